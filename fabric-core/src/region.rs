//! Registered memory: [`Region`] (a whole registration) and [`Buf`] (an owned slice of one,
//! handed to an operation and returned by its completion).
//!
//! Region memory may be written by the peer at any time (one-sided writes, atomics), so it
//! is never exposed as `&[u8]`/`&mut [u8]`: it is read and written by explicit copies
//! ([`Region::read_at`], [`Region::write_at`], [`Buf::copy_from`], [`Buf::copy_to`]) and
//! 8-byte atomics. Concurrent copies into the same bytes (by this process's threads or the
//! peer) leave unspecified bytes there, exactly as a concurrent peer write would; they
//! never touch memory outside the region.
#![allow(unsafe_code)]

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::MmapRaw;

use crate::error::{Error, Result};
use crate::transport::TransportKind;

bitflags::bitflags! {
    /// What a registered region allows.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// Receives and reads may write into it (always granted for local buffers).
        const LOCAL_WRITE = 1;
        /// The peer may write into it (one-sided write).
        const REMOTE_WRITE = 2;
        /// The peer may read it (one-sided read).
        const REMOTE_READ = 4;
        /// The peer may run 8-byte atomics on it.
        const REMOTE_ATOMIC = 8;
    }
}

impl Access {
    /// Any remote access at all.
    pub fn is_remote(self) -> bool {
        self.intersects(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
    }
}

/// Memory the host cannot address directly (GPU memory of the `cuda-ipc` backend): the
/// region's byte copies go through the backend's driver instead of `memcpy`.
#[cfg_attr(fabric_loom, allow(dead_code))]
pub(crate) trait DeviceBacking: Send + Sync + fmt::Debug {
    /// Copies `src` in at `offset` (in bounds: checked by the region).
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies out from `offset` (in bounds: checked by the region).
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Fills `len` bytes at `offset` (in bounds: checked by the region).
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()>;
    /// The device address of the first byte (what a remote key carries as `addr`).
    fn addr(&self) -> u64;
    /// For the backend to get its own type back.
    fn as_any(&self) -> &dyn std::any::Any;
}

pub(crate) struct RegionInner {
    pub(crate) id: u32,
    pub(crate) owner: u64,
    pub(crate) key: u64,
    pub(crate) access: Access,
    pub(crate) transport: TransportKind,
    pub(crate) len: usize,
    /// Shared so a backend's registration (verbs MR) can keep the memory alive too.
    map: Arc<MmapRaw>,
    /// Backend-private state of the registration (the verbs memory region).
    pub(crate) backing: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// Backend key a peer needs (verbs rkey); 0 elsewhere.
    pub(crate) rkey: u32,
    /// The memfd behind a shared mapping (shm); `None` for anonymous memory.
    pub(crate) fd: Option<OwnedFd>,
    /// Device memory (cuda-ipc): then `map` is an unused placeholder page and every byte
    /// access goes through this.
    pub(crate) device: Option<Box<dyn DeviceBacking>>,
}

/// A registration: memory the transport can move bytes from and to, and (with remote
/// access) that the peer can address through its [`RemoteKey`](crate::RemoteKey).
///
/// Cheap to clone (reference counted); the memory lives until the last clone, the last
/// [`Buf`] over it and the connection that registered it are gone.
#[derive(Clone)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("len", &self.inner.len)
            .field("access", &self.inner.access)
            .field("transport", &self.inner.transport)
            .field("fd", &self.inner.fd.as_ref().map(|f| f.as_raw_fd()))
            .finish()
    }
}

impl Region {
    /// Wraps a mapping of at least `len` bytes (backends call this).
    pub(crate) fn new(
        id: u32,
        owner: u64,
        transport: TransportKind,
        access: Access,
        len: usize,
        map: MmapRaw,
        fd: Option<OwnedFd>,
    ) -> Self {
        Self::with_backing(
            id,
            owner,
            transport,
            access,
            len,
            Arc::new(map),
            fd,
            None,
            0,
        )
    }

