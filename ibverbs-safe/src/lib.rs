//! Safe, zero-copy wrappers over libibverbs (InfiniBand / RoCE verbs), loaded at run time.
//!
//! * No build-time dependency on rdma-core: `libibverbs.so.1` is opened with `dlopen` on
//!   first use and its entry points are resolved by versioned symbol. Without it you get
//!   [`Error::LibraryUnavailable`] (naming the package to install); without a device,
//!   [`Error::NoDevice`].
//! * The data path (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`) calls the
//!   provider's op table inside the context, exactly like the `static inline` functions of
//!   `verbs.h`, with no allocation, lock or system call of our own.
//! * Safe code cannot make the device touch freed or aliased memory (see [DESIGN](#design)).
//!
//! # Quick start
//!
//! Two RC queue pairs on one device, connected to each other, SEND one message:
//!
//! ```no_run
//! use ibverbs_safe::{Completion, RemoteAccess};
//! use std::time::Duration;
//!
//! # fn main() -> ibverbs_safe::Result<()> {
//! let ctx = ibverbs_safe::open(None)?;            // first device
//! let pd = ctx.alloc_pd()?;
//! let mut cq = ctx.create_cq(64)?;
//! let a = pd.queue_pair(&cq, &cq).gid_index(1).build_rc()?;
//! let mut b = pd.queue_pair(&cq, &cq).gid_index(1).build_rc()?;
//!
//! // Registered memory owns its buffer; work requests take owned handles to ranges of it.
//! let mut tx = pd.alloc_region(4096)?;
//! tx.as_mut_slice()?[..5].copy_from_slice(b"hello");
//! let mut rx = pd.alloc_region(4096)?;
//! b.post_recv(rx.slice(..)?, 1).map_err(|e| e.error)?;
//!
//! // Exchange endpoints out of band (`Endpoint::to_bytes`/`from_bytes`), then connect.
//! let (ea, eb) = (a.endpoint(), b.endpoint());
//! let mut a = a.connect(&eb)?;
//! let _b = b.connect(&ea)?;
//!
//! a.send(tx.slice(..5)?, 2)?;
//! let mut done = Completion::buffer(2);
//! cq.poll_exact(&mut done, 2, Duration::from_secs(5))?;
//! for c in &mut done {
//!     c.result()?;
//!     drop(c.take_buf()); // the handle comes back with the completion
//! }
//! assert_eq!(&rx.as_slice()?[..5], b"hello");     // no handle is out: we may borrow again
//!
//! // A region peers may write is never lent as `&[u8]`/`&mut [u8]`: copy in and out.
//! let shared = pd.register_remote(vec![0u8; 1 << 20], RemoteAccess::WRITE | RemoteAccess::READ)?;
//! let descriptor = shared.remote(); // addr + len + rkey, send it to the peer
//! # let _ = descriptor;
//! let mut first = [0u8; 16];
//! shared.read_into(0, &mut first)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Async completions (feature `tokio`)
//!
//! With the optional `tokio` feature (off by default; without it tokio is not a dependency),
//! `AsyncCompletionQueue` lets a task `.await` completions instead of busy-polling: create
//! one with `Context::create_async_cq` inside a tokio runtime (IO enabled), build queue
//! pairs on its `cq()`, then `next_completion().await`, `next_batch(&mut out).await`, or use
//! it as a `futures_core::Stream` of `Result<Completion>`. Each completion carries its work
//! request's buffers, exactly as [`CompletionQueue::poll`] hands them back.
//!
//! It runs the completion-channel protocol for you: poll; if empty, arm the CQ
//! (`ibv_req_notify_cq`) and **poll again** — a completion that arrived between the empty
//! poll and the arm raises no event, and would otherwise sit unseen — then sleep until the
//! channel's fd (registered with tokio's reactor through `AsyncFd`) is readable, read the
//! events without blocking and acknowledge them in batches. An idle awaiting task costs no
//! CPU. The futures are cancellation-safe: dropping one loses no completion.
//!
//! **Posting while another task awaits** needs no lock: a [`QueuePair`] (the single
//! producer, posting takes `&mut`) and the `AsyncCompletionQueue` (the single consumer)
//! are separate `Send` objects that share no mutable Rust state, so one task (or thread)
//! owns and posts on the QP while another owns the queue and awaits; buffers come back to
//! whoever awaits, in the completions.
//!
//! ```no_run
//! # #[cfg(feature = "tokio")]
//! async fn serve(ctx: ibverbs_safe::Context) -> ibverbs_safe::Result<()> {
//!     let pd = ctx.alloc_pd()?;
//!     let mut cq = ctx.create_async_cq(256)?;
//!     let qp = pd.queue_pair(cq.cq(), cq.cq()).gid_index(1).build_rc()?;
//!     let mut rx = pd.alloc_region(4096)?;
//! #   let peer: ibverbs_safe::Endpoint = qp.endpoint();
//!     let mut qp = qp.connect(&peer)?; // the peer's endpoint, exchanged out of band
//!     qp.post_recv(rx.slice(..)?, 1).map_err(|e| e.error)?;
//!
//!     // One task posts (it owns the QP) ...
//!     let mut tx = pd.alloc_region(64)?;
//!     let hello = tx.slice(..5)?;
//!     hello.write_from(0, b"hello")?;
//!     let poster = tokio::spawn(async move {
//!         qp.send(hello, 2).map_err(|e| e.error)?;
//!         Ok::<_, ibverbs_safe::Error>(qp)
//!     });
//!     // ... while this one awaits the completions (it owns the queue).
//!     for _ in 0..2 {
//!         let mut c = cq.next_completion().await?;
//!         c.result()?;
//!         if let Some(buf) = c.take_buf() {
//!             println!("wr {} done, {} bytes handed back", c.wr_id(), buf.len());
//!         }
//!     }
//!     let _qp = poster.await.expect("poster task")?;
//!     Ok(())
//! }
//! # fn main() {}
//! ```
//!
//! # DESIGN
//!
//! **Layers.** `sys` (private `#[repr(C)]` mirrors of `verbs.h`; 64-bit targets only) →
//! `result` (one thin `unsafe fn` per verb, and the op-table data-path calls) → the safe
//! RAII types, one module per object. `unsafe` is denied at the crate root and allowed only
//! in the modules that wrap FFI objects. The mirrors are proven against the installed header
//! field by field by the dev-only `ffi-check` crate (bindgen: size, alignment, every field's
//! offset, size and type, the op-table signatures, every constant). The small C layout
//! program among this crate's unit tests stays as a second witness: it needs only `cc` and
//! the headers, not libclang, so it still runs where the bindgen check must skip.
//!
//! **Parents outlive children.** Every object holds an `Arc` of its parent: context ← PD ←
//! MR / QP / SRQ / AH; context ← CQ ← QP; channel ← CQ. Destruction order is therefore
//! always legal, whatever order you drop things in. `Drop` never panics; failed destroy
//! calls are counted in [`drop_failures`].
//!
//! **Memory regions own their buffer.** [`ProtectionDomain::register`] takes any
//! [`RegionBuffer`] by value (`Vec<u8>`, `Box<[u8]>`, [`AlignedBuffer`], `memmap2::MmapMut`
//! for page-aligned, huge-page or file-backed memory). The buffer lives inside the region's
//! reference-counted registration and is freed only after `ibv_dereg_mr`;
//! [`MemoryRegion::into_inner`] deregisters and gives it back. If `ibv_dereg_mr` fails the
//! registration is kept (its keys may still work): `into_inner` gives the region back with
//! [`Error::DeregMr`], and a region dropped then leaks its buffer rather than free it.
//!
//! **Device memory (DMA-BUF).** [`ProtectionDomain::register_dmabuf`] registers a DMA-BUF
//! range (e.g. GPU memory) with `ibv_reg_dmabuf_mr` (resolved as optional: without it,
//! [`Error::Unsupported`] names rdma-core 34). The [`DeviceMemoryRegion`] has no CPU
//! accessors — it is not mapped here — and hands out the same [`MrSlice`] handles (addressed
//! in its iova space; their copying accessors refuse device memory) and a [`RemoteMemory`].
//! The `owner` passed at registration (what keeps the device memory allocated) lives in the
//! registration like a host buffer and is dropped only after `ibv_dereg_mr`.
//!
//! **Work requests own handles.** Posting takes [`MrSlice`] handles (an `Arc` of the
//! registration plus a bounds-checked range), never `&[u8]`. The QP keeps them in a
//! pre-allocated in-flight slot table (one slot per queue entry; the slot's address is the
//! verbs `wr_id`). Polling the CQ maps the `wr_id` back to the slot and hands the handles
//! back in the [`Completion`] — success or error, including `WR_FLUSH_ERR` completions after
//! the QP entered the error state, so every posted buffer comes back. Unsignalled work
//! requests are retired (their handles dropped) by the next signalled completion of the
//! same send queue. The ring's tail moves past a completion before the buffers it retires
//! are dropped, so even a panicking drop (a user buffer's, under `catch_unwind`) cannot make
//! a later completion release a newer, running request; the slots after the panicking one
//! are freed and their buffers leaked.
//!
//! **One device context, one PD.** The device resolves handles per context and keys per PD.
//! [`QpBuilder::build`] refuses CQs and an SRQ of another context, and every post refuses
//! buffers registered in another PD and UD address handles of another PD (including scoped
//! posts and receives), with [`Error::ForeignObject`], before the provider sees them. (The
//! per-buffer check runs while more than one PD is alive in the process; with a single PD
//! every buffer is of it, and the hot path pays one load for knowing so.)
//!
//! **Inline data** is copied by the provider's CPU code from the buffer's address during the
//! post, so it is allowed only for SEND/WRITE sources that are all host memory (never a
//! [`DeviceMemoryRegion`]'s iova, never READ or atomic targets) and within the QP's granted
//! `max_inline_data`.
//!
//! **CPU access.** A [`MemoryRegion<B, Local>`] lends `&[u8]`/`&mut [u8]` only while no handle
//! exists (`Arc` uniqueness, checked with Acquire ordering); creating a handle needs
//! `&mut self`, so no borrow can be alive then. A region registered with remote access
//! ([`MemoryRegion<B, Remote>`]) never lends references: peers may write it at any time.
//! It offers copying accessors (`read_into`, `write_from`, `read_u64`, done with atomic
//! loads/stores, never references) and [`MemoryRegion::close_remote_access`], which
//! re-registers it for local use and deregisters the remote registration (after which no
//! peer can reach it; if that deregistration fails, the region stays remote and the error is
//! returned). Handles, too, only copy. Each byte is accessed with one width only, whatever
//! the handle: the bytes of an 8-aligned word wholly inside the region only as that word
//! (8-byte atomics; a copy that covers part of it updates it with a compare-and-swap), the
//! bytes of a word that straddles the region's bounds only with 1-byte atomics — so racing
//! copies and `read_u64`/`write_u64` are never mixed-size atomic accesses.
//!
//! **Scopes borrow instead.** [`QueuePair::scope`] (like `std::thread::scope`) lets work
//! requests borrow registered memory — `&'env MemoryRegion` for SEND/WRITE sources,
//! `&'env mut` for READ targets — with no handle per post. The scope cannot end, not even by
//! a panic, before every work request posted in it completed. It polls the device CQ
//! directly (completions of other work are kept for the next [`CompletionQueue::poll`], and
//! never hide the device from the scope) and checks its deadline every round. If its work
//! does not complete in time, or polling keeps failing until the deadline, the QP is moved to
//! ERR to flush it and the scope waits again; failing even that, the process aborts rather
//! than release memory the device may still use. No path — error, timeout, panic — leaves the
//! scope with work outstanding. The [`Scope`] is only ever lent as `&mut` with invariant
//! lifetimes, so `mem::forget`/`swap` cannot skip the wait.
//!
//! **Forgetting is sound.** `mem::forget` of a handle or region leaks memory (it stays
//! registered); forgetting a QP leaks its in-flight table and so the buffers it holds —
//! never freed while the device may use them.
//!
//! **Dropping a QP with work in flight** moves it to ERR, destroys it (`ibv_destroy_qp`
//! returns only when the device stopped processing it), then releases the buffers of
//! every still-posted work request. It deliberately does not poll the CQ, which may be
//! shared with other QPs whose completions must reach their own owner. If destroy fails,
//! the buffers are leaked instead of freed.
//!
//! **Shared CQs.** Any number of QPs (and SRQs) may report to one CQ. Each CQ keeps the
//! slot table of a queue attached to it until that queue's QP was destroyed *and* a poll
//! that began after the destruction found the CQ empty, so a completion always finds its
//! slot — even a late flushed completion of a QP already dropped (recognised by the slot's
//! state and ignored) — while a server that churns QPs on one long-lived CQ does not grow.
//! (An SRQ's table stays attached to the CQs of its QPs until those CQs are destroyed.) Polling takes
//! `&mut CompletionQueue`, so each CQ has one poller; each completion names its QP
//! ([`Completion::qp_num`]) and queue ([`Completion::queue`]) and carries its own buffers.
//! Send and receive queues complete in order, so their tables are rings; an SRQ's
//! completions come in any order on several CQs, so its table is searched and each slot
//! is claimed with a compare-and-swap.
//!
//! **Typestate setup.** [`QpBuilder`] → [`PreparedQp`] (INIT; has the local [`Endpoint`],
//! may post receives) → [`PreparedQp::connect`] (RC/UC: RTR + RTS from the peer's
//! endpoint) or [`PreparedQp::activate`] (UD) → [`QueuePair`], the only type with send
//! methods. [`Endpoint`] has a fixed 36-byte little-endian encoding with typed decode
//! errors.
//!
//! **Connection manager.** [`cm`] connects RC/UC queue pairs by IP address and port with
//! rdma_cm (`librdmacm.so.1`, loaded at run time like libibverbs): address and route
//! resolution pick the device, port, GID and path; connect / accept carry private data; every
//! step has a timeout; events are an enum and an unexpected one is an error. The QP is built
//! by the caller on the connection's device and comes out as the usual [`QueuePair`].
//!
//! **Raw layer.** [`QueuePair::post_send_raw`]/[`QueuePair::post_recv_raw`] (unsafe, raw
//! [`raw::ibv_send_wr`] chains with odd `wr_id`s, so the safe poller can tell them apart)
//! and [`CompletionQueue::poll_raw`] give experts the bare op-table calls. `poll_raw`
//! handing out a completion of a safe-layer work request releases that request's slot and
//! drops its buffers, so nothing stays in flight. Entry points are resolved by exact symbol
//! version only: a libibverbs that lacks a version is refused, never bound to another
//! version's function.
//!
//! **When the provider itself fails.** `poll_cq` returning an error: [`CompletionQueue::poll`]
//! returns [`Error::PollCq`] and consumes nothing; a scope treats it like a timeout (above).
//! A post the provider rejects hands the buffers back — except from a [`SendBatch`] whose
//! `bad_wr` names none of its requests: then nothing is known about what was posted, and
//! every request is kept as posted (its buffers come back with its completion, its flush,
//! or the QP's destruction) rather than freed. `ibv_destroy_qp`/`ibv_destroy_srq` failing:
//! the buffers of the still-posted work are leaked, never freed. `ibv_dereg_mr` failing:
//! see memory regions above. A drop of a user's buffer that panics while a poll hands out
//! completions propagates, but the completions already taken from the device are kept for
//! the next poll and no slot stays claimed. What the crate cannot check is a provider that
//! writes outside the SGEs it was given or reports a `wr_id` it was never given.
//!
//! Misuse that does not compile:
//!
//! ```compile_fail,E0599
//! // `&mut` access to a region with remote write access:
//! # fn f(mr: &mut ibverbs_safe::MemoryRegion<Vec<u8>, ibverbs_safe::Remote>) {
//! let bytes: &mut [u8] = mr.as_mut_slice().unwrap();
//! # }
//! ```
//!
//! ```compile_fail,E0502
//! // Borrowing the bytes while a handle for a work request is made from the region:
//! # fn f(mr: &mut ibverbs_safe::MemoryRegion, qp: &mut ibverbs_safe::QueuePair<ibverbs_safe::Rc>) {
//! let bytes = mr.as_slice().unwrap();
//! let h = mr.slice(..).unwrap();
//! qp.post_recv(h, 0).unwrap();
//! println!("{}", bytes[0]); // the device may be writing these bytes
//! # }
//! ```
//!
//! ```compile_fail,E0382
//! // Using a handle after it was moved into a posted work request:
//! # fn f(mut mr: ibverbs_safe::MemoryRegion, qp: &mut ibverbs_safe::QueuePair<ibverbs_safe::Rc>) {
//! let h = mr.slice(..).unwrap();
//! qp.post_recv(h, 0).unwrap();
//! h.write_from(0, b"x").unwrap();
//! # }
//! ```
//!
//! ```compile_fail,E0502
//! // Writing into a local region while a borrow of its bytes is alive:
//! # fn f(mr: &mut ibverbs_safe::MemoryRegion) {
//! let bytes = mr.as_slice().unwrap();
//! mr.write_from(0, b"x").unwrap();
//! println!("{}", bytes[0]);
//! # }
//! ```
//!
//! ```compile_fail,E0599
//! // Posting a send on a QP that is not connected yet:
//! # fn f(qp: &mut ibverbs_safe::PreparedQp<ibverbs_safe::Rc>, h: ibverbs_safe::MrSlice) {
//! qp.send(h, 0);
//! # }
//! ```
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Failed posts hand the caller's buffers back inside the error (BufResult style, no
// allocation); that makes some `Err` variants large by design.
#![allow(clippy::result_large_err)]

