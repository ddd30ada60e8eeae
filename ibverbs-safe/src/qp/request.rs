//! Send work requests, batches, and the posting methods of connected QPs.
#![allow(unsafe_code)]

use super::{PostError, QueuePair, Rc, Transport, Uc, Ud};
use crate::ah::{AddressHandle, AhAttr};
use crate::error::{rc_error, Error, Result};
use crate::inflight::{BufOwners, SgList, Sges, WorkQueue, MAX_SGE};
use crate::mr::{MrSlice, RemoteMemory};
use crate::pd::PdInner;
use crate::qp::Endpoint;
use crate::result::ops;
use crate::sys::{self, *};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// The destination of a UD send: address handle, remote QP number and Q_Key.
#[derive(Clone, Debug)]
pub struct UdDest {
    /// The path.
    pub ah: AddressHandle,
    /// Remote QP number.
    pub qpn: u32,
    /// Remote Q_Key.
    pub qkey: u32,
}

#[derive(Clone, Debug)]
enum Op {
    Send,
    Write(RemoteMemory),
    Read(RemoteMemory),
    CompareSwap {
        remote: RemoteMemory,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteMemory,
        add: u64,
    },
    SendTo(UdDest),
}

/// One send-queue work request: the operation, its local buffers (owned until the
/// completion hands them back) and flags. Signalled by default.
#[derive(Clone, Debug)]
pub struct SendRequest {
    op: Op,
    bufs: SgList,
    wr_id: u64,
    imm: Option<u32>,
    flags: u32,
}

