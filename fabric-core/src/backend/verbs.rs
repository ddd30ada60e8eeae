//! `verbs`: RDMA RC queue pairs through `ibverbs-safe` (InfiniBand / RoCE).
//!
//! * Setup: a TCP side channel (the listener's address) exchanges the queue pairs'
//!   [`ibverbs_safe::Endpoint`]s behind a 16-byte hello; the socket then stays open so a
//!   peer that dies is noticed at once (hang-up) instead of after the RC retry timeout.
//! * Every region is registered with the connection's protection domain (remote access as
//!   asked); its remote key carries the verbs `addr` and `rkey`. The NIC does the
//!   target-side checks (rkey, bounds, access).
//! * Operations map one to one: SEND / RECV, RDMA WRITE / READ, CAS / FAA. They are posted
//!   through `ibverbs-safe`'s raw layer: the tracker owns every operation's buffer (and
//!   through it the region's registration) until its completion is taken, so the safe
//!   layer's own per-request bookkeeping would be a second copy of the same. The `wr_id`
//!   carries the tracker's slot token, the queue and the connection's epoch (see
//!   `raw_id`). A connection that fails moves its queue pair to the error state before
//!   its buffers go back to the caller, and a dropped connection destroys its queue pair
//!   before its tracker lets the buffers go.
//! * Posting only enqueues: a post hands what the tracker queued to the queue pair and returns (no
//!   CQ poll; completions are taken by `poll`, and `arm` routes what the CQ holds before anyone
//!   sleeps). Several queued sends / one-sided operations go behind one doorbell (one chain of up
//!   to 32 work requests; receives likewise): what [`Transport::hold_posts`] held until
//!   [`Transport::flush_posts`], or whatever queued up while the send queue was full. In such a
//!   batch only every 16th work request and the last are signalled, and only SEND and WRITE (with
//!   or without immediate) may go unsignalled (READs and atomics keep their completions). A
//!   signalled completion retires, as successful, the unsignalled ones posted before it (the
//!   connection keeps the posted tokens in post order): RC send queues complete in order, so every
//!   operation still gets its own completion, in post order. A work request that fails reports
//!   itself whether signalled or not, so an error completion still names the failing operation
//!   (those before it succeeded; the queue pair is then in the error state and the rest fail). A
//!   single post is signalled and rings its own doorbell.
//! * One CQ for many connections: the queue pairs of a domain share a completion queue and
//!   its channel (a `Hub`; another one only once a CQ's entries — `max_cqe`, at most
//!   65,536 — are all reserved, each queue pair reserving its depth). Whoever polls it
//!   hands completions of other queue pairs to their mailbox (by `qp_num`; late flushes of
//!   destroyed queue pairs are recognised by their epoch and dropped). A
//!   [`Worker`](crate::Worker) watches each shared CQ once (its channel, and an eventfd
//!   for completions another connection polled) and wakes exactly the endpoints that got
//!   work; an endpoint it holds costs a queue pair and its side socket. A connection used
//!   alone waits on an epoll of the channel, its socket and its own eventfd, made on first
//!   need. The lock around the CQ is uncontended unless connections of one domain are
//!   polled from several threads.
//! * One receive queue for many connections (eager mode with
//!   [`Options::verbs_srq_buffers`]): the domain makes one shared receive queue (SRQ) with
//!   that many bounce buffers, registered once, and every queue pair of the domain (of
//!   every hub) takes its receives from it, so a connection costs a queue pair and a
//!   socket, not 32 registered buffers. The SRQ's completions come through the hub's CQ
//!   and mailboxes like any other (by `qp_num`); the connection copies the message out as
//!   with its own buffers and reposts the buffer to the SRQ (one lock of the SRQ per
//!   message, besides the hub's). A hub reserves CQ entries for every SRQ buffer once,
//!   not per queue pair. A message no receive matches goes to the unexpected queue even
//!   while no receive is posted, and its buffer straight back; a connection keeps shared
//!   buffers only while that queue is full, within bounds (`SrqPool`), beyond which it
//!   fails alone rather than starve the others (its side socket is shut down, so the
//!   peer learns at once); buffers of closed or failed connections come back to the SRQ
//!   (a failed connection's mailbox stops queueing and hands them straight back, since
//!   nothing progresses it again). An armed connection whose mailbox has mail already
//!   sleeps and wakes itself at once instead of reporting work: a worker would leave one
//!   with nothing of the caller's in flight dormant, and its shared buffers with it. A
//!   momentarily empty SRQ makes senders retry (receiver not ready, without limit), so in
//!   eager mode, shared or not, more messages than buffers reach a receiver only while it
//!   is progressed. [`srq_stats`] reports the queue. (256 idle endpoints of one worker in
//!   the Soft-RoCE guest, 4,104-byte buffers: 293.5 KiB resident per endpoint with an SRQ
//!   of 64, 439.8 KiB with 32 buffers each.) Without eager mode the option is
//!   refused (`InvalidArgument`): receives then land in the caller's own buffers, posted
//!   per connection, and an SRQ would hand them to whichever connection's message came
//!   first.
//! * Eager mode ([`Options::verbs_eager_bytes`], both peers alike, agreed in the hello):
//!   messages land in registered bounce buffers with an 8-byte tag header and are matched
//!   by the tracker, so tags, grouped receives and the unexpected queue work as on shm and
//!   tcp, at the price of one copy per received message.
//! * Not emulated (capabilities say so): without eager mode, a message longer than the
//!   posted receive fails the receive with [`Status::MessageTooLong`] *and* moves the queue
//!   pair to the error state (RC semantics), so the connection is lost — unlike shm and
//!   tcp.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use ibverbs_safe as ib;
use ibverbs_safe::raw::{ibv_recv_wr, ibv_send_wr, ibv_sge};

use super::accept::{self, AcceptQueue, Connecting, Handshake};
use super::{
    next_conn_id, BackendEntry, Connector, Endpoint, Hal, Listener, Options, SharedCompletions,
};
use crate::domain::{Domain, DomainBackend, MemorySupport, Registered};
use crate::error::{Error, Result};
use crate::region::{Access, Buf, Region};
use crate::sys;
use crate::tracker::{Finish, OpDesc, Pending as Op, Sink, Token, Tracker};
use crate::transport::{
    AtomicOp, Capabilities, Completion, MemoryKinds, MessageOrdering, PostError, PostResult,
    Status, Transport, TransportKind,
};

/// The registry entry.
pub static ENTRY: BackendEntry = BackendEntry {
    kind: TransportKind::Verbs,
    probe: || probe().map(|_| ()),
    open: Some(|o| Ok(Box::new(VerbsDomain::open(o)?))),
    listen: |o| Domain::open(TransportKind::Verbs, o)?.listen(),
    connect: |a, o| Domain::open(TransportKind::Verbs, o)?.connect(a),
};

/// The verbs domain: one device context and protection domain, shared by every
/// connection's queue pair and every registration.
struct VerbsDomain {
    ctx: ib::Context,
    pd: ib::ProtectionDomain,
    device: String,
    port: u8,
    gid: Option<u8>,
    /// Largest CQ the device makes.
    max_cqe: u32,
    /// The CQs its connections share (a new one when all are full; freed with their last
    /// connection).
    hubs: Mutex<Vec<Weak<Hub>>>,
    /// The queue pair connected to itself that flushes read through (made on first need).
    loopback: Mutex<Option<Loopback>>,
    /// [`Options::verbs_srq_buffers`], checked (0: no shared receive queue).
    srq_buffers: u32,
    /// The shared receive queue of eager mode (made with the first connection; every hub
    /// holds it too).
    srq: Mutex<Option<Arc<SrqPool>>>,
}

impl std::fmt::Debug for VerbsDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDomain")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid", &self.gid)
            .finish()
    }
}

impl VerbsDomain {
    fn open(opts: &Options) -> Result<Self> {
        // What needs no device first (the eager mode), so a host without one says it too.
        srq_buffers(opts, u32::MAX, u32::MAX)?;
        let (device, port, gid) = probe_with(opts)?;
        let e = |e: ib::Error| unavailable(e.to_string());
        let ctx = ib::open(Some(&device)).map_err(e)?;
        let pd = ctx.alloc_pd().map_err(e)?;
        let attr = ctx.query_device().ok();
        let max_cqe = attr.as_ref().map_or(CQ_DEPTH, |a| a.max_cqe.max(CQ_DEPTH));
        let srq_buffers = srq_buffers(
            opts,
            max_cqe,
            attr.as_ref().map_or(u32::MAX, |a| a.max_srq_wr),
        )?;
        Ok(VerbsDomain {
            ctx,
            pd,
            device,
            port,
            gid,
            max_cqe,
            hubs: Mutex::new(Vec::new()),
            loopback: Mutex::new(None),
            srq_buffers,
            srq: Mutex::new(None),
        })
    }
}

