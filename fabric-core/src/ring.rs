//! A lock-free single-producer / single-consumer ring of variable-length records.
//!
//! The ring lives in memory both ends can see (a shared `memfd` mapping for the shm
//! transport, the heap for tests and loom models). Positions count bytes monotonically. A
//! record is a 16-byte header followed by `len` payload bytes, rounded up to [`GRANULE`] (64)
//! bytes; records never wrap: when the contiguous space to the end of the data area is too
//! small the producer writes a padding record first.
//!
//! The header's first word says everything the consumer needs to find a record: `len: u32`,
//! `kind: u8` and a 24-bit *seal* (a set top bit and the low 23 bits of the record's granule
//! position); the second word is the producer's `aux`. The consumer does not read a shared
//! tail position: it polls the first header word at its own position, which the producer
//! stores last (with `Release`) when it commits, and takes the record when the seal is the
//! one its position expects. So a message costs the consumer one cache line from the
//! producer (the record), not two (a tail position, then the record): the latency of a
//! small message is one cache-line transfer between the cores.
//!
//! Bytes left from an earlier lap (a payload that happens to look like a header with the
//! right seal) are never taken for a record: the position the consumer moves to after a
//! record always holds zero until the next record is committed there. The producer keeps
//! the first word of every granule between its position and a *cleared* mark zero; it
//! advances the mark a few granules at a time *after* publishing a record, so that the
//! stores (each a cache line the consumer may still hold) never sit in front of a record's
//! publication. Only a record that ends at or beyond the mark clears its end's word before
//! it is published. That granule must be the producer's to clear, so a record needs one
//! granule of room beyond its own bytes.
//!
//! The consumer treats everything in the ring as untrusted (the producer may be another,
//! buggy or hostile, process): headers are read once, validated, and a bad length is a
//! [`RingError::Corrupt`], never an out-of-bounds access.
//!
//! Ordering: the producer writes the payload and `aux`, clears the next header word, then
//! stores the record's first header word with `Release`; the consumer loads that word with
//! `Acquire` before reading the record, and publishes its `head` position with `Release`
//! after copying out; the producer loads `head` with `Acquire` before reusing space.
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
/// How far past its position the producer keeps header words cleared (bytes), and the
/// distance below which it clears more.
const CLEAR_AHEAD: u64 = 32 * GRANULE as u64;
const CLEAR_LOW: u64 = 8 * GRANULE as u64;

/// A value padded to two cache lines (adjacent-line prefetch), so that the consumer's
/// position shares no line with anything the producer writes.
#[repr(C, align(128))]
#[derive(Debug)]
pub struct Padded<T>(pub T);

/// The shared control block of one ring: the consumer's position (consumers find records
/// by their header seals, so no producer position is published).
///
/// All-zero bytes are a valid, empty ring header (this is how a fresh `memfd` mapping
/// initialises it).
#[repr(C)]
#[derive(Debug)]
pub struct RingHeader {
    head: Padded<AtomicU64>,
}