impl SendRequest {
    #[inline]
    fn new(op: Op, bufs: SgList) -> Self {
        SendRequest {
            op,
            bufs,
            wr_id: 0,
            imm: None,
            flags: sys::IBV_SEND_SIGNALED,
        }
    }
    /// SEND `bufs` (consumes a receive at the peer).
    #[inline]
    pub fn send(bufs: impl Into<SgList>) -> Self {
        Self::new(Op::Send, bufs.into())
    }
    /// RDMA WRITE `bufs` to `remote` (RC/UC). `remote` must be at least as long as `bufs`.
    #[inline]
    pub fn write(bufs: impl Into<SgList>, remote: RemoteMemory) -> Self {
        Self::new(Op::Write(remote), bufs.into())
    }
    /// RDMA READ `remote` into `bufs` (RC).
    #[inline]
    pub fn read(bufs: impl Into<SgList>, remote: RemoteMemory) -> Self {
        Self::new(Op::Read(remote), bufs.into())
    }
    /// Atomic compare-and-swap of the 8-byte word at `remote` (RC): if it equals `compare`
    /// it becomes `swap`; the old value lands in `result` (8 bytes, 8-aligned).
    pub fn compare_swap(result: MrSlice, remote: RemoteMemory, compare: u64, swap: u64) -> Self {
        Self::new(
            Op::CompareSwap {
                remote,
                compare,
                swap,
            },
            result.into(),
        )
    }
    /// Atomic fetch-and-add on the 8-byte word at `remote` (RC); the old value lands in
    /// `result` (8 bytes, 8-aligned).
    pub fn fetch_add(result: MrSlice, remote: RemoteMemory, add: u64) -> Self {
        Self::new(Op::FetchAdd { remote, add }, result.into())
    }
    /// UD SEND of `bufs` to `dest`.
    pub fn send_to(bufs: impl Into<SgList>, dest: UdDest) -> Self {
        Self::new(Op::SendTo(dest), bufs.into())
    }
    /// Attaches immediate data (SEND and WRITE only; WRITE with immediate consumes a receive
    /// at the peer).
    #[inline]
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }
    /// Your id, returned in the completion.
    #[inline]
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }
    /// Do not generate a completion on success. The buffers are released (dropped) when a
    /// later signalled work request of the same QP completes (send queues complete in
    /// order, so the device is done with them then), when a flush completion (the QP in
    /// the error state) hands them back, or when the QP is dropped — never earlier. Keep a
    /// clone of a handle to reuse the memory. A scope's work requests are always signalled.
    #[inline]
    pub fn unsignaled(mut self) -> Self {
        self.flags &= !sys::IBV_SEND_SIGNALED;
        self
    }
    /// Set the solicited-event bit (wakes a peer armed with `req_notify(true)`).
    #[inline]
    pub fn solicited(mut self) -> Self {
        self.flags |= sys::IBV_SEND_SOLICITED;
        self
    }
    /// Wait for earlier READ/atomics to finish before this one starts.
    #[inline]
    pub fn fence(mut self) -> Self {
        self.flags |= sys::IBV_SEND_FENCE;
        self
    }
    /// Copy the data into the work request at post time (at most the QP's
    /// `max_inline_data` bytes).
    #[inline]
    pub fn inline(mut self) -> Self {
        self.flags |= sys::IBV_SEND_INLINE;
        self
    }
    /// The buffers.
    pub fn bufs(&self) -> &SgList {
        &self.bufs
    }
    /// Takes the buffers back out.
    pub fn into_bufs(self) -> SgList {
        self.bufs
    }

    /// Validates against the transport and QP limits and fills `wr`/`sges` (all but wr_id).
    #[inline]
    pub(super) fn encode<T: Transport, const CHECK_BUFS: bool>(
        &self,
        max_sge: usize,
        max_inline: u32,
        pd: *const PdInner,
        wr: &mut ibv_send_wr,
        sges: &mut Sges,
    ) -> Result<()> {
        let (n, total) = self.bufs.encode(sges);
        self.shape::<T>(total).check(max_sge, max_inline)?;
        // (`post_send` checks the buffers once they sit in their slot instead: borrowing the
        // request here for an out-of-line call costs its hot path ~40 instructions.)
        if CHECK_BUFS && (self.flags & sys::IBV_SEND_INLINE != 0 || crate::pd::several()) {
            check_bufs(&self.bufs, self.flags, pd)?;
        }
        wr.next = std::ptr::null_mut();
        wr.sg_list = sges.as_mut_ptr().cast();
        wr.num_sge = n as i32;
        wr.send_flags = self.flags;
        wr.imm_data = self.imm.map_or(0, u32::to_be);
        let with_imm = |plain, imm| if self.imm.is_some() { imm } else { plain };
        match &self.op {
            Op::Send => wr.opcode = with_imm(IBV_WR_SEND, IBV_WR_SEND_WITH_IMM),
            Op::SendTo(d) => {
                // The address handle must be of the QP's PD (and so its context): the
                // provider reads it as one of its own.
                if !std::ptr::eq(Arc::as_ptr(&d.ah.inner.pd.inner), pd) {
                    return Err(Error::ForeignObject("the address handle"));
                }
                wr.opcode = with_imm(IBV_WR_SEND, IBV_WR_SEND_WITH_IMM);
                wr.wr.ud = ibv_send_wr_ud {
                    ah: d.ah.as_ptr(),
                    remote_qpn: d.qpn,
                    remote_qkey: d.qkey,
                };
            }
            Op::Write(r) => {
                wr.opcode = with_imm(IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM);
                wr.wr.rdma = ibv_send_wr_rdma {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                };
            }
            Op::Read(r) => {
                wr.opcode = IBV_WR_RDMA_READ;
                wr.wr.rdma = ibv_send_wr_rdma {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                };
            }
            Op::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
                wr.wr.atomic = ibv_send_wr_atomic {
                    remote_addr: remote.addr,
                    compare_add: *compare,
                    swap: *swap,
                    rkey: remote.rkey,
                };
            }
            Op::FetchAdd { remote, add } => {
                wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
                wr.wr.atomic = ibv_send_wr_atomic {
                    remote_addr: remote.addr,
                    compare_add: *add,
                    swap: 0,
                    rkey: remote.rkey,
                };
            }
        }
        Ok(())
    }

    /// What the host-side checks look at (see [`SendShape::check`]).
    #[inline]
    fn shape<T: Transport>(&self, total: u64) -> SendShape {
        let (class, remote) = match &self.op {
            Op::Send => (OpClass::Send, None),
            Op::SendTo(_) => (OpClass::SendTo, None),
            Op::Write(r) => (OpClass::Write, Some((r.addr, r.len))),
            Op::Read(r) => (OpClass::Read, Some((r.addr, r.len))),
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => {
                (OpClass::Atomic, Some((remote.addr, remote.len)))
            }
        };
        SendShape {
            qpt: T::QPT,
            class,
            imm: self.imm.is_some(),
            inline: self.flags & sys::IBV_SEND_INLINE != 0,
            nbufs: self.bufs.len(),
            total,
            first: self.bufs.first().map(|b| (b.addr(), b.len() as u64)),
            remote,
        }
    }

    #[inline]
    fn ah(&self) -> Option<AddressHandle> {
        match &self.op {
            Op::SendTo(d) => Some(d.ah.clone()),
            _ => None,
        }
    }
}

