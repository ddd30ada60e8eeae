//! Memory regions that own their buffer, and owned handles to ranges of them.
//!
//! See the crate-level `DESIGN` section for the ownership rules these types enforce.
#![allow(unsafe_code)]

use crate::buffer::{AlignedBuffer, RegionBuffer};
use crate::error::{last_os_error, Error, Result};
use crate::pd::ProtectionDomain;
use crate::result::record_drop_failure;
use crate::sys::{self, ibv_mr};
use std::any::Any;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

bitflags::bitflags! {
    /// Remote access rights of a region (`IBV_ACCESS_REMOTE_*`). Local write access is
    /// always granted (receives, READ results and atomics write local memory).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct RemoteAccess: u32 {
        /// Peers may RDMA WRITE into the region.
        const WRITE = sys::IBV_ACCESS_REMOTE_WRITE as u32;
        /// Peers may RDMA READ from the region.
        const READ = sys::IBV_ACCESS_REMOTE_READ as u32;
        /// Peers may run atomics on the region.
        const ATOMIC = sys::IBV_ACCESS_REMOTE_ATOMIC as u32;
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Typestate of a region's remote access: [`Local`] or [`Remote`].
pub trait AccessMode: sealed::Sealed + Send + Sync + 'static {
    /// Whether this mode has remote access open.
    const IS_REMOTE: bool;
}

/// No remote access: the CPU may borrow the bytes when no work request holds them.
#[derive(Debug)]
pub enum Local {}
/// Remote access open: peers may read/write at any time, so the CPU only copies in and out.
#[derive(Debug)]
pub enum Remote {}
impl sealed::Sealed for Local {}
impl sealed::Sealed for Remote {}
impl AccessMode for Local {
    const IS_REMOTE: bool = false;
}
impl AccessMode for Remote {
    const IS_REMOTE: bool = true;
}

/// A registration and the buffer it owns (type-erased, so handles are one thin `Arc`).
pub(crate) struct MrInner {
    pub(crate) pd: ProtectionDomain,
    pub(crate) mr: *mut ibv_mr,
    /// First byte: a host pointer when `host`, else the device memory's I/O virtual address.
    pub(crate) addr: *mut u8,
    pub(crate) len: usize,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) access: u32,
    /// Whether `addr..addr+len` is host memory the CPU may copy through (false for DMA-BUF
    /// registrations of device memory).
    pub(crate) host: bool,
    /// The buffer (or a device-memory owner): dropped only after `ibv_dereg_mr`.
    pub(crate) buf: UnsafeCell<Option<Box<dyn Any + Send + Sync>>>,
}

static DEREGISTRATIONS: AtomicU64 = AtomicU64::new(0);

/// How many memory regions this process deregistered successfully (for tests that check an
/// owner is released only after its registration).
#[doc(hidden)]
pub fn deregistrations() -> u64 {
    DEREGISTRATIONS.load(Ordering::SeqCst)
}

// SAFETY: `buf` is only touched through `&mut`/unique ownership (`into_inner`) or through
// raw pointers with the rules of the DESIGN section; the verbs pointer is thread-safe.
unsafe impl Send for MrInner {}
// SAFETY: as above: shared access never creates references to `B` or its bytes except via
// `MemoryRegion<_, Local>` methods that prove exclusivity.
unsafe impl Sync for MrInner {}

impl MrInner {
    /// Deregisters (once). On failure the registration is kept (the device may still reach
    /// the memory through its keys), so the caller must neither free nor lend the memory.
    pub(crate) fn dereg(&mut self) -> std::io::Result<()> {
        if self.mr.is_null() {
            return Ok(());
        }
        // SAFETY: `mr` came from ibv_reg_mr/ibv_reg_dmabuf_mr and is deregistered exactly
        // once (nulled only on success); no work request can still use it (each holds an
        // Arc to this struct).
        let rc = unsafe { (self.pd.inner.ctx.inner.v.dereg_mr)(self.mr) };
        if rc != 0 {
            return Err(crate::error::rc_error(rc));
        }
        self.mr = std::ptr::null_mut();
        DEREGISTRATIONS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        // Deregister first: only then may the buffer (or device-memory owner, dropped after
        // this as the `buf` field) be freed. If deregistration failed, the device may still
        // reach the memory: leak it rather than free it.
        if let Err(e) = self.dereg() {
            record_drop_failure("ibv_dereg_mr", e.raw_os_error().unwrap_or(libc::EIO));
            if let Some(b) = self.buf.get_mut().take() {
                std::mem::forget(b);
            }
        }
    }
}

