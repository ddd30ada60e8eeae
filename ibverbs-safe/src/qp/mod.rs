//! Queue pairs: typestate setup (builder → [`PreparedQp`] → [`QueuePair`]) and posting.
#![allow(unsafe_code)]

mod endpoint;
mod request;
mod scope;

pub use endpoint::{Endpoint, EndpointDecodeError};
#[doc(hidden)]
pub use request::{OpClass, SendShape};
pub use request::{SendBatch, SendRequest, UdDest, MAX_BATCH};
pub use scope::Scope;

use crate::ah::AhAttr;
use crate::cq::{CompletionQueue, CqInner};
use crate::error::{rc_error, Error, Result};
use crate::inflight::{QueueKind, SgList, SlotData, WorkQueue, MAX_SGE};
use crate::mr::RemoteAccess;
use crate::pd::ProtectionDomain;
use crate::port::{LinkLayer, Mtu};
use crate::result::{self, ops, record_drop_failure};
use crate::srq::{recv_sges, SharedReceiveQueue, SrqInner};
use crate::sys::{self, *};
use std::marker::PhantomData;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
}

/// The transport of a queue pair: [`Rc`], [`Uc`] or [`Ud`].
pub trait Transport: sealed::Sealed + Send + 'static {
    /// `enum ibv_qp_type` value.
    #[doc(hidden)]
    const QPT: u32;
    /// "RC", "UC" or "UD".
    const NAME: &'static str;
}

/// Reliable connection: SEND/RECV, RDMA WRITE/READ, atomics; in-order, acknowledged.
#[derive(Debug)]
pub enum Rc {}
/// Unreliable connection: SEND/RECV and RDMA WRITE; no READ/atomics, no retransmission.
#[derive(Debug)]
pub enum Uc {}
/// Unreliable datagram: SEND/RECV to any UD QP through an address handle.
#[derive(Debug)]
pub enum Ud {}

impl sealed::Sealed for Rc {}
impl sealed::Sealed for Uc {}
impl sealed::Sealed for Ud {}
impl Transport for Rc {
    const QPT: u32 = sys::IBV_QPT_RC;
    const NAME: &'static str = "RC";
}
impl Transport for Uc {
    const QPT: u32 = sys::IBV_QPT_UC;
    const NAME: &'static str = "UC";
}
impl Transport for Ud {
    const QPT: u32 = sys::IBV_QPT_UD;
    const NAME: &'static str = "UD";
}

/// A failed post: the error, and the request (with its buffers) handed back.
#[derive(Debug)]
pub struct PostError<R> {
    /// What went wrong.
    pub error: Error,
    /// The request that was not posted.
    pub request: R,
}

impl<R> std::fmt::Display for PostError<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<R: std::fmt::Debug> std::error::Error for PostError<R> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<R> From<PostError<R>> for Error {
    fn from(e: PostError<R>) -> Error {
        e.error
    }
}

/// Connection parameters (defaults follow `ibv_rc_pingpong`/perftest).
#[derive(Clone, Copy, Debug)]
struct Params {
    port: u8,
    gid_index: Option<u8>,
    mtu: Option<Mtu>,
    access: RemoteAccess,
    psn: Option<u32>,
    qkey: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    max_rd_atomic: Option<u8>,
    sl: u8,
    pkey_index: u16,
}

/// Builds a queue pair. Get one from [`ProtectionDomain::queue_pair`].
pub struct QpBuilder<'a> {
    pd: &'a ProtectionDomain,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    srq: Option<&'a SharedReceiveQueue>,
    cap: ibv_qp_cap,
    p: Params,
}

impl std::fmt::Debug for QpBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpBuilder")
            .field("cap", &self.cap)
            .field("params", &self.p)
            .finish()
    }
}

