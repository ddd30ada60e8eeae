//! The [`Transport`] trait and the types it speaks: completions, capabilities, remote keys.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use crate::error::{DecodeError, Error, Result};
use crate::region::{Access, Buf, Region};
use crate::window::RemoteWindow;

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
///
/// # Messaging semantics
///
/// * **Tags** (`tagged`): a message sent with tag `T`
///   ([`post_send_tagged`](Transport::post_send_tagged)) matches a receive `(tag, mask)`
///   iff `T & mask == tag & mask`. Receives are matched in post order, messages in arrival
///   order. A plain `post_send` sends tag 0; a plain `post_recv` has mask 0 (takes any
///   message). A receive's [`Completion::tag`] is the tag the message carried.
/// * **Unexpected messages**: a message that arrives while receives are posted but none
///   matches it is copied into the connection's unexpected queue (at most
///   `unexpected_messages` messages and `unexpected_bytes` bytes) and consumed from the
///   wire, so it blocks no other tag; a later receive that matches takes it from there (the
///   oldest first). While no receive at all is posted a message waits on the wire (the
///   bounded ring / socket buffer), as untagged traffic always did. Beyond the queue's
///   bounds the connection stops reading from the peer until a receive takes a queued
///   message: the peer's sends stay in flight, and its posts get
///   [`Error::WouldBlock`] once its in-flight table is full (backpressure, never loss). A
///   receiver that posts tags in any order is deadlock-free as long as the messages
///   that overtake the one it waits for fit in the queue. One exception: verbs endpoints
///   on a domain's shared receive queue ([`Options::verbs_srq_buffers`](crate::backend::Options::verbs_srq_buffers))
///   take unmatched messages into the unexpected queue even while no receive is posted
///   (the shared buffer goes back at once), and an endpoint whose peer overruns both the
///   queue and its share of held buffers fails alone (see the verbs backend's docs) instead
///   of holding the peer back.
/// * **Grouped receive** (`max_group` parts; [`post_recv_group`](Transport::post_recv_group)):
///   each part is matched as its own tagged receive; one completion (op
///   [`OpKind::RecvGroup`]) comes when every part is filled, with each part's buffer,
///   length, tag and status in [`Completion::parts`].
/// * **Write with immediate** (`write_imm`): the bytes land in the target region, then the
///   target gets a notification carrying the immediate and the length. The notification
///   consumes one posted receive that matches tag 0 (a plain receive, or a tagged
///   receive whose `tag & mask == 0`), exactly as a zero-byte message with tag 0 would
///   (verbs: `IBV_WR_RDMA_WRITE_WITH_IMM` consumes the next receive). The receive's buffer
///   is not written; its completion is an [`OpKind::Recv`] with [`Completion::imm`] set and
///   `len` = bytes written. On shm and tcp a notification with no receive posted waits in
///   the unexpected queue as a message does; on verbs RC it makes the target's NIC retry
///   and then fail the connection (receiver not ready).
/// * **Flush** ([`post_flush`](Transport::post_flush)): after it completes, bytes the NIC
///   wrote into the buffer's (GPU) memory are visible to the GPU. Host memory: it
///   completes at once.
/// * **Fatal errors** (`too_long_kills_connection`, `remote_error_kills_connection`): on
///   shm and tcp a message longer than the matched receive fails only that receive
///   ([`Status::MessageTooLong`], the message is dropped) and a refused remote access
///   fails only that operation ([`Status::RemoteAccess`]). On verbs RC both move the queue
///   pair to the error state: the operation fails and every later operation of the
///   connection completes with an error (reconnect to go on).
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
    /// Tagged sends and receives with a mask (see the type's docs).
    pub tagged: bool,
    /// Most parts one grouped receive may have; 0 = no grouped receive.
    pub max_group: usize,
    /// Write with immediate data.
    pub write_imm: bool,
    /// Most messages the unexpected queue holds (0 = none: an unmatched message waits on
    /// the wire).
    pub unexpected_messages: usize,
    /// Most payload bytes the unexpected queue holds.
    pub unexpected_bytes: usize,
    /// A message longer than its receive kills the connection (verbs RC) instead of
    /// failing only that receive (shm, tcp).
    pub too_long_kills_connection: bool,
    /// A peer's refused remote access (revoked or invalid key, out of bounds, no
    /// permission) kills the connection (verbs RC) instead of failing only that
    /// operation (shm, tcp).
    pub remote_error_kills_connection: bool,
    /// [`Transport::map_remote`] maps a peer's region into this process (shm: the peer's
    /// memory is on this host), so the caller can load and store into it directly.
    pub remote_window: bool,
}