fn register_raw<B: RegionBuffer>(
    pd: &ProtectionDomain,
    buf: B,
    access: u32,
) -> std::result::Result<Arc<MrInner>, (Error, B)> {
    // Box the buffer: its bytes then never move, even for buffers with inline storage.
    let mut boxed = Box::new(buf);
    let (addr, len) = (boxed.as_mut_ptr(), boxed.len());
    if len == 0 {
        return Err((
            Error::InvalidArgument("cannot register an empty buffer".into()),
            *boxed,
        ));
    }
    // SAFETY: `addr..addr+len` is owned by the boxed buffer (RegionBuffer contract), which
    // the registration keeps until `dereg` ran in MrInner::drop.
    let mr = unsafe { (pd.inner.ctx.inner.v.reg_mr)(pd.inner.pd, addr.cast(), len, access as i32) };
    if mr.is_null() {
        return Err((
            Error::RegMr {
                len,
                access,
                source: last_os_error(),
            },
            *boxed,
        ));
    }
    // SAFETY: `mr` is a valid ibv_mr returned just now.
    let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
    Ok(Arc::new(MrInner {
        pd: pd.clone(),
        mr,
        addr,
        len,
        lkey,
        rkey,
        access,
        host: true,
        buf: UnsafeCell::new(Some(boxed)),
    }))
}

/// A registered memory region that owns its buffer `B`.
///
/// * `MemoryRegion<B, Local>` (from [`ProtectionDomain::register`]) grants no remote access;
///   [`as_slice`](Self::as_slice)/[`as_mut_slice`](Self::as_mut_slice) borrow the bytes
///   when no [`MrSlice`] handle (and so no work request) is outstanding.
/// * `MemoryRegion<B, Remote>` (from [`ProtectionDomain::register_remote`]) never lends the
///   bytes to safe code: use the copying accessors or [`close_remote_access`](Self::close_remote_access).
///
/// Work requests take [`MrSlice`] handles made with [`slice`](Self::slice).
pub struct MemoryRegion<B: RegionBuffer = AlignedBuffer, A: AccessMode = Local> {
    inner: Arc<MrInner>,
    _a: PhantomData<(B, A)>,
}

impl<B: RegionBuffer, A: AccessMode> std::fmt::Debug for MemoryRegion<B, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.inner.addr)
            .field("len", &self.inner.len)
            .field("lkey", &self.inner.lkey)
            .field("rkey", &self.inner.rkey)
            .field("access", &format_args!("{:#x}", self.inner.access))
            .finish()
    }
}

impl ProtectionDomain {
    /// Registers `buf` for local access only (`IBV_ACCESS_LOCAL_WRITE`), taking ownership.
    ///
    /// # Errors
    /// [`Error::RegMr`] (`ENOMEM`: the locked-memory limit, see its message);
    /// [`Error::InvalidArgument`] for an empty buffer. The buffer is dropped on error; use
    /// [`try_register`](Self::try_register) to get it back.
    pub fn register<B: RegionBuffer>(&self, buf: B) -> Result<MemoryRegion<B, Local>> {
        self.try_register(buf).map_err(|(e, _)| e)
    }

    /// As [`register`](Self::register), but hands the buffer back on failure.
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub fn try_register<B: RegionBuffer>(
        &self,
        buf: B,
    ) -> std::result::Result<MemoryRegion<B, Local>, (Error, B)> {
        let inner = register_raw(self, buf, sys::IBV_ACCESS_LOCAL_WRITE as u32)?;
        Ok(MemoryRegion {
            inner,
            _a: PhantomData,
        })
    }