impl DomainBackend for VerbsDomain {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn register(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Registered> {
        let ra = remote_access(access);
        let mut mr: Mr = self
            .pd
            .register_remote(
                RawMem {
                    ptr,
                    len: len.max(1),
                },
                ra,
            )
            .map_err(|e| Error::Io {
                op: "ibv_reg_mr",
                source: io::Error::other(e.to_string()),
            })?;
        let rkey = mr.rkey();
        let full = mr
            .slice(..len.min(u32::MAX as usize))
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(Registered {
            local: Some((full.addr(), full.lkey())),
            backing: Some(Box::new(Backing {
                _mr: Box::new(mr),
                full,
            })),
            rkey,
        })
    }

    #[cfg(feature = "cuda-ipc")]
    fn register_dmabuf(&self, buf: nvlink_p2p::DmaBuf, access: Access) -> Result<Registered> {
        let ra = remote_access(access);
        let (fd, offset, len, iova, memory) = buf.into_parts();
        let mr = self
            .pd
            .register_dmabuf(fd.as_fd(), offset, len, iova, ra, memory)
            .map_err(|e| {
                if e.is_unsupported() {
                    Error::Unsupported {
                        transport: TransportKind::Verbs,
                        what: "GPU memory (DMA-BUF) on this device, provider or kernel \
                               (Soft-RoCE cannot; rdma-core >= 34 and a GPUDirect-capable \
                               NIC are needed)",
                    }
                } else {
                    Error::Io {
                        op: "ibv_reg_dmabuf_mr",
                        source: io::Error::other(e.to_string()),
                    }
                }
            })?;
        let rkey = mr.rkey();
        let full = mr
            .slice(..len.min(u32::MAX as usize))
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(Registered {
            local: Some((full.addr(), full.lkey())),
            backing: Some(Box::new(Backing {
                _mr: Box::new(mr),
                full,
            })),
            rkey,
        })
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn shared_completions(&self, index: u32) -> Option<Arc<dyn SharedCompletions>> {
        let hubs = self.hubs.lock().unwrap_or_else(|e| e.into_inner());
        let h: Arc<dyn SharedCompletions> = hubs.get(index as usize)?.upgrade()?;
        Some(h)
    }

    fn memory(&self) -> MemorySupport {
        // GPU memory only where the probe expects DMA-BUF registration to work.
        let gpu = if crate::topology::probe_gpu_memory(&self.ctx).expected() {
            MemoryKinds::CUDA_DEVICE
        } else {
            MemoryKinds::empty()
        };
        MemorySupport {
            allocated: MemoryKinds::HOST,
            allocated_remote: MemoryKinds::HOST,
            caller: MemoryKinds::HOST | gpu,
            caller_remote: MemoryKinds::HOST | gpu,
        }
    }

    fn listen(&self, d: &Domain) -> Result<Box<dyn Listener>> {
        Ok(Box::new(VerbsListener::bind(d)?))
    }

    fn connect(&self, d: &Domain, address: &str) -> Result<Box<dyn Connector>> {
        Ok(Box::new(VerbsConnector::connect(address, d)?))
    }
}

fn remote_access(access: Access) -> ib::RemoteAccess {
    let mut ra = ib::RemoteAccess::empty();
    if access.contains(Access::REMOTE_WRITE) {
        ra |= ib::RemoteAccess::WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        ra |= ib::RemoteAccess::READ;
    }
    if access.contains(Access::REMOTE_ATOMIC) {
        ra |= ib::RemoteAccess::ATOMIC;
    }
    ra
}

fn verbs_domain(d: &Domain) -> Result<&VerbsDomain> {
    d.backend()
        .as_any()
        .downcast_ref::<VerbsDomain>()
        .ok_or_else(|| Error::InvalidArgument("a verbs connection needs a verbs domain".into()))
}

const HELLO_MAGIC: u64 = 0x3153_4252_4556_4246; // "FBVERBS1"
const HELLO_LEN: usize = 16 + ib::Endpoint::ENCODED_LEN;
/// Work requests per queue pair at most (each side), and the smallest shared CQ.
const CQ_DEPTH: u32 = 1024;
/// Entries of one shared CQ (fewer where the device's `max_cqe` is smaller: rxe 32,767):
/// with the default 256 in flight, 256 queue pairs per CQ.
const HUB_CQE: u32 = 1 << 16;
/// Idle polls between two checks of the side-channel socket.
const CHECK_EVERY: u32 = 1024;
/// How long, after the peer hung up, posted sends may still complete (their acknowledgements
/// can reach the CQ after the peer's exit was seen).
const HANGUP_GRACE: std::time::Duration = std::time::Duration::from_millis(50);
/// At most this many work requests in a row go unsignalled in one doorbell.
const SIGNAL_EVERY: usize = 16;

/// The ids of the work requests a connection posts for its tracker's operations. They go
/// through `ibverbs-safe`'s raw layer: the tracker already owns each operation's buffer
/// (and through it the region and its registration) until the completion is taken, so a
/// second, per-request bookkeeping in the safe layer would only cost time. An id holds:
/// bit 0 set (the raw layer's mark), bit 1 the receive queue (a flushed completion's
/// opcode is undefined), bits 2-17 the connection's epoch, bits 18-33 the slot index and
/// bits 34-63 the slot's generation ([`crate::tracker::GEN_BITS`]). The epoch tells a late
/// completion of a destroyed queue pair from one of a new queue pair that got the same
/// number (the safe layer knows its own requests' queue is gone; a raw id carries it).
mod raw_id {
    use std::sync::atomic::{AtomicU16, Ordering};

    use crate::tracker::{Token, GEN_BITS};

    /// Bits of the slot index: the tracker has at most `CQ_DEPTH / 2` slots.
    const IDX_BITS: u32 = 16;
    const _: () = assert!(super::CQ_DEPTH / 2 <= 1 << IDX_BITS);
    const _: () = assert!(34 + GEN_BITS == 64);

    /// The id of `token`'s work request (`recv`: on the receive queue).
    #[inline(always)]
    pub(super) fn encode(token: Token, recv: bool, epoch: u16) -> u64 {
        let idx = token.0 & ((1 << IDX_BITS) - 1);
        let gen = (token.0 >> 32) & ((1 << GEN_BITS) - 1);
        1 | (u64::from(recv) << 1) | (u64::from(epoch) << 2) | (idx << 18) | (gen << 34)
    }

    /// The token a raw id names.
    #[inline(always)]
    pub(super) fn token(wr_id: u64) -> Token {
        Token(((wr_id >> 34) << 32) | ((wr_id >> 18) & ((1 << IDX_BITS) - 1)))
    }

    /// Whether the raw id is a receive's.
    #[inline(always)]
    pub(super) fn recv(wr_id: u64) -> bool {
        wr_id & 2 != 0
    }

    /// The epoch of the connection that posted it.
    #[inline(always)]
    pub(super) fn epoch(wr_id: u64) -> u16 {
        (wr_id >> 2) as u16
    }

    /// A new connection's epoch (wraps after 65,536 connections of the process).
    pub(super) fn next_epoch() -> u16 {
        static NEXT: AtomicU16 = AtomicU16::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        transport: TransportKind::Verbs,
        reason: reason.into(),
    }
}

/// Device, port and GID index to use with default options.
fn probe() -> Result<(String, u8, Option<u8>)> {
    probe_with(&Options::default())
}

/// Device, port and GID index to use: [`Options::verbs_device`] (default
/// `FABRIC_VERBS_DEVICE`) if set, else the first device with an active port;
/// [`Options::verbs_port`] if set, else its first active port; [`Options::verbs_gid_index`]
/// if set, else on Ethernet the first RoCE v2 IPv4-mapped GID (else the first non-zero one).
fn probe_with(opts: &Options) -> Result<(String, u8, Option<u8>)> {
    let devs = ib::devices().map_err(|e| unavailable(e.to_string()))?;
    let want = opts.verbs_device.clone();
    for d in devs {
        if want.as_deref().is_some_and(|w| w != d.name) {
            continue;
        }
        let Ok(ctx) = ib::open(Some(&d.name)) else {
            continue;
        };
        let Ok(attr) = ctx.query_device() else {
            continue;
        };
        for port in 1..=attr.phys_port_cnt {
            if opts.verbs_port.is_some_and(|w| w != port) {
                continue;
            }
            let Ok(p) = ctx.query_port(port) else {
                continue;
            };
            if !p.is_active() {
                continue;
            }
            if let Some(g) = opts.verbs_gid_index {
                let gids = ctx.gid_table(port).unwrap_or_default();
                if !gids
                    .iter()
                    .any(|e| e.index == u32::from(g) && !e.gid.is_zero())
                {
                    return Err(Error::InvalidArgument(format!(
                        "GID index {g} is not a populated entry of {}'s port {port} ({} populated)",
                        d.name,
                        gids.iter().filter(|e| !e.gid.is_zero()).count()
                    )));
                }
                return Ok((d.name, port, Some(g)));
            }
            if p.link_layer != ib::LinkLayer::Ethernet {
                return Ok((d.name, port, None));
            }
            let gids = ctx.gid_table(port).unwrap_or_default();
            let pick = gids
                .iter()
                .filter(|g| !g.gid.is_zero())
                .find(|g| {
                    g.gid_type == Some(ib::GidType::RoceV2)
                        && g.gid.to_ipv6().to_ipv4_mapped().is_some()
                })
                .or_else(|| gids.iter().find(|g| !g.gid.is_zero()));
            if let Some(g) = pick {
                return Ok((d.name, port, Some(g.index as u8)));
            }
        }
    }
    Err(unavailable(match (want, opts.verbs_port) {
        (Some(w), Some(p)) => format!("RDMA device {w} has no active port {p}"),
        (None, Some(p)) => format!("no RDMA device with an active port {p}"),
        (Some(w), None) => format!("RDMA device {w} (Options::verbs_device / FABRIC_VERBS_DEVICE) absent or without an active port"),
        (None, None) => "no RDMA device with an active port (load rdma_rxe / attach a NIC; rdma-core installed?)".into(),
    }))
}

/// The bytes of a [`Region`] as its verbs registration sees them. The region owns the
/// memory and drops the registration (its `backing`) before it (field order of
/// `RegionInner`), so the pointer outlives the MR.
struct RawMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory belongs to a `Send + Sync` region; this is only its address.
unsafe impl Send for RawMem {}
// SAFETY: as above.
unsafe impl Sync for RawMem {}

// SAFETY: `ptr` is fixed and valid for `len` readable, writable bytes for as long as the
// registration exists: the region that owns the memory releases the registration first.
unsafe impl ib::RegionBuffer for RawMem {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

type Mr = ib::MemoryRegion<RawMem, ib::Remote>;

/// A region's verbs registration and a handle over all of it (sub-handles are cut from it
/// per post without touching the registration).
struct Backing {
    /// The host MR or the DMA-BUF device MR.
    _mr: Box<dyn std::any::Any + Send + Sync>,
    full: ib::MrSlice,
}

/// A work completion as it is handed to its connection (its buffers already released).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Wc {
    wr_id: u64,
    status: ib::WcStatus,
    byte_len: u32,
    imm: Option<u32>,
    /// From the receive queue (the queue pair's own or the shared one).
    recv: bool,
    /// From the domain's shared receive queue (`wr_id` is the buffer's index there).
    srq: bool,
    /// Posted through the raw layer: `wr_id` is a [`raw_id`] (a tracker token).
    raw: bool,
}

/// Who sleeps until a connection's mailbox gets a completion.
#[derive(Debug, Default)]
enum Watch {
    /// Nobody (the connection is being polled).
    #[default]
    None,
    /// The worker (by id) that holds the connection (woken through the queue's eventfd).
    Worker(u64),
    /// The connection alone, through its own eventfd.
    Lone(Arc<OwnedFd>),
}

/// Whom a routed completion wakes.
#[derive(Debug)]
enum Wake {
    Hub,
    Lone(Arc<OwnedFd>),
}

#[derive(Debug, Default)]
struct Mailbox {
    /// The epoch of the connection whose queue pair has this number now ([`raw_id`]).
    epoch: u16,
    q: VecDeque<Wc>,
    watch: Watch,
    /// The connection failed and is not progressed any more: its completions are not
    /// queued (their shared receive buffers go straight back to the SRQ).
    discard: bool,
}

/// The I/O-free core of a shared CQ: one mailbox per queue pair (by `qp_num`) for the
/// completions another connection polled, who sleeps on it, and which worker-held
/// connections got work while armed.
#[derive(Debug, Default)]
struct Demux {
    boxes: HashMap<u32, Mailbox>,
    /// Queue pairs watched by a worker (its id first) that got a completion.
    woken: Vec<(u64, u32)>,
    /// Mailboxes whose watch is not `None` (the CQ must stay armed while some are).
    watchers: usize,
}

impl Demux {
    /// Opens `qp`'s mailbox for the connection of `epoch`; hands back what a stale one of
    /// the same number held.
    fn open(&mut self, qp: u32, epoch: u16) -> VecDeque<Wc> {
        let left = self.close(qp);
        self.boxes.insert(
            qp,
            Mailbox {
                epoch,
                ..Mailbox::default()
            },
        );
        left
    }

    /// Forgets `qp`'s mailbox and hands back the completions still in it.
    fn close(&mut self, qp: u32) -> VecDeque<Wc> {
        let mut left = VecDeque::new();
        if let Some(b) = self.boxes.remove(&qp) {
            if !matches!(b.watch, Watch::None) {
                self.watchers -= 1;
            }
            left = b.q;
        }
        self.woken.retain(|&(_, k)| k != qp);
        left
    }

    /// Whether completions of `qp` are queued for it (its mailbox is open and not
    /// discarding).
    fn is_open(&self, qp: u32) -> bool {
        self.boxes.get(&qp).is_some_and(|b| !b.discard)
    }

    /// From now on `qp`'s completions are not queued; hands back those queued.
    fn discard(&mut self, qp: u32) -> VecDeque<Wc> {
        self.unwatch(qp);
        self.woken.retain(|&(_, k)| k != qp);
        match self.boxes.get_mut(&qp) {
            Some(b) => {
                b.discard = true;
                std::mem::take(&mut b.q)
            }
            None => VecDeque::new(),
        }
    }

    /// Wakes `qp`'s sleeper now, as a completion would (it has mail already); says whom
    /// to signal.
    fn wake_now(&mut self, qp: u32, w: Watch) -> Option<Wake> {
        self.boxes.get(&qp)?;
        match w {
            Watch::None => None,
            Watch::Worker(w) => {
                let first = self.woken.is_empty();
                if !self.woken.contains(&(w, qp)) {
                    self.woken.push((w, qp));
                }
                first.then_some(Wake::Hub)
            }
            Watch::Lone(fd) => Some(Wake::Lone(fd)),
        }
    }

    /// Queues a completion of `qp` (dropped when no connection has that queue pair: a
    /// closed one's, or a raw one of an earlier queue pair of the same number) and says
    /// whom to wake.
    fn route(&mut self, qp: u32, wc: Wc) -> Option<Wake> {
        let b = self.boxes.get_mut(&qp)?;
        if wc.raw && raw_id::epoch(wc.wr_id) != b.epoch {
            return None;
        }
        b.q.push_back(wc);
        match std::mem::take(&mut b.watch) {
            Watch::None => None,
            Watch::Worker(w) => {
                self.watchers -= 1;
                let first = self.woken.is_empty();
                self.woken.push((w, qp));
                first.then_some(Wake::Hub)
            }
            Watch::Lone(fd) => {
                self.watchers -= 1;
                Some(Wake::Lone(fd))
            }
        }
    }

    fn take(&mut self, qp: u32) -> Option<Wc> {
        self.boxes.get_mut(&qp)?.q.pop_front()
    }

    fn has_mail(&self, qp: u32) -> bool {
        self.boxes.get(&qp).is_some_and(|b| !b.q.is_empty())
    }

    /// Sleeps `qp` on its mailbox; `false` (and no watch) when mail waits already.
    fn watch(&mut self, qp: u32, w: Watch) -> bool {
        let Some(b) = self.boxes.get_mut(&qp) else {
            return false;
        };
        if !b.q.is_empty() {
            return false;
        }
        if matches!(b.watch, Watch::None) {
            self.watchers += 1;
        }
        b.watch = w;
        true
    }

    fn unwatch(&mut self, qp: u32) {
        if let Some(b) = self.boxes.get_mut(&qp) {
            if !matches!(std::mem::take(&mut b.watch), Watch::None) {
                self.watchers -= 1;
            }
        }
    }
}

/// One completion queue (and channel) that many connections of a domain share: the
/// worker's one wake-up source on verbs. See [`SharedCompletions`].
struct Hub {
    index: u32,
    channel: ib::CompletionChannel,
    /// Signalled when a worker-watched connection got a completion that another
    /// connection polled (no CQ event announces that one).
    event: OwnedFd,
    capacity: u32,
    /// The domain's shared receive queue (eager mode with `verbs_srq_buffers`): every
    /// queue pair of this hub takes its receives from it.
    pool: Option<Arc<SrqPool>>,
    st: Mutex<HubState>,
}

struct HubState {
    cq: ib::CompletionQueue,
    wcs: Vec<ib::Completion>,
    demux: Demux,
    /// A `req_notify` is outstanding (its event not consumed yet).
    notify: bool,
    /// CQ entries the live queue pairs may fill (each reserves its depth).
    reserved: u32,
    /// Reservations of closed queue pairs, returned once the CQ was seen empty (their
    /// flushed completions are gone by then).
    closing: u32,
    /// The hub's `pool` again, for the buffers of closed connections' completions.
    pool: Option<Arc<SrqPool>>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("index", &self.index)
            .field("capacity", &self.capacity)
            .finish()
    }
}

fn signal(w: Wake, hub_event: BorrowedFd<'_>) {
    match w {
        Wake::Hub => sys::eventfd_signal(hub_event),
        Wake::Lone(fd) => sys::eventfd_signal(fd.as_fd()),
    }
}

/// Hands the shared receive buffer of `wc` (if it names one) back to `pool`.
fn give_back(pool: Option<&SrqPool>, wc: Wc) {
    if let (true, Some(p)) = (wc.srq, pool) {
        p.give_back(wc.wr_id as usize);
    }
}

impl HubState {
    /// Polls the CQ dry: completions of `mine` go to `own`, the others to their mailboxes.
    fn pump(
        &mut self,
        hub_event: BorrowedFd<'_>,
        mine: Option<(u32, u16)>,
        own: &mut impl FnMut(Wc),
    ) -> Result<usize> {
        let mut total = 0;
        loop {
            let n = self
                .cq
                .poll(&mut self.wcs)
                .map_err(|e| Error::Protocol(format!("poll_cq: {e}")))?;
            for c in &mut self.wcs[..n] {
                let queue = c.queue();
                let wr_id = c.wr_id();
                // Raw: what the tracker posted (odd ids; the safe layer's completions of a
                // destroyed queue pair come with none, id 0).
                let raw = queue.is_none() && wr_id & 1 == 1;
                if queue.is_none() && !raw {
                    continue; // a late flush of a destroyed queue pair
                }
                let wc = Wc {
                    wr_id,
                    status: c.status(),
                    byte_len: c.byte_len(),
                    imm: c.imm(),
                    recv: if raw {
                        raw_id::recv(wr_id)
                    } else {
                        matches!(queue, Some(ib::QueueKind::Recv | ib::QueueKind::Srq))
                    },
                    srq: queue == Some(ib::QueueKind::Srq),
                    raw,
                };
                let qp = c.qp_num();
                if !raw {
                    drop(c.take_bufs());
                }
                if let Some((_, epoch)) = mine.filter(|&(me, _)| me == qp) {
                    // (A raw one of an earlier queue pair of this number is dropped.)
                    if !raw || raw_id::epoch(wr_id) == epoch {
                        own(wc);
                        total += 1;
                    }
                } else if !self.demux.is_open(qp) {
                    // A closed connection's: a shared buffer goes back to the SRQ.
                    give_back(self.pool.as_deref(), wc);
                } else if let Some(w) = self.demux.route(qp, wc) {
                    signal(w, hub_event);
                }
            }
            if n < self.wcs.len() {
                self.reserved -= std::mem::take(&mut self.closing);
                return Ok(total);
            }
        }
    }

