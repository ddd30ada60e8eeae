//! Deterministic instruction counts of one ping-pong side driven three ways (four variants): the bare
//! [`Transport`], a [`Worker`] endpoint, and an [`AsyncWorker`] endpoint (`.await`). Not a
//! timer: run it under `valgrind --tool=callgrind` for N and 2N round trips and difference
//! the totals (`fabric-core/bench/callgrind-async.sh` does), so setup falls out and what
//! remains is the cost of N round trips of side A plus side B's echo, which is the same
//! bare-transport code in every variant. The difference between two variants is what
//! side A's engine costs per round trip.
//!
//! ```text
//! cargo build --release -p fabric-core --features tokio --example async_hotpath
//! target/release/examples/async_hotpath async 8 10000   # variant, size, round trips
//! ```
//!
//! Variants: `bare`, `worker`, `async` (A awaits its send, then the reply),
//! `async_reply_first` (A awaits the reply, then the send, which is complete by then) and
//! `async_post` (as `async`, the receive and the send posted by one `AsyncWorker::recv_send`);
//! `empty_bare` and `empty_worker` only poll with nothing to find (a receive posted, no
//! message): the cost of an empty poll (the worker parks the endpoint after
//! `worker::PARK_AFTER` of them and then asks its epoll).
//!
//! Both sides live in this thread (shm), so nothing waits for another process: B echoes
//! between A's send and A's receive, and every operation A awaits is complete when it is
//! first polled. The program fails if one was not (`Pending`), and prints B's empty polls,
//! which must be equal between runs compared.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use fabric_core::async_worker::{AsyncOptions, AsyncWorker};
use fabric_core::backend::{self, Options};
use fabric_core::{
    Access, Completion, Domain, Error, Event, Region, Transport, TransportKind, Worker,
};

type Conn = Box<dyn Transport>;

/// A (in `domain`) and B (its own domain), connected over shm.
fn pair(domain: &Domain) -> Result<(Conn, Conn), Error> {
    let mut l = domain.listen()?;
    let mut c = backend::connect(l.address(), &Options::default())?;
    backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10))
}

fn failed(what: &str, c: &Completion) -> Error {
    Error::Protocol(format!("{what} failed: {:?}", c.status))
}

/// Side B: one echo (its receive was posted before): waits for the message, posts the
/// receive again and sends `size` bytes back, and waits for its send.
struct Echo {
    b: Conn,
    tx: Region,
    out: Vec<Completion>,
    size: usize,
    empty: u64,
}

impl Echo {
    fn once(&mut self) -> Result<(), Error> {
        let got = loop {
            if self.b.poll(&mut self.out)? > 0 {
                break std::mem::take(&mut self.out[0]);
            }
            self.empty += 1;
        };
        if !got.status.is_ok() {
            return Err(failed("B's receive", &got));
        }
        let buf = got
            .buf
            .ok_or(Error::Foreign("a receive without its buffer"))?;
        self.b.post_recv(buf, 1).map_err(|e| e.error)?;
        self.b
            .post_send(self.tx.slice(0, self.size)?, 2)
            .map_err(|e| e.error)?;
        loop {
            if self.b.poll(&mut self.out)? > 0 {
                let c = std::mem::take(&mut self.out[0]);
                if !c.status.is_ok() {
                    return Err(failed("B's send", &c));
                }
                return Ok(());
            }
        }
    }
}

/// Polls a future once; it must be ready (everything it waits for has happened).
fn ready<F: Future>(f: F) -> Result<F::Output, Error> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Ok(v),
        Poll::Pending => Err(Error::Protocol(
            "an awaited operation was not complete at its first poll".into(),
        )),
    }
}

