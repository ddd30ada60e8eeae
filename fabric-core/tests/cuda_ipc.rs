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

/// Set (to 1) in a child that runs a GPU test over nvlink-p2p's host stand-in driver.
const STANDIN: &str = "FABRIC_CUDA_IPC_STANDIN";

fn gpu_present() -> bool {
    let Err(e) = (backend::entry(TransportKind::CudaIpc).unwrap().probe)() else {
        let cuda = nvlink_p2p::Cuda::init().unwrap();
        let stand_in = loaded_driver_is_stand_in(&cuda);
        if std::env::var(STANDIN).is_ok() {
            assert!(
                stand_in,
                "expected the stand-in driver, got {:?}",
                cuda.library_path()
            );
        } else if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
            assert!(
                !stand_in,
                "NVLINK_P2P_REQUIRE_GPU=1 but a stand-in driver was loaded: {:?}",
                cuda.library_path()
            );
        }
        return true;
    };
    if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("NVLINK_P2P_REQUIRE_GPU=1 but: {e}");
    }
    if e.to_string().contains("no CUDA device") {
        skip("gpu", format_args!("no CUDA device"));
    } else {
        skip("gpu", format_args!("no CUDA driver"));
    }
    false
}

#[test]
fn without_a_driver_everything_is_unavailable() {
    let probe = (backend::entry(TransportKind::CudaIpc).unwrap().probe)();
    if probe.is_ok() {
        // Not a skip where a GPU is required: that is the state the machine must be in.
        println!("not applicable: a CUDA driver and GPU are present");
        return;
    }
    if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("NVLINK_P2P_REQUIRE_GPU=1 but: {:?}", probe.unwrap_err());
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
        // Stay until the exporter drops its transport: it revokes our mapping of its region
        // first (answered while we poll here), then hangs up.
        let r = t.register(8, Access::empty()).unwrap();
        t.post_recv(r.full(), 14).map_err(|e| e.error).unwrap();
        assert_eq!(wait_one(t.as_mut()).status, Status::PeerGone);
        return;
    }
    if !gpu_present() {
        return;
    }
    let stand_in = std::env::var(STANDIN).is_ok();
    let mut l = backend::listen(TransportKind::CudaIpc, &Options::default()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "one_sided_gpu_memory_between_processes",
            "--exact",
            "--nocapture",
        ])
        .env(ROLE, "peer")
        .env_remove(STANDIN)
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
    // Dropping the transport revokes the peer's mapping and frees the memory only once the
    // peer closed it (the stand-in counts frees of memory another process still maps).
    let live = stand_in.then(|| stand_in_counter("fake_live_allocs"));
    drop(region);
    drop(t);
    if let Some(live) = live {
        assert_eq!(
            stand_in_counter("fake_freed_while_mapped"),
            0,
            "memory was freed while the peer still mapped it"
        );
        assert!(
            stand_in_counter("fake_live_allocs") < live,
            "the exported memory was not freed after the peer closed its mapping"
        );
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status}");
}

/// The same two-process test over nvlink-p2p's host stand-in driver, whose legacy IPC opens
/// another process's memory for real (a memfd through /proc) and whose host-to-device copies
/// are staged like the real driver's. Not a GPU check: the GPU run is the test above.
#[test]
fn between_processes_over_the_stand_in_driver() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let Some(dir) = stand_in_dir() else {
        skip(
            "cc",
            format_args!("cannot build the stand-in driver (no C compiler `cc`)"),
        );
        return;
    };
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "one_sided_gpu_memory_between_processes",
            "--exact",
            "--nocapture",
        ])
        .env(STANDIN, "1")
        .env_remove("NVLINK_P2P_REQUIRE_GPU")
        .env("LD_LIBRARY_PATH", &dir)
        .env("FABRIC_CUDA_DEVICE", "0")
        .stdin(Stdio::null())
        .status()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.success(),
        "two-process run over the stand-in failed: {status}"
    );
}

/// Whether the loaded CUDA driver is nvlink-p2p's test stand-in (it exports a marker symbol).
fn loaded_driver_is_stand_in(cuda: &nvlink_p2p::Cuda) -> bool {
    let Some(path) = cuda.library_path() else {
        return false;
    };
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: RTLD_NOLOAD only returns the already loaded library; dlsym has no side effects.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        !h.is_null() && !libc::dlsym(h, c"nvlink_p2p_stand_in_driver".as_ptr()).is_null()
    }
}

