//! Real verbs between two processes (needs an RDMA device: run by `ci/softroce/suite.sh` in
//! the Soft-RoCE guest; elsewhere each test prints `skipped: no RDMA device` by name).
//!
//! The test process spawns a copy of this test executable as its peer (it runs only
//! [`peer_process_entry`], selected by an environment variable), exchanges queue-pair
//! endpoints with it over loopback TCP, and then:
//!
//! * `verbs_two_process_pingpong` — ping-pong with data checks (every message carries a
//!   counter the peer must have seen and answers incremented), several sizes;
//! * `verbs_two_process_peer_death` — streams SENDs to the peer, kills it with SIGKILL
//!   mid-stream, and requires the survivor to get a retry-exceeded error completion within
//!   a bound derived from the configured retry time, every posted buffer back (the rest as
//!   flushed completions) and its QP in the error state: no hang.
//!
//! Devices: in the guest the harness describes them (`SOFTROCE_PAIR_DEVS`/`_GID`: two
//! devices joined by a veth pair; `SOFTROCE_LO_DEV`/`_GID`: one on loopback); both are
//! used. Elsewhere the first device and its IPv4-mapped RoCE GID (else index 0).

mod support;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::skip;

use ibverbs_safe::{
    AlignedBuffer, Completion, CompletionQueue, Endpoint, MemoryRegion, QpState, QueuePair, Rc,
    SendRequest, WcStatus,
};

const ROLE_ENV: &str = "FABRIC_TEST_VERBS_PEER_ROLE";
const ADDR_ENV: &str = "FABRIC_TEST_VERBS_PEER_ADDR";
const DEV_ENV: &str = "FABRIC_TEST_VERBS_PEER_DEV";
const GID_ENV: &str = "FABRIC_TEST_VERBS_PEER_GID";
/// The most a peer process lives, whatever happens (so nothing can hang a test run).
const PEER_LIFETIME: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(30);

type R<T> = Result<T, String>;

fn e<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
    move |err| format!("{what}: {err}")
}

/// One pair of (device, GID index) ends to test between.
#[derive(Debug, Clone)]
struct Ends {
    label: String,
    a: (String, u8),
    b: (String, u8),
}

fn env_gid(name: &str) -> Option<u8> {
    std::env::var(name).ok()?.parse().ok()
}

/// The device pairs to test on, or `None` (after printing the skip line) without a device.
fn configurations(test: &str) -> Option<Vec<Ends>> {
    let devs = match ibverbs_safe::devices() {
        Ok(d) if !d.is_empty() => d,
        Ok(_) => {
            skip("rdma", format_args!("no RDMA device ({test})"));
            return None;
        }
        Err(err) => {
            skip("rdma", format_args!("no RDMA device ({test}: {err})"));
            return None;
        }
    };
    let mut out = Vec::new();
    if let (Ok(pair), Some(gid)) = (
        std::env::var("SOFTROCE_PAIR_DEVS"),
        env_gid("SOFTROCE_PAIR_GID"),
    ) {
        let mut it = pair.split_whitespace();
        if let (Some(a), Some(b)) = (it.next(), it.next()) {
            out.push(Ends {
                label: format!("{a}<->{b} (veth)"),
                a: (a.into(), gid),
                b: (b.into(), gid),
            });
        }
    }
    if let (Ok(lo), Some(gid)) = (std::env::var("SOFTROCE_LO_DEV"), env_gid("SOFTROCE_LO_GID")) {
        out.push(Ends {
            label: format!("{lo}<->{lo} (loopback)"),
            a: (lo.clone(), gid),
            b: (lo, gid),
        });
    }
    if out.is_empty() {
        let name = devs[0].name.clone();
        let gid = ibverbs_safe::open(Some(&name)).map_or(0, |ctx| {
            let table = ctx.gid_table(1).unwrap_or_default();
            table
                .iter()
                .find(|g| g.gid.to_ipv6().to_ipv4_mapped().is_some())
                .or_else(|| table.first())
                .map_or(0, |g| g.index as u8)
        });
        out.push(Ends {
            label: format!("{name}<->{name}"),
            a: (name.clone(), gid),
            b: (name, gid),
        });
    }
    Some(out)
}

