//! Backends and how they plug in.
//!
//! A backend is a thin "hal" (`Hal`) that only moves bytes; validation and in-flight
//! bookkeeping live once in [`Tracker`], and `Endpoint` joins the two into a
//! [`Transport`]. Each backend file exports one [`BackendEntry`]; adding a backend is one
//! line in [`BACKENDS`].

use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::domain::{Domain, DomainBackend};
use crate::error::{Error, Result};
use crate::region::{Access, Buf, Region};
use crate::tracker::{OpDesc, Tracker};
use crate::transport::{
    AtomicOp, Capabilities, Completion, GroupPostError, PostError, PostResult, RemoteKey,
    Transport, TransportKind,
};

mod accept;
#[cfg(feature = "cuda-ipc")]
pub mod cuda_ipc;
pub mod shm;
pub mod tcp;
#[cfg(feature = "verbs")]
pub mod verbs;

/// Every backend this build knows, in automatic-selection preference order.
/// (A new backend adds its `ENTRY` here.)
pub static BACKENDS: &[&BackendEntry] = &[
    &shm::ENTRY,
    #[cfg(feature = "verbs")]
    &verbs::ENTRY,
    &tcp::ENTRY,
    #[cfg(feature = "cuda-ipc")]
    &cuda_ipc::ENTRY,
];

/// Opens a backend's per-device half.
pub(crate) type OpenDomain = fn(&Options) -> Result<Box<dyn DomainBackend>>;

/// How a backend is found, probed and started.
pub struct BackendEntry {
    /// Which kind.
    pub kind: TransportKind,
    /// Whether the backend can run on this machine (`Err` says why not).
    pub probe: fn() -> Result<()>,
    /// Opens the per-device half (a [`Domain`](crate::Domain)'s backend); every backend
    /// built in has one.
    pub(crate) open: Option<OpenDomain>,
    /// Starts a listener (in a fresh domain).
    pub listen: fn(&Options) -> Result<Box<dyn Listener>>,
    /// Starts connecting to a listener's address.
    pub connect: fn(&str, &Options) -> Result<Box<dyn Connector>>,
}

impl fmt::Debug for BackendEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendEntry")
            .field("kind", &self.kind)
            .finish()
    }
}

/// The entry for `kind`.
///
/// # Errors
/// [`Error::Unavailable`] when this build has no such backend.
pub fn entry(kind: TransportKind) -> Result<&'static BackendEntry> {
    BACKENDS
        .iter()
        .copied()
        .find(|e| e.kind == kind)
        .ok_or_else(|| Error::Unavailable {
            transport: kind,
            reason: "not built into this version of fabric-core".into(),
        })
}

