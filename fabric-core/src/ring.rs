//! A lock-free single-producer / single-consumer ring of variable-length records.
//!
//! The ring lives in memory both ends can see (a shared `memfd` mapping for the shm
//! transport, the heap for tests and loom models). Positions (`head`, `tail`) count bytes
//! monotonically and sit on their own cache lines. A record is a 16-byte header
//! (`len: u32`, `kind: u8`, 3 reserved bytes, `aux: u64`) followed by `len` payload bytes,
//! rounded up to [`GRANULE`] (64) bytes; records never wrap: when the contiguous space to the
//! end of the data area is too small the producer writes a padding record first.
//!
//! The consumer treats everything in the ring as untrusted (the producer may be another,
//! buggy or hostile, process): positions and headers are read once, validated, and a bad
//! value is a [`RingError::Corrupt`], never an out-of-bounds access.
//!
//! Ordering: the producer writes the record, then publishes `tail` with `Release`; the
//! consumer loads `tail` with `Acquire` before reading the record, and publishes `head` with
//! `Release` after copying out; the producer loads `head` with `Acquire` before reusing space.
//! The hot path takes no lock, makes no system call and does not allocate.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use crate::sync::{AtomicU64, DataCells, Ordering};

/// Records are aligned to (and sized in multiples of) one cache line.
pub const GRANULE: usize = 64;
/// Bytes of a record header.
pub const HEADER: usize = 16;
/// Record kind reserved for the producer's wrap-around padding; never returned by `peek`.
pub const KIND_PAD: u8 = 0;

/// A value padded to two cache lines (adjacent-line prefetch) so the producer's and the
/// consumer's positions never share one.
#[repr(C, align(128))]
#[derive(Debug)]
pub struct Padded<T>(pub T);

/// The shared control block of one ring: the producer's and the consumer's positions.
///
/// All-zero bytes are a valid, empty ring header (this is how a fresh `memfd` mapping
/// initialises it).
#[repr(C)]
#[derive(Debug)]
pub struct RingHeader {
    tail: Padded<AtomicU64>,
    head: Padded<AtomicU64>,
}

impl RingHeader {
    /// An empty ring header.
    pub fn new() -> Self {
        RingHeader {
            tail: Padded(AtomicU64::new(0)),
            head: Padded(AtomicU64::new(0)),
        }
    }
}

impl Default for RingHeader {
    fn default() -> Self {
        Self::new()
    }
}

/// Why the consumer gave up on a ring.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The producer published positions or a header that cannot be right.
    #[error("corrupt ring: {0}")]
    Corrupt(&'static str),
}

/// Bytes a record with `len` payload bytes occupies.
#[inline]
pub const fn record_size(len: usize) -> usize {
    (HEADER + len).div_ceil(GRANULE) * GRANULE
}

/// The memory of one ring: header, data area, and whatever keeps them alive.
struct Shared {
    hdr: *const RingHeader,
    data: *mut u8,
    cap: usize,
    cells: DataCells,
    _keep: Arc<dyn Send + Sync>,
}

// SAFETY: the pointers refer to memory kept alive by `_keep` (which is Send + Sync); the
// header is made of atomics; the data area is only touched through the SPSC protocol
// (the producer writes bytes the consumer does not own yet and vice versa).
unsafe impl Send for Shared {}
// SAFETY: as above; `&Shared` gives no access that is not mediated by the atomics.
unsafe impl Sync for Shared {}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingShared")
            .field("cap", &self.cap)
            .finish()
    }
}

