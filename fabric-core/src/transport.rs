//! The [`Transport`] trait and the types it speaks: completions, capabilities, remote keys.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use crate::error::{DecodeError, Error, Result};
use crate::region::{Access, Buf, Region};

/// The backends this crate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TransportKind {
    /// Shared memory between processes on one host (the default).
    Shm,
    /// TCP between any two hosts.
    Tcp,
    /// RDMA RC queue pairs (InfiniBand / RoCE).
    Verbs,
    /// CUDA IPC between processes on one host.
    CudaIpc,
}

impl TransportKind {
    /// All kinds, in the order automatic selection prefers them.
    pub const ALL: [TransportKind; 4] = [
        TransportKind::Shm,
        TransportKind::Verbs,
        TransportKind::CudaIpc,
        TransportKind::Tcp,
    ];

    /// Lower-case name (`shm`, `tcp`, `verbs`, `cuda-ipc`).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
            TransportKind::CudaIpc => "cuda-ipc",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            TransportKind::Shm => 1,
            TransportKind::Tcp => 2,
            TransportKind::Verbs => 3,
            TransportKind::CudaIpc => 4,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => TransportKind::Shm,
            2 => TransportKind::Tcp,
            3 => TransportKind::Verbs,
            4 => TransportKind::CudaIpc,
            _ => return None,
        })
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "verbs" | "rdma" | "ib" => Ok(TransportKind::Verbs),
            "cuda-ipc" | "cuda_ipc" | "cudaipc" => Ok(TransportKind::CudaIpc),
            other => Err(Error::InvalidArgument(format!(
                "unknown transport {other:?} (expected shm, tcp, verbs or cuda-ipc)"
            ))),
        }
    }
}

/// Delivery ordering a transport guarantees on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageOrdering {
    /// Every operation posted on a connection takes effect at the peer in post order, and
    /// messages are matched to receives in post order (like an RC queue pair).
    InOrder,
    /// Messages may be delivered out of order.
    Unordered,
}

bitflags::bitflags! {
    /// Kinds of memory a transport can register.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MemoryKinds: u32 {
        /// Ordinary host memory.
        const HOST = 1;
        /// CUDA device memory.
        const CUDA_DEVICE = 2;
    }
}

/// What a connection can do. Callers ask; backends never fake a missing feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Ordering guarantee.
    pub ordering: MessageOrdering,
    /// One-sided write and read.
    pub one_sided: bool,
    /// 8-byte compare-and-swap and fetch-and-add on remote memory.
    pub atomics: bool,
    /// Largest message (send/recv) and one-sided transfer.
    pub max_message: usize,
    /// Most operations in flight at once (posted and not yet returned by `poll`).
    pub max_in_flight: usize,
    /// Payloads up to this size are copied at post time (the buffer could be reused at once
    /// if it were not owned by the operation); 0 if none.
    pub inline_size: usize,
    /// Memory kinds `register` accepts.
    pub memory_kinds: MemoryKinds,
}

/// The operation a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpKind {
    /// Two-sided send.
    Send,
    /// Two-sided receive.
    Recv,
    /// One-sided write.
    Write,
    /// One-sided read.
    Read,
    /// Remote compare-and-swap.
    CompareSwap,
    /// Remote fetch-and-add.
    FetchAdd,
}

/// A remote atomic operation on an 8-byte aligned word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// If the word equals `expect`, replace it with `new`. The old value is returned.
    CompareSwap {
        /// Expected value.
        expect: u64,
        /// New value.
        new: u64,
    },
    /// Add `add` (wrapping). The old value is returned.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

impl AtomicOp {
    /// The completion's [`OpKind`].
    pub fn kind(self) -> OpKind {
        match self {
            AtomicOp::CompareSwap { .. } => OpKind::CompareSwap,
            AtomicOp::FetchAdd { .. } => OpKind::FetchAdd,
        }
    }
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// It completed.
    Success,
    /// The incoming message was longer than the posted receive buffer (the message is
    /// dropped; the receive completes with this status).
    MessageTooLong,
    /// The peer refused the remote access (unknown or stale key, out of bounds, no
    /// permission).
    RemoteAccess,
    /// The peer went away (hang-up, reset, heartbeat lost) before the operation completed.
    PeerGone,
    /// The peer broke the protocol; the connection is unusable.
    ProtocolError,
    /// The connection was closed locally.
    Canceled,
}

impl Status {
    /// Whether this is `Success`.
    pub fn is_ok(self) -> bool {
        self == Status::Success
    }
}