/// One of the stand-in's `int f(void)` counters.
fn stand_in_counter(name: &str) -> i32 {
    let sym = std::ffi::CString::new(name).unwrap();
    // SAFETY: RTLD_NOLOAD only returns the already loaded stand-in; the symbol is one of its
    // `int f(void)` counters.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "stand-in not loaded");
        let f = libc::dlsym(h, sym.as_ptr());
        assert!(!f.is_null(), "stand-in lacks {name}");
        let f: extern "C" fn() -> i32 = std::mem::transmute(f);
        f()
    }
}

// ---- the backend's protocol against nvlink-p2p's host-memory stand-in driver ----
// (not a GPU: "device" memory is host memory and IPC opens work within one process, so
// both ends run here; the real two-process run is the GPU test above)

fn stand_in_dir() -> Option<std::path::PathBuf> {
    // One directory per call: tests run in parallel and each removes its own when done.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fabric-cuda-standin-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let c = dir.join("stub.c");
    std::fs::create_dir_all(&dir).ok()?;
    std::fs::write(
        &c,
        include_str!("../../nvlink-p2p/tests/fake_host_driver.c"),
    )
    .ok()?;
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&c)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok.then_some(dir)
}

/// Polls `a` (and keeps `b` moving) until one completion arrives on `a`.
fn wait_pair(a: &mut dyn Transport, b: &mut dyn Transport) -> Completion {
    let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
    let mut other: Vec<Completion> = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if a.poll(&mut out).unwrap() == 1 {
            return std::mem::take(&mut out[0]);
        }
        assert_eq!(b.poll(&mut other).unwrap(), 0);
        assert!(Instant::now() < end, "no completion within 10 s");
    }
}

