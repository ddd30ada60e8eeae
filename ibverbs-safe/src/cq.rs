//! Completion queues, completions and completion channels.
#![allow(unsafe_code)]

use crate::context::Context;
use crate::error::{last_os_error, rc_error, Error, Result, WcStatus};
use crate::inflight::{QueueKind, SgList, WorkQueue};
use crate::mr::MrSlice;
use crate::result::{ops, record_drop_failure};
use crate::sys::{self, ibv_comp_channel, ibv_cq, ibv_wc};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) struct ChannelInner {
    ctx: Context,
    ch: *mut ibv_comp_channel,
}

// SAFETY: completion channels are thread-safe verbs objects.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it, so none is alive.
        let rc = unsafe { (self.ctx.inner.v.destroy_comp_channel)(self.ch) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_comp_channel", rc);
        }
    }
}

/// A completion channel: its file descriptor becomes readable when a CQ attached to it and
/// armed with [`CompletionQueue::req_notify`] receives a completion. Wait on it with
/// [`wait`](Self::wait), or add [`as_raw_fd`](AsRawFd::as_raw_fd) to your own poll/epoll set
/// and call [`get_event`](Self::get_event) when it is readable.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl std::fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

/// A completion event: which CQ has new completions (compare with [`CompletionQueue::id`]).
/// The CQ must be re-armed with [`CompletionQueue::req_notify`] for the next event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CqEvent {
    /// The CQ's id.
    pub cq_id: u64,
}

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is live.
        let ch = unsafe { (ctx.inner.v.create_comp_channel)(ctx.inner.ctx) };
        if ch.is_null() {
            return Err(Error::CreateCompChannel(last_os_error()));
        }
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: ctx.clone(),
                ch,
            }),
        })
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live for as long as `self`.
        unsafe { (*self.inner.ch).fd }
    }

    /// Switches the fd between blocking (default) and non-blocking mode.
    ///
    /// # Errors
    /// [`Error::CqEvent`] if `fcntl` fails.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        let fd = self.fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL have no memory effects.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl < 0 {
                return Err(Error::CqEvent(last_os_error()));
            }
            let fl = if nonblocking {
                fl | libc::O_NONBLOCK
            } else {
                fl & !libc::O_NONBLOCK
            };
            if libc::fcntl(fd, libc::F_SETFL, fl) < 0 {
                return Err(Error::CqEvent(last_os_error()));
            }
        }
        Ok(())
    }

    /// Reads one event (blocks unless the fd is non-blocking) and acknowledges it.
    ///
    /// # Errors
    /// [`Error::CqEvent`] (`EAGAIN` when non-blocking and no event is pending).
    pub fn get_event(&self) -> Result<CqEvent> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is live and both out-pointers are valid.
        let rc = unsafe { (self.inner.ctx.inner.v.get_cq_event)(self.inner.ch, &mut cq, &mut ctx) };
        if rc != 0 {
            return Err(Error::CqEvent(last_os_error()));
        }
        // SAFETY: `cq` was just returned by ibv_get_cq_event; ibv_destroy_cq waits until its
        // events are acknowledged, so it is still alive here. We acknowledge right away.
        unsafe { (self.inner.ctx.inner.v.ack_cq_events)(cq, 1) };
        Ok(CqEvent { cq_id: cq as u64 })
    }

    /// Waits up to `timeout` (forever with `None`) for an event.
    ///
    /// # Errors
    /// [`Error::CqEvent`] if `poll` or reading the event fails.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<CqEvent>> {
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
        loop {
            // SAFETY: `pfd` is a valid pollfd array of length 1.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let e = last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::CqEvent(e));
            }
            if n == 0 {
                return Ok(None);
            }
            return self.get_event().map(Some);
        }
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open for as long as the channel (and so `self`) lives.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

pub(crate) struct CqInner {
    pub(crate) ctx: Context,
    pub(crate) cq: *mut ibv_cq,
    _channel: Option<Arc<ChannelInner>>,
    /// Slot tables of every work queue that reports to this CQ. A table stays here until its
    /// queue was destroyed *and* a poll that started after that found the CQ empty, so a
    /// completion's `wr_id` always points at live memory (even a late, flushed completion of
    /// a QP that is already gone).
    attached: Mutex<Vec<Arc<WorkQueue>>>,
    /// How many attached queues were retired (destroyed) so far; each retired queue records
    /// its number in `WorkQueue::retired_at`.
    retired: AtomicUsize,
}

