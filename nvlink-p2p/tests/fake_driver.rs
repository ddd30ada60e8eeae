//! The probe against a stand-in `libcuda.so` built here from a few lines of C: a driver
//! that lacks base entry points, reports no device, fails `cuInit`, is too old for VMM, or
//! lacks a newer entry point. Each must be a typed error, never a panic (cudarc alone would
//! panic on a missing symbol). Each case runs in a child process with `LD_LIBRARY_PATH`
//! pointing at the stand-in (the driver is probed once per process).
mod common;

use common::*;
use nvlink_p2p::{Cuda, DriverVersion, Error};

/// Runs `test` in a child with the stand-in driver and `envs`; true if it ran.
fn run_with(stub: Stub, test: &str, envs: &[(&str, &str)]) -> bool {
    let Some(dir) = stand_in(stub) else {
        skip(format_args!(
            "cannot build the stand-in driver (no C compiler `cc`, or no writable temp dir)"
        ));
        return false;
    };
    let mut all = vec![("LD_LIBRARY_PATH", dir.to_str().unwrap())];
    all.extend_from_slice(envs);
    expect_success(spawn_child(test, "fake", None, &all), test);
    true
}

fn run_with_fake(test: &str, minimal: bool, envs: &[(&str, &str)]) -> bool {
    run_with(if minimal { Stub::Minimal } else { Stub::Full }, test, envs)
}

fn in_child() -> bool {
    role().as_deref() == Some("fake")
}

#[test]
fn driver_without_base_symbols_is_missing_symbol() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        assert!(
            matches!(
                e,
                Error::MissingSymbol {
                    symbol: "cuDriverGetVersion",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("upgrade the NVIDIA driver"), "{e}");
        return;
    }
    run_with_fake("driver_without_base_symbols_is_missing_symbol", true, &[]);
}

#[test]
fn init_reporting_no_device_is_no_device() {
    if in_child() {
        assert!(matches!(Cuda::init(), Err(Error::NoDevice)));
        return;
    }
    run_with_fake(
        "init_reporting_no_device_is_no_device",
        false,
        &[("FAKE_CUDA_INIT", "100")],
    );
}

#[test]
fn zero_devices_is_no_device() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        assert!(matches!(e, Error::NoDevice), "{e:?}");
        return;
    }
    run_with_fake(
        "zero_devices_is_no_device",
        false,
        &[("FAKE_CUDA_COUNT", "0")],
    );
}

#[test]
fn failing_init_is_a_driver_error() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        match &e {
            Error::Driver { call, code, name } => {
                assert_eq!(
                    (*call, *code, name.as_str()),
                    ("cuInit", 999, "CUDA_ERROR_UNKNOWN")
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.to_string(), "cuInit failed: CUDA_ERROR_UNKNOWN (999)");
        return;
    }
    run_with_fake(
        "failing_init_is_a_driver_error",
        false,
        &[("FAKE_CUDA_INIT", "999")],
    );
}

#[test]
fn old_driver_refuses_newer_features_without_calling_them() {
    if in_child() {
        let cuda = stand_in_cuda();
        assert_eq!(cuda.driver_version(), DriverVersion(10010));
        assert_eq!(cuda.device_count(), 2);
        let e = cuda
            .require("VMM shareable handles", DriverVersion::VMM, "cuMemCreate")
            .unwrap_err();
        assert!(
            matches!(e, Error::DriverTooOld { needed, found, .. } if needed == DriverVersion::VMM && found == DriverVersion(10010)),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("needs CUDA driver 10.2 or newer"),
            "{e}"
        );
        return;
    }
    run_with_fake(
        "old_driver_refuses_newer_features_without_calling_them",
        false,
        &[("FAKE_CUDA_VERSION", "10010"), ("FAKE_CUDA_COUNT", "2")],
    );
}

#[test]
fn missing_newer_entry_point_and_failing_context_are_typed() {
    if in_child() {
        let cuda = stand_in_cuda();
        let e = cuda
            .require(
                "DMA-BUF export",
                DriverVersion::DMA_BUF,
                "cuMemGetHandleForAddressRange",
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::MissingSymbol {
                    symbol: "cuMemGetHandleForAddressRange",
                    ..
                }
            ),
            "{e:?}"
        );
        // The stand-in fails every other call: opening a device is a typed error.
        let e = cuda.device(0).unwrap_err();
        assert!(matches!(e, Error::Driver { code: 999, .. }), "{e:?}");
        assert!(matches!(
            cuda.device(1),
            Err(Error::DeviceOutOfRange {
                ordinal: 1,
                count: 1
            })
        ));
        return;
    }
    run_with_fake(
        "missing_newer_entry_point_and_failing_context_are_typed",
        false,
        &[],
    );
}

