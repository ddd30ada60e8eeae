//! [`Worker`]: one progress engine for many peers — one `poll` serves every endpoint, one
//! fd wakes the caller.
//!
//! A worker belongs to a [`Domain`] and holds any number of its connections
//! ([`Transport`]s), each named by an [`EndpointId`]. [`Worker::poll`] moves finished
//! operations of all of them into one caller slice as [`Event`]s that say which endpoint
//! each completion belongs to; [`Worker::wait_fd`] is one epoll fd (owned by the worker)
//! that wakes the caller, with [`Worker::arm`] following the trait's protocol. The epoll
//! watches each endpoint's underlying fds directly — shm: its eventfd and Unix socket; tcp:
//! its socket — not the endpoint's own [`wait_fd`](Transport::wait_fd), so an endpoint in a
//! worker never makes an epoll of its own (shm holds 3 fds per endpoint, tcp 1; see
//! `tests/fabric_worker.rs`).
//!
//! ```no_run
//! use fabric_core::backend::Options;
//! use fabric_core::{Access, Domain, Event, OpKind, TransportKind, Worker};
//! use std::time::Duration;
//!
//! # fn main() -> fabric_core::Result<()> {
//! let domain = Domain::open(TransportKind::Shm, &Options::default())?;
//! let mut worker = Worker::new(&domain)?;
//! let mut listener = domain.listen()?;
//! println!("peers: connect to {}", listener.address());
//! // One region for everyone: 4 KiB of receive space per peer.
//! let rx = domain.register(64 * 4096, Access::empty())?;
//! let mut events: Vec<Event> = (0..64).map(|_| Event::default()).collect();
//! loop {
//!     // New peers join the same engine (accept never blocks).
//!     while let Some(ep) = worker.accept(listener.as_mut())? {
//!         let i = ep.index();
//!         worker
//!             .post_recv(ep, rx.slice(i * 4096, 4096)?, i as u64)
//!             .map_err(|e| e.error)?;
//!     }
//!     // One call serves every peer; each event names its endpoint.
//!     let n = worker.poll(&mut events)?;
//!     for ev in &mut events[..n] {
//!         let c = std::mem::take(&mut ev.completion);
//!         if c.op == OpKind::Recv && c.status.is_ok() {
//!             println!("{}: {} bytes", ev.endpoint, c.len);
//!             // Post the same buffer again on the same endpoint.
//!             let buf = c.buf.expect("a completion hands its buffer back");
//!             worker.post_recv(ev.endpoint, buf, c.wr_id).map_err(|e| e.error)?;
//!         } else if !c.status.is_ok() {
//!             // Only this peer failed (PeerGone, ...): the others go on.
//!             drop(worker.remove(ev.endpoint)?);
//!         }
//!     }
//!     if n == 0 {
//!         // One fd for all peers (the listener is polled on the timeout).
//!         worker.wait(Some(Duration::from_millis(10)))?;
//!     }
//! }
//! # }
//! ```
//!
//! # How `poll` stays cheap with many idle endpoints
//!
//! Every endpoint is in one of three states:
//!
//! * **active** — in a round-robin queue; every [`poll`](Worker::poll) progresses the active
//!   endpoints (each call starts where the previous one stopped, so one busy endpoint cannot
//!   starve the others when the caller's slice fills up). A new endpoint, one the caller
//!   reached through [`endpoint`](Worker::endpoint) / [`post_send`](Worker::post_send) /
//!   [`post_recv`](Worker::post_recv), and one whose fd fired are active.
//! * **parked** — its own [`arm`](Transport::arm) returned `true`, so by the trait's contract
//!   its `wait_fd` becomes readable when it may have work — that is, one of the fds that
//!   `wait_fd` gathers becomes ready — and the worker's epoll watches those fds (one or two
//!   per endpoint, each `EPOLLONESHOT`, for writability too where the arm asked for it:
//!   tcp output waiting for room; each token names the endpoint and the fd, so an event on
//!   any of them makes the endpoint active, and after the next arm the worker re-enables
//!   only the fds the epoll reported: shm's socket, which tells only of control messages
//!   and hang-up, costs no system call per park). `poll` does not touch it; it
//!   comes back to the active queue when `epoll_wait` reports it. This is how an idle
//!   endpoint with a posted receive is found: shm's peer signals its eventfd when it
//!   publishes a record to a side that armed, tcp's socket becomes readable; verbs
//!   endpoints share their domain's completion queue, which the worker watches once (its
//!   channel and eventfd), and the queue names the endpoints that got work (an endpoint's
//!   own fd, its side socket, only tells of a hang-up). A peer that dies hangs up the
//!   endpoint's socket, which the epoll also watches. An active endpoint that gave no
//!   completion for [`PARK_AFTER`] polls is armed and parked by `poll`
//!   itself; [`Worker::arm`] parks every active endpoint at once.
//! * **dormant** — its `arm` returned `false` ("there is work") although nothing of the
//!   caller's is in flight on it: the connection failed (everything it had completed with an
//!   error already), its peer hung up, or (shm) a message waits for a receive the caller has
//!   not posted. Nothing can complete there until the caller posts, so it is neither
//!   progressed nor watched (a failed endpoint would otherwise keep the worker awake for
//!   ever); posting through the worker makes it active again.
//!
//! So a `poll` costs the active endpoints plus, when some are parked, one `epoll_wait(0)`
//! every [`EPOLL_EVERY`] calls (every call when none is active); 255 idle peers cost nothing
//! per call. The price of parking is paid once per idle period: the arm's system calls, and
//! on the peer's side the wake-up signal of the next message.
//!
//! # No lost wake-up
//!
//! [`Worker::arm`] arms every active endpoint (each [`Transport::arm`] promises that work
//! arriving afterwards makes its `wait_fd` readable, which happens exactly when one of the
//! fds it gathers becomes ready) and only then makes sure every one of those fds is enabled
//! in the worker's epoll with the interest that arm chose. An fd the epoll reported since
//! it was last enabled (`EPOLLONESHOT` disabled it), or whose interest changed, is
//! re-enabled with `epoll_ctl`, which checks its readiness at that moment, so work that
//! arrived between the endpoint's arm and the call is not missed. An fd the epoll has not
//! reported is still enabled: readiness that comes while an entry is enabled queues it in
//! the epoll, and one queued but no longer ready when collected is skipped without being
//! disabled, so it too reports whatever comes after the arm. (The worker tracks this per
//! fd: every event it collects clears that fd's bit, whatever the endpoint's state.) So
//! every fd of a parked endpoint is enabled from the moment it parked, and the first event
//! on any of them makes it active (one on another of its fds while it is active changes
//! nothing but that fd's bit: the endpoint is polled, and armed and re-enabled before it
//! parks again). An endpoint that reports work keeps the worker awake (`arm` returns
//! `false`).
//!
//! # Limits
//!
//! * A parked endpoint is polled again only when its fd fires, so the worker relies on each
//!   backend's `arm` keeping its promise (work that arrived before the arm makes it return
//!   `false`; work after it makes the fd readable). A backend that misses work there hangs
//!   that endpoint here, where a lone [`Transport::wait`] would only sleep to its timeout
//!   (the verbs backend's `arm` did not look into the CQ; the worker's tests caught it).
//! * An endpoint whose fd stays readable for data the caller has no receive posted for
//!   wakes the worker on every wait, as it would a lone [`Transport::wait`]. shm endpoints
//!   go dormant instead, and tcp buffers a waiting message (tested in
//!   `tests/fabric_worker.rs`); verbs makes the sender retry (receiver not ready).
//! * The worker relies on the fds an endpoint has it watch staying the same fds for the
//!   connection's life (true of every backend here; only tcp's interest in writability
//!   changes, and the worker reads it again after every arm).
#![allow(unsafe_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::backend::{self, Listener, SharedCompletions};
use crate::domain::Domain;
use crate::error::{Error, Result};
use crate::region::Buf;
use crate::transport::{Completion, PostError, PostResult, Transport};