    /// Registers `buf` with remote access rights (plus local write), taking ownership.
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub fn register_remote<B: RegionBuffer>(
        &self,
        buf: B,
        access: RemoteAccess,
    ) -> Result<MemoryRegion<B, Remote>> {
        let flags = sys::IBV_ACCESS_LOCAL_WRITE as u32 | access.bits();
        let inner = register_raw(self, buf, flags).map_err(|(e, _)| e)?;
        Ok(MemoryRegion {
            inner,
            _a: PhantomData,
        })
    }

    /// Allocates and registers `len` zeroed, 64-byte aligned bytes for local access.
    ///
    /// # Errors
    /// As [`register`](Self::register) and [`AlignedBuffer::zeroed`].
    pub fn alloc_region(&self, len: usize) -> Result<MemoryRegion<AlignedBuffer, Local>> {
        self.register(AlignedBuffer::new(len)?)
    }
}

pub(crate) fn range_of(r: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds {
            offset: start,
            len: end.saturating_sub(start),
            region_len: len,
        });
    }
    Ok((start, end - start))
}

/// [`range_of`], and the range must fit one scatter/gather element (`u32::MAX` bytes).
#[inline]
pub(crate) fn sge_range(r: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let (off, n) = range_of(r, len)?;
    if n > u32::MAX as usize {
        return Err(Error::OutOfBounds {
            offset: off,
            len: n,
            region_len: u32::MAX as usize,
        });
    }
    Ok((off, n))
}

impl<B: RegionBuffer, A: AccessMode> MemoryRegion<B, A> {
    /// Start address (what a peer uses as `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region is empty (never: empty buffers cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }
    /// Remote key (meaningful for `Remote` regions).
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    /// The PD it is registered in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// How many [`MrSlice`] handles (held by you or by posted work requests) are alive.
    pub fn outstanding(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    /// An owned handle to `range` of the region, for posting.
    ///
    /// Takes `&mut self` so that no borrow from [`as_slice`](MemoryRegion::as_slice) can be
    /// alive while a handle (and so a work request) exists.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range does not lie in the region or is longer than
    /// `u32::MAX` (the largest scatter/gather element).
    pub fn slice(&mut self, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        let (off, len) = sge_range(range, self.inner.len)?;
        Ok(MrSlice {
            owner: self.inner.clone(),
            addr: self.inner.addr as u64 + off as u64,
            len: len as u32,
            lkey: self.inner.lkey,
        })
    }

    /// The registration's PD, for identity checks.
    #[inline]
    pub(crate) fn pd_ptr(&self) -> *const crate::pd::PdInner {
        Arc::as_ptr(&self.inner.pd.inner)
    }

    /// The scatter/gather element of `range` (for scoped, borrowing work requests).
    #[inline]
    pub(crate) fn sge_of(&self, range: impl RangeBounds<usize>) -> Result<sys::ibv_sge> {
        let (off, len) = sge_range(range, self.inner.len)?;
        Ok(sys::ibv_sge {
            addr: self.inner.addr as u64 + off as u64,
            length: len as u32,
            lkey: self.inner.lkey,
        })
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    ///
    /// Safe at any time: the copy goes through raw pointers (never a reference to memory the
    /// device may be writing); bytes a work request or a peer writes concurrently may be
    /// observed torn.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let (off, _) = range_of(offset..offset.saturating_add(dst.len()), self.inner.len)?;
        // SAFETY: the range lies inside the live registration.
        unsafe { copy_out(self.inner.addr, self.inner.len, off, dst) };
        Ok(())
    }

    fn write_from_impl(&self, offset: usize, src: &[u8]) -> Result<()> {
        let (off, _) = range_of(offset..offset.saturating_add(src.len()), self.inner.len)?;
        // SAFETY: the range lies inside the live registration.
        unsafe { copy_in(self.inner.addr, self.inner.len, off, src) };
        Ok(())
    }

    /// Atomically reads the 8-byte word at `offset` (must be 8-aligned; e.g. an atomic target).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::InvalidRequest`] when misaligned.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        range_of(offset..offset.saturating_add(8), self.inner.len)?;
        // SAFETY: in bounds (checked above).
        let p = unsafe { self.inner.addr.add(offset) };
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::InvalidRequest("u64 access must be 8-byte aligned"));
        }
        // SAFETY: aligned, in bounds, and only ever accessed by the CPU through atomics or
        // exclusive borrows (which cannot coexist with `&self` handles).
        Ok(unsafe { a64(p.cast()) }.load(Ordering::Acquire))
    }

    fn write_u64_impl(&self, offset: usize, value: u64) -> Result<()> {
        range_of(offset..offset.saturating_add(8), self.inner.len)?;
        // SAFETY: in bounds (checked above).
        let p = unsafe { self.inner.addr.add(offset) };
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::InvalidRequest("u64 access must be 8-byte aligned"));
        }
        // SAFETY: as in read_u64.
        unsafe { a64(p.cast()) }.store(value, Ordering::Release);
        Ok(())
    }

    /// Deregisters and returns the buffer, when no handle is outstanding.
    ///
    /// # Errors
    /// Gives `self` back with [`Error::RegionBusy`] while [`MrSlice`] handles (or posted
    /// work requests) are alive, or with [`Error::DeregMr`] if `ibv_dereg_mr` fails (the
    /// region stays registered; dropping it tries again, and leaks the buffer rather than
    /// free it if that fails too).
    pub fn into_inner(self) -> std::result::Result<B, (Error, Self)> {
        let n = self.outstanding();
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => {
                if let Err(e) = inner.dereg() {
                    // Still registered: the buffer stays inside, and the region with it.
                    return Err((
                        Error::DeregMr(e),
                        MemoryRegion {
                            inner: Arc::new(inner),
                            _a: PhantomData,
                        },
                    ));
                }
                let b = inner
                    .buf
                    .get_mut()
                    .take()
                    .expect("buffer present until into_inner");
                Ok(*b.downcast::<B>().expect("a MemoryRegion<B> holds a B"))
            }
            Err(inner) => Err((
                Error::RegionBusy(n),
                MemoryRegion {
                    inner,
                    _a: PhantomData,
                },
            )),
        }
    }
}

