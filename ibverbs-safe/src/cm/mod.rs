//! The RDMA connection manager (rdma_cm): connect queue pairs the way RDMA deployments do,
//! by IP address and port, with address and route resolution (the right device, port, GID
//! and path, RoCE v2 included, without choosing a GID index), a connect / accept handshake
//! carrying private data, reject, and disconnect events.
//!
//! `librdmacm.so.1` is loaded at run time like libibverbs (versioned symbols); without it
//! every call returns [`Error::LibraryUnavailable`] naming the package to install.
//!
//! # Shape
//!
//! * Active side: [`CmId::new`] → [`CmId::resolve`] (address, then route; each step
//!   bounded by a timeout) → build a QP with [`CmId::queue_pair`] (on a context from
//!   [`CmId::open_context`]) → [`CmId::connect`] → a [`Connection`] and a connected
//!   [`QueuePair`].
//! * Passive side: [`Listener::bind`] → [`Listener::get_request`] → a [`ConnectRequest`]
//!   (the peer's private data; its own `open_context`/`queue_pair`) → [`ConnectRequest::accept`]
//!   or [`ConnectRequest::reject`] (dropping it rejects too).
//! * [`Connection::next_event`], [`Connection::check`], [`Connection::disconnect`].
//!
//! The queue pair is the crate's ordinary typestate [`QueuePair`] with the usual ownership
//! model (owned buffers, CQs chosen by the caller): this module creates no verbs objects of
//! its own. The QP is not attached to the rdma_cm id; it is moved to RTR/RTS here with the
//! attributes rdma_cm computes (`rdma_init_qp_attr`), which is the documented path for QPs
//! that `rdma_create_qp` did not create. Consequently the QP is not moved to the error state
//! by [`Connection::disconnect`]: drop it or call [`QueuePair::set_error`].
//!
//! Each id has an event channel of its own (an accepted id is migrated to a new one), so
//! waiting on one connection never consumes another's events. Every event is copied and
//! acknowledged at once; an event this module does not expect at that point, or cannot
//! interpret, is an error ([`CmError::UnexpectedEvent`], [`CmError::MalformedEvent`]).
//!
//! Private data: IB CM messages carry at most 56 bytes with a connect and 196 with an
//! accept (rdma_cm's TCP port space); the receiver may see it zero-padded to that size.
#![allow(unsafe_code)]

mod error;
mod loader;

pub use error::CmError;
pub use loader::cm_library_available;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::gid::Gid;
use crate::pd::ProtectionDomain;
use crate::port::Mtu;
use crate::qp::{Connected, Endpoint, PreparedQp, QpBuilder, QueuePair};
use crate::result::record_drop_failure;
use crate::sys::cm::*;
use crate::sys::ibv_qp_attr;
use crate::CompletionQueue;
use loader::CmLib;
use std::ffi::{c_int, c_void, CStr};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest private data of a connect request (IB CM REQ, less rdma_cm's header).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Largest private data of an accept (IB CM REP).
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Largest private data of a reject (IB CM REJ).
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;

const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;

/// An rdma_cm event channel (`struct rdma_event_channel`), owned by one id. Its file
/// descriptor may be registered with `poll`/`epoll` to wait for events of that id.
#[derive(Debug)]
pub struct EventChannel {
    inner: Arc<Channel>,
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd()
    }
}

struct Channel {
    lib: &'static CmLib,
    ch: *mut rdma_event_channel,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("fd", &self.fd()).finish()
    }
}

// SAFETY: an event channel is a file descriptor plus librdmacm bookkeeping that librdmacm
// protects itself; it may be used and destroyed from any thread.
unsafe impl Send for Channel {}
// SAFETY: as above; `&Channel` only reads the fd or calls thread-safe librdmacm functions.
unsafe impl Sync for Channel {}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: `ch` came from rdma_create_event_channel; every id on it holds an `Arc` of
        // this channel, so none is left.
        unsafe { (self.lib.destroy_event_channel)(self.ch) };
    }
}