/// An active endpoint that gave no completion for this many consecutive polls is armed and
/// parked (it then costs `poll` nothing until its fd fires).
pub const PARK_AFTER: u32 = 64;

/// While some endpoints are active, `poll` asks the epoll for parked endpoints that woke up
/// once every this many calls (every call when none is active).
pub const EPOLL_EVERY: u32 = 16;

/// Marks an epoll entry of a completion queue shared by endpoints (the low bits: its index
/// in the domain) rather than an endpoint's own fd.
const SHARED_TAG: u64 = 1 << 40;

/// An endpoint's epoll token is its id (the low 32 bits) and, from this bit on, which of
/// its watched fds it is.
const FD_SHIFT: u32 = 32;

/// Process-unique worker ids (a shared completion queue's wake-ups name their worker).
static NEXT_WORKER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Bits of an [`EndpointId`] that hold its index; the rest is a generation.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;
/// The most endpoints one worker holds at once (the all-ones index is never used, so
/// `Event::default()`'s endpoint is no worker's).
pub const MAX_ENDPOINTS: usize = INDEX_MASK as usize;

/// Names one endpoint of a [`Worker`].
///
/// [`index`](EndpointId::index) is dense (the lowest free slot, reused after
/// [`Worker::remove`], like a file descriptor) and suits per-peer arrays; the id also carries
/// a generation, so an id kept after its endpoint was removed is refused rather than taken
/// for the endpoint that reused its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointId(u32);

