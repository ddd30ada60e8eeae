//! Cross-process tests of the shm and tcp transports: the test binary re-executes itself
//! (test `child_role`, env `FABRIC_TEST_ROLE`) as the peer.
//!
//! Each suite runs, against a real second process: send/recv of many sizes with content
//! checks, a too-long message, one-sided write/read with content checks, a forged key and an
//! out-of-bounds range, CAS/FAA atomics, a peer killed mid-transfer (every in-flight
//! operation must complete with an error within a bounded time, no hang), and a leak check
//! of `/proc/self/fd` and `/proc/self/maps` around a whole connection's life.

mod support;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::skip;

use fabric_core::backend::{self, Options};
use fabric_core::{
    Access, AtomicOp, Completion, Error, OpKind, RemoteKey, Status, Transport, TransportKind,
};

const ROLE: &str = "FABRIC_TEST_ROLE";
const ADDR: &str = "FABRIC_TEST_ADDR";
const DEADLINE: Duration = Duration::from_secs(20);

/// fd/maps counts are process-wide: every test of this binary runs alone, including the
/// verbs probes and pairs (a probe or a pair opening fds while a suite counts them made
/// `tcp_cross_process_suite` see a "leak" of one fd under AddressSanitizer).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn next(conn: &mut dyn Transport) -> Completion {
    let mut cq = [Completion::default()];
    let start = Instant::now();
    loop {
        if conn.poll(&mut cq).expect("poll") == 1 {
            return std::mem::take(&mut cq[0]);
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no completion within {DEADLINE:?}"
        );
        conn.wait(Some(Duration::from_millis(5))).expect("wait");
    }
}