    /// Like [`new`](Self::new), with a shared mapping, backend state and backend key.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn with_backing(
        id: u32,
        owner: u64,
        transport: TransportKind,
        access: Access,
        len: usize,
        map: Arc<MmapRaw>,
        fd: Option<OwnedFd>,
        backing: Option<Box<dyn std::any::Any + Send + Sync>>,
        rkey: u32,
    ) -> Self {
        debug_assert!(map.len() >= len);
        Region {
            inner: Arc::new(RegionInner {
                id,
                owner,
                key: random_u64(),
                access,
                transport,
                len,
                map,
                backing,
                rkey,
                fd,
                device: None,
            }),
        }
    }

    /// A region over device memory (backends that register GPU memory call this).
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn device(
        id: u32,
        owner: u64,
        transport: TransportKind,
        access: Access,
        len: usize,
        memory: Box<dyn DeviceBacking>,
    ) -> Result<Self> {
        let placeholder = MmapRaw::from(
            memmap2::MmapOptions::new()
                .len(1)
                .map_anon()
                .map_err(|e| Error::io("mmap", e))?,
        );
        Ok(Region {
            inner: Arc::new(RegionInner {
                id,
                owner,
                key: random_u64(),
                access,
                transport,
                len,
                map: Arc::new(placeholder),
                backing: None,
                rkey: 0,
                fd: None,
                device: Some(memory),
            }),
        })
    }

    /// The device memory behind the region, if it is not host memory.
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn device_backing(&self) -> Option<&dyn DeviceBacking> {
        self.inner.device.as_deref()
    }

    /// Anonymous private memory (backends whose peer never maps it). Public so that tests
    /// and fuzz targets can drive a [`Tracker`](crate::tracker::Tracker) directly; a region
    /// only becomes usable on a connection whose id is `owner`.
    ///
    /// # Errors
    /// [`Error::Io`] when the memory cannot be mapped.
    pub fn anonymous(
        id: u32,
        owner: u64,
        transport: TransportKind,
        access: Access,
        len: usize,
    ) -> Result<Self> {
        let map = MmapRaw::from(
            memmap2::MmapOptions::new()
                .len(len.max(1))
                .map_anon()
                .map_err(|e| Error::io("mmap", e))?,
        );
        Ok(Self::new(id, owner, transport, access, len, map, None))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// The access it was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }
    /// Its id on the registering connection.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// The key a peer needs to address this region, or `None` without remote access.
    pub fn remote_key(&self) -> Option<crate::RemoteKey> {
        if !self.inner.access.is_remote() {
            return None;
        }
        Some(crate::RemoteKey {
            transport: self.inner.transport,
            region: self.inner.id,
            access: self.inner.access.bits(),
            len: self.inner.len as u64,
            key: self.inner.key,
            addr: match &self.inner.device {
                Some(d) => d.addr(),
                None => self.base() as u64,
            },
            rkey: self.inner.rkey,
        })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.inner.map.as_mut_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        check_range(offset as u64, len as u64, self.inner.len as u64)
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        if let Some(d) = &self.inner.device {
            return d.write(offset, src);
        }
        // SAFETY: bounds checked above; the mapping lives as long as `self`; `src` cannot
        // overlap the mapping's bytes as a Rust slice (we never hand one out).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        if let Some(d) = &self.inner.device {
            return d.read(offset, dst);
        }
        // SAFETY: as in `write_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base().add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        if let Some(d) = &self.inner.device {
            return d.fill(offset, len, byte);
        }
        // SAFETY: bounds checked; mapping alive.
        unsafe { std::ptr::write_bytes(self.base().add(offset), byte, len) };
        Ok(())
    }

    /// Atomically loads the 8-byte word at `offset` (the target side of remote atomics).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] or [`Error::Unaligned`].
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        Ok(self.atomic_at(offset)?.load(Ordering::SeqCst))
    }

    /// Atomically stores the 8-byte word at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] or [`Error::Unaligned`].
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.atomic_at(offset)?.store(v, Ordering::SeqCst);
        Ok(())
    }

    pub(crate) fn atomic_at(&self, offset: usize) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        if offset % 8 != 0 {
            return Err(Error::Unaligned);
        }
        if self.inner.device.is_some() {
            return Err(Error::Unsupported {
                transport: self.inner.transport,
                what: "host atomics on device memory",
            });
        }
        // SAFETY: in bounds, 8-byte aligned (mappings are page aligned), the memory lives as
        // long as `&self`; all concurrent accesses to atomics words go through AtomicU64.
        Ok(unsafe { AtomicU64::from_ptr(self.base().add(offset) as *mut u64) })
    }

    /// An owned slice `[offset, offset + len)` to hand to an operation.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Buf> {
        self.check(offset, len)?;
        Ok(Buf {
            region: self.clone(),
            offset,
            len,
        })
    }

    /// The whole region as one [`Buf`].
    pub fn full(&self) -> Buf {
        Buf {
            region: self.clone(),
            offset: 0,
            len: self.inner.len,
        }
    }
}

/// Checks `offset + len <= region_len` without overflow.
///
/// # Errors
/// [`Error::OutOfBounds`].
pub fn check_range(offset: u64, len: u64, region_len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            offset,
            len,
            region_len,
        }),
    }
}

/// An owned slice of a [`Region`]: moved into an operation, handed back in its
/// [`Completion`](crate::Completion) (or in the [`PostError`](crate::PostError) when the post
/// was refused). Bounds are checked when it is made.
pub struct Buf {
    region: Region,
    offset: usize,
    len: usize,
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buf")
            .field("region", &self.region.inner.id)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Buf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Offset within its region.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// The region it belongs to.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Shrinks or regrows the slice to `len` bytes from the same start.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if that passes the region's end.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.region.check(self.offset, len)?;
        self.len = len;
        Ok(())
    }

    /// Copies `src` to the start of the slice.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if `src` is longer than the slice.
    pub fn copy_from(&self, src: &[u8]) -> Result<()> {
        check_range(0, src.len() as u64, self.len as u64)?;
        self.region.write_at(self.offset, src)
    }

    /// Copies the start of the slice into `dst`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if `dst` is longer than the slice.
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        check_range(0, dst.len() as u64, self.len as u64)?;
        self.region.read_at(self.offset, dst)
    }

    /// The bytes as a new vector (a copy).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // Cannot fail: the slice's bounds were checked when it was made.
        let _ = self.region.read_at(self.offset, &mut v);
        v
    }

    /// Reads the first 8 bytes as a native-endian `u64` (atomic results).
    pub fn read_u64(&self) -> Option<u64> {
        let mut b = [0u8; 8];
        self.copy_to(&mut b).ok()?;
        Some(u64::from_ne_bytes(b))
    }

    /// Raw pointer to the first byte (valid for `len` bytes while `self` lives).
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        // Host backends only see their own (host) regions: the tracker refuses foreign ones.
        debug_assert!(
            self.region.inner.device.is_none(),
            "host pointer of device memory"
        );
        // SAFETY: offset <= region len (checked at construction), inside the mapping.
        unsafe { self.region.base().add(self.offset) }
    }
}

/// A 64-bit random number from the OS-seeded hasher of `std` (keys, nonces).
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}
