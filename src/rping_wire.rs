//! The `rdma_info` message of rdma-core's `rping` (rdmacm-utils): a peer advertises one
//! buffer as 16 bytes — its address (big-endian u64), rkey (big-endian u32) and size
//! (big-endian u32) — and the checks our `rping` applies before using one.
//!
//! Per iteration the client advertises its source buffer, the server RDMA READs it, answers
//! with its own advertisement (the "go ahead"), the client advertises its sink buffer, the
//! server RDMA WRITEs the data there and answers again.

use ibverbs_safe::RemoteMemory;

/// Size of an `rdma_info` message.
pub const INFO_LEN: usize = 16;
/// rping's default ping size.
pub const DEFAULT_SIZE: usize = 64;
/// rping's largest ping size (64 KiB).
pub const MAX_SIZE: usize = 64 * 1024;
/// rping's smallest ping size: room for "rdma-ping-%d: " with the largest count.
pub const MIN_SIZE: usize = 26;

/// A buffer advertisement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaInfo {
    /// Address of the buffer in the sender's address space.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// Its size in bytes.
    pub size: u32,
}

/// Why a received `rdma_info` cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InfoError {
    /// The message is not 16 bytes (rping: "Received bogus data").
    #[error("Received bogus data, size {0} (an rdma_info is {INFO_LEN} bytes)")]
    BogusSize(usize),
    /// The advertised buffer is empty.
    #[error("the peer advertised an empty buffer")]
    Empty,
    /// The advertised buffer is larger than ours (a READ of it would not fit).
    #[error("the peer advertised {advertised} bytes, more than our {ours}-byte buffer")]
    TooLarge {
        /// Advertised size.
        advertised: u32,
        /// Our buffer's size.
        ours: usize,
    },
    /// The advertised buffer is smaller than what we must write into it.
    #[error("the peer advertised {advertised} bytes, less than the {needed} bytes to write")]
    TooSmall {
        /// Advertised size.
        advertised: u32,
        /// Bytes we would write.
        needed: usize,
    },
    /// Address + size wraps around the address space.
    #[error("the advertised buffer {addr:#x}+{size} wraps around the address space")]
    Wraps {
        /// Advertised address.
        addr: u64,
        /// Advertised size.
        size: u32,
    },
}

impl RdmaInfo {
    /// The 16-byte wire form.
    pub fn encode(&self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.size.to_be_bytes());
        b
    }

    /// Decodes a received message checking only its size (what a client does with the
    /// server's answers, whose content rping does not use).
    ///
    /// # Errors
    /// [`InfoError::BogusSize`].
    pub fn decode_unchecked(b: &[u8]) -> Result<RdmaInfo, InfoError> {
        if b.len() != INFO_LEN {
            return Err(InfoError::BogusSize(b.len()));
        }
        Ok(RdmaInfo {
            addr: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
            rkey: u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
            size: u32::from_be_bytes(b[12..].try_into().expect("4 bytes")),
        })
    }

    /// Decodes a received advertisement (exactly 16 bytes, a non-empty buffer that does not
    /// wrap around the address space).
    ///
    /// # Errors
    /// [`InfoError::BogusSize`], [`InfoError::Empty`], [`InfoError::Wraps`].
    pub fn decode(b: &[u8]) -> Result<RdmaInfo, InfoError> {
        let info = Self::decode_unchecked(b)?;
        if info.size == 0 {
            return Err(InfoError::Empty);
        }
        if info.addr.checked_add(info.size as u64).is_none() {
            return Err(InfoError::Wraps {
                addr: info.addr,
                size: info.size,
            });
        }
        Ok(info)
    }

    /// The remote window to RDMA READ all of into a local buffer of `ours` bytes.
    ///
    /// # Errors
    /// [`InfoError::TooLarge`].
    pub fn read_source(&self, ours: usize) -> Result<RemoteMemory, InfoError> {
        if self.size as usize > ours {
            return Err(InfoError::TooLarge {
                advertised: self.size,
                ours,
            });
        }
        Ok(self.window())
    }

    /// The remote window to RDMA WRITE `len` bytes into.
    ///
    /// # Errors
    /// [`InfoError::TooSmall`].
    pub fn write_target(&self, len: usize) -> Result<RemoteMemory, InfoError> {
        if len > self.size as usize {
            return Err(InfoError::TooSmall {
                advertised: self.size,
                needed: len,
            });
        }
        Ok(RemoteMemory {
            addr: self.addr,
            len: len as u64,
            rkey: self.rkey,
        })
    }

    fn window(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr,
            len: self.size as u64,
            rkey: self.rkey,
        }
    }
}

