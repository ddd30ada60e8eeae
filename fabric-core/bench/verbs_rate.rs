//! Message rate of fabric-core's verbs transport against the same pattern on ibverbs-safe
//! directly (issue 12): 8-byte SENDs, `depth` (32) in flight, one RC connection over one
//! device (loopback rxe in the Soft-RoCE guest), both ends in this thread.
//!
//! ```text
//! cargo build --release -p fabric-core --example verbs_rate
//! ci/softroce/run-in-guest.sh --layout lo -- target/release/examples/verbs_rate
//!     [--iters 1024] [--rounds 21] [--size 8] [--depth 32]
//! fabric-core/bench/callgrind-verbs-rate.sh     # instructions per message (in the guest)
//! ```
//!
//! The pattern, identical in both variants: A keeps `depth` sends in flight to B; B keeps
//! `depth` receives posted and reposts each one as it completes; a round ends when A has
//! every send completion and B every receive completion.
//! * `fabric`: two [`Transport`]s joined by `backend::listen`/`connect` (verbs), buffers
//!   from `Transport::register`, `post_send`/`post_recv`/`poll`, each post on its own;
//! * `fabric_batch`: the same, each burst of posts between `hold_posts` and `flush_posts`
//!   (one doorbell for the burst, a completion requested for every 16th and the last);
//! * `ibv`: two `ibverbs_safe` RC queue pairs (a CQ each), `SendRequest::send` with an owned
//!   `MrSlice` per post, every send signalled (ibverbs-safe "owned", as its
//!   `post_poll_bench`), `post_recv` of owned slices, `CompletionQueue::poll`.
//!
//! Rounds rotate among the three (the first of each is a warm-up); the time-stamp
//! counter is read at the start and end of each round only. Prints the median ns per
//! message of each, messages per second, and fabric/ibv rate ratio (target >= 0.9).
//! `BENCH_SETTLE=N`: sleep N ms before every poll pass so each burst has completed (exact
//! instruction counts under callgrind); `BENCH_ONLY=fabric|fabric_batch|ibv` runs one variant.
//!
//! Needs `FABRIC_VERBS_DEVICE` (else the first active device); prints
//! `skipped: no RDMA device` where there is none.

use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{Access, Buf, Completion, Error, Region, Transport, TransportKind};
use ibverbs_safe as ib;

type Conn = Box<dyn Transport>;