    /// Opens `qp`'s mailbox (see [`Demux::open`]).
    fn open(&mut self, qp: u32, epoch: u16) {
        for wc in self.demux.open(qp, epoch) {
            give_back(self.pool.as_deref(), wc);
        }
    }

    /// Stops queueing `qp`'s completions (a failed connection's); shared receive buffers
    /// of those queued and of those to come go back.
    fn discard(&mut self, qp: u32) {
        for wc in self.demux.discard(qp) {
            give_back(self.pool.as_deref(), wc);
        }
    }

    /// Closes `qp`'s mailbox; shared receive buffers of completions left in it go back.
    fn close(&mut self, qp: u32) {
        for wc in self.demux.close(qp) {
            give_back(self.pool.as_deref(), wc);
        }
    }

    fn req_notify(&mut self) -> Result<()> {
        if !self.notify {
            self.cq
                .req_notify(false)
                .map_err(|e| Error::Protocol(format!("req_notify_cq: {e}")))?;
            self.notify = true;
        }
        Ok(())
    }
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a wake-up: consumes the channel's events, routes what the CQ holds, and keeps
    /// the CQ armed while some connection sleeps on it.
    fn settle(&self, st: &mut HubState) -> Result<()> {
        while self.channel.get_event().is_ok() {
            st.notify = false;
        }
        st.pump(self.event.as_fd(), None, &mut |_| {})?;
        if st.demux.watchers > 0 && !st.notify {
            st.req_notify()?;
            // What landed before the arm raised no event.
            st.pump(self.event.as_fd(), None, &mut |_| {})?;
        }
        Ok(())
    }
}

impl SharedCompletions for Hub {
    fn wake_fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.channel.as_fd(), self.event.as_fd()]
    }

    fn drive(&self, worker: u64, woken: &mut Vec<u64>) -> Result<()> {
        let mut st = self.lock();
        sys::eventfd_drain(self.event.as_fd());
        self.settle(&mut st)?;
        let base = u64::from(self.index) << 32;
        st.demux.woken.retain(|&(w, q)| {
            if w == worker {
                woken.push(base | u64::from(q));
            }
            w != worker
        });
        if !st.demux.woken.is_empty() {
            // Another worker's: it watches the same eventfd.
            sys::eventfd_signal(self.event.as_fd());
        }
        Ok(())
    }
}

/// A queue pair's place in a [`Hub`]: its CQ entries and its mailbox, given back on drop
/// (after the queue pair, which is declared before it wherever both are held).
struct Seat {
    hub: Arc<Hub>,
    depth: u32,
    qp_num: Option<u32>,
    /// Its connection's epoch ([`raw_id`]), set with `qp_num`.
    epoch: u16,
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut st = self.hub.lock();
        if let Some(q) = self.qp_num {
            st.close(q);
        }
        st.closing += self.depth;
    }
}

impl VerbsDomain {
    /// A shared CQ with room for a queue pair of `depth` work requests (the first with room,
    /// else a new one). A new CQ also reserves room for every buffer of the shared receive
    /// queue `pool` (its receives may all complete there).
    fn seat(&self, depth: u32, pool: Option<&Arc<SrqPool>>) -> Result<Seat> {
        let mut hubs = self.hubs.lock().unwrap_or_else(|e| e.into_inner());
        for h in hubs.iter().filter_map(Weak::upgrade) {
            let mut st = h.lock();
            if h.capacity - st.reserved >= depth {
                st.reserved += depth;
                drop(st);
                return Ok(Seat {
                    hub: h,
                    depth,
                    qp_num: None,
                    epoch: 0,
                });
            }
        }
        let e = |e: ib::Error| unavailable(e.to_string());
        let channel = self.ctx.create_comp_channel().map_err(e)?;
        channel.set_nonblocking(true).map_err(e)?;
        let base = pool.map_or(0, |p| p.count as u32);
        let want = HUB_CQE.min(self.max_cqe).max(depth + base);
        let cq = self.ctx.create_cq_with_channel(want, &channel).map_err(e)?;
        let capacity = cq.capacity().max(want);
        let index = match hubs.iter().position(|w| w.strong_count() == 0) {
            Some(i) => i,
            None => {
                hubs.push(Weak::new());
                hubs.len() - 1
            }
        };
        let hub = Arc::new(Hub {
            index: index as u32,
            channel,
            event: sys::eventfd()?,
            capacity,
            pool: pool.cloned(),
            st: Mutex::new(HubState {
                cq,
                wcs: ib::Completion::buffer(64),
                demux: Demux::default(),
                notify: false,
                reserved: base + depth,
                closing: 0,
                pool: pool.cloned(),
            }),
        });
        hubs[index] = Arc::downgrade(&hub);
        Ok(Seat {
            hub,
            depth,
            qp_num: None,
            epoch: 0,
        })
    }
}

/// How long a flush waits for its loopback read.
const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A queue pair connected to itself, with its own CQ and an 8-byte host landing area: a
/// flush is an RDMA READ through it of one byte of the flushed memory, after which the
/// NIC's earlier writes there are visible (the PCIe read orders them; NCCL flushes
/// GPUDirect receives the same way).
struct Loopback {
    qp: ib::QueuePair<ib::Rc>,
    cq: ib::CompletionQueue,
    wcs: Vec<ib::Completion>,
    scratch: ib::MemoryRegion<Vec<u8>, ib::Local>,
}

impl VerbsDomain {
    fn make_loopback(&self) -> Result<Loopback> {
        let e = |e: ib::Error| unavailable(format!("flush queue pair: {e}"));
        let cq = self.ctx.create_cq(4).map_err(e)?;
        let mut b = self
            .pd
            .queue_pair(&cq, &cq)
            .port(self.port)
            .max_send_wr(1)
            .max_recv_wr(1);
        if let Some(g) = self.gid {
            b = b.gid_index(g);
        }
        let prepared = b.build_rc().map_err(e)?;
        let me = prepared.endpoint();
        let qp = prepared.connect(&me).map_err(e)?;
        let scratch = self.pd.register(vec![0u8; 8]).map_err(e)?;
        Ok(Loopback {
            qp,
            cq,
            wcs: ib::Completion::buffer(4),
            scratch,
        })
    }

    /// Reads one byte at `addr` (`rkey`) through the loopback queue pair and waits for it.
    fn flush_read(&self, addr: u64, rkey: u32) -> Result<()> {
        let mut g = self.loopback.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(self.make_loopback()?);
        }
        let lb = g.as_mut().expect("made above");
        let fail = |what: String| Error::Protocol(format!("verbs flush: {what}"));
        let s = lb.scratch.slice(..1).map_err(|e| fail(e.to_string()))?;
        let req = ib::SendRequest::read(s, ib::RemoteMemory { addr, len: 1, rkey }).wr_id(1);
        if let Err(e) = lb.qp.post_send(req) {
            *g = None;
            return Err(fail(e.error.to_string()));
        }
        let end = Instant::now() + FLUSH_TIMEOUT;
        loop {
            let n = lb.cq.poll(&mut lb.wcs).map_err(|e| fail(e.to_string()))?;
            if n > 0 {
                let st = lb.wcs[0].status();
                drop(lb.wcs[0].take_bufs());
                if st != ib::WcStatus::Success {
                    // The queue pair is in the error state now: make a new one next time.
                    *g = None;
                    return Err(fail(format!("the loopback read failed: {st}")));
                }
                return Ok(());
            }
            if Instant::now() > end {
                *g = None;
                return Err(Error::Timeout("verbs flush (loopback read)"));
            }
            std::hint::spin_loop();
        }
    }
}

/// A queue pair built but not connected yet.
struct Prepared {
    qp: ib::PreparedQp<ib::Rc>,
    seat: Seat,
    pd: ib::ProtectionDomain,
    /// Work requests the tracker may have in flight.
    depth: u32,
    /// Bytes of each eager receive buffer (0: receives go straight to the caller's).
    eager: usize,
}

/// Eager receive buffers per connection (eager mode).
const EAGER_SLOTS: u32 = 32;
/// The tag header in front of every eager message.
const TAG_HEADER: usize = 8;

fn eager_bytes(opts: &Options) -> Result<usize> {
    match opts.verbs_eager_bytes {
        0 => Ok(0),
        n if n <= TAG_HEADER || n > 1 << 30 => Err(Error::InvalidArgument(format!(
            "Options::verbs_eager_bytes {n}: 0 (off) or {} to 2^30",
            TAG_HEADER + 1
        ))),
        n => Ok(n),
    }
}

/// [`Options::verbs_srq_buffers`], checked against the eager mode and the device (its
/// largest CQ and SRQ).
fn srq_buffers(opts: &Options, max_cqe: u32, max_srq_wr: u32) -> Result<u32> {
    let n = opts.verbs_srq_buffers;
    if n == 0 {
        return Ok(0);
    }
    if opts.verbs_eager_bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "Options::verbs_srq_buffers {n} needs the eager mode (Options::verbs_eager_bytes): \
             without it receives land straight in the caller's buffers, which a shared \
             receive queue cannot keep apart per connection"
        )));
    }
    if n > SRQ_MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "Options::verbs_srq_buffers {n}: 0 (off) or 1 to {SRQ_MAX}"
        )));
    }
    if max_srq_wr == 0 {
        return Err(Error::Unsupported {
            transport: TransportKind::Verbs,
            what: "shared receive queues on this device (Options::verbs_srq_buffers)",
        });
    }
    let most = (max_cqe / 2).min(max_srq_wr).min(SRQ_MAX);
    if n > most as usize {
        return Err(Error::InvalidArgument(format!(
            "Options::verbs_srq_buffers {n}: 0 (off) or 1 to {most} on this device (half its \
             largest CQ of {max_cqe} entries, and at most its largest SRQ, {max_srq_wr})"
        )));
    }
    Ok(n as u32)
}

