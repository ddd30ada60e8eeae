//! [`RemoteWindow`]: a peer's registered memory mapped into this process, read and written
//! with plain copies and atomic loads and stores instead of operations.
//!
//! On a backend whose peers share a host's memory (shm:
//! [`Capabilities::remote_window`](crate::Capabilities::remote_window)),
//! [`Transport::map_remote`](crate::Transport::map_remote) turns a peer's
//! [`RemoteKey`] into a window over the peer's region. A store into the window is in the
//! peer's memory when it retires: no post, no completion, no poll, no system call. That is
//! what a latency-bound algorithm wants for its small messages (a flag word the peer spins
//! on, a few bytes beside it); bulk transfers keep using operations, which the backend can
//! overlap and which report failures per operation.
//!
//! ```no_run
//! # fn f(conn: &mut dyn fabric_core::Transport, key: fabric_core::RemoteKey) -> fabric_core::Result<()> {
//! let win = conn.map_remote(&key)?; // shm; other backends: Error::Unsupported
//! win.write_at(64, &42u32.to_ne_bytes())?; // the payload, then...
//! win.store_u64(0, 1)?; // ...the flag the peer waits on (release: the payload is visible first)
//! # Ok(())
//! # }
//! ```
//!
//! # The memory model
//!
//! The window follows the rules of memory a peer may write ([`crate::region`]): it is never
//! a `&[u8]`. Bytes move by copies ([`read_at`](RemoteWindow::read_at),
//! [`write_at`](RemoteWindow::write_at)); 8-byte words are atomics
//! ([`load_u64`](RemoteWindow::load_u64) with acquire ordering,
//! [`store_u64`](RemoteWindow::store_u64) with release ordering, and the sequentially
//! consistent read-modify-writes [`fetch_add_u64`](RemoteWindow::fetch_add_u64) and
//! [`compare_swap_u64`](RemoteWindow::compare_swap_u64)), and they are the same atomics the
//! owner uses on its side ([`Region::load_u64`](crate::Region::load_u64), ...) and the
//! backend's own remote atomics use. A copy that races with the owner's copies or
//! with another window's leaves unspecified bytes in the range; it never touches memory
//! outside it. To hand bytes over: copy them in, then store a flag with release ordering;
//! the owner loads the flag (acquire) and then copies the bytes out.
//!
//! # Lifetime and revocation
//!
//! The window keeps its mapping of the peer's memory for as long as it (or a clone) lives,
//! whatever happens to the connection or the region: the peer's memory is a size-sealed
//! file, so the mapping cannot shrink under it, and no access through a window ever faults.
//! When the peer drops the region, the connection learns of it (the revocation travels on
//! the control path, and is taken when the connection is polled or an operation names a
//! remote key); from then on [`is_revoked`](RemoteWindow::is_revoked) is `true`, a new
//! `map_remote` with the old key fails, and whatever the window still writes lands in
//! memory no peer reads any more (it is freed when the last window over it is dropped).
//! Exactly as with a one-sided write that races with the revocation, bytes stored before
//! the peer dropped the region may or may not have been seen by it.

#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::region::{check_range, Access};
use crate::transport::RemoteKey;

/// A peer's memory mapped into this process, shared by the backend's table of the peer's
/// regions and by every window over it.
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
    revoked: AtomicBool,
    /// What owns the mapping (unmapped when dropped).
    _keep: Box<dyn Any + Send + Sync>,
}

// SAFETY: `base` points into the mapping `_keep` owns for as long as `self` lives; the
// mapping is only accessed by copies and atomics (see the module docs), which are sound
// from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access is copies and atomics only.
unsafe impl Sync for Mapping {}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("revoked", &self.revoked.load(Ordering::Relaxed))
            .finish()
    }
}

// The shm backend makes them; the loom build has no backends.
#[cfg_attr(fabric_loom, allow(dead_code))]
impl Mapping {
    /// A mapping of `len` bytes at `base` that stays valid while `keep` lives.
    ///
    /// # Safety
    /// `base..base + len` must be mapped, readable and writable memory for as long as `keep`
    /// lives (not freed or unmapped by anyone else, and not shrinkable: a size-sealed file),
    /// and `base` must be 8-byte aligned.
    pub(crate) unsafe fn new(base: *mut u8, len: usize, keep: Box<dyn Any + Send + Sync>) -> Self {
        Mapping {
            base: NonNull::new(base).unwrap_or(NonNull::dangling()),
            len,
            revoked: AtomicBool::new(false),
            _keep: keep,
        }
    }