/// The checks of a send's buffers themselves, out of line (asked only for inline data or
/// while several PDs are alive): none is from another PD, and inline data is host memory
/// (the provider copies it from the buffers' addresses with the CPU: device memory has no
/// host mapping there, only an iova the user chose).
#[cold]
#[inline(never)]
fn check_bufs(bufs: &SgList, flags: u32, pd: *const PdInner) -> Result<()> {
    check_owners(bufs.owners(), flags, pd)
}

/// As [`check_bufs`], on what the checks look at of the buffers, read from the list inline:
/// `post_send` never hands the request's address to an out-of-line call (which would keep
/// the whole request in memory, ~25 instructions a post).
#[cold]
#[inline(never)]
fn check_owners(bufs: BufOwners, flags: u32, pd: *const PdInner) -> Result<()> {
    if crate::pd::several() && bufs.any_foreign(pd) {
        return Err(Error::ForeignObject("a buffer of the work request"));
    }
    if flags & sys::IBV_SEND_INLINE != 0 && !bufs.all_host() {
        return Err(Error::InvalidRequest(
            "inline data must be host memory (not a device-memory region)",
        ));
    }
    Ok(())
}

/// Drops a posted request's remains (a UD destination) out of line.
#[cold]
#[inline(never)]
fn drop_request(req: SendRequest) {
    drop(req);
}

/// A full send queue: the request back.
#[cold]
#[inline(never)]
fn queue_full(depth: usize, request: SendRequest) -> PostError<SendRequest> {
    PostError {
        error: Error::QueueFull {
            queue: "send queue",
            depth,
        },
        request,
    }
}

/// The provider refused the work request in slot `id`: its buffers go back into the
/// request, which is handed back whole.
#[cold]
#[inline(never)]
fn refused(
    core: &super::QpCore,
    id: u64,
    rc: i32,
    mut request: SendRequest,
) -> PostError<SendRequest> {
    if let Some(mut d) = core.sq.unfill(id) {
        request.bufs.move_into_empty(&mut d.bufs);
    }
    PostError {
        error: Error::PostSend {
            qpn: core.qpn,
            source: rc_error(rc),
        },
        request,
    }
}

/// The kind of a send work request, as far as the host-side checks care.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    /// SEND on a connected QP.
    Send,
    /// SEND to a UD destination.
    SendTo,
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// Compare-and-swap or fetch-and-add.
    Atomic,
}

/// Everything the checks made before a send is posted look at: no device, no handle, so
/// they can be tested and fuzzed on any machine ([`crate::fuzzing`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct SendShape {
    /// `IBV_QPT_RC`, `IBV_QPT_UC` or `IBV_QPT_UD`.
    pub qpt: u32,
    /// The operation.
    pub class: OpClass,
    /// Carries immediate data.
    pub imm: bool,
    /// Posted with `IBV_SEND_INLINE`.
    pub inline: bool,
    /// Number of local buffers.
    pub nbufs: usize,
    /// Their total length.
    pub total: u64,
    /// Address and length of the first local buffer.
    pub first: Option<(u64, u64)>,
    /// Address and length of the remote window (WRITE, READ, atomics).
    pub remote: Option<(u64, u64)>,
}

