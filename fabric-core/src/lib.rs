//! One small [`Transport`] trait, an out-of-band bootstrap, and the `shm` (default), `tcp`
//! (and, where available, `verbs` / `cuda-ipc`) backends.
//!
//! ```no_run
//! use fabric_core::{backend, Access, Completion, Domain, Transport, TransportKind};
//! use std::time::Duration;
//!
//! # fn main() -> fabric_core::Result<()> {
//! // A domain per device and backend owns registrations; its connections share them.
//! let domain = Domain::open(TransportKind::Shm, &backend::Options::default())?;
//! // One side listens (the address travels to the peer out of band, e.g. via `bootstrap`)...
//! let mut listener = domain.listen()?;
//! println!("peer: connect to {}", listener.address());
//! let mut conn = backend::accept_timeout(listener.as_mut(), Duration::from_secs(30))?;
//! // ...registers the caller's own memory in place (no copy; any connection of the
//! // domain may use it) and moves bytes; buffers come back in completions.
//! let region = domain.register_memory(vec![0u8; 4096], Access::empty())?;
//! conn.post_recv(region.slice(0, 4096)?, 1).map_err(|e| e.error)?;
//! let mut done: Vec<Completion> = (0..8).map(|_| Completion::default()).collect();
//! loop {
//!     let n = conn.poll(&mut done)?;
//!     if n > 0 {
//!         println!("received {} bytes", done[0].len);
//!         break;
//!     }
//!     conn.wait(Some(Duration::from_millis(100)))?;
//! }
//! drop(done);
//! // No peer may write it, so it lends its bytes without a copy...
//! println!("first byte {}", region.bytes()?[0]);
//! // ...and gives the Vec back once nothing holds it (deregistered first).
//! let bytes: Vec<u8> = region.into_memory().expect("sole owner");
//! # let _ = bytes;
//! # Ok(())
//! # }
//! ```
//!
//! # Design
//!
//! * **Domain → region → connection.** A [`Domain`] (one per device and backend: the verbs
//!   context and protection domain, the shm announcement fan-out) owns registrations:
//!   memory it allocates ([`Domain::register`]) or the caller's, in place
//!   ([`Domain::register_memory`] for `Vec<u8>`, `Box<[u8]>`, typed `Vec<f32>`-like
//!   buffers of [`Plain`] elements, `memmap2::MmapMut`, [`AlignedBuf`];
//!   [`Domain::register_raw`] for foreign memory with a keep-alive; a refused registration
//!   hands the memory back in its [`RegisterError`]). A region works on
//!   every connection of its domain ([`Domain::listen`], [`Domain::connect`]); ids live in
//!   a [`registry::Registry`] with generations and are reused. Dropping the last handle
//!   (no operation holds a slice any more) deregisters it and revokes its key at every
//!   peer: a later operation with the old key completes with
//!   [`Status::RemoteAccess`] and touches nothing. Regions no peer may write lend
//!   `&[u8]` / `&mut [u8]` ([`Region::bytes`], [`Region::bytes_mut`]) while no slice is
//!   out; remotely writable memory stays copy-only. A region whose receives stream says
//!   so ([`Region::set_streaming`]): shm copies large messages into it with non-temporal
//!   stores. shm cannot give peers one-sided
//!   access to caller memory (typed [`Error::Unsupported`] at registration, see
//!   [`backend::shm`]); [`MemorySupport`] says per memory kind what works. A cuda-ipc
//!   domain registers GPU memory: [`Domain::register`] allocates it, and
//!   `Domain::register_device` takes the caller's `nvlink_p2p::DeviceBuffer` in place
//!   (see `backend::cuda_ipc`).
//! * **Cargo features.** `verbs` (the verbs backend and `topology`) and `cuda-ipc` (the
//!   cuda-ipc backend and GPU memory registration) are on by default; shm and tcp alone
//!   build with `default-features = false`, without `ibverbs-safe` or `cudarc`.
//! * **One small trait.** [`Transport`] is one connection: register memory (owned
//!   [`Region`]s, handed to operations as owned [`Buf`] slices and returned by their
//!   [`Completion`]), two-sided send/recv, one-sided write/read against a packable
//!   [`RemoteKey`], CAS/FAA atomics, `poll` into a caller slice, a wait fd + `arm` for
//!   sleeping, typed backpressure ([`Error::WouldBlock`]) and [`Capabilities`]. It is object
//!   safe: the examples hold `Box<dyn Transport>`. Listening and connecting are
//!   non-blocking ([`backend::Listener::accept`], [`backend::Connector::poll_connect`]).
//! * **One progress engine for many peers.** A [`Worker`] holds any number of a domain's
//!   connections ([`Worker::add`], [`Worker::accept`], [`Worker::connect`]); one
//!   [`Worker::poll`] serves them all and yields [`Event`]s naming their [`EndpointId`], and
//!   one epoll fd ([`Worker::wait_fd`], [`Worker::arm`], [`Worker::wait`]) wakes the caller.
//!   Idle endpoints are parked on that fd and cost `poll` nothing (see [`worker`]).
//! * **Async (feature `tokio`, off by default).** `async_worker::AsyncWorker` puts a
//!   worker's fd in tokio's reactor (`AsyncFd`) and makes every operation a future that
//!   resolves to its completion and hands the buffer back (`(Result<Done>, Buf)`, the
//!   owned-buffer style of tokio-uring). Clones serve several tasks at once (one per peer)
//!   without a lock of the caller's; dropping a future never frees memory an operation may
//!   still touch (the operation runs on; its buffer is dropped at its completion); a
//!   completion between a poll and the arm is never lost. Without the feature tokio is not
//!   built. See the `async_worker` module (documented when the feature is on).
//! * **Validation once.** [`tracker::Tracker`] is the I/O-free core every backend shares:
//!   ownership, bounds, access and size checks, a pre-allocated in-flight slot table with
//!   generation-checked tokens (safe to send to a peer and get back), bounded queues, and
//!   "fail everything in flight" when a connection dies — each posted buffer comes back
//!   exactly once. Backends (`backend/*.rs`) only move bytes; a new one is a file exporting a
//!   [`backend::BackendEntry`] plus one line in [`backend::BACKENDS`].
//! * **Messaging** (see [`Capabilities`]): tagged sends and receives with a mask, matched
//!   once in the tracker (receives in post order, messages in arrival order) with a bounded
//!   unexpected-message queue; grouped receives (one completion, per-part lengths); write
//!   with immediate data; flush; flags saying whether a too-long message or a refused remote
//!   access kills the connection (verbs RC) or fails only that operation (shm, tcp).
//! * **shm** ([`backend::shm`]): sealed `memfd` channel with two lock-free SPSC
//!   [`ring`]s (the `sync` shim swaps in loom under `--cfg fabric_loom`), fds over
//!   `SCM_RIGHTS` on an abstract Unix socket, peer uid checked; rendezvous (one copy) from
//!   2 KiB; one-sided ops are copies/atomics on the peer's mapping, which a caller may also
//!   hold directly as a [`RemoteWindow`] ([`Transport::map_remote`]: loads and stores into
//!   the peer's region, no operation at all).
//!   **tcp** ([`backend::tcp`]): framed, non-blocking, one-sided ops emulated.
//!   **verbs** (`backend::verbs`, feature `verbs`): RC queue pairs on `ibverbs-safe`.
//! * **Bootstrap** ([`bootstrap`]): versioned, length-limited TCP rendezvous (all-gather of
//!   endpoint blobs among N ranks), launcher detection, optional shared secret, transport
//!   selection, and [`bootstrap::pair`] for two-party runs. Every decoder of peer bytes is a
//!   pure `decode(&[u8]) -> Result<_, DecodeError>` function.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(all(not(fabric_loom), feature = "tokio"))]
pub mod async_worker;
mod copy;
#[cfg(not(fabric_loom))]
pub mod domain;
mod error;
pub mod memory;
pub mod region;
pub mod registry;
pub mod ring;
#[cfg(any(fabric_loom, feature = "tokio"))]
mod spin;
mod sync;
#[cfg(all(not(fabric_loom), feature = "verbs"))]
pub mod topology;
pub mod tracker;
pub mod transport;
pub mod window;
#[cfg(not(fabric_loom))]
pub mod worker;

#[cfg(not(fabric_loom))]
pub mod backend;
#[cfg(not(fabric_loom))]
pub mod bootstrap;
pub mod sys;

#[cfg(not(fabric_loom))]
pub use domain::{Domain, MemorySupport};
pub use error::{DecodeError, Error, Result};
pub use memory::{AlignedBuf, Plain, RegisterError, RegisterMemory};
pub use region::{Access, Buf, LocalMut, LocalRef, Region};
pub use transport::{
    AtomicOp, Capabilities, Completion, GroupPostError, MemoryKinds, MessageOrdering, OpKind,
    PostError, PostResult, RecvPart, RemoteKey, Status, Transport, TransportKind,
};
pub use window::RemoteWindow;
#[cfg(not(fabric_loom))]
pub use worker::{EndpointId, Event, Worker};