impl<B: RegionBuffer> MemoryRegion<B, Local> {
    /// Copies `src` into the region at `offset`. Takes `&mut self` on a local region, so no
    /// borrow from [`as_slice`](Self::as_slice) can observe the write.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_from(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.write_from_impl(offset, src)
    }

    /// Atomically writes the 8-byte word at `offset` (must be 8-aligned).
    ///
    /// # Errors
    /// As [`read_u64`](MemoryRegion::read_u64).
    pub fn write_u64(&mut self, offset: usize, value: u64) -> Result<()> {
        self.write_u64_impl(offset, value)
    }

    /// Borrows the bytes.
    ///
    /// # Errors
    /// [`Error::RegionBusy`] while [`MrSlice`] handles exist (a work request may be
    /// writing the memory).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let n = self.outstanding();
        if n != 0 {
            return Err(Error::RegionBusy(n));
        }
        // Acquire: pairs with the Release decrement of the last handle's drop, so the
        // device's writes (observed by the poller before it dropped the handle) are visible.
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: no handle exists and none can be created while `&self` is borrowed
        // (`slice` needs `&mut self`); the region grants no remote access; so neither the
        // device nor another thread can write these bytes while the borrow lives.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.addr, self.inner.len) })
    }

    /// Borrows the bytes mutably.
    ///
    /// # Errors
    /// [`Error::RegionBusy`] while [`MrSlice`] handles exist.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let inner = match Arc::get_mut(&mut self.inner) {
            Some(i) => i,
            None => return Err(Error::RegionBusy(Arc::strong_count(&self.inner) - 1)),
        };
        // SAFETY: `get_mut` proved we hold the only reference (with Acquire ordering), the
        // region is local-only, and `&mut self` keeps it so for the borrow's lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(inner.addr, inner.len) })
    }
}

