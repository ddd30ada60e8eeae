//! `shm`: processes on one host, through shared memory.
//!
//! * Setup: the listener is a Unix socket in the abstract namespace (no file system path);
//!   on accept it checks the peer's uid (`SO_PEERCRED`), creates the channel — one
//!   size-sealed `memfd` holding two SPSC [`ring`]s — and passes it, with an
//!   `eventfd` to wake it, over `SCM_RIGHTS`; the connector checks the seals and size,
//!   maps it and answers with its own `eventfd`. Nothing is ever reachable by a path.
//!   Once connected, each side holds three fds: the socket, its own eventfd and the
//!   peer's (the channel's memfd, and a peer region's once mapped, are closed: the
//!   mappings stay).
//! * Two-sided: a message is copied into the outbound ring in records of at most
//!   `chunk_bytes` (the first record carries the total length and, in its first 8 payload
//!   bytes, the message's tag) and copied out into the oldest posted receive that matches
//!   its tag (the tracker matches). No receive posted = the message waits in the ring
//!   (backpressure); receives posted but none matching = the message is copied into the
//!   tracker's bounded unexpected queue, or waits in the ring while that queue is full.
//!   A send that fits one record, with nothing queued ahead of it, is copied into the ring
//!   by the post itself before the tracker records it (`Hal::send_now`): the message is
//!   visible to the peer after ~220 instructions of the post instead of ~430.
//! * Write with immediate: the bytes are copied into the peer's mapping, then a
//!   notification record (the immediate, the length) follows in the ring, so the peer sees
//!   the bytes before the notification; it is matched as a zero-byte message with tag 0.
//! * One-sided: regions are `memfd` shared mappings; registering one with remote access
//!   passes its fd to the peer over the Unix socket — the control path, counted in the
//!   channel header and taken by the peer on every poll independently of the message
//!   rings, so registration never waits for the application to post receives — and
//!   write / read /
//!   atomics are plain copies and `AtomicU64` operations on the peer's mapping, checked
//!   against the key, the granted access and the real mapping length.
//! * Sleeping: each side has a "sleeping" flag in the channel; a side that armed sleeps on
//!   its eventfd and the socket; the other side signals the eventfd after publishing
//!   records or freeing space, only when the flag is set. A lone
//!   [`wait_fd`](Transport::wait_fd) is an epoll of the two, made on first need; a
//!   [`Worker`](crate::Worker) watches the two in its own epoll instead, so a connection in
//!   a worker never makes one.
//! * Peer death: the Unix socket hangs up when the peer dies; it is checked every
//!   [`CHECK_EVERY`] idle polls (and at once after a wake-up); then everything in flight
//!   completes with [`Status::PeerGone`].
#![allow(unsafe_code)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use memmap2::MmapRaw;

use super::accept::{self, AcceptQueue, Connecting, Handshake};
use super::{BackendEntry, Connector, Endpoint, Hal, Listener, WatchFds};
use crate::copy;
use crate::domain::{Domain, DomainBackend, MemorySupport, Source};
use crate::error::{Error, Result};
use crate::region::{check_range, Access, Buf, Memory, Region};
use crate::ring::{self, Consumer, Producer, RingHeader};
use crate::sys;
use crate::tracker::{OpDesc, RecvRef, Sink, Token, Tracker};
use crate::transport::{
    AtomicOp, Capabilities, MemoryKinds, MessageOrdering, RemoteKey, Status, Transport,
    TransportKind,
};
use crate::window::{Mapping, RemoteWindow};

/// The registry entry.
pub static ENTRY: BackendEntry = BackendEntry {
    kind: TransportKind::Shm,
    probe,
    open: Some(|o| {
        probe()?;
        Ok(Box::new(ShmDomain {
            rndv: o.rndv_bytes,
            state: Mutex::new(ShmShared::default()),
        }))
    }),
    listen: |o| Domain::open(TransportKind::Shm, o)?.listen(),
    connect: |a, o| Domain::open(TransportKind::Shm, o)?.connect(a),
};

/// The shm domain: regions it allocates are sealed `memfd`s; those a peer may address
/// (remote access, or rendezvous-sized) are announced to every connection of the domain
/// and revoked at every one when dropped.
#[derive(Debug)]
struct ShmDomain {
    rndv: usize,
    state: Mutex<ShmShared>,
}

/// Announced regions and the connections that hear about them (one lock, so a new
/// connection's snapshot and later announcements never miss or repeat one).
#[derive(Debug, Default)]
struct ShmShared {
    regions: std::collections::BTreeMap<u32, (u32, [u8; ANN_LEN], Arc<OwnedFd>)>,
    announcers: Vec<std::sync::Weak<Announcer>>,
}

impl ShmDomain {
    fn lock(&self) -> std::sync::MutexGuard<'_, ShmShared> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn broadcast(&self, st: &mut ShmShared, msg: impl Fn() -> AnnMsg) {
        st.announcers.retain(|w| w.strong_count() > 0);
        for a in st.announcers.iter().filter_map(|w| w.upgrade()) {
            a.push(msg());
            // Errors (a peer gone) surface in that connection's own progress.
            let _ = a.flush();
        }
    }

    /// Registers a new connection's announcer, queued with every live announcement.
    fn attach(&self, a: &Arc<Announcer>) {
        let mut st = self.lock();
        for (id, (gen, bytes, fd)) in &st.regions {
            let _ = (id, gen);
            a.push(AnnMsg {
                bytes: *bytes,
                fd: Some(fd.clone()),
            });
        }
        st.announcers.retain(|w| w.strong_count() > 0);
        st.announcers.push(Arc::downgrade(a));
    }
}

impl DomainBackend for ShmDomain {
    fn admit(&self, source: Source, access: Access) -> Result<()> {
        if source == Source::Caller && access.is_remote() {
            return Err(Error::Unsupported {
                transport: TransportKind::Shm,
                what: "one-sided access to caller memory (a peer can only address memory \
                       it can map; cross-memory attach, process_vm_writev, cannot be \
                       revoked once a peer holds the key, so it is not offered): register \
                       with Domain::register for one-sided use",
            });
        }
        Ok(())
    }

    fn allocate(&self, len: usize) -> Result<(Memory, Option<Arc<OwnedFd>>)> {
        let size = len.max(1).next_multiple_of(4096);
        let fd = sys::memfd("fabric-shm-region", size)?;
        sys::seal_size(fd.as_fd())?;
        let map = sys::map_shared(fd.as_fd(), size)?;
        Ok((Memory::Mapped(Arc::new(map)), Some(Arc::new(fd))))
    }

    fn published(&self, r: &Region) {
        let Some(fd) = r.inner.fd.clone() else { return };
        let rndv = self.rndv > 0 && r.len() >= self.rndv;
        if !r.access().is_remote() && !rndv {
            return;
        }
        let bytes = announcement(r, if rndv { ANN_RNDV } else { 0 });
        let mut st = self.lock();
        st.regions
            .insert(r.id(), (r.generation(), bytes, fd.clone()));
        self.broadcast(&mut st, || AnnMsg {
            bytes,
            fd: Some(fd.clone()),
        });
    }

    fn revoked(&self, id: u32, gen: u32) {
        let mut st = self.lock();
        match st.regions.get(&id) {
            Some((g, ..)) if *g == gen => {}
            _ => return,
        }
        st.regions.remove(&id);
        let bytes = revocation(id, gen);
        self.broadcast(&mut st, || AnnMsg { bytes, fd: None });
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn memory(&self) -> MemorySupport {
        MemorySupport {
            allocated: MemoryKinds::HOST,
            allocated_remote: MemoryKinds::HOST,
            caller: MemoryKinds::HOST,
            caller_remote: MemoryKinds::empty(),
        }
    }

    fn listen(&self, d: &Domain) -> Result<Box<dyn Listener>> {
        Ok(Box::new(ShmListener::bind(d)?))
    }

    fn connect(&self, d: &Domain, address: &str) -> Result<Box<dyn Connector>> {
        Ok(Box::new(ShmConnector::connect(address, d)?))
    }
}

/// One message of the control path: an announcement (with the region's memfd) or a
/// revocation (without a descriptor).
#[derive(Debug)]
struct AnnMsg {
    bytes: [u8; ANN_LEN],
    fd: Option<Arc<OwnedFd>>,
}

/// One connection's end of the control path: messages queued by the domain (from any
/// thread) and sent without blocking; the rest go on the connection's next progress.
#[derive(Debug)]
struct Announcer {
    /// Messages queued and not yet sent (checked without the lock on every progress).
    queued: AtomicU64,
    inner: Mutex<AnnouncerInner>,
}

#[derive(Debug)]
struct AnnouncerInner {
    /// The connection's socket and the peer's eventfd, shared with its [`ShmHal`] (no
    /// duplicates: an endpoint holds one fd of each).
    sock: Arc<UnixStream>,
    chan: Arc<ChannelMap>,
    side: usize,
    peer_efd: Arc<OwnedFd>,
    sent: u64,
    queue: std::collections::VecDeque<AnnMsg>,
}

impl Announcer {
    fn push(&self, m: AnnMsg) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.queue.push_back(m);
        self.queued.fetch_add(1, Ordering::Release);
    }

