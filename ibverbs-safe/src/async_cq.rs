//! Completion queues awaited on tokio (feature `tokio`).
//!
//! An [`AsyncCompletionQueue`] owns a [`CompletionQueue`] and the [`CompletionChannel`] it
//! reports to, and registers the channel's fd with the tokio reactor through
//! [`AsyncFd`](tokio::io::unix::AsyncFd). Awaiting the next completions runs the whole
//! notification protocol, which is easy to get wrong by hand:
//!
//! 1. poll the CQ; return what it had;
//! 2. empty: arm it (`ibv_req_notify_cq`) — once per event, not per wait;
//! 3. **poll again**: a completion that arrived after step 1 but before the arm raises no
//!    event (the arm only reports completions added after it), so without this re-poll it
//!    would sit in the CQ, unseen, until some later completion happened to wake the task;
//! 4. still empty: wait until the channel's fd is readable (the task sleeps; the runtime
//!    sits in `epoll_wait`), read every pending event without blocking, and acknowledge them
//!    in batches (`ibv_ack_cq_events` takes a lock, so it is called once per
//!    [`ACK_BATCH`] events and when the queue is dropped, not once per event); back to 1.
//!
//! # Posting while another task awaits
//!
//! Posting and polling are already separate objects that share no Rust state: a
//! [`QueuePair`](crate::QueuePair) is the single producer of its queues (posting takes
//! `&mut QueuePair`), a CQ the single consumer of its completions (polling takes
//! `&mut CompletionQueue`), and the two meet only in the in-flight slot table, whose
//! hand-over from poster to poller is lock-free. So the split is: one task owns the QP and
//! posts; another owns the `AsyncCompletionQueue` and awaits; both types are `Send`. The
//! buffers come back in the [`Completion`]s (owned handles), so the awaiting task can hand
//! them to the poster with any channel, or repost receives itself if it also owns that QP.
//! Build the QPs from [`cq`](AsyncCompletionQueue::cq) before moving the queue into its
//! task. No lock is needed — nor possible to need: nothing here is shared mutably.
//!
//! # Cancellation
//!
//! The futures here take completions from the device only inside a poll that then returns
//! them, so dropping a pending future loses nothing: the completions stay in the CQ (or in
//! the queue's own buffer) for the next call. An outstanding arm or unread event only causes
//! one extra, harmless wake-up later.
#![allow(unsafe_code)]

use crate::context::Context;
use crate::cq::{Completion, CompletionChannel, CompletionQueue};
use crate::error::{last_os_error, Error, Result};
use crate::sys::ibv_cq;
use std::future::poll_fn;
use std::pin::Pin;
use std::task::{self, Poll};
use tokio::io::unix::AsyncFd;

/// Events read from the channel are acknowledged once this many have accumulated (and when
/// the queue is dropped).
pub const ACK_BATCH: u32 = 32;

/// How many completions [`next_completion`](AsyncCompletionQueue::next_completion) and the
/// [`Stream`](futures_core::Stream) take from the device per poll.
const STREAM_BATCH: usize = 16;

type Hook = Box<dyn FnMut() + Send>;

/// Counters of the notification protocol (see the
/// [crate docs](crate#async-completions-feature-tokio)): what the queue did while it waited.
/// Cheap to read; meant for tests and tuning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncCqStats {
    /// Times the CQ was armed (`ibv_req_notify_cq`).
    pub arms: u64,
    /// Times the poll right after an arm found completions: each is a completion that landed
    /// between an empty poll and the arm, which no event would have reported.
    pub rearm_hits: u64,
    /// Times a wait found nothing and let the task sleep (returned `Pending`).
    pub sleeps: u64,
    /// Completion events read from the channel.
    pub events: u64,
    /// `ibv_ack_cq_events` calls made.
    pub ack_calls: u64,
}

