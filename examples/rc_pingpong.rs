//! `ibv_rc_pingpong` on `ibverbs-safe`: the same program as rdma-core's example, wire
//! compatible with it (TCP handshake of [`fabric::pingpong_wire`], default port 18515), with
//! the same options and output lines, so our server works with their client and the other
//! way round.
//!
//! ```sh
//! cargo run --example rc_pingpong -- -d rxe0 -g 1               # server
//! cargo run --example rc_pingpong -- -d rxe0 -g 1 127.0.0.1     # client
//! ```
//!
//! Both sides post `-r` receives into one `-s`-byte buffer; the client sends first, and each
//! side sends its next message once its previous send and one receive have completed,
//! `-n` times. Completions are busy-polled, or waited for on a completion channel with `-e`.
//! Without a device it exits with the library's typed error (e.g. "no RDMA device").

use std::error::Error;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use fabric::pingpong_wire::{self, Destination, WireError, DONE, MESSAGE_LEN};
use ibverbs_safe::{
    Completion, Endpoint, Gid, LinkLayer, MrSlice, Mtu, QueuePair, Rc, RemoteAccess, SendRequest,
};

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// How long either side waits for the other during the TCP handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Parser, Debug)]
#[command(
    name = "rc_pingpong",
    about = "Ping-pong over an RC queue pair, compatible with rdma-core's ibv_rc_pingpong",
    long_about = "Start without SERVERNAME to be the server, with it to connect to one.\n\
                  The handshake and output are those of rdma-core's ibv_rc_pingpong."
)]
struct Args {
    /// Listen on / connect to this TCP port.
    #[arg(short = 'p', long = "port", default_value_t = pingpong_wire::DEFAULT_PORT)]
    port: u16,
    /// Use this IB device (default: the first one found).
    #[arg(short = 'd', long = "ib-dev")]
    ib_dev: Option<String>,
    /// Use this port of the IB device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// Size of the message to exchange.
    #[arg(short = 's', long = "size", default_value_t = 4096)]
    size: u32,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(short = 'm', long = "mtu", default_value_t = 1024, value_parser = parse_mtu_bytes)]
    mtu: u32,
    /// Number of receives to post at a time.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 500)]
    rx_depth: u32,
    /// Number of exchanges.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    iters: u32,
    /// Service level.
    #[arg(short = 'l', long = "sl", default_value_t = 0)]
    sl: u8,
    /// Sleep on completion events instead of busy-polling.
    #[arg(short = 'e', long = "events")]
    events: bool,
    /// Local port GID index (needed on RoCE).
    #[arg(short = 'g', long = "gid-idx")]
    gid_idx: Option<u8>,
    /// The server to connect to (be the server when absent).
    servername: Option<String>,
}

fn parse_mtu_bytes(s: &str) -> Result<u32, String> {
    let v: u32 = s.parse().map_err(|e| format!("{e}"))?;
    Mtu::from_bytes(v)
        .map(|_| v)
        .ok_or_else(|| "the MTU must be 256, 512, 1024, 2048 or 4096".into())
}

type AnyResult<T> = Result<T, Box<dyn Error>>;

/// Errors of the handshake, with what was being done.
#[derive(Debug, thiserror::Error)]
enum HandshakeError {
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("bad message from the peer: {0}")]
    Wire(#[from] WireError),
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> HandshakeError {
    move |source| HandshakeError::Io { what, source }
}

fn read_message(s: &mut TcpStream) -> Result<Destination, HandshakeError> {
    let mut msg = [0u8; MESSAGE_LEN];
    s.read_exact(&mut msg)
        .map_err(io("couldn't read remote address"))?;
    Ok(Destination::decode(&msg)?)
}

/// Client side: send ours, read theirs, say done.
fn client_exchange(host: &str, port: u16, mine: &Destination) -> AnyResult<Destination> {
    let mut s = TcpStream::connect((host, port)).map_err(io("couldn't connect to the server"))?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(io("set_read_timeout"))?;
    s.write_all(&mine.encode()?)
        .map_err(io("couldn't send local address"))?;
    let theirs = read_message(&mut s)?;
    s.write_all(DONE).map_err(io("couldn't send \"done\""))?;
    Ok(theirs)
}

/// Server side: accept one client, read its address, connect our QP to it (so it is ready
/// before the client sends), answer with ours and wait for the client's "done".
fn server_exchange(
    port: u16,
    mine: &Destination,
    connect: impl FnOnce(&Destination) -> AnyResult<QueuePair<Rc>>,
) -> AnyResult<(Destination, QueuePair<Rc>)> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(io("couldn't listen"))?;
    let (mut s, _) = listener.accept().map_err(io("accept() failed"))?;
    drop(listener);
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(io("set_read_timeout"))?;
    let theirs = read_message(&mut s)?;
    let qp = connect(&theirs)?;
    s.write_all(&mine.encode()?)
        .map_err(io("couldn't send local address"))?;
    let mut done = [0u8; DONE.len()];
    s.read_exact(&mut done)
        .map_err(io("couldn't read \"done\" from the client"))?;
    pingpong_wire::check_done(&done).map_err(HandshakeError::from)?;
    Ok((theirs, qp))
}

