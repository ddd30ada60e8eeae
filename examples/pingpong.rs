//! Ping-pong latency and streaming bandwidth over a `fabric-core` transport, printed as a
//! perftest-style table for 8 B ... 4 MiB.
//!
//! ```text
//! cargo run --release --example pingpong                      # starts its own peer; shm
//! cargo run --release --example pingpong -- --transport tcp   # same, over loopback TCP
//! cargo run --release --example pingpong -- --server          # host A (waits for one peer)
//! cargo run --release --example pingpong -- --connect A:18515 # host B
//! ```
//! `FABRIC_TRANSPORT=shm|tcp|verbs` overrides automatic selection like `--transport`.

use std::io::IsTerminal;
use std::time::Duration;

use clap::Parser;
use fabric::perf::{self, Initiator, Peer, PeerArgs, Row};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Ping-pong latency / bandwidth over fabric-core (perftest-style table)")]
struct Args {
    #[command(flatten)]
    peer: PeerArgs,
    /// Smallest message size in bytes.
    #[arg(long, default_value_t = 8)]
    min_size: usize,
    /// Largest message size in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_size: usize,
    /// Iterations per size (default: scaled with the size).
    #[arg(long)]
    iters: Option<usize>,
    /// Skip the bandwidth column.
    #[arg(long)]
    no_bw: bool,
}

fn main() {
    let args = Args::parse();
    let max = args.max_size.max(args.min_size);
    perf::main_with("pingpong", &args.peer, max, |peer| measure(&args, peer));
}

fn measure(args: &Args, mut peer: Peer) -> Result<(), Box<dyn std::error::Error>> {
    let max = args.max_size.max(args.min_size);
    let engine = peer.engine();
    let conn = peer.conn()?;
    let (kind, caps) = (conn.kind(), conn.capabilities());
    let mut ini = Initiator::new(peer, max)?;
    let sizes = perf::sizes(args.min_size, max);
    println!(
        "fabric pingpong: transport {kind} on the {engine} (in order: {}, one-sided: {}, atomics: {}); \
         latency = half a round trip (whole iterations timed, as ucx_perftest does, with the {}), BW = streaming sends, {} in flight",
        caps.ordering == fabric_core::MessageOrdering::InOrder,
        caps.one_sided,
        caps.atomics,
        ini.clock().name(),
        perf::WINDOW
    );
    let pb = if std::io::stdout().is_terminal() {
        ProgressBar::with_draw_target(Some(sizes.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg:>18} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(100));
    perf::print_header();
    for &size in &sizes {
        pb.set_message(format!("{size} B latency"));
        let li = args.iters.unwrap_or_else(|| perf::lat_iters(size));
        // Warm-up, then the measured run.
        ini.pingpong(size, (li / 10).max(10))?;
        let (typ, p99) = ini.pingpong(size, li)?;
        let bw = if args.no_bw {
            None
        } else {
            pb.set_message(format!("{size} B bandwidth"));
            let bi = args.iters.unwrap_or_else(|| perf::bw_iters(size));
            Some(ini.stream(size, bi, false)?)
        };
        let row = Row {
            size,
            iters: li,
            lat_typical_us: typ,
            lat_p99_us: p99,
            bw_mib_s: bw,
        };
        pb.suspend(|| perf::print_row(&row));
        pb.inc(1);
    }
    pb.finish_and_clear();
    ini.quit()?;
    Ok(())
}
