//! loom models of the shm SPSC ring (`src/ring.rs`), beyond the in-module model:
//! wrap-around with padding records, records of the largest payload (two fill the ring),
//! one-granule records filling it exactly, `is_empty` / `has_room` across threads, and
//! reserve-without-commit.
//!
//! Run: `RUSTFLAGS="--cfg fabric_loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release
//! -p fabric-core --test loom_ring` (CI: `ci/hardening.sh`). Loom's `UnsafeCell` tracking
//! of the payload granules (`src/sync.rs`) reports any read of bytes the producer has not
//! published, so a missing Release/Acquire pair or an off-by-one on wrap fails here.
#![cfg(fabric_loom)]

use fabric_core::ring::{self, Consumer, Producer};
use loom::thread;

/// The preemption bound: `LOOM_MAX_PREEMPTIONS` (CI sets it), 3 by default.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(
        std::env::var("LOOM_MAX_PREEMPTIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3),
    );
    b.check(f);
}

fn payload(seq: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seq.wrapping_mul(31) ^ i as u8).collect()
}

fn push_all(mut p: Producer, lens: &'static [usize]) {
    for (i, &len) in lens.iter().enumerate() {
        let data = payload(i as u8, len);
        while !p.push(1 + i as u8, i as u64, &data) {
            thread::yield_now();
        }
    }
}

fn pop_all(c: &mut Consumer, lens: &[usize]) {
    let mut buf = vec![0u8; 256];
    for (i, &len) in lens.iter().enumerate() {
        let rec = loop {
            match c.peek().expect("an honest producer never looks corrupt") {
                Some(r) => break r,
                None => thread::yield_now(),
            }
        };
        assert_eq!(
            (rec.kind, rec.aux, rec.len),
            (1 + i as u8, i as u64, len),
            "lost, duplicated or reordered record"
        );
        c.read(&rec, &mut buf[..len]);
        assert_eq!(&buf[..len], &payload(i as u8, len)[..], "torn record {i}");
        c.consume(&rec);
    }
    assert!(c.peek().unwrap().is_none(), "a record appeared twice");
}

/// 256-byte ring: records of 128, 64 and 128 bytes. The third does not fit in the 64 bytes
/// left before the end, so the producer writes a padding record and wraps to 0 — which it
/// may only do once the consumer released the first record.
#[test]
fn loom_ring_wraps_with_padding() {
    static LENS: [usize; 3] = [100, 40, 100];
    model(|| {
        let (p, mut c) = ring::heap(256);
        let t = thread::spawn(move || push_all(p, &LENS));
        pop_all(&mut c, &LENS);
        t.join().unwrap();
    });
}

/// The largest payload fills half the ring; two of them fill it exactly (full, not
/// overwritten), the third must wait for space and lands at offset 0 again.
#[test]
fn loom_ring_max_payload_full_then_reuse() {
    static LENS: [usize; 3] = [112, 112, 112];
    model(|| {
        let (p, mut c) = ring::heap(256);
        assert_eq!(p.max_payload(), 112);
        let t = thread::spawn(move || push_all(p, &LENS));
        pop_all(&mut c, &LENS);
        t.join().unwrap();
    });
}

/// Five one-granule records in a four-granule ring: three fit (the fourth granule is where
/// the next header word is kept cleared), the fourth and fifth must wait until records are
/// released (an off-by-one in the full check would overwrite an unread record or clear the
/// header word the consumer is about to read).
#[test]
fn loom_ring_one_granule_records_fill_exactly() {
    static LENS: [usize; 5] = [40, 41, 42, 43, 44];
    model(|| {
        let (p, mut c) = ring::heap(256);
        let t = thread::spawn(move || push_all(p, &LENS));
        pop_all(&mut c, &LENS);
        t.join().unwrap();
    });
}

/// `is_empty` and `has_room` from the other side's thread: a consumer that sees
/// "not empty" finds a record; a producer told "room" succeeds at once.
#[test]
fn loom_ring_empty_and_room_agree_with_peek_and_push() {
    model(|| {
        let (mut p, mut c) = ring::heap(256);
        let t = thread::spawn(move || {
            for i in 0..3u8 {
                while !p.has_room(100) {
                    thread::yield_now();
                }
                assert!(
                    p.push(1 + i, i as u64, &payload(i, 100)),
                    "has_room said yes"
                );
            }
        });
        let mut got = 0u8;
        let mut buf = [0u8; 100];
        while got < 3 {
            if c.is_empty() {
                thread::yield_now();
                continue;
            }
            let rec = c.peek().unwrap().expect("not empty, yet no record");
            assert_eq!(rec.aux, got as u64);
            c.read(&rec, &mut buf);
            assert_eq!(&buf[..], &payload(got, 100)[..]);
            c.consume(&rec);
            got += 1;
        }
        t.join().unwrap();
    });
}

/// A reserved record is invisible until `commit`: the consumer sees nothing or the whole,
/// committed record, never its header before its payload.
#[test]
fn loom_ring_reserve_is_invisible_until_commit() {
    model(|| {
        let (mut p, mut c) = ring::heap(256);
        let t = thread::spawn(move || {
            let dst = p.reserve(7, 42, 64).expect("empty ring has room");
            let data = payload(9, 64);
            // SAFETY: `reserve` returned 64 writable bytes owned by the producer until commit.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, 64) };
            thread::yield_now();
            p.commit();
        });
        let mut buf = [0u8; 64];
        loop {
            match c.peek().unwrap() {
                Some(rec) => {
                    assert_eq!((rec.kind, rec.aux, rec.len), (7, 42, 64));
                    c.read(&rec, &mut buf);
                    assert_eq!(&buf[..], &payload(9, 64)[..]);
                    c.consume(&rec);
                    break;
                }
                None => thread::yield_now(),
            }
        }
        t.join().unwrap();
    });
}