fn print_address(which: &str, d: &Destination) {
    println!(
        "  {which} LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        d.lid,
        d.qpn,
        d.psn,
        d.gid_display()
    );
}

fn run(a: &Args) -> AnyResult<()> {
    if a.size == 0 || a.iters == 0 || a.rx_depth < 2 {
        return Err("size and iters must be at least 1, rx-depth at least 2".into());
    }
    let mtu = Mtu::from_bytes(a.mtu).ok_or("bad MTU")?;
    let ctx = ibverbs_safe::open(a.ib_dev.as_deref())?;
    let port = ctx.query_port(a.ib_port)?;
    if port.link_layer != LinkLayer::Ethernet && port.lid == 0 {
        return Err("couldn't get local LID".into());
    }
    let channel = if a.events {
        Some(ctx.create_comp_channel()?)
    } else {
        None
    };
    let mut cq = match &channel {
        Some(ch) => ctx.create_cq_with_channel(a.rx_depth + 1, ch)?,
        None => ctx.create_cq(a.rx_depth + 1)?,
    };
    let pd = ctx.alloc_pd()?;
    let mut mr = pd.alloc_region(a.size as usize)?;
    // One buffer for sends and receives, as rdma-core's example does.
    let buf: MrSlice = mr.slice(..)?;

    let mut b = pd
        .queue_pair(&cq, &cq)
        .port(a.ib_port)
        .max_send_wr(1)
        .max_recv_wr(a.rx_depth)
        .max_sge(1, 1)
        .max_inline_data(0)
        .access(RemoteAccess::empty())
        .mtu(mtu)
        .sl(a.sl);
    if let Some(g) = a.gid_idx {
        b = b.gid_index(g);
    }
    let mut qp = b.build_rc()?;
    let mut routs = 0u32;
    for _ in 0..a.rx_depth {
        qp.post_recv(buf.clone(), RECV_WRID).map_err(|e| e.error)?;
        routs += 1;
    }
    if channel.is_some() {
        cq.req_notify(false)?;
    }

    let local = qp.endpoint();
    let mine = Destination {
        lid: local.lid,
        qpn: local.qpn,
        psn: local.psn,
        // rdma-core sends a zero GID without -g
        gid: if a.gid_idx.is_some() {
            local.gid.0
        } else {
            [0; 16]
        },
    };
    print_address("local address: ", &mine);

    let to_endpoint = |d: &Destination| Endpoint {
        lid: d.lid,
        qpn: d.qpn,
        psn: d.psn,
        gid: Gid(d.gid),
        // rdma-core uses its own -m as the path MTU
        mtu,
        qkey: 0,
    };
    let (theirs, mut qp) = match &a.servername {
        Some(host) => {
            let theirs = client_exchange(host, a.port, &mine)?;
            print_address("remote address:", &theirs);
            let qp = qp.connect(&to_endpoint(&theirs))?;
            (theirs, qp)
        }
        None => {
            let (theirs, qp) =
                server_exchange(a.port, &mine, |d| Ok(qp.connect(&to_endpoint(d))?))?;
            print_address("remote address:", &theirs);
            (theirs, qp)
        }
    };
    let _ = theirs;

    let inline = qp.max_inline_data() >= a.size;
    let send = |qp: &mut QueuePair<Rc>| -> AnyResult<()> {
        let mut r = SendRequest::send(buf.clone()).wr_id(SEND_WRID);
        if inline {
            r = r.inline();
        }
        qp.post_send(r)
            .map_err(|e| format!("couldn't post send: {}", e.error))?;
        Ok(())
    };

    let mut pending = RECV_WRID;
    if a.servername.is_some() {
        send(&mut qp)?;
        pending |= SEND_WRID;
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wc = Completion::buffer(2);
    while rcnt < a.iters || scnt < a.iters {
        if let Some(ch) = &channel {
            ch.get_event()?;
            cq.req_notify(false)?;
        }
        let ne = loop {
            let n = cq.poll(&mut wc)?;
            if channel.is_some() || n > 0 {
                break n;
            }
        };
        for c in &wc[..ne] {
            if !c.is_ok() {
                return Err(format!("Failed status {} for wr_id {}", c.status(), c.wr_id()).into());
            }
            match c.wr_id() {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    routs -= 1;
                    if routs <= 1 {
                        while routs < a.rx_depth {
                            if let Err(e) = qp.post_recv(buf.clone(), RECV_WRID) {
                                eprintln!("Couldn't post receive ({routs}): {}", e.error);
                                break;
                            }
                            routs += 1;
                        }
                    }
                    rcnt += 1;
                }
                other => return Err(format!("Completion for unknown wr_id {other}").into()),
            }
            pending &= !c.wr_id();
            if scnt < a.iters && pending == 0 {
                send(&mut qp)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    // whole microseconds, as rdma-core measures them with gettimeofday
    let usec = start.elapsed().as_micros().max(1) as f64;
    let bytes = u64::from(a.size) * u64::from(a.iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        a.iters,
        usec / 1e6,
        usec / f64::from(a.iters)
    );
    Ok(())
}

fn main() -> ExitCode {
    fabric::cli::die_on_broken_pipe();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("rc_pingpong: {e}");
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}
