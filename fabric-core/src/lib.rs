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
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod error;
pub mod region;
pub mod ring;
mod sync;
pub mod tracker;
pub mod transport;

#[cfg(not(fabric_loom))]
pub mod backend;
#[cfg(not(fabric_loom))]
pub mod bootstrap;
pub mod sys;

pub use error::{DecodeError, Error, Result};
pub use region::{Access, Buf, Region};
pub use transport::{
    AtomicOp, Capabilities, Completion, MemoryKinds, MessageOrdering, OpKind, PostError,
    PostResult, RemoteKey, Status, Transport, TransportKind,
};