/// Fills `buf` with ping number `ping`'s data, as rping does: `"rdma-ping-<n>: "`, then
/// letters from `'A' + n % 58` counting up through `'z'` and wrapping to `'A'`, and a NUL in
/// the last byte.
pub fn fill_ping(buf: &mut [u8], ping: u64) {
    let head = format!("rdma-ping-{ping}: ");
    let n = head.len().min(buf.len());
    buf[..n].copy_from_slice(&head.as_bytes()[..n]);
    let mut c = b'A' + (ping % 58) as u8;
    for b in &mut buf[n..] {
        *b = c;
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
}

/// The bytes up to (not including) the first NUL, lossily as text.
pub fn c_str(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_in_network_order() {
        let i = RdmaInfo {
            addr: 0x0102_0304_0506_0708,
            rkey: 0x1122_3344,
            size: 64,
        };
        let b = i.encode();
        assert_eq!(&b[..4], &[1, 2, 3, 4]);
        assert_eq!(&b[12..], &[0, 0, 0, 64]);
        assert_eq!(RdmaInfo::decode(&b), Ok(i));
    }

    #[test]
    fn malformed_infos_are_typed_errors() {
        assert_eq!(RdmaInfo::decode(&[0; 8]), Err(InfoError::BogusSize(8)));
        assert_eq!(RdmaInfo::decode(&[0; 17]), Err(InfoError::BogusSize(17)));
        let mut b = RdmaInfo {
            addr: 1,
            rkey: 1,
            size: 0,
        }
        .encode();
        assert_eq!(RdmaInfo::decode(&b), Err(InfoError::Empty));
        b = RdmaInfo {
            addr: u64::MAX - 4,
            rkey: 1,
            size: 64,
        }
        .encode();
        assert!(matches!(RdmaInfo::decode(&b), Err(InfoError::Wraps { .. })));
        let i = RdmaInfo {
            addr: 0x1000,
            rkey: 7,
            size: 1 << 20,
        };
        assert!(matches!(i.read_source(64), Err(InfoError::TooLarge { .. })));
        assert_eq!(i.read_source(1 << 20).unwrap().len, 1 << 20);
        let small = RdmaInfo {
            addr: 0x1000,
            rkey: 7,
            size: 8,
        };
        assert!(matches!(
            small.write_target(9),
            Err(InfoError::TooSmall { .. })
        ));
        assert_eq!(small.write_target(8).unwrap().len, 8);
    }

    #[test]
    fn any_bytes_decode_to_a_value_or_a_typed_error() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..48 {
            for _ in 0..200 {
                let b: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                match RdmaInfo::decode(&b) {
                    Ok(i) => {
                        assert_eq!(len, INFO_LEN);
                        assert!(i.size > 0 && i.addr.checked_add(i.size as u64).is_some());
                        let _ = i.read_source(DEFAULT_SIZE);
                        let _ = i.write_target(DEFAULT_SIZE);
                    }
                    Err(InfoError::BogusSize(n)) => assert!(n == len && len != INFO_LEN),
                    Err(_) => assert_eq!(len, INFO_LEN),
                }
            }
        }
    }

    #[test]
    fn ping_data_matches_rpings_pattern() {
        // what rdma-core's rping prints for -S 40 (seen in the Soft-RoCE guest)
        let mut b = [0u8; 40];
        fill_ping(&mut b, 0);
        assert_eq!(c_str(&b), "rdma-ping-0: ABCDEFGHIJKLMNOPQRSTUVWXYZ");
        fill_ping(&mut b, 2);
        assert_eq!(c_str(&b), "rdma-ping-2: CDEFGHIJKLMNOPQRSTUVWXYZ[\\");
        let mut b = [0u8; 64];
        fill_ping(&mut b, 1);
        assert_eq!(
            c_str(&b),
            "rdma-ping-1: BCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrs"
        );
        assert_eq!(b[63], 0);
    }
}