// SAFETY: CQs are thread-safe verbs objects; `attached` is behind a Mutex.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl CqInner {
    pub(crate) fn attach(&self, wq: &Arc<WorkQueue>) {
        let mut v = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        if !v.iter().any(|q| Arc::ptr_eq(q, wq)) {
            v.push(wq.clone());
        }
    }

    /// Marks `wq` (attached here) as destroyed: the device makes no new completion for it.
    /// Its table is detached by the poller once no completion can still name it.
    pub(crate) fn retire(&self, wq: &Arc<WorkQueue>) {
        let _v = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        if wq.retired_at.load(Ordering::Relaxed) != 0 {
            return;
        }
        let seq = self.retired.load(Ordering::Relaxed) + 1;
        wq.retired_at.store(seq, Ordering::Relaxed);
        self.retired.store(seq, Ordering::Release);
    }

    /// Detaches the queues retired up to number `upto`: called by the single poller after a
    /// poll that began after it read `upto` (so after those queues' destruction) found the
    /// CQ empty, so no completion naming their slots is left.
    #[cold]
    #[inline(never)]
    fn detach_retired(&self, upto: usize) {
        let mut v = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|q| {
            let r = q.retired_at.load(Ordering::Relaxed);
            r == 0 || r > upto
        });
    }
}

#[cfg(test)]
impl CqInner {
    /// Number of slot tables attached.
    pub(crate) fn attached_len(&self) -> usize {
        self.attached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so all are destroyed; `cq` came
        // from ibv_create_cq and is destroyed exactly once.
        let rc = unsafe { (self.ctx.inner.v.destroy_cq)(self.cq) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_cq", rc);
        }
    }
}

/// A completion queue. Polling needs `&mut self`: one poller per CQ, which is what lets the
/// completion hand posted buffers back without locks. Several QPs may share a CQ; each
/// [`Completion`] says which QP and queue it came from and carries that work request's
/// buffers.
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    /// Completions of other work that a [`QueuePair::scope`](crate::QueuePair::scope) polled
    /// while waiting for its own; handed out first by the next [`poll`](Self::poll).
    pub(crate) stash: std::collections::VecDeque<Completion>,
    /// Raw completions taken from the device but not yet handed out, because a buffer's
    /// drop panicked in the middle of a poll: handled first by the next poll.
    pending: std::collections::VecDeque<ibv_wc>,
    /// Retired queues up to this number are detached already.
    detached_upto: usize,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("id", &self.id())
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Opcode of a completion (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// SEND (with or without immediate).
    Send,
    /// RDMA WRITE (with or without immediate).
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// Atomic compare-and-swap.
    CompareSwap,
    /// Atomic fetch-and-add.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// Anything else.
    Other(u32),
}

impl WcOpcode {
    fn from_raw(v: u32) -> Self {
        match v {
            sys::IBV_WC_SEND => WcOpcode::Send,
            sys::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            sys::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            sys::IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
            sys::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            sys::IBV_WC_RECV => WcOpcode::Recv,
            sys::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            o => WcOpcode::Other(o),
        }
    }
}

/// One work completion, with the buffers of its work request handed back.
pub struct Completion {
    wr_id: u64,
    /// The raw work completion (decoded on access).
    wc: ibv_wc,
    queue: Option<QueueKind>,
    bufs: SgList,
    pub(crate) scoped: bool,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("wr_id", &self.wr_id)
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm", &self.imm())
            .field("qp_num", &self.qp_num())
            .field("queue", &self.queue)
            .field("bufs", &self.bufs)
            .finish()
    }
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            wc: ibv_wc {
                opcode: u32::MAX,
                ..ibv_wc::default()
            },
            queue: None,
            bufs: SgList::new(),
            scoped: false,
        }
    }
}

impl Completion {
    /// `n` empty completions: a reusable buffer for [`CompletionQueue::poll`].
    pub fn buffer(n: usize) -> Vec<Completion> {
        (0..n).map(|_| Completion::default()).collect()
    }