impl SendShape {
    /// The host-side checks of a send work request against the transport and the QP's
    /// limits, in the order they are reported.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] (too many buffers, inline too large, operation not valid
    /// for the transport, immediate data on READ/atomics, atomic buffers not one 8-byte
    /// 8-aligned buffer / 8-byte 8-aligned target), [`Error::OutOfBounds`] (local buffers
    /// longer than the remote window of a WRITE/READ).
    #[inline]
    pub fn check(&self, max_sge: usize, max_inline: u32) -> Result<()> {
        let is_ud = self.qpt == sys::IBV_QPT_UD;
        let is_uc = self.qpt == sys::IBV_QPT_UC;
        if self.nbufs > max_sge {
            return Err(Error::InvalidRequest(
                "more buffers than the QP's max_send_sge",
            ));
        }
        if self.inline {
            if matches!(self.class, OpClass::Read | OpClass::Atomic) {
                return Err(Error::InvalidRequest(
                    "inline is for SEND/WRITE sources, not READ or atomic targets",
                ));
            }
            if self.total > max_inline as u64 {
                return Err(Error::InvalidRequest(
                    "inline data larger than the QP's max_inline_data",
                ));
            }
        }
        let (raddr, rlen) = self.remote.unwrap_or((0, 0));
        let check_remote = || {
            if self.total > rlen {
                Err(Error::OutOfBounds {
                    offset: 0,
                    len: self.total as usize,
                    region_len: rlen as usize,
                })
            } else {
                Ok(())
            }
        };
        match self.class {
            OpClass::Send if is_ud => Err(Error::InvalidRequest(
                "UD sends need a destination: use send_to",
            )),
            OpClass::Send => Ok(()),
            OpClass::SendTo if !is_ud => Err(Error::InvalidRequest("send_to is for UD QPs")),
            OpClass::SendTo => Ok(()),
            OpClass::Write if is_ud => {
                Err(Error::InvalidRequest("RDMA WRITE needs a connected QP"))
            }
            OpClass::Write => check_remote(),
            OpClass::Read if is_ud || is_uc => {
                Err(Error::InvalidRequest("RDMA READ needs an RC QP"))
            }
            OpClass::Read if self.imm => Err(Error::InvalidRequest(
                "RDMA READ cannot carry immediate data",
            )),
            OpClass::Read => check_remote(),
            OpClass::Atomic if is_ud || is_uc => {
                Err(Error::InvalidRequest("atomics need an RC QP"))
            }
            OpClass::Atomic if self.imm => {
                Err(Error::InvalidRequest("atomics cannot carry immediate data"))
            }
            OpClass::Atomic => {
                let (addr, len) = match self.first {
                    Some(b) if self.nbufs == 1 => b,
                    _ => {
                        return Err(Error::InvalidRequest(
                            "atomics take exactly one 8-byte result buffer",
                        ))
                    }
                };
                if len != 8 || addr % 8 != 0 {
                    return Err(Error::InvalidRequest(
                        "the atomic result buffer must be 8 bytes, 8-aligned",
                    ));
                }
                if rlen < 8 || raddr % 8 != 0 {
                    return Err(Error::InvalidRequest(
                        "the atomic target must be 8 bytes, 8-aligned",
                    ));
                }
                Ok(())
            }
        }
    }
}

#[inline]
pub(super) fn blank_wr() -> ibv_send_wr {
    ibv_send_wr {
        wr_id: 0,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: 0,
        opcode: 0,
        send_flags: 0,
        imm_data: 0,
        wr: ibv_send_wr_wr {
            atomic: ibv_send_wr_atomic::default(),
        },
        qp_type_xrc_remote_srqn: 0,
        _bind_mw_tso: [0; 6],
    }
}

/// The work request of single posts ([`QueuePair::post_send`], a scope's posts), kept in
/// the QP instead of built on the stack per post: zeroed once at creation, then each post
/// writes the fields its operation uses (`wr_id`, `next`, `sg_list`, `num_sge`, `opcode`,
/// `send_flags`, `imm_data`, the `wr` union's part for the operation, the SGEs it names).
/// What no post writes (the XRC and `bind_mw`/TSO parts, the SGEs past `num_sge`) stays zero
/// from creation; the union's bytes past an operation's part hold zero or what an earlier
/// post of another operation wrote there, which no provider reads for this opcode. So the
/// provider is never handed uninitialised memory. The QP's `&mut` (posting needs it) makes
/// the post the only user; the QP may move between posts, so `sg_list` is set per post.
pub(crate) struct PostWr {
    pub(crate) wr: ibv_send_wr,
    pub(crate) sges: Sges,
}

