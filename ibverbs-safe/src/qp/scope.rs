//! Scoped work requests: post from *borrowed* registered memory, with the guarantee that the
//! scope does not end before every work request posted in it has completed.
#![allow(unsafe_code)]

use super::request::{OpClass, SendShape};
use super::{QueuePair, Transport};
use crate::buffer::RegionBuffer;
use crate::cq::{Completion, CompletionQueue, ScopeTally};
use crate::error::{rc_error, Error, Result};
use crate::inflight::WorkQueue;
use crate::mr::{AccessMode, Local, MemoryRegion, RemoteMemory};
use crate::result::ops;
use crate::sys::{self, ibv_qp_attr, ibv_send_wr, ibv_sge};
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::time::{Duration, Instant};

/// A scope of work requests that borrow registered memory for `'env` (see
/// [`QueuePair::scope`]). Like `std::thread::scope`, it cannot end — not even by a panic —
/// before every work request posted through it has completed, so the borrows are sound
/// without handles; `mem::forget` cannot skip the wait because the scope is never handed out
/// by value.
///
/// ```compile_fail,E0502
/// # fn f(qp: &mut ibverbs_safe::QueuePair<ibverbs_safe::Rc>, cq: &mut ibverbs_safe::CompletionQueue,
/// #      mut mr: ibverbs_safe::MemoryRegion, remote: ibverbs_safe::RemoteMemory) {
/// qp.scope(cq, std::time::Duration::from_secs(1), |s| {
///     s.write(&mr, ..64, remote, 1).unwrap();
///     mr.as_mut_slice().unwrap()[0] = 1; // the device may be reading these bytes
/// }).unwrap();
/// # }
/// ```
pub struct Scope<'scope, 'env: 'scope, T: Transport> {
    qp: &'scope mut QueuePair<T>,
    cq: &'scope mut CompletionQueue,
    outstanding: usize,
    first_error: Option<crate::error::WcStatus>,
    timeout: Duration,
    /// Invariant in both lifetimes (as `std::thread::Scope`), so scopes cannot be swapped.
    _env: PhantomData<(&'scope mut &'scope (), &'env mut &'env ())>,
}

impl<T: Transport> std::fmt::Debug for Scope<'_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl<T: Transport> QueuePair<T> {
    /// Runs `f` with a [`Scope`] whose work requests borrow registered memory instead of
    /// owning handles (no reference counting per post). `cq` must be this QP's send CQ.
    /// When `f` returns (or panics), the scope polls the device CQ until every work request
    /// it posted has completed; completions of other work polled meanwhile are kept in `cq`
    /// and handed out by its next [`poll`](CompletionQueue::poll). If they do not all
    /// complete within `timeout` (or polling fails until then), the QP is moved to the error
    /// state (which flushes them) and waited for again; should even that fail, the process
    /// aborts rather than release borrowed memory the device may still use.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `cq` is not the QP's send CQ; [`Error::Completion`]
    /// with the first error status of a scoped work request; [`Error::Timeout`] if they had
    /// to be flushed; [`Error::PollCq`] if they had to be flushed because polling failed
    /// (in every case, nothing posted in the scope is outstanding any more).
    pub fn scope<'env, R>(
        &mut self,
        cq: &mut CompletionQueue,
        timeout: Duration,
        f: impl for<'scope> FnOnce(&mut Scope<'scope, 'env, T>) -> R,
    ) -> Result<R> {
        if !std::sync::Arc::ptr_eq(&self.core._send_cq, &cq.inner) {
            return Err(Error::InvalidArgument(
                "scope: the CQ is not this QP's send CQ".into(),
            ));
        }
        let mut s = Scope {
            qp: self,
            cq,
            outstanding: 0,
            first_error: None,
            timeout,
            _env: PhantomData,
        };
        let r = f(&mut s);
        s.finish()?;
        Ok(r)
    }
}