impl ProtectionDomain {
    /// Starts building a queue pair whose send completions go to `send_cq` and receive
    /// completions to `recv_cq` (they may be the same CQ, and may be shared with other QPs).
    pub fn queue_pair<'a>(
        &'a self,
        send_cq: &'a CompletionQueue,
        recv_cq: &'a CompletionQueue,
    ) -> QpBuilder<'a> {
        QpBuilder {
            pd: self,
            send_cq,
            recv_cq,
            srq: None,
            cap: ibv_qp_cap {
                max_send_wr: 128,
                max_recv_wr: 128,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            p: Params {
                port: 1,
                gid_index: None,
                mtu: None,
                access: RemoteAccess::all(),
                psn: None,
                qkey: 0x1111_1111,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                min_rnr_timer: 12,
                max_rd_atomic: None,
                sl: 0,
                pkey_index: 0,
            },
        }
    }
}

impl<'a> QpBuilder<'a> {
    /// Send queue depth (default 128).
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.cap.max_send_wr = n;
        self
    }
    /// Receive queue depth (default 128).
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.cap.max_recv_wr = n;
        self
    }
    /// Max buffers per send / receive work request (default 1, at most [`MAX_SGE`]).
    pub fn max_sge(mut self, send: u32, recv: u32) -> Self {
        self.cap.max_send_sge = send.clamp(1, MAX_SGE as u32);
        self.cap.max_recv_sge = recv.clamp(1, MAX_SGE as u32);
        self
    }
    /// Max bytes of inline data per send (default 0).
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.cap.max_inline_data = n;
        self
    }
    /// Receive from a shared receive queue instead of the QP's own.
    pub fn srq(mut self, srq: &'a SharedReceiveQueue) -> Self {
        self.srq = Some(srq);
        self
    }
    /// Local port (default 1).
    pub fn port(mut self, port: u8) -> Self {
        self.p.port = port;
        self
    }
    /// Local GID index: put into the endpoint and used as source GID (default: 0 on
    /// Ethernet/RoCE ports, none on InfiniBand).
    pub fn gid_index(mut self, index: u8) -> Self {
        self.p.gid_index = Some(index);
        self
    }
    /// Path MTU to ask for (default: the port's active MTU).
    pub fn mtu(mut self, mtu: Mtu) -> Self {
        self.p.mtu = Some(mtu);
        self
    }
    /// Remote access the QP allows (RC/UC; default all; each region still needs its own
    /// rights).
    pub fn access(mut self, access: RemoteAccess) -> Self {
        self.p.access = access;
        self
    }
    /// Initial send PSN (default: random).
    pub fn psn(mut self, psn: u32) -> Self {
        self.p.psn = Some(psn & 0xff_ffff);
        self
    }
    /// Q_Key (UD; default 0x11111111).
    pub fn qkey(mut self, qkey: u32) -> Self {
        self.p.qkey = qkey;
        self
    }
    /// RC ack timeout exponent (4.096 µs · 2^t; default 14).
    pub fn timeout(mut self, t: u8) -> Self {
        self.p.timeout = t;
        self
    }
    /// RC transport retries (default 7).
    pub fn retry_cnt(mut self, n: u8) -> Self {
        self.p.retry_cnt = n.min(7);
        self
    }
    /// RC receiver-not-ready retries (default 7 = infinite).
    pub fn rnr_retry(mut self, n: u8) -> Self {
        self.p.rnr_retry = n.min(7);
        self
    }
    /// Outstanding RDMA READ/atomics (default: min(device limit, 16)).
    pub fn max_rd_atomic(mut self, n: u8) -> Self {
        self.p.max_rd_atomic = Some(n);
        self
    }
    /// Service level (default 0).
    pub fn sl(mut self, sl: u8) -> Self {
        self.p.sl = sl;
        self
    }

    /// Creates an RC QP and moves it to INIT.
    ///
    /// # Errors
    /// As [`build`](Self::build).
    pub fn build_rc(self) -> Result<PreparedQp<Rc>> {
        self.build()
    }
    /// Creates a UC QP and moves it to INIT.
    ///
    /// # Errors
    /// As [`build`](Self::build).
    pub fn build_uc(self) -> Result<PreparedQp<Uc>> {
        self.build()
    }
    /// Creates a UD QP and moves it to INIT.
    ///
    /// # Errors
    /// As [`build`](Self::build).
    pub fn build_ud(self) -> Result<PreparedQp<Ud>> {
        self.build()
    }

    /// Creates the QP, moves it to INIT and computes its local [`Endpoint`].
    ///
    /// # Errors
    /// [`Error::QueryPort`], [`Error::QueryGid`], [`Error::CreateQp`], [`Error::ModifyQp`].
    pub fn build<T: Transport>(self) -> Result<PreparedQp<T>> {
        let ctx = self.pd.context();
        // The kernel resolves the CQ and SRQ handles in the PD's context: objects of another
        // context would name different objects there (or none), and the QP would report to
        // a CQ other than the one whose slot tables track it.
        let same = |c: &crate::context::Context| Arc::ptr_eq(&c.inner, &ctx.inner);
        if !same(&self.send_cq.inner.ctx) {
            return Err(Error::ForeignObject("the send CQ"));
        }
        if !same(&self.recv_cq.inner.ctx) {
            return Err(Error::ForeignObject("the receive CQ"));
        }
        if let Some(srq) = self.srq {
            if !same(&srq.inner.pd.inner.ctx) {
                return Err(Error::ForeignObject("the shared receive queue"));
            }
        }
        let port = ctx.query_port(self.p.port)?;
        let gid_index = match (self.p.gid_index, port.link_layer) {
            (Some(i), _) => Some(i),
            (None, LinkLayer::Ethernet) => Some(0),
            (None, _) => None,
        };
        let gid = match gid_index {
            Some(i) => ctx.query_gid(self.p.port, i as u32)?,
            None => Default::default(),
        };
        let mtu = self.p.mtu.or(port.active_mtu).unwrap_or(Mtu::Mtu1024);
        let mtu = port.active_mtu.map_or(mtu, |a| mtu.min(a));
        let mut p = self.p;
        p.gid_index = gid_index;
        if p.max_rd_atomic.is_none() {
            let dev = ctx.query_device()?;
            let lim = dev.max_qp_rd_atom.min(dev.max_qp_init_rd_atom).clamp(1, 16);
            p.max_rd_atomic = Some(lim as u8);
        }

        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.send_cq.inner.cq,
            recv_cq: self.recv_cq.inner.cq,
            srq: self.srq.map_or(std::ptr::null_mut(), |s| s.inner.srq),
            cap: self.cap,
            qp_type: T::QPT,
            sq_sig_all: 0,
        };
        if self.srq.is_some() {
            init.cap.max_recv_wr = 0;
            init.cap.max_recv_sge = 0;
        }
        let v = ctx.inner.v;
        // SAFETY: the PD and CQs (and SRQ) are live; `init` is a valid attribute struct.
        let qp = unsafe { (v.create_qp)(self.pd.inner.pd, &mut init) };
        if qp.is_null() {
            return Err(Error::CreateQp {
                qp_type: T::NAME,
                source: crate::error::last_os_error(),
            });
        }
        // The provider wrote back the granted capacities (at least what we asked for).
        let cap = init.cap;
        let sq = WorkQueue::new(
            cap.max_send_wr.max(self.cap.max_send_wr) as usize,
            true,
            QueueKind::Send,
        );
        let rq = self.srq.is_none().then(|| {
            WorkQueue::new(
                cap.max_recv_wr.max(self.cap.max_recv_wr) as usize,
                true,
                QueueKind::Recv,
            )
        });
        self.send_cq.inner.attach(&sq);
        match (&rq, self.srq) {
            (Some(rq), _) => self.recv_cq.inner.attach(rq),
            (None, Some(srq)) => self.recv_cq.inner.attach(&srq.inner.wq),
            (None, None) => {}
        }
        // SAFETY: `qp` is live.
        let qpn = unsafe { result::qp::qp_num(qp) };
        let core = QpCore {
            pd: self.pd.clone(),
            qp,
            _send_cq: self.send_cq.inner.clone(),
            _recv_cq: self.recv_cq.inner.clone(),
            _srq: self.srq.map(|s| s.inner.clone()),
            sq_head: sq.ring_start(),
            sq,
            rq,
            rq_head: 0,
            qpn,
            max_send_sge: std::num::NonZeroUsize::new(
                (cap.max_send_sge as usize).clamp(1, MAX_SGE),
            )
            .unwrap_or(std::num::NonZeroUsize::MIN),
            max_recv_sge: (cap.max_recv_sge as usize).clamp(1, MAX_SGE),
            // What the provider granted (never more than it reported: inline data is copied from
            // unregistered memory, so this limit is part of the safety contract).
            max_inline: cap.max_inline_data,
            post_wr: request::PostWr::new(),
            p,
        };
        // INIT
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: p.pkey_index,
            port_num: p.port,
            ..Default::default()
        };
        let mask = if T::QPT == IBV_QPT_UD {
            a.qkey = p.qkey;
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY
        } else {
            a.qp_access_flags = p.access.bits();
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        };
        // SAFETY: `qp` is live (owned by `core`).
        unsafe { result::qp::modify(v, core.qp, &mut a, mask, "INIT")? };
        let psn = p.psn.unwrap_or_else(|| random_psn(qpn));
        let local = Endpoint {
            lid: port.lid,
            qpn,
            psn,
            gid,
            mtu,
            qkey: if T::QPT == IBV_QPT_UD { p.qkey } else { 0 },
        };
        Ok(PreparedQp {
            core,
            local,
            _t: PhantomData,
        })
    }
}

