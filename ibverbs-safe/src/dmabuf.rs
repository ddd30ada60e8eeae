//! Memory regions over device memory exported as a DMA-BUF (`ibv_reg_dmabuf_mr`), e.g. GPU
//! memory for GPUDirect RDMA.
//!
//! The CPU has no mapping of such memory, so a [`DeviceMemoryRegion`] has no host accessors:
//! it only hands out [`MrSlice`] handles (for work requests, addressed in the region's I/O
//! virtual address space) and its [`RemoteMemory`] descriptor. It owns an `owner` value —
//! whatever keeps the device memory allocated — and drops it only after `ibv_dereg_mr`, so
//! the device memory outlives the registration.
#![allow(unsafe_code)]

use crate::error::{last_os_error, Error, Result};
use crate::loader::RegDmabufMrFn;
use crate::mr::{range_of, MrInner, MrSlice, RemoteAccess, RemoteMemory};
use crate::pd::ProtectionDomain;
use crate::sys;
use std::cell::UnsafeCell;
use std::ops::RangeBounds;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

/// What `Error::Unsupported` names when `ibv_reg_dmabuf_mr` is missing.
const DMABUF_WHAT: &str = "ibv_reg_dmabuf_mr (DMA-BUF memory registration)";
const DMABUF_NEEDS: &str = "it needs libibverbs from rdma-core 34 or newer \
     (symbol version IBVERBS_1.12); upgrade rdma-core / libibverbs1";

/// The entry point, or the typed error naming the rdma-core version that has it.
pub(crate) fn require_reg_dmabuf_mr(f: Option<RegDmabufMrFn>) -> Result<RegDmabufMrFn> {
    f.ok_or(Error::Unsupported {
        what: DMABUF_WHAT,
        needs: DMABUF_NEEDS,
    })
}

/// Checks a DMA-BUF range before it reaches the verb.
fn check_dmabuf_args(offset: u64, len: usize, iova: u64) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidArgument(
            "cannot register an empty DMA-BUF range".into(),
        ));
    }
    if offset.checked_add(len as u64).is_none() {
        return Err(Error::InvalidArgument(format!(
            "DMA-BUF range {offset}+{len} overflows"
        )));
    }
    if iova.checked_add(len as u64).is_none() {
        return Err(Error::InvalidArgument(format!(
            "iova range {iova:#x}+{len} overflows"
        )));
    }
    Ok(())
}

/// A memory region over device memory (a DMA-BUF), registered with
/// [`ProtectionDomain::register_dmabuf`].
///
/// It has no CPU accessors — the memory is not mapped in this process. Work requests take
/// [`MrSlice`] handles made with [`slice`](Self::slice) (their `addr` is in the region's I/O
/// virtual address space, starting at [`iova`](Self::iova)); peers reach it through
/// [`remote`](Self::remote). Handles copying through the CPU
/// ([`MrSlice::read_into`] and friends) return [`Error::InvalidRequest`].
///
/// The owner given at registration (e.g. the GPU allocation) is dropped only after the
/// registration was deregistered, when the region and every handle are gone.
pub struct DeviceMemoryRegion {
    inner: Arc<MrInner>,
}

impl std::fmt::Debug for DeviceMemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemoryRegion")
            .field("iova", &format_args!("{:#x}", self.iova()))
            .field("len", &self.inner.len)
            .field("lkey", &self.inner.lkey)
            .field("rkey", &self.inner.rkey)
            .field("access", &format_args!("{:#x}", self.inner.access))
            .finish()
    }
}