/// A completion queue whose completions a tokio task can `.await`, one batch at a time
/// ([`next_batch`](Self::next_batch)), one by one ([`next_completion`](Self::next_completion)),
/// or as a [`Stream`](futures_core::Stream) of `Result<Completion>`. See the
/// [crate docs](crate#async-completions-feature-tokio) for the protocol it runs, how to post
/// from another task, and cancellation.
///
/// It must be created (and used) inside a tokio runtime with IO enabled. It owns its
/// completion channel: no other CQ may report to that channel, so every event on it is this
/// queue's.
///
/// ```no_run
/// # async fn demo() -> ibverbs_safe::Result<()> {
/// let ctx = ibverbs_safe::open(None)?;
/// let pd = ctx.alloc_pd()?;
/// let mut cq = ctx.create_async_cq(64)?; // inside a runtime
/// let qp = pd.queue_pair(cq.cq(), cq.cq()).build_rc()?;
/// # let _ = qp;
/// // ... connect `qp` and move it into the task that posts ...
/// let c = cq.next_completion().await?; // sleeps until the device reports one
/// c.result()?;
/// # Ok(())
/// # }
/// ```
pub struct AsyncCompletionQueue {
    /// Declared first: deregistered from the reactor before anything else is released.
    fd: AsyncFd<CompletionChannel>,
    cq: CompletionQueue,
    /// Whether an arm is outstanding whose event was not read yet.
    armed: bool,
    /// Events read and not yet acknowledged.
    unacked: u32,
    /// Completions polled for `next_completion`/`Stream` and not handed out yet:
    /// `buf[head..head + len]`.
    buf: Vec<Completion>,
    head: usize,
    len: usize,
    stats: AsyncCqStats,
    before_arm: Option<Hook>,
}

impl std::fmt::Debug for AsyncCompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCompletionQueue")
            .field("cq", &self.cq)
            .field("armed", &self.armed)
            .field("unacked", &self.unacked)
            .field("buffered", &self.len)
            .field("stats", &self.stats)
            .finish()
    }
}

impl Context {
    /// Creates a completion queue with its own completion channel, ready to be awaited
    /// (feature `tokio`; call it inside a tokio runtime with IO enabled).
    ///
    /// # Errors
    /// As [`create_comp_channel`](Self::create_comp_channel), [`create_cq`](Self::create_cq)
    /// and [`AsyncCompletionQueue::new`].
    ///
    /// # Panics
    /// As [`AsyncCompletionQueue::new`].
    pub fn create_async_cq(&self, cqe: u32) -> Result<AsyncCompletionQueue> {
        let channel = self.create_comp_channel()?;
        let cq = self.create_cq_with_channel(cqe, &channel)?;
        AsyncCompletionQueue::new(cq, channel)
    }
}

