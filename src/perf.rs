//! The measurement engine behind `examples/pingpong.rs` and `examples/bandwidth.rs`.
//!
//! Two roles over one [`Transport`]: the *initiator* drives phases and measures; the
//! *responder* obeys 32-byte control messages (`mode`, `size`, `iters`) and then echoes
//! (ping-pong), absorbs (stream) or both ends stream at once (bidirectional). One-sided
//! phases use a region the responder registers and announces with its key.
//!
//! Buffers are the caller's own (page-aligned [`AlignedBuf`]s registered in place on the
//! connection's domain), as a library using fabric-core would hold them. Two exceptions,
//! each where the backend says caller memory cannot serve: shm's one-sided target (a peer
//! can only address memory it maps: `Unsupported` at registration), and shm's send
//! buffers, which are fabric-core memory so that large sends go by rendezvous (the peer
//! copies straight out of its memfd: one copy; caller memory would take the eager path's
//! two). The responder's receive buffers are send buffers too: it echoes a ping-pong
//! message straight out of the buffer it arrived in.

use std::time::{Duration, Instant};

use crate::clock::Clock;

use fabric_core::{
    Access, AlignedBuf, Buf, Completion, EndpointId, Error, Event, OpKind, Region, RemoteKey,
    Status, Transport, TransportKind, Worker,
};

/// The caller's own page-aligned memory, registered in place on `conn`'s domain; memory
/// fabric-core allocates where the backend cannot serve caller memory for `access`.
fn buffer(conn: &mut dyn Transport, len: usize, access: Access) -> fabric_core::Result<Region> {
    match conn
        .domain()
        .register_memory(AlignedBuf::new(len.max(1), 4096)?, access)
    {
        Ok(r) => Ok(r),
        Err(e) if matches!(e.error(), Error::Unsupported { .. }) => conn.register(len, access),
        Err(e) => Err(e.into()),
    }
}

/// A send buffer: caller memory, except on shm (see the module docs).
fn send_buffer(conn: &mut dyn Transport, len: usize) -> fabric_core::Result<Region> {
    if conn.kind() == TransportKind::Shm {
        conn.register(len, Access::empty())
    } else {
        buffer(conn, len, Access::empty())
    }
}

/// Receives the responder keeps posted.
pub const WINDOW: usize = 16;
const CTRL_MAGIC: u32 = 0x4642_5043; // "FBPC"
const CTRL_LEN: usize = 32;

/// A phase the initiator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// End of run.
    Quit = 0,
    /// Echo `iters` messages of `size` bytes.
    PingPong = 1,
    /// Receive `iters` messages, then answer one 8-byte ack.
    Stream = 2,
    /// Receive `iters` messages while sending `iters` back, then ack.
    BiStream = 3,
    /// Wait for one 8-byte "done" message (the initiator wrote one-sided), then ack.
    OneSided = 4,
    /// Time `iters` `memcpy`s of `size` bytes on this side's CPU ([`memcpy_bw`]); answer
    /// the MiB/s as an 8-byte `f64`.
    Memcpy = 5,
}

impl Mode {
    fn from(v: u32) -> Option<Self> {
        Some(match v {
            0 => Mode::Quit,
            1 => Mode::PingPong,
            2 => Mode::Stream,
            3 => Mode::BiStream,
            4 => Mode::OneSided,
            5 => Mode::Memcpy,
            _ => return None,
        })
    }
}

/// One measured row.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Message size.
    pub size: usize,
    /// Iterations measured.
    pub iters: usize,
    /// Median one-way latency (half the round trip), microseconds.
    pub lat_typical_us: f64,
    /// 99th percentile one-way latency, microseconds.
    pub lat_p99_us: f64,
    /// Bandwidth in MiB/s (`None` when not measured).
    pub bw_mib_s: Option<f64>,
}

/// Sizes 8 B, 16 B, ... up to `max` (powers of two from `min`).
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        s *= 2;
    }
    v
}

/// Default ping-pong iterations for `size`.
pub fn lat_iters(size: usize) -> usize {
    ((512usize << 20) / size.max(1)).clamp(100, 10_000)
}

/// Default streaming iterations for `size`.
pub fn bw_iters(size: usize) -> usize {
    ((1usize << 30) / size.max(1)).clamp(64, 20_000)
}

/// Single-thread `memcpy` bandwidth in MiB/s: `iters` copies of `size` bytes from one
/// source into 16 rotating destinations (a streaming receiver's pattern), after one untimed
/// copy into each destination.
pub fn memcpy_bw(size: usize, iters: usize) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; size]).collect();
    for d in dst.iter_mut() {
        d.copy_from_slice(&src);
    }
    let t0 = Instant::now();
    for i in 0..iters {
        let d = &mut dst[i % WINDOW];
        d.copy_from_slice(&src);
        std::hint::black_box(&d);
    }
    (size * iters) as f64 / t0.elapsed().as_secs_f64() / (1 << 20) as f64
}