/// Connection options (defaults suit the examples).
#[derive(Debug, Clone)]
pub struct Options {
    /// In-flight operations per connection.
    pub max_in_flight: usize,
    /// Bytes of each shm ring (power of two).
    pub ring_bytes: usize,
    /// Largest piece one shm record carries.
    pub chunk_bytes: usize,
    /// shm messages of at least this many bytes go by rendezvous: the receiver copies
    /// straight out of the sender's registered region (one copy instead of two); 0 = never.
    /// Default 2 KiB, or `FABRIC_SHM_RNDV_BYTES`.
    pub rndv_bytes: usize,
    /// Largest message.
    pub max_message: usize,
    /// Address a TCP listener binds (`127.0.0.1:0` unless told otherwise).
    pub tcp_bind: String,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Shared secret the tcp transport's peers must prove (challenge-response, as the
    /// bootstrap's); `None` (the default) admits any fabric tcp peer. [`pair`] sets it
    /// from the bootstrap secret.
    ///
    /// [`pair`]: crate::bootstrap::pair
    pub tcp_secret: Option<Vec<u8>>,
    /// The RDMA device a verbs domain opens (`FABRIC_VERBS_DEVICE` by default; else the
    /// first with an active port). See `topology::nics` (feature `verbs`).
    pub verbs_device: Option<String>,
    /// The port (else the device's first active one).
    pub verbs_port: Option<u8>,
    /// The GID index (RoCE; else the first RoCE v2 IPv4-mapped GID, or the first non-zero).
    pub verbs_gid_index: Option<u8>,
    /// Most messages a connection's unexpected queue holds (messages that arrived while
    /// receives were posted but none matched their tag; see
    /// [`Capabilities`]). Default 1024.
    pub unexpected_messages: usize,
    /// Most payload bytes a connection's unexpected queue holds. Default 4 MiB.
    pub unexpected_bytes: usize,
    /// verbs: bytes of each eager receive buffer (an 8-byte tag header plus the payload);
    /// 0 (the default, or `FABRIC_VERBS_EAGER_BYTES`) keeps receives zero-copy. When set,
    /// every message lands in one of the connection's registered bounce buffers and is
    /// copied into the receive its tag matches (or into the unexpected queue), so tagged
    /// sends and receives and grouped receives work, a too-long message fails only its
    /// receive, and the largest send is this less 8 bytes (a longer one is refused,
    /// `MessageTooLarge`; receives and one-sided operations keep `max_message`). Both
    /// peers must set the same value (the handshake refuses a mismatch).
    pub verbs_eager_bytes: usize,
    /// verbs, eager mode only: bounce buffers (of `verbs_eager_bytes` each) in one shared
    /// receive queue (SRQ) per domain, from which every queue pair of the domain takes its
    /// receives, instead of 32 registered per connection; 0 (the default, or
    /// `FABRIC_VERBS_SRQ_BUFFERS`) keeps one receive queue per connection. The receive
    /// memory of a domain is then this many buffers however many peers connect. A message
    /// no posted receive matches is copied into the connection's unexpected queue whether
    /// or not receives are posted, and its buffer goes back to the SRQ at once; only when
    /// that queue is full does the connection keep the buffer, at most `max(1, n / 8)` per
    /// connection and `max(1, n / 2)` in all: a connection that would need more fails
    /// (`ProtocolError`), so one flooding peer never starves the others. Local (the peer
    /// need not agree). 1 to 65,536 and at most half the device's largest CQ; set without
    /// `verbs_eager_bytes`, the domain refuses to open (`InvalidArgument`): without eager
    /// mode receives land straight in the caller's buffers, which an SRQ cannot route to
    /// the connection they were posted on (so set `FABRIC_VERBS_SRQ_BUFFERS` only together
    /// with `FABRIC_VERBS_EAGER_BYTES`).
    pub verbs_srq_buffers: usize,
    /// tcp: which congestion control algorithm each connection's socket uses. Default
    /// [`TcpCongestion::UnpacedOnLoopback`], or `FABRIC_TCP_CONGESTION` (`host`,
    /// `unpaced-on-loopback`, or an algorithm's name).
    pub tcp_congestion: TcpCongestion,
}

/// The congestion control a tcp connection's socket uses ([`Options::tcp_congestion`]).
///
/// Why the default departs from the host's choice on one kind of connection: a host that
/// runs BBR (`net.ipv4.tcp_congestion_control = bbr`) paces every socket, so segments leave
/// from timers and from acknowledgement processing on whichever CPU runs them, as well as
/// from the writing thread. On the loopback device a segment is delivered on the CPU that
/// sends it, so segments sent from two CPUs overtake each other; the receiver sees them out
/// of order, the sender retransmits segments that were never lost and stalls. BBR's model (a
/// bottleneck link's bandwidth and a path's round trip) has nothing to measure on a
/// connection that never leaves the host, and such a connection's algorithm affects no
/// other host's traffic. Measured (BENCHMARKS.md, "the tcp transport's congestion control
/// on loopback"): streams of 1 and 4 MiB messages went from 10–321 retransmissions per run
/// to none, and from behind UCX to ahead of it at 4 MiB.
///
/// The algorithm is set before the socket connects where the address says the connection
/// stays on the host (a loopback listener, whose accepted sockets inherit it, or a loopback
/// peer): a socket that started under BBR keeps BBR's pacing after a switch (the kernel
/// leaves it on), so one known to be local only once connected (a listener on every
/// address, a peer at this host's own non-loopback address) is switched then, with less
/// gain.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TcpCongestion {
    /// Every connection keeps the host's default algorithm.
    Host,
    /// A connection between two addresses of this host (a loopback peer, or a peer at the
    /// local address itself: the kernel routes both over the loopback device) that the host
    /// gives a pacing algorithm uses `cubic`, or `reno` where `cubic` is not allowed to this
    /// process (`reno` always is); if neither can be set it keeps the host's. Connections
    /// to other hosts keep the host's algorithm.
    #[default]
    UnpacedOnLoopback,
    /// Every connection uses this algorithm; one the kernel refuses fails the connection
    /// with [`Error::InvalidArgument`] naming what this host allows.
    Named(String),
}