impl AsyncCompletionQueue {
    /// Wraps `cq`, which must report to `channel` and be the only CQ that does, and
    /// registers the channel's fd (switched to non-blocking) with the current tokio runtime.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `cq` does not report to `channel`, or other CQs (or
    /// other clones of `channel`) share it; [`Error::CqEvent`] if no tokio runtime is
    /// current, or registering the fd with it fails.
    ///
    /// # Panics
    /// If the current runtime was built without IO (`enable_io`): tokio's reactor panics.
    pub fn new(cq: CompletionQueue, channel: CompletionChannel) -> Result<Self> {
        if !channel.is_exclusive_to(&cq) {
            return Err(Error::InvalidArgument(
                "AsyncCompletionQueue::new: the CQ must report to the channel, and no other \
                 CQ or channel handle may share it"
                    .into(),
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::CqEvent(std::io::Error::other(
                "AsyncCompletionQueue needs a current tokio runtime (with IO enabled)",
            )));
        }
        channel.set_nonblocking(true)?;
        // SAFETY: the fd is the channel's, open for as long as the channel lives (the
        // handle moves into the `AsyncFd`, and the CQ holds the channel too); `as_raw_fd`
        // always returns that same fd (the field never changes).
        let fd = unsafe { AsyncFd::register_with_interest(channel, tokio::io::Interest::READABLE) }
            .map_err(|e| Error::CqEvent(e.into_parts().1))?;
        Ok(AsyncCompletionQueue {
            fd,
            cq,
            armed: false,
            unacked: 0,
            buf: Completion::buffer(STREAM_BATCH),
            head: 0,
            len: 0,
            stats: AsyncCqStats::default(),
            before_arm: None,
        })
    }

    /// The completion queue, to build queue pairs on
    /// ([`ProtectionDomain::queue_pair`](crate::ProtectionDomain::queue_pair)).
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The completion queue, for synchronous use (e.g.
    /// [`QueuePair::scope`](crate::QueuePair::scope) or a plain
    /// [`poll`](CompletionQueue::poll)). Completions taken that way are simply not seen here;
    /// completions already buffered for
    /// [`next_completion`](Self::next_completion) stay buffered.
    pub fn cq_mut(&mut self) -> &mut CompletionQueue {
        &mut self.cq
    }

    /// What the queue did so far.
    pub fn stats(&self) -> AsyncCqStats {
        self.stats
    }

    /// Test hook: runs between a poll that found the CQ empty and the arm that follows it,
    /// to make completions land in that window. Not a stable API.
    #[doc(hidden)]
    pub fn set_before_arm_hook(&mut self, hook: Option<Box<dyn FnMut() + Send>>) {
        self.before_arm = hook;
    }

    /// Waits until at least one completion is available and writes up to `out.len()` of
    /// them (with their buffers) into `out`; returns how many (0 only for an empty `out`).
    /// Cancellation-safe: dropping the future loses no completion.
    ///
    /// # Errors
    /// [`Error::PollCq`], [`Error::ReqNotifyCq`], [`Error::CqEvent`].
    pub async fn next_batch(&mut self, out: &mut [Completion]) -> Result<usize> {
        poll_fn(|cx| self.poll_next_batch(cx, out)).await
    }

    /// Waits for the next completion. Cancellation-safe.
    ///
    /// # Errors
    /// As [`next_batch`](Self::next_batch).
    pub async fn next_completion(&mut self) -> Result<Completion> {
        poll_fn(|cx| self.poll_next_completion(cx)).await
    }

    /// The poll behind [`next_batch`](Self::next_batch): `Ready` with at least one
    /// completion, or `Pending` after arranging for `cx`'s waker to be woken when the
    /// device reports one.
    ///
    /// # Errors
    /// As [`next_batch`](Self::next_batch).
    pub fn poll_next_batch(
        &mut self,
        cx: &mut task::Context<'_>,
        out: &mut [Completion],
    ) -> Poll<Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.len > 0 {
            let n = self.len.min(out.len());
            for (o, b) in out.iter_mut().zip(&mut self.buf[self.head..self.head + n]) {
                *o = std::mem::take(b);
            }
            self.head += n;
            self.len -= n;
            return Poll::Ready(Ok(n));
        }
        self.poll_device(cx, out)
    }

    /// The poll behind [`next_completion`](Self::next_completion).
    ///
    /// # Errors
    /// As [`next_batch`](Self::next_batch).
    pub fn poll_next_completion(&mut self, cx: &mut task::Context<'_>) -> Poll<Result<Completion>> {
        if self.len == 0 {
            let mut buf = std::mem::take(&mut self.buf);
            let r = self.poll_device(cx, &mut buf);
            self.buf = buf;
            match r {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(n)) => {
                    self.head = 0;
                    self.len = n;
                }
            }
        }
        let c = std::mem::take(&mut self.buf[self.head]);
        self.head += 1;
        self.len -= 1;
        Poll::Ready(Ok(c))
    }