/// One side's verbs objects.
struct Side {
    cq: CompletionQueue,
    qp: QueuePair<Rc>,
    tx: MemoryRegion<AlignedBuffer>,
    _rx: MemoryRegion<AlignedBuffer>,
}

#[derive(Clone, Copy)]
struct QpConfig {
    depth: u32,
    buf: usize,
    /// IB timeout exponent: 4.096 µs × 2^timeout per try.
    timeout: u8,
    retry_cnt: u8,
}

impl QpConfig {
    /// The time the QP keeps retrying before it reports retry-exceeded.
    fn retry_time(self) -> Duration {
        let per_try = Duration::from_nanos(4096 << self.timeout);
        per_try * (u32::from(self.retry_cnt) + 1)
    }
}

const PINGPONG: QpConfig = QpConfig {
    depth: 16,
    buf: 1 << 16,
    timeout: 14,
    retry_cnt: 7,
};
const STREAM: QpConfig = QpConfig {
    depth: 64,
    buf: 4096,
    timeout: 12,
    retry_cnt: 3,
};

/// Opens `dev`, builds an RC QP, posts `recvs` receives of the whole rx buffer, and
/// exchanges endpoints over `sock` (the spawning side writes first), then connects.
fn setup(
    dev: &str,
    gid: u8,
    cfg: QpConfig,
    recvs: u32,
    sock: &mut TcpStream,
    first: bool,
) -> R<Side> {
    let ctx = ibverbs_safe::open(Some(dev)).map_err(e("open device"))?;
    let pd = ctx.alloc_pd().map_err(e("alloc_pd"))?;
    let cq = ctx.create_cq(2 * cfg.depth + 2).map_err(e("create_cq"))?;
    let tx = pd.alloc_region(cfg.buf).map_err(e("register tx"))?;
    let mut rx = pd.alloc_region(cfg.buf).map_err(e("register rx"))?;
    let mut qp = pd
        .queue_pair(&cq, &cq)
        .gid_index(gid)
        .max_send_wr(cfg.depth)
        .max_recv_wr(cfg.depth)
        .timeout(cfg.timeout)
        .retry_cnt(cfg.retry_cnt)
        .rnr_retry(7)
        .build_rc()
        .map_err(e("build RC QP"))?;
    for i in 0..recvs {
        let h = rx.slice(..).map_err(e("rx slice"))?;
        qp.post_recv(h, u64::from(i))
            .map_err(|p| format!("post_recv: {}", p.error))?;
    }
    let mine = qp.endpoint().to_bytes();
    let mut theirs = [0u8; Endpoint::ENCODED_LEN];
    if first {
        sock.write_all(&mine).map_err(e("send endpoint"))?;
        sock.read_exact(&mut theirs).map_err(e("read endpoint"))?;
    } else {
        sock.read_exact(&mut theirs).map_err(e("read endpoint"))?;
        sock.write_all(&mine).map_err(e("send endpoint"))?;
    }
    let qp = qp.connect_bytes(&theirs).map_err(e("connect QP"))?;
    // both QPs are at RTS once both sides said so
    sock.write_all(b"R").map_err(e("send ready"))?;
    let mut ready = [0u8; 1];
    sock.read_exact(&mut ready).map_err(e("read ready"))?;
    if ready != *b"R" {
        return Err(format!("peer sent {ready:?} instead of ready"));
    }
    Ok(Side {
        cq,
        qp,
        tx,
        _rx: rx,
    })
}

/// Polls exactly one completion within `STEP` (its buffer handles still in it).
fn one(cq: &mut CompletionQueue) -> R<Completion> {
    let mut c = Completion::buffer(1);
    cq.poll_exact(&mut c, 1, STEP).map_err(e("poll"))?;
    c.pop().ok_or_else(|| "no completion".to_string())
}

const SEND_ID: u64 = u64::MAX;