impl ProtectionDomain {
    /// Registers `len` bytes at `offset` of the DMA-BUF `fd` (device memory, e.g. from
    /// `nvlink-p2p`'s `DmaBuf::into_parts`), addressed by work requests and peers as
    /// `iova..iova+len`, with local write plus `access`. `owner` keeps the device memory
    /// alive: it is dropped only after `ibv_dereg_mr`. The fd may be closed once this
    /// returned (the registration holds its own reference to the DMA-BUF).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when libibverbs predates `ibv_reg_dmabuf_mr` (rdma-core 34);
    /// [`Error::RegDmabufMr`] when the verb fails — `EOPNOTSUPP` (see
    /// [`Error::is_unsupported`]) when the device, provider or kernel cannot register
    /// DMA-BUF memory; [`Error::InvalidArgument`] for an empty or overflowing range. The
    /// owner is dropped on error; [`try_register_dmabuf`](Self::try_register_dmabuf) gives
    /// it back.
    pub fn register_dmabuf<O: Send + Sync + 'static>(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: RemoteAccess,
        owner: O,
    ) -> Result<DeviceMemoryRegion> {
        self.try_register_dmabuf(fd, offset, len, iova, access, owner)
            .map_err(|(e, _)| e)
    }

    /// As [`register_dmabuf`](Self::register_dmabuf), but hands the owner back on failure.
    ///
    /// # Errors
    /// As [`register_dmabuf`](Self::register_dmabuf).
    pub fn try_register_dmabuf<O: Send + Sync + 'static>(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: RemoteAccess,
        owner: O,
    ) -> std::result::Result<DeviceMemoryRegion, (Error, O)> {
        if let Err(e) = check_dmabuf_args(offset, len, iova) {
            return Err((e, owner));
        }
        let reg = match require_reg_dmabuf_mr(self.inner.ctx.inner.v.reg_dmabuf_mr) {
            Ok(f) => f,
            Err(e) => return Err((e, owner)),
        };
        let flags = sys::IBV_ACCESS_LOCAL_WRITE as u32 | access.bits();
        // SAFETY: the PD is live; the kernel validates the fd, offset and length against the
        // DMA-BUF and takes its own reference to it. The memory behind it stays allocated
        // while the registration exists: `owner` is stored in the MrInner and dropped after
        // `ibv_dereg_mr` (MrInner::drop), and the CPU never dereferences `iova`.
        let mr = unsafe {
            reg(
                self.inner.pd,
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                flags as i32,
            )
        };
        if mr.is_null() {
            let e = Error::RegDmabufMr {
                fd: fd.as_raw_fd(),
                offset,
                len,
                iova,
                access: flags,
                source: last_os_error(),
            };
            return Err((e, owner));
        }
        // SAFETY: `mr` is a valid ibv_mr returned just now.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(DeviceMemoryRegion {
            inner: Arc::new(MrInner {
                pd: self.clone(),
                mr,
                addr: iova as *mut u8,
                len,
                lkey,
                rkey,
                access: flags,
                host: false,
                buf: UnsafeCell::new(Some(Box::new(owner))),
            }),
        })
    }
}

impl DeviceMemoryRegion {
    /// I/O virtual address of the first byte (what work requests and peers address).
    pub fn iova(&self) -> u64 {
        self.inner.addr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region is empty (never: empty ranges cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    /// The remote access rights granted.
    pub fn remote_access(&self) -> RemoteAccess {
        RemoteAccess::from_bits_truncate(self.inner.access)
    }
    /// The PD it is registered in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }
    /// How many [`MrSlice`] handles (held by you or by posted work requests) are alive.
    pub fn outstanding(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    /// An owned handle to `range` (byte offsets from [`iova`](Self::iova)) for posting.
    /// Takes `&self`: the CPU never touches the memory, so any number of handles may coexist.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range does not lie in the region or is longer than
    /// `u32::MAX` (the largest scatter/gather element).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        let (off, len) = range_of(range, self.inner.len)?;
        if len > u32::MAX as usize {
            return Err(Error::OutOfBounds {
                offset: off,
                len,
                region_len: u32::MAX as usize,
            });
        }
        Ok(MrSlice {
            owner: self.inner.clone(),
            addr: self.inner.addr as u64 + off as u64,
            len: len as u32,
            lkey: self.inner.lkey,
        })
    }

    /// The remote descriptor (iova, length, rkey) to send to peers; meaningful when the
    /// region was registered with remote access.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.inner.addr as u64,
            len: self.inner.len as u64,
            rkey: self.inner.rkey,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_entry_point_is_unsupported_naming_rdma_core_34() {
        let e = require_reg_dmabuf_mr(None).err().unwrap();
        assert!(e.is_unsupported());
        let msg = e.to_string();
        assert!(msg.contains("ibv_reg_dmabuf_mr"), "{msg}");
        assert!(msg.contains("rdma-core 34"), "{msg}");
        assert!(msg.contains("IBVERBS_1.12"), "{msg}");
    }

    #[test]
    fn dmabuf_ranges_are_checked_before_the_verb() {
        assert!(check_dmabuf_args(0, 4096, 0x1000).is_ok());
        assert!(matches!(
            check_dmabuf_args(0, 0, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            check_dmabuf_args(u64::MAX - 10, 4096, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            check_dmabuf_args(0, 4096, u64::MAX - 10),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn verb_errors_say_when_the_device_cannot_do_dmabuf() {
        let e = Error::RegDmabufMr {
            fd: 3,
            offset: 0,
            len: 4096,
            iova: 0x1000,
            access: 1,
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        };
        assert!(e.is_unsupported());
        let msg = e.to_string();
        assert!(msg.contains("cannot register DMA-BUF memory"), "{msg}");
        let e = Error::RegDmabufMr {
            fd: 3,
            offset: 0,
            len: 4096,
            iova: 0x1000,
            access: 1,
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert!(!e.is_unsupported());
        assert!(
            std::error::Error::source(&e).is_some(),
            "the OS error is the source"
        );
    }
}