impl Shared {
    fn hdr(&self) -> &RingHeader {
        // SAFETY: `hdr` is valid and aligned for the life of `_keep` (constructor contract).
        unsafe { &*self.hdr }
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub struct Producer {
    s: Arc<Shared>,
    tail: u64,
    head_cache: u64,
    reserved: usize,
}

/// The reading end of a ring.
#[derive(Debug)]
pub struct Consumer {
    s: Arc<Shared>,
    head: u64,
    tail_cache: u64,
}

/// A record seen by [`Consumer::peek`]: valid until [`Consumer::consume`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The record kind (never [`KIND_PAD`]).
    pub kind: u8,
    /// The producer's auxiliary word.
    pub aux: u64,
    /// Payload length.
    pub len: usize,
    off: usize,
    size: usize,
}

/// Builds the two ends of a ring over caller-provided memory.
///
/// # Safety
/// 1. `hdr` points to a properly aligned `RingHeader` (or all-zero bytes) and `data` to
///    `cap` writable bytes aligned to at least 8 (record headers are read and written as
///    `u64`), both valid for as long as `keep` lives.
/// 2. `cap` is a power of two, at least `4 * GRANULE`.
/// 3. Only one `Producer` and one `Consumer` for this memory exist at a time, across all
///    processes that map it.
pub unsafe fn from_raw(
    hdr: *const RingHeader,
    data: *mut u8,
    cap: usize,
    keep: Arc<dyn Send + Sync>,
) -> (Producer, Consumer) {
    debug_assert!(cap.is_power_of_two() && cap >= 4 * GRANULE);
    debug_assert!(
        (data as usize).is_multiple_of(8),
        "ring data must be 8-byte aligned"
    );
    let s = Arc::new(Shared {
        hdr,
        data,
        cap,
        cells: DataCells::new(cap / GRANULE),
        _keep: keep,
    });
    // SAFETY: caller guarantees `hdr` valid.
    let h = unsafe { &*hdr };
    let tail = h.tail.0.load(Ordering::Acquire);
    let head = h.head.0.load(Ordering::Acquire);
    (
        Producer {
            s: s.clone(),
            tail,
            head_cache: head,
            reserved: 0,
        },
        Consumer {
            s,
            head,
            tail_cache: head,
        },
    )
}

struct HeapRing {
    hdr: RingHeader,
    // `u64` words, not bytes: record headers are accessed as aligned `u64`s.
    data: Box<[std::cell::UnsafeCell<u64>]>,
}
// SAFETY: the data bytes are accessed only through the SPSC protocol (see `Shared`).
unsafe impl Sync for HeapRing {}

/// A ring on the heap (tests, loom models, in-process use). `cap` is rounded up to a power
/// of two of at least `4 * GRANULE`.
pub fn heap(cap: usize) -> (Producer, Consumer) {
    let cap = cap.max(4 * GRANULE).next_power_of_two();
    let ring = Arc::new(HeapRing {
        hdr: RingHeader::new(),
        data: (0..cap / 8)
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect(),
    });
    let hdr: *const RingHeader = &ring.hdr;
    let data = ring.data.as_ptr() as *mut u8;
    // SAFETY: `hdr`/`data` point into `ring`, kept alive by `keep`; `data` is `cap` bytes of
    // 8-aligned `u64`s; `cap` is a power of two >= 4 granules; we hand out exactly one
    // producer and one consumer.
    unsafe { from_raw(hdr, data, cap, ring) }
}

impl Producer {
    /// Data-area capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.s.cap
    }

    /// The largest payload one record may carry (so that two records always fit).
    pub fn max_payload(&self) -> usize {
        self.s.cap / 2 - HEADER
    }

    /// Reserves a record of `len` payload bytes and writes its header. Returns a pointer to
    /// `len` writable payload bytes, or `None` when the ring has no room now (backpressure).
    /// Nothing is visible to the consumer until [`commit`](Self::commit).
    ///
    /// # Panics
    /// If `len > max_payload()` or `kind == KIND_PAD` (caller bugs, not peer input).
    pub fn reserve(&mut self, kind: u8, aux: u64, len: usize) -> Option<*mut u8> {
        assert!(len <= self.max_payload() && kind != KIND_PAD && self.reserved == 0);
        let cap = self.s.cap;
        let need = record_size(len);
        let pos = (self.tail as usize) & (cap - 1);
        let contig = cap - pos;
        let pad = if need > contig { contig } else { 0 };
        let total = (pad + need) as u64;
        if self.tail + total - self.head_cache > cap as u64 {
            self.head_cache = self.s.hdr().head.0.load(Ordering::Acquire);
            if self.tail + total - self.head_cache > cap as u64 {
                return None;
            }
        }
        let mut pos = pos;
        if pad > 0 {
            self.write_header(pos, KIND_PAD, 0, pad - HEADER);
            self.s.cells.write(pos / GRANULE, pad / GRANULE);
            pos = 0;
        }
        self.write_header(pos, kind, aux, len);
        self.s.cells.write(pos / GRANULE, need / GRANULE);
        self.reserved = pad + need;
        // SAFETY: pos + need <= cap, so the payload range lies inside the data area.
        Some(unsafe { self.s.data.add(pos + HEADER) })
    }