/// An event copied out of librdmacm's `rdma_cm_event` (already acknowledged).
struct RawEvent {
    kind: u32,
    status: i32,
    /// The new id of a connect request (owned by whoever takes it).
    new_id: *mut rdma_cm_id,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl Channel {
    fn new(lib: &'static CmLib) -> Result<Arc<Channel>> {
        // SAFETY: no preconditions.
        let ch = unsafe { (lib.create_event_channel)() };
        if ch.is_null() {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENOENT | libc::ENODEV | libc::ENXIO) => CmError::NoCmDevice(e),
                _ => CmError::Verb {
                    verb: "rdma_create_event_channel",
                    source: e,
                },
            }
            .into());
        }
        let c = Arc::new(Channel { lib, ch });
        // Non-blocking: `rdma_get_cm_event` then never blocks after a spurious wake-up.
        let fd = c.fd();
        // SAFETY: `fd` is the channel's open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(CmError::verb("fcntl(O_NONBLOCK) on the event channel").into());
        }
        Ok(c)
    }

    fn fd(&self) -> c_int {
        // SAFETY: `ch` is live for as long as `self`.
        unsafe { (*self.ch).fd }
    }

    /// The next event, or `None` when none arrived within `timeout`.
    fn next(&self, timeout: Duration) -> Result<Option<RawEvent>> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
            // SAFETY: `ch` is live; `ev` is a valid out-pointer.
            let rc = unsafe { (self.lib.get_cm_event)(self.ch, &mut ev) };
            if rc == 0 && !ev.is_null() {
                return Ok(Some(self.take(ev)));
            }
            let e = io::Error::last_os_error();
            if rc == 0 || !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                return Err(CmError::Verb {
                    verb: "rdma_get_cm_event",
                    source: e,
                }
                .into());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return Err(CmError::verb("poll on the rdma_cm event channel").into());
            }
        }
    }

    /// Copies what we need out of `ev` and acknowledges it.
    fn take(&self, ev: *mut rdma_cm_event) -> RawEvent {
        // SAFETY: `ev` is a live event from rdma_get_cm_event, not yet acknowledged.
        let e = unsafe { &*ev };
        // SAFETY: every id of this crate is in the connected (TCP) port space, for which
        // librdmacm fills `param.conn`; its fields are integers and a pointer, valid for any
        // bit pattern, and the pointer is only followed below when non-null.
        let conn = unsafe { e.param.conn };
        let len = conn.private_data_len as usize;
        let private_data = if conn.private_data.is_null() || len == 0 {
            Vec::new()
        } else {
            // SAFETY: librdmacm points `private_data` at `private_data_len` bytes inside the
            // event, valid until the event is acknowledged (below).
            unsafe { std::slice::from_raw_parts(conn.private_data.cast::<u8>(), len) }.to_vec()
        };
        let raw = RawEvent {
            kind: e.event,
            status: e.status,
            new_id: if e.event == RDMA_CM_EVENT_CONNECT_REQUEST {
                e.id
            } else {
                std::ptr::null_mut()
            },
            private_data,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
        };
        // SAFETY: acknowledged exactly once; nothing borrowed from it outlives this call.
        let rc = unsafe { (self.lib.ack_cm_event)(ev) };
        if rc != 0 {
            record_drop_failure("rdma_ack_cm_event", rc);
        }
        raw
    }
}

/// The name of an `rdma_cm_event_type` value.
fn event_name(kind: u32) -> &'static str {
    const NAMES: [&str; 16] = [
        "ADDR_RESOLVED",
        "ADDR_ERROR",
        "ROUTE_RESOLVED",
        "ROUTE_ERROR",
        "CONNECT_REQUEST",
        "CONNECT_RESPONSE",
        "CONNECT_ERROR",
        "UNREACHABLE",
        "REJECTED",
        "ESTABLISHED",
        "DISCONNECTED",
        "DEVICE_REMOVAL",
        "MULTICAST_JOIN",
        "MULTICAST_ERROR",
        "ADDR_CHANGE",
        "TIMEWAIT_EXIT",
    ];
    NAMES.get(kind as usize).copied().unwrap_or("UNKNOWN")
}

/// An rdma_cm id with its own event channel; destroyed (`rdma_destroy_id`) on drop.
struct Id {
    lib: &'static CmLib,
    id: *mut rdma_cm_id,
    ch: Arc<Channel>,
}

// SAFETY: an rdma_cm id may be used from any thread (librdmacm locks internally); `Id` is
// only used through `&mut` or moved.
unsafe impl Send for Id {}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: `id` came from rdma_create_id (or a connect request we took ownership of)
        // and is destroyed exactly once; every event of it was acknowledged when received, so
        // this does not block on unacknowledged events.
        let rc = unsafe { (self.lib.destroy_id)(self.id) };
        if rc != 0 {
            record_drop_failure("rdma_destroy_id", rc);
        }
    }
}

impl Id {
    fn new() -> Result<Id> {
        let lib = loader::cm()?;
        let ch = Channel::new(lib)?;
        let mut id = std::ptr::null_mut();
        // SAFETY: `ch` is live; `id` is a valid out-pointer.
        let rc = unsafe { (lib.create_id)(ch.ch, &mut id, std::ptr::null_mut(), RDMA_PS_TCP) };
        if rc != 0 || id.is_null() {
            return Err(CmError::verb("rdma_create_id").into());
        }
        Ok(Id { lib, id, ch })
    }

    /// The next event of this id as a [`CmEvent`], `None` on timeout.
    fn next_event(&self, timeout: Duration) -> Result<Option<CmEvent>> {
        match self.ch.next(timeout)? {
            None => Ok(None),
            Some(raw) => CmEvent::from_raw(self.lib, &self.ch, raw).map(Some),
        }
    }

    fn device_name(&self) -> Result<String> {
        // SAFETY: `id` is live; `verbs` is set once the id is bound to a device.
        let verbs = unsafe { (*self.id).verbs };
        if verbs.is_null() {
            return Err(Error::InvalidArgument(
                "the rdma_cm id is not bound to a device yet (resolve or accept first)".into(),
            ));
        }
        let v = crate::loader::verbs()?;
        // SAFETY: `verbs` is the live ibv_context librdmacm opened for the id's device.
        let name = unsafe { (v.get_device_name)((*verbs).device) };
        if name.is_null() {
            return Err(CmError::verb("ibv_get_device_name").into());
        }
        // SAFETY: a NUL-terminated string owned by the device.
        Ok(unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned())
    }

    fn qp_attr(&self, state: u32, what: &'static str) -> Result<(ibv_qp_attr, c_int)> {
        let mut a = ibv_qp_attr {
            qp_state: state,
            ..Default::default()
        };
        let mut mask: c_int = 0;
        // SAFETY: `id` is live; `a` is a whole `ibv_qp_attr` (checked against verbs.h by the
        // layout test) and `mask` a valid out-int.
        let rc = unsafe { (self.lib.init_qp_attr)(self.id, &mut a, &mut mask) };
        if rc != 0 {
            return Err(CmError::verb(what).into());
        }
        Ok((a, mask))
    }