/// Fills `len` bytes of the tx region with `counter` and a pattern and sends them. The
/// previous send must have completed (its handle returned), or the region is busy.
fn send_counter(s: &mut Side, len: usize, counter: u64) -> R<()> {
    let buf = s.tx.as_mut_slice().map_err(e("tx bytes"))?;
    buf[..len].fill((counter % 251) as u8);
    buf[..8].copy_from_slice(&counter.to_le_bytes());
    let h = s.tx.slice(..len).map_err(e("tx slice"))?;
    s.qp.post_send(SendRequest::send(h).wr_id(SEND_ID))
        .map_err(|p| format!("post_send: {}", p.error))
}

/// Checks a receive completion holds a `len`-byte message carrying `expect`, then reposts
/// its buffer.
fn check_and_repost(s: &mut Side, mut c: Completion, len: usize, expect: u64) -> R<()> {
    c.result()
        .map_err(|err| format!("receive completion: {err}"))?;
    let h = c
        .take_buf()
        .ok_or("receive completion without its buffer")?;
    if c.byte_len() as usize != len {
        return Err(format!("received {} bytes, expected {len}", c.byte_len()));
    }
    let mut bytes = vec![0u8; len];
    h.read_into(0, &mut bytes)
        .map_err(e("copy the received bytes"))?;
    let counter = u64::from_le_bytes(bytes[..8].try_into().map_err(e("counter"))?);
    if counter != expect {
        return Err(format!("received counter {counter}, expected {expect}"));
    }
    let fill = (counter % 251) as u8;
    if let Some(pos) = bytes[8..].iter().position(|&b| b != fill) {
        return Err(format!(
            "byte {} of a {len}-byte message is {:#x}, expected {fill:#x}",
            pos + 8,
            bytes[8 + pos]
        ));
    }
    s.qp.post_recv(h, c.wr_id())
        .map_err(|p| format!("post_recv: {}", p.error))
}

/// Polls until the pending send (if any) and one receive completed; returns the receive.
fn wait_recv(s: &mut Side, send_pending: &mut bool) -> R<Completion> {
    let mut recv = None;
    while *send_pending || recv.is_none() {
        let mut c = one(&mut s.cq)?;
        if c.wr_id() == SEND_ID {
            c.result()
                .map_err(|err| format!("send completion: {err}"))?;
            drop(c.take_bufs());
            *send_pending = false;
        } else if recv.is_none() {
            recv = Some(c);
        } else {
            return Err("a second receive completed before our send".into());
        }
    }
    recv.ok_or_else(|| "no receive".to_string())
}

const SIZES: [(usize, u64); 4] = [(8, 200), (64, 200), (4096 + 7, 100), (1 << 16, 30)];

/// The spawning side of the ping-pong: sends n, expects n + 1 back.
fn pingpong_initiator(s: &mut Side) -> R<()> {
    let mut counter = 0u64;
    for (len, iters) in SIZES {
        for _ in 0..iters {
            send_counter(s, len, counter)?;
            let mut pending = true;
            let c = wait_recv(s, &mut pending)?;
            check_and_repost(s, c, len, counter + 1)?;
            counter += 2;
        }
    }
    Ok(())
}

/// The peer of the ping-pong: receives n, answers n + 1.
fn pingpong_echo(s: &mut Side) -> R<()> {
    let mut counter = 0u64;
    let mut pending = false;
    for (len, iters) in SIZES {
        for _ in 0..iters {
            let c = wait_recv(s, &mut pending)?;
            check_and_repost(s, c, len, counter)?;
            send_counter(s, len, counter + 1)?;
            pending = true;
            counter += 2;
        }
    }
    // the last send's completion
    let c = one(&mut s.cq)?;
    c.result().map_err(|err| format!("last send: {err}"))
}