/// `skip!("capability", "reason {}", x)`: prints `skipped: <reason> [lacks <capability>]` for
/// a test that lacks hardware or tools, straight to the process's stdout (libtest captures
/// `println!` of passing tests, so that would be invisible in `cargo test` output; a direct
/// write to stdout is not captured) — or, where the comma-separated `FABRIC_REQUIRE` names
/// the capability (CI's host stage and the Soft-RoCE guest set it), fails the test instead.
/// Capabilities used in this crate's unit tests: `libibverbs` (the library),
/// `verbs-headers` (infiniband/verbs.h and a C compiler), `libclang`.
#[cfg(test)]
macro_rules! skip {
    ($capability:literal, $($t:tt)*) => {{
        use std::io::Write as _;
        let required = std::env::var("FABRIC_REQUIRE").unwrap_or_default();
        if required.split(',').any(|c| c.trim() == $capability) {
            panic!(
                "this machine must have `{}` (FABRIC_REQUIRE={required}), but {}",
                $capability,
                format_args!($($t)*)
            );
        }
        let _ = writeln!(
            std::io::stdout().lock(),
            "skipped: {} [lacks {}]",
            format_args!($($t)*),
            $capability
        );
    }};
}

mod ah;
#[cfg(feature = "tokio")]
mod async_cq;
mod buffer;
pub mod cm;
mod context;
mod cq;
mod device;
mod dmabuf;
mod error;
#[cfg(test)]
mod fake;
#[cfg(test)]
mod fault_tests;
mod gid;
#[cfg(test)]
mod hotpath_counts;
mod inflight;
mod loader;
mod mr;
mod pd;
mod port;
mod qp;
mod result;
mod srq;
mod sys;