#[cfg(target_arch = "x86_64")]
fn cycles() -> u64 {
    // SAFETY: RDTSC only reads the time-stamp counter; it touches no memory.
    unsafe { std::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn cycles() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// A timeout check that reads the clock once every 4096 empty passes.
struct Deadline {
    end: Instant,
    empty: u32,
}

impl Deadline {
    fn new() -> Self {
        Deadline {
            end: Instant::now() + TIMEOUT,
            empty: 0,
        }
    }
    fn empty_pass(&mut self) {
        self.empty = self.empty.wrapping_add(1);
        if self.empty.is_multiple_of(4096) && Instant::now() > self.end {
            panic!("timed out");
        }
    }
}

/// `BENCH_SETTLE=N`: wait max(N, 2) ms before each poll pass.
fn settle() {
    static SETTLE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    let ms = SETTLE.get_or_init(|| {
        std::env::var("BENCH_SETTLE")
            .ok()
            .map(|v| v.parse::<u64>().unwrap_or(2).max(2))
    });
    if let Some(ms) = *ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

struct Args {
    iters: usize,
    rounds: usize,
    size: usize,
    depth: usize,
}

fn args() -> Args {
    let mut a = Args {
        iters: 1024,
        rounds: 21,
        size: 8,
        depth: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        let n: usize = v.parse().unwrap_or_else(|_| panic!("{k} N"));
        match k.as_str() {
            "--iters" | "-n" => a.iters = n,
            "--rounds" => a.rounds = n,
            "--size" | "-s" => a.size = n,
            "--depth" => a.depth = n,
            _ => panic!("unknown option {k}"),
        }
    }
    a
}

// ---------------------------------------------------------------------------- fabric-core

fn pair() -> Result<(Conn, Conn), Error> {
    let opts = Options::default();
    let mut l = backend::listen(TransportKind::Verbs, &opts)?;
    let mut c = backend::connect(l.address(), &opts)?;
    backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(30))
}

struct Fabric {
    a: Conn,
    b: Conn,
    src: Region,
    /// B's posted receive buffers between rounds.
    rx: Vec<Buf>,
    out: Vec<Completion>,
    size: usize,
}

impl Fabric {
    fn new(size: usize, depth: usize) -> Result<Self, Error> {
        let (mut a, mut b) = pair()?;
        let src = a.register(size.max(8), Access::empty())?;
        let dst = b.register(size.max(8) * depth, Access::empty())?;
        let rx = (0..depth)
            .map(|i| dst.slice(i * size.max(8), size))
            .collect::<Result<Vec<_>, _>>()?;
        let mut f = Fabric {
            a,
            b,
            src,
            rx,
            out: (0..depth.max(16)).map(|_| Completion::default()).collect(),
            size,
        };
        for (i, buf) in std::mem::take(&mut f.rx).into_iter().enumerate() {
            f.b.post_recv(buf, i as u64).map_err(|e| e.error)?;
        }
        Ok(f)
    }
}

/// One round over fabric-core: `iters` sends, `depth` in flight; B's receives stay posted
/// (each reposted as it completes). `held`: each burst of posts goes out behind one
/// doorbell ([`Transport::hold_posts`] / [`Transport::flush_posts`]). Inlined into the two
/// round functions below, which are never inlined: callgrind counts their inclusive cost.
#[inline(always)]
fn fabric_loop(f: &mut Fabric, iters: usize, depth: usize, held: bool) -> u64 {
    let mut deadline = Deadline::new();
    let t0 = cycles();
    let (mut posted, mut sent, mut received) = (0usize, 0usize, 0usize);
    while sent < iters || received < iters {
        if held {
            f.a.hold_posts();
        }
        while posted < iters && posted - sent < depth {
            let buf = f.src.slice(0, f.size).expect("slice");
            f.a.post_send(buf, posted as u64).expect("post_send");
            posted += 1;
        }
        if held {
            f.a.flush_posts();
        }
        settle();
        let n = f.a.poll(&mut f.out).expect("poll a");
        for c in &f.out[..n] {
            assert!(c.status.is_ok(), "send failed: {:?}", c.status);
        }
        sent += n;
        let m = f.b.poll(&mut f.out).expect("poll b");
        if held {
            f.b.hold_posts();
        }
        for c in &mut f.out[..m] {
            assert!(c.status.is_ok(), "receive failed: {:?}", c.status);
            let buf = c.buf.take().expect("receive buffer");
            f.b.post_recv(buf, c.wr_id).expect("post_recv");
        }
        if held {
            f.b.flush_posts();
        }
        received += m;
        if n + m == 0 {
            deadline.empty_pass();
        }
    }
    cycles() - t0
}

/// Every post starts at once (one doorbell per post).
#[inline(never)]
fn fabric_round(f: &mut Fabric, iters: usize, depth: usize) -> u64 {
    fabric_loop(f, iters, depth, false)
}

/// Each burst of posts held and flushed behind one doorbell.
#[inline(never)]
fn fabric_batch_round(f: &mut Fabric, iters: usize, depth: usize) -> u64 {
    fabric_loop(f, iters, depth, true)
}

// ---------------------------------------------------------------------------- ibverbs-safe

struct Ibv {
    qa: ib::QueuePair<ib::Rc>,
    qb: ib::QueuePair<ib::Rc>,
    cqa: ib::CompletionQueue,
    cqb: ib::CompletionQueue,
    src: ib::MrSlice,
    out: Vec<ib::Completion>,
    _mrs: (ib::MemoryRegion<ib::AlignedBuffer, ib::Local>,),
}

fn pick_gid(ctx: &ib::Context) -> u8 {
    let t = ctx.gid_table(1).unwrap_or_default();
    t.iter()
        .find(|e| {
            e.gid.to_ipv6().to_ipv4_mapped().is_some() && e.gid_type != Some(ib::GidType::RoceV1)
        })
        .or_else(|| t.first())
        .map_or(0, |e| e.index as u8)
}

impl Ibv {
    fn new(size: usize, depth: usize) -> ib::Result<Self> {
        let dev = std::env::var("FABRIC_VERBS_DEVICE").ok();
        let ctx = ib::open(dev.as_deref())?;
        let gid = pick_gid(&ctx);
        let pd = ctx.alloc_pd()?;
        let cqa = ctx.create_cq(4 * depth as u32 + 16)?;
        let cqb = ctx.create_cq(4 * depth as u32 + 16)?;
        let pa = pd
            .queue_pair(&cqa, &cqa)
            .gid_index(gid)
            .max_send_wr(depth as u32)
            .build_rc()?;
        let pb = pd
            .queue_pair(&cqb, &cqb)
            .gid_index(gid)
            .max_recv_wr(depth as u32)
            .build_rc()?;
        let (ea, eb) = (pa.endpoint(), pb.endpoint());
        let qa = pa.connect(&eb)?;
        let mut qb = pb.connect(&ea)?;
        let mut src_mr = pd.alloc_region(size.max(8))?;
        let src = src_mr.slice(..size)?;
        let mut dst_mr = pd.alloc_region(size.max(8) * depth)?;
        for i in 0..depth {
            let s = dst_mr.slice(i * size.max(8)..i * size.max(8) + size)?;
            qb.post_recv(s, i as u64).map_err(|e| e.error)?;
        }
        drop(dst_mr);
        Ok(Ibv {
            qa,
            qb,
            cqa,
            cqb,
            src,
            out: ib::Completion::buffer(depth.max(16)),
            _mrs: (src_mr,),
        })
    }
}

/// The same round on ibverbs-safe directly (owned handles, every send signalled).
#[inline(never)]
fn ibv_round(v: &mut Ibv, iters: usize, depth: usize) -> u64 {
    let mut deadline = Deadline::new();
    let t0 = cycles();
    let (mut posted, mut sent, mut received) = (0usize, 0usize, 0usize);
    while sent < iters || received < iters {
        while posted < iters && posted - sent < depth {
            v.qa.post_send(ib::SendRequest::send(v.src.clone()).wr_id(posted as u64))
                .expect("post_send");
            posted += 1;
        }
        settle();
        let n = v.cqa.poll(&mut v.out).expect("poll a");
        for c in &v.out[..n] {
            assert!(c.is_ok(), "send failed: {}", c.status());
        }
        sent += n;
        let m = v.cqb.poll(&mut v.out).expect("poll b");
        for c in &mut v.out[..m] {
            assert!(c.is_ok(), "receive failed: {}", c.status());
            let id = c.wr_id();
            let s = c.take_buf().expect("receive buffer");
            v.qb.post_recv(s, id).expect("post_recv");
        }
        received += m;
        if n + m == 0 {
            deadline.empty_pass();
        }
    }
    cycles() - t0
}

// ---------------------------------------------------------------------------- main

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run() -> Result<(), String> {
    let a = args();
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let mut ibv = match Ibv::new(a.size, a.depth) {
        Ok(v) => v,
        Err(e @ (ib::Error::NoDevice { .. } | ib::Error::LibraryUnavailable { .. })) => {
            println!("skipped: no RDMA device ({e}) [lacks rdma]");
            return Ok(());
        }
        Err(e) => return Err(format!("ibverbs-safe setup: {e}")),
    };
    let mut fab = Fabric::new(a.size, a.depth).map_err(|e| format!("fabric setup: {e}"))?;
    let (clock0, tsc0) = (Instant::now(), cycles());
    let mut t: [Vec<f64>; 3] = Default::default();
    let names = ["fabric", "fabric_batch", "ibv"];
    for round in 0..=a.rounds {
        for k in 0..3 {
            let v = (round + k) % 3;
            if !only.is_empty() && only != names[v] {
                continue;
            }
            let ticks = match v {
                0 => fabric_round(&mut fab, a.iters, a.depth),
                1 => fabric_batch_round(&mut fab, a.iters, a.depth),
                _ => ibv_round(&mut ibv, a.iters, a.depth),
            };
            if round > 0 {
                t[v].push(ticks as f64 / a.iters as f64);
            }
        }
    }
    let ns = clock0.elapsed().as_nanos() as f64 / cycles().wrapping_sub(tsc0).max(1) as f64;
    let [mut tf, mut tb, mut ti] = t;
    let (f, b, i) = (
        median(&mut tf) * ns,
        median(&mut tb) * ns,
        median(&mut ti) * ns,
    );
    println!(
        "verbs message rate, {} B SEND, {} in flight, {} rounds x {} messages (medians)",
        a.size, a.depth, a.rounds, a.iters
    );
    println!(
        "fabric-core {:.0} ns/msg {:.0} msg/s | fabric-core held+flushed {:.0} ns/msg {:.0} msg/s | ibverbs-safe {:.0} ns/msg {:.0} msg/s",
        f,
        1e9 / f,
        b,
        1e9 / b,
        i,
        1e9 / i
    );
    println!(
        "rate ratio fabric/ibv {:.3}, held+flushed/ibv {:.3} (target >= 0.9)",
        i / f,
        i / b
    );
    drop(fab);
    drop(ibv);
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("verbs_rate: {e}");
        std::process::exit(1);
    }
}
