//! A device-free fake provider for tests: an `ibv_context` whose op table (and the library
//! entry points in a [`Verbs`] table) are plain Rust functions whose behaviour the test
//! controls. Objects made from it go through the crate's normal code paths (the same
//! `Context`, `ProtectionDomain`, `CompletionQueue`, `QueuePair`, ...), so faults that real
//! devices rarely show — a failing `poll_cq`, a `bad_wr` naming nothing, a failed
//! `ibv_dereg_mr` — can be injected on any machine, and under Miri (no FFI is involved: every
//! "provider" function is Rust).
//!
//! The fake models a device loosely: posted work requests stay "on the device" until the test
//! completes them ([`Fake::complete_sends`], [`Fake::complete_recv`]) or the QP is moved to
//! ERR (every outstanding work request then completes with `WR_FLUSH_ERR`), or the QP is
//! destroyed (the device forgets them). Completions wait in a per-CQ queue until polled.
//!
//! Completion channels are real: an `eventfd` (semaphore mode) per channel, so a reactor can
//! wait on it. A CQ armed with `req_notify_cq` raises one event on its channel as soon as a
//! completion is added after the arm (like rxe: completions already there at the arm raise
//! none) — checked whenever the test steers the device ([`Fake::with`], `complete_*`) and
//! when a post or a move to ERR adds completions. Events and acknowledgements are counted
//! per CQ.
#![allow(unsafe_code)]

use crate::context::Context;
use crate::device::DeviceInfo;
use crate::loader::Verbs;
use crate::sys::*;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

/// `IBV_WC_WR_FLUSH_ERR`.
pub(crate) const WC_FLUSH: u32 = 5;

/// How the fake's `post_send` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PostSendMode {
    /// Accepts every work request.
    Accept,
    /// Accepts the first `n` work requests of the chain, then fails with `rc`, `bad_wr`
    /// pointing at request `n`.
    FailAt { n: usize, rc: c_int },
    /// Accepts the whole chain, yet returns `rc` with a `bad_wr` that names no request of
    /// it (a provider bug the safe layer must survive).
    FailForeign { rc: c_int },
}

/// One work request as the fake device saw it.
#[derive(Clone, Debug)]
pub(crate) struct PostedSend {
    pub(crate) wr_id: u64,
    pub(crate) opcode: u32,
    pub(crate) flags: u32,
    pub(crate) sges: Vec<ibv_sge>,
    /// `imm_data` as posted (network byte order).
    pub(crate) imm_data: u32,
    /// The remote address and rkey as posted (`wr.atomic`'s for atomics, else `wr.rdma`'s).
    pub(crate) rdma: (u64, u32),
    /// `wr.atomic.compare_add` as posted.
    pub(crate) compare_add: u64,
}

#[derive(Default)]
pub(crate) struct CqState {
    pub(crate) wcs: VecDeque<ibv_wc>,
    /// The next this-many polls fail (`-EIO`).
    pub(crate) fail_polls: usize,
    pub(crate) polls: usize,
    /// The channel it reports to (`*mut FakeChannel`, 0 for none).
    pub(crate) channel: usize,
    /// Armed: the next completion added raises an event.
    pub(crate) armed: bool,
    /// Completions ever added when it was armed (`taken + wcs.len()` then).
    pub(crate) armed_at: usize,
    /// Completions polled so far.
    pub(crate) taken: usize,
    /// Events raised on its channel, and acknowledged (`ibv_ack_cq_events`).
    pub(crate) events: usize,
    pub(crate) acked: usize,
    pub(crate) ack_calls: usize,
}

pub(crate) struct QpState {
    pub(crate) qpn: u32,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    pub(crate) srq: usize,
    pub(crate) state: u32,
    pub(crate) sends: VecDeque<PostedSend>,
    pub(crate) recvs: VecDeque<u64>,
}