pub use ah::{AddressHandle, AhAttr, GlobalRoute};
#[cfg(feature = "tokio")]
pub use async_cq::{AsyncCompletionQueue, AsyncCqStats, ACK_BATCH};
pub use buffer::{huge_pages, page_aligned, AlignedBuffer, RegionBuffer};
pub use context::{Context, DeviceAttr};
pub use cq::{Completion, CompletionChannel, CompletionQueue, CqEvent, WcOpcode};
pub use device::{devices, open, DeviceInfo};
pub use dmabuf::DeviceMemoryRegion;
pub use error::{Error, Result, WcStatus};
pub use gid::{Gid, GidEntry, GidType};
pub use inflight::{QueueKind, SgList, MAX_SGE};
pub use loader::library_available;
#[doc(hidden)]
pub use mr::deregistrations;
pub use mr::{AccessMode, Local, MemoryRegion, MrSlice, Remote, RemoteAccess, RemoteMemory};
pub use pd::ProtectionDomain;
pub use port::{LinkLayer, LinkSpeed, LinkWidth, Mtu, PortAttr, PortState};
pub use qp::{
    Connected, Endpoint, EndpointDecodeError, PostError, PreparedQp, QpBuilder, QpState, QueuePair,
    Rc, Scope, SendBatch, SendRequest, Transport, Uc, Ud, UdDest, MAX_BATCH,
};
pub use result::drop_failures;
pub use srq::SharedReceiveQueue;

