//! Shared receive queues.
#![allow(unsafe_code)]

use crate::error::{last_os_error, rc_error, Error, Result};
use crate::inflight::{QueueKind, SgList, SlotData, WorkQueue, MAX_SGE};
use crate::pd::ProtectionDomain;
use crate::qp::PostError;
use crate::result::{ops, record_drop_failure};
use crate::sys::{ibv_recv_wr, ibv_sge, ibv_srq, ibv_srq_attr, ibv_srq_init_attr};
use std::sync::Arc;

pub(crate) struct SrqInner {
    pub(crate) pd: ProtectionDomain,
    pub(crate) srq: *mut ibv_srq,
    pub(crate) wq: Arc<WorkQueue>,
}

// SAFETY: SRQs are thread-safe verbs objects; slot hand-over is atomic (see inflight).
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: every QP attached to the SRQ holds an Arc to it, so all are destroyed; the
        // SRQ is destroyed once. After this the device no longer writes its buffers.
        let rc = unsafe { (self.pd.inner.ctx.inner.v.destroy_srq)(self.srq) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_srq", rc);
            // The device may still own the buffers: keep them (leak) rather than free them.
            std::mem::forget(self.wq.clone());
            return;
        }
        self.wq.release_all();
    }
}

/// A shared receive queue: receive buffers consumed by any QP attached to it. Posting
/// needs `&mut self` (single producer); completions arrive on the attached QPs' receive CQs
/// and hand the buffers back there.
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
    cursor: usize,
    max_sge: usize,
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("depth", &self.inner.wq.depth())
            .finish()
    }
}

impl ProtectionDomain {
    /// Creates an SRQ holding up to `max_wr` receives of up to `max_sge` buffers each.
    ///
    /// # Errors
    /// [`Error::CreateSrq`].
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let mut attr = ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr,
                max_sge: max_sge.clamp(1, MAX_SGE as u32),
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is live; `attr` is valid.
        let srq = unsafe { (self.inner.ctx.inner.v.create_srq)(self.inner.pd, &mut attr) };
        if srq.is_null() {
            return Err(Error::CreateSrq {
                max_wr,
                source: last_os_error(),
            });
        }
        // The provider writes back the real capacities.
        let depth = (attr.attr.max_wr as usize).max(max_wr as usize);
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: self.clone(),
                srq,
                wq: WorkQueue::new(depth, false, QueueKind::Srq),
            }),
            cursor: 0,
            max_sge: (attr.attr.max_sge as usize).clamp(1, MAX_SGE),
        })
    }
}

impl SharedReceiveQueue {
    /// Posts one receive of `bufs`; `wr_id` comes back in its completion.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::InvalidRequest`] (too many buffers) or
    /// [`Error::PostRecv`], with the buffers handed back.
    pub fn post_recv(
        &mut self,
        bufs: impl Into<SgList>,
        wr_id: u64,
    ) -> Result<(), PostError<SgList>> {
        let bufs = bufs.into();
        if bufs.len() > self.max_sge {
            return Err(PostError {
                error: Error::InvalidRequest("more buffers than the SRQ's max_sge"),
                request: bufs,
            });
        }
        let (mut sges, n) = match recv_sges(&bufs, &self.inner.pd) {
            Ok(x) => x,
            Err(error) => {
                return Err(PostError {
                    error,
                    request: bufs,
                })
            }
        };
        let id = match self.inner.wq.fill(
            &mut self.cursor,
            SlotData {
                bufs,
                user: wr_id,
                _ah: None,
                scoped: false,
            },
        ) {
            Ok(id) => id,
            Err(d) => {
                return Err(PostError {
                    error: Error::QueueFull {
                        queue: "shared receive queue",
                        depth: self.inner.wq.depth(),
                    },
                    request: d.bufs,
                })
            }
        };
        let mut wr = ibv_recv_wr {
            wr_id: id,
            next: std::ptr::null_mut(),
            sg_list: sges.as_mut_ptr(),
            num_sge: n as i32,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the SRQ is live; `wr` and its SGEs are valid for the call; the buffers are
        // owned by the slot until the completion (or the SRQ's destruction) releases them.
        let rc = unsafe { ops::post_srq_recv(self.inner.srq, &mut wr, &mut bad) };
        if rc != 0 {
            let d = self.inner.wq.unfill(id).expect("slot we just filled");
            return Err(PostError {
                error: Error::PostRecv(rc_error(rc)),
                request: d.bufs,
            });
        }
        self.inner.wq.advance(&mut self.cursor);
        Ok(())
    }

    /// Receives currently posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inner.wq.in_flight()
    }
}

/// The SGEs of a receive; [`Error::ForeignObject`] for a buffer of another PD than `pd`.
pub(crate) fn recv_sges(
    bufs: &SgList,
    pd: &ProtectionDomain,
) -> Result<([ibv_sge; MAX_SGE], usize)> {
    let mut sges = [ibv_sge::default(); MAX_SGE];
    let items = bufs.as_slice();
    for (sge, b) in sges.iter_mut().zip(items) {
        *sge = b.sge();
    }
    let n = items.len();
    if crate::pd::several() && bufs.any_foreign(Arc::as_ptr(&pd.inner)) {
        return Err(Error::ForeignObject("a buffer of the work request"));
    }
    Ok((sges, n))
}
