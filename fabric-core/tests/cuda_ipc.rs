//! The cuda-ipc backend: without a CUDA driver every entry point is a typed `Unavailable`
//! naming what to install; with a GPU (ci/gpu/run.sh) two processes move GPU memory with
//! one-sided read/write and exchange messages.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{
    Access, Completion, Error, MemoryKinds, OpKind, RemoteKey, Status, Transport, TransportKind,
};

const ROLE: &str = "FABRIC_CUDA_IPC_TEST_ROLE";
const ADDR: &str = "FABRIC_CUDA_IPC_TEST_ADDR";
const LEN: usize = 1 << 20;

fn gpu_present() -> bool {
    let Err(e) = (backend::entry(TransportKind::CudaIpc).unwrap().probe)() else {
        return true;
    };
    if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("NVLINK_P2P_REQUIRE_GPU=1 but: {e}");
    }
    if e.to_string().contains("no CUDA device") {
        println!("skipped: no CUDA device");
    } else {
        println!("skipped: no CUDA driver");
    }
    false
}

#[test]
fn without_a_driver_everything_is_unavailable() {
    let probe = (backend::entry(TransportKind::CudaIpc).unwrap().probe)();
    if probe.is_ok() {
        println!("skipped: a CUDA driver and GPU are present");
        return;
    }
    let check = |e: Error| match e {
        Error::Unavailable { transport, reason } => {
            assert_eq!(transport, TransportKind::CudaIpc);
            assert!(
                reason.contains("libcuda.so.1") || reason.contains("no CUDA device"),
                "{reason}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    };
    check(probe.unwrap_err());
    check(backend::listen(TransportKind::CudaIpc, &Options::default()).unwrap_err());
    check(backend::connect("cuda-ipc:@nobody", &Options::default()).unwrap_err());
}

fn wait_one(t: &mut dyn Transport) -> Completion {
    let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if t.poll(&mut out).unwrap() == 1 {
            return std::mem::take(&mut out[0]);
        }
        assert!(Instant::now() < end, "no completion within 30 s");
        t.wait(Some(Duration::from_millis(10))).unwrap();
    }
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed ^ (i >> 9) as u8)
        .collect()
}

fn send(t: &mut dyn Transport, bytes: &[u8]) {
    let r = t.register(bytes.len(), Access::empty()).unwrap();
    r.write_at(0, bytes).unwrap();
    t.post_send(r.full(), 1).map_err(|e| e.error).unwrap();
    let c = wait_one(t);
    assert_eq!((c.op, c.status), (OpKind::Send, Status::Success));
}

fn recv(t: &mut dyn Transport, max: usize) -> Vec<u8> {
    let r = t.register(max, Access::empty()).unwrap();
    t.post_recv(r.full(), 2).map_err(|e| e.error).unwrap();
    let c = wait_one(t);
    assert_eq!((c.op, c.status), (OpKind::Recv, Status::Success));
    let mut v = vec![0u8; c.len];
    r.read_at(0, &mut v).unwrap();
    v
}

#[test]
fn one_sided_gpu_memory_between_processes() {
    if std::env::var(ROLE).as_deref() == Ok("peer") {
        let addr = std::env::var(ADDR).unwrap();
        let mut c = backend::connect(&addr, &Options::default()).unwrap();
        let mut t = backend::connect_timeout(c.as_mut(), Duration::from_secs(10)).unwrap();
        let key = RemoteKey::decode(&recv(t.as_mut(), 64)).unwrap();
        let local = t.register(LEN, Access::empty()).unwrap();
        // Read the peer's GPU memory.
        t.post_read(local.full(), &key, 0, 10)
            .map_err(|e| e.error)
            .unwrap();
        let c = wait_one(t.as_mut());
        assert_eq!(
            (c.op, c.status, c.len),
            (OpKind::Read, Status::Success, LEN)
        );
        let mut got = vec![0u8; LEN];
        local.read_at(0, &mut got).unwrap();
        assert!(got == pattern(1), "read the wrong bytes");
        // Write into it.
        local.write_at(0, &pattern(2)).unwrap();
        t.post_write(local.full(), &key, 0, 11)
            .map_err(|e| e.error)
            .unwrap();
        let c = wait_one(t.as_mut());
        assert_eq!((c.op, c.status), (OpKind::Write, Status::Success));
        // A forged key is refused by the initiator's checks.
        let mut forged = key;
        forged.key ^= 1;
        t.post_write(local.slice(0, 8).unwrap(), &forged, 0, 12)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(wait_one(t.as_mut()).status, Status::RemoteAccess);
        // No atomics on this transport.
        let e = t
            .post_atomic(
                local.slice(0, 8).unwrap(),
                &key,
                0,
                fabric_core::AtomicOp::FetchAdd { add: 1 },
                13,
            )
            .unwrap_err();
        assert!(matches!(e.error, Error::Unsupported { .. }), "{e}");
        // The message goes after the write landed (in-order transport).
        send(t.as_mut(), b"written");
        return;
    }
    if !gpu_present() {
        return;
    }
    let mut l = backend::listen(TransportKind::CudaIpc, &Options::default()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "one_sided_gpu_memory_between_processes",
            "--exact",
            "--nocapture",
        ])
        .env(ROLE, "peer")
        .env(ADDR, l.address())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut t = backend::accept_timeout(l.as_mut(), Duration::from_secs(30)).unwrap();
    let caps = t.capabilities();
    assert!(caps.one_sided && !caps.atomics);
    assert_eq!(caps.memory_kinds, MemoryKinds::CUDA_DEVICE);
    let region = t
        .register(LEN, Access::REMOTE_READ | Access::REMOTE_WRITE)
        .unwrap();
    region.write_at(0, &pattern(1)).unwrap();
    send(t.as_mut(), &region.remote_key().unwrap().pack());
    assert_eq!(recv(t.as_mut(), 64), b"written");
    let mut got = vec![0u8; LEN];
    region.read_at(0, &mut got).unwrap();
    assert!(got == pattern(2), "the peer's one-sided write did not land");
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status}");
    // The peer is gone: a receive completes with PeerGone, not a hang.
    let r = t.register(8, Access::empty()).unwrap();
    t.post_recv(r.full(), 3).map_err(|e| e.error).unwrap();
    assert_eq!(wait_one(t.as_mut()).status, Status::PeerGone);
}