    /// Sends what the socket takes now; `Ok(true)` when nothing is left queued.
    /// (One atomic load when nothing is queued: the rest is out of line.)
    #[inline]
    fn flush(&self) -> Result<bool> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return Ok(true);
        }
        self.flush_queued()
    }

    #[cold]
    #[inline(never)]
    fn flush_queued(&self) -> Result<bool> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let g = &mut *g;
        let mut moved = false;
        while let Some(m) = g.queue.front() {
            let fds: Vec<BorrowedFd<'_>> = m.fd.iter().map(|f| f.as_fd()).collect();
            if !sys::send_with_fds(g.sock.as_fd(), &m.bytes, &fds)? {
                break;
            }
            g.queue.pop_front();
            self.queued.fetch_sub(1, Ordering::Release);
            g.sent += 1;
            moved = true;
        }
        if moved {
            // The count moves after the bytes are in the peer's socket queue, so a peer
            // that sees it (or a later ring record) finds the messages there.
            g.chan.announced(g.side).store(g.sent, Ordering::Release);
            fence(Ordering::SeqCst);
            if g.chan.sleeping(1 - g.side).load(Ordering::Relaxed) != 0 {
                sys::eventfd_signal(g.peer_efd.as_fd());
            }
        }
        Ok(g.queue.is_empty())
    }
}

fn announcement(r: &Region, flags: u32) -> [u8; ANN_LEN] {
    let mut b = [0u8; ANN_LEN];
    b[0..4].copy_from_slice(&ANN_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&r.id().to_le_bytes());
    b[8..16].copy_from_slice(&(r.len() as u64).to_le_bytes());
    b[16..24].copy_from_slice(&r.inner.key.to_le_bytes());
    b[24..28].copy_from_slice(&r.access().bits().to_le_bytes());
    b[28..32].copy_from_slice(&flags.to_le_bytes());
    b[32..36].copy_from_slice(&r.generation().to_le_bytes());
    b
}

fn revocation(id: u32, gen: u32) -> [u8; ANN_LEN] {
    let mut b = [0u8; ANN_LEN];
    b[0..4].copy_from_slice(&ANN_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&id.to_le_bytes());
    b[28..32].copy_from_slice(&ANN_REVOKE.to_le_bytes());
    b[32..36].copy_from_slice(&gen.to_le_bytes());
    b
}

/// Idle polls between two checks of the peer's socket.
pub const CHECK_EVERY: u32 = 1024;

const MAGIC: u64 = 0x4642_5348_4d43_4831; // "FBSHMCH1"
/// Channel version: 2 added the tag to message records and the write-imm record.
const VERSION: u32 = 2;
const HELLO_LEN: usize = 24;
const ANN_MAGIC: u32 = 0x4e4e_4146; // "FANN"
const ANN_LEN: usize = 40;
const MAX_REMOTE_REGIONS: usize = 65_536;
const CHAN_HDR: usize = 4096;
const OFF_SLEEP: [usize; 2] = [1024, 1152];
/// Rendezvous messages side `i` has finished reading out of the other side's memory.
const OFF_RNDV_DONE: [usize; 2] = [1280, 1408];
/// Region announcements side `i` has sent over the Unix socket (the control path: the
/// peer takes them whenever this count moves, independently of the message rings).
const OFF_ANNOUNCED: [usize; 2] = [1536, 1664];
const MAX_RING: usize = 1 << 30;

const K_FIRST: u8 = 1;
const K_CONT: u8 = 2;
// 3 was a region announcement carried in the ring; announcements now have their own
// path (the Unix socket, counted in the channel header) and 3 is refused.
/// A rendezvous message: payload = region id `u32`, offset `u64`, length `u64` in the
/// sender's announced region, tag `u64`; `aux` = total length.
const K_RNDV: u8 = 4;
const RNDV_LEN: usize = 28;
/// A write-with-immediate notification: payload = the immediate `u32`; `aux` = bytes
/// written (the bytes are in the target's mapping before this record is published).
const K_IMM: u8 = 5;
/// Bytes of the tag at the start of a [`K_FIRST`] record's payload.
const TAG_LEN: usize = 8;
/// Announcement flag: the region may be read by the peer for rendezvous sends.
const ANN_RNDV: u32 = 1;
/// Announcement flag: the region `(id, gen)` is gone (no descriptor, no other fields).
const ANN_REVOKE: u32 = 2;

fn probe() -> Result<()> {
    let fd = sys::memfd("fabric-probe", 4096).map_err(|e| Error::Unavailable {
        transport: TransportKind::Shm,
        reason: format!("memfd_create does not work here ({e}); Linux >= 3.17 is needed"),
    })?;
    sys::seal_size(fd.as_fd()).map_err(|e| Error::Unavailable {
        transport: TransportKind::Shm,
        reason: format!("memfd seals unsupported: {e}"),
    })
}

/// A Unix-socket listener in the abstract namespace.
#[derive(Debug)]
pub struct ShmListener {
    queue: AcceptQueue<UnixListener, Offer>,
    address: String,
    domain: Domain,
}

/// The listener's half of the handshake: the peer passed the uid check and was sent the
/// channel and this side's eventfd with the hello; its answer (its eventfd) is awaited.
#[derive(Debug)]
struct Offer {
    stream: UnixStream,
    chan: Arc<Channel>,
    efd: OwnedFd,
    peer_efd: Option<OwnedFd>,
}

/// The channel during the handshake: its memfd (passed to the connector in the hello) and
/// the mapping. A finished connection keeps only the mapping ([`ChannelMap`]): nothing
/// sends the memfd again, so it is closed.
#[derive(Debug)]
struct Channel {
    map: MmapRaw,
    _fd: OwnedFd,
    cap: usize,
}

/// The channel mapping: two ring headers, two sleeping flags, two data areas.
#[derive(Debug)]
struct ChannelMap {
    map: MmapRaw,
    cap: usize,
}

impl Channel {
    fn size(cap: usize) -> usize {
        CHAN_HDR + 2 * cap
    }
    fn create(cap: usize) -> Result<Self> {
        let fd = sys::memfd("fabric-shm-channel", Self::size(cap))?;
        sys::seal_size(fd.as_fd())?;
        let map = sys::map_shared(fd.as_fd(), Self::size(cap))?;
        Ok(Channel { map, _fd: fd, cap })
    }

    /// The mapping alone (the memfd is closed; the mapping stays).
    fn into_map(self) -> ChannelMap {
        let Channel { map, _fd, cap } = self;
        ChannelMap { map, cap }
    }
}

impl ChannelMap {
    fn sleeping(&self, side: usize) -> &AtomicU32 {
        // SAFETY: OFF_SLEEP[side] + 4 <= CHAN_HDR <= mapping length; aligned; the mapping
        // lives as long as `self`; the word is only accessed atomically.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(OFF_SLEEP[side]) as *mut u32) }
    }
    fn rndv_done(&self, side: usize) -> &AtomicU64 {
        // SAFETY: OFF_RNDV_DONE[side] + 8 <= CHAN_HDR; 8-aligned; lives with `self`; only
        // accessed atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(OFF_RNDV_DONE[side]) as *mut u64) }
    }
    fn announced(&self, side: usize) -> &AtomicU64 {
        // SAFETY: OFF_ANNOUNCED[side] + 8 <= CHAN_HDR; 8-aligned; lives with `self`; only
        // accessed atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(OFF_ANNOUNCED[side]) as *mut u64) }
    }
    /// (producer of ring `side -> other`, consumer of ring `other -> side`).
    fn ends(self: &Arc<Self>, side: usize) -> (Producer, Consumer) {
        let base = self.map.as_mut_ptr();
        let ring_ptrs = |r: usize| {
            // SAFETY: ring header r at r * 256 (< 1024), data area r at CHAN_HDR + r * cap,
            // both inside the mapping (size CHAN_HDR + 2 * cap).
            unsafe {
                (
                    base.add(r * 256) as *const RingHeader,
                    base.add(CHAN_HDR + r * self.cap),
                )
            }
        };
        let keep: Arc<dyn Send + Sync> = self.clone();
        let (th, td) = ring_ptrs(side);
        let (rh, rd) = ring_ptrs(1 - side);
        // SAFETY: headers are 256-byte aligned inside a page-aligned shared mapping whose
        // bytes start zeroed (a valid empty header); `cap` is a power of two >= 4 granules;
        // side 0 produces on ring 0 and consumes ring 1, side 1 the reverse, so each ring
        // has exactly one producer and one consumer.
        let (p, _) = unsafe { ring::from_raw(th, td, self.cap, keep.clone()) };
        // SAFETY: as above.
        let (_, c) = unsafe { ring::from_raw(rh, rd, self.cap, keep) };
        (p, c)
    }
}