    /// Your id of the work request (given when posting).
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
    /// The status.
    #[inline]
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.wc.status)
    }
    /// Whether the status is success.
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.wc.status == 0
    }
    /// `Ok(())` on success, else [`Error::Completion`] with the status.
    ///
    /// # Errors
    /// [`Error::Completion`].
    pub fn result(&self) -> Result<()> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(Error::Completion(self.status()))
        }
    }
    /// The opcode (only meaningful on success for send-side completions).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.wc.opcode)
    }
    /// Vendor error syndrome.
    pub fn vendor_err(&self) -> u32 {
        self.wc.vendor_err
    }
    /// Bytes received (receives, READ and atomics).
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.wc.byte_len
    }
    /// Immediate data (host byte order), if the message carried one.
    #[inline]
    pub fn imm(&self) -> Option<u32> {
        (self.wc.wc_flags & sys::IBV_WC_WITH_IMM != 0).then(|| u32::from_be(self.wc.imm_data))
    }
    /// The local QP number the completion belongs to.
    #[inline]
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num
    }
    /// Source QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.wc.src_qp
    }
    /// Whether a UD receive carries a GRH (in the first 40 bytes of the buffer).
    pub fn has_grh(&self) -> bool {
        self.wc.wc_flags & sys::IBV_WC_GRH != 0
    }
    /// Source LID (UD receives).
    pub fn slid(&self) -> u16 {
        self.wc.slid
    }
    /// Which queue it came from (`None` for work requests posted through the raw layer).
    #[inline]
    pub fn queue(&self) -> Option<QueueKind> {
        self.queue
    }
    /// The buffers of the work request.
    pub fn bufs(&self) -> &SgList {
        &self.bufs
    }
    /// Takes the buffers out.
    pub fn take_bufs(&mut self) -> SgList {
        self.bufs.take()
    }
    /// Takes the first buffer out (the usual single-buffer case).
    pub fn take_buf(&mut self) -> Option<MrSlice> {
        self.bufs.take().into_first()
    }

    /// Drops the buffers an earlier poll left here. Done before a slot is claimed, so a
    /// panicking drop leaves the completion unconsumed (it is retried), not a slot claimed.
    #[inline(always)]
    fn clear_bufs(&mut self) {
        self.bufs.clear();
    }

    /// Takes `wc` in; its buffers must have been cleared ([`clear_bufs`](Self::clear_bufs)).
    /// Claiming the slot and moving its buffers here cannot panic; releasing the earlier
    /// unsignalled slots the completion retires (done last) may. With `TALLY`, counts the
    /// completion in `tally` when it is one of the tally's scope (see [`ScopeTally`]).
    #[inline(always)]
    fn fill<const TALLY: bool>(&mut self, wc: &ibv_wc, tally: &mut ScopeTally, at: usize) {
        self.wc = *wc;
        if wc.wr_id & 1 == 0 {
            let (wr_id, scoped, queue) = (&mut self.wr_id, &mut self.scoped, &mut self.queue);
            // SAFETY: even wr_ids on queues created by this crate are slot addresses from
            // `WorkQueue::fill`/`Slot::post` (the raw layer only accepts odd ids); the slot's
            // queue is kept alive by the CQ's `attached` list; `&mut CompletionQueue` makes
            // us the single poller; our buffers are empty (cleared before).
            let claimed = unsafe {
                WorkQueue::complete_into(wc.wr_id, &mut self.bufs, |c| {
                    *wr_id = c.user;
                    *scoped = c.scoped;
                    *queue = Some(c.kind);
                    if TALLY && c.scoped && std::ptr::eq(c.queue, tally.queue) {
                        tally.hits += 1;
                        if wc.status != 0 && tally.first_bad.is_none() {
                            tally.first_bad = Some(at);
                        }
                    }
                })
            };
            if claimed {
                return;
            }
            self.wr_id = 0;
        } else {
            self.wr_id = wc.wr_id;
        }
        self.queue = None;
        self.scoped = false;
    }
}

/// What a [`Scope`](crate::Scope)'s poll counts while the completions are taken in (instead
/// of a second pass over them): the completions of scoped work requests of one send queue,
/// and where the first of them with an error status landed in `out`.
pub(crate) struct ScopeTally {
    /// The scope's send queue (compared, never dereferenced).
    pub(crate) queue: *const WorkQueue,
    /// How many completions of the scope were taken in.
    pub(crate) hits: usize,
    /// The index in `out` of the first of them with an error status.
    pub(crate) first_bad: Option<usize>,
}

impl ScopeTally {
    /// A tally that counts nothing (for plain polls).
    #[inline(always)]
    pub(crate) fn none() -> Self {
        ScopeTally {
            queue: std::ptr::null(),
            hits: 0,
            first_bad: None,
        }
    }
}