/// The peer of the peer-death test: consumes SENDs until it is killed.
fn stream_sink(s: &mut Side) -> R<()> {
    let deadline = Instant::now() + PEER_LIFETIME;
    let mut c = Completion::buffer(16);
    while Instant::now() < deadline {
        let n = s.cq.poll(&mut c).map_err(e("poll"))?;
        for c in &mut c[..n] {
            c.result()
                .map_err(|err| format!("sink completion: {err}"))?;
            let h = c.take_buf().ok_or("receive without its buffer")?;
            s.qp.post_recv(h, c.wr_id())
                .map_err(|p| format!("post_recv: {}", p.error))?;
        }
    }
    Err("the sink was never killed".into())
}

/// Runs in the spawned process (see the module docs); a no-op in a normal test run.
#[test]
fn peer_process_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let result = (|| -> R<()> {
        let addr = std::env::var(ADDR_ENV).map_err(e(ADDR_ENV))?;
        let dev = std::env::var(DEV_ENV).map_err(e(DEV_ENV))?;
        let gid: u8 = std::env::var(GID_ENV)
            .map_err(e(GID_ENV))?
            .parse()
            .map_err(e(GID_ENV))?;
        let mut sock = TcpStream::connect(&addr).map_err(e("connect to the test process"))?;
        sock.set_read_timeout(Some(STEP))
            .map_err(e("set_read_timeout"))?;
        match role.as_str() {
            "echo" => {
                let mut s = setup(&dev, gid, PINGPONG, PINGPONG.depth, &mut sock, false)?;
                pingpong_echo(&mut s)
            }
            "sink" => {
                let mut s = setup(&dev, gid, STREAM, STREAM.depth, &mut sock, false)?;
                stream_sink(&mut s)
            }
            other => Err(format!("unknown role {other}")),
        }
    })();
    let code = match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("peer process ({role}): {err}");
            1
        }
    };
    std::process::exit(code);
}

