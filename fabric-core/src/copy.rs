//! The CPU copies a backend makes into a receiver's memory, cached or streaming.
//!
//! A `memcpy` into memory that is not in the cache reads every destination line before it
//! writes it (the store needs the line). Non-temporal stores skip that read and bypass the
//! cache: into a set of buffers larger than the last-level cache they copy up to twice as
//! fast (`fabric-core` probe on an AMD EPYC guest, 4 MiB into 16 rotating destinations:
//! 22–24 GB/s against `memcpy`'s 11–13), but the data is then in memory, not in the cache,
//! and a destination the receiver reads right away or reuses (a staging buffer) is copied
//! at about half of `memcpy`'s cached speed. Whether a receive streams depends on the
//! application's buffers, so it is the region's owner who says it
//! ([`Region::set_streaming`](crate::Region::set_streaming)).
#![allow(unsafe_code)]
// Without the backends (the loom build) nothing copies.
#![cfg_attr(fabric_loom, allow(dead_code))]

/// Messages shorter than this are copied with ordinary stores even into a streaming
/// region: their lines fit any cache, and the fence that ends a streaming copy would cost
/// a small message more than the stores save.
pub const STREAMING_MIN_BYTES: usize = 64 << 10;

#[cfg(test)]
thread_local! {
    /// Bytes this thread copied with [`copy`]'s streaming path (for tests: whether a
    /// backend honoured the hint).
    pub(crate) static STREAMED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Copies `n` bytes from `src` to `dst`, with non-temporal stores when `streaming`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `n` bytes,
/// not overlapping.
#[inline]
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, n: usize, streaming: bool) {
    if streaming {
        #[cfg(test)]
        STREAMED.with(|s| s.set(s.get() + n));
        // SAFETY: the caller's contract.
        unsafe { copy_streaming(src, dst, n) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
    }
}

/// Non-temporal copy: ordinary stores up to the destination's first 16-byte boundary,
/// then 64 bytes per step with `movntdq` (SSE2, which every x86-64 CPU has), the tail
/// with ordinary stores, and an `sfence` so the streamed stores are visible to other CPUs
/// before any store that follows (the completion that tells the application the data is
/// there).
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[inline(never)]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = ((dst as usize).wrapping_neg() & 15).min(n);
    // SAFETY: every access is inside the caller's `n` bytes: `head <= n`, the loop runs
    // while at least 64 bytes are left, the tail is what is left; the stream stores go to
    // 16-byte aligned addresses (`dst + head` is aligned, steps are 16).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d, mut left) = (src.add(head), dst.add(head), n - head);
        while left >= 64 {
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            s = s.add(64);
            d = d.add(64);
            left -= 64;
        }
        std::ptr::copy_nonoverlapping(s, d, left);
        _mm_sfence();
    }
}

/// Elsewhere (and under Miri, which has no model of non-temporal stores' ordering): an
/// ordinary copy; the hint is a hint.
#[cfg(not(all(target_arch = "x86_64", not(miri))))]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the 16- and 64-byte steps, at every destination and source
    /// misalignment, lands exactly the source's bytes and nothing outside them.
    #[test]
    fn streaming_copy_is_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..400u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in (0..=200).chain([255, 256, 257, 319, 320, 321]) {
            for so in 0..16 {
                for doff in 0..16 {
                    let mut dst = vec![0xAAu8; 400 + 32];
                    // SAFETY: so + n <= 16 + 321 < 400 and doff + n < 432; distinct vectors.
                    unsafe { copy(src.as_ptr().add(so), dst.as_mut_ptr().add(doff), n, true) };
                    assert_eq!(
                        &dst[doff..doff + n],
                        &src[so..so + n],
                        "n {n} src+{so} dst+{doff}"
                    );
                    assert!(
                        dst[..doff].iter().all(|&b| b == 0xAA),
                        "wrote before: n {n}"
                    );
                    assert!(
                        dst[doff + n..].iter().all(|&b| b == 0xAA),
                        "wrote after: n {n}"
                    );
                }
            }
        }
    }

    /// A large streaming copy (many 64-byte steps) equals the cached one.
    #[test]
    fn a_large_streaming_copy_equals_the_cached_one() {
        let n = (1 << 20) + 37;
        let src: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let (mut a, mut b) = (vec![0u8; n + 8], vec![0u8; n + 8]);
        let before = STREAMED.with(|s| s.get());
        // SAFETY: both destinations have n + 8 bytes; distinct vectors.
        unsafe {
            copy(src.as_ptr(), a.as_mut_ptr().add(5), n, true);
            copy(src.as_ptr(), b.as_mut_ptr().add(5), n, false);
        }
        assert_eq!(a, b);
        assert_eq!(
            STREAMED.with(|s| s.get()) - before,
            n,
            "only the streaming copy counts"
        );
    }
}