fn next_ok(conn: &mut dyn Transport, op: OpKind) -> Completion {
    let c = next(conn);
    assert_eq!((c.op, c.status), (op, Status::Success), "{c:?}");
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The peer process. Roles: `echo` (echo every message; the 1-byte message `Q` ends it) and
/// `sink` (publish a key, then never receive: the parent kills it).
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return; // Only meaningful when re-executed by the suites below.
    };
    let addr = std::env::var(ADDR).expect("address");
    let opts = Options::default();
    let mut c = backend::connect(&addr, &opts).expect("connect");
    let mut conn = backend::connect_timeout(c.as_mut(), DEADLINE).expect("connected");
    let target = conn
        .register(
            1 << 16,
            Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        )
        .expect("register target");
    let bufs = conn.register(8 << 20, Access::empty()).expect("register");
    let kb = bufs.slice(0, RemoteKey::PACKED_LEN).unwrap();
    kb.copy_from(&target.remote_key().unwrap().pack()).unwrap();
    conn.post_send(kb, 0).unwrap();
    next_ok(conn.as_mut(), OpKind::Send);
    if role == "sink" {
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let half = 4 << 20;
    conn.post_recv(bufs.slice(0, half).unwrap(), 1).unwrap();
    loop {
        let c = next(conn.as_mut());
        assert_eq!(c.status, Status::Success, "{c:?}");
        match c.op {
            OpKind::Recv => {
                let mut b = c.buf.unwrap();
                if c.len == 1 && b.to_vec()[0] == b'Q' {
                    return;
                }
                b.set_len(c.len).unwrap();
                // Echo from the other half so the receive can be re-posted at once.
                let out = bufs.slice(half, c.len).unwrap();
                out.copy_from(&b.to_vec()).unwrap();
                b.set_len(half).unwrap();
                conn.post_recv(b, 1).unwrap();
                conn.post_send(out, 2).unwrap();
            }
            OpKind::Send => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn spawn(role: &str, addr: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(ADDR, addr)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child")
}

fn accept_child(kind: TransportKind, role: &str) -> (Box<dyn Transport>, Child) {
    let mut l = backend::listen(kind, &Options::default()).expect("listen");
    let mut child = spawn(role, l.address());
    let start = Instant::now();
    let conn = loop {
        if let Some(c) = l.accept().expect("accept") {
            break c;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("child exited early: {st}");
        }
        assert!(start.elapsed() < DEADLINE, "child never connected");
        std::thread::sleep(Duration::from_millis(1));
    };
    (conn, child)
}

fn remote_key(conn: &mut dyn Transport, rx: &fabric_core::Region) -> RemoteKey {
    conn.post_recv(rx.slice(0, 64).unwrap(), 9).unwrap();
    let c = next_ok(conn, OpKind::Recv);
    RemoteKey::decode(&c.buf.unwrap().to_vec()[..c.len]).expect("key decodes")
}

fn messaging(conn: &mut dyn Transport) {
    let tx = conn.register(4 << 20, Access::empty()).unwrap();
    let rx = conn.register(4 << 20, Access::empty()).unwrap();
    for (i, &len) in [1usize, 8, 63, 64, 4096, 65_537, 1 << 20, 3 << 20]
        .iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        tx.write_at(0, &data).unwrap();
        rx.fill(0, len, 0).unwrap();
        conn.post_recv(rx.slice(0, 4 << 20).unwrap(), 10).unwrap();
        conn.post_send(tx.slice(0, len).unwrap(), 11).unwrap();
        let (mut got_send, mut got_recv) = (false, false);
        while !(got_send && got_recv) {
            let c = next(conn);
            assert_eq!(c.status, Status::Success, "{c:?}");
            match c.op {
                OpKind::Send => got_send = true,
                OpKind::Recv => {
                    assert_eq!(c.len, len);
                    let mut back = vec![0u8; len];
                    rx.read_at(0, &mut back).unwrap();
                    assert!(back == data, "echo of {len} bytes differs");
                    got_recv = true;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    if conn.kind() == TransportKind::Verbs {
        return; // RC: a too-long message kills the queue pair (see `verbs_error_semantics`).
    }
    // A message longer than the posted receive: typed error completion, data dropped.
    conn.post_recv(rx.slice(0, 16).unwrap(), 12).unwrap();
    conn.post_send(tx.slice(0, 64).unwrap(), 13).unwrap();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let c = next(conn);
        statuses.push((c.op, c.status));
    }
    assert!(
        statuses.contains(&(OpKind::Recv, Status::MessageTooLong)),
        "{statuses:?}"
    );
    // The connection still works afterwards.
    conn.post_recv(rx.slice(0, 4096).unwrap(), 14).unwrap();
    tx.write_at(0, b"after").unwrap();
    conn.post_send(tx.slice(0, 5).unwrap(), 15).unwrap();
    let mut ok = false;
    for _ in 0..2 {
        let c = next(conn);
        assert!(c.status.is_ok(), "{c:?}");
        if c.op == OpKind::Recv {
            assert_eq!(c.buf.unwrap().to_vec()[..5], *b"after");
            ok = true;
        }
    }
    assert!(ok);
}

fn one_sided(conn: &mut dyn Transport, key: RemoteKey) {
    let caps = conn.capabilities();
    assert!(caps.one_sided && caps.atomics);
    let local = conn.register(1 << 16, Access::empty()).unwrap();
    let data = pattern(40_000, 7);
    local.write_at(0, &data).unwrap();
    conn.post_write(local.slice(0, data.len()).unwrap(), &key, 1000, 20)
        .unwrap();
    next_ok(conn, OpKind::Write);
    local.fill(0, 1 << 16, 0).unwrap();
    conn.post_read(local.slice(0, data.len()).unwrap(), &key, 1000, 21)
        .unwrap();
    next_ok(conn, OpKind::Read);
    let mut back = vec![0u8; data.len()];
    local.read_at(0, &mut back).unwrap();
    assert!(back == data, "read-back differs from what was written");

    // Out of the remote region's bounds: refused before anything is posted.
    let e = conn
        .post_write(local.slice(0, 16).unwrap(), &key, key.len - 8, 22)
        .unwrap_err();
    assert!(matches!(e.error, Error::OutOfBounds { .. }), "{e}");
    assert_eq!(e.buf.len(), 16);
    if conn.kind() == TransportKind::Verbs {
        atomics(conn, key, &local);
        return; // RC: a refused access kills the queue pair (see `verbs_error_semantics`).
    }
    // A forged key: the peer side refuses, the op completes with RemoteAccess.
    let mut forged = key;
    forged.key ^= 1;
    conn.post_write(local.slice(0, 16).unwrap(), &forged, 0, 23)
        .unwrap();
    let c = next(conn);
    assert_eq!((c.op, c.status), (OpKind::Write, Status::RemoteAccess));
    let mut forged = key;
    forged.region += 100;
    conn.post_read(local.slice(0, 16).unwrap(), &forged, 0, 24)
        .unwrap();
    assert_eq!(next(conn).status, Status::RemoteAccess);
    atomics(conn, key, &local);
}

fn atomics(conn: &mut dyn Transport, key: RemoteKey, local: &fabric_core::Region) {
    // Atomics on the word at 8192 (written as zero first).
    local.write_at(0, &[0u8; 8]).unwrap();
    conn.post_write(local.slice(0, 8).unwrap(), &key, 8192, 25)
        .unwrap();
    next_ok(conn, OpKind::Write);
    for i in 0..5u64 {
        let op = AtomicOp::FetchAdd { add: 3 };
        conn.post_atomic(local.slice(64, 8).unwrap(), &key, 8192, op, 26)
            .unwrap();
        let c = next_ok(conn, OpKind::FetchAdd);
        assert_eq!(c.value, 3 * i);
        assert_eq!(c.buf.unwrap().read_u64(), Some(3 * i));
    }
    let cas = |conn: &mut dyn Transport, expect, new| {
        let op = AtomicOp::CompareSwap { expect, new };
        conn.post_atomic(local.slice(64, 8).unwrap(), &key, 8192, op, 27)
            .unwrap();
        next_ok(conn, OpKind::CompareSwap).value
    };
    assert_eq!(cas(conn, 1, 99), 15, "failed CAS returns the current value");
    assert_eq!(
        cas(conn, 15, 99),
        15,
        "successful CAS returns the old value"
    );
    assert_eq!(cas(conn, 99, 7), 99);
    let e = conn
        .post_atomic(
            local.slice(64, 8).unwrap(),
            &key,
            8193,
            AtomicOp::FetchAdd { add: 1 },
            28,
        )
        .unwrap_err();
    assert!(matches!(e.error, Error::Unaligned));
}

fn finish_echo(conn: &mut dyn Transport, mut child: Child) {
    let tx = conn.register(8, Access::empty()).unwrap();
    tx.write_at(0, b"Q").unwrap();
    conn.post_send(tx.slice(0, 1).unwrap(), 99).unwrap();
    next_ok(conn, OpKind::Send);
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "child failed: {st}");
            return;
        }
        assert!(start.elapsed() < DEADLINE, "child did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn peer_killed(kind: TransportKind) {
    let (mut conn, mut child) = accept_child(kind, "sink");
    let rx = conn.register(1 << 20, Access::empty()).unwrap();
    let _key = remote_key(conn.as_mut(), &rx);
    // Fill the pipe: the sink never receives, so these stay in flight.
    let tx = conn.register(1 << 20, Access::empty()).unwrap();
    let mut posted = 0;
    for i in 0..64 {
        match conn.post_send(tx.slice(0, 1 << 20).unwrap(), i) {
            Ok(()) => posted += 1,
            Err(e) => {
                assert!(e.is_would_block(), "{e}");
                break;
            }
        }
    }
    conn.post_recv(rx.slice(0, 1 << 20).unwrap(), 1000).unwrap();
    posted += 1;
    // Let some of it flow, then kill the peer mid-transfer.
    let mut cq: Vec<Completion> = (0..64).map(|_| Completion::default()).collect();
    let mut done = conn.poll(&mut cq).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    let mut errors = 0;
    let mut recv_failed = false;
    while conn.in_flight() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} operations still in flight 5 s after the peer died",
            conn.in_flight()
        );
        let n = conn.poll(&mut cq).unwrap();
        for c in &cq[..n] {
            if c.status == Status::PeerGone {
                errors += 1;
                recv_failed |= c.op == OpKind::Recv;
            }
            assert!(c.buf.is_some(), "every buffer comes back");
        }
        done += n;
        if n == 0 {
            conn.wait(Some(Duration::from_millis(10))).unwrap();
        }
    }
    assert_eq!(done, posted);
    assert!(
        errors > 0 && recv_failed,
        "errors {errors}, recv failed {recv_failed}"
    );
    // New posts fail with a typed error instead of hanging.
    let e = conn.post_send(tx.slice(0, 8).unwrap(), 0).unwrap_err();
    assert!(matches!(e.error, Error::Disconnected(_)), "{e}");
}

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}
fn count_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// The caller holds [`serial`].
fn suite(kind: TransportKind) {
    // Warm up lazily-initialised process state (thread-locals, allocator arenas) first.
    {
        let (mut conn, child) = accept_child(kind, "echo");
        let rx = conn.register(4096, Access::empty()).unwrap();
        let _ = remote_key(conn.as_mut(), &rx);
        finish_echo(conn.as_mut(), child);
    }
    let (fds, maps) = (count_fds(), count_maps());
    {
        let (mut conn, child) = accept_child(kind, "echo");
        assert_eq!(conn.kind(), kind);
        let rx = conn.register(4096, Access::empty()).unwrap();
        let key = remote_key(conn.as_mut(), &rx);
        messaging(conn.as_mut());
        one_sided(conn.as_mut(), key);
        finish_echo(conn.as_mut(), child);
    }
    peer_killed(kind);
    let (fds2, maps2) = (count_fds(), count_maps());
    assert_eq!(fds, fds2, "file descriptors leaked");
    // Allow a little allocator growth, but not a mapping per region or channel. (Under
    // AddressSanitizer, whose allocator maps and quarantines memory of its own, ci/hardening.sh
    // sets FABRIC_SANITIZER and LeakSanitizer checks for leaked regions instead.)
    if std::env::var_os("FABRIC_SANITIZER").is_none() {
        assert!(maps2 <= maps + 2, "mappings leaked: {maps} -> {maps2}");
    }
}