// ---- plumbing against the host-memory stand-in (not a GPU: copies are memcpy) ----

use std::sync::Arc;

use nvlink_p2p::{
    copy_async, ipc_cache_stats, DeviceMemory, DmaBuf, IpcEvent, IpcEventHandle, IpcMemHandle,
    LinkKind, VmmAllocation,
};

/// Opens minus closes of IPC handles, as the stand-in counts them.
fn stand_in_ipc_open_count() -> i32 {
    let name = std::ffi::CString::new("libcuda.so").unwrap();
    let sym = std::ffi::CString::new("fake_ipc_open_count").unwrap();
    // SAFETY: RTLD_NOLOAD only looks up the already loaded stand-in; the symbol is the
    // stand-in's `int fake_ipc_open_count(void)`.
    #[allow(unsafe_code)]
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "stand-in not loaded");
        let f = libc::dlsym(h, sym.as_ptr());
        assert!(!f.is_null());
        let f: extern "C" fn() -> i32 = std::mem::transmute(f);
        f()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

#[test]
fn plumbing_memory_copies_contexts_topology() {
    if in_child() {
        let cuda = stand_in_cuda();
        assert_eq!(cuda.device_count(), 2);
        let topo = cuda.topology().unwrap();
        assert_eq!(topo.devices[1].name, "Stand-in GPU");
        assert_eq!(topo.devices[1].pci.1, 0x41);
        assert_eq!(topo.links.len(), 2);
        assert_eq!(topo.link(0, 1).unwrap().kind, LinkKind::LikelyNvLink);

        let dev = cuda.device(0).unwrap();
        assert_eq!(dev.uuid().unwrap()[1], 7);
        let a = Arc::new(dev.alloc(10_000).unwrap());
        a.write(0, &pattern(10_000, 1)).unwrap();
        assert_eq!(a.to_vec().unwrap(), pattern(10_000, 1));
        assert!(matches!(
            a.write(9_999, &[0, 0]),
            Err(Error::OutOfBounds { .. })
        ));
        let b = Arc::new(dev.alloc(10_000).unwrap());
        let s = dev.new_stream().unwrap();
        copy_async(&s, &b, 100, &a, 0, 9_000)
            .unwrap()
            .wait()
            .unwrap();
        let got = b.to_vec().unwrap();
        assert_eq!(&got[100..9_100], &pattern(10_000, 1)[..9_000]);
        nvlink_p2p::fill(&*b, 0, 10, 0xee).unwrap();
        assert_eq!(&b.to_vec().unwrap()[..10], &[0xee; 10]);

        // A second context on the same GPU: copies stay legal without a guard.
        let ctx2 = dev.new_context().unwrap();
        assert!(ctx2.same_gpu(&dev) && !ctx2.same_context(&dev));
        let c = Arc::new(ctx2.alloc(10_000).unwrap());
        let s2 = ctx2.new_stream().unwrap();
        copy_async(&s2, &c, 0, &a, 0, 10_000)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(c.to_vec().unwrap(), pattern(10_000, 1));
        let other = dev.new_context().unwrap().new_stream().unwrap();
        assert!(matches!(
            copy_async(&other, &c, 0, &a, 0, 1),
            Err(Error::ContextMismatch(_))
        ));
        return;
    }
    run_with(Stub::Host, "plumbing_memory_copies_contexts_topology", &[]);
}

#[test]
fn plumbing_peer_access_guards() {
    if in_child() {
        let cuda = stand_in_cuda();
        let (d0, d1) = (cuda.device(0).unwrap(), cuda.device(1).unwrap());
        let a = Arc::new(d0.alloc(4096).unwrap());
        let b = Arc::new(d1.alloc(4096).unwrap());
        a.write(0, &pattern(4096, 3)).unwrap();
        let s = d0.new_stream().unwrap();
        assert!(matches!(
            copy_async(&s, &b, 0, &a, 0, 4096),
            Err(Error::PeerAccessNotEnabled { src: 0, dst: 1 })
        ));
        let g1 = d0.enable_peer_access(&d1).unwrap();
        let g2 = d0.enable_peer_access(&d1).unwrap();
        copy_async(&s, &b, 0, &a, 0, 4096).unwrap().wait().unwrap();
        assert_eq!(b.to_vec().unwrap(), pattern(4096, 3));
        drop(g1);
        // Still enabled through the second guard.
        copy_async(&s, &b, 0, &a, 0, 8).unwrap().wait().unwrap();
        drop(g2);
        assert!(matches!(
            copy_async(&s, &b, 0, &a, 0, 8),
            Err(Error::PeerAccessNotEnabled { .. })
        ));
        return;
    }
    run_with(Stub::Host, "plumbing_peer_access_guards", &[]);
}