/// Most buffers of a shared receive queue.
const SRQ_MAX: u32 = 1 << 16;

impl VerbsDomain {
    /// The domain's shared receive queue of `eager`-byte buffers (made on first need);
    /// `None` without [`Options::verbs_srq_buffers`] or the eager mode.
    fn srq_pool(&self, eager: usize) -> Result<Option<Arc<SrqPool>>> {
        if self.srq_buffers == 0 || eager == 0 {
            return Ok(None);
        }
        let mut g = self.srq.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(SrqPool::new(&self.pd, self.srq_buffers, eager)?);
        }
        Ok(g.clone())
    }
}

fn prepare(domain: &Domain) -> Result<Prepared> {
    let opts = domain.options();
    let vd = verbs_domain(domain)?;
    let (port, gid) = (vd.port, vd.gid);
    let e = |e: ib::Error| unavailable(e.to_string());
    let pd = vd.pd.clone();
    let depth = (opts.max_in_flight as u32).clamp(1, CQ_DEPTH / 2);
    let eager = eager_bytes(opts)?;
    let pool = vd.srq_pool(eager)?;
    // Eager mode: the receive queue holds the bounce buffers, not the caller's receives
    // (with a shared receive queue the queue pair has none; the hub reserved its entries).
    let recv_wr = if eager > 0 { EAGER_SLOTS } else { depth };
    let own_rq = if eager > 0 && pool.is_none() {
        EAGER_SLOTS
    } else {
        0
    };
    let mut seat = vd.seat(depth + own_rq, pool.as_ref())?;
    let qp = {
        let st = seat.hub.lock();
        let srq = seat.hub.pool.as_ref().map(|p| p.lock());
        let mut b = pd
            .queue_pair(&st.cq, &st.cq)
            .port(port)
            .max_send_wr(depth)
            .max_recv_wr(recv_wr)
            .max_sge(2, 1)
            .access(ib::RemoteAccess::WRITE | ib::RemoteAccess::READ | ib::RemoteAccess::ATOMIC);
        if let Some(g) = gid {
            b = b.gid_index(g);
        }
        if let Some(srq) = &srq {
            b = b.srq(&srq.srq);
        }
        b.build_rc().map_err(e)?
    };
    let q = qp.qp_num();
    let epoch = raw_id::next_epoch();
    seat.hub.lock().open(q, epoch);
    seat.qp_num = Some(q);
    seat.epoch = epoch;
    Ok(Prepared {
        qp,
        seat,
        pd,
        depth,
        eager,
    })
}

/// The hello: magic, this side's eager buffer bytes (0: off), the queue pair's endpoint.
fn hello(ep: &ib::Endpoint, eager: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&(eager as u64).to_le_bytes());
    b[16..].copy_from_slice(&ep.to_bytes());
    b
}

/// The peer's eager buffer bytes from its (already decoded) hello.
fn hello_eager(b: &[u8]) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[8..16]);
    u64::from_le_bytes(v)
}

/// Decodes the side-channel hello into the peer's queue-pair endpoint.
///
/// # Errors
/// [`Error::Protocol`] for a wrong magic or an endpoint that does not decode.
pub fn decode_hello(b: &[u8]) -> Result<ib::Endpoint> {
    if b.len() != HELLO_LEN || b[..8] != HELLO_MAGIC.to_le_bytes() {
        return Err(Error::Protocol(
            "not a fabric verbs peer (bad hello)".into(),
        ));
    }
    ib::Endpoint::from_bytes(&b[16..]).map_err(|e| Error::Protocol(format!("verbs endpoint: {e}")))
}

/// Non-blocking exchange of hellos on the side channel: `Ok(Some(peer))` when done.
fn exchange(
    s: &TcpStream,
    mine: &[u8; HELLO_LEN],
    sent: &mut bool,
    got: &mut Vec<u8>,
) -> Result<Option<ib::Endpoint>> {
    use std::io::{Read, Write};
    if !*sent {
        match (&*s).write(mine) {
            Ok(n) if n == HELLO_LEN => *sent = true,
            Ok(_) => return Err(Error::Protocol("short verbs hello write".into())),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(Error::io("verbs hello write", e)),
        }
    }
    let mut buf = [0u8; HELLO_LEN];
    while got.len() < HELLO_LEN {
        match (&*s).read(&mut buf[..HELLO_LEN - got.len()]) {
            Ok(0) => {
                return Err(Error::Disconnected(
                    "peer closed during the verbs hello".into(),
                ))
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(Error::io("verbs hello read", e)),
        }
    }
    decode_hello(got).map(Some)
}

/// The handshake of either side: the queue pair is prepared at the start, hellos cross the
/// TCP side channel, then the queue pair is connected to the peer's.
struct Pending {
    s: TcpStream,
    prepared: Prepared,
    mine: [u8; HELLO_LEN],
    sent: bool,
    got: Vec<u8>,
    peer: Option<ib::Endpoint>,
}

impl Handshake<TcpStream> for Pending {
    type Ctx = Domain;
    type Output = Box<dyn Transport>;
    fn start(s: TcpStream, domain: &Domain) -> Result<Self> {
        s.set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        let _ = s.set_nodelay(true);
        let prepared = prepare(domain)?;
        let mine = hello(&prepared.qp.endpoint(), prepared.eager);
        Ok(Pending {
            s,
            prepared,
            mine,
            sent: false,
            got: Vec::new(),
            peer: None,
        })
    }

    fn step(&mut self, _: &Domain) -> Result<bool> {
        self.peer = exchange(&self.s, &self.mine, &mut self.sent, &mut self.got)?;
        Ok(self.peer.is_some())
    }

    fn establish(self, domain: &Domain) -> Result<Box<dyn Transport>> {
        let peer = self
            .peer
            .ok_or_else(|| Error::Protocol("verbs hello not finished".into()))?;
        let p = self.prepared;
        let theirs = hello_eager(&self.got);
        if theirs != p.eager as u64 {
            return Err(Error::Protocol(format!(
                "the verbs peers disagree on Options::verbs_eager_bytes (here {}, there \
                 {theirs}): both must set the same value",
                p.eager
            )));
        }
        let Prepared {
            qp,
            seat,
            pd,
            depth,
            eager,
        } = p;
        let qp = qp
            .connect(&peer)
            .map_err(|e| Error::Protocol(format!("connecting the queue pair: {e}")))?;
        let setup = Setup {
            seat,
            pd,
            depth,
            eager,
        };
        finish(qp, setup, self.s, domain)
    }
}

/// Listens on a TCP side channel (binds `Options::tcp_bind`).
pub struct VerbsListener {
    queue: AcceptQueue<TcpListener, Pending>,
    address: String,
    domain: Domain,
}

impl std::fmt::Debug for VerbsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsListener")
            .field("address", &self.address)
            .finish()
    }
}

impl VerbsListener {
    /// Binds (after checking a usable RDMA port exists).
    ///
    /// # Errors
    /// [`Error::Unavailable`] without an active RDMA port; [`Error::Io`] for the socket.
    pub fn bind(domain: &Domain) -> Result<Self> {
        let opts = domain.options();
        let (sock, a) = accept::bind_tcp(&opts.tcp_bind)?;
        Ok(VerbsListener {
            queue: AcceptQueue::new(sock, opts.handshake_timeout),
            address: format!("verbs:{a}"),
            domain: domain.clone(),
        })
    }
}

impl Listener for VerbsListener {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }
    fn address(&self) -> &str {
        &self.address
    }
    fn accept(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.queue.accept(&self.domain)
    }
}

/// Connects to a [`VerbsListener`] (`HOST:PORT` of its side channel).
pub struct VerbsConnector {
    conn: Connecting<TcpStream, Pending>,
    domain: Domain,
}

impl std::fmt::Debug for VerbsConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConnector")
            .field("conn", &self.conn)
            .finish()
    }
}

impl VerbsConnector {
    /// Starts connecting the side channel.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without an active RDMA port; address and socket errors.
    pub fn connect(address: &str, domain: &Domain) -> Result<Self> {
        let s = accept::dial_tcp(address, "verbs", |_, _| Ok(()))?;
        let timeout = domain.options().handshake_timeout;
        Ok(VerbsConnector {
            conn: Connecting::dial(s, timeout, ["verbs connect", "verbs handshake"]),
            domain: domain.clone(),
        })
    }
}

impl Connector for VerbsConnector {
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.conn.poll(&self.domain)
    }
}

/// What a connected queue pair needs from its preparation.
struct Setup {
    seat: Seat,
    pd: ib::ProtectionDomain,
    depth: u32,
    eager: usize,
}

fn finish(
    mut qp: ib::QueuePair<ib::Rc>,
    p: Setup,
    sock: TcpStream,
    domain: &Domain,
) -> Result<Box<dyn Transport>> {
    let opts = domain.options();
    let conn = next_conn_id();
    let eager = p.eager > 0;
    let max_message = opts.max_message.min(1 << 30);
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: true,
        atomics: true,
        max_message,
        // Every work request is a tracker slot, so the queue pair never has more
        // completions pending than its seat in the shared CQ reserved.
        max_in_flight: opts.max_in_flight.clamp(1, p.depth as usize),
        inline_size: qp.max_inline_data() as usize,
        memory_kinds: MemoryKinds::HOST,
        // Tags and grouped receives need the eager mode (matching after the bytes landed
        // in a bounce buffer); without it they are refused (Unsupported), not faked.
        tagged: eager,
        max_group: if eager { super::MAX_GROUP } else { 0 },
        write_imm: true,
        unexpected_messages: if eager { opts.unexpected_messages } else { 0 },
        unexpected_bytes: if eager { opts.unexpected_bytes } else { 0 },
        // RC: a local length error moves the QP to ERR; in eager mode the bounce buffer
        // always fits (the sender's max_message), and only the receive fails.
        too_long_kills_connection: !eager,
        remote_error_kills_connection: true,
        remote_window: false,
    };
    let eager = if eager {
        let rx = match &p.seat.hub.pool {
            Some(pool) => Bounce::Shared(pool.clone()),
            None => {
                Bounce::Own(domain.register(EAGER_SLOTS as usize * p.eager, Access::LOCAL_WRITE)?)
            }
        };
        let e = Eager {
            rx,
            size: p.eager,
            hdr: domain.register(caps.max_in_flight * TAG_HEADER, Access::empty())?,
            held: VecDeque::new(),
        };
        if matches!(e.rx, Bounce::Own(_)) {
            for i in 0..EAGER_SLOTS as usize {
                post_bounce(&mut qp, &e, i)?;
            }
        }
        Some(e)
    } else {
        None
    };
    let qp_num = qp.qp_num();
    let hal = VerbsHal {
        conn,
        qp,
        qp_num,
        eager,
        sq: VecDeque::with_capacity(p.depth as usize),
        sq_depth: p.depth as usize,
        db: Doorbell::new(),
        seat: p.seat,
        sock,
        lone: OnceLock::new(),
        attached: None,
        idle: 0,
        armed: false,
        discarded: false,
        _pd: p.pd,
        domain: domain.clone(),
    };
    Ok(Box::new(Endpoint::in_domain(
        domain.clone(),
        Tracker::new(domain.id(), TransportKind::Verbs, caps),
        hal,
    )))
}

/// Eager mode: the receive queue holds [`EAGER_SLOTS`] bounce buffers (or, with
/// [`Options::verbs_srq_buffers`], the domain's shared receive queue holds them for every
/// queue pair: [`SrqPool`]); each message lands in one (an 8-byte tag, then the payload),
/// is matched by the tracker and copied into its receive (or into the unexpected queue),
/// and the buffer is posted again. A message that cannot be placed yet keeps its buffer
/// (`held`, in arrival order) until it can: with every buffer held the sender waits
/// (receiver not ready), as a tcp frame waits on the wire. Own buffers: a message waits
/// while no receive is posted or the unexpected queue is full. Shared buffers: only while
/// the unexpected queue is full (see [`SrqPool`] for the bound).
#[derive(Debug)]
struct Eager {
    rx: Bounce,
    size: usize,
    /// One tag header per tracker slot (a send's slot index picks it).
    hdr: Region,
    held: VecDeque<(usize, Wc)>,
}

/// Where eager messages land.
#[derive(Debug)]
enum Bounce {
    /// [`EAGER_SLOTS`] buffers of this connection, posted to its own receive queue.
    Own(Region),
    /// The domain's shared receive queue.
    Shared(Arc<SrqPool>),
}