    /// The mapping's first byte.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Marks the region behind the mapping gone (the peer revoked it).
    pub(crate) fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
    }
}

/// A peer's registered region mapped into this process (see the [module docs](self)).
///
/// Cheap to clone (reference counted); `Send` and `Sync`: any thread may copy and use
/// atomics through it. Each method checks the range and the access the peer granted.
#[derive(Clone)]
pub struct RemoteWindow {
    map: Arc<Mapping>,
    access: Access,
    key: RemoteKey,
}

impl fmt::Debug for RemoteWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteWindow")
            .field("region", &self.key.region)
            .field("gen", &self.key.gen)
            .field("len", &self.map.len)
            .field("access", &self.access)
            .field("revoked", &self.is_revoked())
            .finish()
    }
}

impl RemoteWindow {
    /// A window over `map` with the access both the region and the key grant.
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn new(map: Arc<Mapping>, access: Access, key: RemoteKey) -> Self {
        RemoteWindow { map, access, key }
    }

    /// Bytes of the peer's region.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// The remote access granted (by the region and its key).
    pub fn access(&self) -> Access {
        self.access
    }

    /// The key the window was made from.
    pub fn key(&self) -> &RemoteKey {
        &self.key
    }

    /// Whether the connection has seen the peer revoke the region (it dropped it). Stores
    /// after that land in memory the peer no longer reads. A revocation is seen when the
    /// connection is polled; `false` is therefore "not revoked as far as this process knows".
    pub fn is_revoked(&self) -> bool {
        self.map.revoked.load(Ordering::Acquire)
    }

    #[inline]
    fn allow(&self, any_of: Access, what: &'static str) -> Result<()> {
        if self.access.intersects(any_of) {
            Ok(())
        } else {
            Err(Error::AccessDenied(what))
        }
    }

    #[inline]
    fn range(&self, offset: usize, len: usize) -> Result<*mut u8> {
        check_range(offset as u64, len as u64, self.map.len as u64)?;
        // SAFETY: offset + len <= the mapping's length (checked above).
        Ok(unsafe { self.map.base().add(offset) })
    }