// Issue 13, items 4 and 8: legacy IPC between two processes over the stand-in (whose
// handles open only in another process, as the real driver's do). The importer's cache
// opens a handle once and closes it once; a handle opened in its own exporter is a typed
// error; and when the exporter frees and re-exports memory whose handle bytes repeat, the
// importer maps the new allocation, not the stale cached one.
#[test]
fn plumbing_ipc_cache_opens_once_and_closes_once() {
    const N: usize = 1 << 16;
    if role().as_deref() == Some("fake-importer") {
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let sock = connect();
        let h = IpcMemHandle::decode(&recv_msg(&sock)).unwrap();
        assert_eq!(h.len(), N as u64);
        let m1 = Arc::new(h.open(&dev).unwrap());
        let m2 = h.open(&dev).unwrap();
        assert!(!m1.was_cached() && m2.was_cached());
        assert_eq!(m1.device_ptr(), m2.device_ptr());
        assert_eq!(stand_in_ipc_open_count(), 1, "the driver saw one open");
        let s = ipc_cache_stats();
        assert_eq!((s.hits, s.misses, s.entries), (1, 1, 1));
        let mut seen = vec![0u8; N];
        nvlink_p2p::copy_to_host(&*m1, 0, &mut seen).unwrap();
        assert!(seen == pattern(N, 5), "read the exporter's bytes");
        drop(m2);
        assert_eq!(stand_in_ipc_open_count(), 1);
        // `m1` stays open while the exporter frees the memory and exports a new allocation.
        nvlink_p2p::fd_passing::send_with_fds(&sock, b"opened", &[]).unwrap();
        let h2 = IpcMemHandle::decode(&recv_msg(&sock)).unwrap();
        assert_eq!(h2.raw(), h.raw(), "the stand-in repeats the handle bytes");
        let fresh = h2.open(&dev).unwrap();
        assert!(
            !fresh.was_cached(),
            "a re-export with repeated handle bytes was served the stale cached mapping"
        );
        nvlink_p2p::copy_to_host(&fresh, 0, &mut seen).unwrap();
        assert!(seen == pattern(N, 6), "read the new allocation");
        drop(fresh);
        drop(m1);
        assert_eq!(
            stand_in_ipc_open_count(),
            0,
            "the last mappings closed the handles"
        );
        assert_eq!(ipc_cache_stats().entries, 0);

        // A peer that claims more bytes than the allocation has is refused (and the
        // mapping it caused is closed again).
        let lying = IpcMemHandle::from_parts(*h2.raw(), 1 << 20, h2.device_uuid())
            .with_allocation_id(h2.allocation_id());
        assert!(matches!(lying.open(&dev), Err(Error::InvalidArgument(_))));
        assert_eq!(stand_in_ipc_open_count(), 0);
        // Bytes the driver rejects are a typed error.
        let forged = IpcMemHandle::from_parts([7; 64], 64, [0; 16]);
        assert!(matches!(
            forged.open(&dev),
            Err(Error::Driver { code: 1, .. })
        ));
        nvlink_p2p::fd_passing::send_with_fds(&sock, b"done", &[]).unwrap();
        return;
    }
    if in_child() {
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let buf = Arc::new(dev.alloc(N).unwrap());
        buf.write(0, &pattern(N, 5)).unwrap();
        let h = IpcMemHandle::decode(&buf.ipc_handle().unwrap().encode()).unwrap();
        assert_ne!(h.allocation_id(), 0);
        // Opening in the exporting process: a typed error before the driver is asked ...
        let e = h.open(&dev).unwrap_err();
        assert!(matches!(e, Error::IpcHandleFromThisProcess), "{e:?}");
        // ... which would refuse it (CUDA_ERROR_INVALID_CONTEXT) as the real driver does.
        let anonymous = IpcMemHandle::from_parts(*h.raw(), h.len(), h.device_uuid());
        assert!(matches!(
            anonymous.open(&dev),
            Err(Error::Driver { code: 201, .. })
        ));

        let l = Listener::new("fake-ipc");
        let child = spawn_child(
            "plumbing_ipc_cache_opens_once_and_closes_once",
            "fake-importer",
            Some(&l),
            &[],
        );
        let sock = l.accept();
        nvlink_p2p::fd_passing::send_with_fds(&sock, &h.encode(), &[]).unwrap();
        assert_eq!(recv_msg(&sock), b"opened");
        drop(buf);
        let again = Arc::new(dev.alloc(N).unwrap());
        again.write(0, &pattern(N, 6)).unwrap();
        let h2 = again.ipc_handle().unwrap();
        assert_ne!(h2.allocation_id(), h.allocation_id());
        nvlink_p2p::fd_passing::send_with_fds(&sock, &h2.encode(), &[]).unwrap();
        assert_eq!(recv_msg(&sock), b"done");
        expect_success(child, "IPC importer");

        // cudarc memory that does not come from a pool exports too.
        let slice = dev
            .context()
            .default_stream()
            .alloc_zeros::<u8>(64)
            .unwrap();
        let h = nvlink_p2p::ipc_handle_of_cudarc_slice(&slice).unwrap();
        assert_eq!(h.len(), 64);

        // IPC events: export, open, record, wait.
        let ev = IpcEvent::new(&dev).unwrap();
        let opened = IpcEventHandle::decode(&ev.handle().unwrap().encode())
            .unwrap()
            .open(&dev)
            .unwrap();
        let st = dev.new_stream().unwrap();
        opened.record(&st).unwrap();
        st.wait_event(&ev).unwrap();
        ev.synchronize().unwrap();
        assert!(ev.query().unwrap());
        let other_ctx = dev.new_context().unwrap().new_stream().unwrap();
        assert!(matches!(
            ev.record(&other_ctx),
            Err(Error::ContextMismatch(_))
        ));
        // The stand-in has the same IPC-handle memory; forget the opened copy's destroy.
        std::mem::forget(opened);
        return;
    }
    run_with(
        Stub::Host,
        "plumbing_ipc_cache_opens_once_and_closes_once",
        &[],
    );
}