/// What a poll has not handed out yet, should a buffer's drop panic midway (its `Drop` runs
/// only then): the completions already written to `out[..done + k]` go to the stash, the raw
/// ones from `k` on that were taken from the device stay pending; the next poll hands out
/// both, in order.
struct Unhanded<'a> {
    stash: &'a mut std::collections::VecDeque<Completion>,
    pending: &'a mut std::collections::VecDeque<ibv_wc>,
    out: *mut Completion,
    done: usize,
    wcs: *const ibv_wc,
    k: usize,
    n: usize,
}

impl Drop for Unhanded<'_> {
    fn drop(&mut self) {
        // Runs only on unwinding (a finished poll forgets the guard).
        for i in 0..self.done + self.k {
            // SAFETY: `out` has at least `done + n` entries, exclusively borrowed by the poll.
            self.stash
                .push_back(std::mem::take(unsafe { &mut *self.out.add(i) }));
        }
        for i in self.k..self.n {
            // SAFETY: the first `n` entries of `wcs` were initialised by the provider.
            self.pending.push_back(unsafe { *self.wcs.add(i) });
        }
    }
}

impl CompletionQueue {
    pub(crate) fn new(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Self> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.ch);
        let n = cqe.clamp(1, i32::MAX as u32);
        // SAFETY: the context (and channel, if any) are live.
        let cq = unsafe {
            (ctx.inner.v.create_cq)(ctx.inner.ctx, n as i32, std::ptr::null_mut(), ch, 0)
        };
        if cq.is_null() {
            return Err(Error::CreateCq {
                cqe,
                source: last_os_error(),
            });
        }
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: ctx.clone(),
                cq,
                _channel: channel.map(|c| c.inner.clone()),
                attached: Mutex::new(Vec::new()),
                retired: AtomicUsize::new(0),
            }),
            stash: std::collections::VecDeque::new(),
            pending: std::collections::VecDeque::new(),
            detached_upto: 0,
        })
    }

    /// An id that [`CqEvent::cq_id`] reports for this CQ.
    pub fn id(&self) -> u64 {
        self.inner.cq as u64
    }

    /// Number of entries the CQ really has (may exceed what was asked for).
    pub fn capacity(&self) -> u32 {
        // SAFETY: the CQ is live.
        unsafe { (*self.inner.cq).cqe.max(0) as u32 }
    }

    /// Polls up to `out.len()` completions into `out`, returning how many were written.
    /// Buffers left in `out` entries from an earlier poll are dropped when overwritten.
    ///
    /// If dropping such a buffer (or one of an earlier unsignalled work request that a
    /// completion retires) panics, the panic propagates, and the completions already taken
    /// from the device but not handed out are kept for the next poll: none is lost, and no
    /// slot is left claimed.
    ///
    /// # Errors
    /// [`Error::PollCq`] if the provider reports an error.
    #[inline]
    pub fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        let mut done = 0;
        if !self.stash.is_empty() {
            done = self.poll_stash(out);
        }
        self.poll_device::<false>(out, done, &mut ScopeTally::none())
    }

    #[cold]
    #[inline(never)]
    pub(crate) fn poll_stash(&mut self, out: &mut [Completion]) -> usize {
        let mut done = 0;
        while done < out.len() {
            match self.stash.pop_front() {
                Some(c) => out[done] = c,
                None => break,
            }
            done += 1;
        }
        done
    }

    /// Fills `out[done..]` from the completions a panic left pending, then from the device
    /// (not from the stash); returns the new `done`.
    #[inline]
    pub(crate) fn poll_device<const TALLY: bool>(
        &mut self,
        out: &mut [Completion],
        mut done: usize,
        tally: &mut ScopeTally,
    ) -> Result<usize> {
        // Up to 32 work completions per provider call (one call for a typical window of 32
        // in flight: the provider's lock and call are paid once, not twice).
        const CHUNK: usize = 32;
        if !self.pending.is_empty() {
            done = self.poll_pending::<TALLY>(out, done, tally);
        }
        // Queues retired before this point were destroyed before the poll below begins.
        let retired = self.inner.retired.load(Ordering::Acquire);
        let mut wcs = [MaybeUninit::<ibv_wc>::uninit(); CHUNK];
        while done < out.len() {
            let want = (out.len() - done).min(CHUNK);
            // SAFETY: the CQ is live and `wcs` has room for `want` entries.
            let n = unsafe { ops::poll_cq(self.inner.cq, want as i32, wcs.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(Error::PollCq(rc_error(n)));
            }
            let n = (n as usize).min(want);
            let base = out[..done + n].as_mut_ptr();
            let first: *const ibv_wc = wcs.as_ptr().cast();
            let mut left = Unhanded {
                stash: &mut self.stash,
                pending: &mut self.pending,
                out: base,
                done,
                wcs: first,
                k: 0,
                n,
            };
            // Walked with two pointers (entry `k` of `wcs` into `out[done + k]`).
            // SAFETY: `done <= done + n`: inside (or one past) `out[..done + n]`; `n` entries of
            // `wcs`.
            let (mut o, mut w, end) = unsafe { (base.add(done), first, first.add(n)) };
            while w != end {
                // SAFETY: `w` is below `end`, so `o` below `base + done + n`: inside the
                // exclusively borrowed `out[..done + n]`, reached only through `base` while
                // `left` lives.
                let c = unsafe { &mut *o };
                c.clear_bufs();
                // From here on nothing can panic before `c` holds the completion.
                left.k += 1;
                // SAFETY: the provider initialised the first `n` entries.
                c.fill::<TALLY>(unsafe { &*w }, tally, done + left.k - 1);
                // SAFETY: at most one past the last entry of each.
                unsafe {
                    o = o.add(1);
                    w = w.add(1);
                }
            }
            std::mem::forget(left);
            done += n;
            if n < want {
                // The CQ was empty: no completion of a queue retired before this poll began
                // is left in it.
                if retired != self.detached_upto && self.pending.is_empty() {
                    self.inner.detach_retired(retired);
                    self.detached_upto = retired;
                }
                break;
            }
        }
        Ok(done)
    }

    #[cold]
    #[inline(never)]
    fn poll_pending<const TALLY: bool>(
        &mut self,
        out: &mut [Completion],
        mut done: usize,
        tally: &mut ScopeTally,
    ) -> usize {
        while done < out.len() {
            let Some(wc) = self.pending.front().copied() else {
                break;
            };
            let o = &mut out[done];
            o.clear_bufs();
            self.pending.pop_front();
            // A panic here (releasing retired slots) leaves `o` filled but not reported:
            // rare enough (a second panicking drop) to accept.
            o.fill::<TALLY>(&wc, tally, done);
            done += 1;
        }
        done
    }

    /// Busy-polls until at least one completion arrived (then returns what [`poll`](Self::poll)
    /// returned) or `timeout` passed.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::PollCq`].
    pub fn poll_blocking(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let n = self.poll(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                if start.elapsed() >= timeout {
                    return Err(Error::Timeout(timeout));
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Polls until exactly `n` completions were collected into `out[..n]` or `timeout` passed.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::PollCq`], [`Error::InvalidArgument`] when `out` is too small.
    pub fn poll_exact(
        &mut self,
        out: &mut [Completion],
        n: usize,
        timeout: Duration,
    ) -> Result<()> {
        if out.len() < n {
            return Err(Error::InvalidArgument(format!(
                "poll_exact: {n} completions do not fit in {}",
                out.len()
            )));
        }
        let start = Instant::now();
        let mut got = 0;
        while got < n {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            got += self.poll_blocking(&mut out[got..n], left)?;
        }
        Ok(())
    }

    /// Arms the CQ: the next completion (or next solicited one) triggers an event on its
    /// completion channel.
    ///
    /// # Errors
    /// [`Error::ReqNotifyCq`].
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is live.
        let rc = unsafe { ops::req_notify_cq(self.inner.cq, solicited_only) };
        if rc != 0 {
            return Err(Error::ReqNotifyCq(rc_error(rc)));
        }
        Ok(())
    }

    /// The context the CQ belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }
}

/// What [`AsyncCompletionQueue`](crate::AsyncCompletionQueue) needs of a channel.
#[cfg(feature = "tokio")]
impl CompletionChannel {
    pub(crate) fn raw(&self) -> *mut ibv_comp_channel {
        self.inner.ch
    }

    pub(crate) fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Whether `cq` reports to this channel and nothing else holds it: no other CQ (each
    /// holds a reference) and no other clone of this handle.
    pub(crate) fn is_exclusive_to(&self, cq: &CompletionQueue) -> bool {
        cq.inner
            ._channel
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &self.inner))
            && Arc::strong_count(&self.inner) == 2
    }
}