impl Eager {
    fn pool(&self) -> Option<&SrqPool> {
        match &self.rx {
            Bounce::Shared(p) => Some(p),
            Bounce::Own(_) => None,
        }
    }

    /// The first `len` (at most `size`) bytes of bounce buffer `i`.
    ///
    /// Buffer `i` must have completed and not be posted again while the borrow lives (the
    /// connection holding its completion is the only one that reposts it).
    fn landed(&self, i: usize, len: usize) -> &[u8] {
        let len = len.min(self.size);
        match &self.rx {
            // SAFETY: buffer `i` lies inside the region (`i < EAGER_SLOTS`, `len <= size`),
            // has completed and is not posted again before this borrow ends, so the NIC
            // does not write it; `rx` keeps the memory alive; nothing else writes it.
            Bounce::Own(r) => unsafe {
                std::slice::from_raw_parts(r.base().add(i * self.size), len)
            },
            Bounce::Shared(p) => p.landed(i, len),
        }
    }

    /// Posts bounce buffer `i` again (to the queue pair or the shared receive queue).
    fn repost(&self, qp: &mut ib::QueuePair<ib::Rc>, i: usize) -> Result<()> {
        match &self.rx {
            Bounce::Own(_) => post_bounce(qp, self, i),
            Bounce::Shared(p) => p.post(i),
        }
    }

    /// Shared buffers: gives back every held one (the connection failed: its messages are
    /// never placed).
    fn release_held(&mut self) {
        if let Bounce::Shared(p) = &self.rx {
            for (i, _) in self.held.drain(..) {
                p.held.fetch_sub(1, Ordering::Relaxed);
                p.give_back(i);
            }
        }
    }
}

impl Drop for Eager {
    fn drop(&mut self) {
        // Own buffers die with their queue pair; shared ones go back to the SRQ.
        self.release_held();
    }
}

/// Eager mode with [`Options::verbs_srq_buffers`]: the domain's one shared receive queue
/// and its bounce buffers (`count` of `size` bytes, one registration), from which every
/// queue pair of the domain takes its receives. Completions come through the hubs' CQs and
/// are routed by `qp_num` like any other; the connection copies the message out and
/// reposts the buffer here (one lock of `srq` per message, uncontended unless connections
/// of the domain are progressed from several threads). A buffer whose connection is gone
/// (its mailbox closed, or it held it) comes back here too.
///
/// Holding: a connection keeps a buffer only while its unexpected queue is full, at most
/// `max(1, count / 8)` of them, and all connections together at most `max(1, count / 2)`;
/// a connection that would need one more fails (`ProtocolError`, its queue pair to the
/// error state, its buffers back here). So at least half the buffers stay for the others,
/// and a momentarily empty SRQ only makes senders retry (receiver not ready; the queue
/// pairs retry without limit, `rnr_retry` 7).
///
/// Drop order: every queue pair built on the SRQ holds it (`ibverbs-safe` keeps the SRQ
/// until the last one is destroyed, and the posted buffers' registration until the SRQ
/// is); the pool itself lives while the domain, a hub or a connection holds it, so the
/// bytes a connection reads stay mapped.
struct SrqPool {
    /// The queue and the registration the buffers are cut from (`slice` needs `&mut`).
    srq: Mutex<SrqParts>,
    /// Address of buffer 0.
    base: usize,
    size: usize,
    count: usize,
    /// Buffers connections hold now.
    held: AtomicUsize,
    /// Buffers that could not be posted again (lost to the pool).
    lost: AtomicUsize,
}

struct SrqParts {
    srq: ib::SharedReceiveQueue,
    mr: ib::MemoryRegion<ib::AlignedBuffer, ib::Local>,
}

impl std::fmt::Debug for SrqPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrqPool")
            .field("count", &self.count)
            .field("size", &self.size)
            .field("held", &self.held)
            .finish()
    }
}

impl SrqPool {
    fn new(pd: &ib::ProtectionDomain, count: u32, size: usize) -> Result<Arc<SrqPool>> {
        let e = |e: ib::Error| unavailable(format!("shared receive queue: {e}"));
        let bytes = (count as usize).checked_mul(size).ok_or_else(|| {
            Error::InvalidArgument("verbs_srq_buffers × verbs_eager_bytes overflows".into())
        })?;
        let srq = pd.create_srq(count, 1).map_err(e)?;
        let mr = pd.alloc_region(bytes).map_err(e)?;
        let pool = SrqPool {
            base: mr.addr() as usize,
            srq: Mutex::new(SrqParts { srq, mr }),
            size,
            count: count as usize,
            held: AtomicUsize::new(0),
            lost: AtomicUsize::new(0),
        };
        for i in 0..pool.count {
            pool.post(i)?;
        }
        Ok(Arc::new(pool))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SrqParts> {
        self.srq.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts buffer `i`.
    fn post(&self, i: usize) -> Result<()> {
        let mut g = self.lock();
        let b =
            g.mr.slice(i * self.size..(i + 1) * self.size)
                .map_err(|e| Error::Protocol(e.to_string()))?;
        g.srq
            .post_recv(b, i as u64)
            .map_err(|e| Error::Protocol(format!("post_srq_recv (eager buffer): {}", e.error)))
    }

    /// Posts buffer `i` again where no connection can be told of a failure (counted).
    fn give_back(&self, i: usize) {
        if i >= self.count || self.post(i).is_err() {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A connection holding `mine` buffers takes one more, if the bounds allow.
    fn try_hold(&self, mine: usize) -> bool {
        let (per, all) = hold_limits(self.count);
        if mine >= per {
            return false;
        }
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                (h < all).then_some(h + 1)
            })
            .is_ok()
    }

    /// The first `len` bytes of buffer `i` (see [`Eager::landed`]).
    fn landed(&self, i: usize, len: usize) -> &[u8] {
        if i >= self.count {
            return &[];
        }
        // SAFETY: buffer `i` lies inside the registration (`i < count`, `len <= size`),
        // which `srq` keeps alive as long as `self`; it completed and the caller does not
        // post it again before the borrow ends, so neither the NIC nor anyone else
        // writes it meanwhile.
        unsafe {
            std::slice::from_raw_parts((self.base + i * self.size) as *const u8, len.min(self.size))
        }
    }

    fn stats(&self) -> SrqStats {
        SrqStats {
            buffers: self.count,
            buffer_bytes: self.size,
            posted: self.lock().srq.in_flight(),
            held: self.held.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }
}

/// Of `count` shared buffers, how many one connection may hold, and all together.
fn hold_limits(count: usize) -> (usize, usize) {
    ((count / 8).max(1), (count / 2).max(1))
}

/// The shared receive queue of a verbs domain ([`Options::verbs_srq_buffers`]), as
/// [`srq_stats`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SrqStats {
    /// Buffers registered (the option's value, however many connections use them).
    pub buffers: usize,
    /// Bytes of each ([`Options::verbs_eager_bytes`]).
    pub buffer_bytes: usize,
    /// Posted now (free for the next message of any connection).
    pub posted: usize,
    /// Kept by connections for messages waiting for a receive.
    pub held: usize,
    /// Could not be posted again (lost to the queue; 0 unless posting failed).
    pub lost: usize,
}

/// The domain's shared receive queue, once its first connection made it; `None` for
/// another backend, without [`Options::verbs_srq_buffers`] or before any connection.
pub fn srq_stats(domain: &Domain) -> Option<SrqStats> {
    let vd = verbs_domain(domain).ok()?;
    let g = vd.srq.lock().unwrap_or_else(|e| e.into_inner());
    g.as_ref().map(|p| p.stats())
}

fn post_bounce(qp: &mut ib::QueuePair<ib::Rc>, e: &Eager, i: usize) -> Result<()> {
    let Bounce::Own(rx) = &e.rx else {
        return Err(Error::Protocol(
            "eager buffer of the shared receive queue".into(),
        ));
    };
    let Some(b) = backing_of(rx) else {
        return Err(Error::Foreign("eager buffers without a registration"));
    };
    let slice = b
        .full
        .slice(i * e.size..(i + 1) * e.size)
        .map_err(|e| Error::Protocol(e.to_string()))?;
    qp.post_recv(slice, i as u64)
        .map_err(|e| Error::Protocol(format!("post_recv (eager buffer): {}", e.error)))
}

/// Places the message in bounce buffer `i` (completion `wc`): `false` when it must wait.
/// Own buffers wait while no receive is posted; shared ones go to the unexpected queue.
fn place(t: &mut Tracker, e: &Eager, i: usize, wc: Wc) -> bool {
    let total = wc.byte_len as usize;
    let wait_for_recv = e.pool().is_none() && !t.has_posted_recv();
    if let Some(imm) = wc.imm {
        // A write-imm notification (no payload here): a receive matching tag 0 takes it.
        match t.match_message(0) {
            Some(at) => {
                t.complete_recv(at, Status::Success, total, 0, Some(imm));
            }
            None => {
                if wait_for_recv || t.stash_begin(0, Some(imm), total, 0).is_none() {
                    return false;
                }
                t.stash_end();
            }
        }
        return true;
    }
    if total < TAG_HEADER || total > e.size {
        t.fail_all(
            Status::ProtocolError,
            "verbs eager message without its tag header",
        );
        return true;
    }
    let bytes = e.landed(i, total);
    let mut tag = [0u8; TAG_HEADER];
    tag.copy_from_slice(&bytes[..TAG_HEADER]);
    let tag = u64::from_le_bytes(tag);
    let payload = &bytes[TAG_HEADER..];
    let len = payload.len();
    match t.match_message(tag) {
        Some(at) => {
            let status = match t.recv_buf(at) {
                Some(buf) if len > buf.len() => Status::MessageTooLong,
                Some(buf) if buf.copy_from(payload).is_ok() => Status::Success,
                _ => Status::ProtocolError,
            };
            t.complete_recv(at, status, len, tag, None);
        }
        None => {
            if wait_for_recv || t.stash_begin(tag, None, len, len).is_none() {
                return false;
            }
            t.stash_fill(0, payload);
            t.stash_end();
        }
    }
    true
}

/// A receive-queue completion in eager mode.
fn on_bounce(t: &mut Tracker, e: &mut Eager, qp: &mut ib::QueuePair<ib::Rc>, wc: Wc) {
    let i = wc.wr_id as usize;
    if let Some(p) = e.pool() {
        if wc.status != ib::WcStatus::Success || t.failure().is_some() {
            // The buffer is free again whatever happened to its message (the connection's
            // failure, if any, was or is now reported).
            p.give_back(i);
            if wc.status != ib::WcStatus::Success && wc.status != ib::WcStatus::WrFlush {
                t.fail_all(
                    map_status(wc.status),
                    format!("verbs completion error: {}", wc.status),
                );
            }
            e.release_held();
            return;
        }
    } else if wc.status != ib::WcStatus::Success {
        if wc.status != ib::WcStatus::WrFlush {
            t.fail_all(
                map_status(wc.status),
                format!("verbs completion error: {}", wc.status),
            );
        }
        return;
    }
    if !e.held.is_empty() || !place(t, e, i, wc) {
        if let Some(p) = e.pool() {
            if !p.try_hold(e.held.len()) {
                overrun(t, e, qp, i);
                return;
            }
        }
        e.held.push_back((i, wc));
        return;
    }
    if let Err(err) = e.repost(qp, i) {
        t.fail_all(Status::ProtocolError, err.to_string());
    }
}

/// Shared buffers: a message that cannot be placed, with no buffer left for it to keep.
/// The connection fails (and gives every buffer back) so that the others keep theirs.
#[cold]
fn overrun(t: &mut Tracker, e: &mut Eager, qp: &mut ib::QueuePair<ib::Rc>, i: usize) {
    let Some(p) = e.pool() else { return };
    let (count, mine) = (p.count, e.held.len());
    p.give_back(i);
    t.fail_all(
        Status::ProtocolError,
        format!(
            "verbs shared receive queue: the peer sent more than this side had receives, \
             unexpected-queue room (Options::unexpected_messages / unexpected_bytes) and \
             shared buffers (this connection holds {mine}; Options::verbs_srq_buffers {count}) \
             for: connection given up so that the domain's other connections keep receiving"
        ),
    );
    let _ = qp.set_error();
    e.release_held();
}

/// Places held messages that can go now (a receive was posted, the queue made room).
fn run_held(t: &mut Tracker, e: &mut Eager, qp: &mut ib::QueuePair<ib::Rc>) -> Result<bool> {
    let mut moved = false;
    while let Some(&(i, wc)) = e.held.front() {
        if !place(t, e, i, wc) {
            break;
        }
        e.held.pop_front();
        if let Some(p) = e.pool() {
            p.held.fetch_sub(1, Ordering::Relaxed);
        }
        e.repost(qp, i)?;
        moved = true;
    }
    Ok(moved)
}

/// What a connection that sleeps alone (no worker holds it) waits on: an epoll of the
/// shared CQ's channel, the side-channel socket and its own eventfd (signalled when another
/// connection polled a completion of this one). Made on first need.
#[derive(Debug)]
struct Lone {
    epoll: OwnedFd,
    event: Arc<OwnedFd>,
}

impl Lone {
    fn new(hub: &Hub, sock: &TcpStream) -> Result<Lone> {
        let event = sys::eventfd()?;
        let epoll = sys::epoll_of(&[hub.channel.as_fd(), sock.as_fd(), event.as_fd()])?;
        Ok(Lone {
            epoll,
            event: Arc::new(event),
        })
    }
}

/// The work requests of one doorbell, reused. The vectors are never resized, so their
/// heap memory stays put: the links between the requests and to their scatter entries are
/// set once, here, with pointers from `as_mut_ptr` (no reference to the elements is
/// made), and each post only cuts the chain after its last request (see
/// [`VerbsHal::ring`]).
struct Doorbell {
    /// [`ib::MAX_BATCH`] requests, each linked to the next and to its two scatter entries.
    wrs: Vec<ibv_send_wr>,
    /// Their scatter entries, two per request.
    sges: Vec<ibv_sge>,
    /// [`ib::MAX_BATCH`] receive requests, each linked to the next and to its scatter entry.
    rwrs: Vec<ibv_recv_wr>,
    /// Their scatter entries, one per request.
    rsges: Vec<ibv_sge>,
}

// SAFETY: the raw pointers in the requests point only into the doorbell's own vectors
// (heap memory that moves with it) and are only used by the thread that holds it `&mut`.
unsafe impl Send for Doorbell {}

impl Doorbell {
    fn new() -> Self {
        let sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let mut db = Doorbell {
            wrs: vec![ib::raw::send_wr(); ib::MAX_BATCH],
            sges: vec![sge; 2 * ib::MAX_BATCH],
            rwrs: (0..ib::MAX_BATCH)
                .map(|_| ibv_recv_wr {
                    wr_id: 1,
                    next: std::ptr::null_mut(),
                    sg_list: std::ptr::null_mut(),
                    num_sge: 1,
                })
                .collect(),
            rsges: vec![sge; ib::MAX_BATCH],
        };
        let n = ib::MAX_BATCH;
        let (wrs, sges) = (db.wrs.as_mut_ptr(), db.sges.as_mut_ptr());
        let (rwrs, rsges) = (db.rwrs.as_mut_ptr(), db.rsges.as_mut_ptr());
        for k in 0..n {
            // SAFETY: `k < n`, the length of `wrs` and `rwrs` and `rsges`; `sges` has `2n`.
            // Each next pointer is one past the request (the last one's is past the end,
            // never followed: `ring` cuts the chain at the request it posts last).
            unsafe {
                let w = &mut *wrs.add(k);
                w.sg_list = sges.add(2 * k);
                w.next = wrs.add(k + 1);
                let r = &mut *rwrs.add(k);
                r.sg_list = rsges.add(k);
                r.next = rwrs.add(k + 1);
            }
        }
        db
    }
}

/// One connection: its queue pair (its CQ is the domain's shared one) and side socket.
/// Field order is drop order: the queue pair before its seat in the CQ.
struct VerbsHal {
    conn: u64,
    qp: ib::QueuePair<ib::Rc>,
    qp_num: u32,
    /// Eager mode's buffers (after the queue pair: dropped once it is destroyed).
    eager: Option<Eager>,
    /// Send work requests posted and not yet retired by a completion, in post order
    /// (room for the whole send queue, so it never grows on the hot path).
    sq: VecDeque<Token>,
    /// The send queue's depth.
    sq_depth: usize,
    /// The work requests of one doorbell.
    db: Doorbell,
    seat: Seat,
    sock: TcpStream,
    lone: OnceLock<Option<Lone>>,
    /// The worker that holds it (and watches the shared CQ for it).
    attached: Option<u64>,
    idle: u32,
    /// Its mailbox is watched (`arm` returned true).
    armed: bool,
    /// The connection failed and its mailbox discards (shared receive queue only).
    discarded: bool,
    _pd: ib::ProtectionDomain,
    /// For flushes (the domain's loopback queue pair).
    domain: Domain,
}

impl std::fmt::Debug for VerbsHal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsHal")
            .field("conn", &self.conn)
            .field("qp_num", &self.qp_num)
            .field("hub", &self.seat.hub)
            .field("attached", &self.attached)
            .finish()
    }
}

