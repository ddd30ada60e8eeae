//! A short deterministic run of the shm ring through many wrap-arounds, sized for Miri
//! (`ci/hardening.sh` runs it under `cargo miri test`): every record comes out once, in
//! order and intact, while the ring wraps with padding records, runs full and runs empty.
#![cfg(not(fabric_loom))]

use fabric_core::ring;

#[test]
fn ring_wraps_many_times_in_order() {
    let (mut p, mut c) = ring::heap(256);
    let (mut sent, mut recvd) = (0u64, 0u64);
    let mut buf = [0u8; 112];
    // Sizes chosen so records of 1..=2 granules and the 112-byte maximum interleave,
    // forcing padding at the end of the ring on most laps.
    let lens = [1usize, 48, 112, 7, 100, 49, 0, 112, 64];
    for step in 0..300usize {
        let len = lens[step % lens.len()];
        if step % 3 != 2 {
            let data: Vec<u8> = (0..len).map(|i| (sent as u8) ^ (i as u8)).collect();
            if p.push(1 + (sent % 250) as u8, sent, &data) {
                sent += 1;
            }
        } else {
            while let Some(rec) = c.peek().expect("honest producer") {
                assert_eq!((rec.aux, rec.kind), (recvd, 1 + (recvd % 250) as u8));
                c.read(&rec, &mut buf[..rec.len]);
                for (i, b) in buf[..rec.len].iter().enumerate() {
                    assert_eq!(*b, (recvd as u8) ^ (i as u8), "torn record {recvd}");
                }
                c.consume(&rec);
                recvd += 1;
            }
            assert!(c.is_empty());
        }
    }
    assert!(recvd > 100, "only {recvd} records went through");
}