    fn port_num(&self) -> Result<u8> {
        Ok(self
            .qp_attr(QPS_INIT, "rdma_init_qp_attr(INIT)")?
            .0
            .port_num)
    }

    fn open_context(&self) -> Result<Context> {
        crate::open(Some(&self.device_name()?))
    }

    fn queue_pair<'a>(
        &self,
        pd: &'a ProtectionDomain,
        send_cq: &'a CompletionQueue,
        recv_cq: &'a CompletionQueue,
    ) -> Result<QpBuilder<'a>> {
        let port = self.port_num()?;
        Ok(pd.queue_pair(send_cq, recv_cq).port(port))
    }

    fn check_qp<T: Connected>(&self, qp: &PreparedQp<T>) -> Result<()> {
        let (qp_port, qp_dev) = qp.port_and_device();
        let cm_dev = self.device_name()?;
        let cm_port = self.port_num()?;
        if qp_dev != cm_dev || qp_port != cm_port {
            return Err(CmError::WrongDevice {
                qp_device: qp_dev.to_owned(),
                qp_port,
                cm_device: cm_dev,
                cm_port,
            }
            .into());
        }
        Ok(())
    }

    /// Moves `qp` to RTR and RTS with rdma_cm's attributes.
    fn ready_qp<T: Connected>(
        &self,
        qp: PreparedQp<T>,
        responder_resources: Option<u8>,
        initiator_depth: Option<u8>,
    ) -> Result<QueuePair<T>> {
        let (mut rtr, rtr_mask) = self.qp_attr(QPS_RTR, "rdma_init_qp_attr(RTR)")?;
        let (mut rts, rts_mask) = self.qp_attr(QPS_RTS, "rdma_init_qp_attr(RTS)")?;
        if let Some(r) = responder_resources {
            rtr.max_dest_rd_atomic = r;
        }
        if let Some(i) = initiator_depth {
            rts.max_rd_atomic = i;
        }
        let remote = Endpoint {
            lid: rtr.ah_attr.dlid,
            qpn: rtr.dest_qp_num,
            psn: rtr.rq_psn,
            gid: Gid(rtr.ah_attr.grh.dgid.raw),
            mtu: Mtu::from_raw(rtr.path_mtu).unwrap_or(Mtu::Mtu1024),
            qkey: 0,
        };
        qp.connect_with_attrs(&mut rtr, rtr_mask, &mut rts, rts_mask, remote)
    }
}

fn sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// The status of an rdma_cm error event (a negative errno) as an `io::Error`.
fn status_error(status: i32) -> io::Error {
    io::Error::from_raw_os_error(status.unsigned_abs() as i32)
}

fn resolve_error(step: &'static str, addr: SocketAddr, source: io::Error) -> Error {
    if error::is_no_device(&source) {
        CmError::NoDeviceForAddress { step, addr, source }.into()
    } else {
        CmError::Resolve { step, addr, source }.into()
    }
}

/// Connection parameters for [`CmId::connect`] and [`ConnectRequest::accept`]
/// (`struct rdma_conn_param`). The defaults (one outstanding READ each way, 7 retries,
/// infinite RNR retries, no private data) are what rdma-core's `rping` uses.
#[derive(Clone, Debug)]
pub struct ConnParam {
    /// Private data carried by the connect / accept message.
    pub private_data: Vec<u8>,
    /// RDMA READ / atomic requests the peer may have outstanding towards us.
    pub responder_resources: u8,
    /// RDMA READ / atomic requests we may have outstanding towards the peer.
    pub initiator_depth: u8,
    /// Transport retries (active side).
    pub retry_count: u8,
    /// Receiver-not-ready retries (7 = infinite).
    pub rnr_retry_count: u8,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }
}

impl ConnParam {
    fn raw(&self, qp_num: u32, what: &'static str, max: usize) -> Result<rdma_conn_param> {
        if self.private_data.len() > max {
            return Err(CmError::PrivateDataTooLong {
                what,
                len: self.private_data.len(),
                max,
            }
            .into());
        }
        Ok(rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast::<c_void>()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 0,
            retry_count: self.retry_count.min(7),
            rnr_retry_count: self.rnr_retry_count.min(7),
            srq: 0,
            qp_num,
        })
    }
}

/// An rdma_cm event (`enum rdma_cm_event_type`), copied out and acknowledged.
#[derive(Debug)]
#[non_exhaustive]
pub enum CmEvent {
    /// Address resolution finished.
    AddrResolved,
    /// Address resolution failed (negative errno).
    AddrError(i32),
    /// Route resolution finished.
    RouteResolved,
    /// Route resolution failed (negative errno).
    RouteError(i32),
    /// A peer asks to connect (on a [`Listener`]).
    ConnectRequest(ConnectRequest),
    /// The peer accepted (handled inside [`CmId::connect`]).
    ConnectResponse(Vec<u8>),
    /// Establishing the connection failed.
    ConnectError(i32),
    /// The peer could not be reached.
    Unreachable(i32),
    /// The peer rejected the connection: reason and private data.
    Rejected(i32, Vec<u8>),
    /// The connection is established (with the peer's private data).
    Established(Vec<u8>),
    /// The peer disconnected (or the connection broke).
    Disconnected,
    /// The device was removed.
    DeviceRemoval,
    /// A multicast join finished.
    MulticastJoin,
    /// A multicast join failed.
    MulticastError(i32),
    /// The local address changed.
    AddrChange,
    /// The id left the time-wait state.
    TimewaitExit,
}