fn check_peer(stream: &UnixStream) -> Result<()> {
    let peer = sys::peer_uid(stream.as_fd())?;
    let ours = sys::uid();
    if peer != ours {
        return Err(Error::PeerUid { peer, ours });
    }
    Ok(())
}

fn hello_bytes(cap: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[16..24].copy_from_slice(&(cap as u64).to_le_bytes());
    b
}

/// Decodes the channel hello (and the connector's answer): magic, version, ring bytes.
///
/// # Errors
/// A [`DecodeError`](crate::DecodeError) for a wrong length, magic, version or ring size.
pub fn decode_hello(b: &[u8]) -> std::result::Result<usize, crate::DecodeError> {
    use crate::DecodeError as D;
    if b.len() != HELLO_LEN {
        return Err(D::Truncated {
            what: "shm hello",
            need: HELLO_LEN,
            got: b.len(),
        });
    }
    let magic = u64::from_le_bytes(b[0..8].try_into().unwrap_or_default());
    if magic != MAGIC {
        return Err(D::BadMagic {
            what: "shm hello",
            found: magic,
        });
    }
    let v = u32::from_le_bytes(b[8..12].try_into().unwrap_or_default());
    if v != VERSION {
        return Err(D::Version {
            what: "shm hello",
            found: v,
            expected: VERSION,
        });
    }
    let cap = u64::from_le_bytes(b[16..24].try_into().unwrap_or_default());
    if cap != 0 && (!cap.is_power_of_two() || cap < 4096 || cap > MAX_RING as u64) {
        return Err(D::Invalid {
            what: "shm ring size",
            value: cap,
        });
    }
    Ok(cap as usize)
}

impl ShmListener {
    /// Binds a fresh abstract-namespace address.
    ///
    /// # Errors
    /// [`Error::Io`] when the socket cannot be bound.
    pub fn bind(domain: &Domain) -> Result<Self> {
        let (sock, name) = accept::bind_abstract("shm")?;
        Ok(ShmListener {
            queue: AcceptQueue::new(sock, domain.options().handshake_timeout),
            address: format!("shm:@{name}"),
            domain: domain.clone(),
        })
    }
}

impl Handshake<UnixStream> for Offer {
    type Ctx = Domain;
    type Output = Box<dyn Transport>;
    fn start(stream: UnixStream, domain: &Domain) -> Result<Self> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        // A stranger (other uid) is refused before it gets a channel.
        check_peer(&stream)?;
        let ring = domain
            .options()
            .ring_bytes
            .clamp(4096, MAX_RING)
            .next_power_of_two();
        let chan = Arc::new(Channel::create(ring)?);
        let efd = sys::eventfd()?;
        let hello = hello_bytes(chan.cap);
        if !sys::send_with_fds(stream.as_fd(), &hello, &[chan._fd.as_fd(), efd.as_fd()])? {
            return Err(Error::Timeout("shm hello (socket full)"));
        }
        Ok(Offer {
            stream,
            chan,
            efd,
            peer_efd: None,
        })
    }
    fn step(&mut self, _: &Domain) -> Result<bool> {
        let mut b = [0u8; HELLO_LEN];
        let Some((n, mut fds)) = sys::recv_with_fds(self.stream.as_fd(), &mut b)? else {
            return Ok(false);
        };
        if n != HELLO_LEN || fds.len() != 1 {
            return Err(Error::Protocol(format!(
                "shm answer of {n} bytes with {} descriptors",
                fds.len()
            )));
        }
        decode_hello(&b)?;
        self.peer_efd = fds.pop();
        Ok(true)
    }
    fn establish(self, domain: &Domain) -> Result<Box<dyn Transport>> {
        let peer_efd = self
            .peer_efd
            .ok_or_else(|| Error::Protocol("shm hello without its descriptor".into()))?;
        finish(0, self.chan, self.stream, self.efd, peer_efd, domain)
    }
}

impl Listener for ShmListener {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn address(&self) -> &str {
        &self.address
    }
    fn accept(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.queue.accept(&self.domain)
    }
}

/// Connects to a [`ShmListener`] (address without the `shm:` prefix, e.g. `@name`).
#[derive(Debug)]
pub struct ShmConnector {
    conn: Connecting<UnixStream, Answer>,
    domain: Domain,
}

/// The connector's half of the handshake: takes the listener's hello (the channel and its
/// eventfd), checks and maps the channel, and answers with this side's eventfd.
#[derive(Debug)]
struct Answer {
    stream: UnixStream,
    /// The mapped channel, this side's eventfd and the peer's, once answered.
    done: Option<(Arc<Channel>, OwnedFd, OwnedFd)>,
}

impl ShmConnector {
    /// Starts connecting.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a malformed address; [`Error::Io`] when the listener
    /// is not there; [`Error::PeerUid`] when it runs as another user.
    pub fn connect(address: &str, domain: &Domain) -> Result<Self> {
        let stream = accept::connect_abstract(address, "shm")?;
        let timeout = domain.options().handshake_timeout;
        Ok(ShmConnector {
            conn: Connecting::connected(stream, domain, timeout, "shm handshake")?,
            domain: domain.clone(),
        })
    }
}

impl Handshake<UnixStream> for Answer {
    type Ctx = Domain;
    type Output = Box<dyn Transport>;
    fn start(stream: UnixStream, _: &Domain) -> Result<Self> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        check_peer(&stream)?;
        Ok(Answer { stream, done: None })
    }
    fn step(&mut self, _: &Domain) -> Result<bool> {
        let mut b = [0u8; HELLO_LEN];
        let Some((n, mut fds)) = sys::recv_with_fds(self.stream.as_fd(), &mut b)? else {
            return Ok(false);
        };
        if n == 0 {
            return Err(Error::Disconnected(
                "listener closed during the handshake".into(),
            ));
        }
        if n != HELLO_LEN || fds.len() != 2 {
            return Err(Error::Protocol(format!(
                "shm hello of {n} bytes with {} descriptors",
                fds.len()
            )));
        }
        let cap = decode_hello(&b)?;
        if cap == 0 {
            return Err(Error::Protocol("shm hello without a ring size".into()));
        }
        let (Some(peer_efd), Some(chan_fd)) = (fds.pop(), fds.pop()) else {
            return Err(Error::Protocol(
                "shm hello without its two descriptors".into(),
            ));
        };
        let size = sys::check_sealed_size(chan_fd.as_fd())?;
        if size != Channel::size(cap) as u64 {
            return Err(Error::Protocol(format!(
                "shm channel of {size} bytes, expected {}",
                Channel::size(cap)
            )));
        }
        let map = sys::map_shared(chan_fd.as_fd(), Channel::size(cap))?;
        let chan = Arc::new(Channel {
            map,
            _fd: chan_fd,
            cap,
        });
        let efd = sys::eventfd()?;
        if !sys::send_with_fds(self.stream.as_fd(), &hello_bytes(0), &[efd.as_fd()])? {
            return Err(Error::Timeout("shm answer (socket full)"));
        }
        self.done = Some((chan, efd, peer_efd));
        Ok(true)
    }
    fn establish(self, domain: &Domain) -> Result<Box<dyn Transport>> {
        let (chan, efd, peer_efd) = self
            .done
            .ok_or_else(|| Error::Protocol("shm handshake not finished".into()))?;
        finish(1, chan, self.stream, efd, peer_efd, domain)
    }
}

impl Connector for ShmConnector {
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.conn.poll(&self.domain)
    }
}

fn finish(
    side: usize,
    chan: Arc<Channel>,
    sock: UnixStream,
    efd: OwnedFd,
    peer_efd: OwnedFd,
    domain: &Domain,
) -> Result<Box<dyn Transport>> {
    let opts = domain.options();
    // The memfd went out in the hello and is never sent again: keep only the mapping.
    let chan = Arc::new(
        Arc::try_unwrap(chan)
            .map_err(|_| Error::Protocol("shm channel shared before the handshake ended".into()))?
            .into_map(),
    );
    let (tx, rx) = chan.ends(side);
    let chunk = opts
        .chunk_bytes
        .clamp(64, tx.max_payload())
        .min(chan.cap / 4);
    // One fd each, shared with the announcer; the epoll of a lone `wait_fd` is made on first
    // need (a worker watches the eventfd and the socket itself).
    let sock = Arc::new(sock);
    let peer_efd = Arc::new(peer_efd);
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: true,
        atomics: true,
        max_message: opts.max_message.min(u32::MAX as usize),
        max_in_flight: opts.max_in_flight,
        inline_size: chunk,
        memory_kinds: MemoryKinds::HOST,
        tagged: true,
        max_group: super::MAX_GROUP,
        write_imm: true,
        unexpected_messages: opts.unexpected_messages,
        unexpected_bytes: opts.unexpected_bytes,
        too_long_kills_connection: false,
        remote_error_kills_connection: false,
        remote_window: true,
    };
    let announcer = Arc::new(Announcer {
        queued: AtomicU64::new(0),
        inner: Mutex::new(AnnouncerInner {
            sock: sock.clone(),
            chan: chan.clone(),
            side,
            peer_efd: peer_efd.clone(),
            sent: 0,
            queue: std::collections::VecDeque::new(),
        }),
    });
    let shm_domain = domain
        .backend()
        .as_any()
        .downcast_ref::<ShmDomain>()
        .ok_or_else(|| Error::InvalidArgument("an shm connection needs an shm domain".into()))?;
    shm_domain.attach(&announcer);
    let hal = ShmHal {
        side,
        announcer,
        ann_buf: [0; ANN_LEN],
        ann_got: 0,
        ann_fds: Vec::new(),
        chan,
        tx,
        rx,
        chunk,
        sock,
        efd,
        peer_efd,
        lone: OnceLock::new(),
        attached: false,
        remote: Vec::new(),
        rndv: opts.rndv_bytes,
        rndv_out: std::collections::VecDeque::with_capacity(opts.max_in_flight),
        rndv_seen: 0,
        rndv_done: 0,
        ann_taken: 0,
        rx_state: RxState::Idle,
        idle: 0,
        armed: false,
    };
    Ok(Box::new(Endpoint::in_domain(
        domain.clone(),
        Tracker::new(domain.id(), TransportKind::Shm, caps),
        hal,
    )))
}

