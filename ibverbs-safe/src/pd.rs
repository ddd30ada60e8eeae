//! Protection domains.
#![allow(unsafe_code)]

use crate::context::Context;
use crate::error::{last_os_error, Error, Result};
use crate::result::record_drop_failure;
use crate::sys::ibv_pd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Protection domains alive in this process. While there is only one, every registered
/// buffer belongs to it, and the per-buffer PD check of a post has nothing to find.
static LIVE_PDS: AtomicUsize = AtomicUsize::new(0);

/// Whether more than one protection domain is alive, so that a buffer or address handle
/// posted on a QP may belong to another one. A handle of a second PD can only reach a
/// poster after that PD was created (and counted): the count is at least 2 then.
#[inline(always)]
pub(crate) fn several() -> bool {
    LIVE_PDS.load(Ordering::Relaxed) > 1
}

pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) pd: *mut ibv_pd,
}

// SAFETY: PDs are thread-safe verbs objects; the pointer is only passed to verbs.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        LIVE_PDS.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: every MR/QP/SRQ/AH of this PD holds an Arc to it, so none is alive; `pd`
        // came from ibv_alloc_pd and is freed exactly once.
        let rc = unsafe { (self.ctx.inner.v.dealloc_pd)(self.pd) };
        if rc != 0 {
            record_drop_failure("ibv_dealloc_pd", rc);
        }
    }
}

/// A protection domain: memory regions, queue pairs, SRQs and address handles are created
/// in one, and only objects of the same PD can be used together. Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.device().name)
            .finish()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is live.
        let pd = unsafe { (ctx.inner.v.alloc_pd)(ctx.inner.ctx) };
        if pd.is_null() {
            return Err(Error::AllocPd(last_os_error()));
        }
        LIVE_PDS.fetch_add(1, Ordering::Relaxed);
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                ctx: ctx.clone(),
                pd,
            }),
        })
    }

    /// The context this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }
}