impl CmEvent {
    /// Refuses an event that cannot be interpreted, before anything is done with it.
    fn check_raw(raw: &RawEvent) -> Result<()> {
        if raw.kind > RDMA_CM_EVENT_TIMEWAIT_EXIT {
            return Err(CmError::MalformedEvent(format!(
                "unknown event type {} (status {})",
                raw.kind, raw.status
            ))
            .into());
        }
        if raw.kind == RDMA_CM_EVENT_CONNECT_REQUEST && raw.new_id.is_null() {
            return Err(CmError::MalformedEvent("connect request without a new id".into()).into());
        }
        Ok(())
    }

    fn from_raw(lib: &'static CmLib, ch: &Arc<Channel>, raw: RawEvent) -> Result<CmEvent> {
        Self::check_raw(&raw)?;
        let s = raw.status;
        Ok(match raw.kind {
            RDMA_CM_EVENT_ADDR_RESOLVED => CmEvent::AddrResolved,
            RDMA_CM_EVENT_ADDR_ERROR => CmEvent::AddrError(s),
            RDMA_CM_EVENT_ROUTE_RESOLVED => CmEvent::RouteResolved,
            RDMA_CM_EVENT_ROUTE_ERROR => CmEvent::RouteError(s),
            RDMA_CM_EVENT_CONNECT_REQUEST => {
                CmEvent::ConnectRequest(ConnectRequest::adopt(lib, ch, raw)?)
            }
            RDMA_CM_EVENT_CONNECT_RESPONSE => CmEvent::ConnectResponse(raw.private_data),
            RDMA_CM_EVENT_CONNECT_ERROR => CmEvent::ConnectError(s),
            RDMA_CM_EVENT_UNREACHABLE => CmEvent::Unreachable(s),
            RDMA_CM_EVENT_REJECTED => CmEvent::Rejected(s, raw.private_data),
            RDMA_CM_EVENT_ESTABLISHED => CmEvent::Established(raw.private_data),
            RDMA_CM_EVENT_DISCONNECTED => CmEvent::Disconnected,
            RDMA_CM_EVENT_DEVICE_REMOVAL => CmEvent::DeviceRemoval,
            RDMA_CM_EVENT_MULTICAST_JOIN => CmEvent::MulticastJoin,
            RDMA_CM_EVENT_MULTICAST_ERROR => CmEvent::MulticastError(s),
            RDMA_CM_EVENT_ADDR_CHANGE => CmEvent::AddrChange,
            RDMA_CM_EVENT_TIMEWAIT_EXIT => CmEvent::TimewaitExit,
            k => {
                return Err(
                    CmError::MalformedEvent(format!("unknown event type {k} (status {s})")).into(),
                )
            }
        })
    }

    /// The C name of the event (`RDMA_CM_EVENT_...` without the prefix).
    pub fn name(&self) -> &'static str {
        event_name(match self {
            CmEvent::AddrResolved => RDMA_CM_EVENT_ADDR_RESOLVED,
            CmEvent::AddrError(_) => RDMA_CM_EVENT_ADDR_ERROR,
            CmEvent::RouteResolved => RDMA_CM_EVENT_ROUTE_RESOLVED,
            CmEvent::RouteError(_) => RDMA_CM_EVENT_ROUTE_ERROR,
            CmEvent::ConnectRequest(_) => RDMA_CM_EVENT_CONNECT_REQUEST,
            CmEvent::ConnectResponse(_) => RDMA_CM_EVENT_CONNECT_RESPONSE,
            CmEvent::ConnectError(_) => RDMA_CM_EVENT_CONNECT_ERROR,
            CmEvent::Unreachable(_) => RDMA_CM_EVENT_UNREACHABLE,
            CmEvent::Rejected(..) => RDMA_CM_EVENT_REJECTED,
            CmEvent::Established(_) => RDMA_CM_EVENT_ESTABLISHED,
            CmEvent::Disconnected => RDMA_CM_EVENT_DISCONNECTED,
            CmEvent::DeviceRemoval => RDMA_CM_EVENT_DEVICE_REMOVAL,
            CmEvent::MulticastJoin => RDMA_CM_EVENT_MULTICAST_JOIN,
            CmEvent::MulticastError(_) => RDMA_CM_EVENT_MULTICAST_ERROR,
            CmEvent::AddrChange => RDMA_CM_EVENT_ADDR_CHANGE,
            CmEvent::TimewaitExit => RDMA_CM_EVENT_TIMEWAIT_EXIT,
        })
    }

    fn status(&self) -> i32 {
        match self {
            CmEvent::AddrError(s)
            | CmEvent::RouteError(s)
            | CmEvent::ConnectError(s)
            | CmEvent::Unreachable(s)
            | CmEvent::Rejected(s, _)
            | CmEvent::MulticastError(s) => *s,
            _ => 0,
        }
    }

    /// The error an event that ends a connection attempt (or a connection) stands for, or
    /// [`CmError::UnexpectedEvent`].
    fn into_error(self, expected: &'static str) -> Error {
        match self {
            CmEvent::Rejected(reason, private_data) => CmError::Rejected {
                reason,
                private_data,
            },
            CmEvent::Unreachable(s) => CmError::Unreachable(s),
            CmEvent::ConnectError(s) => CmError::ConnectError(s),
            CmEvent::Disconnected => CmError::Disconnected,
            CmEvent::DeviceRemoval => CmError::DeviceRemoved,
            other => CmError::UnexpectedEvent {
                expected,
                got: other.name(),
                status: other.status(),
            },
        }
        .into()
    }
}

