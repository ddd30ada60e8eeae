//! Streaming bandwidth over a `fabric-core` transport: two-sided unidirectional and
//! bidirectional, one-sided write and read; next to it, single-thread `memcpy` bandwidth
//! measured in the same run (the ceiling for a copy-based transport).
//!
//! ```text
//! cargo run --release --example bandwidth                       # starts its own peer; shm
//! cargo run --release --example bandwidth -- --transport tcp
//! cargo run --release --example bandwidth -- --server           # host A
//! cargo run --release --example bandwidth -- --connect A:18515  # host B
//! ```

use std::io::IsTerminal;
use std::time::Instant;

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
    /// Modes to run, comma separated: send, bisend, write, read.
    #[arg(long, default_value = "send,bisend,write,read", value_delimiter = ',')]
    modes: Vec<String>,
}

fn main() {
    let args = Args::parse();
    let max = args.max_size.max(args.min_size);
    perf::main_with("bandwidth", &args.peer, max, |peer| measure(&args, peer));
}

/// Single-thread memcpy bandwidth for `size`-byte copies into 16 rotating destinations
/// (the receiver's pattern), MiB/s.
fn memcpy_bw(size: usize, iters: usize) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst: Vec<Vec<u8>> = (0..perf::WINDOW).map(|_| vec![0u8; size]).collect();
    for d in dst.iter_mut() {
        d.copy_from_slice(&src);
    }
    let t0 = Instant::now();
    for i in 0..iters {
        let d = &mut dst[i % perf::WINDOW];
        d.copy_from_slice(&src);
        std::hint::black_box(&d);
    }
    (size * iters) as f64 / t0.elapsed().as_secs_f64() / (1 << 20) as f64
}

fn measure(args: &Args, mut peer: Peer) -> Result<(), Box<dyn std::error::Error>> {
    let max = args.max_size.max(args.min_size);
    let engine = peer.engine();
    let conn = peer.conn()?;
    let (kind, caps) = (conn.kind(), conn.capabilities());
    let mut ini = Initiator::new(peer, max)?;
    let sizes = perf::sizes(args.min_size, max);
    let modes: Vec<&str> = args.modes.iter().map(|s| s.trim()).collect();
    for m in &modes {
        if !["send", "bisend", "write", "read"].contains(m) {
            return Err(format!("unknown mode {m:?}").into());
        }
    }
    println!(
        "fabric bandwidth: transport {kind} on the {engine}, {} in flight, MiB/s (bisend: per direction); \
         memcpy = one thread copying the same sizes in this run; best of {} trials, each size and \
         mode after {} untimed messages",
        perf::WINDOW,
        args.trials.max(1),
        args
            .warmup
            .map_or_else(|| "iterations / 4".into(), |w| w.to_string())
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
        let mut send_bw = None;
        for m in &modes {
            pb.set_message(format!("{size} B {m}"));
            let mut bw: Option<f64> = None;
            let mut run = |n: usize| -> fabric_core::Result<Option<f64>> {
                Ok(match *m {
                    "send" => Some(ini.stream(size, n, false)?),
                    "bisend" => Some(ini.stream(size, n, true)?),
                    "write" | "read" if !caps.one_sided => None,
                    "write" => Some(ini.one_sided(size, n, false)?),
                    _ => Some(ini.one_sided(size, n, true)?),
                })
            };
            if warmup > 0 {
                run(warmup)?; // not timed
            }
            for _ in 0..args.trials.max(1) {
                let b = run(iters)?;
                bw = match (bw, b) {
                    (Some(x), Some(y)) => Some(x.max(y)),
                    (x, y) => x.or(y),
                };
            }
            if *m == "send" {
                send_bw = bw;
            }
            line += &match bw {
                Some(b) => format!(" {b:>12.1}"),
                None => format!(" {:>12}", "n/a"),
            };
        }
        let mc = (0..args.trials.max(1))
            .map(|_| memcpy_bw(size, iters))
            .fold(0.0, f64::max);
        line += &format!(" {mc:>12.1}");
        line += &match send_bw {
            Some(s) => format!(" {:>10.2}", s / mc),
            None => format!(" {:>10}", "-"),
        };
        pb.suspend(|| println!("{line}"));
        pb.inc(1);
    }
    pb.finish_and_clear();
    ini.quit()?;
    Ok(())
}