impl TcpCongestion {
    /// From `FABRIC_TCP_CONGESTION` (see [`parse`](Self::parse)); unset: the default.
    pub fn from_env() -> Self {
        std::env::var("FABRIC_TCP_CONGESTION").map_or_else(|_| Self::default(), |v| Self::parse(&v))
    }

    /// `host`, `unpaced-on-loopback` (or empty: the default), or an algorithm's name.
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "" | "unpaced-on-loopback" => TcpCongestion::UnpacedOnLoopback,
            "host" => TcpCongestion::Host,
            name => TcpCongestion::Named(name.to_owned()),
        }
    }
}

/// Most parts of one grouped receive (shm, tcp).
pub const MAX_GROUP: usize = 64;

impl Default for Options {
    fn default() -> Self {
        Options {
            max_in_flight: 256,
            ring_bytes: 2 << 20,
            chunk_bytes: 64 << 10,
            rndv_bytes: env_usize("FABRIC_SHM_RNDV_BYTES").unwrap_or(2 << 10),
            max_message: 1 << 30,
            tcp_bind: "127.0.0.1:0".into(),
            handshake_timeout: Duration::from_secs(10),
            tcp_secret: None,
            verbs_device: std::env::var("FABRIC_VERBS_DEVICE").ok(),
            verbs_port: None,
            verbs_gid_index: None,
            unexpected_messages: 1024,
            unexpected_bytes: 4 << 20,
            verbs_eager_bytes: env_usize("FABRIC_VERBS_EAGER_BYTES").unwrap_or(0),
            verbs_srq_buffers: env_usize("FABRIC_VERBS_SRQ_BUFFERS").unwrap_or(0),
            tcp_congestion: TcpCongestion::from_env(),
        }
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// A listener of one backend. `accept` never blocks.
pub trait Listener: Send + fmt::Debug {
    /// The backend.
    fn kind(&self) -> TransportKind;
    /// The address a peer passes to [`connect`] (e.g. `shm:@name`, `tcp:10.0.0.1:4000`).
    fn address(&self) -> &str;
    /// A connection whose handshake finished, or `None` ("not yet; call again").
    /// A peer that fails its handshake is dropped; the listener keeps serving others.
    ///
    /// # Errors
    /// Only when the listening socket itself fails.
    fn accept(&mut self) -> Result<Option<Box<dyn Transport>>>;
}

/// A connection being set up. `poll_connect` never blocks.
pub trait Connector: Send + fmt::Debug {
    /// The finished connection, or `None` ("not yet; call again").
    ///
    /// # Errors
    /// When the handshake fails or the listener refused us.
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>>;
}

/// Starts listening on `kind`, in a fresh [`Domain`] of its own (use
/// [`Domain::listen`](crate::Domain::listen) to share registrations among connections).
///
/// # Errors
/// [`Error::Unavailable`] for an unknown backend; the backend's own setup errors.
pub fn listen(kind: TransportKind, opts: &Options) -> Result<Box<dyn Listener>> {
    (entry(kind)?.listen)(opts)
}

/// Starts connecting to `address` (which names its backend: `shm:...`, `tcp:...`).
///
/// # Errors
/// [`Error::InvalidArgument`] for an address without a known backend prefix.
pub fn connect(address: &str, opts: &Options) -> Result<Box<dyn Connector>> {
    let (kind, rest) = address.split_once(':').ok_or_else(|| {
        Error::InvalidArgument(format!("address {address:?} lacks a transport prefix"))
    })?;
    let kind: TransportKind = kind.parse()?;
    (entry(kind)?.connect)(rest, opts)
}

fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 100 {
        std::hint::spin_loop();
    } else {
        std::thread::sleep(Duration::from_micros(if *spins < 1000 { 20 } else { 500 }));
    }
}

/// Calls `accept` until a connection arrives or `timeout` passes.
///
/// # Errors
/// [`Error::Timeout`], or the listener's error.
pub fn accept_timeout(l: &mut dyn Listener, timeout: Duration) -> Result<Box<dyn Transport>> {
    let end = Instant::now() + timeout;
    let mut spins = 0;
    loop {
        if let Some(t) = l.accept()? {
            return Ok(t);
        }
        if Instant::now() > end {
            return Err(Error::Timeout("accept"));
        }
        backoff(&mut spins);
    }
}

/// Calls `poll_connect` until connected or `timeout` passes.
///
/// # Errors
/// [`Error::Timeout`], or the connector's error.
pub fn connect_timeout(c: &mut dyn Connector, timeout: Duration) -> Result<Box<dyn Transport>> {
    let end = Instant::now() + timeout;
    let mut spins = 0;
    loop {
        if let Some(t) = c.poll_connect()? {
            return Ok(t);
        }
        if Instant::now() > end {
            return Err(Error::Timeout("connect"));
        }
        backoff(&mut spins);
    }
}

/// Both ends of one connection in this process: steps `listener`'s accept and
/// `connector` (started with [`connect`] or [`Domain::connect`](crate::Domain::connect) to the
/// listener's address) from this thread until both are done; returns `(accepted,
/// connected)`. For tests, benchmarks and in-process loopback; across processes use
/// [`accept_timeout`] and [`connect_timeout`].
///
/// # Errors
/// [`Error::Timeout`] when the two do not meet within `timeout`; the listener's or the
/// connector's error.
pub fn loopback(
    listener: &mut dyn Listener,
    connector: &mut dyn Connector,
    timeout: Duration,
) -> Result<(Box<dyn Transport>, Box<dyn Transport>)> {
    let end = Instant::now() + timeout;
    let (mut a, mut b) = (None, None);
    loop {
        if a.is_none() {
            a = listener.accept()?;
        }
        if b.is_none() {
            b = connector.poll_connect()?;
        }
        if let (Some(_), Some(_)) = (&a, &b) {
            break;
        }
        if Instant::now() > end {
            return Err(Error::Timeout("loopback connect"));
        }
    }
    match (a, b) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(Error::Timeout("loopback connect")),
    }
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// A fresh process-unique connection id (regions and buffers are tied to it).
pub(crate) fn next_conn_id() -> u64 {
    NEXT_CONN.fetch_add(1, Ordering::Relaxed)
}

/// A completion queue shared by several connections of one domain (verbs), as a
/// [`Worker`](crate::Worker) drives it: one wake-up source for all of them.
///
/// A connection attached to a worker ([`Transport::attach_worker`]) has a key in the queue
/// (the value `attach_worker` returned); `(key >> 32)` is the queue's index in its domain
/// ([`DomainBackend::shared_completions`]).
pub(crate) trait SharedCompletions: Send + Sync + fmt::Debug {
    /// The fds that become readable when an attached, armed connection may have work
    /// (level-triggered: readable until [`drive`](Self::drive) ran).
    fn wake_fds(&self) -> Vec<BorrowedFd<'_>>;
    /// Acknowledges the wake-up, moves completions to their connections and appends the
    /// keys of armed connections attached to `worker` that now have work to `woken` (those
    /// of other workers stay for them, and keep the fds readable).
    fn drive(&self, worker: u64, woken: &mut Vec<u64>) -> Result<()>;
}

/// What a backend implements: moving bytes. Everything it is handed was validated by the
/// [`Tracker`].
pub(crate) trait Hal: Send + fmt::Debug {
    fn kind(&self) -> TransportKind;
    /// Flushes device memory that the NIC wrote (see [`Transport::post_flush`]); host
    /// memory never gets here (it completes at once).
    fn flush_device(&mut self, _t: &mut Tracker, buf: Buf, _wr_id: u64) -> PostResult {
        Err(PostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "flush of device memory",
            },
            buf,
        })
    }
    /// See [`Transport::attach_worker`].
    fn attach_worker(&mut self, _worker: Option<u64>) -> Option<u64> {
        None
    }
    /// Puts a send of `buf` tagged `tag` on the wire in full now, if it can (the caller
    /// checked [`Tracker::can_send_now`]: nothing is queued ahead of it); `false` leaves it
    /// to the queue. The tracker records it after this returns `true`
    /// ([`Tracker::post_sent`]), so the bookkeeping stays off the message's critical path.
    /// The default never does (and [`SENDS_NOW`](Self::SENDS_NOW) says so, so that a
    /// post does not even ask).
    fn send_now(&mut self, _buf: &Buf, _tag: u64) -> bool {
        false
    }
    /// Whether [`send_now`](Self::send_now) may ever say yes.
    const SENDS_NOW: bool = false;
    /// The largest message a send may carry, where it is below
    /// [`Capabilities::max_message`] (which bounds every operation): verbs' eager mode.
    fn max_send(&self) -> usize {
        usize::MAX
    }
    /// Moves queued operations and incoming data; reports completions to `t`.
    fn progress(&mut self, t: &mut Tracker) -> Result<()>;
    /// [`progress`](Self::progress) for a `poll` into `out`: a backend may write
    /// completions straight into `out[*n..]` (counting them in `n`) instead of queueing
    /// them in `t`, as long as the order holds ([`Tracker::finish`]). The caller then takes
    /// what `t` queued after them. On an error, `out[..*n]` still holds completions the
    /// caller must hand out.
    fn progress_into(
        &mut self,
        t: &mut Tracker,
        _out: &mut [Completion],
        _n: &mut usize,
    ) -> Result<()> {
        self.progress(t)
    }
    /// What a post does right after the tracker queued it (`recv`: the post was a
    /// receive). The default is a full [`progress`](Self::progress) pass; a backend whose
    /// posts can start with less (only the new sends, or nothing for a receive) overrides
    /// it, and then its [`arm`](Self::arm) must say "not now" whenever work it skipped
    /// here is waiting, so that no caller sleeps on it.
    fn post_kick(&mut self, t: &mut Tracker, recv: bool) -> Result<()> {
        let _ = recv;
        self.progress(t)
    }
    fn wait_fd(&self) -> BorrowedFd<'_>;
    /// See [`Transport::watch_fds`]: the fds whose readiness [`wait_fd`](Self::wait_fd)
    /// gathers (the default: `wait_fd` itself). A backend that overrides it may make its
    /// `wait_fd` on first need, so that a connection in a worker never has one.
    fn watch_fds(&self) -> WatchFds<'_> {
        WatchFds::one(self.wait_fd(), false)
    }
    fn arm(&mut self, t: &Tracker) -> Result<bool>;
    /// See [`Transport::map_remote`]; the key's transport was checked.
    fn map_remote(&mut self, key: &RemoteKey) -> Result<crate::RemoteWindow> {
        let _ = key;
        Err(Error::Unsupported {
            transport: self.kind(),
            what: "mapping a peer's memory (remote windows)",
        })
    }
}

