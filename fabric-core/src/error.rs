//! The crate's error type.

use std::io;

use crate::transport::TransportKind;

/// A decoder rejected bytes that came from a peer or a user (bootstrap frames, endpoint
/// blobs, remote keys, wire headers). Decoders never panic; they return one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the fixed part of the message needs.
    #[error("truncated {what}: need {need} bytes, got {got}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        got: usize,
    },
    /// The magic number does not match: not one of our messages.
    #[error("bad magic in {what}: {found:#x}")]
    BadMagic {
        /// What was being decoded.
        what: &'static str,
        /// The value found.
        found: u64,
    },
    /// A version this build does not speak.
    #[error("unsupported {what} version {found} (this build speaks {expected})")]
    Version {
        /// What was being decoded.
        what: &'static str,
        /// The version found.
        found: u32,
        /// The version expected.
        expected: u32,
    },
    /// A length field larger than the limit for this message.
    #[error("{what} length {len} exceeds the limit of {max}")]
    TooLong {
        /// What was being decoded.
        what: &'static str,
        /// Length announced.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A field holds a value that is not allowed.
    #[error("invalid {what}: {value}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// The value found.
        value: u64,
    },
    /// Bytes left over after a complete message.
    #[error("{extra} trailing bytes after {what}")]
    Trailing {
        /// What was being decoded.
        what: &'static str,
        /// How many bytes were left.
        extra: usize,
    },
}

/// Errors of `fabric-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Io {
        /// The call (e.g. `memfd_create`).
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Backpressure: the send queue, the receive queue or the in-flight table is full.
    /// Poll completions and post again; nothing was queued.
    #[error("would block: {0} is full")]
    WouldBlock(&'static str),
    /// A buffer or remote range lies outside its registered region.
    #[error("out of bounds: offset {offset} + len {len} exceeds region length {region_len}")]
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The region was not registered with the access this operation needs.
    #[error("access denied: the region lacks {0}")]
    AccessDenied(&'static str),
    /// A message larger than the transport's maximum.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// Length asked for.
        len: usize,
        /// The transport's maximum.
        max: usize,
    },
    /// An atomic operation on a buffer or remote offset that is not an 8-byte aligned word.
    #[error("atomic operations need an 8-byte buffer and an 8-byte aligned remote offset")]
    Unaligned,
    /// A buffer from another connection's region, or a remote key of another transport.
    #[error("foreign handle: {0}")]
    Foreign(&'static str),
    /// The backend does not offer this operation (see [`Capabilities`](crate::Capabilities)).
    #[error("{transport} does not support {what}")]
    Unsupported {
        /// The transport.
        transport: TransportKind,
        /// The operation.
        what: &'static str,
    },
    /// The peer went away (hang-up, reset, heartbeat lost) or the connection failed earlier.
    #[error("connection closed: {0}")]
    Disconnected(String),
    /// The peer broke the protocol (corrupt ring, unknown frame, bad response).
    #[error("protocol violation by the peer: {0}")]
    Protocol(String),
    /// The peer runs as another user than this process.
    #[error("peer uid {peer} differs from ours ({ours}); refusing to share memory")]
    PeerUid {
        /// The peer's uid (`SO_PEERCRED`).
        peer: u32,
        /// Our uid.
        ours: u32,
    },
    /// Bytes from a peer or user did not decode.
    #[error("decode error: {0}")]
    Decode(#[from] DecodeError),
    /// The bootstrap failed (wrong secret, rank mismatch, timeout, ...).
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// Bootstrap ranks were lost: they never joined, joined and left before the table was
    /// sent, or vanished before they confirmed receiving it. Every other rank was served
    /// (or, when the table could not be built, told why).
    #[error("bootstrap: lost rank(s) {ranks:?}: {reason}")]
    RanksLost {
        /// Every lost rank, ascending.
        ranks: Vec<u32>,
        /// What happened to each.
        reason: String,
    },
    /// A transport is not usable on this machine; the message says why and what to install.
    #[error("{transport} transport unavailable: {reason}")]
    Unavailable {
        /// The transport.
        transport: TransportKind,
        /// Why (and what to install).
        reason: String,
    },
    /// A wait or handshake ran past its deadline.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The region is lent out: a local borrow ([`Region::bytes`](crate::Region::bytes) /
    /// [`Region::bytes_mut`](crate::Region::bytes_mut)) conflicts with a slice handed to an
    /// operation, a copy, or another borrow. Drop the guard (or wait for the completion).
    #[error("region busy: {0}")]
    Busy(&'static str),
    /// A remote key names no region the peer has announced on this connection: the region
    /// was dropped (revoked), the key's generation or value does not match, or its
    /// announcement has not arrived yet (poll the connection and try again).
    #[error("remote key refused: {0}")]
    RemoteKey(&'static str),
    /// An argument is not valid (e.g. an unknown transport name).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
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

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
