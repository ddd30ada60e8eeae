//! Registered memory: [`Region`] (a whole registration) and [`Buf`] (an owned slice of one,
//! handed to an operation and returned by its completion).
//!
//! Memory a peer may write (one-sided writes, atomics) is never exposed as
//! `&[u8]`/`&mut [u8]`: it is read and written by explicit copies ([`Region::read_at`],
//! [`Region::write_at`], [`Buf::copy_from`], [`Buf::copy_to`]) and 8-byte atomics.
//! Concurrent copies into the same bytes (by this process's threads or the peer) leave
//! unspecified bytes there, exactly as a concurrent peer write would; they never touch
//! memory outside the region. A region no peer may write ([`Region::is_lendable`]) lends
//! its bytes without a copy ([`Region::bytes`], [`Region::bytes_mut`]); it counts its
//! slices and copies, so a borrow and an operation (or a copy) never overlap: whichever
//! comes second gets [`Error::Busy`].
#![allow(unsafe_code)]

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
#[cfg_attr(any(fabric_loom, not(feature = "cuda-ipc")), allow(dead_code))]
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

/// What keeps a region's bytes alive: memory fabric-core mapped itself, or the caller's.
pub(crate) enum Memory {
    /// A mapping this crate made (shared so a backend registration can hold it too).
    Mapped(Arc<MmapRaw>),
    /// The caller's memory: `ptr`/`len` stay valid while `_keep` lives (see
    /// [`RegisterMemory`]). (Only `Domain` makes it: not in loom builds.)
    #[cfg_attr(fabric_loom, allow(dead_code))]
    Caller {
        ptr: *mut u8,
        len: usize,
        keep: Option<Box<dyn std::any::Any + Send + Sync>>,
    },
    /// Device memory: a 1-byte placeholder; every byte access goes through
    /// [`RegionInner::device`].
    #[cfg_attr(any(fabric_loom, not(feature = "cuda-ipc")), allow(dead_code))]
    Placeholder(MmapRaw),
}

// SAFETY: `Caller` memory is owned by a `Send + Sync` keep-alive (checked by the
// registration functions' bounds); the pointer is only dereferenced under the region's
// bounds checks, like the mapped variants.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    fn ptr(&self) -> *mut u8 {
        match self {
            Memory::Mapped(m) => m.as_mut_ptr(),
            Memory::Caller { ptr, .. } => *ptr,
            Memory::Placeholder(m) => m.as_mut_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            Memory::Mapped(m) => m.len(),
            Memory::Caller { len, .. } => *len,
            Memory::Placeholder(m) => m.len(),
        }
    }
}

/// Who hears that a region is gone (its domain: the registry slot is freed with a new
/// generation, peers are told).
pub(crate) trait Revoke: Send + Sync {
    fn revoke(&self, id: u32, gen: u32);
}

pub(crate) struct RegionInner {
    pub(crate) id: u32,
    /// Generation of the id (the registry slot's); keys carry it.
    pub(crate) gen: u32,
    /// The domain it belongs to.
    pub(crate) owner: u64,
    pub(crate) key: u64,
    pub(crate) access: Access,
    pub(crate) transport: TransportKind,
    pub(crate) len: usize,
    /// Told when the region is dropped (before the backend registration and the memory go).
    pub(crate) revoke: Option<Arc<dyn Revoke>>,
    /// Backend-private state of the registration (the verbs memory region). Declared
    /// before `mem`: the registration is released before the memory it covers.
    pub(crate) backing: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// Backend key a peer needs (verbs rkey); 0 elsewhere.
    pub(crate) rkey: u32,
    /// The device's address of byte 0 and local key (verbs; see `Registered::local`).
    pub(crate) local: Option<(u64, u32)>,
    /// The memfd behind a shared mapping (shm); `None` for anonymous or caller memory.
    pub(crate) fd: Option<Arc<OwnedFd>>,
    /// Device memory (cuda-ipc): then `mem` is a placeholder page and every byte access
    /// goes through this.
    pub(crate) device: Option<Box<dyn DeviceBacking>>,
    /// Local-borrow bookkeeping (see [`Lend`]).
    lend: Lend,
    /// Receives copy into it with non-temporal stores ([`Region::set_streaming`]).
    streaming: AtomicBool,
    mem: Memory,
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if let Some(r) = self.revoke.take() {
            r.revoke(self.id, self.gen);
        }
    }
}