    fn write_header(&self, pos: usize, kind: u8, aux: u64, len: usize) {
        let w0 = (len as u64) | ((kind as u64) << 32);
        // SAFETY: pos is granule aligned and pos + HEADER <= cap; the bytes belong to the
        // producer (between tail and head + cap), so no one reads them concurrently.
        unsafe {
            let p = self.s.data.add(pos) as *mut u64;
            p.write_volatile(w0);
            p.add(1).write_volatile(aux);
        }
    }

    /// Publishes the reserved record to the consumer.
    pub fn commit(&mut self) {
        self.tail += self.reserved as u64;
        self.reserved = 0;
        self.s.hdr().tail.0.store(self.tail, Ordering::Release);
    }

    /// Reserve, copy `payload`, commit. Returns `false` (and writes nothing) when full.
    pub fn push(&mut self, kind: u8, aux: u64, payload: &[u8]) -> bool {
        match self.reserve(kind, aux, payload.len()) {
            Some(dst) => {
                // SAFETY: `reserve` returned `payload.len()` writable bytes owned by us.
                unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, payload.len()) };
                self.commit();
                true
            }
            None => false,
        }
    }

    /// Whether a record of `len` payload bytes would fit now (refreshes the cached head).
    pub fn has_room(&mut self, len: usize) -> bool {
        let cap = self.s.cap;
        let need = record_size(len);
        let pos = (self.tail as usize) & (cap - 1);
        let pad = if need > cap - pos { cap - pos } else { 0 };
        let total = (pad + need) as u64;
        if self.tail + total - self.head_cache > cap as u64 {
            self.head_cache = self.s.hdr().head.0.load(Ordering::Acquire);
        }
        self.tail + total - self.head_cache <= cap as u64
    }
}

impl Consumer {
    /// The next record, if one was published. Padding records are skipped.
    ///
    /// # Errors
    /// [`RingError::Corrupt`] when the producer published impossible positions or headers.
    pub fn peek(&mut self) -> Result<Option<Record>, RingError> {
        let cap = self.s.cap;
        loop {
            if self.head == self.tail_cache {
                let t = self.s.hdr().tail.0.load(Ordering::Acquire);
                if t == self.head {
                    return Ok(None);
                }
                if t < self.head
                    || t - self.head > cap as u64
                    || !(t - self.head).is_multiple_of(GRANULE as u64)
                {
                    return Err(RingError::Corrupt("tail position"));
                }
                self.tail_cache = t;
            }
            let pos = (self.head as usize) & (cap - 1);
            // SAFETY: pos is granule aligned, pos + HEADER <= cap; the bytes were published
            // by the producer's Release store of tail, which we loaded with Acquire.
            let (w0, aux) = unsafe {
                let p = self.s.data.add(pos) as *const u64;
                (p.read_volatile(), p.add(1).read_volatile())
            };
            let len = (w0 & 0xffff_ffff) as usize;
            let kind = (w0 >> 32) as u8;
            if len > cap {
                return Err(RingError::Corrupt("record length"));
            }
            let size = record_size(len);
            if size > cap - pos || self.head + size as u64 > self.tail_cache {
                return Err(RingError::Corrupt("record length"));
            }
            self.s.cells.read(pos / GRANULE, size / GRANULE);
            if kind == KIND_PAD {
                self.head += size as u64;
                self.s.hdr().head.0.store(self.head, Ordering::Release);
                continue;
            }
            return Ok(Some(Record {
                kind,
                aux,
                len,
                off: pos + HEADER,
                size,
            }));
        }
    }

    /// Pointer to the payload of `rec` (valid for `rec.len` bytes until `consume`).
    pub fn payload_ptr(&self, rec: &Record) -> *const u8 {
        // SAFETY: `peek` checked off + len <= cap.
        unsafe { self.s.data.add(rec.off) }
    }

    /// Copies the payload of `rec` into `dst[..rec.len]`.
    ///
    /// # Panics
    /// If `dst` is shorter than the record.
    pub fn read(&self, rec: &Record, dst: &mut [u8]) {
        assert!(dst.len() >= rec.len);
        // SAFETY: the payload range was validated by `peek` and belongs to the consumer
        // until `consume`; `dst` is a distinct, writable slice of at least `rec.len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.payload_ptr(rec), dst.as_mut_ptr(), rec.len) };
    }

