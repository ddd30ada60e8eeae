//! `AsyncCompletionQueue` (feature `tokio`) against a real verbs device (Soft-RoCE in the
//! guest), on every layout present: completions awaited with their buffers while another
//! task and another thread post; the window between an empty poll and the arm; the CPU time
//! of an idle await. Without a device each test prints `skipped: no RDMA device` and passes
//! — unless `FABRIC_REQUIRE` (comma-separated) lists `rdma`, then it fails.
mod common;
use common::*;
use ibverbs_safe::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The layouts present; none is a failure when `FABRIC_REQUIRE` lists `rdma`.
fn layouts_required(test: &str) -> Vec<Layout> {
    let l = layouts(test);
    let required = std::env::var("FABRIC_REQUIRE")
        .is_ok_and(|v| v.split(',').any(|c| c.trim().eq_ignore_ascii_case("rdma")));
    assert!(
        !(l.is_empty() && required),
        "{test}: FABRIC_REQUIRE lists `rdma`, but no RDMA device is usable"
    );
    l
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap()
}

/// Runs `f` on another thread; a hang (a lost completion) fails the test after `secs`.
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {secs} s (a lost completion?)")
        }
        Err(_) => panic!("the test body panicked (see above)"),
    }
}

fn thread_cpu() -> Duration {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `u` has room for a rusage; RUSAGE_THREAD only writes it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: getrusage succeeded and filled it.
    let u = unsafe { u.assume_init() };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Side `a`: a plain CQ. Side `b`: its QP reports to `acq` (send and receive).
struct Pair {
    pda: ProtectionDomain,
    cqa: CompletionQueue,
    qa: QueuePair<Rc>,
    pdb: ProtectionDomain,
    qb: QueuePair<Rc>,
    acq: AsyncCompletionQueue,
}

/// Call inside a runtime. `pre_b` receives of 64 bytes each are posted on `b` (wr_id = index)
/// before connecting, from the returned region.
fn pair(l: &Layout, pre_b: usize) -> (Pair, MemoryRegion) {
    let o = Opts {
        depth: 256,
        ..Opts::default()
    };
    let (pda, pdb) = (l.a.alloc_pd().unwrap(), l.b.alloc_pd().unwrap());
    let cqa = l.a.create_cq(512).unwrap();
    let acq = l.b.create_async_cq(512).unwrap();
    let a = builder(&pda, &cqa, l.gid, &o).build_rc().unwrap();
    let mut b = builder(&pdb, acq.cq(), l.gid, &o).build_rc().unwrap();
    let mut rx = pdb.alloc_region(64 * pre_b.max(1)).unwrap();
    for i in 0..pre_b {
        b.post_recv(rx.slice(i * 64..(i + 1) * 64).unwrap(), i as u64)
            .unwrap();
    }
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let qa = a.connect(&eb).unwrap();
    let qb = b.connect(&ea).unwrap();
    (
        Pair {
            pda,
            cqa,
            qa,
            pdb,
            qb,
            acq,
        },
        rx,
    )
}

/// Sends `msg` from `a` and polls `a`'s CQ until the send completed. On RC the responder
/// writes its receive completion before it acknowledges, so when this returns, `b`'s receive
/// completion is in `b`'s CQ.
fn send_and_wait(qa: &mut QueuePair<Rc>, cqa: &mut CompletionQueue, tx: &MrSlice, msg: &[u8]) {
    tx.write_from(0, msg).unwrap();
    qa.send(tx.slice(..msg.len()).unwrap(), 1).unwrap();
    let mut c = Completion::buffer(1);
    cqa.poll_exact(&mut c, 1, T).unwrap();
    c[0].result().unwrap();
}

/// One task owns `b`'s QP and posts SENDs to `a`; another owns `b`'s async CQ and awaits the
/// send completions of those and the receive completions (with their buffers) of what a
/// thread that owns `a` sends meanwhile. No lock anywhere.
#[test]
fn rxe_async_await_completions_while_another_task_and_a_thread_post() {
    const N: usize = 64; // a -> b
    const M: usize = 64; // b -> a
    for l in layouts_required("rxe_async_await_completions_while_another_task_and_a_thread_post") {
        within(300, move || {
            runtime().block_on(async move {
                let (p, rx) = pair(&l, N);
                let Pair {
                    pda,
                    mut cqa,
                    mut qa,
                    pdb,
                    mut qb,
                    mut acq,
                } = p;
                // Thread: owns `a`; receives M, sends N.
                let mut arx = pda.alloc_region(64 * M).unwrap();
                for i in 0..M {
                    qa.post_recv(arx.slice(i * 64..(i + 1) * 64).unwrap(), 1000 + i as u64)
                        .unwrap();
                }
                let mut atx = pda.alloc_region(64 * N).unwrap();
                let atx = atx.slice(..).unwrap();
                let thread_a = std::thread::spawn(move || {
                    let mut got = vec![];
                    let mut sent = 0;
                    let mut out = Completion::buffer(16);
                    for i in 0..N {
                        let s = atx.slice(i * 64..(i + 1) * 64).unwrap();
                        s.write_from(0, format!("a->b {i:03}").as_bytes()).unwrap();
                        qa.send(s.slice(..8).unwrap(), i as u64).unwrap();
                        if i % 8 == 7 {
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                    let t0 = Instant::now();
                    while sent < N || got.len() < M {
                        assert!(t0.elapsed() < Duration::from_secs(120), "thread a: timeout");
                        let n = cqa.poll(&mut out).unwrap();
                        for c in &mut out[..n] {
                            c.result().unwrap();
                            match c.queue() {
                                Some(QueueKind::Send) => sent += 1,
                                _ => got.push(c.take_buf().unwrap().to_vec().unwrap()),
                            }
                        }
                        if n == 0 {
                            std::thread::yield_now();
                        }
                    }
                    (got, qa, cqa)
                });
                // Task: owns `b`'s QP, sends M.
                let mut btx = pdb.alloc_region(64 * M).unwrap();
                let btx = btx.slice(..).unwrap();
                let poster = tokio::spawn(async move {
                    for i in 0..M {
                        let s = btx.slice(i * 64..(i + 1) * 64).unwrap();
                        s.write_from(0, format!("b->a {i:03}").as_bytes()).unwrap();
                        qb.send(s.slice(..8).unwrap(), 500 + i as u64).unwrap();
                        tokio::task::yield_now().await;
                    }
                    qb
                });
                // Task: owns the async CQ, awaits everything.
                let awaiter = tokio::spawn(async move {
                    let (mut recvd, mut sends) = (vec![None; N], 0);
                    let mut out = Completion::buffer(16);
                    while sends < M || recvd.iter().any(Option::is_none) {
                        let n = acq.next_batch(&mut out).await.unwrap();
                        assert!(n > 0);
                        for c in &mut out[..n] {
                            c.result().unwrap();
                            match c.queue() {
                                Some(QueueKind::Send) => {
                                    assert_eq!(c.wr_id(), 500 + sends as u64, "in order");
                                    assert_eq!(c.take_buf().unwrap().len(), 8);
                                    sends += 1;
                                }
                                Some(QueueKind::Recv) => {
                                    let i = c.wr_id() as usize;
                                    assert_eq!(c.byte_len(), 8);
                                    let b = c.take_buf().expect("the receive buffer comes back");
                                    recvd[i] = Some(b.to_vec().unwrap()[..8].to_vec());
                                }
                                q => panic!("unexpected completion queue {q:?}"),
                            }
                        }
                    }
                    (recvd, acq)
                });
                let (recvd, acq) = awaiter.await.unwrap();
                let qb = poster.await.unwrap();
                let (got, qa, cqa) = thread_a.join().unwrap();
                for (i, r) in recvd.iter().enumerate() {
                    assert_eq!(r.as_deref(), Some(format!("a->b {i:03}").as_bytes()));
                }
                for (i, g) in got.iter().enumerate() {
                    assert_eq!(&g[..8], format!("b->a {i:03}").as_bytes());
                }
                assert_eq!(rx.outstanding(), 0, "every receive handle came back");
                assert_eq!((qb.send_in_flight(), qb.recv_in_flight()), (0, 0));
                note(format_args!(
                    "{}: {N} receives + {M} sends awaited: {:?}",
                    l.name,
                    acq.stats()
                ));
                drop((qa, cqa, qb, acq));
            });
        });
    }
}

/// Each round makes `b`'s receive completion land after the poll that found the CQ empty
/// and before the arm (a hook in that window sends from `a` and waits for the send to
/// complete); only the re-poll after arming can see it, since the arm raises no event for
/// a completion already there. A second message per round arrives while armed, so its event
/// disarms the queue and the next round opens the window again.
#[test]
fn rxe_async_no_completion_is_lost_between_poll_and_arm() {
    let rounds: u64 = std::env::var("RXE_ASYNC_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for l in layouts_required("rxe_async_no_completion_is_lost_between_poll_and_arm") {
        within(600, move || {
            runtime().block_on(async move {
                let (p, mut rx) = pair(&l, 0);
                let Pair {
                    pda,
                    cqa,
                    qa,
                    pdb: _pdb,
                    mut qb,
                    mut acq,
                } = p;
                let mut tx = pda.alloc_region(64).unwrap();
                let tx = tx.slice(..).unwrap();
                // The test's own lock: the hook (in the window) and the test body both send
                // from `a`.
                let a = Arc::new(Mutex::new((qa, cqa)));
                let round = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let (ha, htx, hround) = (a.clone(), tx.clone(), round.clone());
                acq.set_before_arm_hook(Some(Box::new(move || {
                    let i = hround.load(std::sync::atomic::Ordering::SeqCst);
                    let mut g = ha.lock().unwrap();
                    let (qa, cqa) = &mut *g;
                    send_and_wait(qa, cqa, &htx, format!("win {i:05}").as_bytes());
                })));
                let rxs = rx.slice(..).unwrap();
                for i in 0..rounds {
                    round.store(i, std::sync::atomic::Ordering::SeqCst);
                    qb.post_recv(rxs.slice(0..32).unwrap(), 2 * i).unwrap();
                    qb.post_recv(rxs.slice(32..64).unwrap(), 2 * i + 1).unwrap();
                    let mut c = acq.next_completion().await.unwrap();
                    c.result().unwrap();
                    assert_eq!(c.wr_id(), 2 * i);
                    let b = c.take_buf().unwrap();
                    assert_eq!(&b.to_vec().unwrap()[..9], format!("win {i:05}").as_bytes());
                    {
                        let mut g = a.lock().unwrap();
                        let (qa, cqa) = &mut *g;
                        send_and_wait(qa, cqa, &tx, format!("arm {i:05}").as_bytes());
                    }
                    let mut c = acq.next_completion().await.unwrap();
                    c.result().unwrap();
                    assert_eq!(c.wr_id(), 2 * i + 1);
                    assert_eq!(
                        &c.take_buf().unwrap().to_vec().unwrap()[..9],
                        format!("arm {i:05}").as_bytes()
                    );
                }
                let s = acq.stats();
                note(format_args!(
                    "{}: poll/arm window, {rounds} rounds: {s:?}",
                    l.name
                ));
                // Every round's first message landed in the window (the hook waited for it),
                // so every arm was followed by a re-poll that found it.
                assert_eq!(s.arms, rounds, "{s:?}");
                assert!(s.rearm_hits >= rounds * 9 / 10, "{s:?}");
                drop(rxs);
                assert_eq!(rx.outstanding(), 0, "every receive handle came back");
                acq.set_before_arm_hook(None);
                drop((acq, qb, a));
            });
        });
    }
}

/// Polls `fut` once with a waker that does nothing.
fn poll_once<F: std::future::Future>(fut: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
    struct Nop;
    impl std::task::Wake for Nop {
        fn wake(self: Arc<Self>) {}
    }
    let waker = std::task::Waker::from(Arc::new(Nop));
    fut.poll(&mut std::task::Context::from_waker(&waker))
}

/// An awaiting task sleeps in the reactor: its thread's CPU time over a 1 s wait for a
/// receive (from the moment it went to sleep, armed, to its wake-up with the completion)
/// stays under 5% of the wait — in practice a few scheduler ticks at most. Control: a
/// busy-polling wait of 200 ms on the same meter.
#[test]
fn rxe_async_idle_await_costs_almost_no_cpu() {
    for l in layouts_required("rxe_async_idle_await_costs_almost_no_cpu") {
        let name = l.name.clone();
        let (idle, wall, busy) = within(300, move || {
            runtime().block_on(async move {
                let (p, rx) = pair(&l, 1);
                let Pair {
                    pda,
                    mut cqa,
                    mut qa,
                    pdb: _pdb,
                    qb,
                    mut acq,
                } = p;
                let mut tx = pda.alloc_region(64).unwrap();
                let tx = tx.slice(..).unwrap();
                let sender = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(1000));
                    send_and_wait(&mut qa, &mut cqa, &tx, b"late");
                    (qa, cqa)
                });
                let (wall, idle, mut c) = {
                    let mut fut = std::pin::pin!(acq.next_completion());
                    assert!(poll_once(fut.as_mut()).is_pending(), "armed and asleep");
                    let (t0, c0) = (Instant::now(), thread_cpu());
                    let c = fut.await.unwrap();
                    (t0.elapsed(), thread_cpu() - c0, c)
                };
                c.result().unwrap();
                assert_eq!(&c.take_buf().unwrap().to_vec().unwrap()[..4], b"late");
                let _a = sender.join().unwrap();
                assert!(wall >= Duration::from_millis(800), "{wall:?}");
                let mut out = Completion::buffer(1);
                let c0 = thread_cpu();
                let r = acq
                    .cq_mut()
                    .poll_blocking(&mut out, Duration::from_millis(200));
                assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
                let busy = thread_cpu() - c0;
                drop((rx, qb, acq));
                (idle, wall, busy)
            })
        });
        note(format_args!(
            "{name}: idle await {:.3} ms CPU over {:.0} ms; busy poll {:.1} ms CPU over 200 ms",
            idle.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3,
            busy.as_secs_f64() * 1e3
        ));
        assert!(
            busy >= Duration::from_millis(10),
            "the meter sees a busy wait: {busy:?}"
        );
        assert!(
            idle < wall / 20,
            "idle await burnt {idle:?} CPU over {wall:?}"
        );
    }
}