fn random_psn(qpn: u32) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ ((qpn as u64) << 32) ^ (std::process::id() as u64).rotate_left(17);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x as u32) & 0xff_ffff
}

/// The state shared by every typestate of a QP; owns the verbs QP and its slot tables.
pub(crate) struct QpCore {
    pub(crate) pd: ProtectionDomain,
    pub(crate) qp: *mut ibv_qp,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    _srq: Option<Arc<SrqInner>>,
    pub(crate) sq: Arc<WorkQueue>,
    rq: Option<Arc<WorkQueue>>,
    /// The send ring's producer cursor (always of `sq`).
    pub(crate) sq_head: crate::inflight::RingCursor,
    rq_head: usize,
    pub(crate) qpn: u32,
    /// At least 1 (a type the compiler knows is never 0: a one-buffer post's SGE-count
    /// check folds away).
    pub(crate) max_send_sge: std::num::NonZeroUsize,
    max_recv_sge: usize,
    pub(crate) max_inline: u32,
    /// The work request single posts fill (zeroed at creation, see [`request::PostWr`]).
    pub(crate) post_wr: request::PostWr,
    p: Params,
}

// SAFETY: a QP may be used from any thread; posting needs `&mut` (one producer).
unsafe impl Send for QpCore {}
// SAFETY: `&QpCore` only allows reads of immutable fields and thread-safe verbs queries.
unsafe impl Sync for QpCore {}

