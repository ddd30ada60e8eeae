//! Per-message cost of post + poll through the safe API against the raw op-table call, on
//! the same QPs in the same run (RC loopback RDMA WRITE).
//!
//! ```text
//! cargo run --release -p ibverbs-safe --example post_poll_bench -- [--dev rxe0] [--gid 1]
//!     [--iters 500] [--rounds 41] [--size 8] [--depth 32]
//! ```
//!
//! Three variants — safe with owned handles, safe scoped (borrowing), raw — in two patterns,
//! each measured in many short interleaved rounds (the order rotates every round, so drift
//! favours none), reported as medians per message:
//! * `latency`: post one signalled WRITE, poll until it completed, repeat;
//! * `pipelined`: keep `depth` signalled WRITEs in flight, polling completions in batches.
//!
//! Timing: the time-stamp counter is read once at the start and once at the end of each round
//! (as `examples/verbs_perf.rs` reads it), never per message; the monotonic clock is read only
//! to convert counter ticks to ns over the whole run, and for the timeout, once every 4096
//! empty polls. (In the TCG guest a `clock_gettime` is a system call plus an emulated HPET
//! read, about 5 µs: per message, that would pull every ratio toward 1.0.)
//!
//! Prints `skipped: no RDMA device [lacks rdma]` (exit 0) where there is none; where
//! `FABRIC_REQUIRE` lists `rdma` that is an error (exit 1) instead.
use ibverbs_safe::raw::{self, ibv_sge, ibv_wc};
use ibverbs_safe::*;
use std::time::{Duration, Instant};

/// The time-stamp counter (as perftest's `get_cycles()` and `examples/verbs_perf.rs`).
#[cfg(target_arch = "x86_64")]
fn cycles() -> u64 {
    // SAFETY: RDTSC only reads the time-stamp counter (every x86_64 CPU has it); it touches
    // no memory.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Elsewhere: nanoseconds since the first call.
#[cfg(not(target_arch = "x86_64"))]
fn cycles() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A timeout check that reads the clock only once every 4096 calls (each one an empty poll).
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
    fn empty_poll(&mut self) {
        self.empty = self.empty.wrapping_add(1);
        if self.empty.is_multiple_of(4096) && Instant::now() > self.end {
            panic!("timed out");
        }
    }
}

struct Args {
    dev: Option<String>,
    gid: Option<u8>,
    iters: usize,
    rounds: usize,
    size: usize,
    depth: usize,
}

fn args() -> Args {
    let mut a = Args {
        dev: None,
        gid: None,
        iters: 500,
        rounds: 41,
        size: 8,
        depth: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--dev" | "-d" => a.dev = Some(v),
            "--gid" | "-g" => a.gid = Some(v.parse().expect("--gid N")),
            "--iters" | "-n" => a.iters = v.parse().expect("--iters N"),
            "--rounds" => a.rounds = v.parse().expect("--rounds N"),
            "--size" | "-s" => a.size = v.parse().expect("--size N"),
            "--depth" => a.depth = v.parse().expect("--depth N"),
            _ => panic!("unknown option {k}"),
        }
    }
    a
}

fn pick_gid(ctx: &Context) -> u8 {
    let t = ctx.gid_table(1).unwrap_or_default();
    t.iter()
        .find(|e| e.gid.to_ipv6().to_ipv4_mapped().is_some() && e.gid_type != Some(GidType::RoceV1))
        .or_else(|| t.first())
        .map_or(0, |e| e.index as u8)
}

const TIMEOUT: Duration = Duration::from_secs(30);

/// Safe API: owned handle per post (an `Arc` clone), completion hands it back (dropped).
/// (Never inlined, like the other two: callgrind counts each round function's inclusive cost.)
#[inline(never)]
fn safe_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    remote: RemoteMemory,
    iters: usize,
    depth: usize,
    out: &mut [Completion],
) -> u64 {
    let mut deadline = Deadline::new();
    let t0 = cycles();
    let (mut posted, mut done) = (0usize, 0usize);
    while done < iters {
        while posted < iters && posted - done < depth {
            qp.post_send(SendRequest::write(src.clone(), remote).wr_id(posted as u64))
                .expect("post");
            posted += 1;
        }
        settle();
        let n = cq.poll(out).expect("poll");
        for c in &out[..n] {
            assert!(c.is_ok(), "completion error {}", c.status());
        }
        done += n;
        if n == 0 {
            deadline.empty_poll();
        }
    }
    cycles() - t0
}