    #[inline]
    fn word(&self, offset: usize) -> Result<&AtomicU64> {
        let p = self.range(offset, 8)?;
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::Unaligned);
        }
        // SAFETY: 8 in-bounds, 8-aligned bytes of a mapping that lives as long as `&self`;
        // every concurrent access to atomic words (ours, the owner's, the backend's remote
        // atomics) goes through `AtomicU64`.
        Ok(unsafe { AtomicU64::from_ptr(p as *mut u64) })
    }

    /// Copies `src` into the peer's region at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::AccessDenied`] without
    /// [`Access::REMOTE_WRITE`].
    #[inline]
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.allow(Access::REMOTE_WRITE, "remote write")?;
        let dst = self.range(offset, src.len())?;
        // SAFETY: `dst` has `src.len()` bytes of the mapping (checked); no Rust reference
        // to the mapping exists in this process, so `src` cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the peer's region.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::AccessDenied`] without [`Access::REMOTE_READ`].
    #[inline]
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.allow(Access::REMOTE_READ, "remote read")?;
        let src = self.range(offset, dst.len())?;
        // SAFETY: as in `write_at`.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Loads the 8-byte word at `offset` (acquire).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Unaligned`]; [`Error::AccessDenied`] without
    /// [`Access::REMOTE_READ`] or [`Access::REMOTE_ATOMIC`].
    #[inline]
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        self.allow(Access::REMOTE_READ | Access::REMOTE_ATOMIC, "remote read")?;
        Ok(self.word(offset)?.load(Ordering::Acquire))
    }

    /// Stores `v` into the 8-byte word at `offset` (release: the window's earlier copies and
    /// stores are visible to whoever loads this value with acquire ordering).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Unaligned`]; [`Error::AccessDenied`] without
    /// [`Access::REMOTE_WRITE`] or [`Access::REMOTE_ATOMIC`].
    #[inline]
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.allow(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC, "remote write")?;
        self.word(offset)?.store(v, Ordering::Release);
        Ok(())
    }

    /// Adds `add` to the 8-byte word at `offset` (wrapping); returns the old value.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Unaligned`]; [`Error::AccessDenied`] without
    /// [`Access::REMOTE_ATOMIC`].
    #[inline]
    pub fn fetch_add_u64(&self, offset: usize, add: u64) -> Result<u64> {
        self.allow(Access::REMOTE_ATOMIC, "remote atomics")?;
        Ok(self.word(offset)?.fetch_add(add, Ordering::SeqCst))
    }

    /// Replaces the 8-byte word at `offset` with `new` if it holds `expect`; returns the
    /// value it held (equal to `expect` when the swap happened).
    ///
    /// # Errors
    /// As [`fetch_add_u64`](Self::fetch_add_u64).
    #[inline]
    pub fn compare_swap_u64(&self, offset: usize, expect: u64, new: u64) -> Result<u64> {
        self.allow(Access::REMOTE_ATOMIC, "remote atomics")?;
        Ok(
            match self.word(offset)?.compare_exchange(
                expect,
                new,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(v) | Err(v) => v,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TransportKind;

    fn window(len: usize, access: Access) -> RemoteWindow {
        let mut words = vec![0u64; len.div_ceil(8)];
        let base = words.as_mut_ptr() as *mut u8;
        // SAFETY: the Vec's buffer (8-aligned, `len` bytes or more) does not move when the
        // Vec does, and lives as long as the mapping owns the Vec; it is only accessed
        // through the window.
        let map = unsafe { Mapping::new(base, len, Box::new(words)) };
        let key = RemoteKey {
            transport: TransportKind::Shm,
            region: 3,
            gen: 1,
            access: access.bits(),
            len: len as u64,
            key: 7,
            addr: 0,
            rkey: 0,
        };
        RemoteWindow::new(Arc::new(map), access, key)
    }

    #[test]
    fn copies_and_words_round_trip_within_bounds() {
        let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let w = window(64, all);
        w.write_at(60, &[1, 2, 3, 4]).unwrap();
        let mut got = [0u8; 4];
        w.read_at(60, &mut got).unwrap();
        assert_eq!(got, [1, 2, 3, 4]);
        w.store_u64(8, 5).unwrap();
        assert_eq!(w.fetch_add_u64(8, 2).unwrap(), 5);
        assert_eq!(w.compare_swap_u64(8, 7, 9).unwrap(), 7);
        assert_eq!(w.compare_swap_u64(8, 7, 11).unwrap(), 9);
        assert_eq!(w.load_u64(8).unwrap(), 9);
        assert!(matches!(
            w.write_at(61, &[0; 4]),
            Err(Error::OutOfBounds {
                offset: 61,
                len: 4,
                region_len: 64
            })
        ));
        assert!(matches!(
            w.read_at(usize::MAX, &mut got),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(w.load_u64(60), Err(Error::OutOfBounds { .. })));
        assert!(matches!(w.load_u64(4), Err(Error::Unaligned)));
        assert!(!w.is_revoked());
        w.map.revoke();
        assert!(w.is_revoked() && w.clone().is_revoked());
    }

    #[test]
    fn each_method_needs_its_access() {
        let w = window(16, Access::REMOTE_READ);
        assert!(matches!(w.write_at(0, &[1]), Err(Error::AccessDenied(_))));
        assert!(matches!(w.store_u64(0, 1), Err(Error::AccessDenied(_))));
        assert!(matches!(w.fetch_add_u64(0, 1), Err(Error::AccessDenied(_))));
        assert!(matches!(
            w.compare_swap_u64(0, 0, 1),
            Err(Error::AccessDenied(_))
        ));
        assert_eq!(w.load_u64(0).unwrap(), 0);
        let w = window(16, Access::REMOTE_WRITE);
        assert!(matches!(
            w.read_at(0, &mut [0]),
            Err(Error::AccessDenied(_))
        ));
        assert!(matches!(w.load_u64(0), Err(Error::AccessDenied(_))));
        w.store_u64(0, 1).unwrap();
        let w = window(16, Access::REMOTE_ATOMIC);
        assert!(matches!(w.write_at(0, &[1]), Err(Error::AccessDenied(_))));
        assert!(matches!(
            w.read_at(0, &mut [0]),
            Err(Error::AccessDenied(_))
        ));
        w.store_u64(0, 3).unwrap();
        assert_eq!(w.fetch_add_u64(0, 1).unwrap(), 3);
        assert_eq!(w.load_u64(0).unwrap(), 4);
    }
}