#[doc(hidden)]
pub use crate::transport::WatchFds;

/// What [`Endpoint::send_now`] did with a send.
enum SendNow {
    /// It went out at once (and was recorded, completed): the post's result.
    Sent(PostResult),
    /// It could not: the buffer, for the queued path.
    Queue(Buf),
}

/// A connection: the shared [`Tracker`] plus one backend's [`Hal`].
///
/// Field order is drop order: the backend (a verbs queue pair, which may still hold work
/// requests on the tracker's buffers) goes before the tracker and the buffers it owns.
#[derive(Debug)]
pub(crate) struct Endpoint<H: Hal> {
    h: H,
    t: Tracker,
    domain: Domain,
    /// [`Transport::hold_posts`]: posts only queue until the hold ends.
    held: bool,
}

impl<H: Hal> Endpoint<H> {
    /// A connection of `domain` (the tracker must have been made with `domain.id()`).
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn in_domain(domain: Domain, t: Tracker, h: H) -> Self {
        debug_assert_eq!(t.owner(), domain.id());
        Endpoint {
            t,
            h,
            domain,
            held: false,
        }
    }

    /// Refuses a send longer than the backend carries (typed, with the buffer back).
    fn check_send(&self, buf: Buf) -> std::result::Result<Buf, PostError> {
        let max = self.h.max_send();
        if buf.len() > max {
            return Err(PostError {
                error: Error::MessageTooLarge {
                    len: buf.len(),
                    max,
                },
                buf,
            });
        }
        Ok(buf)
    }

