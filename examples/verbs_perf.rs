//! perftest's six basic RC tests on `ibverbs-safe`, with the same semantics, so that
//! `ci/softroce/bench.sh` can put them side by side with `ib_send_lat`, `ib_write_lat`,
//! `ib_read_lat`, `ib_write_bw`, `ib_send_bw` and `ib_read_bw` on the same devices:
//!
//! * `send_lat` — SEND/RECV ping-pong; both sides busy-poll their receive CQ, re-post each
//!   receive, and send (signalled every `--cq-mod`, then that completion is polled);
//! * `write_lat` — RDMA WRITE ping-pong; each side writes a counter into the last byte of
//!   the peer's buffer and spins on the last byte of its own until the peer's write lands;
//! * `read_lat` — the client RDMA READs the server's buffer, one at a time;
//! * `write_bw` / `send_bw` / `read_bw` — the client keeps `--tx-depth` writes/sends/reads
//!   in flight, signalling every `--cq-mod`-th (the others are unsignalled: their buffers are
//!   released by the next signalled completion); the server keeps receives posted
//!   (send_bw). With `-s 8` these are the message-rate tests (`msg_rate_Mpps`).
//!
//! Latency is taken as perftest does: the client's post timestamps (time-stamp counter), consecutive
//! differences, sorted; typical = median, p99 = 99th percentile, halved for the ping-pong
//! tests (round trip / 2). Bandwidth = bytes / (last completion − first post), in MiB/s
//! (perftest's "MB/sec"). Busy polling throughout, no allocation in the measured loops.
//!
//! ```sh
//! verbs_perf send_lat -d rxe0 -x 1                 # server
//! verbs_perf send_lat -d rxe0 -x 1 127.0.0.1       # client: prints the RESULT line
//! ```

use std::error::Error;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use ibverbs_safe::{
    AlignedBuffer, Completion, CompletionQueue, Endpoint, MemoryRegion, MrSlice, QueuePair, Rc,
    Remote, RemoteAccess, RemoteMemory, SendRequest,
};

type AnyResult<T> = Result<T, Box<dyn Error>>;