/// Safe scoped API: posts borrow the region (no handle per post); the scope waits at the end.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn scoped_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MemoryRegion,
    len: usize,
    remote: RemoteMemory,
    iters: usize,
    depth: usize,
    out: &mut [Completion],
) -> u64 {
    let mut deadline = Deadline::new();
    let t0 = cycles();
    qp.scope(cq, TIMEOUT, |s| {
        let (mut posted, mut done) = (0usize, 0usize);
        while done < iters {
            while posted < iters && posted - done < depth {
                s.write(src, ..len, remote, posted as u64).expect("post");
                posted += 1;
            }
            settle();
            let n = s.poll(out).expect("poll");
            for c in &out[..n] {
                assert!(c.is_ok(), "completion error {}", c.status());
            }
            done += n;
            if n == 0 {
                deadline.empty_poll();
            }
        }
    })
    .expect("scope");
    cycles() - t0
}

/// Raw op-table calls: a prepared `ibv_send_wr`, `post_send_raw` and `poll_raw`.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn raw_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    remote: RemoteMemory,
    iters: usize,
    depth: usize,
    wcs: &mut [ibv_wc],
) -> u64 {
    let mut sge = ibv_sge {
        addr: src.addr(),
        length: src.len() as u32,
        lkey: src.lkey(),
    };
    let mut deadline = Deadline::new();
    let t0 = cycles();
    let (mut posted, mut done) = (0usize, 0usize);
    while done < iters {
        while posted < iters && posted - done < depth {
            let mut wr = raw::send_wr();
            wr.wr_id = ((posted as u64) << 1) | 1;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = raw::IBV_WR_RDMA_WRITE;
            wr.send_flags = raw::IBV_SEND_SIGNALED;
            wr.wr.rdma = raw::ibv_send_wr_rdma {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            };
            // SAFETY: one valid WR with one SGE inside `src`'s registration, which stays
            // alive (we hold `src`) and is not written by the CPU during the run; its
            // completion is polled below with poll_raw.
            unsafe { qp.post_send_raw(&mut wr) }.expect("raw post");
            posted += 1;
        }
        settle();
        let n = cq.poll_raw(wcs).expect("raw poll");
        for wc in &wcs[..n] {
            assert_eq!(wc.status, 0, "completion error");
        }
        done += n;
        if n == 0 {
            deadline.empty_poll();
        }
    }
    cycles() - t0
}

/// With `BENCH_SETTLE=1`, wait before each poll so the burst has completed: every poll then
/// finds work and no spin loop runs, which makes instruction counts (callgrind) exact.
/// `BENCH_SETTLE=N` waits max(N, 2) ms (under valgrind in the TCG guest, use 20).
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

/// Nanoseconds per counter tick, measured over everything since `(clock0, tsc0)`.
fn ns_per_tick(clock0: Instant, tsc0: u64) -> f64 {
    let ticks = cycles().wrapping_sub(tsc0).max(1);
    clock0.elapsed().as_nanos() as f64 / ticks as f64
}