impl PostWr {
    pub(crate) fn new() -> Self {
        PostWr {
            wr: blank_wr(),
            sges: [MaybeUninit::new(ibv_sge::default()); MAX_SGE],
        }
    }
}

/// The most work requests one [`SendBatch`] holds.
pub const MAX_BATCH: usize = 32;

/// Up to [`MAX_BATCH`] send work requests posted with one `ibv_post_send` call
/// ([`QueuePair::post_batch`]). Reusable; holds no heap memory.
#[derive(Debug, Default)]
pub struct SendBatch {
    reqs: [Option<SendRequest>; MAX_BATCH],
    len: usize,
}

impl SendBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a request; gives it back when the batch is full.
    ///
    /// # Errors
    /// The request, when [`MAX_BATCH`] are already queued.
    pub fn push(&mut self, r: SendRequest) -> Result<(), SendRequest> {
        if self.len == MAX_BATCH {
            return Err(r);
        }
        self.reqs[self.len] = Some(r);
        self.len += 1;
        Ok(())
    }
    /// Number of queued requests.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Removes every queued request.
    pub fn drain(&mut self) -> impl Iterator<Item = SendRequest> + '_ {
        let n = std::mem::take(&mut self.len);
        self.reqs[..n].iter_mut().filter_map(Option::take)
    }
}

