//! `rping` on `ibverbs-safe`'s rdma_cm: wire compatible with rdma-core's `rping`
//! (rdmacm-utils) — the same 16-byte `rdma_info` advertisements, the same READ / WRITE
//! sequence per iteration, the same options (`-s/-c/-a/-p/-C/-S/-v/-V`) and output lines —
//! so our server works with their client and the other way round. Also `-I` (client source
//! address), `-P` (persistent server) and `-d` (debug lines on stderr); not `-q`.
//!
//! ```sh
//! cargo run --example rping -- -s -a 10.0.0.1 -v          # server
//! cargo run --example rping -- -c -a 10.0.0.1 -C 10 -V -v # client
//! ```
//!
//! Per iteration the client fills its source buffer with `rdma-ping-<n>: ABC...` and
//! advertises it; the server RDMA READs it and answers; the client advertises its sink
//! buffer; the server RDMA WRITEs what it read there and answers again; with `-V` the client
//! checks that the sink holds what it sent. A malformed advertisement (not 16 bytes, or a
//! buffer that does not fit) ends the run with a clear error before any memory is touched.
//! Exit status: 0 on success (the server also when the client disconnects), 255 on error.

use std::error::Error;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use fabric::rping_wire::{self, RdmaInfo, DEFAULT_SIZE, INFO_LEN, MAX_SIZE, MIN_SIZE};
use ibverbs_safe::cm::{CmError, CmId, ConnParam, Connection, Listener};
use ibverbs_safe::{
    Completion, CompletionQueue, MemoryRegion, QueueKind, QueuePair, Rc, RemoteAccess,
};

/// Resolution timeout per step (rping uses 2 s).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long connect / accept may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long one step of an iteration may take (rping waits forever; we do not hang).
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Receive buffer: larger than an rdma_info so that an oversized message is reported as
/// such instead of as a length error.
const RECV_LEN: usize = 64;

#[derive(Parser, Debug)]
#[command(
    name = "rping",
    about = "RDMA ping over rdma_cm, compatible with rdma-core's rping",
    disable_version_flag = true
)]
struct Args {
    /// server side
    #[arg(short = 's')]
    server: bool,
    /// client side
    #[arg(short = 'c')]
    client: bool,
    /// address (server: to bind; client: to connect to)
    #[arg(short = 'a')]
    addr: Option<IpAddr>,
    /// port
    #[arg(short = 'p', default_value_t = 7174)]
    port: u16,
    /// ping count times (0: forever)
    #[arg(short = 'C', default_value_t = 0)]
    count: u64,
    /// ping data size
    #[arg(short = 'S', default_value_t = DEFAULT_SIZE)]
    size: usize,
    /// display ping data to stdout
    #[arg(short = 'v')]
    verbose: bool,
    /// validate ping data
    #[arg(short = 'V')]
    validate: bool,
    /// source address to bind to (client)
    #[arg(short = 'I')]
    source: Option<IpAddr>,
    /// persistent server mode: serve one connection after another
    #[arg(short = 'P')]
    persistent: bool,
    /// debug printfs
    #[arg(short = 'd')]
    debug: bool,
}

type Res<T> = Result<T, Box<dyn Error>>;

fn main() -> ExitCode {
    fabric::cli::die_on_broken_pipe();
    let a = Args::parse();
    if a.server == a.client {
        eprintln!("rping: exactly one of -s (server) and -c (client) is required");
        return ExitCode::from(255);
    }
    if !(MIN_SIZE..=MAX_SIZE).contains(&a.size) {
        eprintln!(
            "Invalid size {} (valid range is {MIN_SIZE} to {MAX_SIZE})",
            a.size
        );
        return ExitCode::from(255);
    }
    let r = if a.server { server(&a) } else { client(&a) };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("rping: {msg}");
            ExitCode::from(255)
        }
    }
}

/// The send/receive plumbing both sides share.
struct Peer {
    qp: QueuePair<Rc>,
    cq: CompletionQueue,
    conn: Connection,
    rx: MemoryRegion,
    tx: MemoryRegion,
    wcs: Vec<Completion>,
    /// Completions of the other queue that arrived while waiting for one queue.
    stash: std::collections::VecDeque<Completion>,
    debug: bool,
    who: &'static str,
}

/// What a wait ended with.
enum Got {
    Done(Completion),
    Disconnected,
}