impl RingHeader {
    /// An empty ring header.
    pub fn new() -> Self {
        RingHeader {
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

/// The seal of a record at byte position `pos` (a multiple of [`GRANULE`]): the top bit
/// set (so a cleared word never matches) and the granule index's low 23 bits.
#[inline]
const fn seal(pos: u64) -> u64 {
    ((pos / GRANULE as u64) & 0x7f_ffff) | 0x80_0000
}

/// The first header word of a record of `kind` with `len` payload bytes at byte position
/// `pos` (a multiple of [`GRANULE`]): what the consumer at `pos` takes for a record. Public
/// so that fuzzing can plant such words where no record was committed.
#[inline]
pub const fn header_word(kind: u8, len: usize, pos: u64) -> u64 {
    (len as u64) | ((kind as u64) << 32) | (seal(pos) << 40)
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
    /// Loom cannot watch an atomic placed in raw memory: under loom the first header word
    /// of each granule is this loom atomic instead.
    #[cfg(fabric_loom)]
    words: Vec<AtomicU64>,
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

    /// The first header word of the granule at `pos` (granule aligned, `< cap`), the word
    /// the producer publishes a record with and the consumer polls. Both ends access it
    /// atomically; plain accesses (an earlier record's payload copied over it) are ordered
    /// before these by the protocol.
    #[cfg(not(fabric_loom))]
    #[inline(always)]
    fn word(&self, pos: usize) -> &AtomicU64 {
        debug_assert!(pos < self.cap && pos.is_multiple_of(GRANULE));
        // SAFETY: `data + pos` is an 8-aligned word inside the data area, alive with `_keep`.
        unsafe { AtomicU64::from_ptr(self.data.add(pos) as *mut u64) }
    }

    #[cfg(fabric_loom)]
    fn word(&self, pos: usize) -> &AtomicU64 {
        &self.words[pos / GRANULE]
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub struct Producer {
    s: Arc<Shared>,
    tail: u64,
    head_cache: u64,
    reserved: usize,
    /// The reserved record's offset and first header word, stored by `commit`.
    record: (usize, u64),
    /// The padding in front of it, when it wraps.
    pad: Option<(usize, u64)>,
    /// Every granule strictly between `tail` and this position has a zero first word.
    cleared: u64,
}

/// The reading end of a ring.
#[derive(Debug)]
pub struct Consumer {
    s: Arc<Shared>,
    head: u64,
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
        #[cfg(fabric_loom)]
        words: (0..cap / GRANULE).map(|_| AtomicU64::new(0)).collect(),
        _keep: keep,
    });
    // SAFETY: caller guarantees `hdr` valid.
    let h = unsafe { &*hdr };
    let head = h.head.0.load(Ordering::Acquire);
    (
        Producer {
            s: s.clone(),
            tail: head,
            head_cache: head,
            reserved: 0,
            record: (0, 0),
            pad: None,
            cleared: head + GRANULE as u64,
        },
        Consumer { s, head },
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

    /// The largest payload one record may carry (so that it always fits in an empty ring,
    /// with wrap-around padding in front of it and the granule after it).
    pub fn max_payload(&self) -> usize {
        self.s.cap / 2 - HEADER
    }

    /// Reserves a record of `len` payload bytes and writes its `aux`. Returns a pointer to
    /// `len` writable payload bytes, or `None` when the ring has no room now (backpressure).
    /// Nothing is visible to the consumer until [`commit`](Self::commit).
    ///
    /// # Panics
    /// If `len > max_payload()` or `kind == KIND_PAD` (caller bugs, not peer input).
    pub fn reserve(&mut self, kind: u8, aux: u64, len: usize) -> Option<*mut u8> {
        assert!(len <= self.max_payload() && kind != KIND_PAD && self.reserved == 0);
        let (pos, pad, need) = self.placement(len);
        if !self.fits(pad + need) {
            return None;
        }
        let mut at = pos;
        let mut start = self.tail;
        if pad > 0 {
            self.s.cells.write(pos / GRANULE, pad / GRANULE);
            self.pad = Some((pos, header_word(KIND_PAD, pad - HEADER, start)));
            start += pad as u64;
            at = 0;
        }
        self.s.cells.write(at / GRANULE, need / GRANULE);
        // SAFETY: `at` is granule aligned and `at + HEADER <= cap`; the bytes belong to the
        // producer (between tail and head + cap), so no one reads them concurrently.
        unsafe { (self.s.data.add(at + 8) as *mut u64).write_volatile(aux) };
        self.record = (at, header_word(kind, len, start));
        self.reserved = pad + need;
        // SAFETY: at + need <= cap, so the payload range lies inside the data area.
        Some(unsafe { self.s.data.add(at + HEADER) })
    }

    /// Where a record of `len` payload bytes goes: the offset of the tail, the padding in
    /// front of the record (the rest of the data area, when the record does not fit there),
    /// and the record's size.
    #[inline]
    fn placement(&self, len: usize) -> (usize, usize, usize) {
        let cap = self.s.cap;
        let need = record_size(len);
        let pos = (self.tail as usize) & (cap - 1);
        let pad = if need > cap - pos { cap - pos } else { 0 };
        (pos, pad, need)
    }

    /// Whether `bytes` (a record and its padding) and the granule after them are free,
    /// refreshing the cached head when they do not seem to be.
    #[inline]
    fn fits(&mut self, bytes: usize) -> bool {
        let cap = self.s.cap as u64;
        let end = self.tail + (bytes + GRANULE) as u64;
        if end - self.head_cache > cap {
            self.head_cache = self.s.hdr().head.0.load(Ordering::Acquire);
            if end - self.head_cache > cap {
                return false;
            }
        }
        true
    }

    /// Publishes the reserved record to the consumer.
    pub fn commit(&mut self) {
        if self.reserved == 0 {
            return;
        }
        let end = self.tail + self.reserved as u64;
        self.reserved = 0;
        if end >= self.cleared {
            // The word the consumer looks at next may hold an earlier lap's bytes: cleared
            // before this record is published (`reserve` made sure the granule is ours).
            self.s
                .word((end as usize) & (self.s.cap - 1))
                .store(0, Ordering::Relaxed);
            self.cleared = end + GRANULE as u64;
        }
        let (at, w0) = self.record;
        self.s.word(at).store(w0, Ordering::Release);
        // Padding last: a consumer that skips it finds the record already there.
        if let Some((at, w0)) = self.pad.take() {
            self.s.word(at).store(w0, Ordering::Release);
        }
        self.tail = end;
        if self.cleared - end < CLEAR_LOW {
            self.clear_ahead();
        }
    }

    /// Moves the cleared mark up to [`CLEAR_AHEAD`] bytes past the tail, as far as the
    /// space the consumer released (by the cached head) allows.
    #[inline(never)]
    fn clear_ahead(&mut self) {
        let limit = (self.tail + CLEAR_AHEAD).min(self.head_cache + self.s.cap as u64);
        let mask = self.s.cap - 1;
        while self.cleared + GRANULE as u64 <= limit {
            self.s
                .word((self.cleared as usize) & mask)
                .store(0, Ordering::Relaxed);
            self.cleared += GRANULE as u64;
        }
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
        let (_, pad, need) = self.placement(len);
        self.fits(pad + need)
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
            let pos = (self.head as usize) & (cap - 1);
            let Some(w0) = self.committed(pos) else {
                return Ok(None);
            };
            let len = (w0 & 0xffff_ffff) as usize;
            let kind = (w0 >> 32) as u8;
            if len > cap {
                return Err(RingError::Corrupt("record length"));
            }
            let size = record_size(len);
            if size > cap - pos {
                return Err(RingError::Corrupt("record length"));
            }
            self.s.cells.read(pos / GRANULE, size / GRANULE);
            if kind == KIND_PAD {
                if size != cap - pos {
                    return Err(RingError::Corrupt("padding length"));
                }
                self.head += size as u64;
                self.s.hdr().head.0.store(self.head, Ordering::Release);
                continue;
            }
            // SAFETY: pos is granule aligned, pos + HEADER <= cap; the producer wrote the
            // word before its Release store of the header word, which we loaded with Acquire.
            let aux = unsafe { (self.s.data.add(pos + 8) as *const u64).read_volatile() };
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
        self.committed((self.head as usize) & (self.s.cap - 1))
            .is_none()
    }

    /// The first header word at the consumer's position `pos` (its offset), if a record was
    /// committed there: `None` while the word is cleared or holds an earlier lap's bytes.
    #[inline]
    fn committed(&self, pos: usize) -> Option<u64> {
        let w0 = self.s.word(pos).load(Ordering::Acquire);
        (w0 >> 40 == seal(self.head)).then_some(w0)
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
        // Four granules: three one-granule records and the granule the next header word is
        // cleared in.
        let (mut p, mut c) = heap(256);
        assert!(p.push(1, 0, &[0; 48]));
        assert!(p.push(1, 1, &[0; 48]));
        assert!(p.push(1, 2, &[0; 48]));
        assert!(!p.has_room(1));
        assert!(!p.push(1, 3, &[0; 1]));
        let r = c.peek().unwrap().unwrap();
        c.consume(&r);
        assert!(p.has_room(1));
        assert!(p.push(1, 3, &[0; 1]));
        for want in 1..4 {
            let r = c.peek().unwrap().unwrap();
            assert_eq!(r.aux, want);
            c.consume(&r);
        }
        assert!(c.is_empty());
    }

    /// Writes a first header word straight into the data area (a hostile producer).
    fn scribble(c: &Consumer, word: usize, value: u64) {
        // SAFETY: test-only write of a word inside the heap ring's data area.
        unsafe { (c.s.data as *mut u64).add(word).write_volatile(value) };
    }

    #[test]
    fn corrupt_headers_are_errors() {
        let (mut p, mut c) = heap(256);
        assert!(p.push(1, 0, &[1; 8]));
        // An absurd length under a seal that is right for the position.
        scribble(&c, 0, u32::MAX as u64 | (1 << 32) | (seal(0) << 40));
        assert_eq!(c.peek(), Err(RingError::Corrupt("record length")));
        // A record that would run past the end of the data area.
        let (_p, mut c) = heap(256);
        scribble(&c, 0, 300 | (1 << 32) | (seal(0) << 40));
        assert_eq!(c.peek(), Err(RingError::Corrupt("record length")));
        // Padding that does not reach the end of the data area.
        let (_p, mut c) = heap(256);
        scribble(&c, 0, header_word(KIND_PAD, 0, 0));
        assert_eq!(c.peek(), Err(RingError::Corrupt("padding length")));
        // A seal for another position is not a record (yet).
        let (_p, mut c) = heap(256);
        scribble(&c, 0, header_word(1, 8, 256));
        assert_eq!(c.peek(), Ok(None));
        assert!(c.is_empty());
    }

    /// A payload from an earlier lap that holds exactly the header the consumer will look
    /// for next is never taken for a record: the producer clears that word before it
    /// publishes the record in front of it.
    #[test]
    fn stale_payload_that_looks_like_the_next_header_is_not_a_record() {
        let (mut p, mut c) = heap(512);
        // Lap 1: a two-granule record at 0 whose payload holds, at byte 64 (granule 1), the
        // header a record at position 512 + 64 = 576 would have, and an aux word.
        let mut payload = vec![0u8; 100];
        payload[48..56].copy_from_slice(&header_word(9, 8, 576).to_le_bytes());
        payload[56..64].copy_from_slice(&77u64.to_le_bytes());
        assert!(p.push(1, 0, &payload));
        let r = c.peek().unwrap().unwrap();
        c.consume(&r);
        // Records at 128 (four granules), 384 and 448, then one at 512 (offset 0) ending at
        // 576: committing it clears the word at offset 64.
        assert!(p.push(1, 1, &[0; 200]));
        assert!(p.push(1, 2, &[0; 8]));
        assert!(p.push(1, 3, &[0; 8]));
        for want in 1..4 {
            let r = c.peek().unwrap().unwrap();
            assert_eq!(r.aux, want);
            c.consume(&r);
        }
        assert!(p.push(1, 4, &[0; 8]));
        let r = c.peek().unwrap().unwrap();
        assert_eq!(r.aux, 4);
        c.consume(&r);
        assert_eq!(
            c.peek(),
            Ok(None),
            "an earlier lap's bytes were taken for a record"
        );
        assert!(c.is_empty());
        assert!(p.push(1, 5, &[0; 8]));
        assert_eq!(c.peek().unwrap().map(|r| r.aux), Some(5));
    }

    /// The same for a record that ends beyond the cleared mark (more than the distance the
    /// producer clears ahead): its end's word is cleared before it is published.
    #[test]
    fn a_record_past_the_cleared_mark_clears_its_end_first() {
        let cap = 8192u64;
        let (mut p, mut c) = heap(cap as usize);
        let pop = |c: &mut Consumer, want: u64| {
            let r = c.peek().unwrap().expect("a record");
            assert_eq!(r.aux, want);
            c.consume(&r);
        };
        // Lap 1: a record at 0 whose payload holds, at offset 3072, the header a record at
        // position cap + 3072 would have.
        let mut payload = vec![0u8; 4000];
        payload[3056..3064].copy_from_slice(&header_word(9, 8, cap + 3072).to_le_bytes());
        assert!(p.push(1, 0, &payload));
        pop(&mut c, 0);
        // The rest of lap 1: 4032..8064, 8064..8128, 8128..8192.
        for (aux, len) in [(1, 4000), (2, 8), (3, 8)] {
            assert!(p.push(1, aux, &vec![0u8; len]));
            pop(&mut c, aux);
        }
        // Lap 2: one record from cap to cap + 3072, past the cleared mark (<= cap + 2048).
        assert!(p.push(1, 4, &[0; 3056]));
        pop(&mut c, 4);
        assert_eq!(
            c.peek(),
            Ok(None),
            "an earlier lap's bytes were taken for a record"
        );
        assert!(p.push(1, 5, &[0; 8]));
        pop(&mut c, 5);
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