impl<T: Transport> QueuePair<T> {
    /// Posts one send work request. Its buffers are owned by the operation until its
    /// completion (or, unsignalled, a later one) hands them back.
    ///
    /// # Errors
    /// With the request handed back: [`Error::QueueFull`] (poll completions first),
    /// [`Error::InvalidRequest`] (operation not valid for this transport, too many
    /// buffers, misaligned atomic, inline too large), [`Error::OutOfBounds`] (local
    /// buffers longer than the remote window), [`Error::PostSend`].
    #[inline]
    pub fn post_send(&mut self, req: SendRequest) -> Result<(), PostError<SendRequest>> {
        // Not dropped in place on the way out: its drop glue, even in a branch never taken,
        // takes the request's address and so keeps it in memory. Every exit hands it on by
        // value (back to the caller whole, or to a cold drop), or knows it holds nothing to
        // drop.
        let mut req = std::mem::ManuallyDrop::new(req);
        let core = &mut self.core;
        let pd = Arc::as_ptr(&core.pd.inner);
        // The QP's own work request (zeroed at creation; see `PostWr`): no 128-byte blank
        // per post, only the fields this operation uses are written.
        let post = &mut core.post_wr;
        if let Err(error) = req.encode::<T, false>(
            core.max_send_sge.get(),
            core.max_inline,
            pd,
            &mut post.wr,
            &mut post.sges,
        ) {
            return Err(PostError {
                error,
                request: std::mem::ManuallyDrop::into_inner(req),
            });
        }
        // The checks of the buffers themselves, only where they can matter.
        if req.flags & sys::IBV_SEND_INLINE != 0 || crate::pd::several() {
            if let Err(error) = check_owners(req.bufs.owners(), req.flags, pd) {
                return Err(PostError {
                    error,
                    request: std::mem::ManuallyDrop::into_inner(req),
                });
            }
        }
        // SAFETY: `sq_head` is `sq`'s cursor.
        let Some(slot) = (unsafe { core.sq.free_at_cursor(core.sq_head) }) else {
            return Err(queue_full(
                core.sq.depth(),
                std::mem::ManuallyDrop::into_inner(req),
            ));
        };
        // The request keeps everything but its buffers, which the slot owns from here on
        // (until the completion, or the provider's refusal, hands them back).
        let (user, ah) = (req.wr_id, req.ah());
        let id = slot.post(&mut req.bufs, user, ah, false);
        // (Reached through the work request's own field, not a new borrow of the whole
        // `post_wr`: that would invalidate the `sg_list` pointer `encode` took from the SGEs.)
        let wr = &mut core.post_wr.wr;
        wr.wr_id = id;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; the work request and its SGEs are initialised and valid for
        // the call (`encode` just pointed `sg_list` at `post_wr.sges`); every SGE names a
        // live registration kept alive by the slot until the completion or QP destruction.
        let rc = unsafe { ops::post_send(core.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(refused(
                core,
                id,
                rc,
                std::mem::ManuallyDrop::into_inner(req),
            ));
        }
        WorkQueue::advance_past(&mut core.sq_head, slot);
        // What is left to drop: the buffers went into the slot (the list is empty), so only
        // a UD destination's address handle (the slot holds a clone of it).
        if matches!(req.op, Op::SendTo(_)) {
            // SAFETY: `req` is not used after this.
            drop_request(unsafe { std::mem::ManuallyDrop::take(&mut req) });
        }
        Ok(())
    }

    /// Posts every request of `batch` with a single `ibv_post_send`, returning how many
    /// were posted (the batch is then empty).
    ///
    /// One doorbell for up to [`MAX_BATCH`] work requests; with [`SendRequest::unsignaled`]
    /// on all but the last, one completion for all of them (selective signalling: the
    /// buffers of the unsignalled ones are released when that completion is polled).
    ///
    /// # Errors
    /// If a request is invalid or the provider rejects one, the requests from that one on
    /// stay in `batch` exactly as they were pushed (operation, flags, id and buffers; those
    /// before it were posted) and the error is returned.
    pub fn post_batch(&mut self, batch: &mut SendBatch) -> Result<usize> {
        let n = batch.len;
        if n == 0 {
            return Ok(0);
        }
        let mut wrs = [MaybeUninit::<ibv_send_wr>::uninit(); MAX_BATCH];
        let mut sges: [Sges; MAX_BATCH] = [[const { MaybeUninit::uninit() }; MAX_SGE]; MAX_BATCH];
        let mut ids = [0u64; MAX_BATCH];
        let core = &mut self.core;
        let pd = Arc::as_ptr(&core.pd.inner);
        let mut filled = 0;
        let mut err = None;
        let mut cursor = core.sq_head;
        for i in 0..n {
            let req = batch.reqs[i]
                .as_mut()
                .expect("batch entries below len are Some");
            let mut wr = blank_wr();
            if let Err(e) = req.encode::<T, true>(
                core.max_send_sge.get(),
                core.max_inline,
                pd,
                &mut wr,
                &mut sges[i],
            ) {
                err = Some(e);
                break;
            }
            // SAFETY: `cursor` started as `sq_head` and moved only past `sq`'s slots.
            let Some(slot) = (unsafe { core.sq.free_at_cursor(cursor) }) else {
                err = Some(Error::QueueFull {
                    queue: "send queue",
                    depth: core.sq.depth(),
                });
                break;
            };
            // The request stays in the batch without its buffers until it is posted (or
            // gets them back, refused).
            let (user, ah) = (req.wr_id, req.ah());
            ids[i] = slot.post(&mut req.bufs, user, ah, false);
            WorkQueue::advance_past(&mut cursor, slot);
            wrs[i].write(wr);
            filled += 1;
        }
        // Chain what was filled. Every pointer into `wrs` comes from one base pointer, and
        // `wrs` is not touched through references after this, so the chain stays valid.
        let base = wrs.as_mut_ptr().cast::<ibv_send_wr>();
        for i in 0..filled {
            let next = if i + 1 < filled {
                // SAFETY: `i + 1 < filled <= MAX_BATCH`: inside `wrs`.
                unsafe { base.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: entries below `filled` were written above; reached through `base`.
            let w = unsafe { &mut *base.add(i) };
            w.wr_id = ids[i];
            w.sg_list = sges[i].as_mut_ptr().cast();
            w.next = next;
        }
        let mut posted = filled;
        if filled > 0 {
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // SAFETY: the QP is live; the chain of `filled` initialised WRs and their SGEs
            // is valid for the call; the buffers are owned by their slots.
            let rc = unsafe { ops::post_send(core.qp, base, &mut bad) };
            if rc != 0 {
                // Everything from `bad` on was not posted: take those slots back. A `bad`
                // that names none of them says nothing about what the provider took: keep
                // every request as posted (its buffers come back with its completion, a
                // flush, or the QP's destruction) rather than free what the device may use.
                let first_bad = (0..filled)
                    // SAFETY: `i < filled`: inside `wrs` (only the address is compared).
                    .find(|&i| std::ptr::eq(unsafe { base.add(i) }, bad))
                    .unwrap_or(filled);
                posted = first_bad;
                for (i, &id) in ids.iter().enumerate().take(filled).skip(first_bad) {
                    if let Some(mut d) = core.sq.unfill(id) {
                        // The request, still in the batch, gets its buffers back whole.
                        let req = batch.reqs[i].as_mut().expect("filled entries are Some");
                        req.bufs.move_into_empty(&mut d.bufs);
                    }
                }
                err = Some(Error::PostSend {
                    qpn: core.qpn,
                    source: rc_error(rc),
                });
            }
        }
        if posted > 0 {
            // SAFETY: `ids[posted - 1]` is the address of the slot of `sq` that the last
            // posted request went into (from `Slot::post`), which the queue keeps alive.
            let last = unsafe { &*(ids[posted - 1] as *const crate::inflight::Slot) };
            WorkQueue::advance_past(&mut core.sq_head, last);
        }
        // The posted requests leave the batch (their buffers are in their slots).
        for r in &mut batch.reqs[..posted] {
            *r = None;
        }
        // Compact the unposted remainder to the front.
        let mut w = 0;
        for r in 0..n {
            if let Some(req) = batch.reqs[r].take() {
                batch.reqs[w] = Some(req);
                w += 1;
            }
        }
        batch.len = w;
        match err {
            Some(e) => Err(e),
            None => Ok(posted),
        }
    }

    /// Sends `data` inline (copied into the work request during the call; no registered
    /// memory needed). Unsignalled when `signaled` is false.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when `data` exceeds [`max_inline_data`](Self::max_inline_data)
    /// or the transport is UD (use a registered buffer with [`SendRequest::send_to`]);
    /// [`Error::QueueFull`]; [`Error::PostSend`].
    pub fn send_inline(&mut self, data: &[u8], wr_id: u64, signaled: bool) -> Result<()> {
        if T::QPT == sys::IBV_QPT_UD {
            return Err(Error::InvalidRequest(
                "UD inline sends are not supported by the safe layer",
            ));
        }
        if data.len() > self.core.max_inline as usize {
            return Err(Error::InvalidRequest(
                "inline data larger than the QP's max_inline_data",
            ));
        }
        let mut sge = ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        let mut wr = blank_wr();
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = sys::IBV_SEND_INLINE | if signaled { sys::IBV_SEND_SIGNALED } else { 0 };
        let core = &mut self.core;
        // SAFETY: `sq_head` is `sq`'s cursor.
        let Some(slot) = (unsafe { core.sq.free_at_cursor(core.sq_head) }) else {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: core.sq.depth(),
            });
        };
        let id = slot.post(&mut SgList::new(), wr_id, None, false);
        wr.wr_id = id;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is live; with IBV_SEND_INLINE the provider copies `data` during the
        // call, so the borrow need not outlive it.
        let rc = unsafe { ops::post_send(core.qp, &mut wr, &mut bad) };
        if rc != 0 {
            core.sq.unfill(id);
            return Err(Error::PostSend {
                qpn: core.qpn,
                source: rc_error(rc),
            });
        }
        WorkQueue::advance_past(&mut core.sq_head, slot);
        Ok(())
    }
}

impl QueuePair<Rc> {
    /// SEND `bufs` (see [`SendRequest::send`]).
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn send(
        &mut self,
        bufs: impl Into<SgList>,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::send(bufs).wr_id(wr_id))
    }
    /// RDMA WRITE `bufs` to `remote`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn write(
        &mut self,
        bufs: impl Into<SgList>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::write(bufs, remote).wr_id(wr_id))
    }
    /// RDMA READ `remote` into `bufs`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn read(
        &mut self,
        bufs: impl Into<SgList>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::read(bufs, remote).wr_id(wr_id))
    }
}