    /// Releases `rec` (which must be the record last returned by `peek`) to the producer.
    pub fn consume(&mut self, rec: &Record) {
        self.head += rec.size as u64;
        self.s.hdr().head.0.store(self.head, Ordering::Release);
    }

    /// Whether a published record (or padding) is waiting.
    pub fn is_empty(&mut self) -> bool {
        if self.head != self.tail_cache {
            return false;
        }
        self.tail_cache = self.s.hdr().tail.0.load(Ordering::Acquire).max(self.head);
        self.head == self.tail_cache
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::*;

    #[test]
    fn push_peek_consume_in_order_with_wrap() {
        let (mut p, mut c) = heap(1024);
        let mut next_send = 0u64;
        let mut next_recv = 0u64;
        // Deterministic simulation: interleave pushes and pops of varied sizes so the ring
        // wraps many times and runs full and empty.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if !x.is_multiple_of(3) {
                let len = (x >> 8) as usize % (p.max_payload() + 1);
                let payload: Vec<u8> = (0..len).map(|i| (next_send as u8) ^ (i as u8)).collect();
                if p.push(1 + (next_send % 200) as u8, next_send, &payload) {
                    next_send += 1;
                }
            } else if let Some(rec) = c.peek().unwrap() {
                assert_eq!(rec.aux, next_recv);
                assert_eq!(rec.kind, 1 + (next_recv % 200) as u8);
                let mut buf = vec![0u8; rec.len];
                c.read(&rec, &mut buf);
                for (i, b) in buf.iter().enumerate() {
                    assert_eq!(*b, (next_recv as u8) ^ (i as u8));
                }
                c.consume(&rec);
                next_recv += 1;
            }
        }
        assert!(next_recv > 1000);
    }

    #[test]
    fn full_ring_refuses_then_accepts() {
        let (mut p, mut c) = heap(256);
        assert!(p.push(1, 0, &[0; 48]));
        assert!(p.push(1, 1, &[0; 48]));
        assert!(p.push(1, 2, &[0; 48]));
        assert!(p.push(1, 3, &[0; 48]));
        assert!(!p.push(1, 4, &[0; 1]));
        let r = c.peek().unwrap().unwrap();
        c.consume(&r);
        assert!(p.push(1, 4, &[0; 1]));
    }

    #[test]
    fn corrupt_positions_are_errors() {
        let (_p, mut c) = heap(256);
        c.s.hdr().tail.0.store(10_000, Ordering::Release);
        assert!(c.peek().is_err());
        let (mut p, mut c) = heap(256);
        assert!(p.push(1, 0, &[1; 8]));
        // Overwrite the header with an absurd length.
        // SAFETY: test-only write into the heap ring's first header word.
        unsafe { (c.s.data as *mut u64).write(u32::MAX as u64 | (1 << 32)) };
        assert_eq!(c.peek(), Err(RingError::Corrupt("record length")));
    }
}

#[cfg(all(test, fabric_loom))]
mod loom_tests {
    use super::*;

    /// The producer pushes three records (forcing a wrap and a full ring in a 256-byte
    /// ring); the consumer must see each exactly once, in order, untorn.
    #[test]
    fn ring_loom_spsc_in_order_untorn() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(
            std::env::var("LOOM_MAX_PREEMPTIONS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(3),
        );
        b.check(|| {
            let (mut p, mut c) = heap(256);
            let t = loom::thread::spawn(move || {
                for i in 0..3u8 {
                    let payload = [i; 100];
                    while !p.push(1 + i, i as u64, &payload) {
                        loom::thread::yield_now();
                    }
                }
            });
            let mut got = 0u8;
            while got < 3 {
                match c.peek().unwrap() {
                    Some(rec) => {
                        assert_eq!(rec.kind, 1 + got);
                        assert_eq!(rec.aux, got as u64);
                        let mut buf = [0u8; 100];
                        c.read(&rec, &mut buf);
                        assert!(buf.iter().all(|b| *b == got));
                        c.consume(&rec);
                        got += 1;
                    }
                    None => loom::thread::yield_now(),
                }
            }
            t.join().unwrap();
        });
    }
}