impl Default for Capabilities {
    /// Nothing: in order, no one-sided operations, no messages, no tags.
    fn default() -> Self {
        Capabilities {
            ordering: MessageOrdering::InOrder,
            one_sided: false,
            atomics: false,
            max_message: 0,
            max_in_flight: 0,
            inline_size: 0,
            memory_kinds: MemoryKinds::empty(),
            tagged: false,
            max_group: 0,
            write_imm: false,
            unexpected_messages: 0,
            unexpected_bytes: 0,
            too_long_kills_connection: false,
            remote_error_kills_connection: false,
            remote_window: false,
        }
    }
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
    /// A grouped receive (every part filled; see [`Completion::parts`]).
    RecvGroup,
    /// One-sided write with immediate data (the initiator's completion; the target's is
    /// an [`OpKind::Recv`] with [`Completion::imm`]).
    WriteImm,
    /// A flush (see [`Transport::post_flush`]).
    Flush,
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
    /// The buffer the post took (`None` in a default-constructed slot, and for a grouped
    /// receive, whose buffers are in [`parts`](Self::parts)).
    pub buf: Option<Buf>,
    /// The message's tag (receives; 0 for an untagged message or a write-imm
    /// notification); the tag sent (tagged sends); 0 otherwise.
    pub tag: u64,
    /// The immediate of a write-with-immediate (the target's receive completion and the
    /// initiator's [`OpKind::WriteImm`] completion); `None` otherwise.
    pub imm: Option<u32>,
    /// The parts of a grouped receive, in post order; empty otherwise (no allocation).
    pub parts: Vec<RecvPart>,
}

/// One part of a finished grouped receive.
#[derive(Debug)]
pub struct RecvPart {
    /// The part's buffer, handed back.
    pub buf: Buf,
    /// Bytes received (the message's length when it was too long).
    pub len: usize,
    /// The tag the matched message carried.
    pub tag: u64,
    /// The immediate, when a write-imm notification filled this part.
    pub imm: Option<u32>,
    /// How the part ended (the group's status is the first part's that is not success).
    pub status: Status,
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
            tag: 0,
            imm: None,
            parts: Vec::new(),
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

/// A refused grouped receive: why, and every part's buffer back (nothing was queued).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct GroupPostError {
    /// Why.
    #[source]
    pub error: Error,
    /// The parts' buffers, in the order given.
    pub bufs: Vec<Buf>,
}