/// A registration: memory the transport can move bytes from and to, and (with remote
/// access) that the peer can address through its [`RemoteKey`](crate::RemoteKey).
///
/// Cheap to clone (reference counted). When the last clone and the last [`Buf`] over it
/// are gone, the region is deregistered: its id is freed (reused later with a new
/// generation), peers holding its key get [`Status::RemoteAccess`](crate::Status) for
/// later operations, and the memory (the caller's, if it was registered with
/// [`Domain::register_memory`](crate::Domain::register_memory)) is released.
#[derive(Clone)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("gen", &self.inner.gen)
            .field("len", &self.inner.len)
            .field("access", &self.inner.access)
            .field("transport", &self.inner.transport)
            .field("fd", &self.inner.fd.as_ref().map(|f| f.as_raw_fd()))
            .finish()
    }
}

/// The parts a backend assembles a region from.
pub(crate) struct Parts {
    pub(crate) id: u32,
    pub(crate) gen: u32,
    pub(crate) owner: u64,
    pub(crate) key: u64,
    pub(crate) transport: TransportKind,
    pub(crate) access: Access,
    pub(crate) len: usize,
    pub(crate) mem: Memory,
    pub(crate) fd: Option<Arc<OwnedFd>>,
    pub(crate) backing: Option<Box<dyn std::any::Any + Send + Sync>>,
    pub(crate) rkey: u32,
    pub(crate) local: Option<(u64, u32)>,
    pub(crate) revoke: Option<Arc<dyn Revoke>>,
    /// Device memory (then `mem` is a placeholder).
    pub(crate) device: Option<Box<dyn DeviceBacking>>,
}

impl Region {
    pub(crate) fn from_parts(p: Parts) -> Self {
        debug_assert!(p.device.is_some() || p.mem.len() >= p.len);
        Region {
            inner: Arc::new(RegionInner {
                id: p.id,
                gen: p.gen,
                owner: p.owner,
                key: p.key,
                access: p.access,
                transport: p.transport,
                len: p.len,
                revoke: p.revoke,
                backing: p.backing,
                rkey: p.rkey,
                local: p.local,
                fd: p.fd,
                device: p.device,
                lend: Lend::new(),
                streaming: AtomicBool::new(false),
                mem: p.mem,
            }),
        }
    }

    /// The device memory behind the region, if it is not host memory.
    #[cfg_attr(any(fabric_loom, not(feature = "cuda-ipc")), allow(dead_code))]
    pub(crate) fn device_backing(&self) -> Option<&dyn DeviceBacking> {
        self.inner.device.as_deref()
    }

    /// Anonymous private memory, outside any domain's registry. Public so that tests and
    /// fuzz targets can drive a [`Tracker`](crate::tracker::Tracker) directly; a region
    /// only becomes usable on a connection whose owner id is `owner`.
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
        let map = anon_map(len)?;
        Ok(Self::from_parts(Parts {
            id,
            gen: 0,
            owner,
            key: random_u64(),
            transport,
            access,
            len,
            mem: Memory::Mapped(Arc::new(map)),
            fd: None,
            backing: None,
            rkey: 0,
            local: None,
            revoke: None,
            device: None,
        }))
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
    /// Its id in its domain's registry (reused after the region is dropped).
    pub fn id(&self) -> u32 {
        self.inner.id
    }
    /// The generation of its id: a key of an earlier region with the same id is refused.
    pub fn generation(&self) -> u32 {
        self.inner.gen
    }
    /// Whether the bytes are the caller's (registered with
    /// [`Domain::register_memory`](crate::Domain::register_memory) or
    /// [`Domain::register_raw`](crate::Domain::register_raw)) rather than allocated by
    /// fabric-core.
    pub fn is_caller_memory(&self) -> bool {
        matches!(self.inner.mem, Memory::Caller { .. })
    }

    /// Messages shorter than this are copied with ordinary stores even into a streaming
    /// region ([`set_streaming`](Self::set_streaming)).
    pub const STREAMING_MIN_BYTES: usize = crate::copy::STREAMING_MIN_BYTES;