impl EndpointId {
    /// The slot index (< [`MAX_ENDPOINTS`]).
    pub fn index(self) -> usize {
        (self.0 & INDEX_MASK) as usize
    }

    fn generation(self) -> u32 {
        self.0 >> INDEX_BITS
    }

    fn new(index: usize, generation: u32) -> Self {
        EndpointId((generation << INDEX_BITS) | index as u32)
    }

    /// The id as one number (index and generation).
    pub fn raw(self) -> u32 {
        self.0
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "endpoint {}", self.index())?;
        if self.generation() != 0 {
            write!(f, " (generation {})", self.generation())?;
        }
        Ok(())
    }
}

/// One finished operation of one endpoint.
#[derive(Debug)]
pub struct Event {
    /// The endpoint it ran on.
    pub endpoint: EndpointId,
    /// The completion, with its buffer.
    pub completion: Completion,
}

impl Default for Event {
    /// An empty slot for [`Worker::poll`] to fill (its endpoint is no worker's:
    /// `u32::MAX`).
    fn default() -> Self {
        Event {
            endpoint: EndpointId(u32::MAX),
            completion: Completion::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In the round-robin queue.
    Active,
    /// Armed; its fds are watched by the worker's epoll.
    Parked,
    /// Nothing in flight and nothing to wait for; woken by the caller's next post.
    Dormant,
}

#[derive(Debug)]
struct Slot {
    id: EndpointId,
    t: Box<dyn Transport>,
    state: State,
    /// Consecutive polls without a completion.
    idle: u32,
    /// Its key in a completion queue it shares with other endpoints (verbs).
    key: Option<u64>,
    /// Which of its watched fds are registered and enabled now (bit k: fd k of
    /// [`Transport::watch_fds`]): set when the worker (re-)enables one, cleared when the
    /// epoll reports one (`EPOLLONESHOT` disabled it then).
    enabled: u8,
    /// Which of its watched fds are registered for writability too.
    out: u8,
}

/// One progress engine for many endpoints of one [`Domain`]: see the [module
/// docs](self).
pub struct Worker {
    id: u64,
    domain: Domain,
    epoll: OwnedFd,
    slots: Vec<Option<Slot>>,
    /// Next generation per slot index (kept after removal).
    generations: Vec<u32>,
    /// Free slot indices, lowest first.
    free: BinaryHeap<Reverse<usize>>,
    len: usize,
    /// Active endpoints, in round-robin order (each exactly once).
    active: VecDeque<usize>,
    parked: usize,
    polls: u32,
    /// Completions of one endpoint on their way into the caller's events.
    scratch: Vec<Completion>,
    ready: Vec<libc::epoll_event>,
    /// A poll error held back because events had already been moved out.
    deferred: Option<Error>,
    /// Shared completion queues watched (by index in the domain; verbs).
    shared: Vec<Option<Weak<dyn SharedCompletions>>>,
    /// Endpoints by their key in a shared completion queue.
    keys: HashMap<u64, usize>,
    /// Keys a shared queue reported woken.
    woken: Vec<u64>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("domain", &self.domain.id())
            .field("kind", &self.domain.kind())
            .field("endpoints", &self.len)
            .field("active", &self.active.len())
            .field("parked", &self.parked)
            .finish()
    }
}

/// The events an endpoint's fd is watched for: readability (and hang-up), writability where
/// the endpoint asks for it, once until re-enabled.
fn endpoint_events(out: bool) -> libc::c_int {
    libc::EPOLLIN | libc::EPOLLONESHOT | if out { libc::EPOLLOUT } else { 0 }
}

/// The epoll token of fd `k` of endpoint `id`.
fn token(id: EndpointId, k: usize) -> u64 {
    u64::from(id.raw()) | (k as u64) << FD_SHIFT
}

/// Adds every fd of an endpoint ([`Transport::watch_fds`]) to the epoll, each with a token
/// naming the endpoint and the fd; on failure none stays. Returns the `enabled` and `out`
/// masks of its [`Slot`].
fn watch(ep: BorrowedFd<'_>, t: &dyn Transport, id: EndpointId) -> Result<(u8, u8)> {
    let w = t.watch_fds();
    let (mut enabled, mut outs) = (0u8, 0u8);
    for (k, &(fd, out)) in w.as_slice().iter().enumerate() {
        if let Err(e) = epoll_ctl_with(
            ep,
            libc::EPOLL_CTL_ADD,
            fd,
            token(id, k),
            endpoint_events(out),
        ) {
            for &(added, _) in &w.as_slice()[..k] {
                let _ = epoll_ctl_with(ep, libc::EPOLL_CTL_DEL, added, 0, 0);
            }
            return Err(e);
        }
        enabled |= 1 << k;
        outs |= u8::from(out) << k;
    }
    Ok((enabled, outs))
}

/// After an arm: re-enables each fd of the endpoint in slot `s` that the epoll reported
/// since it was last enabled (`EPOLLONESHOT`: the kernel checks the fd's readiness now, so
/// work that came after the arm is reported), and re-registers one whose interest in
/// writability changed. An fd the epoll has not reported is still enabled and needs no
/// system call: it reports readiness whenever it comes.
fn rewatch(ep: BorrowedFd<'_>, s: &mut Slot) -> Result<()> {
    for (k, &(fd, out)) in s.t.watch_fds().as_slice().iter().enumerate() {
        let bit = 1u8 << k;
        if s.enabled & bit != 0 && (s.out & bit != 0) == out {
            continue;
        }
        s.enabled &= !bit;
        epoll_ctl_with(
            ep,
            libc::EPOLL_CTL_MOD,
            fd,
            token(s.id, k),
            endpoint_events(out),
        )?;
        s.enabled |= bit;
        s.out = (s.out & !bit) | (u8::from(out) << k);
    }
    Ok(())
}

/// Takes every fd of an endpoint out of the epoll (all are tried; the first error is
/// returned).
fn unwatch(ep: BorrowedFd<'_>, t: &dyn Transport) -> Result<()> {
    let mut first = Ok(());
    for &(fd, _) in t.watch_fds().as_slice() {
        if let Err(e) = epoll_ctl_with(ep, libc::EPOLL_CTL_DEL, fd, 0, 0) {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

fn epoll_ctl_with(
    ep: BorrowedFd<'_>,
    op: libc::c_int,
    fd: BorrowedFd<'_>,
    data: u64,
    events: libc::c_int,
) -> Result<()> {
    let mut ev = libc::epoll_event {
        events: events as u32,
        u64: data,
    };
    // SAFETY: `ev` is a valid epoll_event for the call's duration; both fds are open.
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd.as_raw_fd(), &mut ev) };
    if r < 0 {
        return Err(Error::last_os("epoll_ctl"));
    }
    Ok(())
}

fn unknown(ep: EndpointId) -> Error {
    Error::InvalidArgument(format!("{ep} is not an endpoint of this worker"))
}

impl Worker {
    /// A worker with no endpoints, serving connections of `domain`.
    ///
    /// # Errors
    /// [`Error::Io`] when the epoll fd cannot be created.
    pub fn new(domain: &Domain) -> Result<Worker> {
        // SAFETY: plain flags.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(Error::last_os("epoll_create1"));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Worker {
            id: NEXT_WORKER.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            domain: domain.clone(),
            epoll,
            slots: Vec::new(),
            generations: Vec::new(),
            free: BinaryHeap::new(),
            len: 0,
            active: VecDeque::new(),
            parked: 0,
            polls: 0,
            scratch: Vec::new(),
            ready: Vec::with_capacity(64),
            deferred: None,
            shared: Vec::new(),
            keys: HashMap::new(),
            woken: Vec::new(),
        })
    }

