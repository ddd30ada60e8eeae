//! GPU tests. Without a driver or device each prints `skipped: no CUDA driver` /
//! `skipped: no CUDA device` and returns; with `NVLINK_P2P_REQUIRE_GPU=1` (set by
//! `ci/gpu/run.sh` on the GPU machine) a missing GPU fails instead.
//!
//! The two-process tests re-run this binary as a child (see `common`).
mod common;

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use common::*;
use nvlink_p2p::fd_passing::{recv_with_fds, require_same_uid, send_with_fds};
use nvlink_p2p::{
    copy_async, ipc_cache_stats, Cuda, Device, DeviceBuffer, DeviceMemory, DmaBuf, Error, IpcEvent,
    IpcEventHandle, IpcMemHandle, VmmAllocation, VmmDescriptor, VmmMapping,
};

fn gpu() -> Option<Cuda> {
    if std::env::var("NVLINK_P2P_STANDIN").is_ok() {
        // The run of `suite_over_the_host_stand_in`: the stand-in must be what loaded.
        return Some(stand_in_cuda());
    }
    let required = gpu_required();
    match Cuda::init() {
        Ok(c) => {
            assert_real_driver_when_required(&c);
            Some(c)
        }
        Err(e) if required => panic!("NVLINK_P2P_REQUIRE_GPU=1 but: {e}"),
        Err(Error::DriverUnavailable { .. }) => {
            skip(format_args!("no CUDA driver"));
            None
        }
        Err(Error::NoDevice) => {
            skip(format_args!("no CUDA device"));
            None
        }
        Err(e) => panic!("unexpected error initialising CUDA: {e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn send(sock: &UnixStream, bytes: &[u8]) {
    send_with_fds(sock, bytes, &[]).unwrap();
}

fn recv(sock: &UnixStream) -> Vec<u8> {
    recv_with_fds(sock, 0).unwrap().0
}

const LEN: usize = 16 << 20;

/// Without a GPU, runs this whole suite against the host-memory stand-in driver, so the
/// plumbing of every test — VMM over real memfds, SCM_RIGHTS and legacy IPC (a memfd opened
/// through /proc) between two processes included — runs in CI too.
/// Not a GPU check: on a GPU machine this test steps aside and the suite runs for real.
#[test]
fn suite_over_the_host_stand_in() {
    if std::env::var("NVLINK_P2P_STANDIN").is_ok() {
        return; // we are the run below
    }
    if let Ok(cuda) = Cuda::init() {
        // Not a skip: with a driver the suite below runs for real, in this very binary.
        println!(
            "not needed: a CUDA driver is present ({:?}); the suite runs for real",
            cuda.library_path()
        );
        return;
    }
    let Some(dir) = stand_in(Stub::Host) else {
        skip_or_fail(
            format_args!("cannot build the stand-in driver (no C compiler `cc`)"),
            Limit::Tool,
        );
        return;
    };
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--test-threads=1", "--skip", "suite_over_the_host_stand_in"])
        .env("LD_LIBRARY_PATH", dir)
        .env("NVLINK_P2P_STANDIN", "1")
        .env_remove("NVLINK_P2P_REQUIRE_GPU")
        // The stand-in exports DMA-BUF as a dup of the allocation's memfd.
        .env("FAKE_CUDA_DMABUF", "0")
        .stdin(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the suite failed over the stand-in driver: {status}"
    );
}

#[test]
fn topology_lists_every_pair() {
    let Some(cuda) = gpu() else { return };
    let t = cuda.topology().unwrap();
    let n = cuda.device_count();
    assert_eq!(t.devices.len(), n);
    assert_eq!(t.links.len(), n * (n - 1));
    for d in &t.devices {
        assert!(!d.name.is_empty());
        println!("device {}: {} pci {:?}", d.ordinal, d.name, d.pci);
    }
    for l in &t.links {
        println!("{l:?}");
        assert_eq!(t.link(l.from, l.to), Some(l));
    }
    let dev = cuda.device(0).unwrap();
    assert_eq!(dev.uuid().unwrap().len(), 16);
    println!(
        "driver {}, device 0 = {}, library {:?}",
        cuda.driver_version(),
        dev.name().unwrap(),
        cuda.library_path()
    );
}

#[test]
fn host_copies_and_bounds() {
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    let buf = Arc::new(dev.alloc(LEN).unwrap());
    let data = pattern(LEN, 1);
    buf.write(0, &data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    assert!(matches!(
        buf.write(LEN - 1, &[1, 2]),
        Err(Error::OutOfBounds { offset, len: 2, size }) if offset == LEN - 1 && size == LEN
    ));
    let other = Arc::new(dev.alloc(LEN).unwrap());
    let stream = dev.new_stream().unwrap();
    assert!(matches!(
        copy_async(&stream, &other, 1, &buf, 0, LEN),
        Err(Error::OutOfBounds { .. })
    ));
    copy_async(&stream, &other, 0, &buf, 0, LEN)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(other.to_vec().unwrap(), data);
    assert!(matches!(dev.alloc(0), Err(Error::InvalidArgument(_))));
}

#[test]
fn legacy_ipc_between_processes() {
    if role().as_deref() == Some("ipc-importer") {
        let cuda = Cuda::init().unwrap();
        let dev = cuda.device(0).unwrap();
        let sock = connect();
        require_same_uid(&sock).unwrap();
        let mem = IpcMemHandle::decode(&recv(&sock)).unwrap();
        let ev = IpcEventHandle::decode(&recv(&sock)).unwrap();
        assert_eq!(mem.len(), LEN as u64);
        assert_eq!(mem.device_uuid(), dev.uuid().unwrap());

        let before = ipc_cache_stats();
        let first = Arc::new(mem.open(&dev).unwrap());
        assert!(!first.was_cached());
        let again = mem.open(&dev).unwrap();
        assert!(
            again.was_cached(),
            "second open of an open handle must hit the cache"
        );
        assert_eq!(again.device_ptr(), first.device_ptr());
        let after = ipc_cache_stats();
        assert_eq!(after.hits, before.hits + 1);
        assert_eq!(after.misses, before.misses + 1);
        drop(again);
        assert_eq!(ipc_cache_stats().entries, 1, "still open through `first`");

        // Read the exporter's bytes through the mapping.
        let mut seen = vec![0u8; LEN];
        nvlink_p2p::copy_to_host(&*first, 0, &mut seen).unwrap();
        assert!(seen == pattern(LEN, 7), "importer read wrong bytes");

        // Write back through the mapping with an async copy, ordered by the IPC event.
        let local = Arc::new(dev.alloc(LEN).unwrap());
        local.write(0, &pattern(LEN, 9)).unwrap();
        let stream = dev.new_stream().unwrap();
        let event = ev.open(&dev).unwrap();
        let copy = copy_async(&stream, &first, 0, &local, 0, LEN).unwrap();
        event.record(&stream).unwrap();
        send(&sock, b"recorded");
        copy.wait().unwrap();

        // A forged handle is a typed driver error, not a crash.
        let mut forged = mem.encode();
        for b in &mut forged[8..72] {
            *b ^= 0x5a;
        }
        let forged = IpcMemHandle::decode(&forged).unwrap();
        assert!(matches!(forged.open(&dev), Err(Error::Driver { .. })));

        drop(first);
        assert_eq!(ipc_cache_stats().entries, 0, "last drop closes the handle");
        send(&sock, b"closed");
        return;
    }
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    let buf = Arc::new(DeviceBuffer::new(&dev, LEN).unwrap());
    buf.write(0, &pattern(LEN, 7)).unwrap();
    // Opening our own export: caught before the driver, which refuses it. What the driver
    // itself says (a handle without our allocation id gets past the check) is printed.
    let own = buf.ipc_handle().unwrap();
    assert!(matches!(
        own.open(&dev),
        Err(Error::IpcHandleFromThisProcess)
    ));
    match IpcMemHandle::from_parts(*own.raw(), own.len(), own.device_uuid()).open(&dev) {
        Err(e) => println!("driver on opening an IPC handle in its exporter: {e}"),
        Ok(_) => panic!("the driver opened an IPC handle in the exporting process"),
    }
    let event = IpcEvent::new(&dev).unwrap();
    let l = Listener::new("ipc");
    let child = spawn_child(
        "legacy_ipc_between_processes",
        "ipc-importer",
        Some(&l),
        &[],
    );
    let sock = l.accept();
    require_same_uid(&sock).unwrap();
    send(&sock, &buf.ipc_handle().unwrap().encode());
    send(&sock, &event.handle().unwrap().encode());
    assert_eq!(recv(&sock), b"recorded");
    // The child recorded our event after queueing its write: waiting on it orders us after it.
    event.synchronize().unwrap();
    assert!(event.query().unwrap());
    assert!(
        buf.to_vec().unwrap() == pattern(LEN, 9),
        "exporter did not see the importer's write"
    );
    assert_eq!(recv(&sock), b"closed");
    expect_success(child, "IPC importer");
}

/// Code on the same thread that uses its own context (the CUDA runtime, PyTorch) finds it
/// still current after this crate's calls.
#[test]
fn calls_leave_the_callers_context_current() {
    use nvlink_p2p::cudarc::driver::sys;
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    let callers = dev.new_context().unwrap();
    let current = || {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the driver is initialised.
        #[allow(unsafe_code)]
        let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        c
    };
    // SAFETY: `callers` keeps the context alive for the whole test.
    #[allow(unsafe_code)]
    let r = unsafe { sys::cuCtxSetCurrent(callers.context().cu_ctx()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let mine = callers.context().cu_ctx();
    let a = Arc::new(dev.alloc(1 << 20).unwrap());
    a.write(0, &pattern(1 << 20, 2)).unwrap();
    let b = Arc::new(dev.alloc(1 << 20).unwrap());
    let stream = dev.new_stream().unwrap();
    copy_async(&stream, &b, 0, &a, 0, 1 << 20)
        .unwrap()
        .wait()
        .unwrap();
    assert!(b.to_vec().unwrap() == pattern(1 << 20, 2));
    dev.memory_info().unwrap();
    drop((a, b, stream));
    assert_eq!(current(), mine, "a call left another context current");
}

#[test]
fn stream_ordered_memory_is_refused_for_ipc() {
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    let ctx = dev.context();
    if !ctx.has_async_alloc() {
        skip_or_fail(
            format_args!("device has no stream-ordered allocator"),
            Limit::None,
        );
        return;
    }
    let stream = ctx.default_stream();
    let slice = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    let e = nvlink_p2p::ipc_handle_of_cudarc_slice(&slice).unwrap_err();
    assert!(matches!(e, Error::StreamOrderedAllocation), "{e:?}");
    assert!(e.to_string().contains("stream-ordered allocator"), "{e}");
}

#[test]
fn vmm_fd_between_processes() {
    if role().as_deref() == Some("vmm-importer") {
        let cuda = Cuda::init().unwrap();
        let dev = cuda.device(0).unwrap();
        let sock = connect();
        // Warm the driver's VMM path so its own device fds are open before we count.
        drop(VmmMapping::new(&VmmAllocation::new(&dev, 1).unwrap()).unwrap());
        let fds_before = open_fds();
        let (desc, fds) = recv_with_fds(&sock, 1).unwrap();
        let desc = VmmDescriptor::decode(&desc).unwrap();
        assert_eq!(fds.len(), 1);
        let alloc = VmmAllocation::import_fd(&dev, fds[0].as_fd(), &desc).unwrap();
        drop(fds); // the import does not need the fd any more
        let mapping = Arc::new(VmmMapping::new(&alloc).unwrap());
        drop(alloc); // the mapping keeps the allocation
        let mut seen = vec![0u8; LEN];
        nvlink_p2p::copy_to_host(&*mapping, 0, &mut seen).unwrap();
        assert!(seen == pattern(LEN, 3), "importer read wrong bytes");
        nvlink_p2p::copy_from_host(&*mapping, 0, &pattern(LEN, 4)).unwrap();
        drop(mapping);
        assert_eq!(open_fds(), fds_before, "importer leaked fds");
        send(&sock, b"written");
        return;
    }
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    let alloc = match VmmAllocation::new(&dev, LEN) {
        Ok(a) => a,
        Err(e) if e.is_unavailable_here() => {
            skip_or_fail(format_args!("{e}"), vmm_limit(&e));
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert!(alloc.size() >= LEN);
    let mapping = Arc::new(VmmMapping::new(&alloc).unwrap());
    nvlink_p2p::copy_from_host(&*mapping, 0, &pattern(LEN, 3)).unwrap();
    let l = Listener::new("vmm");
    let child = spawn_child("vmm_fd_between_processes", "vmm-importer", Some(&l), &[]);
    let sock = l.accept();
    require_same_uid(&sock).unwrap();
    let desc = alloc.descriptor().unwrap();
    assert_eq!(desc.size, alloc.size() as u64);
    let fd = alloc.export_fd().unwrap();
    send_with_fds(&sock, &desc.encode(), &[fd.as_fd()]).unwrap();
    drop(fd);
    assert_eq!(recv(&sock), b"written");
    expect_success(child, "VMM importer");
    let mut seen = vec![0u8; LEN];
    nvlink_p2p::copy_to_host(&*mapping, 0, &mut seen).unwrap();
    assert!(
        seen == pattern(LEN, 4),
        "exporter did not see the importer's write"
    );
}

#[test]
fn vmm_release_order_does_not_leak() {
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    const BIG: usize = 1 << 30;
    if let Err(e) = VmmAllocation::new(&dev, 1) {
        if e.is_unavailable_here() {
            skip_or_fail(format_args!("{e}"), vmm_limit(&e));
            return;
        }
        panic!("{e}");
    }
    let (free_before, _) = dev.memory_info().unwrap();
    for order in 0..6 {
        let alloc = VmmAllocation::new(&dev, BIG).unwrap();
        let mapping = VmmMapping::new(&alloc).unwrap();
        let fd = alloc.export_fd().unwrap();
        // Every order of dropping the three owners.
        match order {
            0 => drop((alloc, mapping, fd)),
            1 => {
                drop(mapping);
                drop(alloc);
                drop(fd)
            }
            2 => {
                drop(fd);
                drop(alloc);
                drop(mapping)
            }
            3 => {
                drop(alloc);
                drop(fd);
                drop(mapping)
            }
            4 => {
                drop(fd);
                drop(mapping);
                drop(alloc)
            }
            _ => {
                drop(mapping);
                drop(fd);
                drop(alloc)
            }
        }
    }
    let (free_after, _) = dev.memory_info().unwrap();
    // Six leaked GiB would show; allow some slack for driver bookkeeping.
    assert!(
        free_after + (BIG / 2) >= free_before,
        "free memory went from {free_before} to {free_after}: VMM memory leaked"
    );
}

#[test]
fn fabric_handles_probe() {
    let Some(cuda) = gpu() else { return };
    let dev = cuda.device(0).unwrap();
    match nvlink_p2p::fabric_support(&dev).unwrap() {
        Err(reason) => {
            assert!(!reason.is_empty());
            println!("fabric handles unsupported here (expected without IMEX): {reason}");
        }
        Ok(()) => {
            let alloc = VmmAllocation::new_fabric(&dev, 1 << 21).unwrap();
            let h = alloc.export_fabric().unwrap();
            let h2 = nvlink_p2p::FabricHandle::decode(&h.encode()).unwrap();
            assert_eq!(h, h2);
            println!("fabric handles supported: exported {h:?}");
            assert!(matches!(alloc.export_fd(), Err(Error::Unsupported { .. })));
        }
    }
}

#[test]
fn peer_copies_between_two_contexts() {
    let Some(cuda) = gpu() else { return };
    let a = cuda.device(0).unwrap();
    let b = a.new_context().unwrap();
    assert!(a.same_gpu(&b) && !a.same_context(&b));
    assert!(a.can_access_peer(&b).unwrap());
    let _guard = a.enable_peer_access(&b).unwrap(); // same GPU: a no-op guard
    let src = Arc::new(a.alloc(LEN).unwrap());
    let dst = Arc::new(b.alloc(LEN).unwrap());
    src.write(0, &pattern(LEN, 5)).unwrap();
    let stream = b.new_stream().unwrap();
    let copy = copy_async(&stream, &dst, 0, &src, 0, LEN).unwrap();
    copy.wait().unwrap();
    assert!(dst.to_vec().unwrap() == pattern(LEN, 5));
    // A stream of a third context is refused.
    let c = a.new_context().unwrap();
    let foreign = c.new_stream().unwrap();
    assert!(matches!(
        copy_async(&foreign, &dst, 0, &src, 0, 16),
        Err(Error::ContextMismatch(_))
    ));

    if cuda.device_count() < 2 {
        skip_or_fail(
            format_args!("one GPU: no cross-device peer copy (the two-context part ran)"),
            Limit::OneGpu,
        );
        return;
    }
    let d1 = cuda.device(1).unwrap();
    let far = Arc::new(d1.alloc(LEN).unwrap());
    let s0 = a.new_stream().unwrap();
    match a.enable_peer_access(&d1) {
        Err(Error::PeerAccessUnavailable { .. }) => {
            assert!(matches!(
                copy_async(&s0, &far, 0, &src, 0, LEN),
                Err(Error::PeerAccessNotEnabled { .. })
            ));
        }
        Err(e) => panic!("{e}"),
        Ok(guard) => {
            copy_async(&s0, &far, 0, &src, 0, LEN)
                .unwrap()
                .wait()
                .unwrap();
            assert!(far.to_vec().unwrap() == pattern(LEN, 5));
            drop(guard);
            assert!(matches!(
                copy_async(&s0, &far, 0, &src, 0, LEN),
                Err(Error::PeerAccessNotEnabled { .. })
            ));
        }
    }
}

#[test]
fn dmabuf_export() {
    let Some(cuda) = gpu() else { return };
    let dev: Device = cuda.device(0).unwrap();
    let buf = Arc::new(dev.alloc(4 << 20).unwrap());
    match DmaBuf::export(&buf, 100, 8192) {
        Err(e) if e.is_unavailable_here() => {
            if let Error::Refused { code, name, .. } = &e {
                println!("dma-buf export refused with {name} ({code})");
            }
            // The attribute saying no, or the driver/sandbox refusing: a machine limit when
            // the probe saw it too; a driver too old or a missing entry point is not.
            let limit = match e {
                Error::Unsupported { .. } | Error::Refused { .. } => Limit::RefusedHere("dmabuf"),
                _ => Limit::None,
            };
            skip_or_fail(format_args!("DMA-BUF export unavailable here: {e}"), limit);
        }
        Err(e) => panic!("{e}"),
        Ok(d) => {
            assert_eq!(d.offset(), 100);
            assert_eq!(d.len(), 8192);
            assert_eq!(d.device_ptr(), buf.device_ptr() + 100);
            let mut f = std::fs::File::from(d.fd().try_clone_to_owned().unwrap());
            use std::io::Seek;
            let size = f.seek(std::io::SeekFrom::End(0)).unwrap();
            assert!(size >= 8192 + 100, "dma-buf of {size} bytes");
            println!(
                "dma-buf fd covers {size} bytes, range at offset {}; GPUDirect RDMA (a NIC \
                 registering this fd) is not exercised by this test: unverified here",
                d.offset()
            );
            // The DmaBuf keeps the memory alive after our Arc is gone.
            drop(buf);
            assert_eq!(d.memory().len(), 4 << 20);
            let ptr = d.device_ptr();
            let (_fd, offset, len, iova, memory) = d.into_parts();
            assert_eq!((offset, len, iova), (100, 8192, ptr));
            assert_eq!(memory.device_ptr() + 100, ptr);
        }
    }
    assert!(matches!(
        DmaBuf::export(&Arc::new(dev.alloc(4096).unwrap()), 4000, 200),
        Err(Error::OutOfBounds { .. })
    ));
}

/// Without a driver or device (never with `NVLINK_P2P_REQUIRE_GPU=1`, where `gpu` panics).
fn skip(why: std::fmt::Arguments<'_>) {
    skip_or_fail(why, Limit::None);
}

/// VMM refused by the driver or a sandbox is a machine limit when the probe saw it too; a
/// driver too old, a missing entry point or a device without VMM is not (an H200 has it).
fn vmm_limit(e: &Error) -> Limit {
    match e {
        Error::Refused { .. } => Limit::RefusedHere("vmm"),
        _ => Limit::None,
    }
}
