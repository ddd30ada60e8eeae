//! Op-sequence fuzzing of the shm SPSC ring (single-threaded; the loom models cover the
//! concurrency). Two parts:
//!
//! 1. An honest producer and consumer run any sequence of pushes, peeks, reads and
//!    consumes against a reference model: records come out in order, untorn, exactly once;
//!    `push` refuses exactly when the bytes (records + wrap padding + the one granule
//!    after them whose header word the producer clears) do not fit, and `is_empty` /
//!    `has_room` agree with the model. Payloads are filled with words that look like the
//!    record headers of later positions, so a stale payload taken for a record shows.
//! 2. A hostile producer then scribbles arbitrary words (headers among them) into the
//!    shared memory: the consumer must answer `Corrupt`, nothing, or a record inside the
//!    ring — never a panic, and never an out-of-bounds access (AddressSanitizer watches).
#![no_main]

use std::collections::VecDeque;
use std::sync::Arc;

use arbitrary::Arbitrary;
use fabric_core::ring::{self, header_word, record_size, RingHeader, GRANULE, HEADER, KIND_PAD};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Op {
    Push {
        len: u16,
        kind: u8,
        fill: u8,
        fake: u16,
    },
    Pop,
    PeekOnly,
    IsEmpty,
    HasRoom {
        len: u16,
    },
}

#[derive(Debug, Arbitrary)]
enum Scribble {
    Word {
        at: u16,
        value: u64,
    },
    /// A header word with the seal of the consumer's next position `ahead` granules on.
    Header {
        ahead: u8,
        len: u32,
        kind: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    cap_log2: u8,
    ops: Vec<Op>,
    scribbles: Vec<Scribble>,
    hostile_reads: u8,
}

#[repr(C, align(128))]
struct HeaderMem([u8; 256]);

/// Ring memory the fuzzer can also scribble on (the shm transport maps the same layout).
struct Mem {
    hdr: Box<HeaderMem>,
    data: Box<[u64]>,
}

fuzz_target!(|inp: Input| {
    let cap = 1usize << (8 + inp.cap_log2 % 5); // 256 B .. 4 KiB: wraps often
    let mem = Arc::new(Mem {
        hdr: Box::new(HeaderMem([0; 256])),
        data: vec![0u64; cap / 8].into_boxed_slice(),
    });
    let hdr = mem.hdr.0.as_ptr() as *const RingHeader;
    let data = mem.data.as_ptr() as *mut u8;
    struct Keep(#[allow(dead_code)] Arc<Mem>);
    // SAFETY: the Arc keeps `mem` alive; only the producer/consumer (and, in part 2, the
    // fuzzer acting as a hostile producer) touch it.
    unsafe impl Send for Keep {}
    // SAFETY: as above.
    unsafe impl Sync for Keep {}
    // SAFETY: `hdr` is 128-aligned zeroed memory (a valid empty header) of 256 bytes;
    // `data` is `cap` bytes (a power of two >= 4 granules); one producer, one consumer.
    let (mut p, mut c) = unsafe { ring::from_raw(hdr, data, cap, Arc::new(Keep(mem.clone()))) };
    assert_eq!(p.capacity(), cap);

    // Part 1: honest ends against a model.
    let mut model: VecDeque<(u8, u64, Vec<u8>)> = VecDeque::new();
    let (mut tail, mut head) = (0u64, 0u64); // model positions in bytes
                                             // (padding before it, its size, padding already skipped by a peek) per queued record
    let mut sizes: VecDeque<(u64, u64, bool)> = VecDeque::new();
    let mut seq = 0u64;
    for op in inp.ops.iter().take(512) {
        match *op {
            Op::Push {
                len,
                kind,
                fill,
                fake,
            } => {
                let len = len as usize % (p.max_payload() + 1);
                let kind = if kind == KIND_PAD { 1 } else { kind };
                let need = record_size(len);
                let pos = (tail as usize) % cap;
                let pad = if need > cap - pos { cap - pos } else { 0 };
                let fits = tail + (pad + need + GRANULE) as u64 - head <= cap as u64;
                let mut payload: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
                // Words that a consumer of a later lap would take for the header at their
                // granule (a one-granule record of `kind`) if the producer left them there.
                let start = tail + pad as u64;
                let mut at = (GRANULE - HEADER) + (fake as usize % 4) * GRANULE;
                while at + 8 <= len {
                    let lap_pos = start + (HEADER + at) as u64 + cap as u64;
                    payload[at..at + 8]
                        .copy_from_slice(&header_word(kind, 8, lap_pos).to_le_bytes());
                    at += GRANULE * (1 + fake as usize % 3);
                }
                let ok = p.push(kind, seq, &payload);
                assert_eq!(ok, fits, "push of {len} B: ring said {ok}, model {fits}");
                if ok {
                    tail += (pad + need) as u64;
                    sizes.push_back((pad as u64, need as u64, false));
                    model.push_back((kind, seq, payload));
                    seq += 1;
                }
            }
            Op::Pop | Op::PeekOnly => {
                let got = c.peek().expect("honest producer: never corrupt");
                match (got, model.front()) {
                    (None, None) => {}
                    (Some(rec), Some((kind, aux, payload))) => {
                        // `peek` skips (and releases) the padding in front of the record.
                        let front = sizes.front_mut().expect("model size");
                        if !front.2 {
                            head += front.0;
                            front.2 = true;
                        }
                        assert_eq!((rec.kind, rec.aux, rec.len), (*kind, *aux, payload.len()));
                        let mut buf = vec![0u8; rec.len];
                        c.read(&rec, &mut buf);
                        assert_eq!(&buf, payload, "torn record");
                        if matches!(op, Op::Pop) {
                            c.consume(&rec);
                            model.pop_front();
                            head += sizes.pop_front().expect("model size").1;
                        }
                    }
                    (got, want) => panic!("ring gave {got:?}, model {want:?}"),
                }
            }
            Op::IsEmpty => {
                // Padding is only ever written just before a record.
                assert_eq!(c.is_empty(), model.is_empty());
            }
            Op::HasRoom { len } => {
                let len = len as usize % (p.max_payload() + 1);
                let need = record_size(len);
                let pos = (tail as usize) % cap;
                let pad = if need > cap - pos { cap - pos } else { 0 };
                let fits = tail + (pad + need + GRANULE) as u64 - head <= cap as u64;
                assert_eq!(p.has_room(len), fits, "has_room({len})");
            }
        }
    }

    // Part 2: a hostile producer.
    let words = cap / 8;
    for s in inp.scribbles.iter().take(64) {
        match *s {
            Scribble::Header { ahead, len, kind } => {
                let at = head + (ahead as u64 % 8) * GRANULE as u64;
                let i = (at as usize % cap) / 8;
                let w = header_word(kind, len as usize, at);
                // SAFETY: in bounds of the data area (a granule's first word).
                unsafe { (mem.data.as_ptr() as *mut u64).add(i).write_volatile(w) };
            }
            Scribble::Word { at, value } => {
                let i = at as usize % words;
                // SAFETY: in bounds of the data area; the consumer reads it volatile.
                unsafe { (mem.data.as_ptr() as *mut u64).add(i).write_volatile(value) };
            }
        }
    }
    for _ in 0..inp.hostile_reads % 32 {
        match c.peek() {
            Ok(Some(rec)) => {
                assert!(rec.len <= cap - 16 && rec.kind != KIND_PAD);
                let mut buf = vec![0u8; rec.len];
                c.read(&rec, &mut buf);
                c.consume(&rec);
            }
            Ok(None) | Err(_) => break,
        }
    }
    drop(p);
});
