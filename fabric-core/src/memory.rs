//! Memory the caller owns and hands to a [`Domain`](crate::Domain) for registration
//! without a copy: [`RegisterMemory`] (implemented for `Vec<T>`, `Box<[T]>` of [`Plain`]
//! element types, `memmap2::MmapMut` and [`AlignedBuf`]); [`RegisterError`] hands the
//! memory back when a registration is refused.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::fmt;

use crate::error::{Error, Result};

/// Memory that can be registered in place: a stable address for as long as the value
/// lives (moving the value does not move the bytes), and every bit pattern valid in it
/// (peers and the hardware write arbitrary bytes).
///
/// # Safety
/// Implementors promise that
/// 1. `as_mut_ptr` returns the same pointer every time, valid for reads and writes of
///    `byte_len` bytes for as long as the value lives, even after the value is moved;
/// 2. `byte_len` never changes;
/// 3. any byte pattern written there leaves the value valid (no invariants on the bytes);
/// 4. nothing else accesses the bytes while the value is registered (the value owns
///    them).
pub unsafe trait RegisterMemory: Send + Sync + 'static {
    /// The first byte.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Length in bytes.
    fn byte_len(&self) -> usize;
}

/// Element types for which every bit pattern is a valid value, so a typed buffer
/// (`Vec<f32>`, `Box<[u64]>`) can be written by a peer.
///
/// # Safety
/// Every bit pattern of `size_of::<Self>()` bytes must be a valid `Self`, and `Self`
/// must have no padding and no interior pointers.
pub unsafe trait Plain: Copy + Send + Sync + 'static {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        // SAFETY: primitive integers and floats: every bit pattern is valid, no padding.
        unsafe impl Plain for $t {}
    )*};
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);

// SAFETY: a Vec's heap buffer does not move when the Vec is moved and we never resize it
// (the Vec is owned by the registration); `T: Plain` makes every byte pattern valid.
unsafe impl<T: Plain> RegisterMemory for Vec<T> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Vec::as_mut_ptr(self) as *mut u8
    }
    fn byte_len(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

// SAFETY: as for `Vec<T>`: a boxed slice's heap buffer is fixed.
unsafe impl<T: Plain> RegisterMemory for Box<[T]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[T]>::as_mut_ptr(self) as *mut u8
    }
    fn byte_len(&self) -> usize {
        std::mem::size_of_val(&**self)
    }
}

// SAFETY: a mapping's address is fixed for its lifetime; bytes have no invariants.
unsafe impl RegisterMemory for memmap2::MmapMut {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self[..].as_mut_ptr()
    }
    fn byte_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: the allocation is fixed for the value's lifetime; bytes have no invariants.
unsafe impl RegisterMemory for AlignedBuf {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn byte_len(&self) -> usize {
        self.len
    }
}

/// A refused registration of caller memory: why, and the memory itself, untouched (its
/// contents are as the caller left them), so nothing the caller owned is lost.
///
/// `?` converts it into [`Error`] (dropping the memory) where the caller does not want it
/// back.
///
/// ```no_run
/// use fabric_core::{Access, Domain, Error, TransportKind, backend::Options};
/// # fn main() -> fabric_core::Result<()> {
/// let domain = Domain::open(TransportKind::Shm, &Options::default())?;
/// let region = match domain.register_memory(vec![0u8; 4096], Access::REMOTE_WRITE) {
///     Ok(r) => r,
///     // shm cannot offer one-sided access to caller memory: keep the Vec, use it
///     // two-sided instead.
///     Err(e) if matches!(e.error(), Error::Unsupported { .. }) => {
///         domain.register_memory(e.into_memory(), Access::empty())?
///     }
///     Err(e) => return Err(e.into()),
/// };
/// # let _ = region;
/// # Ok(()) }
/// ```
pub struct RegisterError<M> {
    error: Error,
    memory: M,
}

impl<M> RegisterError<M> {
    #[cfg_attr(fabric_loom, allow(dead_code))]
    pub(crate) fn new(error: Error, memory: M) -> Self {
        RegisterError { error, memory }
    }

    /// Why the registration was refused.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The caller's memory, as it was handed in.
    pub fn into_memory(self) -> M {
        self.memory
    }

    /// The error and the memory.
    pub fn into_parts(self) -> (Error, M) {
        (self.error, self.memory)
    }
}

impl<M> fmt::Debug for RegisterError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisterError")
            .field("error", &self.error)
            .field("memory", &std::any::type_name::<M>())
            .finish()
    }
}

impl<M> fmt::Display for RegisterError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "registration refused (memory handed back): {}",
            self.error
        )
    }
}

impl<M> std::error::Error for RegisterError<M> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<M> From<RegisterError<M>> for Error {
    fn from(e: RegisterError<M>) -> Error {
        e.error
    }
}

/// A zeroed heap buffer with a chosen alignment (e.g. 64 bytes for cache lines, 4096 for
/// pages), registrable in place.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through `&self` methods (`as_slice`).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an alignment that is not a power of two or a size
    /// that overflows; [`Error::Io`] when the allocation fails.
    pub fn new(len: usize, align: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|e| Error::InvalidArgument(format!("aligned buffer {len}/{align}: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p).ok_or_else(|| {
            Error::io(
                "alloc",
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            )
        })?;
        Ok(AlignedBuf { ptr, len, layout })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.layout.align())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_zeroed_and_refuses_bad_alignment() {
        let mut b = AlignedBuf::new(1000, 4096).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert_eq!(b.byte_len(), 1000);
        assert!(AlignedBuf::new(10, 3).is_err());
    }

    #[test]
    fn typed_vectors_report_their_byte_length() {
        let v = vec![0f32; 10];
        assert_eq!(RegisterMemory::byte_len(&v), 40);
        let b: Box<[u64]> = vec![0u64; 3].into_boxed_slice();
        assert_eq!(RegisterMemory::byte_len(&b), 24);
    }
}