    /// A send that can go out at once (not held, nothing queued ahead, the backend takes
    /// it whole) does, and only then is it recorded: the bookkeeping is off the message's
    /// critical path. Else the buffer comes back for the queued path.
    #[inline(always)]
    fn send_now(&mut self, buf: Buf, tag: u64, wr_id: u64) -> SendNow {
        if !H::SENDS_NOW || self.held || !self.t.can_send_now(&buf) || !self.h.send_now(&buf, tag) {
            return SendNow::Queue(buf);
        }
        SendNow::Sent(match self.t.post_sent(buf, wr_id, tag) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Sent, but the table broke its own invariant: nothing on this connection
                // can be trusted any more.
                self.t
                    .fail_all(crate::Status::ProtocolError, e.error.to_string());
                Err(e)
            }
        })
    }

    #[inline(always)]
    fn post(&mut self, desc: OpDesc, buf: Buf, wr_id: u64) -> PostResult {
        let recv = matches!(desc, OpDesc::Recv);
        self.t.post(desc, buf, wr_id)?;
        self.kick(recv);
        Ok(())
    }

    /// Starts what was just posted (latency; `recv`: a receive was posted); errors of
    /// the machinery become error completions.
    #[inline]
    fn kick(&mut self, recv: bool) {
        if !self.held {
            self.kick_now(recv);
        }
    }

    #[inline(never)]
    fn kick_now(&mut self, recv: bool) {
        if let Err(e) = self.h.post_kick(&mut self.t, recv) {
            self.t.fail_all(crate::Status::ProtocolError, e.to_string());
        }
    }
}