/// Waits for one event; `None` (timeout) becomes [`CmError::Timeout`].
fn wait(id: &Id, step: &'static str, timeout: Duration) -> Result<CmEvent> {
    id.next_event(timeout)?.ok_or_else(|| {
        CmError::Timeout {
            step,
            after: timeout,
        }
        .into()
    })
}

/// The active side of a connection: resolve, then [`connect`](CmId::connect).
#[derive(Debug)]
pub struct CmId {
    id: Id,
    dst: Option<SocketAddr>,
    channel: EventChannel,
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Id").field("channel", &self.ch).finish()
    }
}

impl CmId {
    /// Creates an id (reliable-connected port space) with its own event channel.
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`] without librdmacm; [`CmError::Verb`].
    pub fn new() -> Result<CmId> {
        let id = Id::new()?;
        let channel = EventChannel {
            inner: id.ch.clone(),
        };
        Ok(CmId {
            id,
            dst: None,
            channel,
        })
    }

    /// The id's event channel (for `poll`/`epoll`).
    pub fn event_channel(&self) -> &EventChannel {
        &self.channel
    }

    /// Resolves `dst` to a local RDMA device and port (optionally from `src`), waiting at
    /// most `timeout` (also the kernel's own resolution timeout).
    ///
    /// # Errors
    /// [`CmError::NoDeviceForAddress`] when no RDMA device has (or routes to) the address,
    /// [`CmError::Resolve`], [`CmError::Timeout`], [`CmError::UnexpectedEvent`].
    pub fn resolve_addr(
        &mut self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        const STEP: &str = "address resolution";
        let (mut d, _) = sockaddr(&dst);
        let mut s = src.map(|a| sockaddr(&a).0);
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as c_int;
        // SAFETY: the id is live; both addresses are valid sockaddrs for the call.
        let rc = unsafe {
            (self.id.lib.resolve_addr)(
                self.id.id,
                s.as_mut().map_or(std::ptr::null_mut(), |s| {
                    (s as *mut libc::sockaddr_storage).cast()
                }),
                (&mut d as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        };
        if rc != 0 {
            return Err(resolve_error(STEP, dst, io::Error::last_os_error()));
        }
        // the kernel times out by itself after `timeout`; allow for its event to arrive
        match wait(&self.id, STEP, timeout + Duration::from_secs(1))? {
            CmEvent::AddrResolved => {}
            CmEvent::AddrError(s) => return Err(resolve_error(STEP, dst, status_error(s))),
            other => return Err(other.into_error(STEP)),
        }
        self.dst = Some(dst);
        Ok(())
    }

    /// Resolves the route to the address resolved before, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`resolve_addr`](Self::resolve_addr).
    pub fn resolve_route(&mut self, timeout: Duration) -> Result<()> {
        const STEP: &str = "route resolution";
        let Some(dst) = self.dst else {
            return Err(Error::InvalidArgument(
                "resolve_route needs a resolved address (call resolve_addr first)".into(),
            ));
        };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as c_int;
        // SAFETY: the id is live.
        let rc = unsafe { (self.id.lib.resolve_route)(self.id.id, ms) };
        if rc != 0 {
            return Err(resolve_error(STEP, dst, io::Error::last_os_error()));
        }
        match wait(&self.id, STEP, timeout + Duration::from_secs(1))? {
            CmEvent::RouteResolved => Ok(()),
            CmEvent::RouteError(s) => Err(resolve_error(STEP, dst, status_error(s))),
            other => Err(other.into_error(STEP)),
        }
    }

    /// [`resolve_addr`](Self::resolve_addr) then [`resolve_route`](Self::resolve_route),
    /// each bounded by `timeout`.
    ///
    /// # Errors
    /// As those.
    pub fn resolve(&mut self, dst: SocketAddr, timeout: Duration) -> Result<()> {
        self.resolve_addr(None, dst, timeout)?;
        self.resolve_route(timeout)
    }

    /// The name of the RDMA device the id resolved to.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] before resolution.
    pub fn device_name(&self) -> Result<String> {
        self.id.device_name()
    }

    /// The device port the id resolved to.
    ///
    /// # Errors
    /// [`CmError::Verb`] before resolution.
    pub fn port_num(&self) -> Result<u8> {
        self.id.port_num()
    }

    /// Opens (a new context on) the device the id resolved to.
    ///
    /// # Errors
    /// As [`crate::open`].
    pub fn open_context(&self) -> Result<Context> {
        self.id.open_context()
    }

    /// A QP builder on `pd` for the id's port (`pd` must be on the id's device).
    ///
    /// # Errors
    /// [`CmError::Verb`] before resolution.
    pub fn queue_pair<'a>(
        &self,
        pd: &'a ProtectionDomain,
        send_cq: &'a CompletionQueue,
        recv_cq: &'a CompletionQueue,
    ) -> Result<QpBuilder<'a>> {
        self.id.queue_pair(pd, send_cq, recv_cq)
    }

    /// Connects `qp` (built with [`queue_pair`](Self::queue_pair); it may already hold
    /// receives) to the listener at the resolved address, carrying `param`'s private data,
    /// and waits at most `timeout` for the answer. On success the QP is in RTS and the
    /// [`Connection`] holds the peer's private data.
    ///
    /// # Errors
    /// [`CmError::Rejected`] (also: nobody listens on that port), [`CmError::Unreachable`],
    /// [`CmError::ConnectError`], [`CmError::Timeout`], [`CmError::WrongDevice`],
    /// [`CmError::PrivateDataTooLong`], [`Error::ModifyQp`]. The QP is dropped on failure
    /// (its posted receives' buffers are released).
    pub fn connect<T: Connected>(
        self,
        qp: PreparedQp<T>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(Connection, QueuePair<T>)> {
        const STEP: &str = "connection (CONNECT_RESPONSE)";
        self.id.check_qp(&qp)?;
        let mut p = param.raw(qp.qp_num(), "a connect request", MAX_CONNECT_PRIVATE_DATA)?;
        // SAFETY: the id is live; `p` and the private data it points to outlive the call.
        if unsafe { (self.id.lib.connect)(self.id.id, &mut p) } != 0 {
            return Err(CmError::verb("rdma_connect").into());
        }
        let private_data = match wait(&self.id, STEP, timeout)? {
            CmEvent::ConnectResponse(d) => d,
            other => return Err(other.into_error(STEP)),
        };
        let qp = self.id.ready_qp(qp, None, None)?;
        // SAFETY: the id is live and its QP (ours) is in RTS.
        if unsafe { (self.id.lib.establish)(self.id.id) } != 0 {
            return Err(CmError::verb("rdma_establish").into());
        }
        Ok((
            Connection {
                id: self.id,
                private_data,
                disconnected: false,
            },
            qp,
        ))
    }
}

/// A passive id listening for connect requests.
#[derive(Debug)]
pub struct Listener {
    id: Id,
    addr: SocketAddr,
}

impl Listener {
    /// Binds to `addr` (an address of an RDMA device's netdev, or the wildcard) and
    /// listens with a backlog of `backlog`.
    ///
    /// # Errors
    /// [`CmError::NoDeviceForAddress`] when no RDMA device has the address,
    /// [`Error::LibraryUnavailable`], [`CmError::Verb`] (e.g. `EADDRINUSE`).
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<Listener> {
        let id = Id::new()?;
        let (mut a, _) = sockaddr(&addr);
        // SAFETY: the id is live; `a` is a valid sockaddr.
        if unsafe { (id.lib.bind_addr)(id.id, (&mut a as *mut libc::sockaddr_storage).cast()) } != 0
        {
            let e = io::Error::last_os_error();
            return Err(if error::is_no_device(&e) {
                CmError::NoDeviceForAddress {
                    step: "bind",
                    addr,
                    source: e,
                }
                .into()
            } else {
                CmError::Verb {
                    verb: "rdma_bind_addr",
                    source: e,
                }
                .into()
            });
        }
        // SAFETY: the id is live and bound.
        if unsafe { (id.lib.listen)(id.id, backlog) } != 0 {
            return Err(CmError::verb("rdma_listen").into());
        }
        Ok(Listener { id, addr })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits at most `timeout` for the next connect request.
    ///
    /// # Errors
    /// [`CmError::Timeout`]; [`CmError::UnexpectedEvent`] for any other event.
    pub fn get_request(&mut self, timeout: Duration) -> Result<ConnectRequest> {
        const STEP: &str = "a connect request";
        match wait(&self.id, STEP, timeout)? {
            CmEvent::ConnectRequest(r) => Ok(r),
            other => Err(other.into_error(STEP)),
        }
    }

    /// The next event of the listening id, `None` after `timeout`.
    ///
    /// # Errors
    /// [`CmError::MalformedEvent`], [`CmError::Verb`].
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<CmEvent>> {
        self.id.next_event(timeout)
    }
}

/// A peer's connect request: accept it with a QP, or reject it (dropping it rejects).
#[derive(Debug)]
pub struct ConnectRequest {
    id: Option<Id>,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl ConnectRequest {
    /// Takes ownership of a connect request's new id and moves it to a channel of its own.
    fn adopt(lib: &'static CmLib, listen_ch: &Arc<Channel>, raw: RawEvent) -> Result<Self> {
        if raw.new_id.is_null() {
            return Err(CmError::MalformedEvent("connect request without a new id".into()).into());
        }
        // Owned from here: destroyed (on the listener's channel) if migration fails.
        let mut id = Id {
            lib,
            id: raw.new_id,
            ch: listen_ch.clone(),
        };
        let ch = Channel::new(lib)?;
        // SAFETY: both are live; the request event was acknowledged, so the migration does
        // not wait for it.
        if unsafe { (lib.migrate_id)(id.id, ch.ch) } != 0 {
            let e = CmError::verb("rdma_migrate_id");
            // SAFETY: the id is live; reject before it is destroyed.
            unsafe { (lib.reject)(id.id, std::ptr::null(), 0) };
            return Err(e.into());
        }
        id.ch = ch;
        Ok(ConnectRequest {
            id: Some(id),
            private_data: raw.private_data,
            responder_resources: raw.responder_resources,
            initiator_depth: raw.initiator_depth,
        })
    }

    fn id(&self) -> &Id {
        self.id
            .as_ref()
            .expect("a ConnectRequest holds its id until consumed")
    }

    /// The private data the peer sent with its request (possibly zero-padded).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The READ/atomic depth the peer asked for as initiator.
    pub fn peer_initiator_depth(&self) -> u8 {
        self.initiator_depth
    }

    /// The READ/atomic depth the peer offers as responder.
    pub fn peer_responder_resources(&self) -> u8 {
        self.responder_resources
    }

    /// The device the request arrived on.
    ///
    /// # Errors
    /// [`CmError::Verb`].
    pub fn device_name(&self) -> Result<String> {
        self.id().device_name()
    }

    /// The port the request arrived on.
    ///
    /// # Errors
    /// [`CmError::Verb`].
    pub fn port_num(&self) -> Result<u8> {
        self.id().port_num()
    }

    /// Opens (a new context on) the device the request arrived on.
    ///
    /// # Errors
    /// As [`crate::open`].
    pub fn open_context(&self) -> Result<Context> {
        self.id().open_context()
    }

    /// A QP builder on `pd` for the request's port.
    ///
    /// # Errors
    /// [`CmError::Verb`].
    pub fn queue_pair<'a>(
        &self,
        pd: &'a ProtectionDomain,
        send_cq: &'a CompletionQueue,
        recv_cq: &'a CompletionQueue,
    ) -> Result<QpBuilder<'a>> {
        self.id().queue_pair(pd, send_cq, recv_cq)
    }

    /// Accepts with `qp` (post its first receives before, so the peer never finds the
    /// queue empty) and waits at most `timeout` for the connection to be established.
    ///
    /// # Errors
    /// [`CmError::WrongDevice`], [`CmError::PrivateDataTooLong`], [`Error::ModifyQp`],
    /// [`CmError::Verb`], [`CmError::Timeout`], [`CmError::ConnectError`],
    /// [`CmError::UnexpectedEvent`]. The QP is dropped on failure (its posted receives'
    /// buffers are released); the request is rejected.
    pub fn accept<T: Connected>(
        mut self,
        qp: PreparedQp<T>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(Connection, QueuePair<T>)> {
        const STEP: &str = "connection (ESTABLISHED)";
        self.id().check_qp(&qp)?;
        let mut p = param.raw(qp.qp_num(), "an accept", MAX_ACCEPT_PRIVATE_DATA)?;
        let qp = self.id().ready_qp(
            qp,
            Some(param.responder_resources),
            Some(param.initiator_depth),
        )?;
        let id = self
            .id
            .take()
            .expect("a ConnectRequest holds its id until consumed");
        // SAFETY: the id is live; `p` and its private data outlive the call.
        if unsafe { (id.lib.accept)(id.id, &mut p) } != 0 {
            let e = CmError::verb("rdma_accept");
            // SAFETY: as above.
            unsafe { (id.lib.reject)(id.id, std::ptr::null(), 0) };
            return Err(e.into());
        }
        let private_data = match wait(&id, STEP, timeout)? {
            CmEvent::Established(d) => d,
            other => return Err(other.into_error(STEP)),
        };
        Ok((
            Connection {
                id,
                private_data,
                disconnected: false,
            },
            qp,
        ))
    }

    /// Rejects the request, sending `private_data` (at most
    /// [`MAX_REJECT_PRIVATE_DATA`] bytes) to the peer.
    ///
    /// # Errors
    /// [`CmError::PrivateDataTooLong`], [`CmError::Verb`].
    pub fn reject(mut self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(CmError::PrivateDataTooLong {
                what: "a reject",
                len: private_data.len(),
                max: MAX_REJECT_PRIVATE_DATA,
            }
            .into());
        }
        let id = self
            .id
            .take()
            .expect("a ConnectRequest holds its id until consumed");
        // SAFETY: the id is live; the data outlives the call.
        let rc = unsafe {
            (id.lib.reject)(
                id.id,
                private_data.as_ptr().cast::<c_void>(),
                private_data.len() as u8,
            )
        };
        if rc != 0 {
            return Err(CmError::verb("rdma_reject").into());
        }
        Ok(())
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            // SAFETY: the id is live (destroyed right after, by `Id`'s drop).
            let rc = unsafe { (id.lib.reject)(id.id, std::ptr::null(), 0) };
            if rc != 0 {
                record_drop_failure("rdma_reject", rc);
            }
        }
    }
}

/// An established connection. Dropping it disconnects (if not done yet) and destroys the
/// id; the QP is separate and stays with its owner.
#[derive(Debug)]
pub struct Connection {
    id: Id,
    private_data: Vec<u8>,
    disconnected: bool,
}

impl Connection {
    /// The private data the peer sent with its accept (active side) or with the
    /// establishment (passive side; usually empty).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The device the connection runs on.
    ///
    /// # Errors
    /// [`CmError::Verb`].
    pub fn device_name(&self) -> Result<String> {
        self.id.device_name()
    }

    /// The next event of the connection, `None` after `timeout`.
    ///
    /// # Errors
    /// [`CmError::MalformedEvent`], [`CmError::Verb`].
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<CmEvent>> {
        let e = self.id.next_event(timeout)?;
        if matches!(e, Some(CmEvent::Disconnected)) {
            self.disconnected = true;
        }
        Ok(e)
    }

    /// Checks, without waiting, that the connection is still up.
    ///
    /// # Errors
    /// [`CmError::Disconnected`] once the peer disconnected; [`CmError::DeviceRemoved`];
    /// [`CmError::UnexpectedEvent`] for any other event.
    pub fn check(&mut self) -> Result<()> {
        if self.disconnected {
            return Err(CmError::Disconnected.into());
        }
        match self.next_event(Duration::ZERO)? {
            None | Some(CmEvent::TimewaitExit | CmEvent::Established(_)) => Ok(()),
            Some(e) => Err(e.into_error("nothing (connection up)")),
        }
    }

    /// Whether a disconnect was seen or made.
    pub fn is_disconnected(&self) -> bool {
        self.disconnected
    }

    /// Disconnects (`rdma_disconnect`); the peer gets a disconnect event. Idempotent.
    ///
    /// # Errors
    /// [`CmError::Verb`].
    pub fn disconnect(&mut self) -> Result<()> {
        if self.disconnected {
            return Ok(());
        }
        self.disconnected = true;
        // SAFETY: the id is live.
        if unsafe { (self.id.lib.disconnect)(self.id.id) } != 0 {
            let e = io::Error::last_os_error();
            // EINVAL: the connection is already gone (the peer disconnected first).
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(CmError::Verb {
                    verb: "rdma_disconnect",
                    source: e,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Waits at most `timeout` for the peer's disconnect (after our own
    /// [`disconnect`](Self::disconnect), librdmacm reports one too).
    ///
    /// # Errors
    /// [`CmError::Timeout`], [`CmError::UnexpectedEvent`].
    pub fn wait_disconnected(&mut self, timeout: Duration) -> Result<()> {
        const STEP: &str = "DISCONNECTED";
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_event(left)? {
                Some(CmEvent::Disconnected) => return Ok(()),
                Some(CmEvent::TimewaitExit | CmEvent::Established(_)) => {}
                Some(e) => return Err(e.into_error(STEP)),
                None => {
                    return Err(CmError::Timeout {
                        step: STEP,
                        after: timeout,
                    }
                    .into())
                }
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.disconnected {
            // SAFETY: the id is live (destroyed right after, by `Id`'s drop).
            let _ = unsafe { (self.id.lib.disconnect)(self.id.id) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: u32) -> RawEvent {
        RawEvent {
            kind,
            status: -110,
            new_id: std::ptr::null_mut(),
            private_data: vec![],
            responder_resources: 0,
            initiator_depth: 0,
        }
    }

    #[test]
    fn malformed_and_unexpected_events_are_errors() {
        let e = CmEvent::check_raw(&raw(16)).unwrap_err();
        assert!(matches!(e, Error::Cm(CmError::MalformedEvent(_))), "{e}");
        let e = CmEvent::check_raw(&raw(RDMA_CM_EVENT_CONNECT_REQUEST)).unwrap_err();
        assert!(e.to_string().contains("without a new id"), "{e}");
        assert!(CmEvent::check_raw(&raw(RDMA_CM_EVENT_DISCONNECTED)).is_ok());
        // what ends a connection maps to its own error; anything else is "unexpected"
        let e = CmEvent::Disconnected.into_error("x");
        assert!(matches!(e, Error::Cm(CmError::Disconnected)), "{e}");
        let e = CmEvent::Rejected(8, b"no".to_vec()).into_error("x");
        assert!(
            matches!(e, Error::Cm(CmError::Rejected { reason: 8, .. })),
            "{e}"
        );
        let e = CmEvent::AddrResolved.into_error("a connect request");
        assert!(
            matches!(
                e,
                Error::Cm(CmError::UnexpectedEvent {
                    got: "ADDR_RESOLVED",
                    ..
                })
            ),
            "{e}"
        );
        assert!(e.to_string().contains("a connect request"), "{e}");
    }

    #[test]
    fn event_names_follow_the_enum() {
        assert_eq!(event_name(RDMA_CM_EVENT_ESTABLISHED), "ESTABLISHED");
        assert_eq!(event_name(RDMA_CM_EVENT_TIMEWAIT_EXIT), "TIMEWAIT_EXIT");
        assert_eq!(event_name(99), "UNKNOWN");
    }

    #[test]
    fn private_data_over_the_cm_limit_is_refused() {
        let p = ConnParam {
            private_data: vec![0; MAX_CONNECT_PRIVATE_DATA + 1],
            ..Default::default()
        };
        let e = p
            .raw(1, "a connect request", MAX_CONNECT_PRIVATE_DATA)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Cm(CmError::PrivateDataTooLong {
                    len: 57,
                    max: 56,
                    ..
                })
            ),
            "{e}"
        );
        let p = ConnParam {
            private_data: b"hi".to_vec(),
            ..Default::default()
        };
        let r = p
            .raw(7, "a connect request", MAX_CONNECT_PRIVATE_DATA)
            .unwrap();
        assert_eq!(
            (r.private_data_len, r.qp_num, r.responder_resources),
            (2, 7, 1)
        );
    }

    #[test]
    fn sockaddrs_are_network_order() {
        let (ss, len) = sockaddr(&"10.77.0.1:7174".parse().unwrap());
        assert_eq!(len as usize, std::mem::size_of::<libc::sockaddr_in>());
        // SAFETY: `ss` holds a sockaddr_in (written above).
        let sin: libc::sockaddr_in =
            unsafe { std::ptr::read(&ss as *const _ as *const libc::sockaddr_in) };
        assert_eq!(sin.sin_family as i32, libc::AF_INET);
        assert_eq!(u16::from_be(sin.sin_port), 7174);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [10, 77, 0, 1]);
    }

    #[test]
    fn without_a_device_resolution_is_a_typed_error() {
        // On the host (no RDMA device) rdma_cm finds no device for any address; where a
        // device exists, 127.0.0.1 has none behind it unless rxe runs on lo.
        let mut id = match CmId::new() {
            Ok(id) => id,
            Err(e) => {
                skip!("rdma", "rdma_cm unavailable here ({e})");
                return;
            }
        };
        match id.resolve("127.0.0.1:7174".parse().unwrap(), Duration::from_secs(2)) {
            Err(Error::Cm(CmError::NoDeviceForAddress { .. } | CmError::Resolve { .. })) => {}
            Ok(()) => skip!(
                "loopback-without-rdma",
                "127.0.0.1 resolved to an RDMA device (rxe on lo)"
            ),
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}