/// Everything the fake device knows; tests read and change it through [`Fake::with`].
#[derive(Default)]
pub(crate) struct State {
    pub(crate) cqs: HashMap<usize, CqState>,
    pub(crate) qps: HashMap<usize, QpState>,
    pub(crate) srqs: HashMap<usize, VecDeque<u64>>,
    pub(crate) mrs: usize,
    pub(crate) next_key: u32,
    pub(crate) next_qpn: u32,
    pub(crate) post_send_mode: Option<PostSendMode>,
    /// Complete every signalled send as soon as it is posted (success).
    pub(crate) auto_complete: bool,
    /// The next this-many `ibv_dereg_mr` calls fail (and keep the registration).
    pub(crate) fail_dereg: usize,
    /// Every send work request ever accepted (in order), unless `no_log`.
    pub(crate) log: Vec<PostedSend>,
    pub(crate) no_log: bool,
    /// Objects of another context handed to this one (the kernel would resolve their
    /// handles in this context: a different object, or none).
    pub(crate) foreign: Vec<&'static str>,
}

pub(crate) struct FakeDevice {
    state: Mutex<State>,
}

#[repr(C)]
struct FakeContext {
    ctx: ibv_context,
    dev: Arc<FakeDevice>,
}

#[repr(C)]
struct FakeChannel {
    ch: ibv_comp_channel,
    /// The CQs of the events not read yet, oldest first (one eventfd count each).
    events: Mutex<VecDeque<usize>>,
}

#[repr(C)]
struct FakeAh {
    context: *mut ibv_context,
}

/// A fake device's context plus the handle the test steers it with.
pub(crate) struct Fake {
    pub(crate) dev: Arc<FakeDevice>,
    pub(crate) ctx: Context,
}

impl Fake {
    pub(crate) fn new() -> Fake {
        let dev = Arc::new(FakeDevice {
            state: Mutex::new(State {
                next_key: 0x100,
                next_qpn: 0x11,
                ..State::default()
            }),
        });
        let ops = ibv_context_ops {
            _compat_0_10: [None; 11],
            poll_cq: Some(poll_cq),
            req_notify_cq: Some(req_notify_cq),
            _compat_13_19: [None; 7],
            post_srq_recv: Some(post_srq_recv),
            _compat_21_24: [None; 4],
            post_send: Some(post_send),
            post_recv: Some(post_recv),
            _compat_27_31: [None; 5],
        };
        let ctx = Box::into_raw(Box::new(FakeContext {
            ctx: ibv_context {
                device: std::ptr::null_mut(),
                ops,
                cmd_fd: -1,
                async_fd: -1,
                num_comp_vectors: 1,
            },
            dev: dev.clone(),
        }));
        let info = DeviceInfo {
            name: "fake0".into(),
            guid: 0,
        };
        let ctx = Context::from_raw(&FAKE_VERBS, ctx.cast(), info);
        Fake { dev, ctx }
    }

    /// Locks the device state.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut s = self.dev.lock();
        let r = f(&mut s);
        s.raise_events();
        r
    }

    /// Makes the next `n` polls of the CQ `cq_id` fail.
    pub(crate) fn fail_polls(&self, cq_id: u64, n: usize) {
        self.with(|s| {
            s.cqs
                .get_mut(&(cq_id as usize))
                .expect("fake CQ")
                .fail_polls = n
        });
    }

    /// Work requests of QP `qpn` still on the device (posted, neither completed nor flushed).
    pub(crate) fn sends_on_device(&self, qpn: u32) -> usize {
        self.with(|s| s.qp_by_num(qpn).map_or(0, |q| q.sends.len()))
    }

    /// The device finishes the next `n` send work requests of QP `qpn` with `status`
    /// (signalled ones produce a completion); returns how many completions it queued.
    pub(crate) fn complete_sends(&self, qpn: u32, n: usize, status: u32) -> usize {
        self.with(|s| {
            let q = s.qp_by_num_mut(qpn).expect("fake QP");
            let (cq, qpn) = (q.send_cq, q.qpn);
            let mut out = Vec::new();
            for _ in 0..n {
                let Some(w) = q.sends.pop_front() else { break };
                if w.flags & IBV_SEND_SIGNALED != 0 || status != 0 {
                    out.push(send_wc(&w, qpn, status));
                }
            }
            let k = out.len();
            s.cqs.get_mut(&cq).expect("fake CQ").wcs.extend(out);
            k
        })
    }

    /// The device fills the oldest receive of QP `qpn` (its own queue, or its SRQ's) with a
    /// message of `byte_len` bytes.
    pub(crate) fn complete_recv(&self, qpn: u32, byte_len: u32, status: u32) {
        self.with(|s| {
            let q = s.qp_by_num_mut(qpn).expect("fake QP");
            let (cq, srq) = (q.recv_cq, q.srq);
            let wr_id = if srq != 0 {
                None
            } else {
                Some(q.recvs.pop_front().expect("a posted receive"))
            };
            let wr_id = wr_id.unwrap_or_else(|| {
                s.srqs
                    .get_mut(&srq)
                    .and_then(VecDeque::pop_front)
                    .expect("a posted SRQ receive")
            });
            let wc = ibv_wc {
                wr_id,
                status,
                opcode: IBV_WC_RECV,
                byte_len,
                qp_num: qpn,
                ..ibv_wc::default()
            };
            s.cqs.get_mut(&cq).expect("fake CQ").wcs.push_back(wc);
        });
    }
}

