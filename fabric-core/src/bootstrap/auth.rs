//! Challenge–response for the optional shared secret.
//!
//! The server sends a fresh random nonce; the client answers with a 128-bit keyed hash
//! (SipHash-2-4, keyed by a key derived from the secret) of the nonce and its rank; the
//! server compares in constant time.
//!
//! What it protects against: strangers and stray jobs that do not know the secret (port
//! scanners, another job's ranks reusing the port, a misconfigured launcher) — they are
//! refused before their blob is accepted, and the secret itself never crosses the wire, so
//! an eavesdropper cannot replay an answer for another nonce. What it does not protect
//! against: an on-path attacker who rewrites traffic after authentication (there is no
//! channel encryption or integrity), or offline guessing of a low-entropy secret from an
//! observed nonce/answer pair. Use a long random secret, and a private network.

use super::wire::{MAC_LEN, NONCE_LEN};

fn sipround(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13);
    v[1] ^= v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16);
    v[3] ^= v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21);
    v[3] ^= v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17);
    v[1] ^= v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-2-4 of `msg` under the 128-bit key `(k0, k1)`.
pub fn siphash24(k0: u64, k1: u64, msg: &[u8]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let mut chunks = msg.chunks_exact(8);
    for c in &mut chunks {
        let m = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        v[3] ^= m;
        sipround(&mut v);
        sipround(&mut v);
        v[0] ^= m;
    }
    let rest = chunks.remainder();
    let mut last = (msg.len() as u64 & 0xff) << 56;
    for (i, b) in rest.iter().enumerate() {
        last |= (*b as u64) << (8 * i);
    }
    v[3] ^= last;
    sipround(&mut v);
    sipround(&mut v);
    v[0] ^= last;
    v[2] ^= 0xff;
    for _ in 0..4 {
        sipround(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// The answer to `nonce` for `rank` under `secret`.
pub fn response(secret: &[u8], nonce: &[u8; NONCE_LEN], rank: u32) -> [u8; MAC_LEN] {
    let k0 = siphash24(0x6661_6272_6963_2d6b, 0x6b30, secret);
    let k1 = siphash24(0x6661_6272_6963_2d6b, 0x6b31, secret);
    let mut msg = Vec::with_capacity(NONCE_LEN + 24);
    msg.extend_from_slice(b"fabric-bootstrap-v1");
    msg.extend_from_slice(nonce);
    msg.extend_from_slice(&rank.to_le_bytes());
    let a = siphash24(k0, k1, &msg);
    msg.push(1);
    let b = siphash24(k0, k1, &msg);
    let mut out = [0u8; MAC_LEN];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

/// Constant-time equality (no early exit on the first differing byte).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut d = 0u8;
    for (x, y) in a.iter().zip(b) {
        d |= x ^ y;
    }
    std::hint::black_box(d) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_reference_vector() {
        // The SipHash paper's test vector: key 00..0f, message 00..0e.
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let msg: Vec<u8> = (0..15).collect();
        assert_eq!(siphash24(k0, k1, &msg), 0xa129_ca61_49be_45e5);
    }

    #[test]
    fn responses_differ_by_secret_nonce_and_rank() {
        let n = [1u8; NONCE_LEN];
        let r = response(b"s3cret", &n, 1);
        assert!(ct_eq(&r, &response(b"s3cret", &n, 1)));
        assert!(!ct_eq(&r, &response(b"s3cret!", &n, 1)));
        assert!(!ct_eq(&r, &response(b"s3cret", &[2; NONCE_LEN], 1)));
        assert!(!ct_eq(&r, &response(b"s3cret", &n, 2)));
    }
}