#[derive(Debug)]
enum RxState {
    Idle,
    Receiving {
        at: RecvRef,
        tag: u64,
        total: usize,
        got: usize,
    },
    /// Copying an unexpected message into the tracker's queue
    /// ([`Tracker::stash_tail`]).
    Stashing {
        total: usize,
        got: usize,
    },
    Discarding {
        left: usize,
    },
}

#[derive(Debug)]
struct RemoteRegion {
    gen: u32,
    rndv: bool,
    key: u64,
    access: Access,
    len: usize,
    /// The peer's region, mapped (its memfd is closed once mapped: the mapping stays, for
    /// as long as this entry or a [`RemoteWindow`](crate::RemoteWindow) over it lives).
    map: Arc<Mapping>,
}

/// The shm backend's byte mover.
#[derive(Debug)]
struct ShmHal {
    side: usize,
    /// Our control path (the domain queues announcements and revocations there).
    announcer: Arc<Announcer>,
    /// A peer's control message read in part (never waited for inside `poll`).
    ann_buf: [u8; ANN_LEN],
    ann_got: usize,
    ann_fds: Vec<OwnedFd>,
    chan: Arc<ChannelMap>,
    tx: Producer,
    rx: Consumer,
    chunk: usize,
    /// Shared with the announcer.
    sock: Arc<UnixStream>,
    efd: OwnedFd,
    /// Shared with the announcer.
    peer_efd: Arc<OwnedFd>,
    /// The epoll of a lone [`wait_fd`](Hal::wait_fd) (the eventfd and the socket), made on
    /// first need; `None` inside when it could not be made (then `arm` fails).
    lone: OnceLock<Option<OwnedFd>>,
    /// A worker holds the connection (it watches [`watch_fds`](Hal::watch_fds) itself).
    attached: bool,
    remote: Vec<Option<RemoteRegion>>,
    /// Rendezvous threshold (0 = off).
    rndv: usize,
    /// Our rendezvous sends the peer has not finished reading, oldest first.
    rndv_out: std::collections::VecDeque<Token>,
    /// How many of our rendezvous sends the peer reported finished.
    rndv_seen: u64,
    /// How many of the peer's rendezvous messages we finished.
    rndv_done: u64,
    /// The peer's announcements we have taken off the socket.
    ann_taken: u64,
    rx_state: RxState,
    idle: u32,
    armed: bool,
}

enum Step {
    Done,
    /// The ring is full; `true` if some of the operation was copied first.
    Blocked(bool),
}

