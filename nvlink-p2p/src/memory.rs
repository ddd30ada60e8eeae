//! Device memory: the [`DeviceMemory`] trait shared by every kind of GPU memory this crate
//! hands out, and [`DeviceBuffer`], a `cuMemAlloc` allocation.
//!
//! Device memory is not Rust memory: no `&[u8]`/`&mut [u8]` to it is ever created, so a
//! GPU, a peer process or a NIC writing it cannot break Rust's aliasing rules. Reads and
//! writes from the host go through explicit copies; device-side copies that run
//! asynchronously own `Arc`s of their source and destination until they complete
//! ([`copy_async`](crate::copy_async)), so safe code cannot free memory a copy still uses.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::driver::{check, Device};
use crate::error::{Error, Result};

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// GPU memory this crate owns or maps: a [`DeviceBuffer`], an [`IpcMapping`](crate::IpcMapping),
/// a [`VmmMapping`](crate::VmmMapping). Sealed: the pointer/length pair is a promise that the
/// range stays mapped for as long as the value lives.
pub trait DeviceMemory: Sealed + Send + Sync + fmt::Debug {
    /// The device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// The size in bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty (never, for this crate's types).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device (and context) the memory belongs to.
    fn device(&self) -> &Device;
}

/// Checks `offset..offset+len` against `mem` and returns the device address of `offset`.
pub(crate) fn range_ptr(mem: &dyn DeviceMemory, offset: usize, len: usize) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= mem.len() => Ok(mem.device_ptr() + offset as u64),
        _ => Err(Error::OutOfBounds {
            offset,
            len,
            size: mem.len(),
        }),
    }
}

/// Copies `src` from host memory into `dst` at `offset`, and returns only once the bytes are
/// in device memory.
///
/// `cuMemcpyHtoD` from pageable memory returns as soon as the bytes are staged for DMA; the
/// transfer then finishes on the legacy default stream, which this crate's non-blocking
/// streams (and other processes) are not ordered after. So the copy is followed by a
/// synchronization of that stream: a copy on another stream, or a peer process reading the
/// memory through IPC, sees the new bytes.
///
/// # Errors
/// [`Error::OutOfBounds`], [`Error::Driver`].
pub fn copy_from_host(dst: &dyn DeviceMemory, offset: usize, src: &[u8]) -> Result<()> {
    let ptr = range_ptr(dst, offset, src.len())?;
    if src.is_empty() {
        return Ok(());
    }
    let _ctx = dst.device().bind()?;
    // SAFETY: `ptr..ptr+len` is inside a live mapping (range checked, `dst` borrowed);
    // `src` is a valid host slice for the whole synchronous call.
    check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), src.len())
    })?;
    // SAFETY: the null stream is the legacy default stream of the current context, on which
    // the staged copy above completes; synchronizing it has no other effect.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}

/// Copies from `src` at `offset` into host memory `dst` (synchronous).
///
/// # Errors
/// [`Error::OutOfBounds`], [`Error::Driver`].
pub fn copy_to_host(src: &dyn DeviceMemory, offset: usize, dst: &mut [u8]) -> Result<()> {
    let ptr = range_ptr(src, offset, dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    let _ctx = src.device().bind()?;
    // SAFETY: the device range is live and in bounds; `dst` is a valid, exclusively borrowed
    // host slice for the whole synchronous call.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, dst.len())
    })?;
    Ok(())
}

/// Fills `len` bytes of `mem` from `offset` with `value` and waits for it.
///
/// # Errors
/// [`Error::OutOfBounds`], [`Error::Driver`].
pub fn fill(mem: &dyn DeviceMemory, offset: usize, len: usize, value: u8) -> Result<()> {
    let ptr = range_ptr(mem, offset, len)?;
    let _ctx = mem.device().bind()?;
    // SAFETY: the device range is live and in bounds.
    check("cuMemsetD8_v2", unsafe {
        sys::cuMemsetD8_v2(ptr, value, len)
    })?;
    // SAFETY: no arguments; the context is current.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// A device allocation made with `cuMemAlloc`, freed on drop.
///
/// Legacy IPC can export it ([`DeviceBuffer::ipc_handle`]), and DMA-BUF can export ranges of
/// it ([`DmaBuf::export`](crate::DmaBuf::export)). Share it between copies with `Arc`.
pub struct DeviceBuffer {
    device: Device,
    ptr: u64,
    len: usize,
    /// The allocation id its IPC handles carry.
    pub(crate) id: u64,
    /// Whether an IPC handle was exported (so the export registry is told on drop).
    pub(crate) exported: AtomicBool,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes (contents undefined) on `device`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Driver`] (e.g.
    /// `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a device allocation needs at least one byte".into(),
            ));
        }
        let _ctx = device.bind()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the device's context is current.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len)
        })?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
            id: crate::ipc::next_allocation_id(),
            exported: AtomicBool::new(false),
        })
    }

    /// Copies host bytes in at `offset`.
    ///
    /// # Errors
    /// As [`copy_from_host`].
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        copy_from_host(self, offset, src)
    }

    /// Copies bytes out from `offset`.
    ///
    /// # Errors
    /// As [`copy_to_host`].
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        copy_to_host(self, offset, dst)
    }

    /// Reads the whole buffer into a new vector.
    ///
    /// # Errors
    /// As [`copy_to_host`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// The context this buffer was allocated in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.device.context()
    }
}

impl Sealed for DeviceBuffer {}
impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Async copies hold an Arc of the buffer until they complete, so nothing of ours
        // uses it now. Errors cannot be reported from drop. Binding does not consult cudarc's
        // recorded (sticky) error, so an unrelated earlier failure does not leak the memory.
        if *self.exported.get_mut() {
            crate::ipc::forget_export(self.id);
        }
        if let Ok(_ctx) = self.device.bind() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed exactly once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
