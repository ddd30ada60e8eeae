//! The crate's error type.

use std::fmt;
use std::io;

use crate::handle::DecodeError;

/// A CUDA driver version as reported by `cuDriverGetVersion` (`1000 * major + 10 * minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub u32);

impl DriverVersion {
    /// CUDA 10.2: the virtual memory management (`cuMem*`) API with POSIX-fd handles.
    pub const VMM: DriverVersion = DriverVersion(10020);
    /// CUDA 11.7: `cuMemGetHandleForAddressRange` (DMA-BUF export).
    pub const DMA_BUF: DriverVersion = DriverVersion(11070);
    /// CUDA 12.3: fabric handles (`CU_MEM_HANDLE_TYPE_FABRIC`).
    pub const FABRIC: DriverVersion = DriverVersion(12030);

    /// The major version (`12` for CUDA 12.8).
    pub fn major(self) -> u32 {
        self.0 / 1000
    }

    /// The minor version (`8` for CUDA 12.8).
    pub fn minor(self) -> u32 {
        (self.0 % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library could not be loaded.
    #[error(
        "CUDA driver library not found ({} names tried): install the NVIDIA driver, which provides \
         libcuda.so.1, and make sure the dynamic loader can find it (ldconfig or LD_LIBRARY_PATH)",
        .tried.split(", ").count()
    )]
    DriverUnavailable {
        /// The library names that were tried, comma-separated (cudarc's candidates).
        tried: String,
    },
    /// The driver loaded but reports no usable CUDA device.
    #[error(
        "no CUDA device: the NVIDIA driver is loaded but reports no usable GPU \
         (check nvidia-smi, CUDA_VISIBLE_DEVICES and the container's device mounts)"
    )]
    NoDevice,
    /// A device ordinal past the number of devices.
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s)")]
    DeviceOutOfRange {
        /// The requested ordinal.
        ordinal: usize,
        /// The number of devices.
        count: usize,
    },
    /// The driver is older than a feature needs (checked before calling newer entry points).
    #[error("{feature} needs CUDA driver {needed} or newer, but this driver is {found}: upgrade the NVIDIA driver")]
    DriverTooOld {
        /// What was asked for.
        feature: &'static str,
        /// The oldest driver that has it.
        needed: DriverVersion,
        /// The driver found.
        found: DriverVersion,
    },
    /// The driver library lacks an entry point this operation needs.
    #[error("{feature} is unavailable: the CUDA driver library has no `{symbol}` entry point; upgrade the NVIDIA driver")]
    MissingSymbol {
        /// What was asked for.
        feature: &'static str,
        /// The missing entry point.
        symbol: &'static str,
    },
    /// The device, driver or system does not support something.
    #[error("{feature} is not supported here: {reason}")]
    Unsupported {
        /// What was asked for.
        feature: &'static str,
        /// Why not.
        reason: String,
    },
    /// The driver refused a feature on this machine: the device attribute may claim support,
    /// but the platform, a missing system service (IMEX for fabric handles) or a sandbox
    /// around the driver (gVisor's GPU proxy, for one) says no. Not a bug of the caller; the
    /// driver's code is kept.
    #[error("{feature} is not available here: {call} returned {name} ({code}), refused by the driver or the sandbox around it")]
    Refused {
        /// What was asked for.
        feature: &'static str,
        /// The driver entry point that refused.
        call: &'static str,
        /// The raw `CUresult`.
        code: u32,
        /// The `CUresult` name, e.g. `CUDA_ERROR_NOT_SUPPORTED`.
        name: String,
    },
    /// A legacy IPC handle opened in the process that exported it: the driver refuses that
    /// (`CUDA_ERROR_INVALID_CONTEXT`), so it is caught before the call.
    #[error(
        "this legacy IPC handle was exported by this very process, where the CUDA driver cannot          open it: use the exporting DeviceBuffer directly"
    )]
    IpcHandleFromThisProcess,
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        /// The driver entry point.
        call: &'static str,
        /// The raw `CUresult`.
        code: u32,
        /// The `CUresult` name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
    },
    /// Peer access between two devices is impossible (no NVLink / PCIe peer path).
    #[error(
        "device {from} cannot access device {to} directly (cuDeviceCanAccessPeer = 0): \
         no NVLink or PCIe peer path; refusing to stage the copy through host memory"
    )]
    PeerAccessUnavailable {
        /// The accessing device.
        from: usize,
        /// The device whose memory would be accessed.
        to: usize,
    },
    /// A copy between devices was asked for without peer access enabled.
    #[error(
        "copy between device {src} and device {dst} needs peer access: hold a PeerAccess guard \
         (Device::enable_peer_access) for the pair while the copy runs; refusing to stage through host memory"
    )]
    PeerAccessNotEnabled {
        /// The source device.
        src: usize,
        /// The destination device.
        dst: usize,
    },
    /// Memory from the stream-ordered allocator cannot be exported as a legacy IPC handle.
    #[error(
        "memory from the stream-ordered allocator (cuMemAllocAsync / memory pools) cannot be exported \
         as a legacy IPC handle: allocate it with DeviceBuffer::new (cuMemAlloc), or share it with VMM handles"
    )]
    StreamOrderedAllocation,
    /// A legacy IPC handle must name the start of an allocation.
    #[error("legacy IPC exports whole allocations: pointer {ptr:#x} is {offset} bytes into its allocation")]
    NotAllocationBase {
        /// The pointer given.
        ptr: u64,
        /// Its offset from the allocation's base.
        offset: u64,
    },
    /// An offset/length pair outside a device allocation.
    #[error("range {offset}+{len} is outside a {size}-byte device allocation")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Size of the allocation.
        size: usize,
    },
    /// An argument that makes no sense (zero length, misaligned size, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Memory and stream (or two objects) belong to different devices or contexts.
    #[error("{0}")]
    ContextMismatch(String),
    /// Bytes from a peer did not decode as a handle.
    #[error("invalid handle bytes: {0}")]
    Decode(#[from] DecodeError),
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer on a Unix socket runs as another user.
    #[error("peer process {pid} runs as uid {got}, expected uid {expected}: refusing to exchange handles")]
    PeerUidMismatch {
        /// The peer's pid.
        pid: i32,
        /// The peer's uid.
        got: u32,
        /// The uid required.
        expected: u32,
    },
    /// A malformed fd-passing message.
    #[error("fd-passing protocol error: {0}")]
    Protocol(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether the error says "this machine does not offer that" (a driver too old, a missing
    /// entry point, a device or platform without the feature, a refusal by the driver or its
    /// sandbox) rather than that something went wrong.
    pub fn is_unavailable_here(&self) -> bool {
        matches!(
            self,
            Error::DriverTooOld { .. }
                | Error::MissingSymbol { .. }
                | Error::Unsupported { .. }
                | Error::Refused { .. }
        )
    }

    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        Error::Io { op, source }
    }

    pub(crate) fn last_os(op: &'static str) -> Self {
        Error::Io {
            op,
            source: io::Error::last_os_error(),
        }
    }
}
