//! Challenge–response for the optional shared secret.
//!
//! The server sends a fresh random nonce; the client answers with HMAC-SHA256 (RustCrypto's
//! `hmac` + `sha2`), keyed by the secret, over a label naming the protocol, the nonce and
//! its rank, truncated to its first [`MAC_LEN`] bytes (128 bits, as RFC 2104 §5 allows and
//! RFC 4231 test case 5 exercises); the server verifies in constant time through the `hmac`
//! crate. The tcp backend's connection proof is the same construction under its own label
//! ([`Purpose::Tcp`], through [`response`]), with the connection role in place of the rank:
//! an answer given in one protocol proves nothing in the other, so a squatter on the
//! rendezvous port cannot relay a rank's answer into a tcp connection of the job.
//!
//! What it protects against: strangers and stray jobs that do not know the secret (port
//! scanners, another job's ranks reusing the port, a misconfigured launcher) — they are
//! refused before their blob is accepted, and the secret itself never crosses the wire, so
//! an eavesdropper cannot replay an answer for another nonce. What it does not protect
//! against: an on-path attacker who rewrites traffic after authentication (there is no
//! channel encryption or integrity), or offline guessing of a low-entropy secret from an
//! observed nonce/answer pair. Use a long random secret, and a private network.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{MAC_LEN, NONCE_LEN};

type HmacSha256 = Hmac<Sha256>;

/// Which protocol an answer is for; each has its own label in the MAC input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The bootstrap rendezvous (the id is the joining rank).
    Bootstrap,
    /// The tcp transport's connection proof (the id is the prover's role: listener 0,
    /// connector 1).
    Tcp,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Bootstrap => b"fabric-bootstrap-v2",
            Purpose::Tcp => b"fabric-tcp-proof-v2",
        }
    }
}

fn keyed(purpose: Purpose, secret: &[u8], nonce: &[u8; NONCE_LEN], id: u32) -> HmacSha256 {
    // HMAC accepts a key of any length (longer keys are hashed first), so this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(purpose.label());
    m.update(nonce);
    m.update(&id.to_le_bytes());
    m
}

/// The answer to `nonce` for `id` under `secret`: HMAC-SHA256 over the purpose's label,
/// the nonce and `id` (little-endian), truncated to [`MAC_LEN`] bytes.
pub fn answer(purpose: Purpose, secret: &[u8], nonce: &[u8; NONCE_LEN], id: u32) -> [u8; MAC_LEN] {
    let full = keyed(purpose, secret, nonce, id).finalize().into_bytes();
    let mut out = [0u8; MAC_LEN];
    out.copy_from_slice(&full[..MAC_LEN]);
    out
}

/// Whether `got` is the right answer to `nonce` for `id` under `secret`, compared in
/// constant time (the `hmac` crate's verification, through `subtle`). An answer of any
/// other length than [`MAC_LEN`] is refused.
pub fn verify(
    purpose: Purpose,
    secret: &[u8],
    nonce: &[u8; NONCE_LEN],
    id: u32,
    got: &[u8],
) -> bool {
    got.len() == MAC_LEN
        && keyed(purpose, secret, nonce, id)
            .verify_truncated_left(got)
            .is_ok()
}

/// The tcp transport's proof for `role`: [`answer`] with [`Purpose::Tcp`] (the name the tcp
/// backend calls).
pub fn response(secret: &[u8], nonce: &[u8; NONCE_LEN], role: u32) -> [u8; MAC_LEN] {
    answer(Purpose::Tcp, secret, nonce, role)
}

/// Constant-time equality of two byte strings of the same length (`subtle`); different
/// lengths are unequal (the lengths themselves are public).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
        let mut m = <HmacSha256 as Mac>::new_from_slice(key).unwrap();
        m.update(msg);
        m.finalize().into_bytes().to_vec()
    }

    /// RFC 4231 test cases 1, 2 and 5 (truncation to 128 bits). The expected values were
    /// computed independently with Python's standard library —
    /// `python3 -c 'import hmac,hashlib; print(hmac.new(KEY, MSG, hashlib.sha256).hexdigest())'`
    /// — and agree with the RFC's published values.
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        assert_eq!(
            hmac_sha256(&[0x0b; 20], b"Hi There"),
            hex("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7")
        );
        assert_eq!(
            hmac_sha256(b"Jefe", b"what do ya want for nothing?"),
            hex("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        );
        assert_eq!(
            hmac_sha256(&[0x0c; 20], b"Test With Truncation")[..16],
            hex("a3b6167473100ee06e0c796c2955552b")[..]
        );
    }

    /// Our construction, label ‖ nonce ‖ id (LE), against values computed independently:
    /// `python3 -c 'import hmac,hashlib; print(hmac.new(b"correct horse battery staple",
    /// LABEL + bytes(range(16)) + (7).to_bytes(4, "little"), hashlib.sha256).hexdigest()[:32])'`
    /// with LABEL `b"fabric-bootstrap-v2"` and `b"fabric-tcp-proof-v2"`.
    #[test]
    fn answers_known_answer() {
        let secret = b"correct horse battery staple";
        let nonce: [u8; NONCE_LEN] = core::array::from_fn(|i| i as u8);
        let b = answer(Purpose::Bootstrap, secret, &nonce, 7);
        assert_eq!(b[..], hex("2125a3e60824e2f7f383bc15a117f976")[..]);
        assert!(verify(Purpose::Bootstrap, secret, &nonce, 7, &b));
        let t = response(secret, &nonce, 7);
        assert_eq!(t[..], hex("397ec14bdfd0d9480237adcfc556f42b")[..]);
        assert_eq!(t, answer(Purpose::Tcp, secret, &nonce, 7));
        // One protocol's answer proves nothing in the other.
        assert!(!verify(Purpose::Tcp, secret, &nonce, 7, &b));
        assert!(!verify(Purpose::Bootstrap, secret, &nonce, 7, &t));
    }

    #[test]
    fn wrong_secret_nonce_or_id_is_refused() {
        let p = Purpose::Bootstrap;
        let n = [1u8; NONCE_LEN];
        let r = answer(p, b"s3cret", &n, 1);
        assert!(verify(p, b"s3cret", &n, 1, &r));
        assert!(ct_eq(&r, &answer(p, b"s3cret", &n, 1)));
        assert!(!verify(p, b"s3cret!", &n, 1, &r), "wrong secret accepted");
        assert!(!verify(p, b"", &n, 1, &r), "empty secret accepted");
        assert!(!verify(p, b"s3cret", &[2; NONCE_LEN], 1, &r), "other nonce");
        assert!(!verify(p, b"s3cret", &n, 2, &r), "other rank");
        assert!(!ct_eq(&r, &answer(p, b"s3cret!", &n, 1)));
    }

    #[test]
    fn tampered_or_resized_answers_are_refused() {
        let p = Purpose::Bootstrap;
        let n = [9u8; NONCE_LEN];
        let r = answer(p, b"k", &n, 3);
        for i in 0..MAC_LEN {
            for bit in 0..8 {
                let mut t = r;
                t[i] ^= 1 << bit;
                assert!(!verify(p, b"k", &n, 3, &t), "flipped bit {bit} of byte {i}");
                assert!(!ct_eq(&r, &t));
            }
        }
        assert!(!verify(p, b"k", &n, 3, &r[..MAC_LEN - 1]), "short answer");
        assert!(!verify(p, b"k", &n, 3, &[]), "empty answer");
        let mut long = r.to_vec();
        long.push(0);
        assert!(!verify(p, b"k", &n, 3, &long), "long answer");
        assert!(!ct_eq(&r, &long));
    }
}
