//! Safe CUDA peer access, IPC and VMM shareable handles, and DMA-BUF export, on `cudarc`.
//!
//! Inside a node, GPUs talk over NVLink/NVSwitch (or PCIe) through CUDA peer access and IPC.
//! This crate wraps those driver calls — which `cudarc` exposes only as raw `sys` bindings —
//! in types that cannot free memory under the GPU, and it builds and runs anywhere: the
//! driver library is loaded at run time, and a missing driver or GPU is a typed error.
//!
//! | piece | types |
//! | --- | --- |
//! | loading, devices, topology | [`Cuda`], [`Device`], [`Topology`] |
//! | memory, streams, copies | [`DeviceBuffer`], [`DeviceMemory`], [`Stream`], [`copy_async`], [`PendingCopy`] |
//! | peer access | [`PeerAccess`] (a guard) |
//! | legacy IPC | [`IpcMemHandle`], [`IpcMapping`] (cached), [`IpcEvent`], [`IpcEventHandle`] |
//! | VMM | [`VmmAllocation`], [`VmmMapping`], [`VmmDescriptor`], [`FabricHandle`] |
//! | DMA-BUF | [`DmaBuf`] |
//! | fd passing | [`fd_passing`] (`SCM_RIGHTS`, `SO_PEERCRED`, `pidfd_getfd`) |
//!
//! # Quick start
//!
//! ```no_run
//! use std::sync::Arc;
//! use nvlink_p2p::{copy_async, Cuda, Error, IpcMemHandle};
//!
//! # fn main() -> Result<(), Error> {
//! let cuda = match Cuda::init() {
//!     Ok(cuda) => cuda,
//!     Err(e @ (Error::DriverUnavailable { .. } | Error::NoDevice)) => {
//!         eprintln!("no GPU here: {e}");
//!         return Ok(());
//!     }
//!     Err(e) => return Err(e),
//! };
//! let gpu = cuda.device(0)?;
//! let buf = Arc::new(gpu.alloc(1 << 20)?);
//! buf.write(0, b"hello")?;
//!
//! // Another process: decode the bytes and map the memory (opening twice is free).
//! let bytes = buf.ipc_handle()?.encode();
//! let handle = IpcMemHandle::decode(&bytes)?;
//! # let other_process_gpu = gpu.clone();
//! let mapping = Arc::new(handle.open(&other_process_gpu)?);
//! let local = Arc::new(other_process_gpu.alloc(1 << 20)?);
//! let stream = other_process_gpu.new_stream()?;
//! copy_async(&stream, &local, 0, &mapping, 0, 1 << 20)?.wait()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Safety model
//!
//! - Device memory is never exposed as a Rust slice; host access is by explicit copies.
//! - Asynchronous copies own `Arc`s of both ends until their completion event fires
//!   ([`PendingCopy`]); `mem::forget` only leaks them.
//! - Mappings of another process's memory close the handle on drop, never free it.
//! - cudarc would panic on a missing driver library or symbol: [`Cuda::init`] probes the
//!   library and base symbols first, and newer entry points are checked with
//!   [`Cuda::require`] (driver version and symbol) before they are called.
//! - What no type can enforce across processes: an exporter must keep memory alive until
//!   its importers are done with it. Say so in your protocol (the examples do).
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod cache;
mod dmabuf;
mod driver;
mod error;
pub mod fd_passing;
pub mod handle;
mod ipc;
mod memory;
mod peer;
mod stream;
mod topology;
mod vmm;

pub use cache::CacheStats;
pub use cudarc;
pub use dmabuf::DmaBuf;
pub use driver::{device_count_check, probe_library, required_driver_symbols, Cuda, Device};
pub use error::{DriverVersion, Error, Result};
pub use handle::{
    DecodeError, FabricHandle, IpcEventHandle, IpcMemHandle, ShareableHandleType, VmmDescriptor,
};
pub use ipc::{ipc_cache_stats, ipc_handle_of_cudarc_slice, IpcEvent, IpcMapping};
pub use memory::{copy_from_host, copy_to_host, fill, DeviceBuffer, DeviceMemory};
pub use peer::PeerAccess;
pub use stream::{copy, copy_async, PendingCopy, Stream};
pub use topology::{DeviceInfo, LinkKind, PeerLink, Topology};
pub use vmm::{fabric_support, granularity, VmmAllocation, VmmMapping};