/// One finished operation, with its buffer handed back.
#[derive(Debug)]
pub struct Completion {
    /// The caller's id from the post.
    pub wr_id: u64,
    /// Which operation.
    pub op: OpKind,
    /// How it ended.
    pub status: Status,
    /// Bytes received (recv), transferred (send/write/read) or 8 (atomics).
    pub len: usize,
    /// The old value of the word (atomics); 0 otherwise.
    pub value: u64,
    /// The buffer the post took (`None` only in a default-constructed slot).
    pub buf: Option<Buf>,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            op: OpKind::Send,
            status: Status::Success,
            len: 0,
            value: 0,
            buf: None,
        }
    }
}

/// A refused post: why, and the buffer back (nothing was queued).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct PostError {
    /// Why.
    #[source]
    pub error: Error,
    /// The buffer the post took.
    pub buf: Buf,
}

impl PostError {
    /// Whether it is backpressure ([`Error::WouldBlock`]): poll and post again.
    pub fn is_would_block(&self) -> bool {
        matches!(self.error, Error::WouldBlock(_))
    }
}

/// Result of a post.
pub type PostResult = std::result::Result<(), PostError>;

/// What a peer needs to address a registered region: packable to [`RemoteKey::PACKED_LEN`]
/// bytes and decoded with typed errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteKey {
    /// Transport the key belongs to.
    pub transport: TransportKind,
    /// Region id in the owner's domain (reused after the region is dropped).
    pub region: u32,
    /// Generation of the id: a key of a dropped region is refused even when its id is
    /// reused.
    pub gen: u32,
    /// [`Access`] bits granted.
    pub access: u32,
    /// Region length.
    pub len: u64,
    /// Random capability value: a key that does not match the region is refused.
    pub key: u64,
    /// Base address in the owner's address space (used by verbs).
    pub addr: u64,
    /// Backend-specific key (verbs `rkey`).
    pub rkey: u32,
}

const RKEY_MAGIC: u32 = 0x4b52_4246; // "FBRK"
const RKEY_VERSION: u8 = 2;

impl RemoteKey {
    /// Bytes of a packed key.
    pub const PACKED_LEN: usize = 48;

    /// Serialises the key (little-endian, versioned).
    pub fn pack(&self) -> [u8; Self::PACKED_LEN] {
        let mut b = [0u8; Self::PACKED_LEN];
        b[0..4].copy_from_slice(&RKEY_MAGIC.to_le_bytes());
        b[4] = RKEY_VERSION;
        b[5] = self.transport.code();
        // b[6..8] reserved
        b[8..12].copy_from_slice(&self.region.to_le_bytes());
        b[12..16].copy_from_slice(&self.access.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.addr.to_le_bytes());
        b[40..44].copy_from_slice(&self.rkey.to_le_bytes());
        b[44..48].copy_from_slice(&self.gen.to_le_bytes());
        b
    }

    /// Parses a packed key.
    ///
    /// # Errors
    /// A [`DecodeError`] for a wrong length, magic, version, non-zero reserved bytes,
    /// transport or access bits.
    pub fn decode(b: &[u8]) -> std::result::Result<Self, DecodeError> {
        const W: &str = "remote key";
        if b.len() < Self::PACKED_LEN {
            return Err(DecodeError::Truncated {
                what: W,
                need: Self::PACKED_LEN,
                got: b.len(),
            });
        }
        if b.len() > Self::PACKED_LEN {
            return Err(DecodeError::Trailing {
                what: W,
                extra: b.len() - Self::PACKED_LEN,
            });
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != RKEY_MAGIC {
            return Err(DecodeError::BadMagic {
                what: W,
                found: magic as u64,
            });
        }
        if b[4] != RKEY_VERSION {
            return Err(DecodeError::Version {
                what: W,
                found: b[4] as u32,
                expected: RKEY_VERSION as u32,
            });
        }
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if reserved != 0 {
            return Err(DecodeError::Invalid {
                what: "remote key reserved bytes (must be zero)",
                value: reserved as u64,
            });
        }
        let transport = TransportKind::from_code(b[5]).ok_or(DecodeError::Invalid {
            what: "remote key transport",
            value: b[5] as u64,
        })?;
        let access = u32_at(12);
        if Access::from_bits(access).is_none() {
            return Err(DecodeError::Invalid {
                what: "remote key access bits",
                value: access as u64,
            });
        }
        Ok(RemoteKey {
            transport,
            region: u32_at(8),
            gen: u32_at(44),
            access,
            len: u64_at(16),
            key: u64_at(24),
            addr: u64_at(32),
            rkey: u32_at(40),
        })
    }

    /// The access bits as [`Access`].
    pub fn access(&self) -> Access {
        Access::from_bits_truncate(self.access)
    }
}

/// One connection between two endpoints: the small interface higher layers build on.
///
/// Every method is non-blocking except [`wait`](Transport::wait). Buffers are owned by an
/// operation from the post until its [`Completion`] hands them back; a refused post hands
/// the buffer back in its [`PostError`]. Bookkeeping (in-flight slots, bounds and access
/// checks, ordering) is shared by every backend (see `tracker`), and the trait is object
/// safe: `Box<dyn Transport>` is how the examples hold a connection.
pub trait Transport: Send + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> TransportKind;