impl QueuePair<Uc> {
    /// SEND `bufs`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn send(
        &mut self,
        bufs: impl Into<SgList>,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::send(bufs).wr_id(wr_id))
    }
    /// RDMA WRITE `bufs` to `remote`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn write(
        &mut self,
        bufs: impl Into<SgList>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::write(bufs, remote).wr_id(wr_id))
    }
}

impl QueuePair<Ud> {
    /// An address handle + QPN + Q_Key for sending to `remote` from this QP's port and GID.
    ///
    /// # Errors
    /// [`Error::CreateAh`].
    pub fn dest(&self, remote: &Endpoint) -> Result<UdDest> {
        let p = self.core.p;
        let attr = AhAttr::to_endpoint(remote, p.port, p.gid_index.unwrap_or(0));
        let ah = self.core.pd.create_ah(&attr)?;
        Ok(UdDest {
            ah,
            qpn: remote.qpn,
            qkey: remote.qkey,
        })
    }

    /// UD SEND of `bufs` to `dest` (at most one path MTU).
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn send_to(
        &mut self,
        bufs: impl Into<SgList>,
        dest: &UdDest,
        wr_id: u64,
    ) -> Result<(), PostError<SendRequest>> {
        self.post_send(SendRequest::send_to(bufs, dest.clone()).wr_id(wr_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_holds_up_to_max_batch_and_drains() {
        let mut b = SendBatch::new();
        assert!(b.is_empty());
        for i in 0..MAX_BATCH as u64 {
            b.push(SendRequest::send(SgList::new()).wr_id(i)).unwrap();
        }
        let extra = b
            .push(SendRequest::send(SgList::new()).wr_id(99))
            .unwrap_err();
        assert_eq!(extra.wr_id, 99, "the request comes back when full");
        assert_eq!(b.len(), MAX_BATCH);
        let ids: Vec<u64> = b.drain().map(|r| r.wr_id).collect();
        assert_eq!(ids, (0..MAX_BATCH as u64).collect::<Vec<_>>());
        assert!(b.is_empty());
    }

    #[test]
    fn requests_are_validated_per_transport_before_posting() {
        use crate::qp::{Rc, Uc, Ud};
        let mut wr = blank_wr();
        let mut sges: Sges = [const { MaybeUninit::uninit() }; MAX_SGE];
        let remote = RemoteMemory {
            addr: 0x1000,
            len: 64,
            rkey: 7,
        };
        // READ and atomics are RC-only.
        let read = SendRequest::read(SgList::new(), remote);
        assert!(read
            .encode::<Rc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .is_ok());
        assert_eq!(wr.opcode, IBV_WR_RDMA_READ);
        // SAFETY: the rdma member was just written by encode.
        assert_eq!(unsafe { wr.wr.rdma.rkey }, 7);
        assert!(read
            .encode::<Uc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .is_err());
        assert!(read
            .encode::<Ud, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .is_err());
        // Immediate data is carried in network byte order.
        let w = SendRequest::write(SgList::new(), remote).imm(0x0102_0304);
        w.encode::<Uc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .unwrap();
        assert_eq!(wr.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(wr.imm_data, 0x0102_0304u32.to_be());
        // Plain SEND needs a destination on UD; READ cannot carry immediate data.
        assert!(SendRequest::send(SgList::new())
            .encode::<Ud, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .is_err());
        assert!(SendRequest::read(SgList::new(), remote)
            .imm(1)
            .encode::<Rc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .is_err());
        // Unsignalled clears the flag; the default is signalled.
        SendRequest::send(SgList::new())
            .unsignaled()
            .encode::<Rc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .unwrap();
        assert_eq!(wr.send_flags & IBV_SEND_SIGNALED, 0);
        SendRequest::send(SgList::new())
            .encode::<Rc, true>(1, 0, std::ptr::null(), &mut wr, &mut sges)
            .unwrap();
        assert_eq!(wr.send_flags & IBV_SEND_SIGNALED, IBV_SEND_SIGNALED);
    }
}