impl ShmHal {
    /// The epoll a lone `wait_fd` sleeps on: the eventfd (the peer's signal) and the socket
    /// (announcements, hang-up). Made on the first call.
    #[inline]
    fn lone(&self) -> Option<BorrowedFd<'_>> {
        self.lone
            .get_or_init(|| sys::epoll_of(&[self.efd.as_fd(), self.sock.as_fd()]).ok())
            .as_ref()
            .map(|ep| ep.as_fd())
    }

    /// Leaves the sleeping state `arm` entered (nothing to do on the hot path).
    #[inline]
    fn unarm(&mut self) {
        if self.armed {
            self.armed = false;
            self.chan.sleeping(self.side).store(0, Ordering::Relaxed);
            sys::eventfd_drain(self.efd.as_fd());
            self.idle = CHECK_EVERY - 1;
        }
    }

    /// Runs queued submissions in order until one blocks; whether any byte moved.
    #[inline]
    fn submit_all(&mut self, t: &mut Tracker) -> Result<bool> {
        if !t.has_submissions() {
            return Ok(false);
        }
        self.submit_queued(t)
    }

    #[inline(never)]
    fn submit_queued(&mut self, t: &mut Tracker) -> Result<bool> {
        let mut moved = false;
        while let Some(tok) = t.submit_front() {
            match self.submit_one(t, tok)? {
                Step::Done => moved = true,
                Step::Blocked(progressed) => {
                    moved |= progressed;
                    break;
                }
            }
        }
        Ok(moved)
    }

    /// Completes our rendezvous sends the peer counted finished; whether any did.
    #[inline(never)]
    fn rndv_finished(&mut self, t: &mut Tracker) -> Result<bool> {
        let done = self.chan.rndv_done(1 - self.side).load(Ordering::Acquire);
        if done < self.rndv_seen || done - self.rndv_seen > self.rndv_out.len() as u64 {
            return Err(Error::Protocol("rendezvous counter out of range".into()));
        }
        let mut moved = false;
        while self.rndv_seen < done {
            self.rndv_seen += 1;
            let Some(tok) = self.rndv_out.pop_front() else {
                return Err(Error::Protocol("rendezvous counter out of range".into()));
            };
            let n = t.get(tok).map_or(0, |p| p.buf.len());
            t.complete(tok, Status::Success, n, 0);
            moved = true;
        }
        Ok(moved)
    }

    /// The control socket failed: a peer that hung up fails the connection's operations
    /// (after what it published is delivered); anything else is the caller's error.
    #[cold]
    #[inline(never)]
    fn control_failed(&mut self, t: &mut Tracker, e: Error) -> Result<()> {
        if sys::peer_hung_up(self.sock.as_fd()) {
            let mut none = 0;
            while self.receive(t, &mut Sink::new(&mut [], &mut none))? {}
            t.fail_all(Status::PeerGone, "shm peer hung up");
            return Ok(());
        }
        Err(e)
    }

    /// Every `CHECK_EVERY` idle passes: whether the peer is gone (one `poll(2)`).
    #[cold]
    #[inline(never)]
    fn check_peer_alive(&mut self, t: &mut Tracker) -> Result<()> {
        if sys::peer_hung_up(self.sock.as_fd()) {
            // Whatever the peer published before dying is still delivered.
            let mut none = 0;
            while self.receive(t, &mut Sink::new(&mut [], &mut none))? {}
            t.fail_all(Status::PeerGone, "shm peer hung up");
        }
        Ok(())
    }

    fn notify_peer(&self) {
        fence(Ordering::SeqCst);
        if self.chan.sleeping(1 - self.side).load(Ordering::Relaxed) != 0 {
            sys::eventfd_signal(self.peer_efd.as_fd());
        }
    }

    /// Whether a send of `buf` goes by rendezvous: long enough, out of fabric-core memory
    /// (a region the peer can map) registered at the threshold or above.
    #[inline]
    fn by_rendezvous(&self, buf: &Buf) -> bool {
        self.rndv > 0
            && buf.len() >= self.rndv
            && buf.region().inner.fd.is_some()
            && buf.region().len() >= self.rndv
    }

    /// Reserves, fills and commits one eager record of `n` bytes from `src`: a message's
    /// first (`first` = its tag and total length; the tag leads the payload) or a
    /// continuation. `false` when the ring has no room now.
    ///
    /// # Safety
    /// `src` is valid for `n` bytes of reads, and `n` plus the tag fits a record.
    #[inline]
    unsafe fn push_eager(&mut self, first: Option<(u64, usize)>, src: *const u8, n: usize) -> bool {
        let (kind, aux, head) = match first {
            Some((_, total)) => (K_FIRST, total as u64, TAG_LEN),
            None => (K_CONT, 0, 0),
        };
        let Some(dst) = self.tx.reserve(kind, aux, head + n) else {
            return false;
        };
        // SAFETY: `dst` has `head + n` writable bytes owned by us until commit; `src` has `n`
        // readable bytes (the caller's contract).
        unsafe {
            if let Some((tag, _)) = first {
                std::ptr::copy_nonoverlapping(tag.to_le_bytes().as_ptr(), dst, TAG_LEN);
            }
            std::ptr::copy_nonoverlapping(src, dst.add(head), n);
        }
        self.tx.commit();
        true
    }

    /// Runs the front submission as far as possible.
    fn submit_one(&mut self, t: &mut Tracker, token: Token) -> Result<Step> {
        let p = t.live(token, "shm submission")?;
        // (Matched in place: only the fields an arm uses are copied, not the descriptor.)
        match p.desc {
            OpDesc::Send if self.by_rendezvous(&p.buf) => {
                // The region's announcement must be on the socket before this record.
                if !self.announcer.flush()? {
                    return Ok(Step::Blocked(false));
                }
                // Rendezvous: the region is announced (registered >= threshold); the peer
                // copies straight out of it and counts it done in the channel header.
                let mut rec = [0u8; RNDV_LEN];
                rec[0..4].copy_from_slice(&p.buf.region().id().to_le_bytes());
                rec[4..12].copy_from_slice(&(p.buf.offset() as u64).to_le_bytes());
                rec[12..20].copy_from_slice(&(p.buf.len() as u64).to_le_bytes());
                rec[20..28].copy_from_slice(&p.tag.to_le_bytes());
                if !self.tx.push(K_RNDV, p.buf.len() as u64, &rec) {
                    return Ok(Step::Blocked(false));
                }
                t.submit_pop();
                self.rndv_out.push_back(token);
                Ok(Step::Done)
            }
            OpDesc::Send => {
                let total = p.buf.len();
                let mut done = p.progress;
                let started = done;
                let src = p.buf.as_ptr();
                let tag = p.tag;
                // The first record starts with the tag (no record has been pushed while
                // `progress` is 0: a message of 0 bytes still sends its first record).
                let mut first = done == 0;
                loop {
                    let head = if first { TAG_LEN } else { 0 };
                    let n = (total - done).min(self.chunk - head);
                    // SAFETY: `src` is the buffer's mapping (len `total`), done + n <= total.
                    let pushed =
                        unsafe { self.push_eager(first.then_some((tag, total)), src.add(done), n) };
                    if !pushed {
                        t.live_mut(token, "shm send")?.progress = done;
                        return Ok(Step::Blocked(done > started));
                    }
                    first = false;
                    done += n;
                    if done == total {
                        t.submit_pop();
                        t.complete(token, Status::Success, total, 0);
                        return Ok(Step::Done);
                    }
                }
            }
            OpDesc::Write { key, off } | OpDesc::Read { key, off } => {
                let write = matches!(p.desc, OpDesc::Write { .. });
                let need = if write {
                    Access::REMOTE_WRITE
                } else {
                    Access::REMOTE_READ
                };
                let len = p.buf.len();
                let local = p.buf.as_ptr();
                let imm = if write { p.imm } else { None };
                if imm.is_some() && !self.tx.has_room(4) {
                    // The notification must follow the bytes: wait for room first.
                    return Ok(Step::Blocked(false));
                }
                let status = match self.remote_ptr(&key, off, len as u64, need)? {
                    Some(rp) => {
                        // SAFETY: `rp` has `len` bytes inside the peer's mapping (checked
                        // against its real length); `local` has `len` bytes of our region.
                        // Distinct mappings, so no overlap within this process's view.
                        unsafe {
                            if write {
                                std::ptr::copy_nonoverlapping(local, rp, len);
                            } else {
                                copy::copy(rp, local, len, p.buf.region().streams(len));
                            }
                        }
                        Status::Success
                    }
                    None => Status::RemoteAccess,
                };
                if let (Some(imm), Status::Success) = (imm, status) {
                    // Room was checked above and we are the ring's only producer.
                    if !self.tx.push(K_IMM, len as u64, &imm.to_le_bytes()) {
                        return Err(Error::Protocol("shm ring lost room it had".into()));
                    }
                }
                t.submit_pop();
                t.complete(token, status, len, 0);
                Ok(Step::Done)
            }
            OpDesc::Atomic { key, off, op } => {
                let (status, old) = match self.remote_ptr(&key, off, 8, Access::REMOTE_ATOMIC)? {
                    Some(rp) => {
                        // SAFETY: 8 in-bounds bytes of the peer's page-aligned mapping at an
                        // 8-aligned offset (checked by the tracker); shared atomics are only
                        // accessed atomically by both sides.
                        let a = unsafe { AtomicU64::from_ptr(rp as *mut u64) };
                        let old = match op {
                            AtomicOp::CompareSwap { expect, new } => {
                                match a.compare_exchange(
                                    expect,
                                    new,
                                    Ordering::SeqCst,
                                    Ordering::SeqCst,
                                ) {
                                    Ok(v) | Err(v) => v,
                                }
                            }
                            AtomicOp::FetchAdd { add } => a.fetch_add(add, Ordering::SeqCst),
                        };
                        let p = t.live(token, "shm atomic")?;
                        let _ = p.buf.copy_from(&old.to_ne_bytes());
                        (Status::Success, old)
                    }
                    None => (Status::RemoteAccess, 0),
                };
                t.submit_pop();
                t.complete(token, status, 8, old);
                Ok(Step::Done)
            }
            OpDesc::Recv => unreachable!("receives are not submissions"),
        }
    }

    /// The address of `[off, off+len)` in the peer's region named by `key`, or `None` when
    /// the peer never announced it, the key is stale or the range / access is not granted.
    fn remote_ptr(
        &mut self,
        key: &crate::RemoteKey,
        off: u64,
        len: u64,
        need: Access,
    ) -> Result<Option<*mut u8>> {
        let idx = key.region as usize;
        if self.remote.get(idx).and_then(|r| r.as_ref()).is_none() {
            // An announcement may have just arrived; look once more.
            self.take_announcements()?;
        }
        let Some(r) = self.remote.get(idx).and_then(|r| r.as_ref()) else {
            return Ok(None);
        };
        if r.gen != key.gen
            || r.key != key.key
            || !r.access.contains(need)
            || check_range(off, len, r.len as u64).is_err()
        {
            return Ok(None);
        }
        // SAFETY: off + len <= r.len <= mapping length.
        Ok(Some(unsafe { r.map.base().add(off as usize) }))
    }

    /// Takes the peer's region announcements off the Unix socket (the control path),
    /// independently of the message rings: one atomic load when there are none. A count
    /// that runs ahead of the socket is "not yet" (the peer bumps it after sending).
    #[inline]
    fn take_announcements(&mut self) -> Result<()> {
        let sent = self.chan.announced(1 - self.side).load(Ordering::Acquire);
        if self.ann_taken < sent {
            self.take_announcements_up_to(sent)?;
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn take_announcements_up_to(&mut self, sent: u64) -> Result<()> {
        while self.ann_taken < sent {
            if !self.take_announcement()? {
                break;
            }
            self.ann_taken += 1;
        }
        Ok(())
    }

    /// One control message from the socket; `Ok(false)` when none has arrived in full
    /// (a part read is kept for the next call: `poll` never waits for the rest).
    fn take_announcement(&mut self) -> Result<bool> {
        while self.ann_got < ANN_LEN {
            match sys::recv_with_fds(self.sock.as_fd(), &mut self.ann_buf[self.ann_got..])? {
                Some((0, _)) => return Err(Error::Disconnected("peer hung up".into())),
                Some((n, f)) => {
                    self.ann_got += n;
                    self.ann_fds.extend(f);
                    if self.ann_fds.len() > 1 {
                        return Err(Error::Protocol(
                            "announcement with more than one descriptor".into(),
                        ));
                    }
                }
                None => return Ok(false),
            }
        }
        self.ann_got = 0;
        let mut fds = std::mem::take(&mut self.ann_fds);
        let (rid, len, key, access, flags, gen) = decode_announcement(&self.ann_buf)?;
        let idx = rid as usize;
        if idx >= MAX_REMOTE_REGIONS {
            return Err(Error::Protocol(format!(
                "announced region id {rid} over the limit of {MAX_REMOTE_REGIONS} live regions"
            )));
        }
        if flags & ANN_REVOKE != 0 {
            if !fds.is_empty() {
                return Err(Error::Protocol("revocation with a descriptor".into()));
            }
            return match self.remote.get_mut(idx) {
                Some(slot @ Some(_)) if slot.as_ref().is_some_and(|r| r.gen == gen) => {
                    // Unmapped now (unless a window holds the mapping): a later operation
                    // with the old key is refused.
                    if let Some(r) = slot.take() {
                        r.map.revoke();
                    }
                    Ok(true)
                }
                _ => Err(Error::Protocol(
                    "revocation of a region that is not announced".into(),
                )),
            };
        }
        let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
            return Err(Error::Protocol(
                "announcement without its descriptor".into(),
            ));
        };
        let size = sys::check_sealed_size(fd.as_fd())?;
        if size < len {
            return Err(Error::Protocol(
                "announced region larger than its memory".into(),
            ));
        }
        let raw = sys::map_shared(fd.as_fd(), (len as usize).max(1))?;
        drop(fd);
        let base = raw.as_mut_ptr();
        // SAFETY: `raw` maps at least `len` bytes (page-aligned) of a memfd whose size is
        // sealed at `size >= len` (checked above), so the pages stay for as long as the
        // mapping, which the `Mapping` owns.
        let map = Arc::new(unsafe { Mapping::new(base, len as usize, Box::new(raw)) });
        if self.remote.len() <= idx {
            self.remote.resize_with(idx + 1, || None);
        }
        self.remote[idx] = Some(RemoteRegion {
            gen,
            rndv: flags & ANN_RNDV != 0,
            key,
            access,
            len: len as usize,
            map,
        });
        Ok(true)
    }

    /// Takes incoming records (at most 64 per call); whether any was taken. One load
    /// of the header word at the ring's head when it is empty: the rest is out of line.
    #[inline]
    fn receive(&mut self, t: &mut Tracker, sink: &mut Sink<'_>) -> Result<bool> {
        if self.rx.is_empty() {
            return Ok(false);
        }
        self.receive_records(t, sink)
    }

    #[inline(never)]
    fn receive_records(&mut self, t: &mut Tracker, sink: &mut Sink<'_>) -> Result<bool> {
        let mut any = false;
        for _ in 0..64 {
            let Some(rec) = self.rx.peek().map_err(|e| Error::Protocol(e.to_string()))? else {
                break;
            };
            match (rec.kind, &mut self.rx_state) {
                (K_FIRST, RxState::Idle) => {
                    let total = rec.aux as usize;
                    if rec.len < TAG_LEN || rec.len - TAG_LEN > total {
                        return Err(Error::Protocol(
                            "first record shorter than its tag or longer than its message".into(),
                        ));
                    }
                    let n = rec.len - TAG_LEN;
                    let mut tb = [0u8; TAG_LEN];
                    // SAFETY: the payload has rec.len >= TAG_LEN bytes (validated by `peek`).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.rx.payload_ptr(&rec),
                            tb.as_mut_ptr(),
                            TAG_LEN,
                        )
                    };
                    let tag = u64::from_le_bytes(tb);
                    // SAFETY: as above; the data follows the tag.
                    let src = unsafe { self.rx.payload_ptr(&rec).add(TAG_LEN) };
                    match t.match_message(tag) {
                        Some(at) => {
                            let Some(buf) = t.recv_buf(at) else {
                                return Err(Error::Protocol("matched a finished receive".into()));
                            };
                            if total > buf.len() {
                                t.complete_recv(at, Status::MessageTooLong, total, tag, None);
                                if total > n {
                                    self.rx_state = RxState::Discarding { left: total - n };
                                }
                            } else {
                                let streams = buf.region().streams(total);
                                // SAFETY: n <= total <= buf.len(); `src` has n bytes.
                                unsafe { copy::copy(src, buf.as_ptr(), n, streams) };
                                if n == total {
                                    t.complete_recv_into(
                                        at,
                                        Status::Success,
                                        total,
                                        tag,
                                        None,
                                        sink,
                                    );
                                } else {
                                    self.rx_state = RxState::Receiving {
                                        at,
                                        tag,
                                        total,
                                        got: n,
                                    };
                                }
                            }
                        }
                        // No receive at all: leave it in the ring (backpressure).
                        None if !t.has_posted_recv() => break,
                        None => {
                            // Receives wait for other tags: queue it so they can go on.
                            let Some(dst) = t.stash_begin(tag, None, total, total) else {
                                break; // the unexpected queue is full: wait in the ring
                            };
                            // SAFETY: `dst` has `total >= n` bytes; `src` has n bytes.
                            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
                            if n == total {
                                t.stash_end();
                            } else {
                                self.rx_state = RxState::Stashing { total, got: n };
                            }
                        }
                    }
                }
                (
                    K_CONT,
                    RxState::Receiving {
                        at,
                        tag,
                        total,
                        got,
                    },
                ) => {
                    if *got + rec.len > *total {
                        return Err(Error::Protocol("message longer than announced".into()));
                    }
                    let Some(buf) = t.recv_buf(*at) else {
                        return Err(Error::Protocol("receive finished while filling".into()));
                    };
                    let streams = buf.region().streams(*total);
                    // SAFETY: got + len <= total <= buf.len().
                    self.rx
                        .read_into_raw(&rec, unsafe { buf.as_ptr().add(*got) }, streams);
                    *got += rec.len;
                    if *got == *total {
                        let (at, tag, total) = (*at, *tag, *total);
                        t.complete_recv_into(at, Status::Success, total, tag, None, sink);
                        self.rx_state = RxState::Idle;
                    }
                }
                (K_CONT, RxState::Stashing { total, got }) => {
                    if *got + rec.len > *total {
                        return Err(Error::Protocol("message longer than announced".into()));
                    }
                    let Some(dst) = t.stash_tail() else {
                        return Err(Error::Protocol("no unexpected message being filled".into()));
                    };
                    // SAFETY: got + len <= total, and `dst` has `total` bytes until
                    // `stash_end`.
                    self.rx.read_into_raw(&rec, unsafe { dst.add(*got) }, false);
                    *got += rec.len;
                    if *got == *total {
                        t.stash_end();
                        self.rx_state = RxState::Idle;
                    }
                }
                (K_CONT, RxState::Discarding { left }) => {
                    if rec.len > *left {
                        return Err(Error::Protocol("message longer than announced".into()));
                    }
                    *left -= rec.len;
                    if *left == 0 {
                        self.rx_state = RxState::Idle;
                    }
                }
                (K_RNDV, RxState::Idle) => {
                    if rec.len != RNDV_LEN {
                        return Err(Error::Protocol(
                            "rendezvous record of the wrong size".into(),
                        ));
                    }
                    let mut b = [0u8; RNDV_LEN];
                    // SAFETY: the payload has RNDV_LEN bytes (checked), validated by `peek`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.rx.payload_ptr(&rec),
                            b.as_mut_ptr(),
                            RNDV_LEN,
                        )
                    };
                    let rid = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default()) as usize;
                    let off = u64::from_le_bytes(b[4..12].try_into().unwrap_or_default());
                    let len = u64::from_le_bytes(b[12..20].try_into().unwrap_or_default());
                    let tag = u64::from_le_bytes(b[20..28].try_into().unwrap_or_default());
                    if self.remote.get(rid).and_then(|r| r.as_ref()).is_none() {
                        // Announced before this record was pushed: on the socket by now.
                        self.take_announcements()?;
                    }
                    let src = match self.remote.get(rid).and_then(|r| r.as_ref()) {
                        Some(r)
                            if r.rndv
                                && len == rec.aux
                                && check_range(off, len, r.len as u64).is_ok() =>
                        {
                            // SAFETY: off + len <= r.len <= the mapping's length.
                            unsafe { r.map.base().add(off as usize) }
                        }
                        _ => {
                            return Err(Error::Protocol(
                                "rendezvous from an unannounced range".into(),
                            ))
                        }
                    };
                    let len = len as usize;
                    match t.match_message(tag) {
                        Some(at) => {
                            let Some(buf) = t.recv_buf(at) else {
                                return Err(Error::Protocol("matched a finished receive".into()));
                            };
                            if len > buf.len() {
                                t.complete_recv(at, Status::MessageTooLong, len, tag, None);
                            } else {
                                let streams = buf.region().streams(len);
                                // SAFETY: `src` has `len` bytes of the peer's region, which
                                // the peer does not reuse until we count this message done;
                                // the receive buffer has at least `len` bytes.
                                unsafe { copy::copy(src, buf.as_ptr(), len, streams) };
                                t.complete_recv_into(at, Status::Success, len, tag, None, sink);
                            }
                        }
                        None if !t.has_posted_recv() => break,
                        None => {
                            // Copied out now: the peer's counter of finished rendezvous
                            // messages moves in arrival order.
                            let Some(dst) = t.stash_begin(tag, None, len, len) else {
                                break;
                            };
                            // SAFETY: `dst` has `len` bytes; `src` as above.
                            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                            t.stash_end();
                        }
                    }
                    self.rndv_done += 1;
                    self.chan
                        .rndv_done(self.side)
                        .store(self.rndv_done, Ordering::Release);
                }
                (K_IMM, RxState::Idle) => {
                    if rec.len != 4 {
                        return Err(Error::Protocol("write-imm record of the wrong size".into()));
                    }
                    let mut b = [0u8; 4];
                    self.rx.read(&rec, &mut b);
                    let imm = u32::from_le_bytes(b);
                    let len = rec.aux as usize;
                    match t.match_message(0) {
                        Some(at) => {
                            t.complete_recv(at, Status::Success, len, 0, Some(imm));
                        }
                        None if !t.has_posted_recv() => break,
                        None => {
                            if t.stash_begin(0, Some(imm), len, 0).is_none() {
                                break;
                            }
                            t.stash_end();
                        }
                    }
                }
                (kind, _) => {
                    return Err(Error::Protocol(format!(
                        "unexpected record kind {kind} in state {:?}",
                        self.rx_state
                    )))
                }
            }
            self.rx.consume(&rec);
            any = true;
        }
        Ok(any)
    }
}