impl Drop for QpCore {
    fn drop(&mut self) {
        let v = self.pd.inner.ctx.inner.v;
        // Move to ERR first so outstanding work is flushed, then destroy. ibv_destroy_qp
        // returns only once the device has stopped processing the QP, so afterwards the
        // buffers of still-posted work requests can be released. (We deliberately do not
        // poll the CQ here: it may be shared with other QPs whose completions must reach
        // their owner. Late flushed completions of this QP are recognised and ignored.)
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: `qp` is live until destroyed below.
        let _ = unsafe { result::qp::modify(v, self.qp, &mut a, IBV_QP_STATE, "ERR") };
        // SAFETY: `qp` came from ibv_create_qp and is destroyed exactly once.
        let rc = unsafe { (v.destroy_qp)(self.qp) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_qp", rc);
            // The device may still use the buffers: leak them rather than free them.
            std::mem::forget(self.sq.clone());
            if let Some(rq) = &self.rq {
                std::mem::forget(rq.clone());
            }
            return;
        }
        self.sq.release_all();
        self._send_cq.retire(&self.sq);
        if let Some(rq) = &self.rq {
            rq.release_all();
            self._recv_cq.retire(rq);
        }
    }
}

impl QpCore {
    fn post_recv(&mut self, bufs: SgList, wr_id: u64) -> Result<(), PostError<SgList>> {
        let Some(rq) = &self.rq else {
            return Err(PostError {
                error: Error::InvalidRequest("this QP receives from an SRQ: post there"),
                request: bufs,
            });
        };
        if bufs.len() > self.max_recv_sge {
            return Err(PostError {
                error: Error::InvalidRequest("more buffers than the QP's max_recv_sge"),
                request: bufs,
            });
        }
        let (mut sges, n) = match recv_sges(&bufs, &self.pd) {
            Ok(x) => x,
            Err(error) => {
                return Err(PostError {
                    error,
                    request: bufs,
                })
            }
        };
        let id = match rq.fill(
            &mut self.rq_head,
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
                        queue: "receive queue",
                        depth: rq.depth(),
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
        // SAFETY: the QP is live; `wr`/`sges` are valid for the call; the buffers stay owned
        // by the slot until the completion or the QP's destruction.
        let rc = unsafe { ops::post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            let d = rq.unfill(id).expect("slot we just filled");
            return Err(PostError {
                error: Error::PostRecv(rc_error(rc)),
                request: d.bufs,
            });
        }
        rq.advance(&mut self.rq_head);
        Ok(())
    }

    fn modify(&self, a: &mut ibv_qp_attr, mask: i32, to: &'static str) -> Result<()> {
        // SAFETY: `qp` is live.
        unsafe { result::qp::modify(self.pd.inner.ctx.inner.v, self.qp, a, mask, to) }
    }
}

/// A queue pair in the INIT state: it has a local [`Endpoint`] to send to the peer, and
/// may already receive buffers, but cannot send until [`connect`](PreparedQp::connect)ed
/// (RC/UC) or [`activate`](PreparedQp::activate)d (UD).
///
/// ```compile_fail,E0599
/// # fn f(prepared: ibverbs_safe::PreparedQp<ibverbs_safe::Rc>, buf: ibverbs_safe::MrSlice) {
/// let mut prepared = prepared;
/// prepared.post_send(ibverbs_safe::SendRequest::send(buf)); // no such method before connect
/// # }
/// ```
pub struct PreparedQp<T: Transport> {
    core: QpCore,
    local: Endpoint,
    _t: PhantomData<T>,
}

impl<T: Transport> std::fmt::Debug for PreparedQp<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedQp")
            .field("transport", &T::NAME)
            .field("local", &self.local)
            .finish()
    }
}