/// The median of `a / b` over pairs measured back to back (the lower middle one for an
/// even count; pairs whose `b` is not positive are left out; NaN when none is left).
/// `bandwidth` pairs each send trial with a `memcpy` trial: the host's memory bandwidth
/// drifts by tens of percent within seconds on a shared machine, so a ratio of two bests
/// taken at different moments says more about when each was taken than about the
/// transport.
pub fn median_ratio(pairs: &[(f64, f64)]) -> f64 {
    let mut r: Vec<f64> = pairs
        .iter()
        .filter(|p| p.1 > 0.0)
        .map(|p| p.0 / p.1)
        .collect();
    r.sort_by(f64::total_cmp);
    r.get(r.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

fn err(s: impl Into<String>) -> Error {
    Error::Protocol(s.into())
}

/// Set when this process was pinned to its own CPU (see [`Setup::pin`]).
static PINNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How a [`Peer`] drives its connection.
#[derive(Debug)]
enum Link {
    /// The bare [`Transport`]: its own `poll`, `wait`.
    Bare(Box<dyn Transport>),
    /// One endpoint of a [`Worker`] (the progress engine a library serving many peers
    /// uses): every post, poll and wait goes through the worker.
    Worker {
        worker: Box<Worker>,
        ep: EndpointId,
        events: Vec<Event>,
    },
}

/// A connection plus the completion slots to poll into.
#[derive(Debug)]
pub struct Peer {
    link: Link,
    cq: Vec<Completion>,
    deadline: Duration,
    spin: Duration,
}

impl Peer {
    /// Wraps a connection, driven directly; `deadline` bounds any single wait for a
    /// completion.
    pub fn new(conn: Box<dyn Transport>, deadline: Duration) -> Self {
        Self::with_link(Link::Bare(conn), deadline)
    }

    /// Wraps a connection as the one endpoint of a fresh [`Worker`] on its domain: every
    /// post, poll and wait goes through the worker, as in a program that serves many peers.
    ///
    /// # Errors
    /// The worker's own setup (its epoll fd).
    pub fn on_worker(conn: Box<dyn Transport>, deadline: Duration) -> fabric_core::Result<Self> {
        let mut worker = Box::new(Worker::new(conn.domain())?);
        let ep = worker.add(conn)?;
        let link = Link::Worker {
            worker,
            ep,
            events: (0..1).map(|_| Event::default()).collect(),
        };
        Ok(Self::with_link(link, deadline))
    }

    fn with_link(link: Link, deadline: Duration) -> Self {
        Peer {
            link,
            cq: (0..1).map(|_| Completion::default()).collect(),
            deadline,
            spin: if PINNED.load(std::sync::atomic::Ordering::Relaxed) {
                Duration::from_micros(200)
            } else {
                Duration::from_micros(20)
            },
        }
    }

    /// Whether a [`Worker`] drives the connection ([`on_worker`](Self::on_worker)).
    pub fn is_on_worker(&self) -> bool {
        matches!(self.link, Link::Worker { .. })
    }

    /// What drives the connection, for the examples' headers: `"worker"` or `"transport"`.
    pub fn engine(&self) -> &'static str {
        if self.is_on_worker() {
            "worker"
        } else {
            "transport"
        }
    }

    /// The connection, to register memory or post what the peer has no method for.
    ///
    /// # Errors
    /// Only on a worker that lost the endpoint (never here).
    pub fn conn(&mut self) -> fabric_core::Result<&mut dyn Transport> {
        match &mut self.link {
            Link::Bare(t) => Ok(t.as_mut()),
            Link::Worker { worker, ep, .. } => worker.endpoint(*ep),
        }
    }

    fn poll_one(&mut self) -> fabric_core::Result<Option<Completion>> {
        match &mut self.link {
            Link::Bare(t) => {
                Ok((t.poll(&mut self.cq)? > 0).then(|| std::mem::take(&mut self.cq[0])))
            }
            Link::Worker { worker, events, .. } => {
                Ok((worker.poll(events)? > 0).then(|| std::mem::take(&mut events[0].completion)))
            }
        }
    }

    fn wait(&mut self, timeout: Duration) -> fabric_core::Result<()> {
        match &mut self.link {
            Link::Bare(t) => t.wait(Some(timeout)),
            Link::Worker { worker, .. } => worker.wait(Some(timeout)),
        }
    }

    /// How long to busy-poll before yielding the CPU (default 20 us: a peer that shares
    /// our core gets it quickly; 200 us once [`establish`] pinned the two processes to
    /// their own cores).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// The next completion: busy-polls for a while, then sleeps on the wait fd.
    ///
    /// # Errors
    /// A failed completion (`Error::Disconnected` / `Error::Protocol` with its status) or
    /// no completion within the deadline.
    pub fn next_completion(&mut self) -> fabric_core::Result<Completion> {
        self.next_with_spin(self.spin)
    }

    /// Like [`next_completion`](Self::next_completion) but sleeps on the wait fd after a
    /// few microseconds: for waits that take long anyway (large transfers), so the waiting
    /// process does not compete with the one doing the copying (for a core, or for an SMT
    /// core's execution units when pinned to its sibling).
    ///
    /// # Errors
    /// As [`next_completion`](Self::next_completion).
    pub fn next_patient(&mut self) -> fabric_core::Result<Completion> {
        self.next_with_spin(Duration::from_micros(5))
    }

    fn next_with_spin(&mut self, spin: Duration) -> fabric_core::Result<Completion> {
        let mut spins = 0u32;
        let mut start: Option<Instant> = None;
        loop {
            if let Some(c) = self.poll_one()? {
                if c.status != Status::Success {
                    return Err(match c.status {
                        Status::PeerGone => {
                            Error::Disconnected(format!("{:?} failed: peer gone", c.op))
                        }
                        s => err(format!("{:?} completed with {s:?}", c.op)),
                    });
                }
                return Ok(c);
            }
            // Busy-poll for ~20 us, then poll-and-yield (an oversubscribed host may run
            // the peer on our core) until ~2 ms, then sleep on the wait fd.
            spins += 1;
            if !spins.is_multiple_of(16) {
                std::hint::spin_loop();
                continue;
            }
            let t0 = *start.get_or_insert_with(Instant::now);
            let waited = t0.elapsed();
            if waited < spin {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) && spin >= Duration::from_micros(10) {
                std::thread::yield_now();
            } else {
                if waited > self.deadline {
                    return Err(Error::Timeout("completion"));
                }
                self.wait(Duration::from_millis(20))?;
            }
        }
    }

    fn try_send(&mut self, buf: Buf, wr: u64) -> fabric_core::PostResult {
        match &mut self.link {
            Link::Bare(t) => t.post_send(buf, wr),
            Link::Worker { worker, ep, .. } => worker.post_send(*ep, buf, wr),
        }
    }
    fn send(&mut self, buf: Buf, wr: u64) -> fabric_core::Result<()> {
        self.try_send(buf, wr).map_err(|e| e.error)
    }
    fn recv(&mut self, buf: Buf, wr: u64) -> fabric_core::Result<()> {
        match &mut self.link {
            Link::Bare(t) => t.post_recv(buf, wr),
            Link::Worker { worker, ep, .. } => worker.post_recv(*ep, buf, wr),
        }
        .map_err(|e| e.error)
    }
}

/// Control flag: the phase's receives stream ([`Region::set_streaming`]).
const FLAG_STREAMING: u32 = 1;

fn ctrl(mode: Mode, size: usize, iters: usize, flags: u32) -> [u8; CTRL_LEN] {
    let mut b = [0u8; CTRL_LEN];
    b[0..4].copy_from_slice(&CTRL_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(mode as u32).to_le_bytes());
    b[8..16].copy_from_slice(&(size as u64).to_le_bytes());
    b[16..24].copy_from_slice(&(iters as u64).to_le_bytes());
    b[24..28].copy_from_slice(&flags.to_le_bytes());
    b
}

fn parse_ctrl(b: &[u8]) -> fabric_core::Result<(Mode, usize, usize, u32)> {
    if b.len() != CTRL_LEN || b[0..4] != CTRL_MAGIC.to_le_bytes() {
        return Err(err("expected a control message"));
    }
    let u = |r: std::ops::Range<usize>| {
        let mut a = [0u8; 8];
        a[..r.len()].copy_from_slice(&b[r]);
        u64::from_le_bytes(a)
    };
    let mode = Mode::from(u(4..8) as u32).ok_or_else(|| err("unknown mode"))?;
    let flags = u(24..28) as u32;
    if flags & !FLAG_STREAMING != 0 || b[28..32] != [0; 4] {
        return Err(err(format!("unknown control flags {flags:#x}")));
    }
    Ok((mode, u(8..16) as usize, u(16..24) as usize, flags))
}

/// The responder: serves phases until `Quit`. `max` is the largest message size.
///
/// # Errors
/// Transport failures or a peer breaking the protocol.
pub fn respond(peer: &mut Peer, max: usize) -> fabric_core::Result<()> {
    let slot = max.max(CTRL_LEN).max(RemoteKey::PACKED_LEN);
    // The echo goes out of the receive buffer: a send buffer (see the module docs).
    let rx = send_buffer(peer.conn()?, slot * WINDOW)?;
    let tx = send_buffer(peer.conn()?, slot)?;
    let target = buffer(
        peer.conn()?,
        max.max(8),
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    for i in 0..WINDOW {
        peer.recv(rx.slice(i * slot, slot)?, 0)?;
    }
    // Tell the initiator our one-sided key.
    let key = target.remote_key().expect("remote access");
    let kb = tx.slice(0, RemoteKey::PACKED_LEN)?;
    kb.copy_from(&key.pack())?;
    peer.send(kb, 1)?;
    // A control message that arrived while the previous phase was still finishing.
    let mut stash: std::collections::VecDeque<Completion> = Default::default();
    loop {
        let c = match stash.pop_front() {
            Some(c) => c,
            None => next_recv(peer)?,
        };
        let mut cb = [0u8; CTRL_LEN];
        let buf = c.buf.expect("buf");
        if c.len != CTRL_LEN {
            return Err(err(format!(
                "expected a control message, got {} bytes",
                c.len
            )));
        }
        buf.copy_to(&mut cb)?;
        let (mode, size, iters, flags) = parse_ctrl(&cb)?;
        if mode == Mode::Quit {
            // Acknowledge, so the initiator leaves only after we read everything (a TCP
            // close with unread data resets the connection). It may hang up as soon as the
            // ack is out, so a disconnect here is the normal end.
            return match ack(peer, &tx) {
                Ok(()) | Err(Error::Disconnected(_)) => Ok(()),
                Err(e) => Err(e),
            };
        }
        repost(peer, buf, slot)?;
        match mode {
            Mode::Quit => unreachable!("handled above"),
            Mode::PingPong => {
                // Echo each message; a send may complete after the next message arrived
                // (rendezvous sends complete when the peer has read them).
                let (mut echoed, mut sends_done) = (0, 0);
                while sends_done < iters {
                    let c = match stash.pop_front() {
                        Some(c) if echoed < iters => c,
                        Some(c) => {
                            stash.push_front(c);
                            peer.next_completion()?
                        }
                        None => peer.next_completion()?,
                    };
                    if c.op == OpKind::Recv && echoed == iters {
                        stash.push_back(c);
                        continue;
                    }
                    let mut b = c.buf.expect("buf");
                    match c.op {
                        OpKind::Recv if echoed < iters => {
                            b.set_len(c.len)?;
                            peer.send(b, 2)?;
                            echoed += 1;
                        }
                        OpKind::Send => {
                            sends_done += 1;
                            repost(peer, b, slot)?;
                        }
                        _ => return Err(err("unexpected completion during an echo")),
                    }
                }
            }
            Mode::Stream | Mode::BiStream => {
                let bi = mode == Mode::BiStream;
                // For this phase only: the echo of a ping-pong reads what it received.
                rx.set_streaming(flags & FLAG_STREAMING != 0);
                let (mut got, mut sent, mut sends_out) = (0, 0, 0);
                while got < iters || (bi && sent < iters) || sends_out > 0 {
                    while bi && sent < iters && sends_out < WINDOW {
                        peer.send(tx.slice(0, size)?, 3)?;
                        sent += 1;
                        sends_out += 1;
                    }
                    let c = match stash.pop_front() {
                        Some(c) => c,
                        None => peer.next_completion()?,
                    };
                    match c.op {
                        OpKind::Recv => {
                            got += 1;
                            repost(peer, c.buf.expect("buf"), slot)?;
                        }
                        _ => sends_out -= 1,
                    }
                }
                rx.set_streaming(false);
                ack(peer, &tx)?;
            }
            Mode::OneSided => {
                let c = match stash.pop_front() {
                    Some(c) => c,
                    None => next_recv(peer)?,
                };
                repost(peer, c.buf.expect("buf"), slot)?;
                ack(peer, &tx)?;
            }
            Mode::Memcpy => {
                // The reference allocates 17 buffers of `size`: no larger than the messages
                // this run was set up for.
                if size > slot {
                    return Err(err(format!(
                        "memcpy reference of {size} bytes asked for, messages are at most {slot}"
                    )));
                }
                let b = tx.slice(0, 8)?;
                b.copy_from(&memcpy_bw(size, iters).to_le_bytes())?;
                peer.send(b, 9)?;
                let c = peer.next_completion()?;
                if c.op != OpKind::Send {
                    return Err(err("unexpected completion while answering a memcpy figure"));
                }
            }
        }
    }
}

fn ack(peer: &mut Peer, tx: &Region) -> fabric_core::Result<()> {
    peer.send(tx.slice(0, 8)?, 9)?;
    let c = peer.next_completion()?;
    if c.op != OpKind::Send {
        return Err(err("unexpected completion while acking"));
    }
    Ok(())
}

fn repost(peer: &mut Peer, mut b: Buf, slot: usize) -> fabric_core::Result<()> {
    b.set_len(slot)?;
    peer.recv(b, 0)
}

fn next_recv(peer: &mut Peer) -> fabric_core::Result<Completion> {
    loop {
        let c = peer.next_completion()?;
        if c.op == OpKind::Recv {
            return Ok(c);
        }
        // A send completion of ours: nothing to do (its buffer is a slice of `tx`).
    }
}

/// The initiator's side of a run.
#[derive(Debug)]
pub struct Initiator {
    peer: Peer,
    rx: Region,
    tx: Region,
    scratch: Region,
    remote: RemoteKey,
    slot: usize,
    clock: Clock,
}

impl Initiator {
    /// Sets up buffers for messages up to `max` bytes and learns the responder's key.
    ///
    /// # Errors
    /// Transport failures or a peer breaking the protocol.
    pub fn new(mut peer: Peer, max: usize) -> fabric_core::Result<Self> {
        let slot = max.max(CTRL_LEN).max(RemoteKey::PACKED_LEN);
        let rx = buffer(peer.conn()?, slot * WINDOW, Access::empty())?;
        let tx = send_buffer(peer.conn()?, slot)?;
        tx.fill(0, slot, 0x5a)?;
        let scratch = buffer(peer.conn()?, slot, Access::empty())?;
        for i in 0..WINDOW {
            peer.recv(rx.slice(i * slot, slot)?, 0)?;
        }
        let c = next_recv(&mut peer)?;
        let b = c.buf.expect("buf");
        let mut kb = [0u8; RemoteKey::PACKED_LEN];
        if c.len != kb.len() {
            return Err(err("expected the responder's remote key"));
        }
        b.copy_to(&mut kb)?;
        let remote = RemoteKey::decode(&kb)?;
        repost(&mut peer, b, slot)?;
        Ok(Initiator {
            peer,
            rx,
            tx,
            scratch,
            remote,
            slot,
            clock: Clock::new(),
        })
    }

    /// What ping-pong latencies are timed with (for a report's header).
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Whether the receives of streaming phases ([`stream`](Self::stream)) stream into
    /// their buffers — the responder's, and this side's in a bidirectional phase
    /// ([`Region::set_streaming`]: non-temporal copies on shm; no effect elsewhere).
    pub fn set_streaming_receives(&mut self, on: bool) {
        self.rx.set_streaming(on);
    }

    /// The peer in use (its connection, and whether a worker drives it).
    pub fn peer(&mut self) -> &mut Peer {
        &mut self.peer
    }

    fn control(&mut self, mode: Mode, size: usize, iters: usize) -> fabric_core::Result<()> {
        let b = self.tx.slice(0, CTRL_LEN)?;
        // The control bytes go into tx[0..32]; data phases reuse tx afterwards, which is
        // fine: the send completed (copied or on the wire) before we return.
        let streams = self.rx.is_streaming() && matches!(mode, Mode::Stream | Mode::BiStream);
        b.copy_from(&ctrl(mode, size, iters, u32::from(streams)))?;
        self.peer.send(b, 100)?;
        let c = self.peer.next_completion()?;
        if c.op != OpKind::Send {
            return Err(err("unexpected completion after a control message"));
        }
        if mode != Mode::Quit {
            self.tx.fill(0, CTRL_LEN, 0x5a)?;
        }
        Ok(())
    }

    /// Ping-pong `iters` messages of `size`; returns (median, p99) one-way latency in µs.
    ///
    /// # Errors
    /// Transport failures or a peer breaking the protocol.
    pub fn pingpong(&mut self, size: usize, iters: usize) -> fabric_core::Result<(f64, f64)> {
        self.control(Mode::PingPong, size, iters)?;
        let mut samples = Vec::with_capacity(iters);
        // A sample is one whole iteration, half of it one way: the clock is read once per
        // round trip, at its end, which is the next one's start — as `ucx_perftest` and
        // perftest measure. (Until 2026-12-06 a sample ran from before the send to the echo's
        // completion, which left this side's repost of the receive and the send's completion
        // out of the figure: 0.16 µs at 8 B over shm where a whole iteration takes 0.17–0.18.)
        // The clock is the reference's kind too: the time-stamp counter where the kernel
        // trusts it (`crate::clock`), as `ucx_perftest` and perftest read it.
        let clock = self.clock;
        // The echo's buffer goes back to the receive queue after the next ping is sent, as
        // `ucx_perftest` posts its receive after its send: bookkeeping stays off the round
        // trip's critical path (the other `WINDOW - 1` receives stay posted meanwhile).
        let mut echoed: Option<Buf> = None;
        let mut last = clock.now();
        for _ in 0..iters {
            self.peer.send(self.tx.slice(0, size)?, 1)?;
            if let Some(b) = echoed.take() {
                repost(&mut self.peer, b, self.slot)?;
            }
            let mut got_send = false;
            while echoed.is_none() || !got_send {
                let c = self.peer.next_completion()?;
                match c.op {
                    OpKind::Send => got_send = true,
                    OpKind::Recv => {
                        if c.len != size {
                            return Err(err(format!("echo of {} bytes, sent {size}", c.len)));
                        }
                        echoed = Some(c.buf.expect("buf"));
                    }
                    _ => return Err(err("unexpected completion")),
                }
            }
            let now = clock.now();
            samples.push(clock.micros(last, now) / 2.0);
            last = now;
        }
        if let Some(b) = echoed {
            repost(&mut self.peer, b, self.slot)?;
        }
        samples.sort_by(|a, b| a.total_cmp(b));
        let med = samples[samples.len() / 2];
        let p99 = samples[((samples.len() * 99) / 100).min(samples.len() - 1)];
        Ok((med, p99))
    }

    /// Streams `iters` sends of `size` (both ways if `bi`); returns MiB/s (per direction).
    ///
    /// # Errors
    /// Transport failures or a peer breaking the protocol.
    pub fn stream(&mut self, size: usize, iters: usize, bi: bool) -> fabric_core::Result<f64> {
        self.control(if bi { Mode::BiStream } else { Mode::Stream }, size, iters)?;
        // Large transfers on a shared CPU: sleep while the peer copies instead of taking its
        // core. Pinned to a CPU of its own, the sender polls, as `ucx_perftest`'s does: a
        // sleeping sender has the receiver signal it after every message it finishes (an
        // eventfd write and, on a virtual machine, waking an idle vCPU), on the receiver's
        // path between two copies — shm at 1 MiB ran at 0.78–0.88 × memcpy with the sender
        // sleeping, 0.98–1.06 × with it polling (BENCHMARKS.md).
        let patient = size >= 64 << 10 && !PINNED.load(std::sync::atomic::Ordering::Relaxed);
        let t0 = Instant::now();
        let (mut sent, mut done, mut got, mut acked) = (0, 0, 0, false);
        while done < iters || (bi && got < iters) || !acked {
            while sent < iters && sent - done < WINDOW {
                match self.peer.try_send(self.tx.slice(0, size)?, 1) {
                    Ok(()) => sent += 1,
                    Err(e) if e.is_would_block() => break,
                    Err(e) => return Err(e.error),
                }
            }
            let c = if patient {
                self.peer.next_patient()?
            } else {
                self.peer.next_completion()?
            };
            match c.op {
                OpKind::Send => done += 1,
                OpKind::Recv => {
                    if bi && got < iters {
                        got += 1;
                    } else {
                        acked = true;
                    }
                    repost(&mut self.peer, c.buf.expect("buf"), self.slot)?;
                }
                _ => return Err(err("unexpected completion")),
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        Ok((size * iters) as f64 / secs / (1 << 20) as f64)
    }

    /// One-sided: `iters` writes (or reads) of `size` into the responder's region, then a
    /// "done" message and its ack; returns MiB/s.
    ///
    /// # Errors
    /// Transport failures, or a transport without one-sided operations.
    pub fn one_sided(&mut self, size: usize, iters: usize, read: bool) -> fabric_core::Result<f64> {
        self.control(Mode::OneSided, size, iters)?;
        let key = self.remote;
        let t0 = Instant::now();
        let (mut posted, mut done) = (0, 0);
        while done < iters {
            while posted < iters && posted - done < WINDOW {
                let r = if read {
                    let b = self.scratch.slice(0, size)?;
                    self.peer.conn()?.post_read(b, &key, 0, 5)
                } else {
                    let b = self.tx.slice(0, size)?;
                    self.peer.conn()?.post_write(b, &key, 0, 5)
                };
                match r {
                    Ok(()) => posted += 1,
                    Err(e) if e.is_would_block() => break,
                    Err(e) => return Err(e.error),
                }
            }
            let c = self.peer.next_completion()?;
            match c.op {
                OpKind::Write | OpKind::Read => done += 1,
                _ => return Err(err("unexpected completion")),
            }
        }
        // Tell the responder, wait for its ack (so the data is surely there).
        self.peer.send(self.tx.slice(0, 8)?, 6)?;
        let mut acked = false;
        let mut send_done = false;
        while !acked || !send_done {
            let c = self.peer.next_completion()?;
            match c.op {
                OpKind::Send => send_done = true,
                OpKind::Recv => {
                    acked = true;
                    repost(&mut self.peer, c.buf.expect("buf"), self.slot)?;
                }
                _ => return Err(err("unexpected completion")),
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        Ok((size * iters) as f64 / secs / (1 << 20) as f64)
    }

    /// `memcpy` bandwidth measured by the responder on its own CPU ([`memcpy_bw`]): the
    /// copy a receiver's transport makes runs there, and two CPUs of one virtual machine
    /// may sit on host cores whose memory bandwidth differs by a fifth.
    ///
    /// # Errors
    /// Transport failures, or a peer answering something else than a bandwidth.
    pub fn peer_memcpy(&mut self, size: usize, iters: usize) -> fabric_core::Result<f64> {
        self.control(Mode::Memcpy, size, iters)?;
        let c = next_recv(&mut self.peer)?;
        let b = c.buf.expect("buf");
        let mut v = [0u8; 8];
        if c.len != v.len() {
            return Err(err(format!(
                "expected an 8-byte memcpy figure, got {} bytes",
                c.len
            )));
        }
        b.copy_to(&mut v)?;
        repost(&mut self.peer, b, self.slot)?;
        let mibs = f64::from_le_bytes(v);
        if mibs.is_finite() && mibs > 0.0 {
            Ok(mibs)
        } else {
            Err(err(format!(
                "the peer's memcpy figure is not a bandwidth: {mibs}"
            )))
        }
    }

    /// Ends the run (the responder returns from [`respond`]).
    ///
    /// # Errors
    /// Transport failures.
    pub fn quit(&mut self) -> fabric_core::Result<()> {
        self.control(Mode::Quit, 0, 0)?;
        let c = next_recv(&mut self.peer)?;
        drop(c);
        Ok(())
    }
}

/// Prints the perftest-style header.
pub fn print_header() {
    println!(
        "{:>10} {:>8} {:>14} {:>12} {:>14}",
        "#bytes", "#iters", "t_typical[us]", "t_p99[us]", "BW[MiB/s]"
    );
}

/// A MiB/s figure with one decimal, or with at least three significant digits below 1 MiB/s
/// (small messages on a slow host or an emulated guest stream at a few KiB/s, which one
/// decimal would print as `0.0`). Only a real zero prints as `0.0`.
fn mib_s_figure(b: f64) -> String {
    if !(b > 0.0 && b < 1.0) {
        return format!("{b:.1}");
    }
    let decimals = (2.0 - b.log10().floor()).clamp(1.0, 15.0) as usize;
    format!("{b:.decimals$}")
}

/// Prints one row.
pub fn print_row(r: &Row) {
    let bw = r.bw_mib_s.map_or("-".to_string(), mib_s_figure);
    println!(
        "{:>10} {:>8} {:>14.3} {:>12.3} {:>14}",
        r.size, r.iters, r.lat_typical_us, r.lat_p99_us, bw
    );
}

/// The command-line options every perf example shares: how it finds its peer
/// (`#[command(flatten)]` them into the example's own options).
#[derive(clap::Args, Debug, Clone)]
pub struct PeerArgs {
    /// Wait for one peer on the bootstrap address (cross-machine run).
    #[arg(long, conflicts_with = "connect")]
    pub server: bool,
    /// Connect to a `--server` at HOST:PORT (cross-machine run).
    #[arg(long, value_name = "HOST:PORT")]
    pub connect: Option<String>,
    /// Bootstrap address `--server` binds.
    #[arg(long, default_value = "0.0.0.0:18515")]
    pub bind: String,
    /// Transport: shm, tcp or verbs (default: automatic; env FABRIC_TRANSPORT).
    #[arg(long)]
    pub transport: Option<fabric_core::TransportKind>,
    /// Shared secret both sides must present (env FABRIC_SECRET).
    #[arg(long)]
    pub secret: Option<String>,
    /// Do not pin this process and its spawned peer to two different CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Drive the connection through a `Worker` (the progress engine that serves many
    /// peers: one poll, one fd) on both sides, instead of the bare `Transport`.
    #[arg(long)]
    pub worker: bool,
    /// Internal: run as the responder spawned by a no-argument run.
    #[arg(long, hide = true, value_name = "ADDRESS")]
    pub responder: Option<String>,
    /// Internal: the CPU the spawned responder pins itself to.
    #[arg(long, hide = true)]
    pub pin_cpu: Option<usize>,
}

/// Runs an example named `name` whose largest message is `max` bytes: finds the peer the
/// way `peer` says (environment overrides included), runs `measure` as the initiator or
/// serves as the responder, and exits the process with status 1 and the error on failure.
pub fn main_with(
    name: &'static str,
    peer: &PeerArgs,
    max: usize,
    measure: impl FnOnce(Peer) -> Result<(), Box<dyn std::error::Error>>,
) {
    crate::cli::die_on_broken_pipe();
    let mut setup = Setup {
        name,
        server: peer.server,
        connect: peer.connect.clone(),
        bind: peer.bind.clone(),
        transport: peer.transport,
        secret: peer.secret.clone(),
        responder: peer.responder.clone(),
        max,
        pin: !peer.no_pin,
        pin_cpu: peer.pin_cpu,
        worker: peer.worker,
    };
    let r = apply_env(&mut setup)
        .map_err(Into::into)
        .and_then(|()| run_sides(&setup, measure));
    if let Err(e) = r {
        // The spawned responder of a no-argument run whose initiator went away: the
        // initiator told its own story (an error, a panic, a signal such as SIGPIPE from
        // `| head`); a second message from here would only follow the shell's prompt.
        let orphaned = setup.responder.is_some()
            && matches!(e.downcast_ref::<Error>(), Some(Error::Disconnected(_)));
        if !orphaned {
            eprintln!("{name}: error: {e}");
        }
        std::process::exit(1);
    }
}

/// How an example was asked to find its peer.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Name used in messages (`pingpong`, `bandwidth`).
    pub name: &'static str,
    /// `--server`: wait for one peer on `bind`.
    pub server: bool,
    /// `--connect HOST:PORT`.
    pub connect: Option<String>,
    /// Bootstrap bind address for `--server`.
    pub bind: String,
    /// Forced transport (`--transport` / `FABRIC_TRANSPORT`).
    pub transport: Option<fabric_core::TransportKind>,
    /// Shared secret (`--secret` / `FABRIC_SECRET`).
    pub secret: Option<String>,
    /// Hidden `--responder ADDRESS` (the spawned peer of a no-argument run).
    pub responder: Option<String>,
    /// Largest message.
    pub max: usize,
    /// No-argument runs: pin this process and the spawned peer to two different CPUs
    /// (`--no-pin` turns it off). Hidden `--pin-cpu N` carries the peer's CPU.
    pub pin: bool,
    /// The CPU the spawned peer pins itself to.
    pub pin_cpu: Option<usize>,
    /// `--worker`: both sides drive their connection through a [`Worker`] (the spawned
    /// peer is told so).
    pub worker: bool,
}

/// The result of [`establish`].
#[derive(Debug)]
pub enum Side {
    /// Measure over this connection; the child (if any) is our spawned peer.
    Initiator(Box<dyn Transport>, Option<std::process::Child>),
    /// Serve the initiator over this connection.
    Responder(Box<dyn Transport>),
}

/// Reads `FABRIC_TRANSPORT` / `FABRIC_SECRET` into `setup` where the CLI left them unset.
///
/// # Errors
/// An unknown transport name.
pub fn apply_env(setup: &mut Setup) -> fabric_core::Result<()> {
    if setup.transport.is_none() {
        if let Ok(v) = std::env::var("FABRIC_TRANSPORT") {
            if !v.is_empty() {
                setup.transport = Some(v.parse()?);
            }
        }
    }
    if setup.secret.is_none() {
        setup.secret = std::env::var("FABRIC_SECRET")
            .ok()
            .filter(|s| !s.is_empty());
    }
    Ok(())
}

/// Connects the way `setup` says: as the spawned responder, across machines through the
/// bootstrap, or (no arguments) by starting our own peer process (`exe --responder ADDR
/// --max-size N`) over the default transport (shm unless forced).
///
/// # Errors
/// Bootstrap, transport and process-spawning failures.
pub fn establish(setup: &Setup) -> Result<Side, Box<dyn std::error::Error>> {
    use fabric_core::backend::{self, Options};
    use fabric_core::bootstrap::{self, Role};
    let opts = Options::default();
    let timeout = Duration::from_secs(60);
    if let Some(addr) = &setup.responder {
        if let Some(cpu) = setup.pin_cpu {
            fabric_core::sys::pin_to_cpu(cpu)?;
            PINNED.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let mut c = backend::connect(addr, &opts)?;
        return Ok(Side::Responder(backend::connect_timeout(
            c.as_mut(),
            timeout,
        )?));
    }
    if setup.server || setup.connect.is_some() {
        let role = match &setup.connect {
            None => Role::Server {
                bind: setup.bind.clone(),
            },
            Some(s) => Role::Client { server: s.clone() },
        };
        eprintln!(
            "{}: {}",
            setup.name,
            match &role {
                Role::Server { bind } => format!(
                    "waiting for a peer on {bind} (run the other side with --connect THIS_HOST:PORT)"
                ),
                Role::Client { server } => format!("connecting to {server}"),
            }
        );
        let conn = bootstrap::pair(
            &role,
            setup.transport,
            setup.secret.as_deref(),
            &opts,
            timeout,
        )?;
        return Ok(if setup.server {
            Side::Responder(conn)
        } else {
            Side::Initiator(conn, None)
        });
    }
    let kind = setup.transport.unwrap_or(fabric_core::TransportKind::Shm);
    let mut listener = backend::listen(kind, &opts)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    if setup.pin {
        // Two busy-polling processes on one core wait for each other's time slices.
        let cpus = fabric_core::sys::allowed_cpus()?;
        if cpus.len() >= 2 {
            fabric_core::sys::pin_to_cpu(cpus[0])?;
            PINNED.store(true, std::sync::atomic::Ordering::Relaxed);
            cmd.arg("--pin-cpu").arg(cpus[1].to_string());
        }
    }
    let mut child = cmd
        .arg("--responder")
        .arg(listener.address())
        .arg("--max-size")
        .arg(setup.max.to_string())
        .args(setup.worker.then_some("--worker"))
        .env_remove("FABRIC_TRANSPORT")
        .stdin(std::process::Stdio::null())
        .spawn()?;
    let start = Instant::now();
    loop {
        if let Some(c) = listener.accept()? {
            return Ok(Side::Initiator(c, Some(child)));
        }
        if let Some(st) = child.try_wait()? {
            return Err(format!("the peer process exited during setup ({st})").into());
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the peer process did not connect within 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs `measure` as the initiator or serves as the responder; reaps a spawned child.
/// Both get a [`Peer`] driven the way `setup.worker` says.
///
/// # Errors
/// Whatever `measure` or the responder returned, or a failed child.
pub fn run_sides(
    setup: &Setup,
    measure: impl FnOnce(Peer) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let peer = |conn: Box<dyn Transport>| {
        let deadline = Duration::from_secs(60);
        if setup.worker {
            Peer::on_worker(conn, deadline)
        } else {
            Ok(Peer::new(conn, deadline))
        }
    };
    match establish(setup)? {
        Side::Responder(conn) => Ok(respond(&mut peer(conn)?, setup.max)?),
        Side::Initiator(conn, child) => {
            let r = peer(conn).map_err(Into::into).and_then(measure);
            if let Some(mut child) = child {
                if r.is_err() {
                    let _ = child.kill();
                }
                let st = child.wait()?;
                r?;
                if !st.success() {
                    return Err(format!("the peer process failed ({st})").into());
                }
                return Ok(());
            }
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ctrl, median_ratio, mib_s_figure, parse_ctrl, Mode, FLAG_STREAMING};

    #[test]
    fn control_messages_carry_the_streaming_flag_and_refuse_unknown_ones() {
        let (mode, size, iters, flags) =
            parse_ctrl(&ctrl(Mode::Stream, 4 << 20, 96, FLAG_STREAMING)).expect("parse");
        assert_eq!(
            (mode, size, iters, flags),
            (Mode::Stream, 4 << 20, 96, FLAG_STREAMING)
        );
        let (.., flags) = parse_ctrl(&ctrl(Mode::BiStream, 1, 2, 0)).expect("parse");
        assert_eq!(flags, 0);
        assert!(
            parse_ctrl(&ctrl(Mode::Stream, 1, 2, 2)).is_err(),
            "unknown flag bit"
        );
        let mut b = ctrl(Mode::Stream, 1, 2, 0);
        b[31] = 1;
        assert!(parse_ctrl(&b).is_err(), "reserved bytes set");
    }

    #[test]
    fn median_ratio_pairs_each_figure_with_its_own_reference() {
        // Ratios 1.0, 3.0, 0.5: the median is 1.0 — not best / best (30 / 10 = 3.0).
        assert_eq!(
            median_ratio(&[(10.0, 10.0), (30.0, 10.0), (5.0, 10.0)]),
            1.0
        );
        // Even count: the lower middle (0.5, 0.8, 1.0, 3.0 -> 0.8).
        assert_eq!(
            median_ratio(&[(10.0, 10.0), (30.0, 10.0), (5.0, 10.0), (8.0, 10.0)]),
            0.8
        );
        // A reference that measured nothing is left out, not divided by.
        assert_eq!(median_ratio(&[(7.0, 0.0), (9.0, 10.0)]), 0.9);
        assert!(median_ratio(&[]).is_nan());
        assert!(median_ratio(&[(1.0, 0.0)]).is_nan());
    }

    #[test]
    fn small_bandwidth_figures_keep_three_significant_digits() {
        assert_eq!(mib_s_figure(1234.56), "1234.6");
        assert_eq!(mib_s_figure(1.0), "1.0");
        assert_eq!(mib_s_figure(0.0478), "0.0478");
        assert_eq!(mib_s_figure(0.5), "0.500");
        assert_eq!(mib_s_figure(0.000_123_4), "0.000123");
        assert_eq!(mib_s_figure(0.0), "0.0");
        for b in [0.9, 0.049, 0.001, 1e-9] {
            let s = mib_s_figure(b);
            assert!(s.parse::<f64>().unwrap() > 0.0, "{b} printed as {s}");
        }
    }
}
