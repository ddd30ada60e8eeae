//! [`AsyncWorker`]: a [`Worker`] whose operations are futures, on tokio (feature `tokio`).
//!
//! ```no_run
//! use fabric_core::async_worker::AsyncWorker;
//! use fabric_core::backend::Options;
//! use fabric_core::{Access, Domain, TransportKind};
//!
//! # async fn serve() -> fabric_core::Result<()> {
//! let domain = Domain::open(TransportKind::Shm, &Options::default())?;
//! let worker = AsyncWorker::new(&domain)?; // inside a tokio runtime (IO enabled)
//! let mut listener = domain.listen()?;
//! let rx = domain.register(64 * 4096, Access::empty())?;
//! loop {
//!     let ep = worker.accept(listener.as_mut()).await?;
//!     let (w, buf) = (worker.clone(), rx.slice(ep.index() * 4096, 4096)?);
//!     // One task per peer; no lock of the caller's: the worker is shared by clones.
//!     tokio::spawn(async move {
//!         let mut buf = buf;
//!         loop {
//!             let (r, b) = w.recv(ep, buf).await; // the buffer always comes back
//!             let Ok(done) = r else { break };
//!             let mut b = b;
//!             b.set_len(done.len).unwrap();
//!             let (r, b) = w.send(ep, b).await; // echo the same bytes
//!             if r.is_err() {
//!                 break;
//!             }
//!             buf = b.region().slice(b.offset(), 4096).unwrap();
//!         }
//!     });
//! }
//! # }
//! ```
//!
//! # How it runs
//!
//! [`AsyncWorker::new`] moves a [`Worker`] behind a lock shared by every clone of the
//! handle (a spin lock whose release is a plain store: it is only ever held for a post, one
//! poll of the worker or an `Op`'s short spin; a contended `lock` spins briefly, then yields
//! the thread), registers a duplicate of the worker's [`wait_fd`](Worker::wait_fd) (an epoll
//! fd) with tokio's reactor through [`AsyncFd`], and spawns one *driver* task on the current
//! runtime. An operation ([`send`](AsyncWorker::send), [`recv`](AsyncWorker::recv), ...) is
//! posted when the method is called (so operations called in order are posted in order) and
//! returns an [`Op`], a future that resolves to the completion with the buffer handed back:
//! `(Result<Done>, Buf)` ([`BufResult`], the owned-buffer style of tokio-uring).
//! [`recv_send`](AsyncWorker::recv_send) posts a receive and a send under one acquisition of
//! the lock (request / reply). The driver polls the worker, hands each completion to the slot
//! its operation waits on, wakes that task, and when there is nothing to do sleeps on the fd:
//!
//! 1. poll the worker; dispatch what it returned;
//! 2. nothing, but the last completion (or wake-up) is younger than
//!    [`AsyncOptions::spin`]: yield to the runtime and go to 1, whether or not an operation
//!    is pending at that moment (the task a completion just woke is about to post its next
//!    one; a short busy phase keeps round trips at busy-poll latency, and it ends while the
//!    runtime keeps running other tasks);
//! 3. [`Worker::arm`]: every active endpoint is armed and parked on the fd. `false` means
//!    some endpoint found work that arrived between the poll and the arm: go to 1;
//! 4. await readiness of the fd (or a *kick*: a new post, which may make a dormant endpoint
//!    busy, wakes the driver as well); clear tokio's readiness and go to 1.
//!
//! An [`Op`] that is polled before its completion was dispatched polls the worker itself
//! once (up to four completions; the others' are handed to their slots): a send's
//! completion is usually there at once, and taking it there saves a round through the
//! driver task. With [`AsyncOptions::op_spin`] it keeps polling for that long (releasing the
//! worker every 16 polls, when other threads' posts and polls get their turn) before it
//! returns `Pending`: a latency-bound task then waits like a blocking busy-poll, at the
//! price of holding the runtime's thread meanwhile. Because such a poll may move an
//! endpoint whose fd fired back to the active queue (where no fd watches it), it kicks the
//! driver, which then polls and arms again before it sleeps.
//!
//! # No lost completion
//!
//! A completion that arrives after step 1's poll and before step 3's arm is seen by the arm
//! (each [`Transport::arm`] returns `false` for work that is already there). One that
//! arrives after the arm makes the worker's epoll readable, which makes tokio's registration
//! of it ready. tokio's readiness is cleared in step 4 only with the readiness *tick* the
//! driver was woken with: an event that came in after that wake-up is not cleared, so the
//! next wait returns at once. The readiness is cleared *before* the poll that follows it, so
//! an event the poll does not see is still pending at the next wait.
//! `tests/fabric_async.rs` forces a completion into the window between the empty poll and
//! the arm on every round (a test hook runs there) and stresses it with random timing.
//!
//! # Several tasks, no user lock
//!
//! [`AsyncWorker`] is `Clone + Send + Sync`: give each task (one per peer, say) a clone; its
//! operations take `&self`. The worker behind them is locked only inside the calls (post,
//! a poll by the driver, taking a completion) and never across an `.await`.
//!
//! # Cancellation
//!
//! Dropping an [`Op`] never frees or reuses memory the device or the peer may still touch:
//! the [`Buf`] was moved into the transport at the post, and the transport keeps it until
//! the operation completes (successfully or not). What happens on drop:
//!
//! * the operation is **not** cancelled: it stays in flight and runs to its end (a dropped
//!   receive still takes the next matching message: the bytes land in its buffer and are
//!   then dropped with it; a dropped send is still delivered);
//! * when its completion comes out of the worker, the driver drops the completion and with
//!   it the buffer — only then is that slice's hold on its [`Region`](crate::Region)
//!   released (a region whose last handle was dropped meanwhile is deregistered then);
//! * an operation that had already completed when its future was dropped has its buffer
//!   dropped at once.
//!
//! The driver keeps running while a handle or an [`Op`] is alive. When the last one goes,
//! the driver stops and the [`Worker`] is dropped with its connections: a connection closed
//! with operations in flight keeps their buffers until its backend has quiesced them, as
//! when a blocking [`Worker`] is dropped (verbs moves the queue pair to the error state and
//! drains it before the memory may go).
//!
//! # Limits
//!
//! * A refused post ([`Error::WouldBlock`] backpressure, bounds, access) resolves the [`Op`]
//!   at once with the error and the buffer; nothing is retried.
//! * A local failure of [`Worker::poll`] (an epoll error) is counted
//!   ([`AsyncWorkerStats::poll_errors`]) and retried after a millisecond; the operations stay
//!   pending. Peer failures are error completions of their operations only.
//! * [`AsyncWorker::new`] needs a tokio runtime with IO enabled (`enable_io` /
//!   `enable_all`; without it, a typed error); the driver runs on it, so the runtime must
//!   outlive the operations.
#![allow(unsafe_code)]

