//! Remote windows (`Transport::map_remote`): a peer's region mapped into this process and
//! used with copies and atomics, no operation in between.
//!
//! shm maps; the other backends say `Unsupported` (tcp here; verbs in the Soft-RoCE
//! guest's `fabric_transport` run would say the same through the trait's default).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{Access, Completion, Error, RemoteKey, RemoteWindow, Transport, TransportKind};

fn pair(kind: TransportKind) -> (Box<dyn Transport>, Box<dyn Transport>) {
    let opts = Options::default();
    let mut l = backend::listen(kind, &opts).unwrap();
    let mut c = backend::connect(l.address(), &opts).unwrap();
    backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(20)).expect("pair not connected")
}

const ALL: Access = Access::REMOTE_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// Maps `key` on `t`, polling while its announcement is on the way (it travels on the
/// control path, not with the key).
fn map(t: &mut dyn Transport, key: &RemoteKey) -> RemoteWindow {
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = [Completion::default()];
    loop {
        match t.map_remote(key) {
            Ok(w) => return w,
            Err(Error::RemoteKey(_)) if Instant::now() < end => {
                t.poll(&mut out).unwrap();
            }
            Err(e) => panic!("map_remote: {e}"),
        }
    }
}

#[test]
fn shm_window_copies_and_atomics_reach_the_peers_region() {
    let (mut a, mut b) = pair(TransportKind::Shm);
    assert!(a.capabilities().remote_window);
    let r = a.register(4096, ALL).unwrap();
    let w = map(b.as_mut(), &r.remote_key().unwrap());
    assert_eq!(w.len(), 4096);
    assert_eq!(w.access(), ALL);
    // b → a: bytes and a word.
    w.write_at(100, b"stored through the window").unwrap();
    w.store_u64(8, 0x1122_3344_5566_7788).unwrap();
    let mut got = [0u8; 25];
    r.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"stored through the window");
    assert_eq!(r.load_u64(8).unwrap(), 0x1122_3344_5566_7788);
    // a → b: the owner's copies and atomics are seen through the window.
    r.write_at(4000, &[7u8; 96]).unwrap();
    r.store_u64(16, 41).unwrap();
    let mut back = [0u8; 96];
    w.read_at(4000, &mut back).unwrap();
    assert_eq!(back, [7u8; 96]);
    assert_eq!(w.fetch_add_u64(16, 1).unwrap(), 41);
    assert_eq!(r.load_u64(16).unwrap(), 42);
    assert_eq!(w.compare_swap_u64(16, 42, 5).unwrap(), 42);
    assert_eq!(w.compare_swap_u64(16, 42, 6).unwrap(), 5);
    assert_eq!(r.load_u64(16).unwrap(), 5);
    // The window's atomics and the backend's remote atomics are the same words.
    let key = *w.key();
    let src = b.register(8, Access::empty()).unwrap();
    b.post_atomic(
        src.slice(0, 8).unwrap(),
        &key,
        16,
        fabric_core::AtomicOp::FetchAdd { add: 10 },
        1,
    )
    .map_err(|e| e.error)
    .unwrap();
    let mut out = [Completion::default()];
    let end = Instant::now() + Duration::from_secs(10);
    while b.poll(&mut out).unwrap() == 0 {
        assert!(Instant::now() < end, "fetch-add did not complete");
    }
    assert!(out[0].status.is_ok(), "{:?}", out[0].status);
    assert_eq!(w.load_u64(16).unwrap(), 15);
    // Bounds and alignment are checked against the peer's region.
    assert!(matches!(
        w.write_at(4090, &[0; 7]),
        Err(Error::OutOfBounds {
            offset: 4090,
            len: 7,
            region_len: 4096
        })
    ));
    assert!(matches!(w.load_u64(4), Err(Error::Unaligned)));
    assert!(matches!(
        w.store_u64(4096, 1),
        Err(Error::OutOfBounds { .. })
    ));
}