    /// Steps 1-4 of the protocol (module docs), for a non-empty `out`.
    fn poll_device(
        &mut self,
        cx: &mut task::Context<'_>,
        out: &mut [Completion],
    ) -> Poll<Result<usize>> {
        loop {
            let n = self.cq.poll(out)?;
            if n > 0 {
                return Poll::Ready(Ok(n));
            }
            if !self.armed {
                if let Some(hook) = self.before_arm.as_mut() {
                    hook();
                }
                self.cq.req_notify(false)?;
                self.armed = true;
                self.stats.arms += 1;
                // A completion that came between the poll above and the arm raised no event.
                let n = self.cq.poll(out)?;
                if n > 0 {
                    self.stats.rearm_hits += 1;
                    return Poll::Ready(Ok(n));
                }
            }
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Pending => {
                    self.stats.sleeps += 1;
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Error::CqEvent(e))),
                Poll::Ready(Ok(g)) => g,
            };
            // Read every pending event; the fd is non-blocking and edge-triggered, so
            // readiness is cleared only once a read said there is nothing more.
            let mut read = 0u32;
            let drained = loop {
                match get_event(guard.get_inner(), self.cq.inner.cq) {
                    Ok(true) => read += 1,
                    Ok(false) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(e),
                }
            };
            if drained.is_ok() {
                guard.clear_ready();
            }
            drop(guard);
            if read > 0 {
                // The event consumed the arm: the next empty poll arms again.
                self.armed = false;
                self.stats.events += u64::from(read);
                self.unacked = self.unacked.saturating_add(read);
                if self.unacked >= ACK_BATCH {
                    self.ack();
                }
            }
            if let Err(e) = drained {
                return Poll::Ready(Err(Error::CqEvent(e)));
            }
        }
    }

    fn ack(&mut self) {
        if self.unacked > 0 {
            let v = self.cq.inner.ctx.inner.v;
            // SAFETY: the CQ is live (we hold it) and these events were read for it.
            unsafe { (v.ack_cq_events)(self.cq.inner.cq, self.unacked) };
            self.unacked = 0;
            self.stats.ack_calls += 1;
        }
    }
}

/// Reads one event from `ch` without blocking: `Ok(true)` if it was for `ours`,
/// `Ok(false)` if it was for another CQ (acknowledged at once), `Err` with `WouldBlock`
/// when none is pending.
fn get_event(ch: &CompletionChannel, ours: *mut ibv_cq) -> std::io::Result<bool> {
    let mut cq: *mut ibv_cq = std::ptr::null_mut();
    let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
    let v = ch.context().inner.v;
    // SAFETY: the channel is live and both out-pointers are valid; its fd is non-blocking.
    let rc = unsafe { (v.get_cq_event)(ch.raw(), &mut cq, &mut ctx) };
    if rc != 0 {
        return Err(last_os_error());
    }
    if cq == ours {
        return Ok(true);
    }
    // Not reachable while the channel is exclusive to `ours`; acknowledge so the other CQ's
    // destruction cannot wait for it.
    // SAFETY: `cq` was just returned by ibv_get_cq_event, so it is alive until acknowledged.
    unsafe { (v.ack_cq_events)(cq, 1) };
    Ok(false)
}

impl Drop for AsyncCompletionQueue {
    fn drop(&mut self) {
        // `ibv_destroy_cq` waits until every event read for the CQ was acknowledged.
        self.ack();
    }
}

impl futures_core::Stream for AsyncCompletionQueue {
    type Item = Result<Completion>;

    /// Never ends: yields each completion, or an error (polling may go on after one).
    fn poll_next(self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_completion(cx).map(Some)
    }
}

