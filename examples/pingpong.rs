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
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use fabric::perf::{self, Initiator, Peer, Row};
use fabric_core::backend::{self, Options};
use fabric_core::bootstrap::{self, Role};
use fabric_core::{Transport, TransportKind};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Ping-pong latency / bandwidth over fabric-core (perftest-style table)")]
struct Args {
    /// Wait for one peer on the bootstrap address (cross-machine run).
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Connect to a `--server` at HOST:PORT (cross-machine run).
    #[arg(long, value_name = "HOST:PORT")]
    connect: Option<String>,
    /// Bootstrap address `--server` binds.
    #[arg(long, default_value = "0.0.0.0:18515")]
    bind: String,
    /// Transport: shm, tcp or verbs (default: automatic; env FABRIC_TRANSPORT).
    #[arg(long)]
    transport: Option<TransportKind>,
    /// Shared secret both sides must present (env FABRIC_SECRET).
    #[arg(long)]
    secret: Option<String>,
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
    /// Internal: run as the responder spawned by a no-argument run.
    #[arg(long, hide = true, value_name = "ADDRESS")]
    responder: Option<String>,
}

fn main() {
    let mut args = Args::parse();
    if args.transport.is_none() {
        match std::env::var("FABRIC_TRANSPORT") {
            Ok(v) if !v.is_empty() => match v.parse() {
                Ok(k) => args.transport = Some(k),
                Err(e) => {
                    eprintln!("pingpong: FABRIC_TRANSPORT: {e}");
                    std::process::exit(2);
                }
            },
            _ => {}
        }
    }
    if args.secret.is_none() {
        args.secret = std::env::var("FABRIC_SECRET")
            .ok()
            .filter(|s| !s.is_empty());
    }
    if let Err(e) = run(&args) {
        eprintln!("pingpong: error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = Options::default();
    let timeout = Duration::from_secs(60);
    let max = args.max_size.max(args.min_size);
    if let Some(addr) = &args.responder {
        let mut c = backend::connect(addr, &opts)?;
        let conn = backend::connect_timeout(c.as_mut(), timeout)?;
        return Ok(perf::respond(&mut Peer::new(conn, timeout), max)?);
    }
    if args.server || args.connect.is_some() {
        let role = if args.server {
            Role::Server {
                bind: args.bind.clone(),
            }
        } else {
            Role::Client {
                server: args.connect.clone().unwrap_or_default(),
            }
        };
        eprintln!(
            "pingpong: {}",
            match &role {
                Role::Server { bind } => format!("waiting for a peer on {bind} (run the other side with --connect THIS_HOST:PORT)"),
                Role::Client { server } => format!("connecting to {server}"),
            }
        );
        let conn = bootstrap::pair(
            &role,
            args.transport,
            args.secret.as_deref(),
            &opts,
            timeout,
        )?;
        return if args.server {
            let mut peer = Peer::new(conn, timeout);
            Ok(perf::respond(&mut peer, max)?)
        } else {
            measure(args, conn, None)
        };
    }
    // No arguments: start our own peer process and run over the default transport.
    let kind = args.transport.unwrap_or(TransportKind::Shm);
    let mut listener = backend::listen(kind, &opts)?;
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .arg("--responder")
        .arg(listener.address())
        .arg("--max-size")
        .arg(max.to_string())
        .env_remove("FABRIC_TRANSPORT")
        .stdin(Stdio::null())
        .spawn()?;
    let start = Instant::now();
    let conn = loop {
        if let Some(c) = listener.accept()? {
            break c;
        }
        if let Some(st) = child.try_wait()? {
            return Err(format!("the peer process exited during setup ({st})").into());
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            return Err("the peer process did not connect within 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    drop(listener);
    let r = measure(args, conn, Some(&mut child));
    if r.is_err() {
        let _ = child.kill();
    }
    let st = child.wait()?;
    r?;
    if !st.success() {
        return Err(format!("the peer process failed ({st})").into());
    }
    Ok(())
}

fn measure(
    args: &Args,
    conn: Box<dyn Transport>,
    _child: Option<&mut Child>,
) -> Result<(), Box<dyn std::error::Error>> {
    let max = args.max_size.max(args.min_size);
    let kind = conn.kind();
    let caps = conn.capabilities();
    let mut ini = Initiator::new(Peer::new(conn, Duration::from_secs(60)), max)?;
    let sizes = perf::sizes(args.min_size, max);
    println!(
        "fabric pingpong: transport {kind} (in order: {}, one-sided: {}, atomics: {}); \
         latency = half round trip, BW = streaming sends, {} in flight",
        caps.ordering == fabric_core::MessageOrdering::InOrder,
        caps.one_sided,
        caps.atomics,
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
