//! Exporting device memory as a Linux DMA-BUF fd (`cuMemGetHandleForAddressRange`), the
//! input of `ibv_reg_dmabuf_mr` for GPUDirect RDMA.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::driver::{check, is_refusal, refused};
use crate::error::{DriverVersion, Error, Result};
use crate::memory::{range_ptr, DeviceMemory};

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Aligns `ptr..ptr+len` outwards to `page` and checks it stays inside `base..base+size`.
/// Returns (aligned start, aligned length, offset of `ptr` in it).
pub(crate) fn page_span(
    ptr: u64,
    len: u64,
    base: u64,
    size: u64,
    page: u64,
) -> Result<(u64, u64, u64)> {
    let start = ptr & !(page - 1);
    let end = (ptr + len).div_ceil(page) * page;
    if start < base || end > base + size {
        return Err(Error::InvalidArgument(format!(
            "DMA-BUF export works on whole {page}-byte pages, and the pages around \
             {ptr:#x}+{len} leave the {size}-byte mapping at {base:#x}: allocate a multiple of the page size"
        )));
    }
    Ok((start, end - start, ptr - start))
}

/// A DMA-BUF fd for a range of device memory, with the memory kept alive for as long as
/// this value lives (so a NIC registration that owns it cannot outlive the GPU memory).
///
/// For `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` pass
/// [`offset`](DmaBuf::offset), [`len`](DmaBuf::len), [`device_ptr`](DmaBuf::device_ptr)
/// (or any iova), and [`fd`](DmaBuf::fd).
pub struct DmaBuf {
    fd: OwnedFd,
    offset: u64,
    len: usize,
    device_ptr: u64,
    memory: Arc<dyn DeviceMemory>,
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuf")
            .field("fd", &self.fd)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .finish()
    }
}

impl DmaBuf {
    /// Exports `len` bytes of `memory` from `offset`. The exported fd covers the enclosing
    /// host pages; [`DmaBuf::offset`] is where the range starts inside it.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::DriverTooOld`] / [`Error::MissingSymbol`] before CUDA
    /// 11.7; [`Error::Unsupported`] when the device or kernel cannot export DMA-BUF (needs the
    /// open GPU kernel modules and Linux 5.12+); [`Error::Refused`] (with the driver's code)
    /// when the driver or a sandbox refuses the export although the device attribute claims
    /// support (`CUDA_ERROR_NOT_SUPPORTED`, `_NOT_PERMITTED`, `_OPERATING_SYSTEM`);
    /// [`Error::InvalidArgument`] when the enclosing
    /// pages leave the mapping; [`Error::Driver`].
    pub fn export<M: DeviceMemory + 'static>(
        memory: &Arc<M>,
        offset: usize,
        len: usize,
    ) -> Result<DmaBuf> {
        if len == 0 {
            return Err(Error::InvalidArgument("DMA-BUF of zero bytes".into()));
        }
        let ptr = range_ptr(&**memory, offset, len)?;
        let device = memory.device();
        device.cuda().require(
            "DMA-BUF export",
            DriverVersion::DMA_BUF,
            "cuMemGetHandleForAddressRange",
        )?;
        if device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 0 {
            return Err(Error::Unsupported {
                feature: "DMA-BUF export",
                reason: format!(
                    "device {} reports no DMA-BUF support (needs the open NVIDIA kernel modules and Linux 5.12+)",
                    device.ordinal()
                ),
            });
        }
        let (start, span, inner) = page_span(
            ptr,
            len as u64,
            memory.device_ptr(),
            memory.len() as u64,
            page_size(),
        )?;
        let _ctx = device.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: for DMA_BUF_FD the driver writes one int through the pointer; the range is
        // page aligned and inside a live mapping (checked above).
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut libc::c_int).cast::<c_void>(),
                start,
                span as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        // The device attribute can say yes while the platform or a sandbox in front of the
        // driver still refuses the export: that is "not here", with the driver's code.
        if is_refusal(r) {
            return Err(refused(
                "DMA-BUF export",
                "cuMemGetHandleForAddressRange",
                r,
            ));
        }
        check("cuMemGetHandleForAddressRange", r)?;
        // SAFETY: the driver returned a new fd that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf {
            fd,
            offset: inner,
            len,
            device_ptr: ptr,
            memory: memory.clone(),
        })
    }

    /// The DMA-BUF fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Offset of the exported range inside the DMA-BUF.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the exported range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the first exported byte (a natural iova for the NIC).
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// The memory kept alive.
    pub fn memory(&self) -> &Arc<dyn DeviceMemory> {
        &self.memory
    }

    /// Splits into `(fd, offset, len, device_ptr, memory)`: what a NIC registration needs,
    /// and the owner it must keep until it is deregistered (the fd may be closed once
    /// `ibv_reg_dmabuf_mr` returned; the GPU memory may not be freed before the MR is gone).
    pub fn into_parts(self) -> (OwnedFd, u64, usize, u64, Arc<dyn DeviceMemory>) {
        (self.fd, self.offset, self.len, self.device_ptr, self.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_span_rounds_outwards_and_stays_inside() {
        let base = 0x7000_0000_0000;
        assert_eq!(
            page_span(base, 4096, base, 8192, 4096).unwrap(),
            (base, 4096, 0)
        );
        assert_eq!(
            page_span(base + 100, 10, base, 8192, 4096).unwrap(),
            (base, 4096, 100)
        );
        assert_eq!(
            page_span(base + 4000, 200, base, 8192, 4096).unwrap(),
            (base, 8192, 4000)
        );
        let e = page_span(base + 8000, 100, base, 8100, 4096).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("whole 4096-byte pages")),
            "{e}"
        );
    }
}
