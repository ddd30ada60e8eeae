//! Bootstrap wire format: pure encoders and decoders (no I/O), so fuzz targets and tests
//! can call them directly. Every decoder returns a typed [`DecodeError`] and never panics.
//!
//! A frame is a 12-byte header — magic `u32` (`"FBBS"`), version `u16`, type `u8`,
//! reserved `u8`, payload length `u32`, all little-endian — and the payload. Lengths are
//! checked against a per-type limit *before* anything is allocated or read, so a 4 GiB
//! length prefix is refused from the header alone.

use crate::error::DecodeError;

/// Frame magic ("FBBS").
pub const MAGIC: u32 = 0x5342_4246;
/// The protocol version this build speaks. Version 2: the secret's answer is
/// HMAC-SHA256 (version 1 used a hand-written SipHash), and a rank confirms the table with
/// an [`FrameType::Ack`]. A peer of another version gets [`DecodeError::Version`] from the
/// first header it reads.
pub const VERSION: u16 = 2;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 12;
/// Largest endpoint blob a rank may publish.
pub const MAX_BLOB: usize = 64 << 10;
/// Largest table frame (all ranks' blobs).
pub const MAX_TABLE: usize = 64 << 20;
/// Bytes of the challenge nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of the challenge response.
pub const MAC_LEN: usize = 16;
/// Largest error text.
pub const MAX_ERROR: usize = 1024;
/// Most ranks a [`Lost`] frame names (its text may summarise more).
pub const MAX_LOST: usize = 4096;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameType {
    /// Server → client: nonce (and whether a secret is required).
    Challenge = 1,
    /// Client → server: rank, size, challenge response, blob.
    Hello = 2,
    /// Server → client: every rank's blob.
    Table = 3,
    /// Either way: a refusal with a reason.
    Error = 4,
    /// Client → server, empty: the table arrived complete (the server counts the rank as
    /// served only then).
    Ack = 5,
    /// Server → client: the run failed because ranks were lost ([`Lost`]).
    Lost = 6,
}

impl FrameType {
    fn from(v: u8) -> Option<Self> {
        Some(match v {
            1 => FrameType::Challenge,
            2 => FrameType::Hello,
            3 => FrameType::Table,
            4 => FrameType::Error,
            5 => FrameType::Ack,
            6 => FrameType::Lost,
            _ => return None,
        })
    }
    /// The payload limit of this type.
    pub fn max_len(self) -> usize {
        match self {
            FrameType::Challenge => NONCE_LEN + 4,
            FrameType::Hello => 8 + MAC_LEN + MAX_BLOB,
            FrameType::Table => MAX_TABLE,
            FrameType::Error => MAX_ERROR,
            FrameType::Ack => 0,
            FrameType::Lost => 4 + 4 * MAX_LOST + MAX_ERROR,
        }
    }
}

fn rd_u32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn trunc(what: &'static str, need: usize, got: usize) -> DecodeError {
    DecodeError::Truncated { what, need, got }
}

/// Encodes a frame header.
pub fn encode_header(t: FrameType, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = t as u8;
    h[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

/// Decodes a frame header into `(type, payload length)`.
///
/// # Errors
/// Truncated input, bad magic, another version, a non-zero reserved byte, an unknown
/// type, or a length above the type's limit.
pub fn decode_header(b: &[u8]) -> Result<(FrameType, usize), DecodeError> {
    const W: &str = "bootstrap frame header";
    if b.len() < HEADER_LEN {
        return Err(trunc(W, HEADER_LEN, b.len()));
    }
    let magic = rd_u32(b, 0);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic {
            what: W,
            found: magic as u64,
        });
    }
    let v = u16::from_le_bytes([b[4], b[5]]);
    if v != VERSION {
        return Err(DecodeError::Version {
            what: W,
            found: v as u32,
            expected: VERSION as u32,
        });
    }
    if b[7] != 0 {
        return Err(DecodeError::Invalid {
            what: "bootstrap frame header reserved byte (must be zero)",
            value: b[7] as u64,
        });
    }
    let t = FrameType::from(b[6]).ok_or(DecodeError::Invalid {
        what: "bootstrap frame type",
        value: b[6] as u64,
    })?;
    let len = rd_u32(b, 8) as usize;
    if len > t.max_len() {
        return Err(DecodeError::TooLong {
            what: "bootstrap frame",
            len: len as u64,
            max: t.max_len() as u64,
        });
    }
    Ok((t, len))
}