#[cfg(test)]
mod tests {
    //! The protocol on the fake provider: its channels are real eventfds the tokio reactor
    //! waits on, and an armed CQ raises an event only for completions added after the arm.
    use super::*;
    use crate::fake::Fake;
    use crate::{MrSlice, QueuePair, Rc};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap()
    }

    /// Runs `f` on another thread; a hang becomes a test failure after `secs`.
    fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(Duration::from_secs(secs)) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("did not finish within {secs} s (a lost completion?)")
            }
            Err(_) => panic!("the test body panicked (see above)"),
        }
    }

    /// An RC QP on the fake device, connected to itself, reporting to `cq`; and a handle to
    /// a 4 KiB region of its PD.
    fn qp_on(f: &Fake, cq: &CompletionQueue) -> (QueuePair<Rc>, MrSlice) {
        let pd = f.ctx.alloc_pd().unwrap();
        let qp = pd
            .queue_pair(cq, cq)
            .max_send_wr(256)
            .max_recv_wr(256)
            .build_rc()
            .unwrap();
        let ep = qp.endpoint();
        let mut mr = pd.alloc_region(4096).unwrap();
        (qp.connect(&ep).unwrap(), mr.slice(..).unwrap())
    }

    fn thread_cpu() -> Duration {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: `u` has room for a rusage; RUSAGE_THREAD only writes it.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
        assert_eq!(rc, 0, "getrusage");
        // SAFETY: getrusage succeeded and filled it.
        let u = unsafe { u.assume_init() };
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
        };
        tv(u.ru_utime) + tv(u.ru_stime)
    }

    fn note(line: std::fmt::Arguments<'_>) {
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }

    #[test]
    fn a_completion_that_arrives_later_wakes_the_awaiting_task_with_its_buffer() {
        within(20, || {
            let f = Arc::new(Fake::new());
            let rt = runtime();
            rt.block_on(async {
                let mut acq = f.ctx.create_async_cq(16).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                qp.send(buf.slice(8..16).unwrap(), 7).unwrap();
                let qpn = qp.qp_num();
                let dev = f.clone();
                let device = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    assert_eq!(dev.complete_sends(qpn, 1, 0), 1);
                });
                let mut c = acq.next_completion().await.unwrap();
                device.join().unwrap();
                c.result().unwrap();
                assert_eq!(c.wr_id(), 7);
                let b = c.take_buf().expect("the send's buffer comes back");
                assert_eq!((b.addr(), b.len()), (buf.addr() + 8, 8));
                let s = acq.stats();
                assert!(s.sleeps >= 1 && s.arms == 1, "{s:?}");
                // The wake-up found the completion before reading the event; the next wait
                // reads it (and re-arms), then sleeps until the next completion.
                qp.send(buf.slice(0..8).unwrap(), 8).unwrap();
                let dev = f.clone();
                let device = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    assert_eq!(dev.complete_sends(qpn, 1, 0), 1);
                });
                assert_eq!(acq.next_completion().await.unwrap().wr_id(), 8);
                device.join().unwrap();
                let s = acq.stats();
                assert!(s.events == 1 && s.arms == 2 && s.sleeps >= 2, "{s:?}");
                let id = acq.cq().id();
                drop(acq);
                // Every event read was acknowledged (ibv_destroy_cq would wait otherwise);
                // the second one was never read.
                let (raised, acked) = f.with(|s| {
                    let c = &s.cqs[&(id as usize)];
                    (c.events, c.acked)
                });
                assert_eq!((raised, acked), (2, 1));
                drop(qp);
            });
        });
    }

    /// Each round makes a completion land after the poll that found the CQ empty and before
    /// the arm: the arm raises no event for it, so only the re-poll after arming can find it.
    /// Without that re-poll the first round hangs (and `within` fails the test).
    #[test]
    fn a_completion_between_the_empty_poll_and_the_arm_is_not_lost() {
        const ROUNDS: u64 = 1000;
        within(60, || {
            let f = Arc::new(Fake::new());
            let rt = runtime();
            rt.block_on(async {
                let mut acq = f.ctx.create_async_cq(16).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                let qpn = qp.qp_num();
                let dev = f.clone();
                acq.set_before_arm_hook(Some(Box::new(move || {
                    dev.complete_sends(qpn, 1, 0);
                })));
                for i in 0..ROUNDS {
                    // Completed by the hook, in the window.
                    qp.send(buf.slice(0..8).unwrap(), 2 * i).unwrap();
                    let c = acq.next_completion().await.unwrap();
                    assert_eq!(c.wr_id(), 2 * i);
                    // Completed now, while armed: raises the event that disarms the queue,
                    // so the next round arms (and opens the window) again.
                    qp.send(buf.slice(0..8).unwrap(), 2 * i + 1).unwrap();
                    assert_eq!(f.complete_sends(qpn, 1, 0), 1);
                    let c = acq.next_completion().await.unwrap();
                    assert_eq!(c.wr_id(), 2 * i + 1);
                }
                let s = acq.stats();
                note(format_args!("poll/arm race, {ROUNDS} rounds: {s:?}"));
                assert_eq!(s.rearm_hits, ROUNDS, "{s:?}");
                assert_eq!(s.arms, ROUNDS, "{s:?}");
                // Events are acknowledged in batches, not one by one.
                assert_eq!(s.ack_calls, s.events / u64::from(ACK_BATCH), "{s:?}");
                let id = acq.cq().id();
                drop(acq);
                let (read, acked, calls) = f.with(|st| {
                    let c = &st.cqs[&(id as usize)];
                    (c.events, c.acked, c.ack_calls)
                });
                // The last round's event was raised but never read: nothing to acknowledge.
                assert_eq!(read as u64, s.events + 1);
                assert_eq!(acked as u64, s.events);
                assert_eq!(
                    calls as u64,
                    s.ack_calls + 1,
                    "one final acknowledgement on drop"
                );
                drop(qp);
            });
        });
    }

    #[test]
    fn the_stream_yields_every_completion_in_order_with_its_buffer() {
        use futures_core::Stream;
        const N: u64 = 40;
        within(20, || {
            let f = Arc::new(Fake::new());
            let rt = runtime();
            rt.block_on(async {
                let mut acq = f.ctx.create_async_cq(64).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                for i in 0..N {
                    let at = (i * 16) as usize;
                    qp.send(buf.slice(at..at + 16).unwrap(), 100 + i).unwrap();
                }
                let qpn = qp.qp_num();
                let dev = f.clone();
                let device = std::thread::spawn(move || {
                    for _ in 0..N / 8 {
                        std::thread::sleep(Duration::from_millis(5));
                        assert_eq!(dev.complete_sends(qpn, 8, 0), 8);
                    }
                });
                for i in 0..N {
                    let mut c = poll_fn(|cx| Pin::new(&mut acq).poll_next(cx))
                        .await
                        .expect("the stream never ends")
                        .unwrap();
                    assert_eq!(c.wr_id(), 100 + i);
                    let b = c.take_buf().unwrap();
                    assert_eq!(b.addr(), buf.addr() + i * 16);
                }
                device.join().unwrap();
                assert_eq!(qp.send_in_flight(), 0);
            });
        });
    }

    #[test]
    fn next_batch_hands_out_what_next_completion_left_buffered_first() {
        within(20, || {
            let f = Fake::new();
            runtime().block_on(async {
                let mut acq = f.ctx.create_async_cq(64).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                for i in 0..5 {
                    qp.send(buf.slice(0..8).unwrap(), i).unwrap();
                }
                f.complete_sends(qp.qp_num(), 5, 0);
                assert_eq!(acq.next_completion().await.unwrap().wr_id(), 0);
                let mut out = Completion::buffer(8);
                assert_eq!(acq.next_batch(&mut []).await.unwrap(), 0);
                let n = acq.next_batch(&mut out).await.unwrap();
                let ids: Vec<u64> = out[..n].iter().map(Completion::wr_id).collect();
                assert_eq!(ids, [1, 2, 3, 4]);
            });
        });
    }

    /// The split the module docs describe: the QP (posting) on one thread or task, the
    /// awaiting queue on another, no lock in between.
    #[test]
    fn posting_from_another_thread_and_task_while_one_task_awaits() {
        const N: u64 = 200;
        within(30, || {
            let f = Arc::new(Fake::new());
            let rt = runtime();
            rt.block_on(async {
                let mut acq = f.ctx.create_async_cq(256).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                let qpn = qp.qp_num();
                // A plain thread owns the QP and posts (and plays the device).
                let dev = f.clone();
                let poster = std::thread::spawn(move || {
                    for i in 0..N {
                        let at = (i % 256 * 16) as usize;
                        qp.send(buf.slice(at..at + 16).unwrap(), i).unwrap();
                        if i % 10 == 9 {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        dev.complete_sends(qpn, 1, 0);
                    }
                    qp
                });
                let awaiter = tokio::spawn(async move {
                    let mut out = Completion::buffer(16);
                    let mut next = 0;
                    while next < N {
                        let n = acq.next_batch(&mut out).await.unwrap();
                        for c in &mut out[..n] {
                            assert_eq!(c.wr_id(), next);
                            assert_eq!(c.take_bufs().len(), 1);
                            next += 1;
                        }
                    }
                    acq
                });
                let acq = awaiter.await.unwrap();
                let qp = poster.join().unwrap();
                assert_eq!(qp.send_in_flight(), 0);

                // Two tasks of one runtime: one posts, one awaits.
                let (dev, buf) = (f.clone(), qp_buf(&qp));
                let poster = tokio::spawn(async move {
                    let mut qp = qp;
                    for i in 0..N {
                        qp.send(buf.clone(), 1000 + i).unwrap();
                        dev.complete_sends(qpn, 1, 0);
                        tokio::task::yield_now().await;
                    }
                    qp
                });
                let mut acq = acq;
                let awaiter = tokio::spawn(async move {
                    for i in 0..N {
                        assert_eq!(acq.next_completion().await.unwrap().wr_id(), 1000 + i);
                    }
                    acq
                });
                let (qp, acq) = (poster.await.unwrap(), awaiter.await.unwrap());
                let s = acq.stats();
                note(format_args!("post/await split, 2 x {N} sends: {s:?}"));
                drop((qp, acq));
            });
        });
    }

    /// A handle to 16 bytes of a fresh region in the QP's PD.
    fn qp_buf(qp: &QueuePair<Rc>) -> MrSlice {
        let pd = qp.core.pd.clone();
        let mut mr = pd.alloc_region(16).unwrap();
        mr.slice(..).unwrap()
    }

    /// An awaiting task sleeps in the reactor: CPU time over a 500 ms wait stays near zero.
    /// Control: a busy-polling wait of 200 ms on the same meter.
    #[test]
    fn an_idle_await_costs_almost_no_cpu() {
        let (idle, busy) = within(20, || {
            let f = Arc::new(Fake::new());
            let rt = runtime();
            rt.block_on(async {
                let mut acq = f.ctx.create_async_cq(16).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                qp.send(buf.slice(0..8).unwrap(), 1).unwrap();
                let qpn = qp.qp_num();
                let dev = f.clone();
                let device = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    dev.complete_sends(qpn, 1, 0);
                });
                let (t0, c0) = (Instant::now(), thread_cpu());
                let c = acq.next_completion().await.unwrap();
                let (wall, idle) = (t0.elapsed(), thread_cpu() - c0);
                assert_eq!(c.wr_id(), 1);
                assert!(wall >= Duration::from_millis(450), "{wall:?}");
                device.join().unwrap();

                let mut out = Completion::buffer(1);
                let c0 = thread_cpu();
                let r = acq
                    .cq_mut()
                    .poll_blocking(&mut out, Duration::from_millis(200));
                assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
                let busy = thread_cpu() - c0;
                note(format_args!(
                    "idle await: {:.3} ms CPU over {:.0} ms; busy poll: {:.1} ms CPU over 200 ms",
                    idle.as_secs_f64() * 1e3,
                    wall.as_secs_f64() * 1e3,
                    busy.as_secs_f64() * 1e3
                ));
                drop(qp);
                (idle, busy)
            })
        });
        assert!(
            busy >= Duration::from_millis(10),
            "the meter sees a busy wait: {busy:?}"
        );
        assert!(
            idle < Duration::from_millis(20),
            "idle await burnt {idle:?} CPU"
        );
    }

    #[test]
    fn flushed_work_comes_back_through_the_await() {
        within(20, || {
            let f = Fake::new();
            runtime().block_on(async {
                let mut acq = f.ctx.create_async_cq(16).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                qp.post_recv(buf.slice(0..64).unwrap(), 5).unwrap();
                // Arm with nothing there, then flush: the flush raises the event.
                let mut fut = std::pin::pin!(acq.next_completion());
                assert!(poll_once(fut.as_mut()).is_pending());
                qp.set_error().unwrap();
                let mut c = fut.await.unwrap();
                assert_eq!(c.wr_id(), 5);
                assert_eq!(c.status(), crate::WcStatus::WrFlush);
                assert_eq!(c.take_buf().unwrap().len(), 64);
            });
        });
    }

    /// Polls `fut` once with a waker that does nothing.
    fn poll_once<F: std::future::Future>(fut: Pin<&mut F>) -> Poll<F::Output> {
        struct Nop;
        impl std::task::Wake for Nop {
            fn wake(self: Arc<Self>) {}
        }
        let waker = std::task::Waker::from(Arc::new(Nop));
        fut.poll(&mut task::Context::from_waker(&waker))
    }

    #[test]
    fn a_dropped_wait_loses_no_completion() {
        within(20, || {
            let f = Fake::new();
            runtime().block_on(async {
                let mut acq = f.ctx.create_async_cq(16).unwrap();
                let (mut qp, buf) = qp_on(&f, acq.cq());
                qp.send(buf.slice(0..8).unwrap(), 9).unwrap();
                {
                    let fut = std::pin::pin!(acq.next_completion());
                    assert!(poll_once(fut).is_pending());
                } // cancelled while armed and waiting
                f.complete_sends(qp.qp_num(), 1, 0);
                assert_eq!(acq.next_completion().await.unwrap().wr_id(), 9);
            });
        });
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let f = Fake::new();
        // Outside a runtime.
        let r = f.ctx.create_async_cq(4);
        assert!(matches!(r, Err(Error::CqEvent(_))), "{r:?}");
        let rt = runtime();
        let _g = rt.enter();
        // A CQ without the channel, or with another one.
        let ch = f.ctx.create_comp_channel().unwrap();
        let plain = f.ctx.create_cq(4).unwrap();
        let r = AsyncCompletionQueue::new(plain, ch.clone());
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        let other = f.ctx.create_comp_channel().unwrap();
        let cq = f.ctx.create_cq_with_channel(4, &other).unwrap();
        let r = AsyncCompletionQueue::new(cq, ch.clone());
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // A channel another CQ (or another handle) shares.
        let cq1 = f.ctx.create_cq_with_channel(4, &ch).unwrap();
        let cq2 = f.ctx.create_cq_with_channel(4, &ch).unwrap();
        let r = AsyncCompletionQueue::new(cq1, ch.clone());
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        drop(cq2);
        let cq1 = f.ctx.create_cq_with_channel(4, &ch).unwrap();
        let kept = ch.clone();
        let r = AsyncCompletionQueue::new(cq1, ch);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        let cq1 = f.ctx.create_cq_with_channel(4, &kept).unwrap();
        assert!(AsyncCompletionQueue::new(cq1, kept).is_ok());
    }

    #[test]
    fn the_split_halves_are_send() {
        fn send<T: Send>() {}
        send::<AsyncCompletionQueue>();
        send::<QueuePair<Rc>>();
        send::<Completion>();
    }
}