impl FakeDevice {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn qp_by_num(&self, qpn: u32) -> Option<&QpState> {
        self.qps.values().find(|q| q.qpn == qpn)
    }
    fn qp_by_num_mut(&mut self, qpn: u32) -> Option<&mut QpState> {
        self.qps.values_mut().find(|q| q.qpn == qpn)
    }
    fn key(&mut self) -> u32 {
        self.next_key += 1;
        self.next_key
    }

    /// Every armed CQ that got a completion since its arm raises one event and is disarmed.
    fn raise_events(&mut self) {
        for (&id, c) in &mut self.cqs {
            if c.armed && c.channel != 0 && c.taken + c.wcs.len() > c.armed_at {
                c.armed = false;
                c.events += 1;
                // SAFETY: a CQ's channel outlives it (the safe layer holds it).
                let ch = unsafe { &*(c.channel as *const FakeChannel) };
                ch.events
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(id);
                let one = 1u64;
                // SAFETY: the channel's eventfd is open; `one` is 8 readable bytes.
                let n = unsafe { libc::write(ch.ch.fd, (&one as *const u64).cast(), 8) };
                assert_eq!(n, 8, "fake channel: eventfd write");
            }
        }
    }
}

fn send_wc(w: &PostedSend, qpn: u32, status: u32) -> ibv_wc {
    let opcode = match w.opcode {
        IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => IBV_WC_RDMA_WRITE,
        IBV_WR_RDMA_READ => IBV_WC_RDMA_READ,
        IBV_WR_ATOMIC_CMP_AND_SWP => IBV_WC_COMP_SWAP,
        IBV_WR_ATOMIC_FETCH_AND_ADD => IBV_WC_FETCH_ADD,
        _ => IBV_WC_SEND,
    };
    ibv_wc {
        wr_id: w.wr_id,
        status,
        opcode,
        qp_num: qpn,
        byte_len: w.sges.iter().map(|s| s.length).sum(),
        ..ibv_wc::default()
    }
}

/// The device behind any object of a fake context.
///
/// # Safety
/// `ctx` is the context of a live object created by a [`Fake`].
unsafe fn dev<'a>(ctx: *mut ibv_context) -> &'a FakeDevice {
    // SAFETY: every fake context is a `FakeContext` (first field `ctx`, repr(C)), alive until
    // close_device, which runs only after every object of it was destroyed.
    unsafe { &(*ctx.cast::<FakeContext>()).dev }
}

// ---- the library entry points ------------------------------------------------------------