/// Challenge payload: nonce and whether the server requires a secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// Random nonce.
    pub nonce: [u8; NONCE_LEN],
    /// Whether a response is checked.
    pub secret_required: bool,
}

impl Challenge {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.nonce.to_vec();
        v.extend_from_slice(&(self.secret_required as u32).to_le_bytes());
        v
    }
    /// Decodes the payload.
    ///
    /// # Errors
    /// Wrong length or flag value.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() != NONCE_LEN + 4 {
            return Err(trunc("bootstrap challenge", NONCE_LEN + 4, b.len()));
        }
        let f = rd_u32(b, NONCE_LEN);
        if f > 1 {
            return Err(DecodeError::Invalid {
                what: "bootstrap challenge flag",
                value: f as u64,
            });
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[..NONCE_LEN]);
        Ok(Challenge {
            nonce,
            secret_required: f == 1,
        })
    }
}

/// Hello payload: a rank joining.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The joining rank.
    pub rank: u32,
    /// The world size it believes in.
    pub size: u32,
    /// Challenge response (zeros without a secret).
    pub mac: [u8; MAC_LEN],
    /// Its endpoint blob.
    pub blob: Vec<u8>,
}

impl Hello {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + MAC_LEN + self.blob.len());
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.mac);
        v.extend_from_slice(&self.blob);
        v
    }
    /// Decodes the payload.
    ///
    /// # Errors
    /// Too short, a blob over [`MAX_BLOB`], or rank/size out of range.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < 8 + MAC_LEN {
            return Err(trunc("bootstrap hello", 8 + MAC_LEN, b.len()));
        }
        let blob = &b[8 + MAC_LEN..];
        if blob.len() > MAX_BLOB {
            return Err(DecodeError::TooLong {
                what: "endpoint blob",
                len: blob.len() as u64,
                max: MAX_BLOB as u64,
            });
        }
        let (rank, size) = (rd_u32(b, 0), rd_u32(b, 4));
        if size == 0 || rank >= size {
            return Err(DecodeError::Invalid {
                what: "bootstrap rank",
                value: rank as u64,
            });
        }
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[8..8 + MAC_LEN]);
        Ok(Hello {
            rank,
            size,
            mac,
            blob: blob.to_vec(),
        })
    }
}

/// Lost payload: the ranks whose loss failed the run (ascending), and what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The lost ranks (at most [`MAX_LOST`] travel).
    pub ranks: Vec<u32>,
    /// What happened to them (at most [`MAX_ERROR`] bytes travel).
    pub reason: String,
}

impl Lost {
    /// Encodes the payload: `n: u32`, `n` ranks (`u32` each), the reason's UTF-8 bytes
    /// (cut at a character boundary to [`MAX_ERROR`]).
    pub fn encode(&self) -> Vec<u8> {
        let ranks = &self.ranks[..self.ranks.len().min(MAX_LOST)];
        let mut cut = self.reason.len().min(MAX_ERROR);
        while !self.reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut v = Vec::with_capacity(4 + 4 * ranks.len() + cut);
        v.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
        for r in ranks {
            v.extend_from_slice(&r.to_le_bytes());
        }
        v.extend_from_slice(&self.reason.as_bytes()[..cut]);
        v
    }

