//! Streaming bandwidth over a `fabric-core` transport: two-sided unidirectional and
//! bidirectional, one-sided write and read; next to it, single-thread `memcpy` bandwidth
//! measured in the same run by the receiving side on its own CPU, right after each send
//! trial (the ceiling for a copy-based transport; the ratio is the median of the trials'
//! ratios, see [`fabric::perf::median_ratio`]).
//!
//! ```text
//! cargo run --release --example bandwidth                       # starts its own peer; shm
//! cargo run --release --example bandwidth -- --transport tcp
//! cargo run --release --example bandwidth -- --server           # host A
//! cargo run --release --example bandwidth -- --connect A:18515  # host B
//! ```

use std::io::IsTerminal;

use clap::Parser;
use fabric::perf::{self, Initiator, Peer, PeerArgs};
use indicatif::{ProgressBar, ProgressDrawTarget};

#[derive(Parser, Debug)]
#[command(about = "Bandwidth over fabric-core: send, bidirectional send, write, read")]
struct Args {
    #[command(flatten)]
    peer: PeerArgs,
    /// Smallest message size in bytes.
    #[arg(long, default_value_t = 4096)]
    min_size: usize,
    /// Largest message size in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_size: usize,
    /// Iterations per size and mode (default: scaled with the size).
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed messages streamed before each size and mode's trials, in the same mode
    /// (default: a quarter of the iterations). A cold start (TCP's socket buffers growing
    /// from their initial sizes, first touches of the rings' and regions' pages) otherwise
    /// counts in the figure; `ucx_perftest` warms up too (`-w`, 10,000 by default), and
    /// `fabric-core/bench/compare.sh` gives both the same count.
    #[arg(long)]
    warmup: Option<usize>,
    /// Trials per measurement; the best is printed (filters out preemption on busy hosts).
    #[arg(long, default_value_t = 3)]
    trials: usize,
    /// Mark the receive buffers of the send and bisend phases as streaming
    /// (`Region::set_streaming`): shm copies messages of 64 KiB and more into them with
    /// non-temporal stores. The memcpy reference stays an ordinary `memcpy`.
    #[arg(long)]
    streaming_receives: bool,
    /// Modes to run, comma separated: send, bisend, write, read.
    #[arg(long, default_value = "send,bisend,write,read", value_delimiter = ',')]
    modes: Vec<String>,
}

fn main() {
    let args = Args::parse();
    let max = args.max_size.max(args.min_size);
    perf::main_with("bandwidth", &args.peer, max, |peer| measure(&args, peer));
}

/// One measurement of `mode`: MiB/s, or `None` for a one-sided mode on a transport without
/// one-sided operations.
fn run_mode(
    ini: &mut Initiator,
    mode: &str,
    size: usize,
    n: usize,
    one_sided: bool,
) -> fabric_core::Result<Option<f64>> {
    Ok(match mode {
        "send" => Some(ini.stream(size, n, false)?),
        "bisend" => Some(ini.stream(size, n, true)?),
        "write" | "read" if !one_sided => None,
        "write" => Some(ini.one_sided(size, n, false)?),
        _ => Some(ini.one_sided(size, n, true)?),
    })
}

fn measure(args: &Args, mut peer: Peer) -> Result<(), Box<dyn std::error::Error>> {
    let max = args.max_size.max(args.min_size);
    let engine = peer.engine();
    let conn = peer.conn()?;
    let (kind, caps) = (conn.kind(), conn.capabilities());
    let mut ini = Initiator::new(peer, max)?;
    ini.set_streaming_receives(args.streaming_receives);
    let sizes = perf::sizes(args.min_size, max);
    let modes: Vec<&str> = args.modes.iter().map(|s| s.trim()).collect();
    for m in &modes {
        if !["send", "bisend", "write", "read"].contains(m) {
            return Err(format!("unknown mode {m:?}").into());
        }
    }
    println!(
        "fabric bandwidth: transport {kind} on the {engine}, {} in flight, MiB/s (bisend: per direction); \
         memcpy = one thread of the receiving side copying the same sizes on its CPU, right after \
         each send trial; best of {} trials, each size and mode after {} untimed messages; \
         send/memcpy = the median of the trials' ratios{}",
        perf::WINDOW,
        args.trials.max(1),
        args
            .warmup
            .map_or_else(|| "iterations / 4".into(), |w| w.to_string()),
        if args.streaming_receives {
            format!(
                "; receives streaming (non-temporal copies from {} KiB on shm)",
                fabric_core::Region::STREAMING_MIN_BYTES >> 10
            )
        } else {
            String::new()
        }
    );
    let mut head = format!("{:>10}", "#bytes");
    for m in &modes {
        head += &format!(" {m:>12}");
    }
    head += &format!(" {:>12} {:>10}", "memcpy", "send/memcpy");
    println!("{head}");
    let pb = if std::io::stdout().is_terminal() {
        ProgressBar::with_draw_target(Some(sizes.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    for &size in &sizes {
        let iters = args.iters.unwrap_or_else(|| perf::bw_iters(size));
        let warmup = args.warmup.unwrap_or(iters / 4);
        let mut line = format!("{size:>10}");
        // (send, memcpy) of each send trial, measured back to back.
        let mut pairs: Vec<(f64, f64)> = Vec::new();
        for m in &modes {
            pb.set_message(format!("{size} B {m}"));
            let mut bw: Option<f64> = None;
            if warmup > 0 {
                run_mode(&mut ini, m, size, warmup, caps.one_sided)?; // not timed
            }
            for _ in 0..args.trials.max(1) {
                let b = run_mode(&mut ini, m, size, iters, caps.one_sided)?;
                if let (true, Some(s)) = (*m == "send", b) {
                    // The reference right after, so both see the same host.
                    pairs.push((s, ini.peer_memcpy(size, iters)?));
                }
                bw = match (bw, b) {
                    (Some(x), Some(y)) => Some(x.max(y)),
                    (x, y) => x.or(y),
                };
            }
            line += &match bw {
                Some(b) => format!(" {b:>12.1}"),
                None => format!(" {:>12}", "n/a"),
            };
        }
        if pairs.is_empty() {
            // No send mode: the reference alone.
            let mut mc = 0.0f64;
            for _ in 0..args.trials.max(1) {
                mc = mc.max(ini.peer_memcpy(size, iters)?);
            }
            line += &format!(" {mc:>12.1} {:>10}", "-");
        } else {
            let mc = pairs.iter().map(|p| p.1).fold(0.0, f64::max);
            line += &format!(" {mc:>12.1} {:>10.2}", perf::median_ratio(&pairs));
        }
        pb.suspend(|| println!("{line}"));
        pb.inc(1);
    }
    pb.finish_and_clear();
    ini.quit()?;
    Ok(())
}