/// Two threads hand numbered payloads back and forth through each other's windows: a
/// payload copied in, then a flag stored (release); the other side loads the flag
/// (acquire) and must find the whole payload of that number. A store published before its
/// payload, or a load that does not order the copy after it, shows up as a torn payload.
#[test]
fn shm_window_flag_publishes_the_bytes_before_it() {
    const ROUNDS: u64 = 5_000;
    const PAYLOAD: usize = 248;
    let (mut a, mut b) = pair(TransportKind::Shm);
    let ra = a.register(4096, ALL).unwrap();
    let rb = b.register(4096, ALL).unwrap();
    let a_to_b = map(a.as_mut(), &rb.remote_key().unwrap());
    let b_to_a = map(b.as_mut(), &ra.remote_key().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // Flag at 0, payload at 64 (another cache line).
    fn wait(r: &fabric_core::Region, i: u64, stop: &AtomicBool) -> bool {
        let end = Instant::now() + Duration::from_secs(30);
        let mut n = 0u32;
        while r.load_u64(0).unwrap() != i {
            n = n.wrapping_add(1);
            if n.is_multiple_of(64) {
                // Tests share the CPUs: let the other side run.
                std::thread::yield_now();
                if Instant::now() > end || stop.load(Ordering::Relaxed) {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
        true
    }
    fn check(r: &fabric_core::Region, i: u64) {
        let mut got = [0u8; PAYLOAD];
        r.read_at(64, &mut got).unwrap();
        let want = (i % 251) as u8;
        assert!(
            got.iter().all(|&x| x == want),
            "round {i}: torn payload {:?}",
            &got[..8]
        );
    }
    let (rb2, stop2) = (rb.clone(), stop.clone());
    let echo = std::thread::spawn(move || {
        for i in 1..=ROUNDS {
            if !wait(&rb2, i, &stop2) {
                return false;
            }
            check(&rb2, i);
            b_to_a.write_at(64, &[(i % 251) as u8; PAYLOAD]).unwrap();
            b_to_a.store_u64(0, i).unwrap();
        }
        true
    });
    let start = Instant::now();
    for i in 1..=ROUNDS {
        a_to_b.write_at(64, &[(i % 251) as u8; PAYLOAD]).unwrap();
        a_to_b.store_u64(0, i).unwrap();
        if !wait(&ra, i, &stop) {
            stop.store(true, Ordering::Relaxed);
            panic!("round {i}: no answer within 30 s");
        }
        check(&ra, i);
    }
    let took = start.elapsed();
    assert!(echo.join().unwrap());
    println!(
        "window round trip ({PAYLOAD} B + flag each way, two threads): {:.3} us mean over {ROUNDS}",
        took.as_secs_f64() * 1e6 / ROUNDS as f64
    );
    drop((a, b));
}

#[test]
fn shm_map_remote_checks_keys_and_access() {
    let (mut a, mut b) = pair(TransportKind::Shm);
    let read_only = a.register(64, Access::REMOTE_READ).unwrap();
    let w = map(b.as_mut(), &read_only.remote_key().unwrap());
    assert_eq!(w.access(), Access::REMOTE_READ);
    assert!(matches!(w.write_at(0, &[1]), Err(Error::AccessDenied(_))));
    assert!(matches!(w.store_u64(0, 1), Err(Error::AccessDenied(_))));
    assert!(matches!(w.fetch_add_u64(0, 1), Err(Error::AccessDenied(_))));
    w.read_at(0, &mut [0u8; 64]).unwrap();
    // A key granting less than the region narrows the window.
    let r = a.register(64, ALL).unwrap();
    let mut narrow = r.remote_key().unwrap();
    narrow.access = Access::REMOTE_ATOMIC.bits();
    let wn = map(b.as_mut(), &narrow);
    assert_eq!(wn.access(), Access::REMOTE_ATOMIC);
    assert!(matches!(
        wn.read_at(0, &mut [0]),
        Err(Error::AccessDenied(_))
    ));
    // A wrong capability value, a wrong generation, an id never announced.
    let mut bad = r.remote_key().unwrap();
    bad.key ^= 1;
    assert!(matches!(b.map_remote(&bad), Err(Error::RemoteKey(_))));
    let mut bad = r.remote_key().unwrap();
    bad.gen = bad.gen.wrapping_add(1);
    assert!(matches!(b.map_remote(&bad), Err(Error::RemoteKey(_))));
    let mut bad = r.remote_key().unwrap();
    bad.region = 60_000;
    assert!(matches!(b.map_remote(&bad), Err(Error::RemoteKey(_))));
    // Another transport's key.
    let mut bad = r.remote_key().unwrap();
    bad.transport = TransportKind::Tcp;
    assert!(matches!(b.map_remote(&bad), Err(Error::Foreign(_))));
}

#[test]
fn shm_window_outlives_the_revocation_and_the_connection() {
    let (mut a, mut b) = pair(TransportKind::Shm);
    let r = a.register(8192, ALL).unwrap();
    let key = r.remote_key().unwrap();
    let w = map(b.as_mut(), &key);
    w.store_u64(0, 9).unwrap();
    assert_eq!(r.load_u64(0).unwrap(), 9);
    assert!(!w.is_revoked());
    drop(r);
    // The revocation arrives on b's control path; b takes it when polled.
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = [Completion::default()];
    while !w.is_revoked() {
        assert!(Instant::now() < end, "revocation not seen within 10 s");
        a.poll(&mut out).unwrap();
        b.poll(&mut out).unwrap();
    }
    assert!(matches!(b.map_remote(&key), Err(Error::RemoteKey(_))));
    // The mapping stays valid memory: the window still copies (into memory no one reads).
    w.write_at(4096, &[3u8; 4096]).unwrap();
    assert_eq!(w.load_u64(0).unwrap(), 9);
    let clone = w.clone();
    drop((a, b, w));
    let mut got = [0u8; 16];
    clone.read_at(4096, &mut got).unwrap();
    assert_eq!(got, [3u8; 16]);
    assert!(clone.is_revoked());
}

#[test]
fn tcp_has_no_remote_window() {
    let (mut a, mut b) = pair(TransportKind::Tcp);
    assert!(!a.capabilities().remote_window);
    let r = a.register(64, ALL).unwrap();
    match b.map_remote(&r.remote_key().unwrap()) {
        Err(Error::Unsupported { transport, .. }) => assert_eq!(transport, TransportKind::Tcp),
        other => panic!("tcp map_remote: {other:?}"),
    }
}