fn run() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let variant = args.get(1).map_or("async", |s| s.as_str()).to_string();
    let size: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let iters: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let domain = Domain::open(TransportKind::Shm, &Options::default())?;
    let (a, mut b) = pair(&domain)?;
    let a_tx = domain.register(size, Access::empty())?;
    let a_rx = domain.register(size, Access::empty())?;
    let b_rx = b.register(size, Access::empty())?;
    let tx = b.register(size, Access::empty())?;
    b.post_recv(b_rx.slice(0, size)?, 1).map_err(|e| e.error)?;
    let mut echo = Echo {
        b,
        tx,
        out: (0..1).map(|_| Completion::default()).collect(),
        size,
        empty: 0,
    };
    let mut rbuf = a_rx.slice(0, size)?;
    match variant.as_str() {
        "bare" => {
            let mut a = a;
            let mut out: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
            for _ in 0..iters {
                a.post_recv(rbuf, 3).map_err(|e| e.error)?;
                a.post_send(a_tx.slice(0, size)?, 4).map_err(|e| e.error)?;
                echo.once()?;
                let mut got = None;
                let mut sent = false;
                while got.is_none() || !sent {
                    let n = a.poll(&mut out)?;
                    for c in &mut out[..n] {
                        let c = std::mem::take(c);
                        if !c.status.is_ok() {
                            return Err(failed("A's operation", &c));
                        }
                        if c.wr_id == 3 {
                            got = c.buf;
                        } else {
                            sent = true;
                        }
                    }
                }
                rbuf = got.ok_or(Error::Foreign("a receive without its buffer"))?;
            }
        }
        "worker" => {
            let mut w = Worker::new(&domain)?;
            let ep = w.add(a)?;
            let mut out: Vec<Event> = (0..2).map(|_| Event::default()).collect();
            for _ in 0..iters {
                w.post_recv(ep, rbuf, 3).map_err(|e| e.error)?;
                w.post_send(ep, a_tx.slice(0, size)?, 4)
                    .map_err(|e| e.error)?;
                echo.once()?;
                let mut got = None;
                let mut sent = false;
                while got.is_none() || !sent {
                    let n = w.poll(&mut out)?;
                    for ev in &mut out[..n] {
                        let c = std::mem::take(&mut ev.completion);
                        if !c.status.is_ok() {
                            return Err(failed("A's operation", &c));
                        }
                        if c.wr_id == 3 {
                            got = c.buf;
                        } else {
                            sent = true;
                        }
                    }
                }
                rbuf = got.ok_or(Error::Foreign("a receive without its buffer"))?;
            }
        }
        "async" | "async_reply_first" | "async_post" => {
            let reply_first = variant == "async_reply_first";
            let together = variant == "async_post";
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::Protocol(format!("tokio runtime: {e}")))?;
            let _in_rt = rt.enter();
            let w = AsyncWorker::with_options(&domain, AsyncOptions::default())?;
            let ep = w.add(a)?;
            for _ in 0..iters {
                let (recv, send) = if together {
                    // both under one lock
                    w.recv_send(ep, rbuf, a_tx.slice(0, size)?)
                } else {
                    let recv = w.recv(ep, rbuf);
                    (recv, w.send(ep, a_tx.slice(0, size)?))
                };
                if reply_first {
                    // The reply first: its poll of the worker also finds the send's
                    // completion, which the send's own await then only picks up.
                    echo.once()?;
                    let (r, b) = ready(recv)?;
                    r?;
                    rbuf = b;
                    ready(send)?.0?;
                } else {
                    ready(send)?.0?;
                    echo.once()?;
                    let (r, b) = ready(recv)?;
                    r?;
                    rbuf = b;
                }
            }
            let st = w.stats();
            println!("async driver: {} arms, {} sleeps", st.arms, st.sleeps);
        }
        "empty_bare" => {
            // empty polls only (instructions per empty poll)
            let mut a = a;
            let mut out: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
            a.post_recv(rbuf, 3).map_err(|e| e.error)?;
            for _ in 0..iters {
                if a.poll(&mut out)? != 0 {
                    return Err(Error::Protocol("a poll found work".into()));
                }
            }
        }
        "empty_worker" => {
            let mut w = Worker::new(&domain)?;
            let ep = w.add(a)?;
            let mut out: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
            w.post_recv(ep, rbuf, 3).map_err(|e| e.error)?;
            for _ in 0..iters {
                if w.poll_completions(&mut out)? != 0 {
                    return Err(Error::Protocol("a poll found work".into()));
                }
            }
        }
        v => {
            return Err(Error::InvalidArgument(format!(
                "variant {v:?}: bare, worker, async, async_reply_first, async_post, empty_bare or \
                 empty_worker"
            )))
        }
    }
    println!(
        "{variant} size {size} round_trips {iters} empty_polls_b {}",
        echo.empty
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("async_hotpath: {e}");
        std::process::exit(1);
    }
}