impl Peer {
    /// Waits for the next completion of `queue`, watching the connection for a disconnect.
    fn wait(&mut self, queue: QueueKind, what: &str) -> Res<Got> {
        if let Some(i) = self.stash.iter().position(|c| c.queue() == Some(queue)) {
            let c = self.stash.remove(i).expect("index found above");
            return Ok(Got::Done(c));
        }
        let end = Instant::now() + STEP_TIMEOUT;
        let mut spins = 0u32;
        loop {
            let n = self.cq.poll(&mut self.wcs[..1])?;
            if n == 1 {
                let mut c = std::mem::take(&mut self.wcs[0]);
                if !c.is_ok() {
                    if self.conn.check().is_err() {
                        return Ok(Got::Disconnected);
                    }
                    return Err(
                        format!("cq completion failed status {} ({what})", c.status()).into(),
                    );
                }
                drop(c.take_bufs());
                if c.queue() != Some(queue) {
                    self.stash.push_back(c);
                    continue;
                }
                return Ok(Got::Done(c));
            }
            spins += 1;
            if spins.is_multiple_of(256) {
                match self.conn.check() {
                    Ok(()) => {}
                    Err(ibverbs_safe::Error::Cm(CmError::Disconnected)) => {
                        return Ok(Got::Disconnected)
                    }
                    Err(e) => return Err(e.into()),
                }
                if Instant::now() > end {
                    return Err(format!("no completion for {what} within {STEP_TIMEOUT:?}").into());
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn post_recv(&mut self) -> Res<()> {
        self.qp
            .post_recv(self.rx.slice(..)?, 1)
            .map_err(|e| e.error)?;
        Ok(())
    }

    /// Receives one rdma_info (reposting the receive), or `None` on disconnect.
    fn recv_info(&mut self, what: &str) -> Res<Option<Result<RdmaInfo, rping_wire::InfoError>>> {
        let c = match self.wait(QueueKind::Recv, what)? {
            Got::Done(c) => c,
            Got::Disconnected => return Ok(None),
        };
        let len = (c.byte_len() as usize).min(RECV_LEN);
        let mut b = [0u8; RECV_LEN];
        self.rx.read_into(0, &mut b[..len])?;
        let msg = &b[..len];
        // the server uses what the client advertises; the client only counts the answers
        let info = if self.who == "server" {
            RdmaInfo::decode(msg)
        } else {
            RdmaInfo::decode_unchecked(msg)
        };
        if self.debug {
            eprintln!("{} received {:?}", self.who, info);
        }
        self.post_recv()?;
        Ok(Some(info))
    }

    fn send_info(&mut self, info: RdmaInfo) -> Res<bool> {
        self.tx.write_from(0, &info.encode())?;
        self.qp
            .send(self.tx.slice(..INFO_LEN)?, 2)
            .map_err(|e| e.error)?;
        Ok(matches!(self.wait(QueueKind::Send, "send")?, Got::Done(_)))
    }
}

fn info_of(mr: &MemoryRegion<Vec<u8>, ibverbs_safe::Remote>) -> RdmaInfo {
    let r = mr.remote();
    RdmaInfo {
        addr: r.addr,
        rkey: r.rkey,
        size: r.len as u32,
    }
}

fn server(a: &Args) -> Res<()> {
    let ip = a.addr.unwrap_or(IpAddr::from([0, 0, 0, 0]));
    let mut listener = Listener::bind(SocketAddr::new(ip, a.port), 3)?;
    loop {
        let req = listener.get_request(Duration::from_secs(24 * 3600))?;
        let r = serve(a, req);
        if !a.persistent {
            return r;
        }
        if let Err(e) = r {
            eprintln!("rping: {e}");
        }
    }
}

/// Serves one connection.
fn serve(a: &Args, req: ibverbs_safe::cm::ConnectRequest) -> Res<()> {
    if a.debug {
        eprintln!("child cma on {}", req.device_name()?);
    }
    let ctx = req.open_context()?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(32)?;
    let mut prepared = req
        .queue_pair(&pd, &cq, &cq)?
        .max_send_wr(16)
        .max_recv_wr(4)
        .build_rc()?;
    let mut rx = pd.alloc_region(RECV_LEN)?;
    prepared.post_recv(rx.slice(..)?, 1).map_err(|e| e.error)?;
    let mut buf =
        pd.register_remote(vec![0u8; a.size], RemoteAccess::READ | RemoteAccess::WRITE)?;
    let (conn, qp) = req.accept(prepared, &ConnParam::default(), CONNECT_TIMEOUT)?;
    let mut p = Peer {
        qp,
        cq,
        conn,
        rx,
        tx: pd.alloc_region(INFO_LEN)?,
        wcs: Completion::buffer(1),
        stash: Default::default(),
        debug: a.debug,
        who: "server",
    };
    let mut ping = 0u64;
    while a.count == 0 || ping < a.count {
        // 1. the client's source advertisement
        let Some(info) = p.recv_info("the client's source advertisement")? else {
            return disconnected_server();
        };
        let src = info?.read_source(a.size)?;
        // 2. READ it into our buffer
        let n = src.len as usize;
        p.qp.read(buf.slice(..n)?, src, 3).map_err(|e| e.error)?;
        match p.wait(QueueKind::Send, "RDMA READ")? {
            Got::Done(_) => {}
            Got::Disconnected => return disconnected_server(),
        }
        let mut data = vec![0u8; a.size];
        buf.read_into(0, &mut data)?;
        if a.verbose {
            println!("server ping data: {}", rping_wire::c_str(&data));
        }
        // 3. go ahead
        if !p.send_info(info_of(&buf))? {
            return disconnected_server();
        }
        // 4. the client's sink advertisement
        let Some(sink) = p.recv_info("the client's sink advertisement")? else {
            return disconnected_server();
        };
        let len = (data.iter().position(|&b| b == 0).unwrap_or(a.size - 1) + 1).min(a.size);
        let dst = sink?.write_target(len)?;
        // 5. WRITE the data there
        p.qp.write(buf.slice(..len)?, dst, 4).map_err(|e| e.error)?;
        match p.wait(QueueKind::Send, "RDMA WRITE")? {
            Got::Done(_) => {}
            Got::Disconnected => return disconnected_server(),
        }
        // 6. done with this iteration
        if !p.send_info(info_of(&buf))? {
            return disconnected_server();
        }
        ping += 1;
    }
    // the client disconnects once it has its last answer
    match p.conn.wait_disconnected(STEP_TIMEOUT) {
        Ok(()) => eprintln!("server DISCONNECT EVENT..."),
        Err(e) => return Err(e.into()),
    }
    drop(p);
    drop(buf);
    Ok(())
}

fn disconnected_server() -> Res<()> {
    eprintln!("server DISCONNECT EVENT...");
    eprintln!("wait for RDMA_READ_ADV state 10");
    Ok(())
}

fn client(a: &Args) -> Res<()> {
    let Some(ip) = a.addr else {
        return Err("a server address is required (-a)".into());
    };
    let mut id = CmId::new()?;
    let src = a.source.map(|s| SocketAddr::new(s, 0));
    id.resolve_addr(src, SocketAddr::new(ip, a.port), RESOLVE_TIMEOUT)?;
    id.resolve_route(RESOLVE_TIMEOUT)?;
    if a.debug {
        eprintln!("cma on {}", id.device_name()?);
    }
    let ctx = id.open_context()?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(32)?;
    let mut prepared = id
        .queue_pair(&pd, &cq, &cq)?
        .max_send_wr(16)
        .max_recv_wr(4)
        .build_rc()?;
    let mut rx = pd.alloc_region(RECV_LEN)?;
    prepared.post_recv(rx.slice(..)?, 1).map_err(|e| e.error)?;
    let start = pd.register_remote(vec![0u8; a.size], RemoteAccess::READ)?;
    let sink = pd.register_remote(vec![0u8; a.size], RemoteAccess::WRITE)?;
    let (conn, qp) = id.connect(prepared, &ConnParam::default(), CONNECT_TIMEOUT)?;
    let mut p = Peer {
        qp,
        cq,
        conn,
        rx,
        tx: pd.alloc_region(INFO_LEN)?,
        wcs: Completion::buffer(1),
        stash: Default::default(),
        debug: a.debug,
        who: "client",
    };
    let mut data = vec![0u8; a.size];
    let mut ping = 0u64;
    while a.count == 0 || ping < a.count {
        rping_wire::fill_ping(&mut data, ping);
        start.write_from(0, &data)?;
        // 1. advertise the source; the server READs it and answers
        if !p.send_info(info_of(&start))? {
            return Err(CmError::Disconnected.into());
        }
        match p.recv_info("the server's go-ahead")? {
            Some(r) => drop(r?),
            None => return Err(CmError::Disconnected.into()),
        }
        // 2. advertise the sink; the server WRITEs it and answers
        sink.write_from(0, &vec![0u8; a.size])?;
        if !p.send_info(info_of(&sink))? {
            return Err(CmError::Disconnected.into());
        }
        match p.recv_info("the server's write completion")? {
            Some(r) => drop(r?),
            None => return Err(CmError::Disconnected.into()),
        }
        let mut got = vec![0u8; a.size];
        sink.read_into(0, &mut got)?;
        if a.validate && got != data {
            eprintln!("data mismatch!");
            return Err("data mismatch".into());
        }
        if a.verbose {
            println!("ping data: {}", rping_wire::c_str(&got));
        }
        ping += 1;
    }
    p.conn.disconnect()?;
    if p.conn.wait_disconnected(Duration::from_secs(5)).is_ok() {
        eprintln!("client DISCONNECT EVENT...");
    }
    Ok(())
}