pub(crate) static FAKE_VERBS: Verbs = Verbs {
    get_device_list,
    free_device_list,
    get_device_name,
    get_device_guid,
    open_device,
    close_device,
    query_device,
    query_port,
    query_gid,
    query_gid_ex: None,
    alloc_pd,
    dealloc_pd,
    reg_mr,
    dereg_mr,
    reg_dmabuf_mr: Some(reg_dmabuf_mr),
    create_comp_channel,
    destroy_comp_channel,
    create_cq,
    destroy_cq,
    get_cq_event,
    ack_cq_events,
    create_qp,
    modify_qp,
    query_qp,
    destroy_qp,
    create_srq,
    destroy_srq,
    create_ah,
    destroy_ah,
};

unsafe extern "C" fn get_device_list(n: *mut c_int) -> *mut *mut ibv_device {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *n = 0 };
    std::ptr::null_mut()
}
unsafe extern "C" fn free_device_list(_: *mut *mut ibv_device) {}
unsafe extern "C" fn get_device_name(_: *mut ibv_device) -> *const c_char {
    std::ptr::null()
}
unsafe extern "C" fn get_device_guid(_: *mut ibv_device) -> u64 {
    0
}
unsafe extern "C" fn open_device(_: *mut ibv_device) -> *mut ibv_context {
    std::ptr::null_mut()
}
unsafe extern "C" fn close_device(ctx: *mut ibv_context) -> c_int {
    // SAFETY: made by `Fake::new` with Box::into_raw; closed once, after all its objects.
    drop(unsafe { Box::from_raw(ctx.cast::<FakeContext>()) });
    0
}
unsafe extern "C" fn query_device(_: *mut ibv_context, a: *mut ibv_device_attr) -> c_int {
    // SAFETY: the caller passes a valid, initialised out-struct.
    let a = unsafe { &mut *a };
    a.max_qp_rd_atom = 16;
    a.max_qp_init_rd_atom = 16;
    a.max_qp_wr = 1024;
    a.max_sge = 4;
    a.phys_port_cnt = 1;
    0
}
unsafe extern "C" fn query_port(_: *mut ibv_context, _port: u8, a: *mut ibv_port_attr) -> c_int {
    // SAFETY: the caller passes a valid, initialised out-struct.
    let a = unsafe { &mut *a };
    a.state = IBV_PORT_ACTIVE;
    a.max_mtu = 3;
    a.active_mtu = 3;
    a.gid_tbl_len = 2;
    a.link_layer = IBV_LINK_LAYER_ETHERNET;
    0
}
unsafe extern "C" fn query_gid(_: *mut ibv_context, _: u8, i: c_int, g: *mut ibv_gid) -> c_int {
    // SAFETY: the caller passes a valid out-struct.
    unsafe { (*g).raw = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, i as u8] };
    0
}
unsafe extern "C" fn alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    Box::into_raw(Box::new(ibv_pd {
        context: ctx,
        handle: 1,
    }))
}
unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: made by `alloc_pd`, freed once.
    drop(unsafe { Box::from_raw(pd) });
    0
}
unsafe extern "C" fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    _: c_int,
) -> *mut ibv_mr {
    // SAFETY: `pd` is a live fake PD.
    let ctx = unsafe { (*pd).context };
    // SAFETY: as above.
    let mut s = unsafe { dev(ctx) }.lock();
    s.mrs += 1;
    let key = s.key();
    Box::into_raw(Box::new(ibv_mr {
        context: ctx,
        pd,
        addr,
        length: len,
        handle: key,
        lkey: key,
        rkey: key | 0x8000_0000,
    }))
}
unsafe extern "C" fn reg_dmabuf_mr(
    pd: *mut ibv_pd,
    _offset: u64,
    len: usize,
    iova: u64,
    _fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded; the fake never touches the "memory".
    unsafe { reg_mr(pd, iova as *mut c_void, len, access) }
}
unsafe extern "C" fn dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: `mr` is a live fake MR.
    let mut s = unsafe { dev((*mr).context) }.lock();
    if s.fail_dereg > 0 {
        s.fail_dereg -= 1;
        return libc::EBUSY;
    }
    s.mrs -= 1;
    drop(s);
    // SAFETY: made by `reg_mr`, freed once (only on success).
    drop(unsafe { Box::from_raw(mr) });
    0
}
unsafe extern "C" fn create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    // SAFETY: no pointer arguments.
    let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return std::ptr::null_mut();
    }
    let ch = Box::new(FakeChannel {
        ch: ibv_comp_channel {
            context: ctx,
            fd,
            refcnt: 0,
        },
        events: Mutex::new(VecDeque::new()),
    });
    Box::into_raw(ch).cast()
}
unsafe extern "C" fn destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    // SAFETY: made by `create_comp_channel`, freed once.
    let ch = unsafe { Box::from_raw(ch.cast::<FakeChannel>()) };
    // SAFETY: the eventfd is open and closed only here.
    unsafe { libc::close(ch.ch.fd) };
    0
}
unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    _: *mut c_void,
    channel: *mut ibv_comp_channel,
    _: c_int,
) -> *mut ibv_cq {
    let cq = Box::into_raw(Box::new(ibv_cq {
        context: ctx,
        channel,
        cq_context: std::ptr::null_mut(),
        handle: 0,
        cqe,
    }));
    // SAFETY: `ctx` is a live fake context.
    unsafe { dev(ctx) }.lock().cqs.insert(
        cq as usize,
        CqState {
            channel: channel as usize,
            ..CqState::default()
        },
    );
    cq
}
unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: `cq` is a live fake CQ.
    unsafe { dev((*cq).context) }
        .lock()
        .cqs
        .remove(&(cq as usize));
    // SAFETY: made by `create_cq`, freed once.
    drop(unsafe { Box::from_raw(cq) });
    0
}
/// Like libibverbs: one `read` of the channel's fd per event (blocking unless the fd is
/// non-blocking; `-1` with `errno` set when the read fails).
unsafe extern "C" fn get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: `ch` is a live fake channel.
    let ch = unsafe { &*ch.cast::<FakeChannel>() };
    let mut v = 0u64;
    // SAFETY: the eventfd is open; `v` has room for 8 bytes.
    if unsafe { libc::read(ch.ch.fd, (&mut v as *mut u64).cast(), 8) } != 8 {
        return -1;
    }
    let id = ch
        .events
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop_front()
        .expect("fake channel: an event per eventfd count");
    // SAFETY: the out-pointers are valid (the caller's contract); the CQ is alive while it
    // has unacknowledged events (the safe layer acknowledges before destroying it).
    unsafe {
        *cq = id as *mut ibv_cq;
        *cq_context = (*(id as *mut ibv_cq)).cq_context;
    }
    0
}
unsafe extern "C" fn ack_cq_events(cq: *mut ibv_cq, n: u32) {
    // SAFETY: `cq` is a live fake CQ.
    let mut s = unsafe { dev((*cq).context) }.lock();
    let c = s.cqs.get_mut(&(cq as usize)).expect("fake CQ");
    c.acked += n as usize;
    c.ack_calls += 1;
}
unsafe extern "C" fn create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: `pd` is a live fake PD and `init` a valid attribute struct.
    let (ctx, init) = unsafe { ((*pd).context, &mut *init) };
    // SAFETY: as above.
    let mut s = unsafe { dev(ctx) }.lock();
    // The kernel resolves the CQ/SRQ handles in *this* context.
    // SAFETY: the CQs/SRQ passed are live objects (of some context).
    unsafe {
        if (*init.send_cq).context != ctx || (*init.recv_cq).context != ctx {
            s.foreign.push("create_qp: CQ of another context");
        }
        if !init.srq.is_null() && (*init.srq).context != ctx {
            s.foreign.push("create_qp: SRQ of another context");
        }
    }
    s.next_qpn += 1;
    let qpn = s.next_qpn;
    let qp = Box::into_raw(Box::new(ibv_qp {
        context: ctx,
        qp_context: std::ptr::null_mut(),
        pd,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        handle: qpn,
        qp_num: qpn,
        state: IBV_QPS_RESET,
        qp_type: init.qp_type,
    }));
    s.qps.insert(
        qp as usize,
        QpState {
            qpn,
            send_cq: init.send_cq as usize,
            recv_cq: init.recv_cq as usize,
            srq: init.srq as usize,
            state: IBV_QPS_RESET,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
        },
    );
    qp
}
unsafe extern "C" fn modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    if mask & IBV_QP_STATE == 0 {
        return 0;
    }
    // SAFETY: `qp` is a live fake QP; `attr` a valid struct.
    let (ctx, to) = unsafe { ((*qp).context, (*attr).qp_state) };
    // SAFETY: as above.
    let mut s = unsafe { dev(ctx) }.lock();
    let q = s.qps.get_mut(&(qp as usize)).expect("fake QP");
    q.state = to;
    if to == IBV_QPS_ERR {
        // Everything outstanding is flushed.
        let qpn = q.qpn;
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        let sends: Vec<ibv_wc> = q
            .sends
            .drain(..)
            .map(|w| send_wc(&w, qpn, WC_FLUSH))
            .collect();
        let recvs: Vec<ibv_wc> = q
            .recvs
            .drain(..)
            .map(|wr_id| ibv_wc {
                wr_id,
                status: WC_FLUSH,
                opcode: IBV_WC_RECV,
                qp_num: qpn,
                ..ibv_wc::default()
            })
            .collect();
        if let Some(c) = s.cqs.get_mut(&scq) {
            c.wcs.extend(sends);
        }
        if let Some(c) = s.cqs.get_mut(&rcq) {
            c.wcs.extend(recvs);
        }
        s.raise_events();
    }
    0
}
unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _: c_int,
    _: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: `qp` is a live fake QP; `attr` a valid out-struct.
    let s = unsafe { dev((*qp).context) }.lock();
    // SAFETY: as above.
    unsafe { (*attr).qp_state = s.qps[&(qp as usize)].state };
    0
}
unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: `qp` is a live fake QP. Work still on the device is forgotten; completions
    // already queued stay in their CQs (late completions, as rxe leaves them).
    unsafe { dev((*qp).context) }
        .lock()
        .qps
        .remove(&(qp as usize));
    // SAFETY: made by `create_qp`, freed once.
    drop(unsafe { Box::from_raw(qp) });
    0
}
unsafe extern "C" fn create_srq(pd: *mut ibv_pd, _: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    // SAFETY: `pd` is a live fake PD.
    let ctx = unsafe { (*pd).context };
    let srq = Box::into_raw(Box::new(ibv_srq {
        context: ctx,
        srq_context: std::ptr::null_mut(),
        pd,
        handle: 0,
    }));
    // SAFETY: as above.
    unsafe { dev(ctx) }
        .lock()
        .srqs
        .insert(srq as usize, VecDeque::new());
    srq
}
unsafe extern "C" fn destroy_srq(srq: *mut ibv_srq) -> c_int {
    // SAFETY: `srq` is a live fake SRQ.
    unsafe { dev((*srq).context) }
        .lock()
        .srqs
        .remove(&(srq as usize));
    // SAFETY: made by `create_srq`, freed once.
    drop(unsafe { Box::from_raw(srq) });
    0
}
unsafe extern "C" fn create_ah(pd: *mut ibv_pd, _: *mut ibv_ah_attr) -> *mut ibv_ah {
    // SAFETY: `pd` is a live fake PD.
    let context = unsafe { (*pd).context };
    Box::into_raw(Box::new(FakeAh { context })).cast()
}
unsafe extern "C" fn destroy_ah(ah: *mut ibv_ah) -> c_int {
    // SAFETY: made by `create_ah`, freed once.
    drop(unsafe { Box::from_raw(ah.cast::<FakeAh>()) });
    0
}