impl<H: Hal> Transport for Endpoint<H> {
    fn kind(&self) -> TransportKind {
        self.h.kind()
    }
    fn capabilities(&self) -> Capabilities {
        *self.t.caps()
    }
    fn domain(&self) -> &Domain {
        &self.domain
    }
    fn register(&mut self, len: usize, access: Access) -> Result<Region> {
        if let Some(why) = self.t.failure() {
            return Err(Error::Disconnected(why.to_string()));
        }
        if access.is_remote() && !self.t.caps().one_sided {
            return Err(Error::Unsupported {
                transport: self.h.kind(),
                what: "remote access",
            });
        }
        self.domain.register(len, access)
    }
    fn post_send(&mut self, buf: Buf, wr_id: u64) -> PostResult {
        let buf = self.check_send(buf)?;
        match self.send_now(buf, 0, wr_id) {
            SendNow::Sent(r) => r,
            SendNow::Queue(buf) => self.post(OpDesc::Send, buf, wr_id),
        }
    }
    fn post_recv(&mut self, buf: Buf, wr_id: u64) -> PostResult {
        self.post(OpDesc::Recv, buf, wr_id)
    }
    fn post_write(&mut self, buf: Buf, key: &RemoteKey, off: u64, wr_id: u64) -> PostResult {
        self.post(OpDesc::Write { key: *key, off }, buf, wr_id)
    }
    fn post_read(&mut self, buf: Buf, key: &RemoteKey, off: u64, wr_id: u64) -> PostResult {
        self.post(OpDesc::Read { key: *key, off }, buf, wr_id)
    }
    fn post_atomic(
        &mut self,
        buf: Buf,
        key: &RemoteKey,
        off: u64,
        op: AtomicOp,
        wr_id: u64,
    ) -> PostResult {
        self.post(OpDesc::Atomic { key: *key, off, op }, buf, wr_id)
    }
    fn post_send_tagged(&mut self, buf: Buf, tag: u64, wr_id: u64) -> PostResult {
        let buf = self.check_send(buf)?;
        let buf = if self.t.caps().tagged {
            match self.send_now(buf, tag, wr_id) {
                SendNow::Sent(r) => return r,
                SendNow::Queue(buf) => buf,
            }
        } else {
            buf
        };
        self.t.post_send_tagged(buf, tag, wr_id)?;
        self.kick(false);
        Ok(())
    }
    fn post_recv_tagged(&mut self, buf: Buf, tag: u64, mask: u64, wr_id: u64) -> PostResult {
        self.t.post_recv_tagged(buf, tag, mask, wr_id)?;
        self.kick(true);
        Ok(())
    }
    fn post_recv_group(
        &mut self,
        parts: Vec<(Buf, u64, u64)>,
        wr_id: u64,
    ) -> std::result::Result<(), GroupPostError> {
        self.t.post_recv_group(parts, wr_id)?;
        self.kick(true);
        Ok(())
    }
    fn post_write_imm(
        &mut self,
        buf: Buf,
        key: &RemoteKey,
        off: u64,
        imm: u32,
        wr_id: u64,
    ) -> PostResult {
        self.t.post_write_imm(buf, *key, off, imm, wr_id)?;
        self.kick(false);
        Ok(())
    }
    fn post_flush(&mut self, buf: Buf, wr_id: u64) -> PostResult {
        if buf.region().device_backing().is_some() {
            return self.h.flush_device(&mut self.t, buf, wr_id);
        }
        self.t.post_flush_done(buf, wr_id)?;
        Ok(())
    }
    fn hold_posts(&mut self) {
        self.held = true;
    }
    fn flush_posts(&mut self) {
        if std::mem::take(&mut self.held) && self.t.failure().is_none() {
            self.kick(false);
        }
    }
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        // A full pass starts whatever a hold kept back.
        self.held = false;
        // Completions finished before this pass go first.
        let mut n = self.t.take(out);
        if self.t.failure().is_none() {
            if let Err(e) = self.h.progress_into(&mut self.t, out, &mut n) {
                self.t.fail_all(crate::Status::ProtocolError, e.to_string());
            }
        }
        Ok(n + self.t.take(&mut out[n..]))
    }
    fn in_flight(&self) -> usize {
        self.t.in_flight()
    }
    fn wait_fd(&self) -> BorrowedFd<'_> {
        self.h.wait_fd()
    }
    fn watch_fds(&self) -> WatchFds<'_> {
        self.h.watch_fds()
    }
    fn attach_worker(&mut self, worker: Option<u64>) -> Option<u64> {
        self.h.attach_worker(worker)
    }
    fn map_remote(&mut self, key: &RemoteKey) -> Result<crate::RemoteWindow> {
        if let Some(why) = self.t.failure() {
            return Err(Error::Disconnected(why.to_string()));
        }
        if key.transport != self.h.kind() {
            return Err(Error::Foreign("remote key of another transport"));
        }
        self.h.map_remote(key)
    }
    fn arm(&mut self) -> Result<bool> {
        // Nothing held back may wait behind a sleeper.
        self.flush_posts();
        if self.t.ready_len() > 0 || self.t.failure().is_some() {
            return Ok(false);
        }
        self.h.arm(&self.t)
    }
}