    /// Decodes the payload.
    ///
    /// # Errors
    /// Truncation, more than [`MAX_LOST`] ranks, a reason over [`MAX_ERROR`] bytes or not
    /// UTF-8.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = "bootstrap lost-ranks frame";
        if b.len() < 4 {
            return Err(trunc(W, 4, b.len()));
        }
        let n = rd_u32(b, 0) as usize;
        if n > MAX_LOST {
            return Err(DecodeError::TooLong {
                what: "bootstrap lost-ranks list",
                len: n as u64,
                max: MAX_LOST as u64,
            });
        }
        let need = 4 + 4 * n;
        if b.len() < need {
            return Err(trunc(W, need, b.len()));
        }
        let ranks = (0..n).map(|i| rd_u32(b, 4 + 4 * i)).collect();
        let text = &b[need..];
        if text.len() > MAX_ERROR {
            return Err(DecodeError::TooLong {
                what: "bootstrap lost-ranks reason",
                len: text.len() as u64,
                max: MAX_ERROR as u64,
            });
        }
        let reason = std::str::from_utf8(text)
            .map_err(|_| DecodeError::Invalid {
                what: "bootstrap lost-ranks reason encoding",
                value: text.len() as u64,
            })?
            .to_string();
        Ok(Lost { ranks, reason })
    }
}

/// One rank's entry in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEntry {
    /// Its rank.
    pub rank: u32,
    /// The IP address the server saw it connect from (empty for the server itself).
    pub ip: String,
    /// Its endpoint blob.
    pub blob: Vec<u8>,
}

/// Encodes the table payload: `n: u32`, then per rank `rank u32, ip_len u8, ip, blob_len
/// u32, blob`.
pub fn encode_table(entries: &[PeerEntry]) -> Vec<u8> {
    let mut v = (entries.len() as u32).to_le_bytes().to_vec();
    for e in entries {
        v.extend_from_slice(&e.rank.to_le_bytes());
        let ip = &e.ip.as_bytes()[..e.ip.len().min(255)];
        v.push(ip.len() as u8);
        v.extend_from_slice(ip);
        v.extend_from_slice(&(e.blob.len() as u32).to_le_bytes());
        v.extend_from_slice(&e.blob);
    }
    v
}

/// Decodes the table payload; ranks must be exactly `0..n` in order.
///
/// # Errors
/// Truncation, oversized blobs, ranks out of order, non-UTF-8 addresses, trailing bytes.
pub fn decode_table(b: &[u8]) -> Result<Vec<PeerEntry>, DecodeError> {
    const W: &str = "bootstrap table";
    if b.len() < 4 {
        return Err(trunc(W, 4, b.len()));
    }
    let n = rd_u32(b, 0) as usize;
    // Each entry needs at least 9 bytes: refuse absurd counts before allocating.
    if n > (b.len() - 4) / 9 {
        return Err(DecodeError::Invalid {
            what: "bootstrap table count",
            value: n as u64,
        });
    }
    let mut out = Vec::with_capacity(n);
    let mut o = 4;
    for i in 0..n {
        if b.len() < o + 5 {
            return Err(trunc(W, o + 5, b.len()));
        }
        let rank = rd_u32(b, o);
        if rank as usize != i {
            return Err(DecodeError::Invalid {
                what: "bootstrap table rank",
                value: rank as u64,
            });
        }
        let ip_len = b[o + 4] as usize;
        o += 5;
        if b.len() < o + ip_len + 4 {
            return Err(trunc(W, o + ip_len + 4, b.len()));
        }
        let ip = std::str::from_utf8(&b[o..o + ip_len])
            .map_err(|_| DecodeError::Invalid {
                what: "bootstrap table address",
                value: i as u64,
            })?
            .to_string();
        o += ip_len;
        let bl = rd_u32(b, o) as usize;
        o += 4;
        if bl > MAX_BLOB {
            return Err(DecodeError::TooLong {
                what: "endpoint blob",
                len: bl as u64,
                max: MAX_BLOB as u64,
            });
        }
        if b.len() < o + bl {
            return Err(trunc(W, o + bl, b.len()));
        }
        out.push(PeerEntry {
            rank,
            ip,
            blob: b[o..o + bl].to_vec(),
        });
        o += bl;
    }
    if o != b.len() {
        return Err(DecodeError::Trailing {
            what: W,
            extra: b.len() - o,
        });
    }
    Ok(out)
}