impl<B: RegionBuffer> MemoryRegion<B, Remote> {
    /// Copies `src` into the region at `offset` (see [`read_into`](MemoryRegion::read_into));
    /// peers may be reading or writing the same bytes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.write_from_impl(offset, src)
    }

    /// Atomically writes the 8-byte word at `offset` (must be 8-aligned; e.g. the initial
    /// value of an atomic target).
    ///
    /// # Errors
    /// As [`read_u64`](MemoryRegion::read_u64).
    pub fn write_u64(&self, offset: usize, value: u64) -> Result<()> {
        self.write_u64_impl(offset, value)
    }

    /// The remote descriptor (address, length, rkey) to send to peers.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.inner.addr as u64,
            len: self.inner.len as u64,
            rkey: self.inner.rkey,
        }
    }

    /// The remote access rights granted.
    pub fn remote_access(&self) -> RemoteAccess {
        RemoteAccess::from_bits_truncate(self.inner.access)
    }

    /// Closes remote access: registers the same memory again for local access only, then
    /// deregisters the remote registration (after which no peer can reach it), giving a
    /// region whose bytes can be borrowed. The rkey stops working; the lkey changes.
    ///
    /// # Errors
    /// Gives `self` back with [`Error::RegionBusy`] while handles are outstanding, with
    /// [`Error::RegMr`] if the new registration fails, or with [`Error::DeregMr`] if the
    /// remote registration cannot be deregistered (the region stays remote: the old rkey
    /// may still work).
    pub fn close_remote_access(
        mut self,
    ) -> std::result::Result<MemoryRegion<B, Local>, (Error, Self)> {
        let n = self.outstanding();
        let Some(inner) = Arc::get_mut(&mut self.inner) else {
            return Err((Error::RegionBusy(n), self));
        };
        let access = sys::IBV_ACCESS_LOCAL_WRITE as u32;
        // SAFETY: the memory is owned by this (unique) region and stays valid until the new
        // registration is deregistered.
        let mr = unsafe {
            (inner.pd.inner.ctx.inner.v.reg_mr)(
                inner.pd.inner.pd,
                inner.addr.cast(),
                inner.len,
                access as i32,
            )
        };
        if mr.is_null() {
            let e = Error::RegMr {
                len: inner.len,
                access,
                source: last_os_error(),
            };
            return Err((e, self));
        }
        if let Err(e) = inner.dereg() {
            // The old rkey may still work: stay remote, and undo the local registration.
            // SAFETY: `mr` was registered just now and nothing uses it.
            let rc = unsafe { (inner.pd.inner.ctx.inner.v.dereg_mr)(mr) };
            if rc != 0 {
                // Leaked: its lkey was never handed out, so no work request can use it.
                record_drop_failure("ibv_dereg_mr", rc);
            }
            return Err((Error::DeregMr(e), self));
        }
        inner.mr = mr;
        inner.access = access;
        // SAFETY: `mr` is a valid ibv_mr returned just now.
        unsafe {
            inner.lkey = (*mr).lkey;
            inner.rkey = (*mr).rkey;
        }
        Ok(MemoryRegion {
            inner: self.inner,
            _a: PhantomData,
        })
    }
}

/// A peer's memory as it described it: address, length and rkey. Plain data: the peer owns
/// the memory; the NIC checks the rkey and bounds (violations complete with
/// [`WcStatus::RemoteAccess`](crate::WcStatus::RemoteAccess)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RemoteMemory {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length of the window.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteMemory {
    /// Encoded size of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 20;

    /// A sub-window `[offset, offset + len)`, checked against this window.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteMemory> {
        match (offset.checked_add(len), self.addr.checked_add(offset)) {
            (Some(end), Some(addr)) if end <= self.len => Ok(RemoteMemory {
                addr,
                len,
                rkey: self.rkey,
            }),
            _ => Err(Error::OutOfBounds {
                offset: offset as usize,
                len: len as usize,
                region_len: self.len as usize,
            }),
        }
    }

    /// Little-endian encoding: addr (8), len (8), rkey (4).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong length or an address range that overflows.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let b: &[u8; Self::ENCODED_LEN] = b.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "remote memory descriptor must be {} bytes, got {}",
                Self::ENCODED_LEN,
                b.len()
            ))
        })?;
        let addr = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(b[16..].try_into().expect("4 bytes"));
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(
                "remote memory range overflows".into(),
            ));
        }
        Ok(RemoteMemory { addr, len, rkey })
    }
}