/// Decodes a control message: `(region id, len, key, access, flags, generation)`; with
/// the revocation flag only the id and generation count (the rest must be zero).
///
/// # Errors
/// A [`DecodeError`](crate::DecodeError) for a wrong length, magic or access bits.
pub fn decode_announcement(
    b: &[u8],
) -> std::result::Result<(u32, u64, u64, Access, u32, u32), crate::DecodeError> {
    use crate::DecodeError as D;
    if b.len() != ANN_LEN {
        return Err(D::Truncated {
            what: "shm announcement",
            need: ANN_LEN,
            got: b.len(),
        });
    }
    let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
    if magic != ANN_MAGIC {
        return Err(D::BadMagic {
            what: "shm announcement",
            found: magic as u64,
        });
    }
    let id = u32::from_le_bytes(b[4..8].try_into().unwrap_or_default());
    let len = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
    let key = u64::from_le_bytes(b[16..24].try_into().unwrap_or_default());
    let bits = u32::from_le_bytes(b[24..28].try_into().unwrap_or_default());
    let access = Access::from_bits(bits).ok_or(D::Invalid {
        what: "shm announcement access",
        value: bits as u64,
    })?;
    if len > isize::MAX as u64 {
        return Err(D::TooLong {
            what: "shm announced region",
            len,
            max: isize::MAX as u64,
        });
    }
    let flags = u32::from_le_bytes(b[28..32].try_into().unwrap_or_default());
    if flags & !(ANN_RNDV | ANN_REVOKE) != 0 || flags == ANN_RNDV | ANN_REVOKE {
        return Err(D::Invalid {
            what: "shm announcement flags",
            value: flags as u64,
        });
    }
    let gen = u32::from_le_bytes(b[32..36].try_into().unwrap_or_default());
    let reserved = u32::from_le_bytes(b[36..40].try_into().unwrap_or_default());
    if reserved != 0 {
        return Err(D::Invalid {
            what: "shm announcement reserved bytes",
            value: reserved as u64,
        });
    }
    if flags & ANN_REVOKE != 0 && (len != 0 || key != 0 || bits != 0) {
        return Err(D::Invalid {
            what: "shm revocation with region fields",
            value: len | key | bits as u64,
        });
    }
    Ok((id, len, key, access, flags, gen))
}

