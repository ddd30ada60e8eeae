//! The local description of a queue pair that a peer needs to connect to it, and its
//! fixed little-endian wire format.

use crate::gid::Gid;
use crate::port::Mtu;

/// What a peer needs to reach a queue pair: LID, QP number, first PSN, GID, path MTU and
/// (for UD) the Q_Key.
///
/// Exchange it out of band (TCP, a file, ...) with [`to_bytes`](Self::to_bytes) /
/// [`from_bytes`](Self::from_bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// QP number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// GID (zero when the port has no GID / LID-only InfiniBand).
    pub gid: Gid,
    /// Path MTU this side wants (the connection uses the smaller of both).
    pub mtu: Mtu,
    /// Q_Key (UD only; 0 otherwise).
    pub qkey: u32,
}

/// Why an endpoint blob could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointDecodeError {
    /// The blob has the wrong size.
    #[error("endpoint blob must be {expected} bytes, got {got}")]
    WrongLength {
        /// Expected size.
        expected: usize,
        /// Actual size.
        got: usize,
    },
    /// The magic bytes are wrong (not an endpoint blob).
    #[error("endpoint blob has bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// The format version is not supported.
    #[error("endpoint blob version {0} is not supported (expected {v})", v = Endpoint::VERSION)]
    UnsupportedVersion(u8),
    /// The MTU code is not 1..=5.
    #[error("endpoint blob has invalid MTU code {0}")]
    BadMtu(u8),
    /// The QP number does not fit in 24 bits.
    #[error("endpoint QP number {0:#x} does not fit in 24 bits")]
    QpnOutOfRange(u32),
    /// The PSN does not fit in 24 bits.
    #[error("endpoint PSN {0:#x} does not fit in 24 bits")]
    PsnOutOfRange(u32),
}

impl Endpoint {
    /// Size of the encoding.
    pub const ENCODED_LEN: usize = 36;
    /// Magic bytes at the start of the encoding.
    pub const MAGIC: [u8; 4] = *b"IBEP";
    /// Format version.
    pub const VERSION: u8 = 1;

    /// Encodes: magic (4) | version (1) | MTU code (1) | LID (2) | QPN (4) | PSN (4) |
    /// GID (16, network order) | Q_Key (4); integers little-endian.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..4].copy_from_slice(&Self::MAGIC);
        b[4] = Self::VERSION;
        b[5] = self.mtu as u8;
        b[6..8].copy_from_slice(&self.lid.to_le_bytes());
        b[8..12].copy_from_slice(&self.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid.0);
        b[32..36].copy_from_slice(&self.qkey.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes), validating every field.
    ///
    /// # Errors
    /// An [`EndpointDecodeError`] naming the first bad field.
    pub fn from_bytes(b: &[u8]) -> Result<Self, EndpointDecodeError> {
        if b.len() != Self::ENCODED_LEN {
            return Err(EndpointDecodeError::WrongLength {
                expected: Self::ENCODED_LEN,
                got: b.len(),
            });
        }
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != Self::MAGIC {
            return Err(EndpointDecodeError::BadMagic(magic));
        }
        if b[4] != Self::VERSION {
            return Err(EndpointDecodeError::UnsupportedVersion(b[4]));
        }
        let mtu = Mtu::from_raw(b[5] as u32).ok_or(EndpointDecodeError::BadMtu(b[5]))?;
        let lid = u16::from_le_bytes([b[6], b[7]]);
        let qpn = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if qpn >> 24 != 0 {
            return Err(EndpointDecodeError::QpnOutOfRange(qpn));
        }
        let psn = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        if psn >> 24 != 0 {
            return Err(EndpointDecodeError::PsnOutOfRange(psn));
        }
        let gid = Gid(b[16..32].try_into().expect("16 bytes"));
        let qkey = u32::from_le_bytes(b[32..36].try_into().expect("4 bytes"));
        Ok(Endpoint {
            lid,
            qpn,
            psn,
            gid,
            mtu,
            qkey,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Endpoint {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[127, 0, 0, 1]);
        Endpoint {
            lid: 0x1234,
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            gid: Gid(g),
            mtu: Mtu::Mtu1024,
            qkey: 0x1111_2222,
        }
    }

    #[test]
    fn round_trip() {
        let e = sample();
        let b = e.to_bytes();
        assert_eq!(&b[0..4], b"IBEP");
        assert_eq!(Endpoint::from_bytes(&b).unwrap(), e);
        for mtu in [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu2048, Mtu::Mtu4096] {
            let e = Endpoint { mtu, ..sample() };
            assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
        }
    }

    #[test]
    fn rejects_bad_input_with_typed_errors() {
        let good = sample().to_bytes();
        assert_eq!(
            Endpoint::from_bytes(&[]),
            Err(EndpointDecodeError::WrongLength {
                expected: 36,
                got: 0
            })
        );
        assert_eq!(
            Endpoint::from_bytes(&good[..35]),
            Err(EndpointDecodeError::WrongLength {
                expected: 36,
                got: 35
            })
        );
        let mut long = good.to_vec();
        long.push(0);
        assert!(matches!(
            Endpoint::from_bytes(&long),
            Err(EndpointDecodeError::WrongLength { got: 37, .. })
        ));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Endpoint::from_bytes(&b),
            Err(EndpointDecodeError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = 2;
        assert_eq!(
            Endpoint::from_bytes(&b),
            Err(EndpointDecodeError::UnsupportedVersion(2))
        );
        for bad in [0u8, 6, 255] {
            let mut b = good;
            b[5] = bad;
            assert_eq!(
                Endpoint::from_bytes(&b),
                Err(EndpointDecodeError::BadMtu(bad))
            );
        }
        let mut b = good;
        b[11] = 1;
        assert!(matches!(
            Endpoint::from_bytes(&b),
            Err(EndpointDecodeError::QpnOutOfRange(_))
        ));
        let mut b = good;
        b[15] = 0x80;
        assert!(matches!(
            Endpoint::from_bytes(&b),
            Err(EndpointDecodeError::PsnOutOfRange(_))
        ));
    }

    #[test]
    fn decoder_never_panics_on_arbitrary_bytes() {
        // A small deterministic sweep (the fuzz target covers this exhaustively).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..80 {
            for _ in 0..50 {
                let v: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                let _ = Endpoint::from_bytes(&v);
            }
        }
    }
}