fn backing_of(r: &Region) -> Option<&Backing> {
    r.inner.backing.as_ref()?.downcast_ref::<Backing>()
}

fn map_status(s: ib::WcStatus) -> Status {
    match s {
        ib::WcStatus::Success => Status::Success,
        ib::WcStatus::LocalLength => Status::MessageTooLong,
        ib::WcStatus::RemoteAccess | ib::WcStatus::LocalProtection => Status::RemoteAccess,
        ib::WcStatus::WrFlush => Status::Canceled,
        ib::WcStatus::RetryExceeded | ib::WcStatus::RnrRetryExceeded => Status::PeerGone,
        _ => Status::ProtocolError,
    }
}

impl VerbsHal {
    /// The scatter entry of an operation's buffer: its bytes in the region's registration
    /// (host address, or a DMA-BUF registration's I/O virtual address).
    #[inline(always)]
    fn sge(p: &Op) -> Result<ibv_sge> {
        // (`let else`: an `ok_or` would build and drop the error on every call. The
        // registration's address and key are plain fields of the region: no downcast of
        // its backing per post.)
        let Some((addr, lkey)) = p.buf.region().inner.local else {
            return Err(Error::Foreign("buffer without a verbs registration"));
        };
        Ok(ibv_sge {
            addr: addr + p.buf.offset() as u64,
            // At most max_message (2^30): the tracker checked it.
            length: p.buf.len() as u32,
            lkey,
        })
    }

    /// Fills work request `i` of the doorbell being built (`wrs[i]`, its scatter entries
    /// `sges[2i..2i + 2]`; the links were set by `Doorbell::new`) for the queued
    /// operation `token`. `signal`: it must ask for a completion; otherwise a send or a
    /// write goes without one. Says whether it went without.
    #[inline(always)]
    fn fill(&mut self, t: &Tracker, token: Token, i: usize, signal: bool) -> Result<bool> {
        let p = t.live(token, "verbs submission")?;
        let sge = Self::sge(p)?;
        let mut num_sge = 1;
        // A SEND's request leaves `wr` (the remote address / atomic operands) and
        // `imm_data` as the previous request in this place left them: the provider reads
        // them only for the opcodes that carry them, and every arm that sets such an
        // opcode writes them.
        let w = &mut self.db.wrs[i];
        let rdma = |key: &crate::RemoteKey, off: u64| ib::raw::ibv_send_wr_wr {
            rdma: ib::raw::ibv_send_wr_rdma {
                remote_addr: key.addr + off,
                rkey: key.rkey,
            },
        };
        let atomic = |key: &crate::RemoteKey, off: u64, compare_add: u64, swap: u64| {
            ib::raw::ibv_send_wr_wr {
                atomic: ib::raw::ibv_send_wr_atomic {
                    remote_addr: key.addr + off,
                    compare_add,
                    swap,
                    rkey: key.rkey,
                },
            }
        };
        let (opcode, may_quiet) = match p.desc {
            OpDesc::Send => {
                match &self.eager {
                    None => self.db.sges[2 * i] = sge,
                    Some(e) => {
                        self.db.sges[2 * i] = header(e, token, p.tag)?;
                        if sge.length > 0 {
                            self.db.sges[2 * i + 1] = sge;
                            num_sge = 2;
                        }
                    }
                }
                (ib::raw::IBV_WR_SEND, true)
            }
            OpDesc::Write { key, off } => {
                self.db.sges[2 * i] = sge;
                w.wr = rdma(&key, off);
                // Write with immediate: consumes a receive at the target.
                let op = match p.imm {
                    Some(imm) => {
                        w.imm_data = imm.to_be();
                        ib::raw::IBV_WR_RDMA_WRITE_WITH_IMM
                    }
                    None => ib::raw::IBV_WR_RDMA_WRITE,
                };
                (op, true)
            }
            OpDesc::Read { key, off } => {
                self.db.sges[2 * i] = sge;
                w.wr = rdma(&key, off);
                (ib::raw::IBV_WR_RDMA_READ, false)
            }
            OpDesc::Atomic { key, off, op } => {
                // The tracker checked the buffer: 8 bytes, aligned.
                self.db.sges[2 * i] = sge;
                let (code, a) = match op {
                    AtomicOp::CompareSwap { expect, new } => (
                        ib::raw::IBV_WR_ATOMIC_CMP_AND_SWP,
                        atomic(&key, off, expect, new),
                    ),
                    AtomicOp::FetchAdd { add } => (
                        ib::raw::IBV_WR_ATOMIC_FETCH_AND_ADD,
                        atomic(&key, off, add, 0),
                    ),
                };
                w.wr = a;
                (code, false)
            }
            OpDesc::Recv => {
                return Err(Error::Protocol(
                    "verbs submission: a receive among the sends".into(),
                ))
            }
        };
        let quiet = may_quiet && !signal;
        w.wr_id = raw_id::encode(token, false, self.seat.epoch);
        w.num_sge = num_sge;
        w.opcode = opcode;
        w.send_flags = if quiet { 0 } else { ib::raw::IBV_SEND_SIGNALED };
        Ok(quiet)
    }

    /// Rings one doorbell for `wrs[..n]` (filled by [`fill`](Self::fill)).
    ///
    /// Why the raw post is sound (its contract, point by point): (1) `wrs[..n]` is a
    /// NULL-terminated chain (linked once by `Doorbell::new`, cut here after request
    /// `n - 1`) of requests `fill` built for this RC queue pair (valid opcodes, odd ids),
    /// each naming its scatter entries in `sges`. (2) Every entry
    /// names a buffer the tracker validated as this domain's (one protection domain) and
    /// within its region; the tracker owns that buffer, and through it the region and its
    /// registration, until the operation's completion is taken or the connection failed
    /// (then the queue pair is in the error state, and dropping a connection destroys its
    /// queue pair before its tracker); the caller cannot touch the buffer meanwhile.
    /// (3) Completions come back through the hub's `CompletionQueue::poll`, by raw id.
    fn ring(&mut self, n: usize) -> std::result::Result<(), ib::Error> {
        assert!(n >= 1 && n <= self.db.wrs.len());
        let wrs = self.db.wrs.as_mut_ptr();
        let qp = &mut self.qp;
        // SAFETY: `n - 1 < wrs.len()`; the requests were linked by `Doorbell::new` (their
        // vectors never move). A valid chain of this queue pair's requests on tracker-owned
        // buffers, completed through the hub's poll (the contract, point by point: the doc
        // above).
        unsafe {
            post_cut(
                wrs,
                n,
                |w| &raw mut (*w).next,
                |first| qp.post_send_raw(first),
            )
        }
    }

    /// Posts `rwrs[..n]` (their ids and scatter entries filled) in one call: a chain of
    /// receive requests with odd ids, one scatter entry each, for buffers the tracker
    /// validated and owns until the completion is taken or the connection failed (as in
    /// [`ring`](Self::ring)); their completions come back through the hub's poll. The
    /// receive queue has room: every posted receive is a live tracker slot, and the tracker
    /// has at most the queue's depth.
    fn ring_recv(&mut self, n: usize) -> std::result::Result<(), ib::Error> {
        assert!(n >= 1 && n <= self.db.rwrs.len());
        let wrs = self.db.rwrs.as_mut_ptr();
        let qp = &mut self.qp;
        // SAFETY: `n - 1 < rwrs.len()`; linked by `Doorbell::new`. A valid chain of receives
        // on tracker-owned buffers, with room in the queue (the contract, point by point:
        // the doc above).
        unsafe {
            post_cut(
                wrs,
                n,
                |w| &raw mut (*w).next,
                |first| qp.post_recv_raw(first),
            )
        }
    }

    /// Posts up to MAX_BATCH of the tracker's waiting receives in one call (kept out of
    /// line, as `post_many`).
    #[inline(never)]
    fn post_recvs(&mut self, t: &mut Tracker) -> Result<()> {
        // (`n` receives wait: the chain is filled in full.)
        let n = t.recv_len().min(ib::MAX_BATCH);
        for (i, token) in t.recv_first(n).enumerate() {
            self.db.rsges[i] = Self::sge(t.live(token, "verbs receive")?)?;
            self.db.rwrs[i].wr_id = raw_id::encode(token, true, self.seat.epoch);
        }
        self.ring_recv(n)
            .map_err(|e| Error::Protocol(format!("post_recv ({n} requests): {e}")))?;
        t.recv_pop_n(n);
        Ok(())
    }