    /// What the connection can do.
    fn capabilities(&self) -> Capabilities;

    /// The domain the connection belongs to: register caller memory there
    /// ([`Domain::register_memory`](crate::Domain::register_memory)); its regions work on
    /// every connection of the domain.
    #[cfg(not(fabric_loom))]
    fn domain(&self) -> &crate::Domain;

    /// Registers `len` bytes of fresh, zeroed memory with `access` on the connection's
    /// domain (the convenient form of [`Domain::register`](crate::Domain::register)).
    ///
    /// # Errors
    /// [`Error::Io`] when memory cannot be allocated or mapped; [`Error::Disconnected`] when
    /// the connection failed; [`Error::Unsupported`] for remote access on a transport
    /// without one-sided operations.
    fn register(&mut self, len: usize, access: Access) -> Result<Region>;

    /// Posts a two-sided send of `buf`'s bytes.
    ///
    /// Its completion means the buffer may be reused: the bytes were copied out (shm
    /// eager, tcp) or read by the peer (shm rendezvous, verbs). It does not promise that a
    /// receive matched them: if the connection dies first, messages still in transit are
    /// lost (as with a TCP connection) and the peer's pending receives complete with
    /// [`Status::PeerGone`].
    ///
    /// # Errors
    /// [`Error::WouldBlock`] (backpressure), [`Error::MessageTooLarge`],
    /// [`Error::Foreign`], [`Error::Disconnected`]; the buffer comes back in the error.
    fn post_send(&mut self, buf: Buf, wr_id: u64) -> PostResult;

    /// Posts a receive into `buf`. A message longer than `buf` completes the receive with
    /// [`Status::MessageTooLong`].
    ///
    /// # Errors
    /// As [`post_send`](Transport::post_send), plus [`Error::AccessDenied`] for a region
    /// without local write access.
    fn post_recv(&mut self, buf: Buf, wr_id: u64) -> PostResult;

    /// Writes `buf`'s bytes into the peer's region at `remote_offset`.
    ///
    /// # Errors
    /// As [`post_send`](Transport::post_send), plus [`Error::OutOfBounds`],
    /// [`Error::AccessDenied`] and [`Error::Unsupported`].
    fn post_write(
        &mut self,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        wr_id: u64,
    ) -> PostResult;

    /// Reads `buf.len()` bytes of the peer's region at `remote_offset` into `buf`.
    ///
    /// # Errors
    /// As [`post_write`](Transport::post_write).
    fn post_read(
        &mut self,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        wr_id: u64,
    ) -> PostResult;

    /// Runs `op` on the 8-byte word at `remote_offset` (8-byte aligned); the old value
    /// lands in `buf` (8 bytes) and in [`Completion::value`].
    ///
    /// # Errors
    /// As [`post_write`](Transport::post_write), plus [`Error::Unaligned`].
    fn post_atomic(
        &mut self,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        op: AtomicOp,
        wr_id: u64,
    ) -> PostResult;

    /// Makes progress and moves finished operations into `out`; returns how many.
    ///
    /// # Errors
    /// Only for local failures (e.g. a failing system call). Peer failures surface as
    /// error completions ([`Status::PeerGone`], ...).
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize>;

    /// Operations posted and not yet returned by `poll`.
    fn in_flight(&self) -> usize;

    /// A file descriptor that becomes readable when `poll` may have work, once
    /// [`arm`](Transport::arm) returned `true`.
    fn wait_fd(&self) -> BorrowedFd<'_>;

    /// Prepares to sleep on [`wait_fd`](Transport::wait_fd). Returns `false` when there is
    /// work already (do not sleep; poll).
    ///
    /// # Errors
    /// Only for a failing system call.
    fn arm(&mut self) -> Result<bool>;

    /// Sleeps until there may be work or `timeout` passes (`arm` + `poll(2)` on the fd).
    ///
    /// # Errors
    /// Only for a failing system call.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.arm()? {
            crate::sys::poll_readable(self.wait_fd(), timeout)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_key_round_trips_and_refuses_reserved_bytes() {
        let k = RemoteKey {
            transport: TransportKind::Tcp,
            region: 3,
            gen: 9,
            access: Access::REMOTE_WRITE.bits(),
            len: 4096,
            key: 0xfeed,
            addr: 0,
            rkey: 0,
        };
        assert_eq!(RemoteKey::decode(&k.pack()), Ok(k));
        for i in [6usize, 7] {
            let mut b = k.pack();
            b[i] = 1;
            assert!(
                matches!(RemoteKey::decode(&b), Err(DecodeError::Invalid { .. })),
                "reserved byte {i} ignored"
            );
        }
    }
}
