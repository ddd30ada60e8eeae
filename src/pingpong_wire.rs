//! The out-of-band TCP handshake of rdma-core's `ibv_rc_pingpong`, so that
//! `examples/rc_pingpong.rs` interoperates with it in both directions.
//!
//! The exchange, as rdma-core's example does it (default TCP port [`DEFAULT_PORT`]):
//!
//! 1. the client connects and sends its [`Destination`] as a [`MESSAGE_LEN`]-byte message
//!    `LLLL:QQQQQQ:PPPPPP:GGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGG\0` — LID as 4 hex digits, QP
//!    number and packet sequence number as 6, the 16-byte GID as 32 hex digits in network
//!    byte order, then a NUL;
//! 2. the server reads it, connects its queue pair to it and answers with its own message;
//! 3. the client reads the server's message and answers [`DONE`] (`done\0`), which tells the
//!    server that the client's queue pair is ready too.
//!
//! Everything that comes from the peer goes through [`Destination::decode`] or
//! [`check_done`], which reject anything but the exact format with a typed [`WireError`]:
//! nothing here panics or allocates on bad input (a fuzz target calls them).

use std::fmt;
use std::net::Ipv6Addr;

/// rdma-core's default TCP port for `ibv_rc_pingpong`.
pub const DEFAULT_PORT: u16 = 18515;

/// Length of one address message, NUL included (`sizeof "0000:000000:000000:" + 32 hex`).
pub const MESSAGE_LEN: usize = 52;

/// What the client sends once it has read the server's address: `done` and a NUL.
pub const DONE: &[u8; 5] = b"done\0";

/// The largest queue-pair number or packet sequence number: both are 24-bit.
pub const MAX_24BIT: u32 = 0x00ff_ffff;

/// One side's queue-pair address, as exchanged before the queue pairs connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Destination {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Global identifier, raw bytes in network order (all zero when no GID is used).
    pub gid: [u8; 16],
}

/// Why bytes from the peer are not a valid handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The message does not have the fixed length.
    #[error("handshake message is {found} bytes long, expected {expected}")]
    Length {
        /// Bytes received.
        found: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// A field separator is not `:`.
    #[error("handshake message byte {at} is {found:#04x}, expected ':'")]
    Separator {
        /// Offset in the message.
        at: usize,
        /// The byte found there.
        found: u8,
    },
    /// A field holds something other than hexadecimal digits.
    #[error("handshake {field} field: byte {at} is {found:#04x}, not a hexadecimal digit")]
    NotHex {
        /// `"LID"`, `"QPN"`, `"PSN"` or `"GID"`.
        field: &'static str,
        /// Offset in the message.
        at: usize,
        /// The byte found there.
        found: u8,
    },
    /// The message does not end with a NUL.
    #[error("handshake message ends with {found:#04x}, expected a NUL byte")]
    Terminator {
        /// The last byte.
        found: u8,
    },
    /// A queue-pair or packet sequence number to encode does not fit in 24 bits.
    #[error("{field} {value:#x} does not fit in 24 bits")]
    OutOfRange {
        /// `"QPN"` or `"PSN"`.
        field: &'static str,
        /// The value.
        value: u32,
    },
    /// The client's final message is not `done\0`.
    #[error("expected the client's \"done\" message, got {len} other bytes")]
    NotDone {
        /// Bytes received.
        len: usize,
    },
}

// Offsets of the fields in the message: "LLLL:QQQQQQ:PPPPPP:G{32}\0".
const LID: (usize, usize) = (0, 4);
const QPN: (usize, usize) = (5, 11);
const PSN: (usize, usize) = (12, 18);
const GID: (usize, usize) = (19, 51);
const SEPARATORS: [usize; 3] = [4, 11, 18];

fn hex_value(field: &'static str, at: usize, b: u8) -> Result<u8, WireError> {
    match b {
        b'0'..=b'9' => Ok(b - b'0'),
        b'a'..=b'f' => Ok(b - b'a' + 10),
        b'A'..=b'F' => Ok(b - b'A' + 10),
        found => Err(WireError::NotHex { field, at, found }),
    }
}

