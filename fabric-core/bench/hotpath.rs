//! A deterministic hot-path driver for instruction and syscall counts (not a timer).
//!
//! Both ends of one connection live in this thread, so nothing spins on another process:
//! every `poll` either finds work or is counted as an empty poll. Run it for N and 2N
//! round trips under `valgrind --tool=callgrind` or `strace -c -f` and difference the two
//! counts: setup and teardown fall out and what remains is the cost of N round trips.
//!
//! ```text
//! cargo build --release -p fabric-core --example hotpath
//! target/release/examples/hotpath shm 8 10000     # transport, message size, round trips
//! ```
//!
//! One round trip = A sends `size` bytes, B receives them (its receive was posted before),
//! B reposts its receive and sends `size` bytes back, A receives them. Buffers are as
//! `src/perf.rs` uses them: receives in the caller's page-aligned [`AlignedBuf`]s
//! registered in place, sends from fabric-core memory on shm (rendezvous-capable) and from
//! caller memory elsewhere. It prints the number of empty polls, which must be equal
//! between runs compared (it is on shm, where both rings are in this process).
//!
//! `HOTPATH_ECHO=1`: B replies out of the buffer it received into, as `src/perf.rs`'s
//! responder does (so on shm the reply goes by rendezvous only from fabric-core memory);
//! `HOTPATH_EMPTY=N`: afterwards, N polls of the idle connection (difference two values of
//! N for the cost of one pass that finds nothing, what a waiting side repeats);
//! `HOTPATH_RECV=fabric`: receive buffers are fabric-core memory instead of the caller's.

use std::time::Duration;

use fabric_core::backend::{self, Options};
use fabric_core::{Access, AlignedBuf, Buf, Completion, Error, Region, Transport, TransportKind};

type Conn = Box<dyn Transport>;

fn pair(kind: TransportKind) -> Result<(Conn, Conn), Error> {
    let opts = Options::default();
    let mut l = backend::listen(kind, &opts)?;
    let mut c = backend::connect(l.address(), &opts)?;
    backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10))
}

/// Receive buffers: the caller's `AlignedBuf` (default), or fabric-core memory with
/// `HOTPATH_RECV=fabric` (to compare the two placements at equal code paths).
fn recv_region(c: &mut Conn, len: usize) -> Result<Region, Error> {
    if std::env::var("HOTPATH_RECV").is_ok_and(|v| v == "fabric") {
        return c.register(len, Access::empty());
    }
    match c
        .domain()
        .register_memory(AlignedBuf::new(len.max(1), 4096)?, Access::empty())
    {
        Ok(r) => Ok(r),
        Err(e) => Err(e.into()),
    }
}

fn send_region(c: &mut Conn, len: usize) -> Result<Region, Error> {
    if c.kind() == TransportKind::Shm {
        c.register(len, Access::empty())
    } else {
        match c
            .domain()
            .register_memory(AlignedBuf::new(len.max(1), 4096)?, Access::empty())
        {
            Ok(r) => Ok(r),
            Err(e) => Err(e.into()),
        }
    }
}

/// Polls `rx` (and `tx`, whose send completions are dropped) until `rx` completes one
/// operation; returns its buffer and counts empty polls of `rx`.
fn wait(
    rx: &mut Conn,
    mut tx: Option<&mut Conn>,
    out: &mut [Completion],
    empty: &mut u64,
) -> Result<Buf, Error> {
    loop {
        while let Some(tx) = tx.as_deref_mut() {
            if tx.poll(out)? == 0 {
                break;
            }
            if !out[0].status.is_ok() {
                return Err(Error::Protocol(format!("send failed: {:?}", out[0].status)));
            }
        }
        if rx.poll(out)? > 0 {
            let c = std::mem::take(&mut out[0]);
            if !c.status.is_ok() {
                return Err(Error::Protocol(format!("receive failed: {:?}", c.status)));
            }
            return c
                .buf
                .ok_or_else(|| Error::Protocol("receive without its buffer".into()));
        }
        *empty += 1;
    }
}

/// The buffer of `c`'s send, once it completed.
fn sent_back(c: &mut Conn, out: &mut [Completion]) -> Result<Buf, Error> {
    loop {
        if c.poll(out)? > 0 {
            let d = std::mem::take(&mut out[0]);
            if !d.status.is_ok() {
                return Err(Error::Protocol(format!("send failed: {:?}", d.status)));
            }
            return d
                .buf
                .ok_or_else(|| Error::Protocol("send without its buffer".into()));
        }
    }
}

fn run() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let kind: TransportKind = args.get(1).map_or("shm", |s| s.as_str()).parse()?;
    let size: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let iters: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let (mut a, mut b) = pair(kind)?;
    let (a_tx, a_rx) = (send_region(&mut a, size)?, recv_region(&mut a, size)?);
    let (b_tx, b_rx) = (send_region(&mut b, size)?, recv_region(&mut b, size)?);
    let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
    let mut empty = 0u64;
    let echo = std::env::var("HOTPATH_ECHO").is_ok_and(|v| v == "1");
    let mut a_buf = a_rx.slice(0, size)?;
    let mut b_buf = b_rx.slice(0, size)?;
    for _ in 0..iters {
        b.post_recv(b_buf, 1).map_err(|e| e.error)?;
        a.post_recv(a_buf, 2).map_err(|e| e.error)?;
        a.post_send(a_tx.slice(0, size)?, 3).map_err(|e| e.error)?;
        b_buf = wait(&mut b, Some(&mut a), &mut out, &mut empty)?;
        if echo {
            // As `src/perf.rs`'s responder: the reply goes out of the receive buffer.
            b.post_send(b_buf, 4).map_err(|e| e.error)?;
            a_buf = wait(&mut a, None, &mut out, &mut empty)?;
            b_buf = sent_back(&mut b, &mut out)?;
            continue;
        }
        b.post_send(b_tx.slice(0, size)?, 4).map_err(|e| e.error)?;
        a_buf = wait(&mut a, Some(&mut b), &mut out, &mut empty)?;
    }
    // Let the last send completions drain.
    for _ in 0..1000 {
        if a.in_flight() == 0 && b.in_flight() == 0 {
            break;
        }
        while a.poll(&mut out)? > 0 {}
        while b.poll(&mut out)? > 0 {}
    }
    // `HOTPATH_EMPTY=N`: N polls of an idle connection (the cost of a waiting side's pass).
    let idle: u64 = std::env::var("HOTPATH_EMPTY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for _ in 0..idle {
        if a.poll(&mut out)? != 0 {
            return Err(Error::Protocol(
                "an idle connection completed something".into(),
            ));
        }
    }
    println!("{kind} size {size} round_trips {iters} empty_polls {empty} idle_polls {idle}");
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("hotpath: {e}");
        std::process::exit(1);
    }
}