// ---- the op table (data path) ------------------------------------------------------------

unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: `qp` is a live fake QP.
    let (ctx, qpt) = unsafe { ((*qp).context, (*qp).qp_type) };
    // SAFETY: as above.
    let mut s = unsafe { dev(ctx) }.lock();
    let mode = s.post_send_mode.unwrap_or(PostSendMode::Accept);
    let mut i = 0;
    while !wr.is_null() {
        if let PostSendMode::FailAt { n, rc } = mode {
            if i == n {
                // SAFETY: the caller passes a valid out-pointer.
                unsafe { *bad = wr };
                return rc;
            }
        }
        // SAFETY: `wr` heads a valid chain (the caller's contract).
        let w = unsafe { &*wr };
        let sges =
            // SAFETY: `sg_list` holds `num_sge` entries (the caller's contract).
            unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge.max(0) as usize) }.to_vec();
        if qpt == IBV_QPT_UD {
            // SAFETY: UD work requests carry the `ud` member.
            let ah = unsafe { w.wr.ud.ah };
            // SAFETY: address handles passed to post are live fake AHs (of some context).
            if unsafe { (*ah.cast::<FakeAh>()).context } != ctx {
                s.foreign
                    .push("post_send: address handle of another context");
            }
        }
        let atomic = matches!(
            w.opcode,
            IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD
        );
        let (rdma, compare_add) = if atomic {
            // SAFETY: an atomic work request sets the `atomic` member.
            let a = unsafe { w.wr.atomic };
            ((a.remote_addr, a.rkey), a.compare_add)
        } else {
            // SAFETY: bytes 0..12 of the union are initialised in every work request posted
            // here (each member sets them: `rdma`'s address and rkey, `atomic`'s address and
            // compare value, `ud`'s handle, QP number and Q_Key; a SEND's union is all zero or
            // what an earlier post wrote); no padding byte is read.
            (unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) }, 0)
        };
        let p = PostedSend {
            wr_id: w.wr_id,
            opcode: w.opcode,
            flags: w.send_flags,
            sges,
            imm_data: w.imm_data,
            rdma,
            compare_add,
        };
        if !s.no_log {
            s.log.push(p.clone());
        }
        let auto = s.auto_complete;
        let q = s.qps.get_mut(&(qp as usize)).expect("fake QP");
        if auto {
            let (cq, qpn) = (q.send_cq, q.qpn);
            if p.flags & IBV_SEND_SIGNALED != 0 {
                let wc = send_wc(&p, qpn, 0);
                s.cqs.get_mut(&cq).expect("fake CQ").wcs.push_back(wc);
            }
        } else {
            q.sends.push_back(p);
        }
        wr = w.next;
        i += 1;
    }
    s.raise_events();
    if let PostSendMode::FailForeign { rc } = mode {
        static NOTHING: u8 = 0;
        // SAFETY: the caller passes a valid out-pointer; the value names no request.
        unsafe { *bad = (&NOTHING as *const u8).cast_mut().cast() };
        return rc;
    }
    0
}

unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_recv_wr,
    _bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is a live fake QP.
    let mut s = unsafe { dev((*qp).context) }.lock();
    let q = s.qps.get_mut(&(qp as usize)).expect("fake QP");
    while !wr.is_null() {
        // SAFETY: `wr` heads a valid chain (the caller's contract).
        let w = unsafe { &*wr };
        q.recvs.push_back(w.wr_id);
        wr = w.next;
    }
    0
}

unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    mut wr: *mut ibv_recv_wr,
    _bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: `srq` is a live fake SRQ.
    let mut s = unsafe { dev((*srq).context) }.lock();
    let q = s.srqs.get_mut(&(srq as usize)).expect("fake SRQ");
    while !wr.is_null() {
        // SAFETY: `wr` heads a valid chain (the caller's contract).
        let w = unsafe { &*wr };
        q.push_back(w.wr_id);
        wr = w.next;
    }
    0
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: `cq` is a live fake CQ.
    let mut s = unsafe { dev((*cq).context) }.lock();
    let c = s.cqs.get_mut(&(cq as usize)).expect("fake CQ");
    c.polls += 1;
    if c.fail_polls > 0 {
        c.fail_polls -= 1;
        return -libc::EIO;
    }
    let mut k = 0;
    while k < n.max(0) as usize {
        let Some(w) = c.wcs.pop_front() else { break };
        // SAFETY: `wc` has room for `n` entries (the caller's contract).
        unsafe { wc.add(k).write(w) };
        k += 1;
    }
    c.taken += k;
    k as c_int
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, _: c_int) -> c_int {
    // SAFETY: `cq` is a live fake CQ.
    let mut s = unsafe { dev((*cq).context) }.lock();
    let c = s.cqs.get_mut(&(cq as usize)).expect("fake CQ");
    c.armed = true;
    c.armed_at = c.taken + c.wcs.len();
    0
}