    /// Says whether what the transport copies into this region *streams*: data the
    /// application will not read again soon, spread over more buffers than the cache holds
    /// (a pool of receive buffers cycled through, a KV-cache block store). Then messages of
    /// at least [`STREAMING_MIN_BYTES`](Self::STREAMING_MIN_BYTES) are copied in with
    /// non-temporal stores, which do not read the destination first and leave the cache to
    /// the rest of the program: up to twice `memcpy`'s speed into memory that is not cached
    /// (BENCHMARKS.md). Into a buffer that is read right away or reused (a staging buffer),
    /// they run at about half of a cached `memcpy`, and into a set of buffers the cache
    /// still holds they lose too (16 × 1 MiB on a host with a 32 MiB L3: 0.87–0.95 ×
    /// `memcpy` streaming, 1.21–1.29 × without): leave the hint off there (the default).
    ///
    /// Honoured where the CPU makes the copy on the receiver: **shm** receives (eager and
    /// rendezvous) and shm one-sided reads into this region. Elsewhere the bytes are not
    /// the receiving CPU's stores (tcp: the kernel's copy out of the socket; verbs: the
    /// NIC's DMA) and the hint changes nothing; nor does it for a message that arrived
    /// before its receive was posted (it waits in the unexpected queue and is copied from
    /// there with ordinary stores). It can be changed at any time: a message copied in
    /// pieces may then switch between the two kinds of stores, and lands whole either way.
    /// The data is complete and visible to every thread when its completion is reported,
    /// as with ordinary copies (the streaming copy ends with a store fence).
    pub fn set_streaming(&self, on: bool) {
        self.inner.streaming.store(on, Ordering::Relaxed);
    }

    /// Whether receives stream into this region ([`set_streaming`](Self::set_streaming)).
    pub fn is_streaming(&self) -> bool {
        self.inner.streaming.load(Ordering::Relaxed)
    }

    /// Whether a copy of a `msg_len`-byte message into this region streams.
    #[cfg_attr(fabric_loom, allow(dead_code))]
    #[inline]
    pub(crate) fn streams(&self, msg_len: usize) -> bool {
        msg_len >= Self::STREAMING_MIN_BYTES && self.is_streaming()
    }