impl Consumer {
    fn read_into_raw(&self, rec: &ring::Record, dst: *mut u8, streaming: bool) {
        // SAFETY: callers pass a destination with at least `rec.len` writable bytes of a
        // registered region; the record's payload was validated by `peek`.
        unsafe { copy::copy(self.payload_ptr(rec), dst, rec.len, streaming) };
    }
}

impl Hal for ShmHal {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn progress(&mut self, t: &mut Tracker) -> Result<()> {
        let mut none = 0;
        self.progress_into(t, &mut [], &mut none)
    }

    /// A full pass; receives that complete go straight into the caller's `out[*n..]`
    /// ([`Tracker::complete_recv_into`]).
    fn progress_into(
        &mut self,
        t: &mut Tracker,
        out: &mut [crate::Completion],
        n: &mut usize,
    ) -> Result<()> {
        let mut sink = Sink::new(out, n);
        self.unarm();
        if let Err(e) = self.announcer.flush() {
            return self.control_failed(t, e);
        }
        self.take_announcements()?;
        let mut moved = self.submit_all(t)?;
        if self.receive(t, &mut sink)? {
            moved = true;
        }
        if !self.rndv_out.is_empty() && self.rndv_finished(t)? {
            moved = true;
        }
        if moved {
            self.idle = 0;
            self.notify_peer();
        } else {
            self.idle += 1;
            if self.idle >= CHECK_EVERY {
                self.idle = 0;
                self.check_peer_alive(t)?;
            }
        }
        Ok(())
    }

    const SENDS_NOW: bool = true;

    /// A send that fits one eager record goes into the ring at once (the caller checked
    /// that nothing is queued ahead of it); the rest (rendezvous, several records, a full
    /// ring) take the queue.
    #[inline]
    fn send_now(&mut self, buf: &Buf, tag: u64) -> bool {
        let len = buf.len();
        if len > self.chunk - TAG_LEN || self.by_rendezvous(buf) {
            return false;
        }
        self.unarm();
        // SAFETY: the buffer's mapping has `len` readable bytes; `TAG_LEN + len` fits a
        // record (checked above).
        if !unsafe { self.push_eager(Some((tag, len)), buf.as_ptr(), len) } {
            return false;
        }
        self.idle = 0;
        self.notify_peer();
        true
    }

    /// A post only starts what it queued: a send is copied into the ring (or its
    /// rendezvous record pushed) and the peer woken if it sleeps; a receive does nothing
    /// here (a message waiting for it stays in the ring, which `arm` sees). Incoming
    /// records, finished rendezvous sends and announcements wait for the next `poll`.
    fn post_kick(&mut self, t: &mut Tracker, recv: bool) -> Result<()> {
        if recv {
            return Ok(());
        }
        self.unarm();
        if self.submit_all(t)? {
            self.idle = 0;
            self.notify_peer();
        }
        Ok(())
    }