#[test]
fn shm_cross_process_suite() {
    let _g = serial();
    suite(TransportKind::Shm);
}

#[test]
fn tcp_cross_process_suite() {
    let _g = serial();
    suite(TransportKind::Tcp);
}

fn verbs_usable(test: &str) -> bool {
    match (backend::verbs::ENTRY.probe)() {
        Ok(()) => true,
        Err(e) => {
            skip("rdma", format_args!("{test}: {e}"));
            false
        }
    }
}

/// The same suite over RC queue pairs (runs for real in the Soft-RoCE guest).
#[test]
fn verbs_cross_process_suite() {
    let _g = serial();
    if verbs_usable("verbs_cross_process_suite") {
        suite(TransportKind::Verbs);
    }
}

/// RC semantics the capabilities warn about: a refused remote access completes with
/// `RemoteAccess`, and the connection is then failed (every later op errors, none hangs).
#[test]
fn verbs_error_semantics() {
    let _g = serial();
    if !verbs_usable("verbs_error_semantics") {
        return;
    }
    let (mut conn, mut child) = accept_child(TransportKind::Verbs, "sink");
    let rx = conn.register(4096, Access::empty()).unwrap();
    let mut key = remote_key(conn.as_mut(), &rx);
    key.rkey ^= 0x5a5a;
    let local = conn.register(64, Access::empty()).unwrap();
    conn.post_write(local.slice(0, 8).unwrap(), &key, 0, 1)
        .unwrap();
    let c = next(conn.as_mut());
    assert_eq!((c.op, c.status), (OpKind::Write, Status::RemoteAccess));
    let e = conn.post_send(local.slice(0, 8).unwrap(), 2).unwrap_err();
    assert!(matches!(e.error, Error::Disconnected(_)), "{e}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Both ends of one verbs connection in this process.
fn verbs_pair() -> (Box<dyn Transport>, Box<dyn Transport>) {
    let opts = Options::default();
    let mut l = backend::listen(TransportKind::Verbs, &opts).expect("listen");
    let mut c = backend::connect(l.address(), &opts).expect("connect");
    let (mut a, mut b) = (None, None);
    let start = Instant::now();
    while a.is_none() || b.is_none() {
        assert!(start.elapsed() < DEADLINE, "verbs pair not connected");
        if a.is_none() {
            a = l.accept().expect("accept");
        }
        if b.is_none() {
            b = c.poll_connect().expect("poll_connect");
        }
    }
    (a.unwrap(), b.unwrap())
}

/// Held posts go out behind one doorbell per 32 (issue 12), most of them unsignalled; every
/// operation still gets its own completion, in post order, and the messages arrive in order.
#[test]
fn verbs_held_posts_complete_each_in_order() {
    let _g = serial();
    if !verbs_usable("verbs_held_posts_complete_each_in_order") {
        return;
    }
    let (mut a, mut b) = verbs_pair();
    const N: usize = 70;
    let rx = b.register(8 * N, Access::LOCAL_WRITE).unwrap();
    b.hold_posts();
    for i in 0..N {
        b.post_recv(rx.slice(8 * i, 8).unwrap(), i as u64).unwrap();
    }
    b.flush_posts();
    let tx = a.register(8 * N, Access::empty()).unwrap();
    for i in 0..N {
        tx.write_at(8 * i, &(i as u64).to_le_bytes()).unwrap();
    }
    // Twice: once flushed explicitly, once by the poll.
    for round in 0..2 {
        a.hold_posts();
        for i in 0..N / 2 {
            let k = round * N / 2 + i;
            a.post_send(tx.slice(8 * k, 8).unwrap(), k as u64).unwrap();
        }
        if round == 0 {
            a.flush_posts();
        }
        for i in 0..N / 2 {
            let c = next_ok(a.as_mut(), OpKind::Send);
            assert_eq!(
                c.wr_id,
                (round * N / 2 + i) as u64,
                "send completions in post order"
            );
        }
    }
    assert_eq!(a.in_flight(), 0);
    for i in 0..N {
        let c = next_ok(b.as_mut(), OpKind::Recv);
        assert_eq!(c.wr_id, i as u64);
        let got = c.buf.unwrap().to_vec();
        assert_eq!(got[..8], (i as u64).to_le_bytes(), "message {i} in order");
    }
}

/// An error completion in a held batch names the failing operation: those before it
/// complete successfully (unsignalled, retired by it), it fails with its own status, and
/// everything after it fails (the RC queue pair is in the error state).
#[test]
fn verbs_held_batch_error_names_the_failing_op() {
    let _g = serial();
    if !verbs_usable("verbs_held_batch_error_names_the_failing_op") {
        return;
    }
    let (mut a, mut b) = verbs_pair();
    let target = b
        .register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let key = target.remote_key().expect("a remote key");
    let mut bad = key;
    bad.rkey ^= 0x5a5a;
    let src = a.register(64, Access::empty()).unwrap();
    const N: u64 = 24;
    const FAILING: u64 = 10;
    a.hold_posts();
    for i in 0..N {
        let k = if i == FAILING { &bad } else { &key };
        a.post_write(src.slice(0, 8).unwrap(), k, 8 * i, i).unwrap();
    }
    a.flush_posts();
    let mut seen = Vec::new();
    for _ in 0..N {
        let c = next(a.as_mut());
        assert_eq!(c.op, OpKind::Write);
        seen.push((c.wr_id, c.status));
    }
    for (i, &(id, status)) in seen.iter().enumerate().take(FAILING as usize) {
        assert_eq!((id, status), (i as u64, Status::Success), "{seen:?}");
    }
    assert_eq!(
        seen[FAILING as usize],
        (FAILING, Status::RemoteAccess),
        "{seen:?}"
    );
    let mut ids: Vec<u64> = seen.iter().map(|s| s.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..N).collect::<Vec<_>>(), "each op completes once");
    assert!(
        seen[FAILING as usize + 1..].iter().all(|s| !s.1.is_ok()),
        "{seen:?}"
    );
}