    fn submit(&mut self, t: &mut Tracker) -> Result<bool> {
        let mut moved = false;
        if let Some(e) = self.eager.as_mut() {
            moved |= run_held(t, e, &mut self.qp)?;
        }
        // Receives (without eager mode they go straight to the caller's buffers): one
        // alone by itself, more in chains of up to MAX_BATCH per call.
        while self.eager.is_none() && t.recv_len() > 0 {
            if t.recv_len() > 1 {
                self.post_recvs(t)?;
                moved = true;
                continue;
            }
            let Some(token) = t.recv_front() else { break };
            let mut sge = Self::sge(t.live(token, "verbs receive")?)?;
            let mut wr = ibv_recv_wr {
                wr_id: raw_id::encode(token, true, self.seat.epoch),
                next: std::ptr::null_mut(),
                sg_list: &mut sge,
                num_sge: 1,
            };
            // SAFETY: as in `ring_recv`, for a chain of one.
            unsafe { self.qp.post_recv_raw(&mut wr) }
                .map_err(|e| Error::Protocol(format!("post_recv: {e}")))?;
            t.recv_pop();
            moved = true;
        }
        if !t.has_submissions() {
            return Ok(moved);
        }
        // Sends and one-sided operations: as many as the send queue surely has room for
        // (`sq` holds every work request posted and not yet retired), up to MAX_BATCH per
        // doorbell; one alone goes signalled.
        loop {
            let room = self.sq_depth.saturating_sub(self.sq.len());
            let n = t.submit_len().min(room).min(ib::MAX_BATCH);
            if n == 0 {
                break;
            }
            if n == 1 {
                let Some(token) = t.submit_front() else { break };
                self.fill(t, token, 0, true)?;
                t.submit_pop();
                match self.ring(1) {
                    Ok(()) => self.sq.push_back(token),
                    // Refused by the provider (e.g. an invalid request): fail this op.
                    Err(_) => {
                        t.complete(token, Status::ProtocolError, 0, 0);
                    }
                }
                moved = true;
                continue;
            }
            self.post_many(t, n)?;
            moved = true;
        }
        Ok(moved)
    }

    /// Posts the first `n` (at least 2) queued operations behind one doorbell. Kept out of
    /// `submit` (never inlined), so that a single post does not pay for its loop.
    #[inline(never)]
    fn post_many(&mut self, t: &mut Tracker, n: usize) -> Result<()> {
        let mut unsignalled = 0;
        for i in 0..n {
            let Some(token) = t.submit_get(i) else {
                return Err(Error::Protocol("verbs submission queue shrank".into()));
            };
            // Selective signalling: sends and writes may go without a completion of
            // their own, except every SIGNAL_EVERY-th and the last of the doorbell;
            // the next signalled one's completion retires them (send queues complete
            // in order). READs and atomics (their completion says data arrived) keep
            // theirs.
            let signal = i + 1 == n || unsignalled + 1 >= SIGNAL_EVERY;
            if self.fill(t, token, i, signal)? {
                unsignalled += 1;
            } else {
                unsignalled = 0;
            }
        }
        let res = self.ring(n);
        for _ in 0..n {
            if let Some(token) = t.submit_pop() {
                self.sq.push_back(token);
            }
        }
        if let Err(e) = res {
            // The provider refused a request of the chain: those before it went out, but
            // which is not told, and the part that went may end without a signalled
            // request. Give the connection up: the error state's flushes retire whatever
            // was posted (their ids are in `sq`).
            let _ = self.qp.set_error();
            return Err(Error::Protocol(format!("post_send ({n} requests): {e}")));
        }
        Ok(())
    }

    /// Takes this connection's completions: those another connection routed to its
    /// mailbox, then what the shared CQ holds (routing the others'). They go straight into
    /// `out[*n..]` where they may ([`Tracker::finish`]), else to the tracker's ready queue.
    fn reap(&mut self, t: &mut Tracker, out: &mut [Completion], n_out: &mut usize) -> Result<bool> {
        let me = (self.qp_num, self.seat.epoch);
        let VerbsHal {
            seat,
            eager,
            qp,
            sq,
            ..
        } = self;
        let hub = &seat.hub;
        let mut st = hub.lock();
        let mut n = 0;
        let mut sink = Sink::new(out, n_out);
        let mut on = |wc: Wc| match eager.as_mut() {
            Some(e) if wc.recv => on_bounce(t, e, qp, wc),
            _ => complete(t, sq, wc, &mut sink),
        };
        while let Some(wc) = st.demux.take(me.0) {
            on(wc);
            n += 1;
        }
        n += st.pump(hub.event.as_fd(), Some(me), &mut on)?;
        drop(st);
        if let Some(e) = eager.as_mut() {
            if !e.held.is_empty() && t.failure().is_some() {
                // A failed connection's messages are never placed: shared buffers go back.
                e.release_held();
            }
        }
        Ok(n > 0)
    }

    fn lone(&self) -> Option<&Lone> {
        self.lone
            .get_or_init(|| Lone::new(&self.seat.hub, &self.sock).ok())
            .as_ref()
    }

    fn unwatch(&mut self) {
        if std::mem::take(&mut self.armed) {
            self.seat.hub.lock().demux.unwatch(self.qp_num);
        }
    }
}

/// Posts the first `n` requests of a doorbell's linked array `wrs` (see `Doorbell::new`):
/// the chain is cut after request `n - 1` for the post (`next` names a request's link) and
/// joined again after it, whatever the post returned.
///
/// # Safety
/// `wrs` points to at least `n >= 1` requests, each linked to the next; `post` must be
/// sound for the chain of the first `n` (the callers' contracts).
#[inline(always)]
unsafe fn post_cut<W, R>(
    wrs: *mut W,
    n: usize,
    next: impl Fn(*mut W) -> *mut *mut W,
    post: impl FnOnce(&mut W) -> R,
) -> R {
    // SAFETY: `n - 1` is within the array (the caller's contract); the link is a plain
    // pointer field of that request.
    unsafe {
        let link = next(wrs.add(n - 1));
        let keep = std::mem::replace(&mut *link, std::ptr::null_mut());
        let res = post(&mut *wrs);
        *link = keep;
        res
    }
}

/// The first scatter entry of an eager-mode send: its tag header, written into the slot's
/// header cell (the payload follows as a second entry).
fn header(e: &Eager, token: Token, tag: u64) -> Result<ibv_sge> {
    let at = (token.0 & u64::from(u32::MAX)) as usize * TAG_HEADER;
    e.hdr.write_at(at, &tag.to_le_bytes())?;
    let Some((addr, lkey)) = e.hdr.inner.local else {
        return Err(Error::Foreign("tag headers without a registration"));
    };
    Ok(ibv_sge {
        addr: addr + at as u64,
        length: TAG_HEADER as u32,
        lkey,
    })
}

/// Hands one completion to the tracker. A send-queue completion first retires, as
/// successful, the unsignalled work requests posted before it (`sq`, in post order: send
/// queues complete in order, and a failing work request always reports itself, signalled
/// or not).
fn complete(t: &mut Tracker, sq: &mut VecDeque<Token>, wc: Wc, sink: &mut Sink<'_>) {
    if !wc.raw {
        return; // (every operation's request is posted raw; eager buffers go elsewhere)
    }
    let token = raw_id::token(wc.wr_id);
    if !wc.recv {
        while let Some(&front) = sq.front() {
            sq.pop_front();
            if front == token {
                break;
            }
            complete_one(
                t,
                front,
                Wc {
                    wr_id: front.0,
                    status: ib::WcStatus::Success,
                    ..wc
                },
                sink,
            );
        }
    }
    complete_one(t, token, wc, sink);
}

/// Hands the completion `wc` of `token` to the tracker: into the sink when it has room.
#[inline(always)]
fn complete_one(t: &mut Tracker, token: Token, wc: Wc, sink: &mut Sink<'_>) {
    let status = map_status(wc.status);
    let len_value = |p: &Op| match p.desc {
        OpDesc::Recv => (wc.byte_len as usize, 0),
        OpDesc::Atomic { .. } => (
            8,
            if status.is_ok() {
                p.buf.read_u64().unwrap_or(0)
            } else {
                0
            },
        ),
        _ => (p.buf.len(), 0),
    };
    let into = sink.next();
    match t.finish(token, status, wc.imm, len_value, into) {
        Finish::Taken => *sink.n += 1,
        Finish::Queued => {}
        Finish::Grouped => {
            // A grouped receive: the message (or a write-imm notification, with its
            // immediate) fills its first part.
            let at = crate::tracker::RecvRef { token, part: 0 };
            t.complete_recv(at, status, wc.byte_len as usize, 0, wc.imm);
        }
        Finish::Stale => return, // flushed after a local failure: already completed
    }
    if !status.is_ok() && status != Status::MessageTooLong {
        // The QP is in the error state: everything else will flush.
        t.fail_all(status, format!("verbs completion error: {}", wc.status));
    }
}

impl Hal for VerbsHal {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn flush_device(&mut self, t: &mut Tracker, buf: Buf, wr_id: u64) -> PostResult {
        let Some(key) = buf
            .region()
            .remote_key()
            .filter(|k| k.access().contains(Access::REMOTE_READ))
        else {
            return Err(PostError {
                error: Error::AccessDenied(
                    "REMOTE_READ (a verbs flush reads the memory through the NIC: register \
                     it with REMOTE_READ)",
                ),
                buf,
            });
        };
        if !buf.is_empty() {
            let at = key.addr + buf.offset() as u64;
            let read = verbs_domain(&self.domain).and_then(|vd| vd.flush_read(at, key.rkey));
            if let Err(error) = read {
                return Err(PostError { error, buf });
            }
        }
        t.post_flush_done(buf, wr_id).map(|_| ())
    }

    fn max_send(&self) -> usize {
        match &self.eager {
            // Sends must fit a bounce buffer after the tag; receives and one-sided
            // operations keep max_message.
            Some(e) => e.size - TAG_HEADER,
            None => usize::MAX,
        }
    }

    fn progress(&mut self, t: &mut Tracker) -> Result<()> {
        self.progress_into(t, &mut [], &mut 0)
    }

    /// Completions go straight into `out` while it has room and nothing waits in the
    /// tracker's ready queue (see [`Tracker::finish`]).
    fn progress_into(
        &mut self,
        t: &mut Tracker,
        out: &mut [Completion],
        n: &mut usize,
    ) -> Result<()> {
        let r = self.progress_inner(t, out, n);
        if r.is_err() {
            // The caller fails every operation and hands the buffers back: no request of
            // this queue pair may go on with them.
            let _ = self.qp.set_error();
        }
        if self.shared() && !self.discarded && (r.is_err() || t.failure().is_some()) {
            // A failed connection is not progressed any more (the endpoint skips it, a
            // worker leaves it dormant): its shared receive buffers, held or still to
            // complete, must not wait for it.
            self.discarded = true;
            self.armed = false;
            self.seat.hub.lock().discard(self.qp_num);
            // Tell the peer at once (a hang-up): its sends would otherwise retry against a
            // queue pair in the error state (rxe retries without limit at retry_cnt 7).
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
            if let Some(e) = self.eager.as_mut() {
                e.release_held();
            }
        }
        r
    }

    fn attach_worker(&mut self, worker: Option<u64>) -> Option<u64> {
        self.unwatch();
        self.attached = worker;
        Some((u64::from(self.seat.hub.index) << 32) | u64::from(self.qp_num))
    }

    /// A post only hands what the tracker queued to the queue pair (one doorbell for all
    /// of it): no CQ poll, no second pass. Completions are taken by the next `poll`; `arm`
    /// routes what the CQ holds before it lets a caller sleep, so none is missed.
    fn post_kick(&mut self, t: &mut Tracker, _recv: bool) -> Result<()> {
        let r = self.submit(t).map(|_| ());
        if r.is_err() {
            // As in `progress`: the caller fails everything and hands the buffers back.
            let _ = self.qp.set_error();
        }
        r
    }