impl<'scope, 'env, T: Transport> Scope<'scope, 'env, T> {
    /// Posts one signalled work request of `class` with the single SGE `sge` (a range of a
    /// borrowed region of PD `mr_pd`), to `remote` for WRITE/READ. The checks are those of
    /// [`SendShape::check`] (for one buffer, no immediate data, not inline), and the region
    /// must be of the QP's PD.
    #[inline(always)]
    fn post(
        &mut self,
        class: OpClass,
        sge: ibv_sge,
        remote: Option<RemoteMemory>,
        mr_pd: *const crate::pd::PdInner,
        wr_id: u64,
    ) -> Result<()> {
        let core = &mut self.qp.core;
        SendShape {
            qpt: T::QPT,
            class,
            imm: false,
            inline: false,
            nbufs: 1,
            total: sge.length as u64,
            first: Some((sge.addr, sge.length as u64)),
            remote: remote.map(|r| (r.addr, r.len)),
        }
        .check(core.max_send_sge.get(), core.max_inline)?;
        if !std::ptr::eq(std::sync::Arc::as_ptr(&core.pd.inner), mr_pd) {
            return Err(Error::ForeignObject("the borrowed region"));
        }
        // SAFETY: `sq_head` is `sq`'s cursor.
        let Some(slot) = (unsafe { core.sq.free_at_cursor(core.sq_head) }) else {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: core.sq.depth(),
            });
        };
        // The QP's own work request (zeroed at creation; see `PostWr`): only the fields of
        // this operation are written.
        let post = &mut core.post_wr;
        post.sges[0].write(sge);
        let wr = &mut post.wr;
        wr.next = std::ptr::null_mut();
        wr.sg_list = post.sges.as_mut_ptr().cast();
        wr.num_sge = 1;
        wr.send_flags = sys::IBV_SEND_SIGNALED; // every scoped WR must report back
        wr.imm_data = 0;
        wr.opcode = match class {
            OpClass::Write => sys::IBV_WR_RDMA_WRITE,
            OpClass::Read => sys::IBV_WR_RDMA_READ,
            _ => sys::IBV_WR_SEND,
        };
        if let Some(r) = remote {
            wr.wr.rdma = sys::ibv_send_wr_rdma {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
        }
        // No buffers to hold: the scope's borrows keep the memory, and the scope does not
        // end before the completion.
        let id = slot.post_borrowed(wr_id);
        let wr = &mut core.post_wr.wr;
        wr.wr_id = id;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; its work request and SGE are initialised and valid for the
        // call (see `PostWr`); the SGE names memory of a region borrowed for 'env, and the
        // scope does not end before the completion.
        let rc = unsafe { ops::post_send(core.qp, wr, &mut bad) };
        if rc != 0 {
            core.sq.unfill(id);
            return Err(Error::PostSend {
                qpn: core.qpn,
                source: rc_error(rc),
            });
        }
        WorkQueue::advance_past(&mut core.sq_head, slot);
        self.outstanding += 1;
        Ok(())
    }

    /// SEND `range` of a borrowed region.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`] (nothing is posted on error).
    #[inline(always)]
    pub fn send<B: RegionBuffer, A: AccessMode>(
        &mut self,
        mr: &'env MemoryRegion<B, A>,
        range: impl RangeBounds<usize>,
        wr_id: u64,
    ) -> Result<()> {
        let sge = mr.sge_of(range)?;
        self.post(OpClass::Send, sge, None, mr.pd_ptr(), wr_id)
    }

    /// RDMA WRITE `range` of a borrowed region to `remote`.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`].
    #[inline(always)]
    pub fn write<B: RegionBuffer, A: AccessMode>(
        &mut self,
        mr: &'env MemoryRegion<B, A>,
        range: impl RangeBounds<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<()> {
        let sge = mr.sge_of(range)?;
        self.post(OpClass::Write, sge, Some(remote), mr.pd_ptr(), wr_id)
    }

    /// RDMA READ `remote` into `range` of an exclusively borrowed local region.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`].
    #[inline(always)]
    pub fn read<B: RegionBuffer>(
        &mut self,
        mr: &'env mut MemoryRegion<B, Local>,
        range: impl RangeBounds<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<()> {
        let sge = mr.sge_of(range)?;
        self.post(OpClass::Read, sge, Some(remote), mr.pd_ptr(), wr_id)
    }

    /// Work requests of this scope not completed yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Polls the CQ (see [`CompletionQueue::poll`]); completions of this scope's work
    /// requests are counted off.
    ///
    /// # Errors
    /// [`Error::PollCq`].
    #[inline(always)]
    pub fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        let mut done = 0;
        if !self.cq.stash.is_empty() {
            done = self.poll_stash(out);
        }
        // The device's completions are counted as they are taken in (one pass, not two):
        // those of this scope are the scoped ones of this QP's send queue, which is what
        // `count` asks of a completion by its QP number.
        let mut tally = ScopeTally {
            queue: std::sync::Arc::as_ptr(&self.qp.core.sq),
            hits: 0,
            first_bad: None,
        };
        let n = self.cq.poll_device::<true>(out, done, &mut tally)?;
        self.outstanding -= tally.hits;
        if let Some(i) = tally.first_bad {
            if self.first_error.is_none() {
                self.first_error = Some(out[i].status());
            }
        }
        Ok(n)
    }

    /// Hands out (and counts) what an earlier scope's wait stashed.
    #[cold]
    #[inline(never)]
    fn poll_stash(&mut self, out: &mut [Completion]) -> usize {
        let n = self.cq.poll_stash(out);
        for c in &out[..n] {
            self.count(c);
        }
        n
    }

    #[inline(always)]
    fn count(&mut self, c: &Completion) -> bool {
        if c.scoped && c.qp_num() == self.qp.core.qpn {
            self.outstanding -= 1;
            if !c.is_ok() && self.first_error.is_none() {
                self.first_error = Some(c.status());
            }
            true
        } else {
            false
        }
    }

    /// Polls the device CQ (not the stash, which holds no completion of this scope) until
    /// nothing of this scope is outstanding; other completions are stashed for the next
    /// [`CompletionQueue::poll`]. The deadline is checked every round, and a failing poll
    /// is retried until it passes. `Err` (with the first poll error, if any) when work is
    /// still outstanding at the deadline.
    fn wait(&mut self, timeout: Duration) -> std::result::Result<(), Option<Error>> {
        let start = Instant::now();
        let mut buf: [Completion; 8] = Default::default();
        let mut first_err = None;
        while self.outstanding > 0 {
            let n = match self
                .cq
                .poll_device::<false>(&mut buf, 0, &mut ScopeTally::none())
            {
                Ok(n) => n,
                Err(e) => {
                    first_err.get_or_insert(e);
                    0
                }
            };
            for c in &mut buf[..n] {
                if !self.count(c) {
                    self.cq.stash.push_back(std::mem::take(c));
                }
            }
            if self.outstanding == 0 {
                break;
            }
            if start.elapsed() > timeout {
                return Err(first_err);
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Ends the scope: on return nothing posted in it is outstanding. A wait that fails
    /// (timeout, or polls that keep failing) moves the QP to ERR, which flushes the rest,
    /// and waits again; failing even that, the process aborts.
    fn finish(&mut self) -> Result<()> {
        if let Err(cause) = self.wait(self.timeout) {
            // Flush what is left, then wait for the flush completions.
            let mut a = ibv_qp_attr {
                qp_state: sys::IBV_QPS_ERR,
                ..Default::default()
            };
            let _ = self.qp.core.modify(&mut a, sys::IBV_QP_STATE, "ERR");
            if self.wait(self.timeout).is_err() {
                eprintln!("ibverbs-safe: scoped work requests never completed; aborting to keep borrowed memory safe");
                std::process::abort();
            }
            return Err(cause.unwrap_or(Error::Timeout(self.timeout)));
        }
        match self.first_error.take() {
            Some(s) => Err(Error::Completion(s)),
            None => Ok(()),
        }
    }
}

impl<T: Transport> Drop for Scope<'_, '_, T> {
    fn drop(&mut self) {
        // Normal exits already waited in `finish`; this covers a panic in the closure.
        if self.outstanding > 0 {
            let _ = self.finish();
        }
    }
}