/// What a rank publishes about itself: which host (for "same host → shm"), whether it has
/// an active RDMA port, and the addresses of its transport listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// Host identity (boot id + network namespace).
    pub host: String,
    /// An active RDMA port is present.
    pub rdma: bool,
    /// Listener addresses (`shm:@...`, `tcp:*:PORT` where `*` = the bootstrap IP).
    pub addrs: Vec<String>,
}

const INFO_MAGIC: u32 = 0x4946_4245; // "EBFI"
const INFO_VERSION: u16 = 1;
const MAX_ADDR: usize = 1024;
const MAX_ADDRS: usize = 16;

impl EndpointInfo {
    /// Encodes the blob.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = INFO_MAGIC.to_le_bytes().to_vec();
        v.extend_from_slice(&INFO_VERSION.to_le_bytes());
        v.push(self.rdma as u8);
        v.push(self.addrs.len().min(MAX_ADDRS) as u8);
        let put = |v: &mut Vec<u8>, s: &str| {
            let s = &s.as_bytes()[..s.len().min(MAX_ADDR)];
            v.extend_from_slice(&(s.len() as u16).to_le_bytes());
            v.extend_from_slice(s);
        };
        put(&mut v, &self.host);
        for a in self.addrs.iter().take(MAX_ADDRS) {
            put(&mut v, a);
        }
        v
    }

    /// Decodes the blob.
    ///
    /// # Errors
    /// Bad magic/version, truncation, strings too long or not UTF-8, trailing bytes.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = "endpoint info";
        if b.len() < 8 {
            return Err(trunc(W, 8, b.len()));
        }
        let magic = rd_u32(b, 0);
        if magic != INFO_MAGIC {
            return Err(DecodeError::BadMagic {
                what: W,
                found: magic as u64,
            });
        }
        let v = u16::from_le_bytes([b[4], b[5]]);
        if v != INFO_VERSION {
            return Err(DecodeError::Version {
                what: W,
                found: v as u32,
                expected: INFO_VERSION as u32,
            });
        }
        if b[6] > 1 {
            return Err(DecodeError::Invalid {
                what: "endpoint info rdma flag",
                value: b[6] as u64,
            });
        }
        let n = b[7] as usize;
        if n > MAX_ADDRS {
            return Err(DecodeError::Invalid {
                what: "endpoint info address count",
                value: n as u64,
            });
        }
        let mut o = 8;
        let get = |o: &mut usize| -> Result<String, DecodeError> {
            if b.len() < *o + 2 {
                return Err(trunc(W, *o + 2, b.len()));
            }
            let l = u16::from_le_bytes([b[*o], b[*o + 1]]) as usize;
            if l > MAX_ADDR {
                return Err(DecodeError::TooLong {
                    what: "endpoint address",
                    len: l as u64,
                    max: MAX_ADDR as u64,
                });
            }
            *o += 2;
            if b.len() < *o + l {
                return Err(trunc(W, *o + l, b.len()));
            }
            let s = std::str::from_utf8(&b[*o..*o + l]).map_err(|_| DecodeError::Invalid {
                what: "endpoint address encoding",
                value: l as u64,
            })?;
            *o += l;
            Ok(s.to_string())
        };
        let host = get(&mut o)?;
        let mut addrs = Vec::with_capacity(n);
        for _ in 0..n {
            addrs.push(get(&mut o)?);
        }
        if o != b.len() {
            return Err(DecodeError::Trailing {
                what: W,
                extra: b.len() - o,
            });
        }
        Ok(EndpointInfo {
            host,
            rdma: b[6] == 1,
            addrs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let h = Hello {
            rank: 3,
            size: 4,
            mac: [7; MAC_LEN],
            blob: b"abc".to_vec(),
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let t = vec![
            PeerEntry {
                rank: 0,
                ip: String::new(),
                blob: vec![1, 2],
            },
            PeerEntry {
                rank: 1,
                ip: "10.0.0.2".into(),
                blob: vec![],
            },
        ];
        assert_eq!(decode_table(&encode_table(&t)).unwrap(), t);
        let i = EndpointInfo {
            host: "boot:net".into(),
            rdma: true,
            addrs: vec!["shm:@x".into(), "tcp:*:4000".into()],
        };
        assert_eq!(EndpointInfo::decode(&i.encode()).unwrap(), i);
        let c = Challenge {
            nonce: [9; NONCE_LEN],
            secret_required: true,
        };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        let l = Lost {
            ranks: vec![3, 999],
            reason: "rank 3: never joined; rank 999: hung up".into(),
        };
        assert_eq!(Lost::decode(&l.encode()).unwrap(), l);
        // A long reason is cut at a character boundary, and still decodes.
        let long = Lost {
            ranks: vec![1],
            reason: "é".repeat(MAX_ERROR),
        };
        let d = Lost::decode(&long.encode()).unwrap();
        assert!(d.reason.len() <= MAX_ERROR && long.reason.starts_with(&d.reason));
    }

    #[test]
    fn another_protocol_version_is_a_version_error() {
        // Version 1 (the SipHash MAC, no Ack) must not be half-understood.
        let mut h = encode_header(FrameType::Challenge, NONCE_LEN + 4);
        h[4..6].copy_from_slice(&1u16.to_le_bytes());
        assert!(
            matches!(
                decode_header(&h),
                Err(DecodeError::Version {
                    found: 1,
                    expected: 2,
                    ..
                })
            ),
            "{:?}",
            decode_header(&h)
        );
        // An Ack carries nothing.
        assert!(matches!(
            decode_header(&encode_header(FrameType::Ack, 1)),
            Err(DecodeError::TooLong { .. })
        ));
        assert_eq!(
            decode_header(&encode_header(FrameType::Ack, 0)).unwrap(),
            (FrameType::Ack, 0)
        );
        // Lost frames: too many ranks, truncated lists, bad text.
        let mut b = ((MAX_LOST + 1) as u32).to_le_bytes().to_vec();
        b.resize(4 + 4 * (MAX_LOST + 1), 0);
        assert!(matches!(Lost::decode(&b), Err(DecodeError::TooLong { .. })));
        assert!(matches!(
            Lost::decode(&[2, 0, 0, 0, 1, 0, 0, 0]),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            Lost::decode(&[0, 0, 0, 0, 0xff]),
            Err(DecodeError::Invalid { .. })
        ));
    }

    #[test]
    fn hostile_headers_are_typed_errors() {
        let mut h = encode_header(FrameType::Hello, 10);
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_header(&h),
            Err(DecodeError::TooLong { .. })
        ));
        let mut r = encode_header(FrameType::Hello, 10);
        r[7] = 1; // reserved
        assert!(
            matches!(decode_header(&r), Err(DecodeError::Invalid { .. })),
            "reserved byte ignored"
        );
        assert!(matches!(
            decode_header(b"GET / HTTP/1.1"),
            Err(DecodeError::BadMagic { .. })
        ));
        assert!(matches!(
            decode_header(&h[..5]),
            Err(DecodeError::Truncated { .. })
        ));
        let mut t = encode_table(&[]);
        t[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_table(&t).is_err());
        assert!(EndpointInfo::decode(&[0xff; 40]).is_err());
        // Every prefix of a valid message is an error, never a panic.
        let i = EndpointInfo {
            host: "h".into(),
            rdma: false,
            addrs: vec!["tcp:*:1".into()],
        }
        .encode();
        for n in 0..i.len() {
            assert!(EndpointInfo::decode(&i[..n]).is_err());
        }
    }
}