/// An owned handle to a byte range of a registered region: what work requests take.
///
/// Cloning is cheap (a reference count). The region's memory stays registered and
/// allocated while any handle lives. A handle never lends references to the bytes (the
/// device may be using them); it copies in and out with atomic accesses.
#[derive(Clone)]
pub struct MrSlice {
    pub(crate) owner: Arc<MrInner>,
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
}

impl std::fmt::Debug for MrSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrSlice")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .finish()
    }
}

impl MrSlice {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Local key of the region.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Whether the region it belongs to has remote access open.
    pub fn is_remote(&self) -> bool {
        self.owner.access & !(sys::IBV_ACCESS_LOCAL_WRITE as u32) != 0
    }
    /// The remote descriptor of this range (for a region with remote access).
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr,
            len: self.len as u64,
            rkey: self.owner.rkey,
        }
    }

    /// A handle to a sub-range (relative to this handle).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        let (off, len) = range_of(range, self.len as usize)?;
        Ok(MrSlice {
            addr: self.addr + off as u64,
            len: len as u32,
            ..self.clone()
        })
    }

    #[inline]
    pub(crate) fn sge(&self) -> sys::ibv_sge {
        sys::ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.lkey,
        }
    }

    /// Copies out `dst.len()` bytes at `offset` (see [`MemoryRegion::read_into`]).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.host_mapped()?;
        let (off, _) = range_of(offset..offset.saturating_add(dst.len()), self.len as usize)?;
        // SAFETY: in bounds of a live host registration (kept alive by `owner`).
        unsafe {
            copy_out(
                self.owner.addr,
                self.owner.len,
                self.region_offset() + off,
                dst,
            )
        };
        Ok(())
    }

    /// Copies `src` in at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.host_mapped()?;
        let (off, _) = range_of(offset..offset.saturating_add(src.len()), self.len as usize)?;
        // SAFETY: in bounds of a live host registration (kept alive by `owner`).
        unsafe {
            copy_in(
                self.owner.addr,
                self.owner.len,
                self.region_offset() + off,
                src,
            )
        };
        Ok(())
    }

    /// A copy of the bytes.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for device memory ([`is_host_memory`](Self::is_host_memory)
    /// is false).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        self.host_mapped()?;
        let mut v = vec![0u8; self.len as usize];
        self.read_into(0, &mut v)?;
        Ok(v)
    }

    /// Whether the bytes are host memory the CPU can copy in and out (false for a range of
    /// a [`DeviceMemoryRegion`](crate::DeviceMemoryRegion)).
    pub fn is_host_memory(&self) -> bool {
        self.owner.host
    }

    #[inline]
    fn host_mapped(&self) -> Result<()> {
        if self.owner.host {
            Ok(())
        } else {
            Err(Error::InvalidRequest(
                "device memory (a DMA-BUF registration) has no host mapping to copy through",
            ))
        }
    }

    /// Atomically reads the 8-byte word at `offset` (8-aligned).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::InvalidRequest`] when misaligned.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        self.host_mapped()?;
        range_of(offset..offset.saturating_add(8), self.len as usize)?;
        // SAFETY: in bounds of the live registration (checked above).
        let p = unsafe { self.owner.addr.add(self.region_offset() + offset) }.cast::<u64>();
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::InvalidRequest("u64 access must be 8-byte aligned"));
        }
        // SAFETY: aligned and in bounds of a live registration.
        Ok(unsafe { a64(p) }.load(Ordering::Acquire))
    }

    /// Offset of this handle's first byte in its region.
    #[inline]
    fn region_offset(&self) -> usize {
        (self.addr - self.owner.addr as u64) as usize
    }

    /// Whether `other` is a handle into the same registration.
    pub fn same_region(&self, other: &MrSlice) -> bool {
        Arc::ptr_eq(&self.owner, &other.owner)
    }
}