/// A spawned peer process, killed if still running when dropped.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    /// Waits (bounded) for the peer to exit and returns whether it succeeded.
    fn wait_success(&mut self, limit: Duration) -> R<()> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.0.try_wait().map_err(e("wait for peer"))? {
                return if st.success() {
                    Ok(())
                } else {
                    Err(format!("peer process failed: {st}"))
                };
            }
            if Instant::now() > deadline {
                return Err(format!("peer process still running after {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Spawns the peer with `role` on `(dev, gid)` and returns it with the connected socket.
fn spawn_peer(role: &str, dev: &str, gid: u8) -> R<(Peer, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(e("bind loopback"))?;
    let addr = listener.local_addr().map_err(e("local_addr"))?;
    let exe = std::env::current_exe().map_err(e("current_exe"))?;
    let child = Command::new(exe)
        .args([
            "--exact",
            "peer_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .env(ADDR_ENV, addr.to_string())
        .env(DEV_ENV, dev)
        .env(GID_ENV, gid.to_string())
        .stdout(Stdio::null())
        .spawn()
        .map_err(e("spawn peer process"))?;
    let mut peer = Peer(child);
    listener
        .set_nonblocking(true)
        .map_err(e("set_nonblocking"))?;
    let deadline = Instant::now() + STEP;
    let sock = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(st) = peer.0.try_wait().map_err(e("peer"))? {
                    return Err(format!("peer process exited before connecting: {st}"));
                }
                if Instant::now() > deadline {
                    return Err("peer process never connected".into());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => return Err(format!("accept: {err}")),
        }
    };
    sock.set_nonblocking(false).map_err(e("set_blocking"))?;
    sock.set_read_timeout(Some(STEP))
        .map_err(e("set_read_timeout"))?;
    // on the error paths above, dropping `peer` killed the process
    Ok((peer, sock))
}

#[test]
fn verbs_two_process_pingpong() {
    let Some(configs) = configurations("verbs_two_process_pingpong") else {
        return;
    };
    for ends in configs {
        let t0 = Instant::now();
        let result = (|| -> R<()> {
            let (mut peer, mut sock) = spawn_peer("echo", &ends.b.0, ends.b.1)?;
            let mut s = setup(
                &ends.a.0,
                ends.a.1,
                PINGPONG,
                PINGPONG.depth,
                &mut sock,
                true,
            )?;
            pingpong_initiator(&mut s)?;
            peer.wait_success(STEP)
        })();
        if let Err(err) = result {
            panic!("ping-pong between two processes on {}: {err}", ends.label);
        }
        let msgs: u64 = SIZES.iter().map(|s| 2 * s.1).sum();
        println!(
            "two-process ping-pong on {}: {msgs} messages checked in {:?}",
            ends.label,
            t0.elapsed()
        );
    }
}

#[test]
fn verbs_two_process_peer_death() {
    let Some(configs) = configurations("verbs_two_process_peer_death") else {
        return;
    };
    for ends in configs {
        match peer_death(&ends) {
            Ok(report) => println!("peer death on {}: {report}", ends.label),
            Err(err) => panic!("peer death on {}: {err}", ends.label),
        }
    }
}

fn peer_death(ends: &Ends) -> R<String> {
    let (mut peer, mut sock) = spawn_peer("sink", &ends.b.0, ends.b.1)?;
    let mut s = setup(&ends.a.0, ends.a.1, STREAM, 0, &mut sock, true)?;
    let window = STREAM.depth as usize / 2;
    let len = 1024;
    let src = s.tx.slice(..len).map_err(e("tx slice"))?;
    let (mut posted, mut returned, mut ok) = (0usize, 0usize, 0usize);
    let mut statuses: Vec<WcStatus> = Vec::new();
    let mut killed_at: Option<Instant> = None;
    let mut first_error: Option<(Instant, WcStatus)> = None;
    let limit = STREAM.retry_time() * 4 + Duration::from_secs(5);
    let mut wc = Completion::buffer(16);
    let start = Instant::now();
    loop {
        // keep the window full until the first error
        while first_error.is_none() && posted - returned < window {
            s.qp.post_send(SendRequest::send(src.clone()).wr_id(posted as u64))
                .map_err(|p| format!("post_send #{posted}: {}", p.error))?;
            posted += 1;
        }
        let n = s.cq.poll(&mut wc).map_err(e("poll"))?;
        for c in &mut wc[..n] {
            drop(c.take_bufs());
            returned += 1;
            if c.is_ok() {
                if first_error.is_some() {
                    return Err(format!(
                        "send {} succeeded after the first error",
                        c.wr_id()
                    ));
                }
                ok += 1;
            } else {
                statuses.push(c.status());
                first_error.get_or_insert((Instant::now(), c.status()));
            }
        }
        if killed_at.is_none() && ok >= 100 {
            // mid-stream: sends are in flight right now
            peer.0.kill().map_err(e("kill peer"))?;
            peer.0.wait().map_err(e("reap peer"))?;
            killed_at = Some(Instant::now());
        }
        if first_error.is_some() && returned == posted {
            break;
        }
        let waited = killed_at.map_or(start.elapsed(), |k| k.elapsed());
        if waited > limit + STEP {
            return Err(format!(
                "no end after {waited:?}: {posted} posted, {returned} returned, first error {first_error:?}"
            ));
        }
    }
    let killed_at = killed_at.ok_or("an error completion came before the peer was killed")?;
    let (err_at, status) = first_error.ok_or("no error completion")?;
    if status != WcStatus::RetryExceeded {
        return Err(format!(
            "first error completion is {status}, expected retry exceeded"
        ));
    }
    if let Some(bad) = statuses[1..].iter().find(|s| **s != WcStatus::WrFlush) {
        return Err(format!(
            "after the first error, a completion with {bad} instead of a flush"
        ));
    }
    let took = err_at.duration_since(killed_at);
    if took > limit {
        return Err(format!(
            "error completion {took:?} after the kill, limit {limit:?}"
        ));
    }
    let state = s.qp.state().map_err(e("query QP"))?;
    if state != QpState::Error {
        return Err(format!(
            "QP is in state {state:?} after the error, expected Error"
        ));
    }
    Ok(format!(
        "{ok} sends completed before the kill, error completion {took:?} after it (configured retry time \
         {:?}, limit {limit:?}), {} flushed, all {posted} buffers returned, QP in error state",
        STREAM.retry_time(),
        statuses.len() - 1
    ))
}