fn hex_field(
    msg: &[u8],
    field: &'static str,
    (start, end): (usize, usize),
) -> Result<u32, WireError> {
    msg[start..end]
        .iter()
        .enumerate()
        .try_fold(0u32, |acc, (i, &b)| {
            Ok(acc << 4 | u32::from(hex_value(field, start + i, b)?))
        })
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn put_hex(out: &mut [u8], mut value: u32) {
    for slot in out.iter_mut().rev() {
        *slot = HEX[(value & 0xf) as usize];
        value >>= 4;
    }
}

impl Destination {
    /// Encodes this address as the 52-byte message `ibv_rc_pingpong` sends.
    ///
    /// # Errors
    /// [`WireError::OutOfRange`] when `qpn` or `psn` does not fit in 24 bits (the format
    /// has room for 6 hex digits only).
    pub fn encode(&self) -> Result<[u8; MESSAGE_LEN], WireError> {
        for (field, value) in [("QPN", self.qpn), ("PSN", self.psn)] {
            if value > MAX_24BIT {
                return Err(WireError::OutOfRange { field, value });
            }
        }
        let mut msg = [0u8; MESSAGE_LEN];
        put_hex(&mut msg[LID.0..LID.1], u32::from(self.lid));
        put_hex(&mut msg[QPN.0..QPN.1], self.qpn);
        put_hex(&mut msg[PSN.0..PSN.1], self.psn);
        for at in SEPARATORS {
            msg[at] = b':';
        }
        for (i, b) in self.gid.iter().enumerate() {
            let at = GID.0 + 2 * i;
            msg[at] = HEX[usize::from(b >> 4)];
            msg[at + 1] = HEX[usize::from(b & 0xf)];
        }
        // msg[51] stays the terminating NUL
        Ok(msg)
    }

    /// Decodes a peer's 52-byte message. Accepts exactly the format of
    /// [`encode`](Self::encode) (hex digits in either case), nothing else.
    ///
    /// # Errors
    /// A [`WireError`] naming the first thing wrong: the length, a separator, a non-hex
    /// digit (with its field and offset) or a missing NUL terminator.
    pub fn decode(msg: &[u8]) -> Result<Self, WireError> {
        if msg.len() != MESSAGE_LEN {
            return Err(WireError::Length {
                found: msg.len(),
                expected: MESSAGE_LEN,
            });
        }
        for at in SEPARATORS {
            if msg[at] != b':' {
                return Err(WireError::Separator { at, found: msg[at] });
            }
        }
        if msg[MESSAGE_LEN - 1] != 0 {
            return Err(WireError::Terminator {
                found: msg[MESSAGE_LEN - 1],
            });
        }
        let lid = hex_field(msg, "LID", LID)?;
        let qpn = hex_field(msg, "QPN", QPN)?;
        let psn = hex_field(msg, "PSN", PSN)?;
        let mut gid = [0u8; 16];
        for (i, byte) in gid.iter_mut().enumerate() {
            let at = GID.0 + 2 * i;
            *byte = hex_value("GID", at, msg[at])? << 4 | hex_value("GID", at + 1, msg[at + 1])?;
        }
        Ok(Self {
            // 4 hex digits: fits in 16 bits
            lid: lid as u16,
            qpn,
            psn,
            gid,
        })
    }

    /// The GID as `inet_ntop(AF_INET6, ...)` prints it (what `ibv_rc_pingpong` shows).
    pub fn gid_display(&self) -> GidDisplay {
        GidDisplay(self.gid)
    }
}

/// Checks the client's final `done\0` message.
///
/// # Errors
/// [`WireError::NotDone`] for anything but exactly `done\0`.
pub fn check_done(msg: &[u8]) -> Result<(), WireError> {
    if msg == DONE {
        Ok(())
    } else {
        Err(WireError::NotDone { len: msg.len() })
    }
}

/// Formats a raw GID like glibc's `inet_ntop(AF_INET6, ...)`: RFC 5952 compression, and
/// the IPv4-mapped (`::ffff:a.b.c.d`) and IPv4-compatible (`::a.b.c.d`) forms in dotted quad.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidDisplay(pub [u8; 16]);

impl fmt::Display for GidDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.0;
        // glibc writes ::a.b.c.d when the first 96 bits are zero and the next 16 are not
        // (so :: and ::1 stay hexadecimal); Rust's Ipv6Addr only special-cases ::ffff:.
        if g[..12].iter().all(|&b| b == 0) && (g[12] != 0 || g[13] != 0) {
            return write!(f, "::{}.{}.{}.{}", g[12], g[13], g[14], g[15]);
        }
        write!(f, "{}", Ipv6Addr::from(*g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped_loopback() -> [u8; 16] {
        Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x7f00, 0x0001]).octets()
    }

    #[test]
    fn encodes_like_rdma_core() {
        let d = Destination {
            lid: 0,
            qpn: 0x12,
            psn: 0x89466e,
            gid: mapped_loopback(),
        };
        let msg = d.encode().unwrap();
        assert_eq!(
            &msg[..],
            b"0000:000012:89466e:00000000000000000000ffff7f000001\0"
        );
    }

    #[test]
    fn round_trips() {
        let d = Destination {
            lid: 0xbeef,
            qpn: MAX_24BIT,
            psn: 1,
            gid: Ipv6Addr::new(0xfe80, 0, 0, 0, 0x0200, 0xff, 0xfe00, 0).octets(),
        };
        assert_eq!(Destination::decode(&d.encode().unwrap()), Ok(d));
    }

    #[test]
    fn decodes_uppercase() {
        let d =
            Destination::decode(b"00AB:0000FF:ABCDEF:FE800000000000000000000000000001\0").unwrap();
        assert_eq!((d.lid, d.qpn, d.psn), (0xab, 0xff, 0xabcdef));
        assert_eq!(d.gid[0], 0xfe);
        assert_eq!(d.gid[15], 1);
    }

    #[test]
    fn rejects_out_of_range_on_encode() {
        let d = Destination {
            lid: 0,
            qpn: 0x0100_0000,
            psn: 0,
            gid: [0; 16],
        };
        assert_eq!(
            d.encode(),
            Err(WireError::OutOfRange {
                field: "QPN",
                value: 0x0100_0000
            })
        );
        let d = Destination {
            lid: 0,
            qpn: 0,
            psn: u32::MAX,
            gid: [0; 16],
        };
        assert_eq!(
            d.encode(),
            Err(WireError::OutOfRange {
                field: "PSN",
                value: u32::MAX
            })
        );
    }

    #[test]
    fn rejects_malformed_messages() {
        let good = *b"0000:000012:89466e:00000000000000000000ffff7f000001\0";
        assert!(Destination::decode(&good).is_ok());
        assert_eq!(
            Destination::decode(&good[..51]),
            Err(WireError::Length {
                found: 51,
                expected: 52
            })
        );
        assert_eq!(
            Destination::decode(&[]),
            Err(WireError::Length {
                found: 0,
                expected: 52
            })
        );
        let mut m = good;
        m[11] = b'-';
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::Separator {
                at: 11,
                found: b'-'
            })
        );
        let mut m = good;
        m[51] = b'\n';
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::Terminator { found: b'\n' })
        );
        let mut m = good;
        m[2] = b'g';
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::NotHex {
                field: "LID",
                at: 2,
                found: b'g'
            })
        );
        let mut m = good;
        m[6] = b' ';
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::NotHex {
                field: "QPN",
                at: 6,
                found: b' '
            })
        );
        let mut m = good;
        m[17] = 0;
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::NotHex {
                field: "PSN",
                at: 17,
                found: 0
            })
        );
        let mut m = good;
        m[50] = 0xff;
        assert_eq!(
            Destination::decode(&m),
            Err(WireError::NotHex {
                field: "GID",
                at: 50,
                found: 0xff
            })
        );
    }

    #[test]
    fn every_single_byte_corruption_is_an_error_or_a_hex_change() {
        let good = *b"0000:000012:89466e:00000000000000000000ffff7f000001\0";
        for at in 0..MESSAGE_LEN {
            for b in 0..=255u8 {
                let mut m = good;
                m[at] = b;
                match Destination::decode(&m) {
                    Ok(d) => {
                        // only the original byte, or a hex digit in place of another, decodes
                        assert!(
                            b == good[at] || b.is_ascii_hexdigit(),
                            "byte {b:#x} at {at} accepted"
                        );
                        let again = Destination::decode(&d.encode().unwrap()).unwrap();
                        assert_eq!(again, d);
                    }
                    Err(e) => assert!(!e.to_string().is_empty()),
                }
            }
        }
    }

    #[test]
    fn done_message() {
        assert_eq!(check_done(b"done\0"), Ok(()));
        assert_eq!(check_done(b"done"), Err(WireError::NotDone { len: 4 }));
        assert_eq!(check_done(b"DONE\0"), Err(WireError::NotDone { len: 5 }));
    }

    #[test]
    fn gid_display_matches_inet_ntop() {
        let show = |g: [u8; 16]| GidDisplay(g).to_string();
        assert_eq!(show(mapped_loopback()), "::ffff:127.0.0.1");
        assert_eq!(show(Ipv6Addr::LOCALHOST.octets()), "::1");
        assert_eq!(show([0; 16]), "::");
        assert_eq!(
            show(Ipv6Addr::new(0xfe80, 0, 0, 0, 0x0200, 0xff, 0xfe00, 0).octets()),
            "fe80::200:ff:fe00:0"
        );
        assert_eq!(
            show(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0x0a00, 1).octets()),
            "::10.0.0.1"
        );
    }
}