/// The time-stamp counter, as perftest's `get_cycles()` reads it. `Instant::now()` would
/// not do in the guest: under TCG the kernel's clocksource is the HPET, so every
/// `clock_gettime` is a system call plus an emulated device read (~5 µs), which would land
/// in every measured iteration.
#[cfg(target_arch = "x86_64")]
fn cycles() -> u64 {
    // SAFETY: RDTSC only reads the time-stamp counter (every x86_64 CPU has it); it touches
    // no memory.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Elsewhere: nanoseconds (then `cycles_per_us` is 1000).
#[cfg(not(target_arch = "x86_64"))]
fn cycles() -> u64 {
    use std::sync::OnceLock;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Counter ticks per microsecond: `cpu MHz` from /proc/cpuinfo, as perftest converts (so
/// both programs use the same unit), else measured against the monotonic clock.
fn cycles_per_us() -> (f64, &'static str) {
    if cfg!(not(target_arch = "x86_64")) {
        return (1000.0, "ns clock");
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mhz = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok());
    if let Some(m) = mhz.filter(|m| *m > 0.0) {
        return (m, "cpu MHz from /proc/cpuinfo");
    }
    let (c0, t0) = (cycles(), Instant::now());
    std::thread::sleep(Duration::from_millis(200));
    let (c1, t1) = (cycles(), Instant::now());
    ((c1 - c0) as f64 / (t1 - t0).as_secs_f64() / 1e6, "measured")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[allow(clippy::enum_variant_names)]
#[value(rename_all = "snake_case")]
enum Test {
    SendLat,
    WriteLat,
    ReadLat,
    WriteBw,
    SendBw,
    ReadBw,
}

impl Test {
    fn is_lat(self) -> bool {
        matches!(self, Test::SendLat | Test::WriteLat | Test::ReadLat)
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "verbs_perf",
    about = "perftest's RC latency/bandwidth tests on ibverbs-safe"
)]
struct Args {
    /// The test.
    #[arg(value_enum)]
    test: Test,
    /// The server to connect to (be the server when absent).
    server: Option<String>,
    /// IB device (default: the first).
    #[arg(short = 'd', long = "ib-dev")]
    ib_dev: Option<String>,
    /// Port of the IB device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// GID index.
    #[arg(short = 'x', long = "gid-index")]
    gid_index: Option<u8>,
    /// TCP port of the handshake.
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    port: u16,
    /// Message size (default 2 for latency, 65536 for bandwidth tests).
    #[arg(short = 's', long = "size")]
    size: Option<usize>,
    /// Iterations (default 1000 for latency, 5000 for bandwidth tests).
    #[arg(short = 'n', long = "iters")]
    iters: Option<usize>,
    /// Send queue depth of the bandwidth tests.
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    tx_depth: usize,
    /// Receive queue depth.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 512)]
    rx_depth: usize,
    /// Signal one send in this many.
    #[arg(short = 'Q', long = "cq-mod", default_value_t = 1)]
    cq_mod: usize,
    /// Send messages up to this size inline.
    #[arg(short = 'I', long = "inline-size", default_value_t = 0)]
    inline_size: u32,
}

/// Everything a side needs, connected.
struct Side {
    scq: CompletionQueue,
    rcq: CompletionQueue,
    qp: QueuePair<Rc>,
    /// Local source (sends, writes) / READ destination.
    src: MrSlice,
    /// Target of the peer's writes and reads; receives land here too.
    dst: MemoryRegion<AlignedBuffer, Remote>,
    dst_handle: MrSlice,
    remote: RemoteMemory,
    sock: TcpStream,
}

fn handshake(a: &Args) -> AnyResult<TcpStream> {
    let s = match &a.server {
        Some(host) => {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match TcpStream::connect((host.as_str(), a.port)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => {
                        return Err(format!("couldn't connect to {host}:{}: {e}", a.port).into())
                    }
                }
            }
        }
        None => TcpListener::bind(("0.0.0.0", a.port))?.accept()?.0,
    };
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn setup(a: &Args, size: usize) -> AnyResult<Side> {
    let ctx = ibverbs_safe::open(a.ib_dev.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let tx_depth = if a.test.is_lat() { 1 } else { a.tx_depth };
    let scq = ctx.create_cq(tx_depth as u32 + 1)?;
    let rcq = ctx.create_cq(a.rx_depth as u32 + 1)?;
    // page-aligned buffers, as perftest allocates them
    let page = 4096;
    let mut src_mr = pd.register(AlignedBuffer::zeroed(size, page)?)?;
    let src = src_mr.slice(..)?;
    let mut dst = pd.register_remote(
        AlignedBuffer::zeroed(size, page)?,
        RemoteAccess::WRITE | RemoteAccess::READ,
    )?;
    let dst_handle = dst.slice(..)?;
    let mut b = pd
        .queue_pair(&scq, &rcq)
        .port(a.ib_port)
        .max_send_wr(tx_depth as u32)
        .max_recv_wr(a.rx_depth as u32)
        .max_inline_data(a.inline_size);
    if let Some(g) = a.gid_index {
        b = b.gid_index(g);
    }
    let qp = b.build_rc()?;
    let mut sock = handshake(a)?;
    let mut msg = [0u8; Endpoint::ENCODED_LEN + RemoteMemory::ENCODED_LEN];
    msg[..Endpoint::ENCODED_LEN].copy_from_slice(&qp.endpoint().to_bytes());
    msg[Endpoint::ENCODED_LEN..].copy_from_slice(&dst.remote().to_bytes());
    sock.write_all(&msg)?;
    let mut theirs = [0u8; Endpoint::ENCODED_LEN + RemoteMemory::ENCODED_LEN];
    sock.read_exact(&mut theirs)?;
    let remote = RemoteMemory::from_bytes(&theirs[Endpoint::ENCODED_LEN..])?;
    let mut qp = qp.connect_bytes(&theirs[..Endpoint::ENCODED_LEN])?;
    // receives before the peer may send: the sync below orders them
    if matches!(a.test, Test::SendLat | Test::SendBw) {
        for i in 0..a.rx_depth {
            qp.post_recv(dst_handle.slice(..size)?, i as u64)
                .map_err(|e| e.error)?;
        }
    }
    sync(&mut sock)?;
    Ok(Side {
        scq,
        rcq,
        qp,
        src,
        dst,
        dst_handle,
        remote,
        sock,
    })
}

fn sync(s: &mut TcpStream) -> AnyResult<()> {
    s.write_all(b"S")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    if b != *b"S" {
        return Err("out of sync with the peer".into());
    }
    Ok(())
}

/// Busy-polls `cq` into `wc` until at least one completion arrived; fails on an error status.
fn poll_some(cq: &mut CompletionQueue, wc: &mut [Completion]) -> AnyResult<usize> {
    loop {
        let n = cq.poll(wc)?;
        for c in &wc[..n] {
            if !c.is_ok() {
                return Err(format!("completion with {} (wr_id {})", c.status(), c.wr_id()).into());
            }
        }
        if n > 0 {
            return Ok(n);
        }
    }
}

fn send_lat(
    a: &Args,
    s: &mut Side,
    size: usize,
    iters: usize,
    stamps: &mut [u64],
) -> AnyResult<()> {
    let client = a.server.is_some();
    let inline = size <= a.inline_size as usize;
    let mut wc = Completion::buffer(1);
    let (mut scnt, mut rcnt) = (0usize, 0usize);
    let src = s.src.slice(..size)?;
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(scnt < 1 && client) {
            poll_some(&mut s.rcq, &mut wc)?;
            rcnt += 1;
            if rcnt + a.rx_depth <= iters {
                let h = wc[0].take_buf().ok_or("receive without its buffer")?;
                s.qp.post_recv(h, wc[0].wr_id()).map_err(|e| e.error)?;
            }
        }
        if scnt < iters {
            if client {
                stamps[scnt] = cycles();
            }
            scnt += 1;
            let signalled = scnt % a.cq_mod == 0 || scnt == iters;
            let mut r = SendRequest::send(src.clone()).wr_id(scnt as u64);
            if !signalled {
                r = r.unsignaled();
            }
            if inline {
                r = r.inline();
            }
            s.qp.post_send(r).map_err(|e| e.error)?;
            if signalled {
                poll_some(&mut s.scq, &mut wc)?;
            }
        }
    }
    Ok(())
}

fn write_lat(
    a: &Args,
    s: &mut Side,
    size: usize,
    iters: usize,
    stamps: &mut [u64],
) -> AnyResult<()> {
    let client = a.server.is_some();
    let inline = size <= a.inline_size as usize;
    let mut wc = Completion::buffer(1);
    let (mut scnt, mut rcnt, mut ccnt) = (0usize, 0usize, 0usize);
    let src = s.src.slice(..size)?;
    let target = s.remote.slice(0, size as u64)?;
    let last = size - 1;
    let mut byte = [0u8; 1];
    while scnt < iters || ccnt < iters || rcnt < iters {
        // the server writes first (as perftest's write_lat does)
        if rcnt < iters && (client || scnt >= 1) {
            rcnt += 1;
            loop {
                s.dst.read_into(last, &mut byte)?;
                if byte[0] == rcnt as u8 {
                    break;
                }
            }
        }
        if scnt < iters {
            if client {
                stamps[scnt] = cycles();
            }
            scnt += 1;
            src.write_from(last, &[scnt as u8])?;
            let mut r = SendRequest::write(src.clone(), target).wr_id(scnt as u64);
            if inline {
                r = r.inline();
            }
            s.qp.post_send(r).map_err(|e| e.error)?;
        }
        if ccnt < iters {
            poll_some(&mut s.scq, &mut wc)?;
            ccnt += 1;
        }
    }
    Ok(())
}

fn read_lat(s: &mut Side, size: usize, iters: usize, stamps: &mut [u64]) -> AnyResult<()> {
    let mut wc = Completion::buffer(1);
    let dst = s.src.slice(..size)?;
    let from = s.remote.slice(0, size as u64)?;
    for (i, stamp) in stamps.iter_mut().enumerate().take(iters) {
        *stamp = cycles();
        s.qp.post_send(SendRequest::read(dst.clone(), from).wr_id(i as u64))
            .map_err(|e| e.error)?;
        poll_some(&mut s.scq, &mut wc)?;
    }
    Ok(())
}

/// The client side of the bandwidth tests; returns (first post, last completion).
fn bw_client(a: &Args, s: &mut Side, size: usize, iters: usize) -> AnyResult<(u64, u64)> {
    let src = s.src.slice(..size)?;
    let target = s.remote.slice(0, size as u64)?;
    let inline = size <= a.inline_size as usize;
    let mut wc = Completion::buffer(16);
    let (mut scnt, mut ccnt) = (0usize, 0usize);
    let mut start = None;
    while scnt < iters || ccnt < iters {
        while scnt < iters && scnt - ccnt < a.tx_depth {
            let signalled = (scnt + 1) % a.cq_mod == 0 || scnt + 1 == iters;
            let mut r = match a.test {
                Test::WriteBw => SendRequest::write(src.clone(), target),
                Test::ReadBw => SendRequest::read(src.clone(), target),
                _ => SendRequest::send(src.clone()),
            }
            .wr_id(scnt as u64);
            if !signalled {
                r = r.unsignaled();
            }
            if inline && a.test != Test::ReadBw {
                r = r.inline();
            }
            if start.is_none() {
                start = Some(cycles());
            }
            s.qp.post_send(r).map_err(|e| e.error)?;
            scnt += 1;
        }
        let n = poll_some(&mut s.scq, &mut wc)?;
        // a signalled completion retires every send posted before it
        ccnt = wc[n - 1].wr_id() as usize + 1;
    }
    let end = cycles();
    Ok((start.unwrap_or(end), end))
}

/// The server side of send_bw: keeps receives posted until `iters` arrived.
fn bw_server_recv(a: &Args, s: &mut Side, iters: usize) -> AnyResult<()> {
    let mut wc = Completion::buffer(16);
    let mut rcnt = 0usize;
    let mut posted = a.rx_depth;
    while rcnt < iters {
        let n = poll_some(&mut s.rcq, &mut wc)?;
        for c in &mut wc[..n] {
            rcnt += 1;
            if posted < iters {
                let h = c.take_buf().ok_or("receive without its buffer")?;
                s.qp.post_recv(h, c.wr_id()).map_err(|e| e.error)?;
                posted += 1;
            }
        }
    }
    Ok(())
}

fn report_lat(a: &Args, size: usize, stamps: &[u64], per_us: f64) {
    let rtt_factor = if a.test == Test::ReadLat { 1.0 } else { 2.0 };
    let mut d: Vec<f64> = stamps
        .windows(2)
        .map(|w| w[1].wrapping_sub(w[0]) as f64 / per_us / rtt_factor)
        .collect();
    d.sort_by(|x, y| x.total_cmp(y));
    let n = d.len();
    let typical = if (n - 1) % 2 == 1 {
        (d[n / 2] + d[n / 2 - 1]) / 2.0
    } else {
        d[n / 2]
    };
    let p99 = d[((n as f64 * 0.99).ceil() as usize).min(n - 1)];
    let avg = d.iter().sum::<f64>() / n as f64;
    println!(
        "RESULT test={:?} bytes={size} iters={} t_min_us={:.2} t_typical_us={typical:.2} t_avg_us={avg:.2} t_p99_us={p99:.2} t_max_us={:.2}",
        a.test,
        stamps.len(),
        d[0],
        d[n - 1]
    );
}

fn run(a: &Args) -> AnyResult<()> {
    let size = a.size.unwrap_or(if a.test.is_lat() { 2 } else { 65536 });
    let iters = a.iters.unwrap_or(if a.test.is_lat() { 1000 } else { 5000 });
    if size == 0 || iters < 5 || a.cq_mod == 0 || a.tx_depth == 0 || a.rx_depth == 0 {
        return Err("size must be > 0, iters >= 5, depths and cq-mod >= 1".into());
    }
    let (per_us, unit_source) = cycles_per_us();
    let mut s = setup(a, size)?;
    let client = a.server.is_some();
    let mut stamps = vec![0u64; iters];
    match (a.test, client) {
        (Test::SendLat, _) => send_lat(a, &mut s, size, iters, &mut stamps)?,
        (Test::WriteLat, _) => write_lat(a, &mut s, size, iters, &mut stamps)?,
        (Test::ReadLat, true) => read_lat(&mut s, size, iters, &mut stamps)?,
        (Test::WriteBw | Test::SendBw | Test::ReadBw, true) => {
            let (t0, t1) = bw_client(a, &mut s, size, iters)?;
            let secs = t1.wrapping_sub(t0) as f64 / per_us / 1e6;
            let mib = (size * iters) as f64 / (1 << 20) as f64;
            println!(
                "RESULT test={:?} bytes={size} iters={iters} bw_avg_MiBps={:.2} msg_rate_Mpps={:.6}",
                a.test,
                mib / secs,
                iters as f64 / secs / 1e6
            );
        }
        (Test::SendBw, false) => bw_server_recv(a, &mut s, iters)?,
        (Test::ReadLat | Test::WriteBw | Test::ReadBw, false) => {}
    }
    // the server stays until the client is done with its buffer
    sync(&mut s.sock)?;
    if client && a.test.is_lat() {
        report_lat(a, size, &stamps, per_us);
    }
    if client {
        println!("# time-stamp counter at {per_us:.3} ticks/µs ({unit_source})");
    }
    drop(s.dst_handle);
    drop(s.dst);
    Ok(())
}

fn main() -> ExitCode {
    fabric::cli::die_on_broken_pipe();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbs_perf: {e}");
            ExitCode::FAILURE
        }
    }
}
