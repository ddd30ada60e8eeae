//! Legacy-IPC figures on one GPU, both from the same run:
//!
//! 1. copy bandwidth through an IPC mapping of another process's memory vs `cuMemcpyDtoD`
//!    between two buffers of one process (target: ratio >= 0.95);
//! 2. re-opening a handle already open in the process (cache hit) vs the first open
//!    (target: <= 1% of the first open's time).
//!
//! `cargo run --release -p nvlink-p2p --example ipc_bench [-- --size-mib 1024 --iters 20]`
//! Without a CUDA driver or device it prints `skipped: ...` and exits 0.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use nvlink_p2p::cudarc::driver::sys::CUevent_flags;
use nvlink_p2p::{copy_async, fill, Cuda, Device, DeviceMemory, Error, IpcMemHandle, Stream};

struct Args {
    size: usize,
    iters: usize,
    child: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        size: 1 << 30,
        iters: 20,
        child: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--size-mib" => {
                a.size = it
                    .next()
                    .and_then(|v| v.parse::<usize>().ok())
                    .expect("--size-mib N")
                    << 20
            }
            "--iters" => a.iters = it.next().and_then(|v| v.parse().ok()).expect("--iters N"),
            "--child" => a.child = it.next(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Mean milliseconds per copy of `len` bytes from `src` to `dst`, timed with CUDA events
/// around `iters` back-to-back copies after two warm-up copies.
fn time_copies<D: DeviceMemory + 'static, S: DeviceMemory + 'static>(
    dev: &Device,
    stream: &Stream,
    dst: &Arc<D>,
    src: &Arc<S>,
    len: usize,
    iters: usize,
) -> Result<f64, Error> {
    for _ in 0..2 {
        copy_async(stream, dst, 0, src, 0, len)?.wait()?;
    }
    let ctx = dev.context();
    let ev = |_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let (start, end) = (ev(0).unwrap(), ev(1).unwrap());
    start.record(stream.as_cudarc()).unwrap();
    let mut pending = Vec::with_capacity(iters);
    for _ in 0..iters {
        pending.push(copy_async(stream, dst, 0, src, 0, len)?);
    }
    end.record(stream.as_cudarc()).unwrap();
    for p in pending {
        p.wait()?;
    }
    let ms = start.elapsed_ms(&end).unwrap() as f64;
    Ok(ms / iters as f64)
}

fn gbps(len: usize, ms: f64) -> f64 {
    len as f64 / (ms / 1e3) / 1e9
}

fn child(path: &str, a: &Args) -> Result<(), Error> {
    let cuda = Cuda::init()?;
    let dev = cuda.device(0)?;
    let mut sock = UnixStream::connect(path).expect("connect");
    let mut line = String::new();
    BufReader::new(&sock)
        .read_line(&mut line)
        .expect("handle line");
    let bytes: Vec<u8> = (0..line.trim().len() / 2)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let handle = IpcMemHandle::decode(&bytes)?;

    let t = Instant::now();
    let mapping = Arc::new(handle.open(&dev)?);
    let first_us = t.elapsed().as_secs_f64() * 1e6;
    assert!(!mapping.was_cached());
    // Cached re-opens: median of many.
    let mut samples: Vec<f64> = (0..2001)
        .map(|_| {
            let t = Instant::now();
            let m = handle.open(&dev).expect("re-open");
            let us = t.elapsed().as_secs_f64() * 1e6;
            assert!(m.was_cached());
            drop(m);
            us
        })
        .collect();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let cached_us = samples[samples.len() / 2];

    let local = Arc::new(dev.alloc(a.size)?);
    let stream = dev.new_stream()?;
    let ms = time_copies(&dev, &stream, &local, &mapping, a.size, a.iters)?;
    writeln!(sock, "{ms} {first_us} {cached_us}").expect("send results");
    Ok(())
}

fn main() -> ExitCode {
    let a = args();
    if let Some(path) = &a.child {
        return match child(path, &a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("child: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let cuda = match Cuda::init() {
        Ok(c) => c,
        Err(e @ (Error::DriverUnavailable { .. } | Error::NoDevice)) => {
            if std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1") {
                eprintln!("error: NVLINK_P2P_REQUIRE_GPU=1 but: {e}");
                return ExitCode::FAILURE;
            }
            println!("skipped: {e}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match parent(&cuda, &a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parent(cuda: &Cuda, a: &Args) -> Result<bool, Error> {
    let dev = cuda.device(0)?;
    println!(
        "ipc_bench: {} (driver {}), {} MiB, {} copies per measurement",
        dev.name()?,
        cuda.driver_version(),
        a.size >> 20,
        a.iters
    );
    let src = Arc::new(dev.alloc(a.size)?);
    let dst = Arc::new(dev.alloc(a.size)?);
    fill(&*src, 0, a.size, 0xa5)?;
    let stream = dev.new_stream()?;
    let local_ms = time_copies(&dev, &stream, &dst, &src, a.size, a.iters)?;

    let path = std::env::temp_dir().join(format!("nvlink-ipc-bench-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--child",
            path.to_str().unwrap(),
            "--size-mib",
            &(a.size >> 20).to_string(),
            "--iters",
            &a.iters.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn child");
    let exchange = || -> Result<String, Error> {
        let (mut sock, _) = listener.accept().expect("accept");
        let _ = std::fs::remove_file(&path);
        nvlink_p2p::fd_passing::require_same_uid(&sock)?;
        let hex: String = src
            .ipc_handle()?
            .encode()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        writeln!(sock, "{hex}").expect("send handle");
        let mut line = String::new();
        BufReader::new(&sock).read_line(&mut line).expect("results");
        Ok(line)
    };
    let line = exchange();
    let status = child.wait().expect("wait child");
    // `src` stays alive until here: the child has closed its mapping and exited.
    let line = line?;
    if !status.success() || line.trim().is_empty() {
        eprintln!("error: child failed ({status})");
        return Ok(false);
    }
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    let (ipc_ms, first_us, cached_us) = (v[0], v[1], v[2]);

    let (local_bw, ipc_bw) = (gbps(a.size, local_ms), gbps(a.size, ipc_ms));
    let ratio = ipc_bw / local_bw;
    let open_ratio = cached_us / first_us;
    let bw_ok = ratio >= 0.95;
    let open_ok = open_ratio <= 0.01;
    println!("figure dtod_same_process_GBps {local_bw:.1} ({local_ms:.3} ms per copy)");
    println!("figure ipc_mapping_other_process_GBps {ipc_bw:.1} ({ipc_ms:.3} ms per copy)");
    println!(
        "figure ipc_vs_dtod_ratio {ratio:.3} target>=0.95 {}",
        if bw_ok { "PASS" } else { "FAIL" }
    );
    println!("figure ipc_first_open_us {first_us:.1}");
    println!("figure ipc_cached_reopen_us {cached_us:.3} (median of 2001)");
    println!(
        "figure cached_vs_first_open {:.4}% target<=1% {}",
        open_ratio * 100.0,
        if open_ok { "PASS" } else { "FAIL" }
    );
    Ok(bw_ok && open_ok)
}