/// The CPU's access rule for region memory shared with the device and peers: the bytes of
/// an 8-aligned word that lies wholly inside the region are only ever accessed as that word
/// (8-byte atomics: `read_u64`/`write_u64`, and the copies below, which load the word, or
/// store it whole, or update part of it with a compare-and-swap); bytes of a word that
/// straddles the region's start or end only with 1-byte atomics. The choice depends only on
/// the address and the region's bounds, so accesses through any handle of the same region
/// never mix sizes on one byte (racing mixed-size atomics are undefined behaviour in Rust).
#[inline(always)]
fn whole_word(rlen: usize, word_off: isize) -> bool {
    word_off >= 0 && word_off as usize + 8 <= rlen
}

/// Copies `dst.len()` bytes at `off` out of the region `base..base+rlen` (see
/// [`whole_word`] for the access widths). No reference to the shared bytes is ever formed,
/// and concurrent CPU copies are not data races.
///
/// # Safety
/// `base..base+rlen` is a live host registration and `off + dst.len() <= rlen`.
unsafe fn copy_out(base: *mut u8, rlen: usize, off: usize, dst: &mut [u8]) {
    let mis = (base as usize % 8) as isize;
    let end = off + dst.len();
    let mut o = off;
    while o < end {
        // Offset (from `base`) of the 8-aligned word holding byte `o`.
        let w = ((o as isize + mis) & !7) - mis;
        let stop = ((w + 8) as usize).min(end);
        if whole_word(rlen, w) {
            // SAFETY: the word lies inside the registration and is 8-aligned.
            let v = unsafe { a64(base.add(w as usize).cast()) }
                .load(Ordering::Relaxed)
                .to_ne_bytes();
            let i = (o as isize - w) as usize;
            dst[o - off..stop - off].copy_from_slice(&v[i..i + (stop - o)]);
        } else {
            for b in o..stop {
                // SAFETY: in bounds (contract); AtomicU8 has no alignment requirement.
                dst[b - off] = unsafe { a8(base.add(b)) }.load(Ordering::Relaxed);
            }
        }
        o = stop;
    }
    std::sync::atomic::fence(Ordering::Acquire);
}

/// Copies `src` into the region `base..base+rlen` at `off` (see [`copy_out`]).
///
/// # Safety
/// As [`copy_out`].
unsafe fn copy_in(base: *mut u8, rlen: usize, off: usize, src: &[u8]) {
    std::sync::atomic::fence(Ordering::Release);
    let mis = (base as usize % 8) as isize;
    let end = off + src.len();
    let mut o = off;
    while o < end {
        let w = ((o as isize + mis) & !7) - mis;
        let stop = ((w + 8) as usize).min(end);
        let part = &src[o - off..stop - off];
        if whole_word(rlen, w) {
            // SAFETY: the word lies inside the registration and is 8-aligned.
            let word = unsafe { a64(base.add(w as usize).cast()) };
            let i = (o as isize - w) as usize;
            if part.len() == 8 {
                word.store(
                    u64::from_ne_bytes(part.try_into().expect("8 bytes")),
                    Ordering::Relaxed,
                );
            } else {
                // Part of the word: update it whole, keeping the other bytes.
                let mut cur = word.load(Ordering::Relaxed);
                loop {
                    let mut b = cur.to_ne_bytes();
                    b[i..i + part.len()].copy_from_slice(part);
                    match word.compare_exchange_weak(
                        cur,
                        u64::from_ne_bytes(b),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break,
                        Err(now) => cur = now,
                    }
                }
            }
        } else {
            for (k, &x) in part.iter().enumerate() {
                // SAFETY: in bounds (contract).
                unsafe { a8(base.add(o + k)) }.store(x, Ordering::Relaxed);
            }
        }
        o = stop;
    }
}

/// The one way this module makes an 8-byte atomic view of region memory (recorded in tests).
///
/// # Safety
/// As [`AtomicU64::from_ptr`].
#[inline(always)]
unsafe fn a64<'a>(p: *mut u64) -> &'a AtomicU64 {
    #[cfg(test)]
    access_log::note(p as usize, 8);
    // SAFETY: forwarded.
    unsafe { AtomicU64::from_ptr(p) }
}

