//! The crate's error type and the named work-completion statuses.

use std::io;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in this crate.
///
/// Verb failures carry the failing verb's context and the OS error (`errno`) as their
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libibverbs.so.1` (or one of its entry points) could not be loaded.
    #[error("{library} could not be loaded ({reason}); {hint}")]
    LibraryUnavailable {
        /// The library we tried to open.
        library: &'static str,
        /// What `dlopen`/`dlvsym` said.
        reason: String,
        /// What to install.
        hint: &'static str,
    },
    /// No RDMA device (or none with the requested name) is present.
    #[error("no RDMA device{}{}: load a driver (e.g. `rdma link add rxe0 type rxe netdev <if>` for Soft-RoCE) and check `ibv_devices`", .name.as_ref().map(|n| format!(" named {n:?}")).unwrap_or_default(), if .available.is_empty() { String::new() } else { format!(" (present: {})", .available.join(", ")) })]
    NoDevice {
        /// The requested name, if any.
        name: Option<String>,
        /// Names of the devices that are present.
        available: Vec<String>,
    },
    /// `ibv_get_device_list` failed.
    #[error("ibv_get_device_list failed")]
    GetDeviceList(#[source] io::Error),
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}) failed")]
    OpenDevice {
        /// Device name.
        device: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device failed")]
    QueryDevice(#[source] io::Error),
    /// `ibv_query_port` failed.
    #[error("ibv_query_port(port {port}) failed")]
    QueryPort {
        /// Port number.
        port: u8,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid` failed.
    #[error("ibv_query_gid(port {port}, index {index}) failed")]
    QueryGid {
        /// Port number.
        port: u8,
        /// GID index.
        index: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd failed")]
    AllocPd(#[source] io::Error),
    /// `ibv_reg_mr` failed. On `ENOMEM` the message explains the locked-memory limit.
    #[error("ibv_reg_mr({len} bytes, access {access:#x}) failed{}", memlock_hint(.source))]
    RegMr {
        /// Length of the region.
        len: usize,
        /// Access flags.
        access: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_reg_dmabuf_mr` failed. `EOPNOTSUPP`/`EPROTONOSUPPORT` mean the device, its
    /// provider or the kernel cannot register DMA-BUF memory (see the message).
    #[error("ibv_reg_dmabuf_mr(fd {fd}, offset {offset}, {len} bytes, iova {iova:#x}, access {access:#x}) failed{}", dmabuf_hint(.source))]
    RegDmabufMr {
        /// The DMA-BUF fd.
        fd: i32,
        /// Offset of the range in the DMA-BUF.
        offset: u64,
        /// Length of the range.
        len: usize,
        /// The I/O virtual address requested for its first byte.
        iova: u64,
        /// Access flags.
        access: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// This libibverbs lacks an optional entry point (older rdma-core).
    #[error("{what} is not available in this libibverbs: {needs}")]
    Unsupported {
        /// The missing feature / verb.
        what: &'static str,
        /// What provides it.
        needs: &'static str,
    },
    /// Allocating or mapping a buffer failed.
    #[error("allocating a {len}-byte buffer failed")]
    Alloc {
        /// Requested size.
        len: usize,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed")]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq({cqe} entries) failed")]
    CreateCq {
        /// Requested entries.
        cqe: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_qp` failed.
    #[error("ibv_create_qp({qp_type}) failed")]
    CreateQp {
        /// "RC", "UC" or "UD".
        qp_type: &'static str,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_modify_qp` failed.
    #[error("ibv_modify_qp(qpn {qpn:#x} -> {to}) failed")]
    ModifyQp {
        /// Local QP number.
        qpn: u32,
        /// Target state.
        to: &'static str,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_srq` failed.
    #[error("ibv_create_srq({max_wr} WRs) failed")]
    CreateSrq {
        /// Requested depth.
        max_wr: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_ah` failed.
    #[error("ibv_create_ah failed")]
    CreateAh(#[source] io::Error),
    /// `ibv_post_send` failed (the provider rejected the work request).
    #[error("ibv_post_send(qpn {qpn:#x}) failed")]
    PostSend {
        /// Local QP number.
        qpn: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` / `ibv_post_srq_recv` failed.
    #[error("ibv_post_recv failed")]
    PostRecv(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed")]
    PollCq(#[source] io::Error),
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq failed")]
    ReqNotifyCq(#[source] io::Error),
    /// `ibv_get_cq_event` or waiting on the channel's fd failed.
    #[error("waiting for a completion event failed")]
    CqEvent(#[source] io::Error),
    /// A range does not lie inside its memory region.
    #[error("range {offset}..{offset}+{len} is outside the {region_len}-byte region")]
    OutOfBounds {
        /// Offset of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The work queue has no free slot (wait for completions first).
    #[error("{queue} is full ({depth} work requests outstanding)")]
    QueueFull {
        /// Which queue.
        queue: &'static str,
        /// Its depth.
        depth: usize,
    },
    /// A request was malformed (too many SGEs, misaligned atomic, inline too large, ...).
    #[error("invalid work request: {0}")]
    InvalidRequest(&'static str),
    /// An argument was out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The region still has outstanding handles (work requests or slices), so the requested
    /// state change cannot happen yet.
    #[error("the memory region is still in use by {0} handle(s)")]
    RegionBusy(usize),
    /// A remote endpoint blob could not be decoded.
    #[error(transparent)]
    Endpoint(#[from] crate::qp::EndpointDecodeError),
    /// A work request completed with an error status.
    #[error("work completion error: {0}")]
    Completion(WcStatus),
    /// Waiting timed out.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The RDMA connection manager (rdma_cm) failed.
    #[error(transparent)]
    Cm(#[from] crate::cm::CmError),
    /// An object of another device context (or protection domain) was used with this one:
    /// the device resolves handles per context, so it would name a different object.
    #[error("{0} belongs to another device context or protection domain")]
    ForeignObject(&'static str),
    /// `ibv_dereg_mr` failed: the registration (and the memory behind it) is kept.
    #[error("ibv_dereg_mr failed; the region stays registered")]
    DeregMr(#[source] io::Error),
}

fn memlock_hint(e: &io::Error) -> &'static str {
    if e.raw_os_error() == Some(libc::ENOMEM) {
        ": out of locked memory; registered memory counts against RLIMIT_MEMLOCK — \
         raise it with `ulimit -l unlimited` (shell) or a `memlock` entry in \
         /etc/security/limits.conf (or LimitMEMLOCK= for systemd services)"
    } else {
        ""
    }
}

fn dmabuf_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::ENOSYS) => {
            ": this device, its rdma-core provider or the kernel cannot register DMA-BUF memory \
             (needs Linux 5.12+ and a driver with DMA-BUF MR support, e.g. mlx5; Soft-RoCE/rxe \
             has none)"
        }
        Some(libc::ENOMEM) => memlock_hint(e),
        _ => "",
    }
}

impl Error {
    /// Whether this error says the library, device, provider or kernel lacks the feature
    /// (as opposed to a bad argument or a transient failure).
    pub fn is_unsupported(&self) -> bool {
        match self {
            Error::Unsupported { .. } => true,
            Error::RegDmabufMr { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::ENOSYS)
            ),
            _ => false,
        }
    }
}

pub(crate) fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// An `errno`-style return value (positive errno, or -1 with `errno` set) as an `io::Error`.
pub(crate) fn rc_error(rc: i32) -> io::Error {
    if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else if rc < 0 && rc != -1 {
        io::Error::from_raw_os_error(-rc)
    } else {
        io::Error::last_os_error()
    }
}

macro_rules! wc_statuses {
    ($($variant:ident = $c:literal $n:literal: $doc:literal,)*) => {
        /// The status of a work completion: every `enum ibv_wc_status` value has a named variant.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(#[doc = $doc] $variant,)*
            /// A value this crate does not know.
            Unknown(u32),
        }

        impl WcStatus {
            /// Maps the raw `ibv_wc_status`.
            #[inline]
            pub fn from_raw(raw: u32) -> Self {
                match raw {
                    $($n => WcStatus::$variant,)*
                    other => WcStatus::Unknown(other),
                }
            }

            /// The raw `ibv_wc_status` value.
            pub fn as_raw(self) -> u32 {
                match self {
                    $(WcStatus::$variant => $n,)*
                    WcStatus::Unknown(v) => v,
                }
            }

            /// The C enumerator's name (`IBV_WC_...`).
            pub fn c_name(self) -> &'static str {
                match self {
                    $(WcStatus::$variant => $c,)*
                    WcStatus::Unknown(_) => "unknown",
                }
            }
        }

        /// C names in numeric order (the layout test checks them against verbs.h).
        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) const WC_STATUS_C_NAMES: &[&str] = &[$($c,)*];
    };
}

wc_statuses! {
    Success = "IBV_WC_SUCCESS" 0: "The work request completed successfully.",
    LocalLength = "IBV_WC_LOC_LEN_ERR" 1: "Local length error (e.g. a receive buffer too small for the message).",
    LocalQpOperation = "IBV_WC_LOC_QP_OP_ERR" 2: "Local QP operation error.",
    LocalEecOperation = "IBV_WC_LOC_EEC_OP_ERR" 3: "Local EE context operation error.",
    LocalProtection = "IBV_WC_LOC_PROT_ERR" 4: "Local protection error (bad lkey or address).",
    WrFlush = "IBV_WC_WR_FLUSH_ERR" 5: "Flushed because the QP entered the error state.",
    MwBind = "IBV_WC_MW_BIND_ERR" 6: "Memory window bind error.",
    BadResponse = "IBV_WC_BAD_RESP_ERR" 7: "Bad response from the responder.",
    LocalAccess = "IBV_WC_LOC_ACCESS_ERR" 8: "Local access error.",
    RemoteInvalidRequest = "IBV_WC_REM_INV_REQ_ERR" 9: "Remote invalid request.",
    RemoteAccess = "IBV_WC_REM_ACCESS_ERR" 10: "Remote access error (bad rkey, out of bounds, or missing access right).",
    RemoteOperation = "IBV_WC_REM_OP_ERR" 11: "Remote operation error.",
    RetryExceeded = "IBV_WC_RETRY_EXC_ERR" 12: "Transport retry counter exceeded (peer unreachable or gone).",
    RnrRetryExceeded = "IBV_WC_RNR_RETRY_EXC_ERR" 13: "Receiver-not-ready retry counter exceeded.",
    LocalRddViolation = "IBV_WC_LOC_RDD_VIOL_ERR" 14: "Local RDD violation.",
    RemoteInvalidRdRequest = "IBV_WC_REM_INV_RD_REQ_ERR" 15: "Remote invalid RD request.",
    RemoteAbort = "IBV_WC_REM_ABORT_ERR" 16: "Remote aborted.",
    InvalidEecn = "IBV_WC_INV_EECN_ERR" 17: "Invalid EE context number.",
    InvalidEecState = "IBV_WC_INV_EEC_STATE_ERR" 18: "Invalid EE context state.",
    Fatal = "IBV_WC_FATAL_ERR" 19: "Fatal error.",
    ResponseTimeout = "IBV_WC_RESP_TIMEOUT_ERR" 20: "Response timeout.",
    General = "IBV_WC_GENERAL_ERR" 21: "General error.",
    TagMatching = "IBV_WC_TM_ERR" 22: "Tag matching error.",
    TagMatchingRndvIncomplete = "IBV_WC_TM_RNDV_INCOMPLETE" 23: "Tag matching rendezvous incomplete.",
}

impl WcStatus {
    /// Whether this is [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WcStatus::Unknown(v) => write!(f, "unknown status {v}"),
            s => write!(f, "{} ({})", s.c_name(), s.as_raw()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_status_round_trips_and_names_every_value() {
        for raw in 0..24u32 {
            let s = WcStatus::from_raw(raw);
            assert!(!matches!(s, WcStatus::Unknown(_)), "{raw} unnamed");
            assert_eq!(s.as_raw(), raw);
            assert_eq!(s.c_name(), WC_STATUS_C_NAMES[raw as usize]);
        }
        assert_eq!(WcStatus::from_raw(10), WcStatus::RemoteAccess);
        assert_eq!(WcStatus::from_raw(5), WcStatus::WrFlush);
        assert_eq!(WcStatus::from_raw(99), WcStatus::Unknown(99));
        assert!(WcStatus::Success.is_success());
        assert!(!WcStatus::WrFlush.is_success());
        assert!(WcStatus::RemoteAccess
            .to_string()
            .contains("IBV_WC_REM_ACCESS_ERR"));
    }

    #[test]
    fn enomem_on_registration_explains_memlock() {
        let e = Error::RegMr {
            len: 1 << 26,
            access: 1,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let msg = e.to_string();
        assert!(msg.contains("ulimit -l"), "{msg}");
        assert!(msg.contains("memlock"), "{msg}");
        let e = Error::RegMr {
            len: 1,
            access: 1,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert!(!e.to_string().contains("ulimit"));
    }

    #[test]
    fn no_device_names_what_is_present() {
        let e = Error::NoDevice {
            name: Some("mlx5_9".into()),
            available: vec!["rxe0".into()],
        };
        let msg = e.to_string();
        assert!(msg.contains("mlx5_9") && msg.contains("rxe0"), "{msg}");
    }
}