    /// The domain whose connections this worker serves.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// Adds a connection; its completions come out of [`poll`](Self::poll) from now on.
    ///
    /// # Errors
    /// [`Error::Foreign`] for a connection of another domain (or another backend) — a
    /// worker serves the connections of its own domain, whose registrations they share; the
    /// connection is dropped (closed). [`Error::WouldBlock`] past [`MAX_ENDPOINTS`];
    /// [`Error::Io`] when its fds cannot be watched.
    pub fn add(&mut self, t: Box<dyn Transport>) -> Result<EndpointId> {
        if t.kind() != self.domain.kind() || t.domain().id() != self.domain.id() {
            return Err(Error::Foreign(
                "a connection of another domain (a worker serves its own domain's connections)",
            ));
        }
        let index = match self.free.pop() {
            Some(Reverse(i)) => i,
            None if self.slots.len() < MAX_ENDPOINTS => {
                self.slots.push(None);
                self.generations.push(0);
                self.slots.len() - 1
            }
            None => return Err(Error::WouldBlock("worker endpoint table")),
        };
        let id = EndpointId::new(index, self.generations[index]);
        let mut t = t;
        // An endpoint on a shared completion queue: its fd now tells only of a hang-up, and
        // the queue is watched once for all of them.
        let key = t.attach_worker(Some(self.id));
        let watched = match key {
            Some(k) => self.watch_shared((k >> 32) as u32),
            None => Ok(()),
        };
        let watched = watched.and_then(|()| watch(self.epoll.as_fd(), t.as_ref(), id));
        let (enabled, out) = match watched {
            Ok(masks) => masks,
            Err(e) => {
                if key.is_some() {
                    t.attach_worker(None);
                }
                self.free.push(Reverse(index));
                return Err(e);
            }
        };
        if let Some(k) = key {
            self.keys.insert(k, index);
        }
        self.generations[index] = (self.generations[index] + 1) & (u32::MAX >> INDEX_BITS);
        self.slots[index] = Some(Slot {
            id,
            t,
            state: State::Active,
            idle: 0,
            key,
            enabled,
            out,
        });
        self.active.push_back(index);
        self.len += 1;
        Ok(id)
    }