use std::fmt;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

use crate::backend::Listener;
use crate::domain::Domain;
use crate::error::{Error, Result};
use crate::region::Buf;
use crate::spin::SpinLock;
use crate::transport::{
    AtomicOp, Capabilities, Completion, OpKind, PostError, PostResult, RemoteKey, Status, Transport,
};
use crate::worker::{EndpointId, Worker};

/// The output of an [`Op`]: how it ended, and the buffer it took (always handed back).
pub type BufResult<T> = (Result<T>, Buf);

/// What a successful operation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Done {
    /// Which operation.
    pub op: OpKind,
    /// Bytes received (recv), transferred (send/write/read) or 8 (atomics).
    pub len: usize,
    /// The message's tag (receives), the tag sent (tagged sends); 0 otherwise.
    pub tag: u64,
    /// The immediate of a write-with-immediate notification (receives); `None` otherwise.
    pub imm: Option<u32>,
    /// The old value of the word (atomics); 0 otherwise.
    pub value: u64,
}

/// Tuning of an [`AsyncWorker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncOptions {
    /// How long the driver keeps polling (yielding to the runtime between polls) after the
    /// last completion or wake-up while operations are pending, before it arms the worker
    /// and sleeps on its fd. Zero: sleep as soon as a poll finds nothing. Default 50 µs.
    pub spin: Duration,
    /// Completions taken from the worker per poll. Default 64.
    pub batch: usize,
    /// How long an [`Op`] polled before its completion came keeps polling the worker
    /// itself (busy, on the runtime's thread) before it returns `Pending`. Zero (the
    /// default): one poll. A latency-bound task (a ping-pong, an RPC client awaiting one
    /// reply at a time) gets busy-poll round trips with a few microseconds here, without a
    /// trip through the runtime and the driver task; a server with many tasks keeps it at
    /// zero, since the spin holds the runtime's thread (and so every other task on it).
    pub op_spin: Duration,
}

impl Default for AsyncOptions {
    fn default() -> Self {
        AsyncOptions {
            spin: Duration::from_micros(50),
            batch: 64,
            op_spin: Duration::ZERO,
        }
    }
}

impl AsyncOptions {
    /// These options with `spin` set.
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// These options with `op_spin` set.
    pub fn with_op_spin(mut self, op_spin: Duration) -> Self {
        self.op_spin = op_spin;
        self
    }
}

/// Counters of the driver (see the [module docs](self)): cheap to read, meant for tests and
/// tuning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncWorkerStats {
    /// Operations posted.
    pub posts: u64,
    /// Completions handed to their operations (including dropped ones').
    pub completions: u64,
    /// Completions whose future had been dropped (their buffers dropped by the driver).
    pub abandoned: u64,
    /// Times the driver armed the worker before sleeping.
    pub arms: u64,
    /// Times the arm found work that arrived after the empty poll before it (each one a
    /// completion in the window between poll and arm, which no fd event would report).
    pub arm_found_work: u64,
    /// Times the driver went to sleep on the fd.
    pub sleeps: u64,
    /// Sleeps ended by the fd (rather than by a post's kick).
    pub fd_wakeups: u64,
    /// Local poll failures (retried).
    pub poll_errors: u64,
}