fn recv_msg(sock: &std::os::unix::net::UnixStream) -> Vec<u8> {
    nvlink_p2p::fd_passing::recv_with_fds(sock, 0).unwrap().0
}

#[test]
fn plumbing_missing_features_are_typed() {
    if in_child() {
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        // A device without VMM (FAKE_CUDA_NO_VMM) is refused before cuMemCreate is called.
        let e = VmmAllocation::new(&dev, 1 << 20).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Unsupported {
                    feature: "VMM (cuMemCreate)",
                    ..
                }
            ),
            "{e:?}"
        );
        // No fabric support reported: the probe says so instead of failing.
        assert!(nvlink_p2p::fabric_support(&dev).unwrap().is_err());
        // The device reports no DMA-BUF support: refused before the export is tried. (The
        // missing-entry-point case is `missing_newer_entry_point_and_failing_context_are_typed`.)
        let buf = Arc::new(dev.alloc(8192).unwrap());
        let e = DmaBuf::export(&buf, 0, 4096).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Unsupported {
                    feature: "DMA-BUF export",
                    ..
                }
            ),
            "{e:?}"
        );
        return;
    }
    run_with(
        Stub::Host,
        "plumbing_missing_features_are_typed",
        &[("FAKE_CUDA_NO_VMM", "1")],
    );
}

/// Reads one of the stand-in's `int f(void)` counters.
fn stand_in_counter(name: &str) -> i32 {
    let lib = std::ffi::CString::new("libcuda.so").unwrap();
    let sym = std::ffi::CString::new(name).unwrap();
    // SAFETY: RTLD_NOLOAD only looks up the already loaded stand-in; the symbol is one of the
    // stand-in's `int f(void)` functions.
    #[allow(unsafe_code)]
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "stand-in not loaded");
        let f = libc::dlsym(h, sym.as_ptr());
        assert!(!f.is_null(), "stand-in lacks {name}");
        let f: extern "C" fn() -> i32 = std::mem::transmute(f);
        f()
    }
}

use nvlink_p2p::cudarc::driver::sys;