    /// Watches the domain's shared completion queue number `index` (once; level-triggered:
    /// readable until [`SharedCompletions::drive`] ran).
    fn watch_shared(&mut self, index: u32) -> Result<()> {
        let i = index as usize;
        if self
            .shared
            .get(i)
            .is_some_and(|w| w.as_ref().is_some_and(|w| w.strong_count() > 0))
        {
            return Ok(());
        }
        let q = self
            .domain
            .backend()
            .shared_completions(index)
            .ok_or_else(|| Error::Protocol(format!("no shared completion queue {index}")))?;
        for fd in q.wake_fds() {
            epoll_ctl_with(
                self.epoll.as_fd(),
                libc::EPOLL_CTL_ADD,
                fd,
                SHARED_TAG | u64::from(index),
                libc::EPOLLIN,
            )?;
        }
        if self.shared.len() <= i {
            self.shared.resize_with(i + 1, || None);
        }
        self.shared[i] = Some(Arc::downgrade(&q));
        Ok(())
    }

    /// Connects to `address` (with or without its `kind:` prefix) and adds the connection;
    /// blocks for the handshake, at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`], the backend's connection errors, or [`add`](Self::add)'s.
    pub fn connect(&mut self, address: &str, timeout: Duration) -> Result<EndpointId> {
        let mut c = self.domain.connect(address)?;
        let t = backend::connect_timeout(c.as_mut(), timeout)?;
        self.add(t)
    }

    /// Adds the next connection `listener` has finished accepting, if any; never blocks.
    ///
    /// # Errors
    /// The listener's error, or [`add`](Self::add)'s (a listener of another domain).
    pub fn accept(&mut self, listener: &mut dyn Listener) -> Result<Option<EndpointId>> {
        match listener.accept()? {
            Some(t) => self.add(t).map(Some),
            None => Ok(None),
        }
    }

    fn slot(&self, ep: EndpointId) -> Option<&Slot> {
        self.slots.get(ep.index())?.as_ref().filter(|s| s.id == ep)
    }

    /// Makes `ep` active (the caller is about to post on it) and returns its slot.
    fn touch(&mut self, ep: EndpointId) -> Option<&mut Slot> {
        self.slot(ep)?;
        let index = ep.index();
        let s = self.slots[index].as_mut()?;
        match s.state {
            State::Active => {}
            State::Parked => {
                self.parked -= 1;
                s.state = State::Active;
                self.active.push_back(index);
            }
            State::Dormant => {
                s.state = State::Active;
                self.active.push_back(index);
            }
        }
        s.idle = 0;
        Some(s)
    }

    /// The connection behind `ep`, to post anything on it (one-sided, atomics, the tagged
    /// operations...); its completions still come out of [`poll`](Self::poll). Do not
    /// [`poll`](Transport::poll) it directly: what that takes does not come out of the
    /// worker.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id that is not (or no longer) this worker's.
    pub fn endpoint(&mut self, ep: EndpointId) -> Result<&mut dyn Transport> {
        match self.touch(ep) {
            Some(s) => Ok(s.t.as_mut()),
            None => Err(unknown(ep)),
        }
    }

    /// [`Transport::post_send`] on `ep`.
    ///
    /// # Errors
    /// As [`Transport::post_send`]; [`Error::InvalidArgument`] for an unknown id (the buffer
    /// comes back in the error).
    pub fn post_send(&mut self, ep: EndpointId, buf: Buf, wr_id: u64) -> PostResult {
        match self.touch(ep) {
            Some(s) => s.t.post_send(buf, wr_id),
            None => Err(PostError {
                error: unknown(ep),
                buf,
            }),
        }
    }

    /// [`Transport::post_recv`] on `ep`.
    ///
    /// # Errors
    /// As [`Transport::post_recv`]; [`Error::InvalidArgument`] for an unknown id.
    pub fn post_recv(&mut self, ep: EndpointId, buf: Buf, wr_id: u64) -> PostResult {
        match self.touch(ep) {
            Some(s) => s.t.post_recv(buf, wr_id),
            None => Err(PostError {
                error: unknown(ep),
                buf,
            }),
        }
    }