    /// The key a peer needs to address this region, or `None` without remote access.
    pub fn remote_key(&self) -> Option<crate::RemoteKey> {
        if !self.inner.access.is_remote() {
            return None;
        }
        Some(crate::RemoteKey {
            transport: self.inner.transport,
            region: self.inner.id,
            gen: self.inner.gen,
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
        self.inner.mem.ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        check_range(offset as u64, len as u64, self.inner.len as u64)
    }

    /// Whether local borrows are possible: no peer may write the memory and it is host
    /// memory. Such regions count their slices and copies so that a borrow never aliases
    /// an operation's writes.
    pub fn is_lendable(&self) -> bool {
        self.inner.device.is_none()
            && !self
                .inner
                .access
                .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
    }

    /// Counts a slice or a copy (lendable regions only).
    fn use_begin(&self) -> Result<()> {
        if self.is_lendable() {
            self.inner.lend.use_begin()?;
        }
        Ok(())
    }

    fn use_end(&self) {
        if self.is_lendable() {
            self.inner.lend.use_end();
        }
    }

    /// Borrows the bytes for reading, without a copy.
    ///
    /// Only for regions no peer may write ([`is_lendable`](Self::is_lendable)); while the
    /// guard lives, [`slice`](Self::slice), [`full`](Self::full)-made slices' copies and
    /// this region's copies return [`Error::Busy`], and `bytes_mut` is refused.
    ///
    /// # Errors
    /// [`Error::AccessDenied`] for remotely writable or device memory; [`Error::Busy`]
    /// while a slice is held by an operation (or exists), a copy runs or a mutable borrow
    /// is out.
    pub fn bytes(&self) -> Result<LocalRef<'_>> {
        if !self.is_lendable() {
            return Err(Error::AccessDenied(
                "local borrows (the region is remotely writable or device memory)",
            ));
        }
        self.inner.lend.shared_begin()?;
        Ok(LocalRef { region: self })
    }

    /// Borrows the bytes for writing, without a copy (e.g. to serialise a message in
    /// place before sending it).
    ///
    /// # Errors
    /// As [`bytes`](Self::bytes), and [`Error::Busy`] while any other borrow is out.
    pub fn bytes_mut(&self) -> Result<LocalMut<'_>> {
        if !self.is_lendable() {
            return Err(Error::AccessDenied(
                "local borrows (the region is remotely writable or device memory)",
            ));
        }
        self.inner.lend.exclusive_begin()?;
        Ok(LocalMut { region: self })
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region; [`Error::Busy`] while a
    /// local borrow is out.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        if let Some(d) = &self.inner.device {
            return d.write(offset, src);
        }
        self.use_begin()?;
        // SAFETY: bounds checked above; the memory lives as long as `self`; no Rust slice
        // over it exists (borrows are counted: `use_begin` refused while one is out), so
        // `src` cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base().add(offset), src.len()) };
        self.use_end();
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region; [`Error::Busy`] while a
    /// local borrow is out.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        if let Some(d) = &self.inner.device {
            return d.read(offset, dst);
        }
        self.use_begin()?;
        // SAFETY: as in `write_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base().add(offset), dst.as_mut_ptr(), dst.len())
        };
        self.use_end();
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region; [`Error::Busy`] while a
    /// local borrow is out.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        if let Some(d) = &self.inner.device {
            return d.fill(offset, len, byte);
        }
        self.use_begin()?;
        // SAFETY: bounds checked; memory alive; no borrow out (counted).
        unsafe { std::ptr::write_bytes(self.base().add(offset), byte, len) };
        self.use_end();
        Ok(())
    }

    /// Atomically loads the 8-byte word at `offset` (the target side of remote atomics).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Unaligned`], or [`Error::Busy`] while a local
    /// borrow is out.
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        self.use_begin()?;
        let v = self.atomic_at(offset).map(|a| a.load(Ordering::SeqCst));
        self.use_end();
        v
    }

    /// Atomically stores the 8-byte word at `offset`.
    ///
    /// # Errors
    /// As [`load_u64`](Self::load_u64).
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.use_begin()?;
        let r = self.atomic_at(offset).map(|a| a.store(v, Ordering::SeqCst));
        self.use_end();
        r
    }

    pub(crate) fn atomic_at(&self, offset: usize) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        if !offset.is_multiple_of(8) || !(self.base() as usize + offset).is_multiple_of(8) {
            return Err(Error::Unaligned);
        }
        if self.inner.device.is_some() {
            return Err(Error::Unsupported {
                transport: self.inner.transport,
                what: "host atomics on device memory",
            });
        }
        // SAFETY: in bounds, 8-byte aligned (address checked above), the memory lives as
        // long as `&self`; all concurrent accesses to atomics words go through AtomicU64.
        Ok(unsafe { AtomicU64::from_ptr(self.base().add(offset) as *mut u64) })
    }

    /// An owned slice `[offset, offset + len)` to hand to an operation.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is outside the region; [`Error::Busy`] while a
    /// local borrow ([`bytes`](Self::bytes) / [`bytes_mut`](Self::bytes_mut)) is out.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Buf> {
        self.check(offset, len)?;
        self.use_begin()?;
        Ok(Buf {
            region: self.clone(),
            offset,
            len,
        })
    }

    /// The whole region as one [`Buf`].
    ///
    /// # Panics
    /// If a local borrow is out (use [`slice`](Self::slice) for a typed error).
    pub fn full(&self) -> Buf {
        match self.slice(0, self.inner.len) {
            Ok(b) => b,
            Err(e) => panic!("Region::full: {e}"),
        }
    }

    /// Gives the caller's memory back once nothing else holds the region (no clone, no
    /// slice, no operation): the registration is released first (peers' keys are
    /// revoked, the backend registration is gone), then the memory is returned as the
    /// type it was registered as.
    ///
    /// # Errors
    /// The region itself when it is still shared, or when it is not caller memory of
    /// type `M`.
    pub fn into_memory<M: 'static>(self) -> std::result::Result<M, Region> {
        let inner = match Arc::try_unwrap(self.inner) {
            Ok(i) => i,
            Err(inner) => return Err(Region { inner }),
        };
        let is_m = matches!(&inner.mem, Memory::Caller { keep: Some(k), .. } if (**k).is::<M>());
        if !is_m {
            return Err(Region {
                inner: Arc::new(inner),
            });
        }
        let mut inner = inner;
        if let Some(r) = inner.revoke.take() {
            r.revoke(inner.id, inner.gen);
        }
        inner.backing = None;
        inner.local = None;
        let keep = match &mut inner.mem {
            Memory::Caller { keep, .. } => keep.take(),
            _ => None,
        };
        drop(inner);
        match keep.map(|k| k.downcast::<M>()) {
            Some(Ok(m)) => Ok(*m),
            // Unreachable: the type was checked above; the region is gone either way.
            _ => unreachable!("caller memory type checked before release"),
        }
    }
}

