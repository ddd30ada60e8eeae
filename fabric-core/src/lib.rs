//! One small [`Transport`] trait, an out-of-band bootstrap, and the `shm` (default), `tcp`
//! (and, where available, `verbs` / `cuda-ipc`) backends.
//!
//! ```no_run
//! use fabric_core::{backend, Access, Completion, Transport};
//! use std::time::Duration;
//!
//! # fn main() -> fabric_core::Result<()> {
//! let opts = backend::Options::default();
//! // One side listens (the address travels to the peer out of band, e.g. via `bootstrap`)...
//! let mut listener = backend::listen(fabric_core::TransportKind::Shm, &opts)?;
//! println!("peer: connect to {}", listener.address());
//! let mut conn = backend::accept_timeout(listener.as_mut(), Duration::from_secs(30))?;
//! // ...then registers memory and moves bytes; buffers come back in completions.
//! let region = conn.register(4096, Access::empty())?;
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
//! # Ok(())
//! # }
//! ```
//!
//! # Design
//!
//! * **One small trait.** [`Transport`] is one connection: register memory (owned
//!   [`Region`]s, handed to operations as owned [`Buf`] slices and returned by their
//!   [`Completion`]), two-sided send/recv, one-sided write/read against a packable
//!   [`RemoteKey`], CAS/FAA atomics, `poll` into a caller slice, a wait fd + `arm` for
//!   sleeping, typed backpressure ([`Error::WouldBlock`]) and [`Capabilities`]. It is object
//!   safe: the examples hold `Box<dyn Transport>`. Listening and connecting are
//!   non-blocking ([`backend::Listener::accept`], [`backend::Connector::poll_connect`]).
//! * **Validation once.** [`tracker::Tracker`] is the I/O-free core every backend shares:
//!   ownership, bounds, access and size checks, a pre-allocated in-flight slot table with
//!   generation-checked tokens (safe to send to a peer and get back), bounded queues, and
//!   "fail everything in flight" when a connection dies — each posted buffer comes back
//!   exactly once. Backends (`backend/*.rs`) only move bytes; a new one is a file exporting a
//!   [`backend::BackendEntry`] plus one line in [`backend::BACKENDS`].
//! * **shm** ([`backend::shm`]): sealed `memfd` channel with two lock-free SPSC
//!   [`ring`]s (the `sync` shim swaps in loom under `--cfg fabric_loom`), fds over
//!   `SCM_RIGHTS` on an abstract Unix socket, peer uid checked; rendezvous (one copy) from
//!   2 KiB; one-sided ops are copies/atomics on the peer's mapping.
//!   **tcp** ([`backend::tcp`]): framed, non-blocking, one-sided ops emulated.
//!   **verbs** ([`backend::verbs`]): RC queue pairs on `ibverbs-safe`.
//! * **Bootstrap** ([`bootstrap`]): versioned, length-limited TCP rendezvous (all-gather of
//!   endpoint blobs among N ranks), launcher detection, optional shared secret, transport
//!   selection, and [`bootstrap::pair`] for two-party runs. Every decoder of peer bytes is a
//!   pure `decode(&[u8]) -> Result<_, DecodeError>` function.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(not(fabric_loom))]
pub mod domain;
mod error;
pub mod memory;
pub mod region;
pub mod registry;
pub mod ring;
mod sync;
pub mod tracker;
pub mod transport;

#[cfg(not(fabric_loom))]
pub mod backend;
#[cfg(not(fabric_loom))]
pub mod bootstrap;
pub mod sys;

#[cfg(not(fabric_loom))]
pub use domain::{Domain, MemorySupport};
pub use error::{DecodeError, Error, Result};
pub use memory::{AlignedBuf, Plain, RegisterMemory};
pub use region::{Access, Buf, LocalMut, LocalRef, Region};
pub use transport::{
    AtomicOp, Capabilities, Completion, MemoryKinds, MessageOrdering, OpKind, PostError,
    PostResult, RemoteKey, Status, Transport, TransportKind,
};