impl<T: Transport> PreparedQp<T> {
    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        self.local
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.core.qpn
    }

    /// Posts a receive (allowed from INIT on, so a peer never finds the queue empty).
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`].
    pub fn post_recv(
        &mut self,
        bufs: impl Into<SgList>,
        wr_id: u64,
    ) -> Result<(), PostError<SgList>> {
        self.core.post_recv(bufs.into(), wr_id)
    }

    fn into_connected(self, remote: Option<Endpoint>) -> QueuePair<T> {
        QueuePair {
            core: self.core,
            local: self.local,
            remote,
            _t: PhantomData,
        }
    }
}

impl<T: Connected> PreparedQp<T> {
    /// Moves the QP to RTR and RTS towards `remote` (the peer's [`Endpoint`]); the path MTU
    /// is the smaller of both sides'.
    ///
    /// # Errors
    /// [`Error::ModifyQp`] (the QP is destroyed; its posted receives' buffers are released).
    pub fn connect(self, remote: &Endpoint) -> Result<QueuePair<T>> {
        let p = self.core.p;
        let ah = AhAttr::to_endpoint(remote, p.port, p.gid_index.unwrap_or(0));
        let mut ah = ah.to_raw();
        ah.sl = p.sl;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: self.local.mtu.min(remote.mtu) as u32,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            ah_attr: ah,
            ..Default::default()
        };
        let mut mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        if T::QPT == IBV_QPT_RC {
            a.max_dest_rd_atomic = p.max_rd_atomic.unwrap_or(1);
            a.min_rnr_timer = p.min_rnr_timer;
            mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        }
        self.core.modify(&mut a, mask, "RTR")?;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: self.local.psn,
            ..Default::default()
        };
        let mut mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
        if T::QPT == IBV_QPT_RC {
            a.timeout = p.timeout;
            a.retry_cnt = p.retry_cnt;
            a.rnr_retry = p.rnr_retry;
            a.max_rd_atomic = p.max_rd_atomic.unwrap_or(1);
            mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
        }
        self.core.modify(&mut a, mask, "RTS")?;
        Ok(self.into_connected(Some(*remote)))
    }

    /// [`connect`](Self::connect) from the peer's encoded endpoint.
    ///
    /// # Errors
    /// [`Error::Endpoint`] for a bad blob, else as [`connect`](Self::connect).
    pub fn connect_bytes(self, remote: &[u8]) -> Result<QueuePair<T>> {
        let e = Endpoint::from_bytes(remote)?;
        self.connect(&e)
    }
}

impl<T: Connected> PreparedQp<T> {
    /// The local port and device name the QP was built on (checked by the rdma_cm module
    /// against the connection's).
    pub(crate) fn port_and_device(&self) -> (u8, &str) {
        (self.core.p.port, &self.core.pd.context().device().name)
    }

    /// Moves the QP to RTR and RTS with attributes computed elsewhere (by rdma_cm's
    /// `rdma_init_qp_attr`), recording `remote` as the peer.
    ///
    /// # Errors
    /// [`Error::ModifyQp`] (the QP is destroyed; its posted receives' buffers are released).
    pub(crate) fn connect_with_attrs(
        self,
        rtr: &mut ibv_qp_attr,
        rtr_mask: i32,
        rts: &mut ibv_qp_attr,
        rts_mask: i32,
        remote: Endpoint,
    ) -> Result<QueuePair<T>> {
        self.core.modify(rtr, rtr_mask, "RTR")?;
        self.core.modify(rts, rts_mask, "RTS")?;
        Ok(self.into_connected(Some(remote)))
    }
}

impl PreparedQp<Ud> {
    /// Moves a UD QP to RTR and RTS (UD needs no remote endpoint).
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn activate(self) -> Result<QueuePair<Ud>> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            ..Default::default()
        };
        self.core.modify(&mut a, IBV_QP_STATE, "RTR")?;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: self.local.psn,
            ..Default::default()
        };
        self.core
            .modify(&mut a, IBV_QP_STATE | IBV_QP_SQ_PSN, "RTS")?;
        Ok(self.into_connected(None))
    }
}

/// Connected transports ([`Rc`], [`Uc`]).
pub trait Connected: Transport {}
impl Connected for Rc {}
impl Connected for Uc {}

/// A queue pair ready to send (RTS).
///
/// Posting needs `&mut self`: the QP has a single producer, which is what lets it track
/// in-flight buffers without locks. Buffers come back in the [`Completion`](crate::Completion)s
/// of the CQs the QP was built with.
pub struct QueuePair<T: Transport> {
    pub(crate) core: QpCore,
    local: Endpoint,
    remote: Option<Endpoint>,
    _t: PhantomData<T>,
}

impl<T: Transport> std::fmt::Debug for QueuePair<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("transport", &T::NAME)
            .field("local", &self.local)
            .field("remote", &self.remote)
            .finish()
    }
}

/// The state of a QP as the device reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QpState {
    /// RESET.
    Reset,
    /// INIT.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: all outstanding work is flushed.
    Error,
    /// Unknown value.
    Unknown(u32),
}

impl<T: Transport> QueuePair<T> {
    /// The local endpoint.
    pub fn endpoint(&self) -> Endpoint {
        self.local
    }
    /// The remote endpoint it is connected to (RC/UC).
    pub fn remote(&self) -> Option<Endpoint> {
        self.remote
    }
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.core.qpn
    }
    /// Max inline bytes per send.
    pub fn max_inline_data(&self) -> u32 {
        self.core.max_inline
    }
    /// Send work requests posted and not yet retired by a completion.
    pub fn send_in_flight(&self) -> usize {
        self.core.sq.in_flight()
    }
    /// Receives posted and not yet completed (0 with an SRQ).
    pub fn recv_in_flight(&self) -> usize {
        self.core.rq.as_ref().map_or(0, |q| q.in_flight())
    }

    /// Queries the current state.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `ibv_query_qp` fails.
    pub fn state(&self) -> Result<QpState> {
        // SAFETY: the QP is live.
        let s = unsafe { result::qp::state(self.core.pd.inner.ctx.inner.v, self.core.qp) }
            .ok_or_else(|| Error::InvalidArgument("ibv_query_qp failed".into()))?;
        Ok(match s {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Error,
            o => QpState::Unknown(o),
        })
    }

    /// Moves the QP to the error state: every outstanding work request completes with
    /// [`WcStatus::WrFlush`](crate::WcStatus::WrFlush), handing its buffers back.
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn set_error(&mut self) -> Result<()> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        self.core.modify(&mut a, IBV_QP_STATE, "ERR")
    }

    /// Posts a receive of `bufs`; `wr_id` comes back in its completion.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::InvalidRequest`] (too many buffers, or the QP uses an
    /// SRQ), [`Error::PostRecv`]; the buffers are handed back in the [`PostError`].
    pub fn post_recv(
        &mut self,
        bufs: impl Into<SgList>,
        wr_id: u64,
    ) -> Result<(), PostError<SgList>> {
        self.core.post_recv(bufs.into(), wr_id)
    }

    /// The raw `ibv_qp` pointer, for use with the raw layer or other C code. The QP stays
    /// owned by `self`; work posted through it from C must follow the contract of
    /// [`post_send_raw`](Self::post_send_raw) (odd `wr_id`s, memory kept valid until
    /// completion), and the QP must not be modified or destroyed through it.
    pub fn as_raw(&self) -> *mut ibv_qp {
        self.core.qp
    }

    /// Posts a chain of raw send work requests through the context's op table, bypassing
    /// all bookkeeping.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if a `wr_id` in the chain is even (reserved for the safe
    /// layer), [`Error::PostSend`] if the provider rejects the chain.
    ///
    /// # Safety
    /// 1. `wr` is a valid, NULL-terminated chain of `ibv_send_wr` with valid SGE arrays;
    ///    the opcodes are valid for this QP's transport (UD: a live `ah`).
    /// 2. Every SGE names memory registered in this QP's PD, which stays allocated and is
    ///    not accessed in conflicting ways by the CPU until the work request completed (its
    ///    completion was polled, a later signalled one on this QP completed, or the QP was
    ///    destroyed).
    /// 3. Its completions come back through [`CompletionQueue::poll`] (with the raw
    ///    `wr_id`, no buffers) or [`CompletionQueue::poll_raw`].
    pub unsafe fn post_send_raw(&mut self, wr: &mut ibv_send_wr) -> Result<()> {
        // SAFETY: (1): `wr` heads a valid, NULL-terminated chain.
        unsafe { check_raw_ids::<ibv_send_wr>(wr, |w| (w.wr_id, w.next.cast_const())) }?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the chain's validity is the caller's contract.
        let rc = unsafe { ops::post_send(self.core.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(Error::PostSend {
                qpn: self.core.qpn,
                source: rc_error(rc),
            });
        }
        Ok(())
    }

    /// Posts a chain of raw receive work requests (see [`post_send_raw`](Self::post_send_raw)).
    ///
    /// # Errors
    /// As [`post_send_raw`](Self::post_send_raw).
    ///
    /// # Safety
    /// As [`post_send_raw`](Self::post_send_raw), for receive work requests (the device
    /// writes the memory).
    pub unsafe fn post_recv_raw(&mut self, wr: &mut ibv_recv_wr) -> Result<()> {
        // SAFETY: (1): `wr` heads a valid, NULL-terminated chain.
        unsafe { check_raw_ids::<ibv_recv_wr>(wr, |w| (w.wr_id, w.next.cast_const())) }?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the chain's validity is the caller's contract.
        let rc = unsafe { ops::post_recv(self.core.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(Error::PostRecv(rc_error(rc)));
        }
        Ok(())
    }
}

impl CompletionQueue {
    /// Polls raw work completions (no buffer hand-back): for work posted with the raw layer.
    ///
    /// Completions kept back by a [`QueuePair::scope`] are not returned here (only by
    /// [`poll`](Self::poll)). A completion of a work request posted through the safe API
    /// that is polled this way releases that request's buffers (they are dropped, not handed
    /// back) and its slot, so nothing stays in flight.
    ///
    /// # Errors
    /// [`Error::PollCq`].
    #[inline]
    pub fn poll_raw(&mut self, out: &mut [ibv_wc]) -> Result<usize> {
        // SAFETY: the CQ is live and `out` has room for `out.len()` entries.
        let n = unsafe {
            ops::poll_cq(
                self.inner.cq,
                out.len().min(i32::MAX as usize) as i32,
                out.as_mut_ptr(),
            )
        };
        if n < 0 {
            return Err(Error::PollCq(rc_error(n)));
        }
        let n = (n as usize).min(out.len());
        for wc in &out[..n] {
            if wc.wr_id & 1 == 0 {
                release_slot(wc.wr_id);
            }
        }
        Ok(n)
    }
}

/// Releases the safe-layer slot named by a raw-polled completion (dropping its buffers).
#[cold]
#[inline(never)]
fn release_slot(wr_id: u64) {
    // The buffers are moved out of the claimed slot and dropped after it is free again.
    let mut bufs = SgList::new();
    // SAFETY: even wr_ids are slot addresses of queues attached to the polling CQ, which
    // keeps them alive; `&mut CompletionQueue` makes the caller the single poller.
    unsafe {
        crate::inflight::WorkQueue::complete_into(wr_id, &mut bufs, |_| {});
    }
    drop(bufs);
}

/// Refuses a raw work-request chain holding an even `wr_id`: even ids are the safe layer's
/// slot addresses, and a raw one would be taken for a slot when its completion is polled.
///
/// # Safety
/// `first` heads a valid, NULL-terminated chain whose `(wr_id, next)` `link` reads.
unsafe fn check_raw_ids<W>(first: *const W, link: impl Fn(&W) -> (u64, *const W)) -> Result<()> {
    let mut p = first;
    while !p.is_null() {
        // SAFETY: every element of the chain is valid (the caller's contract).
        let (id, next) = link(unsafe { &*p });
        if id & 1 == 0 {
            return Err(Error::InvalidRequest(
                "raw wr_id must be odd (even ids belong to the safe layer)",
            ));
        }
        p = next;
    }
    Ok(())
}

#[cfg(test)]
mod raw_id_tests {
    use super::*;

    fn wr(wr_id: u64, next: *mut ibv_recv_wr) -> ibv_recv_wr {
        ibv_recv_wr {
            wr_id,
            next,
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        }
    }

    #[test]
    fn an_even_id_anywhere_in_the_chain_is_refused() {
        let mut last = wr(4, std::ptr::null_mut());
        let first = wr(3, &mut last);
        let link = |w: &ibv_recv_wr| (w.wr_id, w.next.cast_const());
        // SAFETY: both elements are live locals and the chain ends in NULL.
        let r = unsafe { check_raw_ids(&first, link) };
        assert!(matches!(r, Err(Error::InvalidRequest(_))), "{r:?}");
        last.wr_id = 5;
        let first = wr(3, &mut last);
        // SAFETY: as above.
        assert!(unsafe { check_raw_ids(&first, link) }.is_ok());
    }
}