fn median(v: &mut Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let a = args();
    let ctx = match open(a.dev.as_deref()) {
        Ok(c) => c,
        Err(e @ (Error::NoDevice { .. } | Error::LibraryUnavailable { .. })) => {
            let required = std::env::var("FABRIC_REQUIRE").unwrap_or_default();
            if required.split(',').any(|c| c.trim() == "rdma") {
                eprintln!("this machine must have `rdma` (FABRIC_REQUIRE={required}), but: {e}");
                std::process::exit(1);
            }
            println!("skipped: no RDMA device ({e}) [lacks rdma]");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let gid = a.gid.unwrap_or_else(|| pick_gid(&ctx));
    let pd = ctx.alloc_pd()?;
    let mut cq = ctx.create_cq(4 * a.depth as u32 + 16)?;
    let peer_cq = ctx.create_cq(16)?;
    let depth = a.depth as u32;
    let qa = pd
        .queue_pair(&cq, &cq)
        .gid_index(gid)
        .max_send_wr(depth)
        .build_rc()?;
    let qb = pd
        .queue_pair(&peer_cq, &peer_cq)
        .gid_index(gid)
        .build_rc()?;
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    let mut qp = qa.connect(&eb)?;
    let _peer = qb.connect(&ea)?;
    let target = pd.register_remote(AlignedBuffer::new(a.size.max(8))?, RemoteAccess::WRITE)?;
    let remote = target.remote().slice(0, a.size as u64)?;
    let mut src_mr = pd.alloc_region(a.size.max(8))?;
    let src = src_mr.slice(..a.size)?;
    let mut out = Completion::buffer(a.depth.max(16));
    let mut wcs = vec![ibv_wc::default(); a.depth.max(16)];

    // Counter ticks to ns, over the whole run (outside every timed round).
    let (clock0, tsc0) = (Instant::now(), cycles());
    println!(
        "post+poll cost, RC RDMA WRITE of {} B on {} (GID {gid}): {} rounds x {} messages per variant, \
         variants interleaved (order rotates every round); medians",
        a.size,
        ctx.device().name,
        a.rounds,
        a.iters
    );
    println!(
        "{:<10} {:>5} {:>12} {:>12} {:>12} {:>11} {:>11} {:>13} {:>13}",
        "pattern",
        "depth",
        "owned ns/msg",
        "scoped ns/msg",
        "raw ns/msg",
        "owned/raw",
        "scoped/raw",
        "paired owned",
        "paired scoped"
    );
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let names = ["owned", "scoped", "raw"];
    let patterns: &[(&str, usize)] = if std::env::var_os("BENCH_SETTLE").is_some() {
        &[("pipelined", a.depth)]
    } else {
        &[("latency", 1), ("pipelined", a.depth)]
    };
    for &(name, d) in patterns {
        // Warm-up.
        safe_round(&mut qp, &mut cq, &src, remote, a.iters, d, &mut out);
        scoped_round(
            &mut qp, &mut cq, &src_mr, a.size, remote, a.iters, d, &mut out,
        );
        raw_round(&mut qp, &mut cq, &src, remote, a.iters, d, &mut wcs);
        let mut t: [Vec<f64>; 3] = Default::default();
        let (mut pair_owned, mut pair_scoped) = (vec![], vec![]);
        // per-message cost in counter ticks; converted to ns at the end
        let per = |ticks: u64| ticks as f64 / a.iters as f64;
        for round in 0..a.rounds {
            let mut this = [f64::NAN; 3];
            for k in 0..3 {
                let v = (round + k) % 3;
                if !only.is_empty() && only != names[v] {
                    continue;
                }
                let total = match v {
                    0 => safe_round(&mut qp, &mut cq, &src, remote, a.iters, d, &mut out),
                    1 => scoped_round(
                        &mut qp, &mut cq, &src_mr, a.size, remote, a.iters, d, &mut out,
                    ),
                    _ => raw_round(&mut qp, &mut cq, &src, remote, a.iters, d, &mut wcs),
                };
                this[v] = per(total);
                t[v].push(this[v]);
            }
            pair_owned.push(this[0] / this[2]);
            pair_scoped.push(this[1] / this[2]);
        }
        if std::env::var_os("BENCH_VERBOSE").is_some() {
            for (n, v) in names.iter().zip(&t) {
                println!("  {n} rounds: {v:.0?}");
            }
        }
        let [mut o, mut sc, mut r] = t;
        let ns = ns_per_tick(clock0, tsc0);
        let (mo, ms, mr) = (
            median(&mut o) * ns,
            median(&mut sc) * ns,
            median(&mut r) * ns,
        );
        println!(
            "{:<10} {:>5} {:>12.0} {:>12.0} {:>12.0} {:>11.3} {:>11.3} {:>13.3} {:>13.3}",
            name,
            d,
            mo,
            ms,
            mr,
            mo / mr,
            ms / mr,
            median(&mut pair_owned),
            median(&mut pair_scoped)
        );
    }
    println!("(owned: SendRequest with an MrSlice handle per post; scoped: QueuePair::scope borrowing the region; raw: post_send_raw/poll_raw; paired = median of per-round ratios to raw; timed with the time-stamp counter per round, {:.3} ns per tick over the run)", ns_per_tick(clock0, tsc0));
    drop(out);
    drop(src);
    assert_eq!(src_mr.outstanding(), 0, "every handle came back");
    Ok(())
}
