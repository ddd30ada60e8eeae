//! The thin layer over `sys`: one `unsafe fn` per verb, grouped by object
//! (`result::qp::modify`, ...), returning [`Result`] with the failing verb's context.
//!
//! These functions do no bookkeeping; the safe types in the other modules own the pointers
//! and uphold the `# Safety` conditions. The data-path functions (`post_send`, `poll_cq`, ...)
//! are the `static inline` functions of `verbs.h`: they call through the context's
//! `ibv_context_ops` table exactly as the header does.
#![allow(unsafe_code)]

use crate::error::{rc_error, Error, Result};
use crate::loader::Verbs;
use crate::sys::*;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};

static DROP_FAILURES: AtomicUsize = AtomicUsize::new(0);

/// How many destroy/deregister calls made from `Drop` implementations failed in this
/// process (`Drop` never panics; it records failures here instead, and prints each one to
/// stderr when the environment variable `IBVERBS_SAFE_DEBUG` is set).
pub fn drop_failures() -> usize {
    DROP_FAILURES.load(Ordering::Relaxed)
}

/// Records a failed destroy call made from `Drop`.
pub(crate) fn record_drop_failure(verb: &'static str, rc: c_int) {
    DROP_FAILURES.fetch_add(1, Ordering::Relaxed);
    if std::env::var_os("IBVERBS_SAFE_DEBUG").is_some() {
        eprintln!("ibverbs-safe: {verb} failed in drop: {}", rc_error(rc));
    }
}

/// Data-path calls through `ctx->ops` (the `static inline` verbs of `verbs.h`).
pub(crate) mod ops {
    use super::*;

    /// `ibv_post_send`: `qp->context->ops.post_send(qp, wr, bad_wr)`.
    ///
    /// # Safety
    /// 1. `qp` is a live QP returned by `ibv_create_qp`.
    /// 2. `wr` is a valid, `next`-terminated chain whose SGEs name registered memory that
    ///    stays valid until the matching completions (or until the QP is destroyed).
    #[inline(always)]
    pub(crate) unsafe fn post_send(
        qp: *mut ibv_qp,
        wr: *mut ibv_send_wr,
        bad: *mut *mut ibv_send_wr,
    ) -> c_int {
        // SAFETY: (1) makes `qp` and its context readable; the op table is filled by the
        // provider at context creation and never changes.
        match unsafe { (*(*qp).context).ops.post_send } {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f(qp, wr, bad) },
            None => libc::ENOSYS,
        }
    }

    /// `ibv_post_recv`: `qp->context->ops.post_recv(qp, wr, bad_wr)`.
    ///
    /// # Safety
    /// As [`post_send`], for receive work requests.
    #[inline(always)]
    pub(crate) unsafe fn post_recv(
        qp: *mut ibv_qp,
        wr: *mut ibv_recv_wr,
        bad: *mut *mut ibv_recv_wr,
    ) -> c_int {
        // SAFETY: see `post_send`.
        match unsafe { (*(*qp).context).ops.post_recv } {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f(qp, wr, bad) },
            None => libc::ENOSYS,
        }
    }

    /// `ibv_post_srq_recv`: `srq->context->ops.post_srq_recv(srq, wr, bad_wr)`.
    ///
    /// # Safety
    /// 1. `srq` is a live SRQ. 2. As [`post_send`] (2), for receive work requests.
    #[inline(always)]
    pub(crate) unsafe fn post_srq_recv(
        srq: *mut ibv_srq,
        wr: *mut ibv_recv_wr,
        bad: *mut *mut ibv_recv_wr,
    ) -> c_int {
        // SAFETY: (1) makes `srq` and its context readable.
        match unsafe { (*(*srq).context).ops.post_srq_recv } {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f(srq, wr, bad) },
            None => libc::ENOSYS,
        }
    }

    /// `ibv_poll_cq`: `cq->context->ops.poll_cq(cq, n, wc)`.
    ///
    /// # Safety
    /// 1. `cq` is a live CQ. 2. `wc` points to `n` writable `ibv_wc`.
    #[inline(always)]
    pub(crate) unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
        // SAFETY: (1) makes `cq` and its context readable.
        match unsafe { (*(*cq).context).ops.poll_cq } {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f(cq, n, wc) },
            None => -libc::ENOSYS,
        }
    }

    /// `ibv_req_notify_cq`: `cq->context->ops.req_notify_cq(cq, solicited_only)`.
    ///
    /// # Safety
    /// `cq` is a live CQ.
    #[inline(always)]
    pub(crate) unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: bool) -> c_int {
        // SAFETY: `cq` is live, so its context is readable.
        match unsafe { (*(*cq).context).ops.req_notify_cq } {
            // SAFETY: forwarded from this function's contract.
            Some(f) => unsafe { f(cq, solicited_only as c_int) },
            None => libc::ENOSYS,
        }
    }
}

/// Queue-pair verbs.
pub(crate) mod qp {
    use super::*;

    /// `ibv_modify_qp`.
    ///
    /// # Safety
    /// `qp` is a live QP.
    pub(crate) unsafe fn modify(
        v: &Verbs,
        qp: *mut ibv_qp,
        attr: &mut ibv_qp_attr,
        mask: c_int,
        to: &'static str,
    ) -> Result<()> {
        // SAFETY: `qp` is live (contract); `attr` is a valid, exclusively borrowed struct.
        let rc = unsafe { (v.modify_qp)(qp, attr, mask) };
        if rc != 0 {
            // SAFETY: `qp` is live.
            let qpn = unsafe { (*qp).qp_num };
            return Err(Error::ModifyQp {
                qpn,
                to,
                source: rc_error(rc),
            });
        }
        Ok(())
    }

    /// The QP number.
    ///
    /// # Safety
    /// `qp` is a live QP.
    pub(crate) unsafe fn qp_num(qp: *mut ibv_qp) -> u32 {
        // SAFETY: contract.
        unsafe { (*qp).qp_num }
    }

    /// `ibv_query_qp` for the state only.
    ///
    /// # Safety
    /// `qp` is a live QP.
    pub(crate) unsafe fn state(v: &Verbs, qp: *mut ibv_qp) -> Option<u32> {
        let mut attr = ibv_qp_attr::default();
        // SAFETY: all-zero is a valid `ibv_qp_init_attr` (pointers null, integers 0).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `qp` is live; both out-structs are valid and exclusively borrowed.
        let rc = unsafe { (v.query_qp)(qp, &mut attr, IBV_QP_STATE, &mut init) };
        (rc == 0).then_some(attr.qp_state)
    }
}