/// Device-free entry points to the host-side checks made before a post, for the fuzz
/// targets in `fuzz/` and tests. Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::inflight::SlotTable;
    pub use crate::qp::{OpClass, SendShape};
    pub use crate::sys::{IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD};

    /// The bounds check of [`MemoryRegion::slice`](crate::MemoryRegion::slice) /
    /// [`MrSlice::slice`](crate::MrSlice::slice) for `start..end` of a region `len` long:
    /// `(offset, length)`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](crate::Error::OutOfBounds).
    pub fn region_range(start: usize, end: usize, len: usize) -> crate::Result<(usize, usize)> {
        crate::mr::range_of(start..end, len)
    }

    /// As [`region_range`], also refusing ranges longer than one scatter/gather element
    /// (the check of `MemoryRegion::slice` and scoped posts).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](crate::Error::OutOfBounds).
    pub fn sge_range(start: usize, end: usize, len: usize) -> crate::Result<(usize, usize)> {
        crate::mr::sge_range(start..end, len)
    }
}

/// The `#[repr(C)]` mirrors of `verbs.h`, for the bindgen layout proof in `ffi-check/`.
/// Not a stable API.
#[doc(hidden)]
pub mod ffi_mirror {
    pub use crate::sys::*;
}

/// The raw `verbs.h` types for the expert layer ([`QueuePair::post_send_raw`],
/// [`QueuePair::post_recv_raw`], [`CompletionQueue::poll_raw`]).
pub mod raw {
    pub use crate::sys::{
        ibv_qp, ibv_recv_wr, ibv_send_wr, ibv_send_wr_atomic, ibv_send_wr_rdma, ibv_send_wr_ud,
        ibv_send_wr_wr, ibv_sge, ibv_wc, IBV_SEND_FENCE, IBV_SEND_INLINE, IBV_SEND_SIGNALED,
        IBV_SEND_SOLICITED, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
        IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND,
        IBV_WR_SEND_WITH_IMM,
    };

    /// A zeroed `ibv_send_wr` to fill in.
    pub fn send_wr() -> ibv_send_wr {
        ibv_send_wr {
            wr_id: 1,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            wr: ibv_send_wr_wr {
                atomic: ibv_send_wr_atomic::default(),
            },
            qp_type_xrc_remote_srqn: 0,
            _bind_mw_tso: [0; 6],
        }
    }
}