// ---- a lean data path, for counting the safe layer's own instructions -------------------

/// Completions of the lean data path (one queue for the process: the instruction-count
/// harness is its only user, on one thread): a ring of `wr_id`s with the QP number. Relaxed
/// atomics compile to plain loads and stores; no TLS, no lock, so the provider's share of a
/// message stays small and does not move with inlining decisions elsewhere.
struct LeanRing {
    ids: [std::sync::atomic::AtomicU64; LEAN_DEPTH],
    qpn: std::sync::atomic::AtomicU32,
    head: std::sync::atomic::AtomicUsize,
    tail: std::sync::atomic::AtomicUsize,
}

const LEAN_DEPTH: usize = 1024;

static LEAN: LeanRing = LeanRing {
    ids: [const { std::sync::atomic::AtomicU64::new(0) }; LEAN_DEPTH],
    qpn: std::sync::atomic::AtomicU32::new(0),
    head: std::sync::atomic::AtomicUsize::new(0),
    tail: std::sync::atomic::AtomicUsize::new(0),
};

impl Fake {
    /// Swaps this context's `post_send`/`poll_cq` for a lean pair that takes no lock and
    /// logs nothing: every signalled send completes at once (success), in posting order.
    /// Used by the host instruction-count harness (`hotpath_counts`) so that the provider's
    /// share of a message is a few dozen instructions and the safe layer's work stands out;
    /// the rest of the fake (setup, teardown) is unchanged.
    pub(crate) fn lean_data_path(&self) {
        let ctx = self.ctx.inner.ctx;
        // SAFETY: the fake context is live (owned by `self.ctx`) and no post or poll runs
        // concurrently (the caller's thread owns every object of it at this point).
        unsafe {
            (*ctx).ops.post_send = Some(lean_post_send);
            (*ctx).ops.poll_cq = Some(lean_poll_cq);
        }
    }
}