/// The one way this module makes a 1-byte atomic view of region memory (recorded in tests).
///
/// # Safety
/// As [`AtomicU8::from_ptr`].
#[inline(always)]
unsafe fn a8<'a>(p: *mut u8) -> &'a AtomicU8 {
    #[cfg(test)]
    access_log::note(p as usize, 1);
    // SAFETY: forwarded.
    unsafe { AtomicU8::from_ptr(p) }
}

/// Which widths the CPU used on which addresses (this thread, tests only).
#[cfg(test)]
pub(crate) mod access_log {
    use std::cell::RefCell;
    thread_local!(static LOG: RefCell<Option<Vec<(usize, usize)>>> = const { RefCell::new(None) });
    pub(crate) fn note(addr: usize, width: usize) {
        LOG.with(|l| {
            if let Some(v) = l.borrow_mut().as_mut() {
                v.push((addr, width));
            }
        });
    }
    pub(crate) fn start() {
        LOG.with(|l| *l.borrow_mut() = Some(Vec::new()));
    }
    pub(crate) fn take() -> Vec<(usize, usize)> {
        LOG.with(|l| l.borrow_mut().take().unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert_eq!(range_of(.., 10).unwrap(), (0, 10));
        assert_eq!(range_of(2..5, 10).unwrap(), (2, 3));
        assert_eq!(range_of(2..=5, 10).unwrap(), (2, 4));
        assert_eq!(range_of(10.., 10).unwrap(), (10, 0));
        assert!(matches!(
            range_of(5..11, 10),
            Err(Error::OutOfBounds {
                offset: 5,
                len: 6,
                region_len: 10
            })
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let r = range_of(6..5, 10);
        assert!(r.is_err());
        assert!(range_of(usize::MAX.., 10).is_err());
    }

    #[test]
    fn remote_memory_codec_and_bounds() {
        let r = RemoteMemory {
            addr: 0x1000,
            len: 4096,
            rkey: 0xabcd,
        };
        assert_eq!(RemoteMemory::from_bytes(&r.to_bytes()).unwrap(), r);
        assert!(RemoteMemory::from_bytes(&[0u8; 19]).is_err());
        let mut bad = r.to_bytes();
        bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(RemoteMemory::from_bytes(&bad).is_err());
        assert_eq!(r.slice(4000, 96).unwrap().addr, 0x1000 + 4000);
        assert!(r.slice(4000, 97).is_err());
        assert!(r.slice(u64::MAX, 2).is_err());
        let top = RemoteMemory {
            addr: u64::MAX - 1,
            len: 16,
            rkey: 1,
        };
        assert!(
            top.slice(4, 1).is_err(),
            "address overflow is an error, not a panic"
        );
    }

    #[test]
    fn copies_in_and_out_at_any_alignment() {
        let src: Vec<u8> = (0..37).collect();
        for base in 0..8 {
            // A fresh buffer per base: each base is another region over the memory, and the
            // access width of a byte is fixed per region (8-byte atomics for whole words
            // inside it, 1-byte ones at its edges), so reusing one buffer under regions with
            // other edges would mix widths on the same bytes (Miri rejects that).
            let mut buf = vec![0u8; 64];
            let p = buf.as_mut_ptr();
            // SAFETY: `p + base .. p + 64` lies in `buf`, which nothing else accesses.
            let b = unsafe { p.add(base) };
            let rlen = 64 - base;
            // SAFETY: as above; 3 + 37 <= rlen.
            unsafe { copy_in(b, rlen, 3, &src) };
            let mut out = vec![0u8; 37];
            // SAFETY: as above.
            unsafe { copy_out(b, rlen, 3, &mut out) };
            assert_eq!(out, src);
            // SAFETY: as above.
            unsafe { copy_in(b, rlen, 0, &[0u8; 56]) };
            let mut all = vec![0xffu8; rlen];
            // SAFETY: as above.
            unsafe { copy_out(b, rlen, 0, &mut all) };
            assert_eq!(all, vec![0u8; rlen], "base {base}");
        }
    }
}