    fn wait_fd(&self) -> BorrowedFd<'_> {
        match self.lone() {
            Some(ep) => ep,
            // No fd left for the epoll: `arm` reports it (the eventfd still wakes).
            None => self.efd.as_fd(),
        }
    }

    fn watch_fds(&self) -> WatchFds<'_> {
        WatchFds::two(self.efd.as_fd(), self.sock.as_fd())
    }

    fn attach_worker(&mut self, worker: Option<u64>) -> Option<u64> {
        self.attached = worker.is_some();
        None
    }

    fn arm(&mut self, t: &Tracker) -> Result<bool> {
        if !self.attached && self.lone().is_none() {
            return Err(Error::io(
                "shm wait fd (epoll_create1)",
                std::io::Error::other("could not be created (file descriptor limit?)"),
            ));
        }
        sys::eventfd_drain(self.efd.as_fd());
        self.chan.sleeping(self.side).store(1, Ordering::Relaxed);
        self.armed = true;
        fence(Ordering::SeqCst);
        let work = !self.rx.is_empty()
            || (t.has_submissions() && self.tx.has_room(self.chunk))
            || sys::peer_hung_up(self.sock.as_fd());
        if work {
            self.armed = false;
            self.chan.sleeping(self.side).store(0, Ordering::Relaxed);
            self.idle = CHECK_EVERY - 1;
        }
        Ok(!work)
    }

    fn map_remote(&mut self, key: &RemoteKey) -> Result<RemoteWindow> {
        let idx = key.region as usize;
        if self.remote.get(idx).and_then(|r| r.as_ref()).is_none() {
            // Its announcement (or revocation) may be on the socket by now.
            self.take_announcements()?;
        }
        let Some(r) = self.remote.get(idx).and_then(|r| r.as_ref()) else {
            return Err(Error::RemoteKey(
                "the peer has not announced this region on this connection (yet), or dropped it",
            ));
        };
        if r.gen != key.gen || r.key != key.key {
            return Err(Error::RemoteKey(
                "the key does not match the peer's region (dropped, its id reused)",
            ));
        }
        let remote = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let access = r.access & key.access() & remote;
        Ok(RemoteWindow::new(r.map.clone(), access, *key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: TransportKind = TransportKind::Shm;

    /// See [`crate::backend::shared_tests::a_receive_posted_after_its_message_arrived_does_not_sleep`].
    #[test]
    fn a_receive_posted_after_its_message_arrived_does_not_sleep() {
        crate::backend::shared_tests::a_receive_posted_after_its_message_arrived_does_not_sleep(
            KIND,
        );
    }

    /// A small send posted while a long one waits for ring room goes after it, not into
    /// the room it would fit (a send goes into the ring at post time only when nothing is
    /// queued ahead of it), and both arrive whole, in post order.
    #[test]
    fn a_send_posted_behind_a_queued_one_keeps_its_place() {
        use crate::backend::{self, Options};
        use crate::transport::Completion;
        use std::time::Duration;
        let opts = Options {
            ring_bytes: 4096,
            chunk_bytes: 1024,
            ..Options::default()
        };
        let mut l = backend::listen(KIND, &opts).expect("listen");
        let mut c = backend::connect(l.address(), &opts).expect("connect");
        let (mut a, mut b) =
            backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10)).expect("loopback");
        // Caller memory (no rendezvous): the long message goes eagerly, record by record.
        let long: Vec<u8> = (0..16 << 10).map(|i| (i % 251) as u8).collect();
        let src = a
            .domain()
            .register_memory(long.clone(), Access::empty())
            .expect("register long");
        let small = a
            .domain()
            .register_memory(b"after the long one".to_vec(), Access::empty())
            .expect("register small");
        a.post_send(src.slice(0, long.len()).expect("slice"), 1)
            .expect("long send");
        assert_eq!(a.in_flight(), 1, "the long send should wait for room");
        a.post_send(small.slice(0, 18).expect("slice"), 2)
            .expect("small send");
        let rx = b.register(32 << 10, Access::empty()).expect("register rx");
        b.post_recv(rx.slice(0, 16 << 10).expect("slice"), 3)
            .expect("recv 1");
        b.post_recv(rx.slice(16 << 10, 16 << 10).expect("slice"), 4)
            .expect("recv 2");
        let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
        let mut got = Vec::new();
        let mut sends = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while (got.len() < 2 || sends < 2) && std::time::Instant::now() < deadline {
            let n = a.poll(&mut out).expect("poll a");
            for c in &out[..n] {
                assert!(c.status.is_ok(), "send {:?}", c.status);
                sends += 1;
            }
            let n = b.poll(&mut out).expect("poll b");
            for c in out[..n].iter_mut() {
                assert!(c.status.is_ok(), "recv {:?}", c.status);
                let mut v = vec![0u8; c.len];
                c.buf.as_ref().expect("buf").copy_to(&mut v).expect("read");
                got.push((c.wr_id, v));
            }
        }
        assert_eq!(got.len(), 2, "both messages arrive");
        assert_eq!(got[0].0, 3);
        assert_eq!(got[0].1, long, "the long message first, whole");
        assert_eq!(got[1].0, 4);
        assert_eq!(&got[1].1, b"after the long one");
    }

    /// Messages of at least `STREAMING_MIN_BYTES` into a region marked streaming are copied
    /// with the streaming copy — by rendezvous, eagerly (caller memory) and by a one-sided
    /// read — and land whole; a shorter message, or the same message once the hint is off,
    /// takes the ordinary copy. (Counted by the copy's test-only tally of this thread.)
    #[test]
    fn receives_into_a_streaming_region_stream_and_only_those() {
        use crate::backend::{self, Options};
        use crate::copy::STREAMED;
        use crate::transport::{Completion, Transport};
        use std::time::{Duration, Instant};
        let min = Region::STREAMING_MIN_BYTES;
        let opts = Options::default();
        let mut l = backend::listen(KIND, &opts).expect("listen");
        let mut c = backend::connect(l.address(), &opts).expect("connect");
        let (mut a, mut b) =
            backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10)).expect("loopback");
        let pattern = |n: usize, seed: usize| -> Vec<u8> {
            (0..n).map(|i| ((i * 31 + seed) % 253) as u8).collect()
        };
        // fabric-core memory (rendezvous), caller memory (eager), a short rendezvous message.
        let big = a.register(4 * min, Access::REMOTE_READ).expect("big");
        big.write_at(0, &pattern(4 * min, 1)).expect("fill big");
        let eager = a
            .domain()
            .register_memory(pattern(2 * min, 2), Access::empty())
            .expect("eager");
        let short = a.register(min / 2, Access::empty()).expect("short");
        short.write_at(0, &pattern(min / 2, 3)).expect("fill short");
        let rx = b.register(8 * min, Access::empty()).expect("rx");
        assert!(!rx.is_streaming(), "off by default");
        rx.set_streaming(true);
        assert!(rx.is_streaming());

        // Runs one exchange; returns the bytes the receiving thread streamed and what landed.
        let exchange = |a: &mut Box<dyn Transport>,
                        b: &mut Box<dyn Transport>,
                        send: Option<Buf>,
                        read: Option<(usize, crate::RemoteKey)>|
         -> (usize, Vec<u8>) {
            let before = STREAMED.with(|s| s.get());
            let n = match (&send, &read) {
                (Some(s), _) => s.len(),
                (None, Some((n, _))) => *n,
                (None, None) => unreachable!("one of the two"),
            };
            let dst = rx.slice(0, n).expect("rx slice");
            match (send, read) {
                (Some(s), _) => {
                    b.post_recv(dst, 7).expect("recv");
                    a.post_send(s, 8).expect("send");
                }
                (None, Some((_, key))) => b.post_read(dst, &key, 0, 9).expect("read"),
                (None, None) => unreachable!(),
            }
            let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut landed = None;
            let mut sent = read.is_some();
            while (landed.is_none() || !sent) && Instant::now() < deadline {
                let k = a.poll(&mut out).expect("poll a");
                for c in &out[..k] {
                    assert!(c.status.is_ok(), "send {:?}", c.status);
                    sent = true;
                }
                let k = b.poll(&mut out).expect("poll b");
                if let Some(c) = out[..k].iter().next() {
                    assert!(c.status.is_ok(), "{:?} {:?}", c.op, c.status);
                    let mut v = vec![0u8; n];
                    c.buf
                        .as_ref()
                        .expect("buf")
                        .copy_to(&mut v)
                        .expect("read out");
                    landed = Some(v);
                }
            }
            let v = landed.expect("the message lands within 10 s");
            (STREAMED.with(|s| s.get()) - before, v)
        };

        let (streamed, v) = exchange(&mut a, &mut b, Some(big.full()), None);
        assert_eq!(v, pattern(4 * min, 1), "rendezvous message whole");
        assert_eq!(streamed, 4 * min, "rendezvous copy streamed");
        let (streamed, v) = exchange(&mut a, &mut b, Some(eager.full()), None);
        assert_eq!(v, pattern(2 * min, 2), "eager message whole");
        assert_eq!(streamed, 2 * min, "every eager record streamed");
        let (streamed, v) = exchange(&mut a, &mut b, Some(short.full()), None);
        assert_eq!(v, pattern(min / 2, 3));
        assert_eq!(
            streamed, 0,
            "a message under STREAMING_MIN_BYTES is copied as usual"
        );
        let key = big.remote_key().expect("key");
        let (streamed, v) = exchange(&mut a, &mut b, None, Some((3 * min, key)));
        assert_eq!(v, pattern(3 * min, 1), "one-sided read whole");
        assert_eq!(streamed, 3 * min, "one-sided read streamed");

        rx.set_streaming(false);
        let (streamed, v) = exchange(&mut a, &mut b, Some(big.full()), None);
        assert_eq!(v, pattern(4 * min, 1));
        assert_eq!(streamed, 0, "hint off: the ordinary copy");
        let (streamed, _) = exchange(&mut a, &mut b, Some(eager.full()), None);
        assert_eq!(streamed, 0, "hint off: the ordinary copy (eager)");
    }

    #[test]
    fn hello_and_announcement_decoders() {
        assert_eq!(decode_hello(&hello_bytes(1 << 20)).unwrap(), 1 << 20);
        assert_eq!(decode_hello(&hello_bytes(0)).unwrap(), 0);
        assert!(
            decode_hello(&hello_bytes(3000)).is_err(),
            "not a power of two"
        );
        assert!(decode_hello(&hello_bytes(1 << 40)).is_err(), "too large");
        assert!(decode_hello(&[0u8; HELLO_LEN]).is_err());
        // A version 1 peer (no tags in its records) gets a typed version error.
        let mut v1 = hello_bytes(1 << 20);
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            decode_hello(&v1),
            Err(crate::DecodeError::Version {
                what: "shm hello",
                found: 1,
                expected: 2
            })
        );
        assert!(decode_hello(&[0u8; 3]).is_err());

        let mut a = [0u8; ANN_LEN];
        a[0..4].copy_from_slice(&ANN_MAGIC.to_le_bytes());
        a[4..8].copy_from_slice(&5u32.to_le_bytes());
        a[8..16].copy_from_slice(&4096u64.to_le_bytes());
        a[16..24].copy_from_slice(&77u64.to_le_bytes());
        a[24..28].copy_from_slice(&(Access::REMOTE_WRITE.bits()).to_le_bytes());
        a[28..32].copy_from_slice(&ANN_RNDV.to_le_bytes());
        a[32..36].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(
            decode_announcement(&a).unwrap(),
            (5, 4096, 77, Access::REMOTE_WRITE, ANN_RNDV, 3)
        );
        let r = revocation(5, 3);
        assert_eq!(
            decode_announcement(&r).unwrap(),
            (5, 0, 0, Access::empty(), ANN_REVOKE, 3)
        );
        let mut bad = r;
        bad[16] = 1;
        assert!(decode_announcement(&bad).is_err(), "revocation with a key");
        let mut bad = a;
        bad[28..32].copy_from_slice(&(ANN_RNDV | ANN_REVOKE).to_le_bytes());
        assert!(decode_announcement(&bad).is_err(), "both flags");
        let mut bad = a;
        bad[36] = 1;
        assert!(decode_announcement(&bad).is_err(), "reserved bytes");
        let mut bad = a;
        bad[24..28].copy_from_slice(&0xffu32.to_le_bytes());
        assert!(decode_announcement(&bad).is_err(), "unknown access bits");
        let mut bad = a;
        bad[28..32].copy_from_slice(&4u32.to_le_bytes());
        assert!(decode_announcement(&bad).is_err(), "unknown flags");
        let mut bad = a;
        bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_announcement(&bad).is_err(), "absurd length");
        assert!(decode_announcement(&a[..39]).is_err());
    }
}