/// The context current on this thread, as the driver reports it.
fn current_context() -> sys::CUcontext {
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the (stand-in) driver is loaded and initialised.
    #[allow(unsafe_code)]
    let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    c
}

/// Makes `c` current on this thread, as code using the CUDA runtime would.
fn set_current_context(c: sys::CUcontext) {
    // SAFETY: the stand-in accepts any token as a context.
    #[allow(unsafe_code)]
    let r = unsafe { sys::cuCtxSetCurrent(c) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

// Issue 13, item 1: a driver (or sandbox) that refuses the DMA-BUF export although the device
// attribute says yes is "unavailable here" with the driver's code, not a driver failure.
#[test]
fn refused_dmabuf_export_keeps_the_driver_code() {
    if in_child() {
        let expected: u32 = std::env::var("FAKE_CUDA_DMABUF").unwrap().parse().unwrap();
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let buf = Arc::new(dev.alloc(8192).unwrap());
        match DmaBuf::export(&buf, 0, 4096) {
            Err(e @ Error::Refused { code, .. }) if expected != 0 => {
                assert_eq!(code, expected, "{e}");
                assert!(e.is_unavailable_here());
                println!("dma-buf export refused here: {e}");
            }
            Ok(d) if expected == 0 => assert_eq!((d.offset(), d.len()), (0, 4096)),
            other => panic!("FAKE_CUDA_DMABUF={expected}: {other:?}"),
        }
        return;
    }
    // NOT_SUPPORTED, NOT_PERMITTED, OPERATING_SYSTEM, and a working export.
    for code in ["801", "800", "304", "0"] {
        run_with(
            Stub::Host,
            "refused_dmabuf_export_keeps_the_driver_code",
            &[("FAKE_CUDA_DMABUF", code)],
        );
    }
}

// Issue 13, item 2: any refusal of creating, exporting or importing a fabric handle is
// "no fabric (reason)"; the probe imports (and releases) too.
#[test]
fn fabric_probe_reports_each_refusal() {
    if in_child() {
        let mode = std::env::var("FAKE_CUDA_FABRIC").unwrap();
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let live_before = stand_in_counter("fake_live_vmm_handles");
        let verdict = nvlink_p2p::fabric_support(&dev).unwrap();
        match (mode.as_str(), &verdict) {
            ("ok", Ok(())) => {}
            (step, Err(reason)) if step != "ok" => {
                let step = step.split(':').next().unwrap();
                assert!(reason.contains(step), "{step}: {reason}");
                println!("no fabric ({reason})");
            }
            _ => panic!("FAKE_CUDA_FABRIC={mode}: {verdict:?}"),
        }
        assert_eq!(
            stand_in_counter("fake_live_vmm_handles"),
            live_before,
            "the probe released what it made"
        );
        return;
    }
    for mode in ["ok", "create:801", "export:800", "import:999", "import:1"] {
        run_with(
            Stub::Host,
            "fabric_probe_reports_each_refusal",
            &[("FAKE_CUDA_FABRIC", mode)],
        );
    }
}

// Issue 13, item 3: host-to-device copies land before `copy_from_host` returns, so work on
// the crate's non-blocking streams sees them (the stand-in stages them like the driver does
// for pageable memory).
#[test]
fn host_writes_are_visible_to_stream_copies() {
    if in_child() {
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let stream = dev.new_stream().unwrap();
        let a = Arc::new(dev.alloc(4096).unwrap());
        let b = Arc::new(dev.alloc(4096).unwrap());
        a.write(0, &pattern(4096, 11)).unwrap();
        copy_async(&stream, &b, 0, &a, 0, 4096)
            .unwrap()
            .wait()
            .unwrap();
        assert!(
            b.to_vec().unwrap() == pattern(4096, 11),
            "a stream copy read bytes the host write had not landed yet"
        );
        return;
    }
    run_with(Stub::Host, "host_writes_are_visible_to_stream_copies", &[]);
}

// Issue 13, item 6: calls leave the caller's current context as they found it, and a sticky
// error that cudarc recorded for an unrelated call does not make a drop skip its free.
#[test]
fn calls_keep_the_callers_context_and_drops_survive_sticky_errors() {
    if in_child() {
        let cuda = stand_in_cuda();
        let foreign = 0xdead_0000usize as sys::CUcontext;
        set_current_context(foreign);
        let dev = cuda.device(0).unwrap();
        assert_eq!(current_context(), foreign, "Cuda::device");
        let buf = Arc::new(dev.alloc(4096).unwrap());
        assert_eq!(current_context(), foreign, "alloc");
        buf.write(0, &pattern(4096, 1)).unwrap();
        buf.to_vec().unwrap();
        assert_eq!(current_context(), foreign, "host copies");
        let stream = dev.new_stream().unwrap();
        assert_eq!(current_context(), foreign, "new_stream");
        dev.memory_info().unwrap();
        assert_eq!(current_context(), foreign, "memory_info");
        let other = Arc::new(dev.alloc(4096).unwrap());
        let copy = copy_async(&stream, &other, 0, &buf, 0, 4096).unwrap();
        assert_eq!(current_context(), foreign, "copy_async");
        copy.wait().unwrap();
        assert_eq!(current_context(), foreign, "wait");
        let ctx2 = dev.new_context().unwrap();
        assert_eq!(current_context(), foreign, "new_context");
        drop(ctx2);
        drop(stream);
        assert_eq!(current_context(), foreign, "stream drop");
        buf.ipc_handle().unwrap();
        assert_eq!(current_context(), foreign, "ipc_handle");

        // cudarc records an error for some unrelated call on this context ...
        let live = stand_in_counter("fake_live_allocs");
        dev.context()
            .record_err::<()>(Err(nvlink_p2p::cudarc::driver::DriverError(
                sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
            )));
        // ... and dropping a buffer still frees it.
        drop(other);
        assert_eq!(
            stand_in_counter("fake_live_allocs"),
            live - 1,
            "a pending sticky error made DeviceBuffer's drop skip cuMemFree"
        );
        assert_eq!(current_context(), foreign, "drop");
        // The error is still there for the code that owns it.
        assert!(dev.context().check_err().is_err());
        return;
    }
    run_with(
        Stub::Host,
        "calls_keep_the_callers_context_and_drops_survive_sticky_errors",
        &[],
    );
}

// Issue 13, item 7: a driver that refuses the GPUDirect-RDMA flag still gets a VMM
// allocation (retried without it), and a peer's size is checked before the driver sees it.
#[test]
fn vmm_rdma_flag_retry_and_peer_sizes() {
    if in_child() {
        let refuse = std::env::var("FAKE_CUDA_REFUSE_RDMA_FLAG").is_ok();
        let cuda = stand_in_cuda();
        let dev = cuda.device(0).unwrap();
        let alloc = VmmAllocation::new(&dev, 1).unwrap();
        assert_eq!(alloc.gpu_direct_rdma(), !refuse);
        let g = alloc.size();
        let fd = alloc.export_fd().unwrap();
        let mut desc = alloc.descriptor().unwrap();
        // Not a granularity multiple: refused before the driver is called.
        desc.size = g as u64 + 1;
        let e = VmmAllocation::import_fd(&dev, std::os::fd::AsFd::as_fd(&fd), &desc).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        // Larger than the real allocation: the mapping is a typed driver error, not a fault.
        desc.size = 2 * g as u64;
        let imported =
            VmmAllocation::import_fd(&dev, std::os::fd::AsFd::as_fd(&fd), &desc).unwrap();
        let e = nvlink_p2p::VmmMapping::new(&imported).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Driver {
                    call: "cuMemMap",
                    ..
                }
            ),
            "{e:?}"
        );
        // The true size maps and reads.
        desc.size = g as u64;
        let imported =
            VmmAllocation::import_fd(&dev, std::os::fd::AsFd::as_fd(&fd), &desc).unwrap();
        let m = nvlink_p2p::VmmMapping::new(&imported).unwrap();
        nvlink_p2p::fill(&m, 0, 16, 3).unwrap();
        return;
    }
    run_with(
        Stub::Host,
        "vmm_rdma_flag_retry_and_peer_sizes",
        &[("FAKE_CUDA_VMM_RDMA", "1")],
    );
    run_with(
        Stub::Host,
        "vmm_rdma_flag_retry_and_peer_sizes",
        &[
            ("FAKE_CUDA_VMM_RDMA", "1"),
            ("FAKE_CUDA_REFUSE_RDMA_FLAG", "801"),
        ],
    );
}

/// Says why a test did not run (only for a missing C compiler: a named machine limit).
fn skip(why: std::fmt::Arguments<'_>) {
    skip_or_fail(why, Limit::Tool);
}