#[derive(Default)]
struct Counters {
    posts: AtomicU64,
    completions: AtomicU64,
    abandoned: AtomicU64,
    arms: AtomicU64,
    arm_found_work: AtomicU64,
    sleeps: AtomicU64,
    fd_wakeups: AtomicU64,
    poll_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Adds `n` to a counter that only changes under the table's lock: a load and a store, no
/// read-modify-write on the per-operation path.
fn add_locked(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// Completions an [`Op`] takes from the worker when it polls it itself.
const INLINE_POLL: usize = 4;

/// An [`Op`] spinning on the worker ([`AsyncOptions::op_spin`]) reads the clock once per
/// this many polls.
const CLOCK_EVERY: u32 = 16;

/// What an [`Op`] resolves to, taken out of its [`Completion`] (an [`AsyncWorker`]'s
/// operations are single-buffer ones: no grouped-receive parts to carry).
struct Finished {
    op: OpKind,
    status: Status,
    len: usize,
    tag: u64,
    imm: Option<u32>,
    value: u64,
    buf: Option<Buf>,
}

impl Finished {
    /// Takes the buffer out of `c` (left to be overwritten by the next poll) and copies
    /// the rest.
    #[inline(always)]
    fn take(c: &mut Completion) -> Finished {
        Finished {
            op: c.op,
            status: c.status,
            len: c.len,
            tag: c.tag,
            imm: c.imm,
            value: c.value,
            buf: c.buf.take(),
        }
    }
}

/// One operation's place between its post and its future.
enum Slot {
    Free,
    /// In flight; the future's waker once it was polled.
    Waiting(Option<Waker>),
    /// Completed; waits for its future to take it.
    Done(Finished),
    /// In flight, its future dropped: the completion is dropped when it comes.
    Abandoned,
}

/// The operations' slots: an operation's `wr_id` is its slot's generation (high half) and
/// index (low half).
struct Slots {
    slots: Vec<(u32, Slot)>,
    free: Vec<u32>,
    /// Slots `Waiting` or `Abandoned` (operations still in flight).
    pending: usize,
}

impl Slots {
    fn new() -> Slots {
        Slots {
            slots: Vec::new(),
            free: Vec::new(),
            pending: 0,
        }
    }

    #[inline]
    fn claim(&mut self) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i,
            None => self.grow(),
        };
        let s = &mut self.slots[index as usize];
        s.0 = s.0.wrapping_add(1);
        s.1 = Slot::Waiting(None);
        self.pending += 1;
        ((s.0 as u64) << 32) | index as u64
    }

    /// A new slot (the table only grows: slots are reused through `free`).
    #[cold]
    fn grow(&mut self) -> u32 {
        self.slots.push((0, Slot::Free));
        (self.slots.len() - 1) as u32
    }

    #[inline]
    fn get(&mut self, wr_id: u64) -> Option<&mut Slot> {
        let (gen, index) = ((wr_id >> 32) as u32, wr_id as u32);
        match self.slots.get_mut(index as usize) {
            Some((g, s)) if *g == gen => Some(s),
            _ => None,
        }
    }

    /// Frees the slot of `wr_id` (a stale id frees nothing).
    #[inline]
    fn release(&mut self, wr_id: u64) {
        if let Some(s) = self.get(wr_id) {
            *s = Slot::Free;
            self.free.push(wr_id as u32);
        }
    }

    /// The completion of `wr_id` when it is `Done` (its slot freed); `None` otherwise.
    #[inline]
    fn take_done(&mut self, wr_id: u64) -> Option<Finished> {
        let s = self.get(wr_id)?;
        if !matches!(s, Slot::Done(_)) {
            return None;
        }
        let Slot::Done(c) = std::mem::replace(s, Slot::Free) else {
            unreachable!()
        };
        self.free.push(wr_id as u32);
        Some(c)
    }

    /// A refused post: the slot goes back, the operation never ran.
    fn unclaim(&mut self, wr_id: u64) {
        self.pending -= 1;
        self.release(wr_id);
    }
}

struct Table {
    worker: Worker,
    ops: Slots,
    /// [`Op`]s posted and neither completed nor dropped.
    live_ops: usize,
    /// An [`Op`]'s own polls land here (`INLINE_POLL` completions, made once: a poll
    /// borrows them in place).
    inline: Vec<Completion>,
    /// The hold of every live [`Op`] on the shared state: taken by the first post, given up
    /// only when no handle and no `Op` is left (so an `Op` points at the state without a
    /// reference count of its own: no atomic read-modify-write per operation).
    keep: Option<Arc<Shared>>,
}

fn inline_events() -> Vec<Completion> {
    (0..INLINE_POLL).map(|_| Completion::default()).collect()
}

type Hook = Box<dyn FnMut() + Send>;

struct Shared {
    /// A duplicate of the worker's epoll fd, registered with tokio. Declared first: it is
    /// deregistered before the worker (and its fd) go.
    fd: AsyncFd<OwnedFd>,
    table: SpinLock<Table>,
    domain: Domain,
    opts: AsyncOptions,
    /// Handles (the [`AsyncWorker`] and its clones). The driver stops when there are none
    /// and no [`Op`] is live ([`Table::live_ops`], counted under the table's lock so that an
    /// operation costs no read-modify-write of a shared counter).
    users: AtomicUsize,
    closed: AtomicBool,
    /// A post happened since the driver last looked (it may have to progress an endpoint
    /// that no fd watches).
    kicked: AtomicBool,
    driver: Mutex<Option<Waker>>,
    before_arm: Mutex<Option<Hook>>,
    stats: Counters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it (a user hook, a backend) leaves consistent state: every
    // update under these locks is a single assignment or push.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    #[inline]
    fn kick(&self) {
        // Already kicked (the driver has not taken it yet, e.g. while it spins): nothing to
        // add, and no read-modify-write on the per-operation path.
        if !self.kicked.load(Ordering::Acquire) {
            self.kick_slow();
        }
    }

    #[cold]
    fn kick_slow(&self) {
        if !self.kicked.swap(true, Ordering::AcqRel) {
            if let Some(w) = lock(&self.driver).take() {
                w.wake();
            }
        }
    }

    fn add_user(self: &Arc<Self>) -> Arc<Self> {
        self.users.fetch_add(1, Ordering::Relaxed);
        self.clone()
    }

