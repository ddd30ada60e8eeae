//! GIDs (global identifiers) and GID table entries.

use std::fmt;
use std::net::Ipv6Addr;

/// A 128-bit GID, in network byte order (as it appears on the wire and in `ibv_gid.raw`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether every byte is zero (an empty GID table slot, or "no GRH").
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The GID as an IPv6 address (RoCE GIDs are IP addresses; IPv4 ones are v4-mapped).
    pub fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl From<[u8; 16]> for Gid {
    fn from(raw: [u8; 16]) -> Self {
        Gid(raw)
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(a: Ipv6Addr) -> Self {
        Gid(a.octets())
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_ipv6(), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The type of a GID table entry (`enum ibv_gid_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GidType {
    /// InfiniBand.
    Ib = 0,
    /// RoCE v1 (Ethernet, no IP header).
    RoceV1 = 1,
    /// RoCE v2 (UDP/IP).
    RoceV2 = 2,
}

impl GidType {
    pub(crate) fn from_raw(v: u32) -> Option<Self> {
        match v {
            0 => Some(GidType::Ib),
            1 => Some(GidType::RoceV1),
            2 => Some(GidType::RoceV2),
            _ => None,
        }
    }
}

/// One populated entry of a port's GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its index in the table (what `connect`/`ah` options call `gid_index`).
    pub index: u32,
    /// The port.
    pub port: u8,
    /// Its type, where the library can tell (`_ibv_query_gid_ex`, rdma-core ≥ 32).
    pub gid_type: Option<GidType>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_formats_as_ipv6() {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[127, 0, 0, 1]);
        let g = Gid(raw);
        assert_eq!(g.to_string(), "::ffff:127.0.0.1");
        assert!(!g.is_zero());
        assert!(Gid::default().is_zero());
    }
}
