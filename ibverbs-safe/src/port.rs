//! Port attributes: state, MTU, LID, link layer.

use crate::sys;

/// Path MTU (`enum ibv_mtu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the raw enum value (1..=5).
    pub fn from_raw(v: u32) -> Option<Mtu> {
        Some(match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// From a size in bytes (256, 512, 1024, 2048, 4096).
    pub fn from_bytes(b: u32) -> Option<Mtu> {
        Some(match b {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// Logical port state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    /// No state change.
    Nop,
    /// Down.
    Down,
    /// Initialising.
    Init,
    /// Armed.
    Armed,
    /// Active: ready for traffic.
    Active,
    /// Active, deferred.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(i32),
}

impl PortState {
    fn from_raw(v: i32) -> Self {
        match v {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            o => PortState::Unknown(o),
        }
    }
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// Not reported (treated as InfiniBand by verbs).
    Unspecified,
    /// InfiniBand: addressing by LID; GRH optional.
    InfiniBand,
    /// Ethernet (RoCE): addressing by GID; GRH mandatory.
    Ethernet,
}

/// Attributes of one port (`struct ibv_port_attr`, the commonly used part).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// MTU currently in use.
    pub active_mtu: Option<Mtu>,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Number of entries in the GID table.
    pub gid_table_len: u32,
    /// Largest message size.
    pub max_msg_size: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
}

impl PortAttr {
    pub(crate) fn from_raw(a: &sys::ibv_port_attr) -> Self {
        PortAttr {
            state: PortState::from_raw(a.state),
            max_mtu: Mtu::from_raw(a.max_mtu as u32),
            active_mtu: Mtu::from_raw(a.active_mtu as u32),
            lid: a.lid,
            gid_table_len: a.gid_tbl_len.max(0) as u32,
            max_msg_size: a.max_msg_sz,
            link_layer: match a.link_layer {
                sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
        }
    }

    /// Whether the port is `Active`.
    pub fn is_active(&self) -> bool {
        self.state == PortState::Active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_bytes_round_trip() {
        for m in [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu2048,
            Mtu::Mtu4096,
        ] {
            assert_eq!(Mtu::from_bytes(m.bytes()), Some(m));
            assert_eq!(Mtu::from_raw(m as u32), Some(m));
        }
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_raw(0), None);
    }
}