impl GroupPostError {
    /// Whether it is backpressure ([`Error::WouldBlock`]): poll and post again.
    pub fn is_would_block(&self) -> bool {
        matches!(self.error, Error::WouldBlock(_))
    }
}

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

    /// Posts a send of `buf`'s bytes carrying `tag` (see [`Capabilities`] for matching).
    ///
    /// # Errors
    /// As [`post_send`](Transport::post_send); [`Error::Unsupported`] without
    /// [`Capabilities::tagged`] (the default).
    fn post_send_tagged(&mut self, buf: Buf, tag: u64, wr_id: u64) -> PostResult {
        let _ = (tag, wr_id);
        Err(PostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "tagged messages",
            },
            buf,
        })
    }

    /// Posts a receive that takes the oldest message whose tag `T` has
    /// `T & mask == tag & mask` (an unexpected one first, if one waits).
    ///
    /// # Errors
    /// As [`post_recv`](Transport::post_recv); [`Error::Unsupported`] without
    /// [`Capabilities::tagged`] (the default).
    fn post_recv_tagged(&mut self, buf: Buf, tag: u64, mask: u64, wr_id: u64) -> PostResult {
        let _ = (tag, mask, wr_id);
        Err(PostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "tagged messages",
            },
            buf,
        })
    }

    /// Posts several receives `(buf, tag, mask)` as one: each part is matched as its own
    /// tagged receive (in the order given), and one [`OpKind::RecvGroup`] completion
    /// comes when every part is filled, with the parts in [`Completion::parts`].
    ///
    /// # Errors
    /// [`GroupPostError`] with every buffer back: [`Error::InvalidArgument`] for no parts
    /// or more than [`Capabilities::max_group`]; a part's own error as in
    /// [`post_recv_tagged`](Transport::post_recv_tagged); [`Error::Unsupported`] without
    /// grouped receives (the default).
    fn post_recv_group(
        &mut self,
        parts: Vec<(Buf, u64, u64)>,
        wr_id: u64,
    ) -> std::result::Result<(), GroupPostError> {
        let _ = wr_id;
        Err(GroupPostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "grouped receives",
            },
            bufs: parts.into_iter().map(|(b, _, _)| b).collect(),
        })
    }

    /// Writes `buf`'s bytes into the peer's region at `remote_offset`, then notifies the
    /// peer with `imm` and the length (see [`Capabilities`]). The initiator's completion is
    /// an [`OpKind::WriteImm`].
    ///
    /// # Errors
    /// As [`post_write`](Transport::post_write); [`Error::Unsupported`] without
    /// [`Capabilities::write_imm`] (the default).
    fn post_write_imm(
        &mut self,
        buf: Buf,
        remote: &RemoteKey,
        remote_offset: u64,
        imm: u32,
        wr_id: u64,
    ) -> PostResult {
        let _ = (remote, remote_offset, imm, wr_id);
        Err(PostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "write with immediate",
            },
            buf,
        })
    }

    /// Makes bytes that the NIC wrote into `buf`'s memory visible to the GPU once the
    /// [`OpKind::Flush`] completion comes (the buffer is handed back in it). Host
    /// memory, and transports where the CPU moves the bytes (shm, tcp): it completes at
    /// once.
    ///
    /// # Errors
    /// [`Error::Foreign`] for a buffer of another domain; [`Error::Unsupported`] where the
    /// transport cannot flush that memory (the default).
    fn post_flush(&mut self, buf: Buf, wr_id: u64) -> PostResult {
        let _ = wr_id;
        Err(PostError {
            error: Error::Unsupported {
                transport: self.kind(),
                what: "flush",
            },
            buf,
        })
    }

    /// Holds the posts that follow: each is validated and queued (its errors come back at
    /// once, as always) but not started until [`flush_posts`](Transport::flush_posts), the
    /// next [`poll`](Transport::poll) or the next [`arm`](Transport::arm), whichever comes
    /// first (each of them ends the hold). On verbs the held sends and one-sided
    /// operations then go to the NIC behind one doorbell (up to 32 work requests per
    /// `ibv_post_send`), with a completion requested only for every 16th and the last of
    /// them; every operation still gets its own [`Completion`], in post order. Backends that
    /// start posts cheaply (shm, tcp) may ignore it (the default does nothing).
    fn hold_posts(&mut self) {}

    /// Starts what [`hold_posts`](Transport::hold_posts) held and ends the hold (a no-op
    /// without one). Failures of the machinery become error completions, as a post's do.
    fn flush_posts(&mut self) {}

    /// Maps the peer's region named by `key` into this process: a [`RemoteWindow`] whose
    /// copies and atomic loads and stores reach the peer's memory directly, with no
    /// operation, completion or poll (see [`crate::window`] for the memory model and what
    /// revocation does). Only where [`Capabilities::remote_window`] says so (shm).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on backends whose peers' memory is not on this host (the
    /// default); [`Error::Foreign`] for another transport's key; [`Error::RemoteKey`] when
    /// the peer has not announced the region on this connection (yet), or dropped it, or the
    /// key does not match it; [`Error::Disconnected`] after the connection failed.
    fn map_remote(&mut self, key: &RemoteKey) -> Result<RemoteWindow> {
        let _ = key;
        Err(Error::Unsupported {
            transport: self.kind(),
            what: "mapping a peer's memory (remote windows)",
        })
    }

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

    /// Internal to fabric-core's [`Worker`](crate::Worker): it calls this with its id when it
    /// takes the connection and with `None` when it hands it back. A connection whose
    /// completions arrive on a queue shared by its domain's connections (verbs: one CQ for
    /// many queue pairs) returns its key in that queue, and while attached its
    /// [`wait_fd`](Transport::wait_fd) only reports hang-up; the worker watches the shared
    /// queue once for all of them. Other connections return `None` (the default).
    #[doc(hidden)]
    fn attach_worker(&mut self, _worker: Option<u64>) -> Option<u64> {
        None
    }

    /// Internal to fabric-core's [`Worker`](crate::Worker): the fds it watches in its own
    /// epoll instead of [`wait_fd`](Transport::wait_fd), so that a connection in a worker
    /// needs no epoll of its own. After [`arm`](Transport::arm) returned `true`, work makes
    /// one of them ready as it would make `wait_fd` readable (read again after every arm:
    /// what is watched may change with it, e.g. writability while output waits). The
    /// default is `wait_fd` itself, for readability.
    #[doc(hidden)]
    fn watch_fds(&self) -> WatchFds<'_> {
        WatchFds::one(self.wait_fd(), false)
    }

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

/// The fds a [`Worker`](crate::Worker) watches for one connection in its own epoll, in
/// place of the connection's [`wait_fd`](Transport::wait_fd) (see
/// [`Transport::watch_fds`]): one or two, each for readability and hang-up, and for
/// writability where `out` says so. Internal to fabric-core.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct WatchFds<'a> {
    fds: [(BorrowedFd<'a>, bool); 2],
    len: usize,
}

impl<'a> WatchFds<'a> {
    /// One fd (`out`: writability too).
    pub fn one(fd: BorrowedFd<'a>, out: bool) -> Self {
        WatchFds {
            fds: [(fd, out), (fd, out)],
            len: 1,
        }
    }

    /// Two fds, readability (and hang-up) only.
    pub fn two(a: BorrowedFd<'a>, b: BorrowedFd<'a>) -> Self {
        WatchFds {
            fds: [(a, false), (b, false)],
            len: 2,
        }
    }

    /// The fds, each with whether its writability is watched too.
    pub fn as_slice(&self) -> &[(BorrowedFd<'a>, bool)] {
        &self.fds[..self.len]
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