    /// A handle went: the last one closes the driver once no [`Op`] is live. (The count
    /// goes down before the table is locked, and an [`Op`] that finishes checks it under the
    /// lock: whichever of the two comes second sees the other and closes.)
    fn drop_user(&self) {
        if self.users.fetch_sub(1, Ordering::AcqRel) == 1 {
            let last = {
                let mut t = self.table.lock();
                (t.live_ops == 0).then(|| t.keep.take())
            };
            if let Some(keep) = last {
                self.close();
                // The caller's handle still holds the state: this is not its last reference.
                drop(keep);
            }
        }
    }

    /// An [`Op`] completed or was dropped (under the table's lock). `Some` when it was the
    /// last user: the driver must be closed after the lock is released, and the table's
    /// hold on the state (inside) dropped after every other use of it.
    #[inline]
    fn op_finished(&self, t: &mut Table) -> Option<Option<Arc<Shared>>> {
        t.live_ops -= 1;
        if t.live_ops == 0 && self.users.load(Ordering::Acquire) == 0 {
            Some(t.keep.take())
        } else {
            None
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Some(w) = lock(&self.driver).take() {
            w.wake();
        }
    }

    /// One poll of the worker; completions go to their slots, wakers into `wake`.
    fn progress(&self, events: &mut [Completion], wake: &mut Vec<Waker>) -> Result<usize> {
        let mut t = self.table.lock();
        let t = &mut *t;
        dispatch(&self.stats, &mut t.worker, &mut t.ops, events, None, |w| {
            wake.push(w)
        })
        .map(|(n, _)| n)
    }

    /// Whether a completion came (here or in an [`Op`]'s own poll) within the spin time.
    /// Completions are noticed by their count (`seen`: the count at the driver's last
    /// look), so that dispatching one costs no clock read; one that came since the last
    /// look counts as now.
    fn recently_busy(&self, seen: &mut u64, last_work: &mut Instant) -> bool {
        let now = Instant::now();
        let count = self.stats.completions.load(Ordering::Relaxed);
        if count != *seen {
            *seen = count;
            *last_work = now;
            return true;
        }
        now.saturating_duration_since(*last_work) < self.opts.spin
    }

    fn poll_wait(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.closed.load(Ordering::Acquire) || self.kicked.swap(false, Ordering::AcqRel) {
            return Poll::Ready(Ok(()));
        }
        *lock(&self.driver) = Some(cx.waker().clone());
        if self.closed.load(Ordering::Acquire) || self.kicked.swap(false, Ordering::AcqRel) {
            return Poll::Ready(Ok(()));
        }
        match self.fd.poll_read_ready(cx) {
            Poll::Ready(Ok(mut g)) => {
                // Clears only the readiness this wake-up saw; the poll that follows sees
                // everything before it, and anything later sets readiness again.
                g.clear_ready();
                bump(&self.stats.fd_wakeups);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Polls the (locked) worker into `events` and hands each completion to its slot; returns
/// how many came. With `mine` (the `wr_id` of an [`Op`] polling for itself), that
/// operation's own completion stays in `events` (its index is returned) and its slot is
/// released at once: it never sits in the table.
#[inline(always)]
fn dispatch(
    stats: &Counters,
    worker: &mut Worker,
    ops: &mut Slots,
    events: &mut [Completion],
    mine: Option<u64>,
    mut wake: impl FnMut(Waker),
) -> Result<(usize, Option<usize>)> {
    let n = worker.poll_completions(events)?;
    let mut found = None;
    for (i, c) in events[..n].iter_mut().enumerate() {
        let wr_id = c.wr_id;
        if mine == Some(wr_id) {
            // Its slot is `Waiting`: an Op that is polled exists, and it takes a `Done`
            // slot before it polls the worker.
            ops.pending -= 1;
            ops.release(wr_id);
            found = Some(i);
            continue;
        }
        let Some(slot) = ops.get(wr_id) else {
            // Not ours (an operation posted on the worker before it was handed over):
            // dropped, with its buffers, now.
            *c = Completion::default();
            continue;
        };
        match std::mem::replace(slot, Slot::Free) {
            Slot::Waiting(w) => {
                *slot = Slot::Done(Finished::take(c));
                ops.pending -= 1;
                if let Some(w) = w {
                    wake(w);
                }
            }
            Slot::Abandoned => {
                ops.pending -= 1;
                ops.release(wr_id);
                bump(&stats.abandoned);
                // Its buffer goes now (the operation is over).
                drop(c.buf.take());
            }
            other => {
                // Cannot happen (one completion per post); dropped.
                *slot = other;
                *c = Completion::default();
            }
        }
    }
    if n > 0 {
        // Also what the driver's spin watches (no clock read per completion: see
        // `recently_busy`).
        add_locked(&stats.completions, n as u64);
    }
    Ok((n, found))
}

async fn drive(shared: Arc<Shared>) {
    let mut events: Vec<Completion> = (0..shared.opts.batch.max(1))
        .map(|_| Completion::default())
        .collect();
    let mut wake = Vec::new();
    let mut last_work = Instant::now();
    let mut seen = shared.stats.completions.load(Ordering::Relaxed);
    let mut busy_rounds = 0u32;
    loop {
        if shared.closed.load(Ordering::Acquire) {
            break;
        }
        let r = shared.progress(&mut events, &mut wake);
        for w in wake.drain(..) {
            w.wake();
        }
        match r {
            Ok(0) => {}
            Ok(_) => {
                last_work = Instant::now();
                busy_rounds += 1;
                if busy_rounds.is_multiple_of(16) {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            Err(_) => {
                bump(&shared.stats.poll_errors);
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        }
        // Spin while a completion is recent, whether or not an operation is pending now:
        // the task a completion just woke has not run yet, and its next post (a ping-pong's
        // next receive and send) would otherwise find the driver armed and asleep, costing
        // an arm, a sleep and a kick per round trip (8x the blocking round trip on shm).
        if shared.recently_busy(&mut seen, &mut last_work) {
            tokio::task::yield_now().await;
            continue;
        }
        if let Some(h) = lock(&shared.before_arm).as_mut() {
            h();
        }
        bump(&shared.stats.arms);
        let armed = shared.table.lock().worker.arm();
        match armed {
            Ok(true) => {}
            Ok(false) => {
                bump(&shared.stats.arm_found_work);
                continue;
            }
            Err(_) => {
                bump(&shared.stats.poll_errors);
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        }
        bump(&shared.stats.sleeps);
        if std::future::poll_fn(|cx| shared.poll_wait(cx))
            .await
            .is_err()
        {
            bump(&shared.stats.poll_errors);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        last_work = Instant::now();
    }
}

/// A [`Worker`] on tokio: operations are futures; clones share it (see the [module
/// docs](self)).
pub struct AsyncWorker {
    shared: Arc<Shared>,
}

impl fmt::Debug for AsyncWorker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncWorker")
            .field("domain", &self.shared.domain.id())
            .field("kind", &self.shared.domain.kind())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Clone for AsyncWorker {
    fn clone(&self) -> Self {
        AsyncWorker {
            shared: self.shared.add_user(),
        }
    }
}

impl Drop for AsyncWorker {
    fn drop(&mut self) {
        self.shared.drop_user();
    }
}

impl AsyncWorker {
    /// An async worker with no endpoints for `domain`, with default [`AsyncOptions`].
    ///
    /// # Errors
    /// As [`from_worker`](Self::from_worker).
    pub fn new(domain: &Domain) -> Result<AsyncWorker> {
        Self::from_worker(Worker::new(domain)?, AsyncOptions::default())
    }

    /// An async worker with `opts`.
    ///
    /// # Errors
    /// As [`from_worker`](Self::from_worker).
    pub fn with_options(domain: &Domain, opts: AsyncOptions) -> Result<AsyncWorker> {
        Self::from_worker(Worker::new(domain)?, opts)
    }

    /// Takes over `worker` (with its endpoints) and spawns its driver on the current tokio
    /// runtime.
    ///
    /// Operations posted on `worker` before are not the async worker's: their completions
    /// are dropped (with their buffers) when they come. Post through the async worker.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside a tokio runtime, or in one built without IO
    /// (tokio's own check panics; that panic is caught and its message printed by the panic
    /// hook); [`Error::Io`] when the fd cannot be duplicated or registered with the reactor.
    pub fn from_worker(worker: Worker, opts: AsyncOptions) -> Result<AsyncWorker> {
        let rt = tokio::runtime::Handle::try_current().map_err(|e| {
            Error::InvalidArgument(format!("AsyncWorker needs a tokio runtime: {e}"))
        })?;
        let dup = worker
            .wait_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup", e))?;
        let fd = {
            let _enter = rt.enter();
            // tokio panics when the runtime has no IO driver: made a typed error here.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: `dup` is an open fd that the `OwnedFd` owns and keeps open for as
                // long as the `AsyncFd` holds it; `as_raw_fd` always returns that same fd.
                unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
            }))
            .map_err(|_| {
                Error::InvalidArgument(
                    "AsyncWorker needs a tokio runtime with IO enabled (enable_io / enable_all)"
                        .into(),
                )
            })?
            .map_err(|e| Error::io("AsyncFd registration", e.into()))?
        };
        let shared = Arc::new(Shared {
            fd,
            domain: worker.domain().clone(),
            table: SpinLock::new(Table {
                worker,
                ops: Slots::new(),
                live_ops: 0,
                inline: inline_events(),
                keep: None,
            }),
            opts,
            users: AtomicUsize::new(1),
            closed: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            driver: Mutex::new(None),
            before_arm: Mutex::new(None),
            stats: Counters::default(),
        });
        rt.spawn(drive(shared.clone()));
        Ok(AsyncWorker { shared })
    }

    /// The domain whose connections it serves.
    pub fn domain(&self) -> &Domain {
        &self.shared.domain
    }

    /// The options it runs with.
    pub fn options(&self) -> AsyncOptions {
        self.shared.opts
    }

    /// The driver's counters.
    pub fn stats(&self) -> AsyncWorkerStats {
        let c = &self.shared.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AsyncWorkerStats {
            posts: l(&c.posts),
            completions: l(&c.completions),
            abandoned: l(&c.abandoned),
            arms: l(&c.arms),
            arm_found_work: l(&c.arm_found_work),
            sleeps: l(&c.sleeps),
            fd_wakeups: l(&c.fd_wakeups),
            poll_errors: l(&c.poll_errors),
        }
    }

    /// Operations posted and not yet completed (including those whose future was dropped).
    pub fn in_flight(&self) -> usize {
        self.shared.table.lock().ops.pending
    }

    /// Test hook: `hook` runs in the driver after every poll that found nothing and before
    /// the arm that precedes a sleep — the window in which a completion must not be lost.
    /// `None` removes it. Not for production use.
    #[doc(hidden)]
    pub fn set_before_arm_hook(&self, hook: Option<Box<dyn FnMut() + Send>>) {
        *lock(&self.shared.before_arm) = hook;
    }

    /// [`Worker::add`]: its operations are this worker's from now on.
    ///
    /// # Errors
    /// As [`Worker::add`].
    pub fn add(&self, t: Box<dyn Transport>) -> Result<EndpointId> {
        let ep = self.shared.table.lock().worker.add(t)?;
        self.shared.kick();
        Ok(ep)
    }

    /// Adds the next connection `listener` finishes accepting, waiting for one (the
    /// listener is polled with a back-off of 20 µs growing to 2 ms).
    ///
    /// # Errors
    /// As [`Worker::accept`].
    pub async fn accept(&self, listener: &mut dyn Listener) -> Result<EndpointId> {
        let mut delay = Duration::from_micros(20);
        loop {
            if let Some(t) = listener.accept()? {
                return self.add(t);
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(2));
        }
    }

    /// Connects to `address` (with or without its `kind:` prefix) and adds the connection,
    /// without blocking the runtime (the handshake is polled with a back-off).
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout`; the backend's connection errors; [`add`](Self::add)'s.
    pub async fn connect(&self, address: &str, timeout: Duration) -> Result<EndpointId> {
        let mut c = self.shared.domain.connect(address)?;
        let end = Instant::now() + timeout;
        let mut delay = Duration::from_micros(20);
        loop {
            if let Some(t) = c.poll_connect()? {
                return self.add(t);
            }
            if Instant::now() > end {
                return Err(Error::Timeout("connect"));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(2));
        }
    }

    /// Takes `ep` out and hands its connection back.
    ///
    /// # Errors
    /// [`Error::Busy`] while operations are in flight on it (their futures wait for the
    /// completions this worker polls); [`Worker::remove`]'s errors.
    pub fn remove(&self, ep: EndpointId) -> Result<Box<dyn Transport>> {
        let mut t = self.shared.table.lock();
        if t.worker.endpoint(ep)?.in_flight() > 0 {
            return Err(Error::Busy("the endpoint has operations in flight"));
        }
        t.worker.remove(ep)
    }

    /// The capabilities of `ep`'s connection.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown id.
    pub fn capabilities(&self, ep: EndpointId) -> Result<Capabilities> {
        Ok(self.shared.table.lock().worker.endpoint(ep)?.capabilities())
    }

    /// Endpoints it holds.
    pub fn endpoints(&self) -> Vec<EndpointId> {
        self.shared.table.lock().worker.endpoints().collect()
    }

    /// A receive and then a send on `ep` (as [`recv`](Self::recv) then
    /// [`send`](Self::send)) under one acquisition of the worker's lock: the request /
    /// reply pattern (the reply's receive posted with the request, or the next request's
    /// receive with the reply) at about the cost of one post. Each [`Op`] says whether its
    /// post was refused; a refused receive does not stop the send.
    ///
    /// ```no_run
    /// # use fabric_core::async_worker::AsyncWorker;
    /// # async fn f(w: AsyncWorker, ep: fabric_core::EndpointId, rx: fabric_core::Buf, tx: fabric_core::Buf) {
    /// let (reply, request) = w.recv_send(ep, rx, tx);
    /// let (sent, tx) = request.await;
    /// let (got, rx) = reply.await;
    /// # }
    /// ```
    pub fn recv_send(&self, ep: EndpointId, rx: Buf, tx: Buf) -> (Op, Op) {
        let mut g = self.shared.table.lock();
        let r = self.submit_locked(&mut g, ep, rx, |c, b, id| c.post_recv(b, id));
        let s = self.submit_locked(&mut g, ep, tx, |c, b, id| c.post_send(b, id));
        drop(g);
        (self.op(r), self.op(s))
    }

    fn submit(
        &self,
        ep: EndpointId,
        buf: Buf,
        post: impl FnOnce(&mut dyn Transport, Buf, u64) -> PostResult,
    ) -> Op {
        let mut g = self.shared.table.lock();
        let r = self.submit_locked(&mut g, ep, buf, post);
        drop(g);
        self.op(r)
    }

    /// Posts under the (held) lock; the operation's id, or the refusal with the buffer.
    #[inline(always)]
    fn submit_locked(
        &self,
        t: &mut Table,
        ep: EndpointId,
        buf: Buf,
        post: impl FnOnce(&mut dyn Transport, Buf, u64) -> PostResult,
    ) -> std::result::Result<u64, PostError> {
        let wr_id = t.ops.claim();
        let r = match t.worker.endpoint(ep) {
            Ok(conn) => post(conn, buf, wr_id),
            Err(error) => Err(PostError { error, buf }),
        };
        match r {
            Ok(()) => {
                add_locked(&self.shared.stats.posts, 1);
                t.live_ops += 1;
                if t.keep.is_none() {
                    t.keep = Some(self.shared.clone());
                }
                Ok(wr_id)
            }
            Err(e) => {
                t.ops.unclaim(wr_id);
                Err(e)
            }
        }
    }

    /// The future of a post made (after the lock is released: a post kicks the driver).
    #[inline(always)]
    fn op(&self, r: std::result::Result<u64, PostError>) -> Op {
        match r {
            Ok(wr_id) => {
                self.shared.kick();
                Op {
                    shared: Some(NonNull::from(&*self.shared)),
                    wr_id,
                    refused: None,
                }
            }
            Err(e) => Op {
                shared: None,
                wr_id: 0,
                refused: Some(Box::new((e.error, e.buf))),
            },
        }
    }

    /// Sends `buf` to `ep`'s peer ([`Transport::post_send`]).
    pub fn send(&self, ep: EndpointId, buf: Buf) -> Op {
        self.submit(ep, buf, |c, b, id| c.post_send(b, id))
    }

    /// Receives the next message into `buf` ([`Transport::post_recv`]); the [`Done`] says
    /// how many bytes came.
    pub fn recv(&self, ep: EndpointId, buf: Buf) -> Op {
        self.submit(ep, buf, |c, b, id| c.post_recv(b, id))
    }

    /// Sends `buf` with `tag` ([`Transport::post_send_tagged`]).
    pub fn send_tagged(&self, ep: EndpointId, buf: Buf, tag: u64) -> Op {
        self.submit(ep, buf, |c, b, id| c.post_send_tagged(b, tag, id))
    }

    /// Receives a message whose tag `t` satisfies `t & mask == tag & mask`
    /// ([`Transport::post_recv_tagged`]); [`Done::tag`] is the tag it carried.
    pub fn recv_tagged(&self, ep: EndpointId, buf: Buf, tag: u64, mask: u64) -> Op {
        self.submit(ep, buf, |c, b, id| c.post_recv_tagged(b, tag, mask, id))
    }

    /// Writes `buf` into the peer's region at `remote_offset` ([`Transport::post_write`]).
    pub fn write(&self, ep: EndpointId, buf: Buf, remote: &RemoteKey, remote_offset: u64) -> Op {
        self.submit(ep, buf, |c, b, id| {
            c.post_write(b, remote, remote_offset, id)
        })
    }

    /// Writes `buf` and notifies the peer with `imm` ([`Transport::post_write_imm`]).
    pub fn write_imm(
        &self,
        ep: EndpointId,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        imm: u32,
    ) -> Op {
        self.submit(ep, buf, |c, b, id| {
            c.post_write_imm(b, remote, remote_offset, imm, id)
        })
    }

    /// Reads the peer's region at `remote_offset` into `buf` ([`Transport::post_read`]).
    pub fn read(&self, ep: EndpointId, buf: Buf, remote: &RemoteKey, remote_offset: u64) -> Op {
        self.submit(ep, buf, |c, b, id| {
            c.post_read(b, remote, remote_offset, id)
        })
    }

    /// A remote atomic on the peer's word at `remote_offset`; the old value comes back in
    /// [`Done::value`] and in `buf` ([`Transport::post_atomic`]).
    pub fn atomic(
        &self,
        ep: EndpointId,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        op: AtomicOp,
    ) -> Op {
        self.submit(ep, buf, |c, b, id| {
            c.post_atomic(b, remote, remote_offset, op, id)
        })
    }
}

/// The error an operation that completed with `status` resolves to.
fn status_error(op: OpKind, status: Status, len: usize, buf_len: usize) -> Error {
    match status {
        Status::MessageTooLong => Error::MessageTooLarge { len, max: buf_len },
        Status::RemoteAccess => Error::AccessDenied("access at the peer (refused by the peer)"),
        Status::ProtocolError => Error::Protocol(format!("{op:?} failed: protocol error")),
        Status::Canceled => Error::Disconnected(format!("{op:?} canceled: connection closed")),
        _ => Error::Disconnected(format!("{op:?} failed: the peer went away")),
    }
}

fn finish(c: Finished) -> BufResult<Done> {
    let buf = c
        .buf
        .expect("a completion of a single-buffer operation hands its buffer back");
    let r = if c.status.is_ok() {
        Ok(Done {
            op: c.op,
            len: c.len,
            tag: c.tag,
            imm: c.imm,
            value: c.value,
        })
    } else {
        Err(status_error(c.op, c.status, c.len, buf.len()))
    };
    (r, buf)
}

/// A posted operation: resolves to its completion with the buffer back
/// ([`BufResult`]`<`[`Done`]`>`). How a completion that failed maps to [`Error`]:
/// `MessageTooLong` → [`Error::MessageTooLarge`], `RemoteAccess` → [`Error::AccessDenied`],
/// `ProtocolError` → [`Error::Protocol`], `PeerGone` / `Canceled` →
/// [`Error::Disconnected`]. A refused post resolves at once with the post's error.
///
/// Dropping it does not cancel the operation (see the [module docs](self#cancellation)).
#[must_use = "an Op does nothing more when not awaited: the operation is already posted, and dropping it only forgets the result"]
pub struct Op {
    /// The worker's shared state while the operation is posted and its result not taken.
    /// Valid for as long as this `Op` is counted in the table's `live_ops`: the table's
    /// `keep` holds the state while any `Op` is.
    shared: Option<NonNull<Shared>>,
    wr_id: u64,
    /// A refused post's error and buffer (boxed: the posted case, the hot one, moves a
    /// small `Op`).
    refused: Option<Box<(Error, Buf)>>,
}

// SAFETY: `Op` only reaches `Shared` (which is `Send + Sync`) through its pointer, by
// shared reference, as an `Arc<Shared>` would; the pointer stays valid wherever the `Op`
// goes (see `Op::shared`).
unsafe impl Send for Op {}
// SAFETY: as above; `&Op` only reads whether the pointer is set.
unsafe impl Sync for Op {}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Op")
            .field("posted", &self.shared.is_some())
            .field("refused", &self.refused.as_ref().map(|r| &r.0))
            .finish()
    }
}

impl Op {
    /// Whether it was posted (`false`: it resolves at once with the post's error).
    pub fn is_posted(&self) -> bool {
        self.shared.is_some()
    }
}

impl Future for Op {
    type Output = BufResult<Done>;

    /// # Panics
    /// When polled again after it returned `Ready`.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(ptr) = this.shared else {
            let (e, b) = *this.refused.take().expect("Op polled after it completed");
            return Poll::Ready((Err(e), b));
        };
        // SAFETY: this Op is counted in `live_ops` until below (see `Op::shared`), and the
        // reference is not used after the table's hold (`last`) is dropped.
        let shared: &Shared = unsafe { ptr.as_ref() };
        let wr_id = this.wr_id;
        let mut g = shared.table.lock();
        // Others' completions found by this poll: their tasks are woken after the unlock.
        let mut woken: [Option<Waker>; INLINE_POLL] = Default::default();
        // How many of `woken` are set (only those are looked at again).
        let mut k = 0;
        let out = match g.ops.get(wr_id) {
            Some(Slot::Done(_)) => g.ops.take_done(wr_id),
            Some(Slot::Waiting(_)) => {
                // Not done yet: poll the worker here first (the completion is often there
                // already, e.g. a send's), which saves a round through the driver task. A
                // failing poll is left to the driver (it counts and retries). The spin's
                // deadline is read from the clock only once the first poll found nothing,
                // and then every `CLOCK_EVERY` polls: a clock read costs as much as an
                // empty poll.
                let mut spin_until: Option<Instant> = None;
                let mut rounds = 0u32;
                let out = loop {
                    let t = &mut *g;
                    let room = INLINE_POLL - k;
                    let r = dispatch(
                        &shared.stats,
                        &mut t.worker,
                        &mut t.ops,
                        &mut t.inline[..room],
                        Some(wr_id),
                        |w| {
                            woken[k] = Some(w);
                            k += 1;
                        },
                    );
                    if let Ok((_, Some(i))) = r {
                        break Some(Finished::take(&mut t.inline[i]));
                    }
                    if k == INLINE_POLL || shared.opts.op_spin.is_zero() {
                        break None;
                    }
                    if rounds.is_multiple_of(CLOCK_EVERY) {
                        let now = Instant::now();
                        if now >= *spin_until.get_or_insert(now + shared.opts.op_spin) {
                            break None;
                        }
                    }
                    rounds = rounds.wrapping_add(1);
                    std::hint::spin_loop();
                    if !rounds.is_multiple_of(CLOCK_EVERY) {
                        continue;
                    }
                    // Posts from other threads get the worker every `CLOCK_EVERY` polls
                    // (not after each: taking the lock costs an atomic read-modify-write,
                    // more than an empty poll).
                    drop(g);
                    std::hint::spin_loop();
                    g = shared.table.lock();
                    // Another thread's poll may have finished it meanwhile.
                    if let Some(c) = g.ops.take_done(wr_id) {
                        break Some(c);
                    }
                };
                if out.is_none() {
                    if let Some(Slot::Waiting(w)) = g.ops.get(wr_id) {
                        if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                            *w = Some(cx.waker().clone());
                        }
                    }
                }
                // That poll may have taken a parked endpoint's fd event and left the
                // endpoint active (no longer watched): have the driver poll and arm again
                // before it sleeps, or work arriving there would wake nobody.
                shared.kick();
                out
            }
            Some(Slot::Free | Slot::Abandoned) | None => {
                unreachable!("an Op's slot stays claimed until the Op takes or drops it")
            }
        };
        let last = if out.is_some() {
            shared.op_finished(&mut g)
        } else {
            None
        };
        drop(g);
        for w in woken[..k].iter_mut().filter_map(Option::take) {
            w.wake();
        }
        match out {
            Some(c) => {
                this.shared = None;
                if let Some(keep) = last {
                    shared.close();
                    // The last use of `shared`: the state may go with it.
                    drop(keep);
                }
                Poll::Ready(finish(c))
            }
            None => Poll::Pending,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        let Some(ptr) = self.shared.take() else {
            return;
        };
        // SAFETY: this Op is still counted in `live_ops` until `op_finished` below, and the
        // reference is not used after the table's hold (`last`) is dropped.
        let shared: &Shared = unsafe { ptr.as_ref() };
        let (done, last) = {
            let mut g = shared.table.lock();
            let t = &mut *g;
            let done = match t.ops.get(self.wr_id) {
                Some(slot @ Slot::Waiting(_)) => {
                    // Still in flight: the transport holds the buffer; the driver drops the
                    // completion (and the buffer) when it comes.
                    *slot = Slot::Abandoned;
                    None
                }
                _ => t.ops.take_done(self.wr_id),
            };
            (done, shared.op_finished(t))
        };
        // The operation is over for its future: its buffer may go (outside the lock).
        drop(done);
        if let Some(keep) = last {
            shared.close();
            // The last use of `shared`: the state may go with it.
            drop(keep);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_and_ops_move_between_tasks() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<AsyncWorker>();
        send::<Op>();
    }

    #[test]
    fn slot_ids_carry_a_generation() {
        let mut t = Slots::new();
        let a = t.claim();
        assert_eq!(t.pending, 1);
        t.unclaim(a);
        assert_eq!(t.pending, 0);
        let b = t.claim();
        assert_eq!(a as u32, b as u32, "the slot is reused");
        assert_ne!(a, b, "with a new generation");
        assert!(t.get(a).is_none(), "the old id is refused");
        assert!(matches!(t.get(b), Some(Slot::Waiting(None))));
    }

    #[test]
    fn outside_a_runtime_it_is_a_typed_error() {
        let d = Domain::open(crate::TransportKind::Shm, &Default::default()).unwrap();
        let e = AsyncWorker::new(&d).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // a runtime without IO: tokio would panic; a typed error instead
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _enter = rt.enter();
        let e = AsyncWorker::new(&d).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