/// Tests shared by the shm and tcp backends.
#[cfg(test)]
pub(crate) mod shared_tests {
    use crate::{Access, TransportKind};

    /// A receive posted after its message arrived (and was taken off the wire while no
    /// receive was posted) is found by the next `wait` without sleeping: a post no longer
    /// runs a full progress pass, so `post_kick` / `arm` must cover it.
    pub(crate) fn a_receive_posted_after_its_message_arrived_does_not_sleep(kind: TransportKind) {
        use crate::backend::{self, Options};
        use crate::transport::Completion;
        use std::time::{Duration, Instant};
        let opts = Options::default();
        let mut l = backend::listen(kind, &opts).expect("listen");
        let mut c = backend::connect(l.address(), &opts).expect("connect");
        let (mut a, mut b) =
            backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10)).expect("loopback");
        let tx = a.register(64, Access::empty()).expect("register");
        let rx = b.register(64, Access::empty()).expect("register");
        tx.slice(0, 8)
            .expect("slice")
            .copy_from(b"hot path")
            .expect("fill");
        a.post_send(tx.slice(0, 8).expect("slice"), 1)
            .expect("send");
        let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
        // The message arrives while B has no receive: polls take it as far as they can.
        for _ in 0..100 {
            let _ = a.poll(&mut out).expect("poll a");
            assert_eq!(
                b.poll(&mut out).expect("poll b"),
                0,
                "completion without a receive"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        b.post_recv(rx.slice(0, 64).expect("slice"), 2)
            .expect("recv");
        let t0 = Instant::now();
        b.wait(Some(Duration::from_secs(5))).expect("wait");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "slept {:?} with a message waiting for the receive just posted",
            t0.elapsed()
        );
        assert_eq!(
            b.poll(&mut out).expect("poll b"),
            1,
            "the receive did not complete"
        );
        assert!(out[0].status.is_ok(), "{:?}", out[0].status);
        assert_eq!(out[0].len, 8);
        let mut got = [0u8; 8];
        out[0]
            .buf
            .as_ref()
            .expect("buf")
            .copy_to(&mut got)
            .expect("read");
        assert_eq!(&got, b"hot path");
    }
}