    fn wait_fd(&self) -> BorrowedFd<'_> {
        if self.attached.is_some() {
            // The worker watches the shared CQ; this fd only tells of a hang-up.
            return self.sock.as_fd();
        }
        match self.lone() {
            Some(l) => l.epoll.as_fd(),
            // No fds left for the epoll: `arm` reports it (the socket still tells of a
            // hang-up).
            None => self.sock.as_fd(),
        }
    }

    fn arm(&mut self, t: &Tracker) -> Result<bool> {
        let watch = if let Some(w) = self.attached {
            Watch::Worker(w)
        } else {
            match self.lone() {
                Some(l) => Watch::Lone(l.event.clone()),
                None => {
                    return Err(Error::io(
                        "verbs wait fd (epoll_create1 / eventfd)",
                        io::Error::other("could not be created (file descriptor limit?)"),
                    ))
                }
            }
        };
        let me = self.qp_num;
        let hub = &self.seat.hub;
        let mut st = hub.lock();
        st.req_notify()?;
        // A completion that landed before the arm raises no event: route what the CQ has.
        st.pump(hub.event.as_fd(), None, &mut |_| {})?;
        if t.ready_len() > 0 || sys::peer_hung_up(self.sock.as_fd()) {
            return Ok(false);
        }
        if st.demux.has_mail(me) {
            if !self.shared() {
                return Ok(false);
            }
            // Shared receive queue: the mail may hold shared buffers, which must not wait
            // for the caller's next post (a worker leaves an endpoint with nothing in
            // flight alone until then, "dormant"). Sleep, and wake at once as a new
            // completion would: the worker progresses it on its next round.
            if let Some(w) = st.demux.wake_now(me, watch) {
                signal(w, hub.event.as_fd());
            }
            self.armed = true;
            return Ok(true);
        }
        self.armed = st.demux.watch(me, watch);
        Ok(self.armed)
    }
}

impl VerbsHal {
    /// Its receives come from the domain's shared receive queue.
    fn shared(&self) -> bool {
        self.eager.as_ref().is_some_and(|e| e.pool().is_some())
    }

    fn progress_inner(
        &mut self,
        t: &mut Tracker,
        out: &mut [Completion],
        n: &mut usize,
    ) -> Result<()> {
        if self.armed {
            self.unwatch();
            if self.attached.is_none() {
                // Woken alone: take the channel's event (the worker does that for those
                // it holds) and our eventfd's signal.
                if let Some(l) = self.lone() {
                    sys::eventfd_drain(l.event.as_fd());
                }
                let hub = &self.seat.hub;
                hub.settle(&mut hub.lock())?;
            }
            self.idle = CHECK_EVERY - 1;
        }
        let mut moved = self.submit(t)?;
        moved |= self.reap(t, out, n)?;
        if moved {
            self.idle = 0;
            // Completions may have freed queue entries.
            self.submit(t)?;
        } else {
            self.idle += 1;
            if self.idle >= CHECK_EVERY {
                self.idle = 0;
                if sys::peer_hung_up(self.sock.as_fd()) {
                    // A peer that received our last sends and left at once: their
                    // acknowledgements may still be on the way to our CQ (the peer's exit
                    // can overtake them). Give posted sends a short grace to complete as
                    // they did before they are failed.
                    let until = Instant::now() + HANGUP_GRACE;
                    loop {
                        let got = self.reap(t, out, n)?;
                        if !got && (self.sq.is_empty() || Instant::now() >= until) {
                            break;
                        }
                        if !got {
                            std::thread::yield_now();
                        }
                    }
                    let _ = self.qp.set_error();
                    t.fail_all(Status::PeerGone, "verbs peer hung up (side channel closed)");
                    if let Some(e) = self.eager.as_mut() {
                        e.release_held();
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(wr_id: u64) -> Wc {
        Wc {
            wr_id,
            status: ib::WcStatus::Success,
            byte_len: 8,
            imm: None,
            recv: false,
            srq: false,
            raw: false,
        }
    }

    #[test]
    fn raw_ids_carry_token_queue_and_epoch_and_are_odd() {
        use crate::tracker::GEN_BITS;
        for (idx, gen) in [
            (0u64, 0u64),
            (511, 1),
            (3, (1 << GEN_BITS) - 1),
            (65_535, 12_345),
        ] {
            let token = Token((gen << 32) | idx);
            for recv in [false, true] {
                for epoch in [0u16, 1, 0xbeef, u16::MAX] {
                    let id = raw_id::encode(token, recv, epoch);
                    assert_eq!(id & 1, 1, "the raw layer takes odd ids only");
                    assert_eq!(raw_id::token(id), token);
                    assert_eq!(raw_id::recv(id), recv);
                    assert_eq!(raw_id::epoch(id), epoch);
                }
            }
        }
    }

    #[test]
    fn a_raw_completion_of_an_earlier_queue_pair_of_the_same_number_is_dropped() {
        let mut d = Demux::default();
        let raw = |epoch: u16, idx: u64| Wc {
            raw: true,
            ..wc(raw_id::encode(Token(idx), false, epoch))
        };
        // Queue pair 7 of epoch 1 closed with a completion still in the CQ; a new
        // connection (epoch 2) got the number 7.
        d.open(7, 2);
        assert!(d.route(7, raw(1, 3)).is_none());
        assert_eq!(
            d.take(7),
            None,
            "the stale one must not reach the new connection"
        );
        assert!(d.route(7, raw(2, 3)).is_none());
        assert_eq!(d.take(7), Some(raw(2, 3)));
        // The safe layer's own completions (eager buffers) carry no epoch.
        assert!(d.route(7, wc(4)).is_none());
        assert_eq!(d.take(7), Some(wc(4)));
    }

    #[test]
    fn srq_buffers_are_checked_against_eager_mode_and_device() {
        let o = |eager, n| Options {
            verbs_eager_bytes: eager,
            verbs_srq_buffers: n,
            ..Options::default()
        };
        assert_eq!(srq_buffers(&o(0, 0), 32_767, 1 << 20).unwrap(), 0);
        assert_eq!(srq_buffers(&o(4096, 0), 32_767, 1 << 20).unwrap(), 0);
        assert_eq!(srq_buffers(&o(4096, 64), 32_767, 1 << 20).unwrap(), 64);
        // Without the eager mode: refused, and the message says why.
        let e = srq_buffers(&o(0, 64), 32_767, 1 << 20).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("verbs_eager_bytes")),
            "{e}"
        );
        // More than half the largest CQ, or than the device's SRQ, or than 2^16.
        let e = srq_buffers(&o(4096, 16_384), 32_767, 1 << 20).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("1 to 16383")),
            "{e}"
        );
        assert!(srq_buffers(&o(4096, 300), 32_767, 256).is_err());
        assert!(srq_buffers(&o(4096, 1 << 17), u32::MAX, u32::MAX).is_err());
        assert_eq!(
            srq_buffers(&o(4096, 1 << 16), u32::MAX, u32::MAX).unwrap(),
            1 << 16
        );
        // A device without SRQs.
        let e = srq_buffers(&o(4096, 64), 32_767, 0).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    }

    #[test]
    fn hold_limits_leave_half_the_shared_buffers_to_the_others() {
        assert_eq!(hold_limits(256), (32, 128));
        assert_eq!(hold_limits(64), (8, 32));
        assert_eq!(hold_limits(1), (1, 1));
        assert_eq!(hold_limits(7), (1, 3));
    }

    #[test]
    fn a_discarding_mailbox_queues_nothing_and_wakes_nobody() {
        let mut d = Demux::default();
        d.open(5, 0);
        assert!(d.watch(5, Watch::Worker(1)));
        d.route(5, wc(1));
        assert!(d.route(5, wc(2)).is_none());
        assert_eq!(d.discard(5), VecDeque::from([wc(1), wc(2)]));
        assert!(d.woken.is_empty());
        assert_eq!(d.watchers, 0);
        // Pump checks `is_open` before routing: a discarding mailbox is not.
        assert!(!d.is_open(5));
        assert!(!d.has_mail(5));
        assert!(d.close(5).is_empty());
    }

    #[test]
    fn waking_now_tells_the_worker_once() {
        let mut d = Demux::default();
        d.open(1, 0);
        d.open(2, 0);
        assert!(matches!(d.wake_now(1, Watch::Worker(7)), Some(Wake::Hub)));
        assert!(d.wake_now(1, Watch::Worker(7)).is_none());
        assert!(d.wake_now(2, Watch::Worker(7)).is_none());
        assert_eq!(d.woken, vec![(7, 1), (7, 2)]);
        assert_eq!(d.watchers, 0);
        assert!(d.wake_now(3, Watch::Worker(7)).is_none(), "no mailbox");
        let fd = Arc::new(sys::eventfd().unwrap());
        assert!(matches!(
            d.wake_now(2, Watch::Lone(fd)),
            Some(Wake::Lone(_))
        ));
    }

    #[test]
    fn closing_a_mailbox_hands_back_what_it_held() {
        let mut d = Demux::default();
        assert!(d.open(3, 0).is_empty());
        let mut r = wc(5);
        r.recv = true;
        r.srq = true;
        assert!(d.route(3, r).is_none());
        assert!(d.is_open(3));
        assert_eq!(d.close(3), VecDeque::from([r]));
        assert!(!d.is_open(3));
        assert!(d.close(3).is_empty());
    }

    #[test]
    fn completions_reach_their_queue_pair_in_order() {
        let mut d = Demux::default();
        d.open(7, 0);
        d.open(9, 0);
        assert!(d.route(7, wc(1)).is_none());
        assert!(d.route(9, wc(2)).is_none());
        assert!(d.route(7, wc(3)).is_none());
        // A closed (or unknown) queue pair's completion is dropped.
        assert!(d.route(11, wc(4)).is_none());
        assert_eq!(d.take(7), Some(wc(1)));
        assert_eq!(d.take(7), Some(wc(3)));
        assert_eq!(d.take(7), None);
        assert_eq!(d.take(9), Some(wc(2)));
        assert_eq!(d.take(11), None);
    }

    #[test]
    fn a_watched_mailbox_wakes_its_sleeper_once() {
        let mut d = Demux::default();
        d.open(1, 0);
        d.open(2, 0);
        d.open(3, 0);
        assert!(d.watch(1, Watch::Worker(1)));
        assert!(d.watch(2, Watch::Worker(1)));
        let fd = Arc::new(sys::eventfd().unwrap());
        assert!(d.watch(3, Watch::Lone(fd.clone())));
        assert_eq!(d.watchers, 3);
        // The first worker wake-up signals, the second only joins the list.
        assert!(matches!(d.route(2, wc(5)), Some(Wake::Hub)));
        assert!(d.route(1, wc(6)).is_none());
        assert_eq!(d.woken, vec![(1, 2), (1, 1)]);
        // Woken once: the next completion of the same queue pair signals nobody.
        assert!(d.route(2, wc(7)).is_none());
        match d.route(3, wc(8)) {
            Some(Wake::Lone(f)) => assert!(Arc::ptr_eq(&f, &fd)),
            other => panic!("{other:?}"),
        }
        assert_eq!(d.watchers, 0);
    }

    /// The flush's loopback read on host memory (what rxe allows: it cannot register GPU
    /// memory): a good key reads, a bad one fails typed, and the next flush works again.
    #[test]
    fn verbs_loopback_flush_read() {
        let d = match Domain::open(TransportKind::Verbs, &Options::default()) {
            Ok(d) => d,
            Err(e) => {
                println!("skipped: verbs_loopback_flush_read: no RDMA device ({e}) [lacks rdma]");
                return;
            }
        };
        let r = d.register(4096, Access::REMOTE_READ).unwrap();
        let key = r.remote_key().unwrap();
        let vd = verbs_domain(&d).unwrap();
        vd.flush_read(key.addr + 100, key.rkey).unwrap();
        let e = vd.flush_read(key.addr, key.rkey ^ 0x55).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        vd.flush_read(key.addr + 4095, key.rkey).unwrap();
        let e = vd.flush_read(key.addr + 4096, key.rkey).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        println!("verbs: loopback flush reads (good key, bad key refused, out of bounds refused)");
    }

    #[test]
    fn each_worker_is_told_only_of_its_own_endpoints() {
        let mut d = Demux::default();
        d.open(1, 0);
        d.open(2, 0);
        assert!(d.watch(1, Watch::Worker(10)));
        assert!(d.watch(2, Watch::Worker(20)));
        assert!(matches!(d.route(1, wc(1)), Some(Wake::Hub)));
        assert!(d.route(2, wc(2)).is_none());
        assert_eq!(d.woken, vec![(10, 1), (20, 2)]);
    }

    #[test]
    fn mail_already_waiting_refuses_the_watch() {
        let mut d = Demux::default();
        d.open(4, 0);
        assert!(d.route(4, wc(1)).is_none());
        assert!(d.has_mail(4));
        assert!(!d.watch(4, Watch::Worker(1)));
        assert_eq!(d.watchers, 0);
        assert_eq!(d.take(4), Some(wc(1)));
        assert!(d.watch(4, Watch::Worker(1)));
        d.unwatch(4);
        d.unwatch(4);
        assert_eq!(d.watchers, 0);
        // Closing a watched, woken queue pair forgets it everywhere.
        assert!(d.watch(4, Watch::Worker(1)));
        assert!(d.route(4, wc(2)).is_some());
        assert!(!d.watch(4, Watch::Worker(1)), "mail waits");
        d.close(4);
        assert!(d.woken.is_empty());
        assert_eq!(d.watchers, 0);
        assert!(
            !d.watch(4, Watch::Worker(1)),
            "no mailbox: nothing to watch"
        );
    }
}