unsafe extern "C" fn lean_post_send(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_send_wr,
    _bad: *mut *mut ibv_send_wr,
) -> c_int {
    use std::sync::atomic::Ordering::Relaxed;
    // SAFETY: `qp` is a live fake QP.
    LEAN.qpn.store(unsafe { (*qp).qp_num }, Relaxed);
    let mut t = LEAN.tail.load(Relaxed);
    while !wr.is_null() {
        // SAFETY: `wr` heads a valid chain (the caller's contract).
        let w = unsafe { &*wr };
        if w.send_flags & IBV_SEND_SIGNALED != 0 {
            LEAN.ids[t % LEAN_DEPTH].store(w.wr_id, Relaxed);
            t = t.wrapping_add(1);
        }
        wr = w.next;
    }
    LEAN.tail.store(t, Relaxed);
    0
}

unsafe extern "C" fn lean_poll_cq(_cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    use std::sync::atomic::Ordering::Relaxed;
    let (mut h, t) = (LEAN.head.load(Relaxed), LEAN.tail.load(Relaxed));
    let qp_num = LEAN.qpn.load(Relaxed);
    let mut k = 0;
    while k < n.max(0) as usize && h != t {
        let w = ibv_wc {
            wr_id: LEAN.ids[h % LEAN_DEPTH].load(Relaxed),
            opcode: IBV_WC_RDMA_WRITE,
            qp_num,
            ..ibv_wc::default()
        };
        // SAFETY: `wc` has room for `n` entries (the caller's contract).
        unsafe { wc.add(k).write(w) };
        h = h.wrapping_add(1);
        k += 1;
    }
    LEAN.head.store(h, Relaxed);
    k as c_int
}
