//! Buffers that a [`MemoryRegion`](crate::MemoryRegion) can own.
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use std::alloc::Layout;
use std::ptr::NonNull;

/// Memory that can be registered: a stable, owned byte range.
///
/// A region takes the buffer by value and keeps it (inside a heap allocation that never
/// moves) until it is deregistered, so the buffer only has to stay valid while it is alive
/// and untouched.
///
/// # Safety
/// Implementors promise that:
/// 1. `as_mut_ptr()` returns a pointer to `len()` initialised bytes owned by `self`,
///    readable and writable, valid for as long as `self` is alive and not otherwise
///    accessed (the region never calls any other method of the buffer while registered);
/// 2. neither the pointer nor the length changes when `self` is moved, and calling
///    `as_mut_ptr()` / `len()` again returns the same values;
/// 3. nothing else (another owner, another thread) accesses those bytes while the buffer is
///    owned by a region.
pub unsafe trait RegionBuffer: Send + Sync + 'static {
    /// Start of the bytes.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Whether `len() == 0`.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a Vec's heap buffer does not move when the Vec moves; `len` bytes are initialised.
unsafe impl RegionBuffer for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Vec::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: as for Vec: the boxed slice's heap storage is stable and initialised.
unsafe impl RegionBuffer for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

// SAFETY: a mapping's address is fixed for its lifetime and owned by the MmapMut. (Whoever
// created a file-backed MmapMut already promised, via memmap2's `unsafe` constructor, that
// the file is not truncated or modified behind its back.)
unsafe impl RegionBuffer for memmap2::MmapMut {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        let s: &mut [u8] = self;
        s.as_mut_ptr()
    }
    fn len(&self) -> usize {
        let s: &[u8] = self;
        s.len()
    }
}

/// A zeroed heap buffer with a chosen alignment (the default buffer of a region).
#[derive(Debug)]
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuffer uniquely owns its allocation (like Box<[u8]>).
unsafe impl Send for AlignedBuffer {}
// SAFETY: no interior mutability; shared access is read-only.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0` or a bad alignment; [`Error::Alloc`] when
    /// the allocator fails.
    pub fn zeroed(len: usize, align: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "buffer length must be non-zero".into(),
            ));
        }
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| Error::InvalidArgument(format!("buffer layout ({len}, {align}): {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| Error::Alloc {
            len,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        Ok(AlignedBuffer { ptr, layout })
    }

    /// `len` zeroed bytes aligned to 64 (a cache line).
    ///
    /// # Errors
    /// As [`AlignedBuffer::zeroed`].
    pub fn new(len: usize) -> Result<Self> {
        Self::zeroed(len, 64)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the allocation is owned, stable across moves, and `layout.size()` bytes long.
unsafe impl RegionBuffer for AlignedBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}

/// A page-aligned anonymous mapping of `len` bytes (zeroed).
///
/// # Errors
/// [`Error::Alloc`] if `mmap` fails.
pub fn page_aligned(len: usize) -> Result<memmap2::MmapMut> {
    memmap2::MmapMut::map_anon(len).map_err(|source| Error::Alloc { len, source })
}

/// An anonymous mapping backed by huge pages (`MAP_HUGETLB`; `len` should be a multiple of
/// the huge page size).
///
/// # Errors
/// [`Error::Alloc`] if no huge pages are available (see `/proc/sys/vm/nr_hugepages`).
pub fn huge_pages(len: usize) -> Result<memmap2::MmapMut> {
    memmap2::MmapOptions::new()
        .len(len)
        .huge(None)
        .map_anon()
        .map_err(|source| Error::Alloc { len, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffer_is_zeroed_and_aligned() {
        let mut b = AlignedBuffer::zeroed(4096, 4096).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 7;
        assert_eq!(b.as_slice()[5], 7);
        assert!(AlignedBuffer::zeroed(0, 8).is_err());
        assert!(AlignedBuffer::zeroed(8, 3).is_err());
    }

    #[test]
    fn page_aligned_mapping() {
        let mut m = page_aligned(8192).unwrap();
        assert_eq!(RegionBuffer::as_mut_ptr(&mut m) as usize % 4096, 0);
        assert_eq!(RegionBuffer::len(&m), 8192);
    }
}