/// A shared, copy-free borrow of a lendable region's bytes ([`Region::bytes`]).
pub struct LocalRef<'a> {
    region: &'a Region,
}

impl std::ops::Deref for LocalRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region is host memory no peer may write (checked at borrow), alive
        // for 'a; no slice, copy or mutable borrow exists while this guard is counted, so
        // nothing writes these bytes meanwhile.
        unsafe { std::slice::from_raw_parts(self.region.base(), self.region.len()) }
    }
}

impl Drop for LocalRef<'_> {
    fn drop(&mut self) {
        self.region.inner.lend.shared_end();
    }
}

impl fmt::Debug for LocalRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalRef")
            .field("len", &self.region.len())
            .finish()
    }
}

/// An exclusive, copy-free borrow of a lendable region's bytes ([`Region::bytes_mut`]).
pub struct LocalMut<'a> {
    region: &'a Region,
}

impl std::ops::Deref for LocalMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `LocalRef`; this guard is the only user of the bytes.
        unsafe { std::slice::from_raw_parts(self.region.base(), self.region.len()) }
    }
}

impl std::ops::DerefMut for LocalMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: the exclusive borrow is counted: no slice, copy or other borrow of the
        // region exists while it lives, and no peer may write the memory.
        unsafe { std::slice::from_raw_parts_mut(self.region.base(), self.region.len()) }
    }
}

impl Drop for LocalMut<'_> {
    fn drop(&mut self) {
        self.region.inner.lend.exclusive_end();
    }
}

impl fmt::Debug for LocalMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalMut")
            .field("len", &self.region.len())
            .finish()
    }
}

/// Who uses a lendable region's bytes: slices and copies ("users", low 32 bits), shared
/// borrows (bits 32..63) and an exclusive borrow (bit 63). Users exclude borrows; shared
/// borrows exclude users and the exclusive one.
/// (Its atomic comes from the `sync` shim: `tests/loom_region.rs` checks it under loom.)
#[derive(Debug)]
struct Lend(crate::sync::AtomicU64);

const LEND_EXCL: u64 = 1 << 63;
const LEND_SHARED: u64 = 1 << 32;
const LEND_USERS: u64 = LEND_SHARED - 1;

impl Lend {
    fn new() -> Self {
        Lend(crate::sync::AtomicU64::new(0))
    }
    fn update(&self, f: impl Fn(u64) -> Option<u64>, why: &'static str) -> Result<()> {
        self.0
            .fetch_update(
                crate::sync::Ordering::Acquire,
                crate::sync::Ordering::Relaxed,
                f,
            )
            .map(|_| ())
            .map_err(|_| Error::Busy(why))
    }
    fn use_begin(&self) -> Result<()> {
        self.update(
            |s| (s & !LEND_USERS == 0 && s & LEND_USERS < LEND_USERS).then_some(s + 1),
            "a local borrow is out",
        )
    }
    fn use_end(&self) {
        self.0.fetch_sub(1, crate::sync::Ordering::Release);
    }
    fn shared_begin(&self) -> Result<()> {
        self.update(
            |s| {
                (s & (LEND_EXCL | LEND_USERS) == 0 && (s >> 32) < (LEND_EXCL >> 32) - 1)
                    .then_some(s + LEND_SHARED)
            },
            "slices, copies or a mutable borrow are out",
        )
    }
    fn shared_end(&self) {
        self.0
            .fetch_sub(LEND_SHARED, crate::sync::Ordering::Release);
    }
    fn exclusive_begin(&self) -> Result<()> {
        self.update(
            |s| (s == 0).then_some(LEND_EXCL),
            "slices, copies or another borrow are out",
        )
    }
    fn exclusive_end(&self) {
        self.0.fetch_and(!LEND_EXCL, crate::sync::Ordering::Release);
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

impl Drop for Buf {
    fn drop(&mut self) {
        self.region.use_end();
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
    #[cfg_attr(any(fabric_loom, not(feature = "cuda-ipc")), allow(dead_code))]
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

/// A fresh anonymous mapping of at least one byte.
pub(crate) fn anon_map(len: usize) -> Result<MmapRaw> {
    Ok(MmapRaw::from(
        memmap2::MmapOptions::new()
            .len(len.max(1))
            .map_anon()
            .map_err(|e| Error::io("mmap", e))?,
    ))
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