#[test]
fn protocol_over_the_stand_in_driver() {
    if std::env::var(ROLE).as_deref() == Ok("stand-in") {
        let opts = Options {
            handshake_timeout: Duration::from_secs(1),
            ..Options::default()
        };
        let mut l = backend::listen(TransportKind::CudaIpc, &opts).unwrap();
        let mut c = backend::connect(l.address(), &opts).unwrap();
        let mut a = backend::connect_timeout(c.as_mut(), Duration::from_secs(5)).unwrap();
        let mut b = backend::accept_timeout(l.as_mut(), Duration::from_secs(5)).unwrap();
        assert_eq!(a.kind(), TransportKind::CudaIpc);
        assert!(!a.capabilities().atomics);

        // b exposes a region; a learns its key by a message.
        let target = b
            .register(LEN, Access::REMOTE_READ | Access::REMOTE_WRITE)
            .unwrap();
        target.write_at(0, &pattern(1)).unwrap();
        let keybuf = b.register(64, Access::empty()).unwrap();
        keybuf
            .write_at(0, &target.remote_key().unwrap().pack())
            .unwrap();
        let inbox = a.register(64, Access::empty()).unwrap();
        a.post_recv(inbox.full(), 1).map_err(|e| e.error).unwrap();
        b.post_send(keybuf.slice(0, RemoteKey::PACKED_LEN).unwrap(), 2)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(wait_pair(b.as_mut(), a.as_mut()).status, Status::Success);
        let c = wait_pair(a.as_mut(), b.as_mut());
        assert_eq!(
            (c.op, c.status, c.len),
            (OpKind::Recv, Status::Success, RemoteKey::PACKED_LEN)
        );
        let mut kb = vec![0u8; RemoteKey::PACKED_LEN];
        inbox.read_at(0, &mut kb).unwrap();
        let key = RemoteKey::decode(&kb).unwrap();

        // One-sided read and write at an offset.
        let local = a.register(LEN, Access::empty()).unwrap();
        a.post_read(local.slice(0, 4096).unwrap(), &key, 512, 3)
            .map_err(|e| e.error)
            .unwrap();
        let c = wait_pair(a.as_mut(), b.as_mut());
        assert_eq!(
            (c.op, c.status, c.len),
            (OpKind::Read, Status::Success, 4096)
        );
        let mut got = vec![0u8; 4096];
        local.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(1)[512..512 + 4096]);
        local.write_at(0, &pattern(2)[..100]).unwrap();
        a.post_write(local.slice(0, 100).unwrap(), &key, 7, 4)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(wait_pair(a.as_mut(), b.as_mut()).status, Status::Success);
        let mut got = vec![0u8; 100];
        target.read_at(7, &mut got).unwrap();
        assert_eq!(got, pattern(2)[..100]);

        // Refusals: wrong key value, beyond the region (caught at post), no atomics, no
        // remote access granted.
        let mut forged = key;
        forged.key ^= 1;
        a.post_write(local.slice(0, 8).unwrap(), &forged, 0, 5)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(
            wait_pair(a.as_mut(), b.as_mut()).status,
            Status::RemoteAccess
        );
        let e = a
            .post_read(local.slice(0, 16).unwrap(), &key, LEN as u64 - 8, 6)
            .unwrap_err();
        assert!(matches!(e.error, Error::OutOfBounds { .. }), "{e}");
        let e = a
            .post_atomic(
                local.slice(0, 8).unwrap(),
                &key,
                0,
                fabric_core::AtomicOp::FetchAdd { add: 1 },
                7,
            )
            .unwrap_err();
        assert!(matches!(e.error, Error::Unsupported { .. }), "{e}");
        let mut read_only = key;
        read_only.access = Access::REMOTE_READ.bits();
        read_only.region = 1; // keybuf: registered without remote access, never announced
                              // Waits for an announcement that never comes, then gives up. The wait may start
                              // inside post_read, so the clock starts before it.
        let started = Instant::now();
        a.post_read(local.slice(0, 8).unwrap(), &read_only, 0, 8)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(
            wait_pair(a.as_mut(), b.as_mut()).status,
            Status::RemoteAccess
        );
        assert!(started.elapsed() >= Duration::from_secs(1));

        // Issue 13, item 9: access bits are enforced by the initiator against what the owner
        // announced, not against what the key claims (the mapping itself is read-write).
        let ro = b.register(4096, Access::REMOTE_READ).unwrap();
        ro.write_at(0, &pattern(3)[..4096]).unwrap();
        let ro_key = ro.remote_key().unwrap();
        let mut claims_write = ro_key;
        claims_write.access |= Access::REMOTE_WRITE.bits();
        a.post_write(local.slice(0, 8).unwrap(), &claims_write, 0, 20)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(
            wait_pair(a.as_mut(), b.as_mut()).status,
            Status::RemoteAccess,
            "a write to a read-only region went through on a forged key"
        );
        a.post_read(local.slice(0, 4096).unwrap(), &ro_key, 0, 21)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(wait_pair(a.as_mut(), b.as_mut()).status, Status::Success);
        let mut got = vec![0u8; 4096];
        local.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(3)[..4096]);
        let mut unchanged = vec![0u8; 8];
        ro.read_at(0, &mut unchanged).unwrap();
        assert_eq!(unchanged, pattern(3)[..8]);

        // A message longer than the receive buffer completes it with MessageTooLong.
        let small = a.register(4, Access::empty()).unwrap();
        a.post_recv(small.full(), 9).map_err(|e| e.error).unwrap();
        b.post_send(keybuf.slice(0, 16).unwrap(), 10)
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(wait_pair(b.as_mut(), a.as_mut()).status, Status::Success);
        assert_eq!(
            wait_pair(a.as_mut(), b.as_mut()).status,
            Status::MessageTooLong
        );

        // The peer goes away: a pending receive completes with PeerGone.
        a.post_recv(inbox.full(), 11).map_err(|e| e.error).unwrap();
        drop(b);
        let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
        let end = Instant::now() + Duration::from_secs(5);
        while a.poll(&mut out).unwrap() == 0 {
            assert!(Instant::now() < end, "no PeerGone");
        }
        assert_eq!(out[0].status, Status::PeerGone);
        return;
    }
    let Some(dir) = stand_in_dir() else {
        skip(
            "cc",
            format_args!("cannot build the stand-in driver (no C compiler `cc`)"),
        );
        return;
    };
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "protocol_over_the_stand_in_driver",
            "--exact",
            "--nocapture",
        ])
        .env(ROLE, "stand-in")
        .env("LD_LIBRARY_PATH", &dir)
        .env("FABRIC_CUDA_DEVICE", "0")
        .stdin(Stdio::null())
        .status()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "stand-in run failed: {status}");
}

/// Says why a test did not run — `skipped: <why> [lacks <capability>] [<test>]`, past
/// libtest's output capture so that `cargo test` shows it — or, where the comma-separated
/// `FABRIC_REQUIRE` names the capability, fails the test instead (the policy of the
/// workspace's test helpers; capabilities here: `gpu`, `cc`). With `NVLINK_P2P_REQUIRE_GPU=1`
/// (the GPU machine) the only skips that reach here are for a missing C compiler (the
/// stand-in tests): a named limit of that machine, printed as `limit:`.
fn skip(capability: &str, why: std::fmt::Arguments<'_>) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let required = std::env::var("FABRIC_REQUIRE").unwrap_or_default();
    if required.split(',').any(|c| c.trim() == capability) {
        panic!(
            "this machine must have `{capability}` (FABRIC_REQUIRE={required}), but {why} [{test}]"
        );
    }
    let word = if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
        "limit:"
    } else {
        "skipped:"
    };
    let _ = std::io::Write::write_fmt(
        &mut std::io::stdout(),
        format_args!(
            "{word} {why} [lacks {capability}] [{test}]
"
        ),
    );
}