    /// Takes `ep` out of the worker and hands its connection back (with whatever it still
    /// has in flight or ready: poll it directly from now on).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown id; [`Error::Io`] when its fds cannot be
    /// unwatched (it stays in the worker).
    pub fn remove(&mut self, ep: EndpointId) -> Result<Box<dyn Transport>> {
        let s = self.slot(ep).ok_or_else(|| unknown(ep))?;
        unwatch(self.epoll.as_fd(), s.t.as_ref())?;
        let index = ep.index();
        let mut s = self.slots[index].take().expect("checked above");
        if let Some(k) = s.key {
            s.t.attach_worker(None);
            self.keys.remove(&k);
        }
        match s.state {
            State::Active => self.active.retain(|&i| i != index),
            State::Parked => self.parked -= 1,
            State::Dormant => {}
        }
        self.free.push(Reverse(index));
        self.len -= 1;
        Ok(s.t)
    }

    /// How many endpoints it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ids of its endpoints, in index order.
    pub fn endpoints(&self) -> impl Iterator<Item = EndpointId> + '_ {
        self.slots.iter().filter_map(|s| s.as_ref().map(|s| s.id))
    }

    /// Endpoints `poll` progresses now (the rest are parked on the fd, or dormant): what a
    /// call costs, beyond one `epoll_wait` now and then.
    pub fn active_len(&self) -> usize {
        self.active.len()
    }

    /// Endpoints parked on the worker's fd.
    pub fn parked_len(&self) -> usize {
        self.parked
    }

    /// Moves the parked endpoints whose fd fired back into the active queue.
    fn reap_epoll(&mut self) -> Result<()> {
        let cap = self.ready.capacity();
        // SAFETY: `ready` has room for `cap` events; the kernel writes at most that many
        // and returns how many it wrote.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll.as_raw_fd(),
                self.ready.as_mut_ptr(),
                cap as libc::c_int,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Error::io("epoll_wait", e));
        }
        for k in 0..n as usize {
            // SAFETY: the kernel initialised the first `n` entries.
            let data = unsafe { (*self.ready.as_ptr().add(k)).u64 };
            if data & SHARED_TAG != 0 {
                self.drive_shared((data & u64::from(u32::MAX)) as usize)?;
                continue;
            }
            let id = EndpointId(data as u32);
            let index = id.index();
            let Some(Some(s)) = self.slots.get_mut(index) else {
                continue;
            };
            if s.id != id {
                continue;
            }
            // `EPOLLONESHOT` disabled this fd: the next park re-enables it.
            s.enabled &= !(1u8 << ((data >> FD_SHIFT) & 7));
            self.wake(index);
        }
        Ok(())
    }

    /// Lets the shared completion queue `i` route its completions and wakes the endpoints
    /// that got some.
    fn drive_shared(&mut self, i: usize) -> Result<()> {
        let Some(q) = self.shared.get(i).and_then(|w| w.as_ref()?.upgrade()) else {
            return Ok(());
        };
        q.drive(self.id, &mut self.woken)?;
        let mut woken = std::mem::take(&mut self.woken);
        for k in woken.drain(..) {
            if let Some(&index) = self.keys.get(&k) {
                self.wake(index);
            }
        }
        self.woken = woken;
        Ok(())
    }

    /// Puts a parked or dormant endpoint back in the active queue.
    fn wake(&mut self, index: usize) {
        let Some(Some(s)) = self.slots.get_mut(index) else {
            return;
        };
        match s.state {
            State::Active => {}
            State::Parked => {
                self.parked -= 1;
                s.state = State::Active;
                s.idle = 0;
                self.active.push_back(index);
            }
            State::Dormant => {
                s.state = State::Active;
                s.idle = 0;
                self.active.push_back(index);
            }
        }
    }

    /// Arms the endpoint in `index` (which is out of the active queue): parked, dormant,
    /// or `Ok(false)` when it has work (the caller puts it back in the queue).
    fn try_park(&mut self, index: usize) -> Result<bool> {
        let s = self.slots[index].as_mut().expect("active slot");
        if s.t.arm()? {
            rewatch(self.epoll.as_fd(), s)?;
            s.state = State::Parked;
            self.parked += 1;
            Ok(true)
        } else if s.t.in_flight() == 0 {
            s.state = State::Dormant;
            Ok(true)
        } else {
            s.idle = 0;
            Ok(false)
        }
    }

    /// Makes progress on every active endpoint (and picks up parked ones whose fd fired)
    /// and moves finished operations into `out`; returns how many. Never sleeps.
    ///
    /// Each call starts with the endpoint after the last one the previous call served, so
    /// an endpoint with a flood of completions cannot starve the others even when `out` is
    /// small.
    ///
    /// # Errors
    /// A local failure of the epoll or of one endpoint's [`Transport::poll`] (peer failures
    /// are error completions of that endpoint only). Events already moved out are returned
    /// first; the error comes with the next call.
    pub fn poll(&mut self, out: &mut [Event]) -> Result<usize> {
        let mut scratch = std::mem::take(&mut self.scratch);
        if scratch.len() < out.len() {
            scratch.resize_with(out.len(), Completion::default);
        }
        let r = self.poll_with(out.len(), |t, id, filled| {
            let room = out.len() - filled;
            let n = t.poll(&mut scratch[..room])?;
            for (o, c) in out[filled..].iter_mut().zip(&mut scratch[..n]) {
                *o = Event {
                    endpoint: id,
                    completion: std::mem::take(c),
                };
            }
            Ok(n)
        });
        // What `take` left there is an empty `Vec` (no allocation): put the scratch back
        // without an out-of-line drop of it.
        std::mem::forget(std::mem::replace(&mut self.scratch, scratch));
        r
    }

    /// [`poll`](Self::poll) for a caller that needs no endpoint ids (its `wr_id`s say
    /// which operation finished): the endpoints' completions are written straight into
    /// `out`, with no [`Event`] around them (one move less per completion).
    ///
    /// # Errors
    /// As [`poll`](Self::poll).
    pub fn poll_completions(&mut self, out: &mut [Completion]) -> Result<usize> {
        let cap = out.len();
        self.poll_with(cap, |t, _, filled| t.poll(&mut out[filled..]))
    }

    /// The loop of [`poll`](Self::poll): serves the active endpoints in turn (parking idle
    /// ones) until `cap` completions were taken; `take(transport, id, filled)` polls one
    /// endpoint into the caller's output after the `filled` taken so far (at most
    /// `cap - filled`) and says how many it took.
    #[inline(always)]
    fn poll_with(
        &mut self,
        cap: usize,
        mut take: impl FnMut(&mut dyn Transport, EndpointId, usize) -> Result<usize>,
    ) -> Result<usize> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        if cap == 0 {
            return Ok(0);
        }
        self.polls = self.polls.wrapping_add(1);
        if self.parked > 0 && (self.active.is_empty() || self.polls.is_multiple_of(EPOLL_EVERY)) {
            self.reap_epoll()?;
        }
        let mut filled = 0;
        let rounds = self.active.len();
        for _ in 0..rounds {
            if filled == cap {
                break;
            }
            let Some(index) = self.active.pop_front() else {
                break;
            };
            let s = self.slots[index].as_mut().expect("active slot");
            let n = match take(s.t.as_mut(), s.id, filled) {
                Ok(n) => n,
                Err(e) => {
                    self.active.push_back(index);
                    if filled == 0 {
                        return Err(e);
                    }
                    self.deferred = Some(e);
                    return Ok(filled);
                }
            };
            filled += n;
            if n > 0 {
                s.idle = 0;
                self.active.push_back(index);
                continue;
            }
            s.idle += 1;
            if s.idle < PARK_AFTER {
                self.active.push_back(index);
                continue;
            }
            match self.try_park(index) {
                Ok(true) => {}
                Ok(false) => self.active.push_back(index),
                Err(e) => {
                    self.active.push_back(index);
                    if filled == 0 {
                        return Err(e);
                    }
                    self.deferred = Some(e);
                    return Ok(filled);
                }
            }
        }
        Ok(filled)
    }

    /// One fd for every endpoint: readable when [`poll`](Self::poll) may have work, once
    /// [`arm`](Self::arm) returned `true`.
    pub fn wait_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    /// Prepares to sleep on [`wait_fd`](Self::wait_fd): arms every active endpoint and
    /// parks it on the fd. Returns `false` when some endpoint has work already (do not
    /// sleep; poll). Work that arrives after it returned `true` makes the fd readable.
    ///
    /// # Errors
    /// A failing system call (the endpoint concerned stays active).
    pub fn arm(&mut self) -> Result<bool> {
        if self.deferred.is_some() {
            return Ok(false);
        }
        let mut idle = true;
        for _ in 0..self.active.len() {
            let Some(index) = self.active.pop_front() else {
                break;
            };
            match self.try_park(index) {
                Ok(true) => {}
                Ok(false) => {
                    idle = false;
                    self.active.push_back(index);
                }
                Err(e) => {
                    self.active.push_back(index);
                    return Err(e);
                }
            }
        }
        Ok(idle)
    }

    /// Sleeps until some endpoint may have work or `timeout` passes
    /// ([`arm`](Self::arm) + `poll(2)` on the fd).
    ///
    /// # Errors
    /// Only for a failing system call.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.arm()? {
            crate::sys::poll_readable(self.wait_fd(), timeout)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_moves_between_threads() {
        fn send<T: Send>() {}
        send::<Worker>();
        send::<Event>();
    }

    #[test]
    fn ids_carry_index_and_generation() {
        let id = EndpointId::new(5, 3);
        assert_eq!(id.index(), 5);
        assert_eq!(id.generation(), 3);
        assert_ne!(id, EndpointId::new(5, 4));
        assert_eq!(id.to_string(), "endpoint 5 (generation 3)");
        assert_eq!(EndpointId::new(7, 0).to_string(), "endpoint 7");
        let last = EndpointId::new(MAX_ENDPOINTS - 1, u32::MAX >> INDEX_BITS);
        assert_eq!(last.index(), MAX_ENDPOINTS - 1);
        assert_ne!(last, Event::default().endpoint);
    }

    /// `poll_completions` takes the same completions as `poll`, from every endpoint,
    /// straight into the caller's array, with their buffers; a small array serves the
    /// endpoints in turn.
    #[test]
    fn poll_completions_serves_every_endpoint() {
        use crate::backend::{self, Options};
        use crate::{Access, TransportKind};
        use std::time::{Duration, Instant};
        let d = Domain::open(TransportKind::Shm, &Options::default()).unwrap();
        let mut w = Worker::new(&d).unwrap();
        let mut peers = Vec::new();
        let mut eps = Vec::new();
        for _ in 0..3 {
            let mut l = d.listen().unwrap();
            let mut c = backend::connect(l.address(), &Options::default()).unwrap();
            let (a, b) =
                backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(10)).unwrap();
            eps.push(w.add(a).unwrap());
            peers.push(b);
        }
        let r = d.register(64 * 6, Access::empty()).unwrap();
        // each endpoint: a send (wr_id 10 + i) and a receive (wr_id 20 + i) that its peer
        // answers
        for (i, &ep) in eps.iter().enumerate() {
            let rx = r.slice(64 * 2 * i, 64).unwrap();
            w.endpoint(ep)
                .unwrap()
                .post_recv(rx, 20 + i as u64)
                .unwrap();
            let tx = r.slice(64 * (2 * i + 1), 8).unwrap();
            tx.copy_from(&[i as u8; 8]).unwrap();
            w.endpoint(ep)
                .unwrap()
                .post_send(tx, 10 + i as u64)
                .unwrap();
        }
        let mut pout: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
        for (i, p) in peers.iter_mut().enumerate() {
            // (each peer connected from a domain of its own)
            let pr = p.domain().register(128, Access::empty()).unwrap();
            p.post_recv(pr.slice(0, 64).unwrap(), 1).unwrap();
            let tx = pr.slice(64, 4).unwrap();
            tx.copy_from(&[0xa0 + i as u8; 4]).unwrap();
            p.post_send(tx, 2).unwrap();
        }
        // The peers first (each takes our message and sends its own): then every endpoint
        // has two completions waiting, and one call fills the array from several of them.
        let end = Instant::now() + Duration::from_secs(10);
        let mut peer_done = [0; 3];
        while peer_done.iter().any(|&n| n < 2) {
            assert!(Instant::now() < end, "peers: {peer_done:?}");
            for (p, done) in peers.iter_mut().zip(&mut peer_done) {
                *done += p.poll(&mut pout).unwrap();
            }
        }
        let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
        let mut got = Vec::new();
        while got.len() < 6 {
            assert!(Instant::now() < end, "only {got:?} completed");
            let n = w.poll_completions(&mut out).unwrap();
            assert!(n <= out.len());
            for c in &mut out[..n] {
                assert!(c.status.is_ok(), "{c:?}");
                let buf = c.buf.take().expect("the buffer comes back");
                if c.wr_id >= 20 {
                    let i = (c.wr_id - 20) as usize;
                    assert_eq!(c.len, 4);
                    let mut b = [0u8; 4];
                    buf.copy_to(&mut b).unwrap();
                    assert_eq!(b, [0xa0 + i as u8; 4], "endpoint {i}'s message");
                }
                got.push(c.wr_id);
            }
        }
        got.sort_unstable();
        assert_eq!(got, vec![10, 11, 12, 20, 21, 22]);
        assert_eq!(w.poll_completions(&mut out).unwrap(), 0);
        assert_eq!(w.poll_completions(&mut []).unwrap(), 0);
    }
}
