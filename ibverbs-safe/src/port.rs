//! Port attributes: state, MTU, LID, link layer, active speed and width.

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

/// Signalling speed of each lane of an active port (`active_speed` of `ibv_port_attr`:
/// the InfiniBand PortInfo codes that `ibv_query_port(3)` lists; RoCE providers map their
/// Ethernet speed onto them). The header has no enum for them, so the codes live here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkSpeed {
    /// SDR, 2.5 Gb/s per lane (code 1).
    Sdr,
    /// DDR, 5 Gb/s per lane (code 2).
    Ddr,
    /// QDR, 10 Gb/s per lane (code 4).
    Qdr,
    /// FDR10, 10 Gb/s per lane (code 8).
    Fdr10,
    /// FDR, 14 Gb/s per lane (code 16).
    Fdr,
    /// EDR, 25 Gb/s per lane (code 32).
    Edr,
    /// HDR, 50 Gb/s per lane (code 64).
    Hdr,
    /// NDR, 100 Gb/s per lane (code 128).
    Ndr,
    /// A code this crate does not know, or 0 (not reported). Faster links (XDR) are only
    /// reported in `active_speed_ex`, which the 48-byte compat query does not fill.
    Unknown(u8),
}

impl LinkSpeed {
    /// From the raw `active_speed` code.
    pub fn from_raw(code: u8) -> Self {
        match code {
            1 => LinkSpeed::Sdr,
            2 => LinkSpeed::Ddr,
            4 => LinkSpeed::Qdr,
            8 => LinkSpeed::Fdr10,
            16 => LinkSpeed::Fdr,
            32 => LinkSpeed::Edr,
            64 => LinkSpeed::Hdr,
            128 => LinkSpeed::Ndr,
            o => LinkSpeed::Unknown(o),
        }
    }

    /// Data rate of one lane in Gb/s, as the kernel states rates (sysfs `rate` is lanes
    /// times this: `100 Gb/sec (4X EDR)`); `None` when unknown.
    pub fn gbps_per_lane(self) -> Option<f64> {
        Some(match self {
            LinkSpeed::Sdr => 2.5,
            LinkSpeed::Ddr => 5.0,
            LinkSpeed::Qdr | LinkSpeed::Fdr10 => 10.0,
            LinkSpeed::Fdr => 14.0,
            LinkSpeed::Edr => 25.0,
            LinkSpeed::Hdr => 50.0,
            LinkSpeed::Ndr => 100.0,
            LinkSpeed::Unknown(_) => return None,
        })
    }

    /// The name the kernel uses (`EDR`), `None` when unknown.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            LinkSpeed::Sdr => "SDR",
            LinkSpeed::Ddr => "DDR",
            LinkSpeed::Qdr => "QDR",
            LinkSpeed::Fdr10 => "FDR10",
            LinkSpeed::Fdr => "FDR",
            LinkSpeed::Edr => "EDR",
            LinkSpeed::Hdr => "HDR",
            LinkSpeed::Ndr => "NDR",
            LinkSpeed::Unknown(_) => return None,
        })
    }
}

/// Lanes of an active port (`active_width` of `ibv_port_attr`: the PortInfo codes of
/// `ibv_query_port(3)`, one bit per width).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkWidth {
    /// 1 lane (code 1).
    X1,
    /// 2 lanes (code 16).
    X2,
    /// 4 lanes (code 2).
    X4,
    /// 8 lanes (code 4).
    X8,
    /// 12 lanes (code 8).
    X12,
    /// A code this crate does not know, or 0 (not reported).
    Unknown(u8),
}

impl LinkWidth {
    /// From the raw `active_width` code.
    pub fn from_raw(code: u8) -> Self {
        match code {
            1 => LinkWidth::X1,
            16 => LinkWidth::X2,
            2 => LinkWidth::X4,
            4 => LinkWidth::X8,
            8 => LinkWidth::X12,
            o => LinkWidth::Unknown(o),
        }
    }

    /// The number of lanes; `None` when unknown.
    pub fn lanes(self) -> Option<u8> {
        Some(match self {
            LinkWidth::X1 => 1,
            LinkWidth::X2 => 2,
            LinkWidth::X4 => 4,
            LinkWidth::X8 => 8,
            LinkWidth::X12 => 12,
            LinkWidth::Unknown(_) => return None,
        })
    }
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
    /// Signalling speed of each lane.
    pub active_speed: LinkSpeed,
    /// Number of lanes.
    pub active_width: LinkWidth,
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
            active_speed: LinkSpeed::from_raw(a.active_speed),
            active_width: LinkWidth::from_raw(a.active_width),
        }
    }

    /// Lanes in use; `None` when the provider does not say.
    pub fn lanes(&self) -> Option<u8> {
        self.active_width.lanes()
    }

    /// Data rate of one lane in Gb/s; `None` when the provider does not say.
    pub fn gbps_per_lane(&self) -> Option<f64> {
        self.active_speed.gbps_per_lane()
    }

    /// Data rate of the port in Gb/s (lanes × per-lane rate, as the kernel's sysfs `rate`
    /// states it); `None` when either is unknown.
    pub fn rate_gbps(&self) -> Option<f64> {
        Some(f64::from(self.lanes()?) * self.gbps_per_lane()?)
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

    #[test]
    fn speed_and_width_codes_decode_to_lanes_and_gbps() {
        // (code, Gb/s per lane, name) as ibv_query_port(3) lists them.
        let speeds = [
            (1u8, 2.5, "SDR"),
            (2, 5.0, "DDR"),
            (4, 10.0, "QDR"),
            (8, 10.0, "FDR10"),
            (16, 14.0, "FDR"),
            (32, 25.0, "EDR"),
            (64, 50.0, "HDR"),
            (128, 100.0, "NDR"),
        ];
        for (code, gbps, name) in speeds {
            let s = LinkSpeed::from_raw(code);
            assert_eq!(
                (s.gbps_per_lane(), s.name()),
                (Some(gbps), Some(name)),
                "{code}"
            );
        }
        for code in [0u8, 3, 5, 255] {
            assert_eq!(LinkSpeed::from_raw(code), LinkSpeed::Unknown(code));
            assert_eq!(LinkSpeed::from_raw(code).gbps_per_lane(), None);
        }
        let widths = [(1u8, 1u8), (2, 4), (4, 8), (8, 12), (16, 2)];
        for (code, lanes) in widths {
            assert_eq!(LinkWidth::from_raw(code).lanes(), Some(lanes), "{code}");
        }
        for code in [0u8, 3, 32, 255] {
            assert_eq!(LinkWidth::from_raw(code).lanes(), None, "{code}");
        }
    }

    #[test]
    fn port_attr_reads_speed_and_width_from_the_compat_prefix() {
        // A 4X EDR port: 100 Gb/s, as sysfs states `100 Gb/sec (4X EDR)`.
        let raw = sys::ibv_port_attr {
            state: 4,
            active_width: 2,
            active_speed: 32,
            ..Default::default()
        };
        let p = PortAttr::from_raw(&raw);
        assert_eq!(
            (p.active_width, p.active_speed),
            (LinkWidth::X4, LinkSpeed::Edr)
        );
        assert_eq!((p.lanes(), p.gbps_per_lane()), (Some(4), Some(25.0)));
        assert_eq!(p.rate_gbps(), Some(100.0));
        // 1X SDR (what Soft-RoCE reports over a slow or speedless netdev): 2.5 Gb/s.
        let raw = sys::ibv_port_attr {
            active_width: 1,
            active_speed: 1,
            ..raw
        };
        assert_eq!(PortAttr::from_raw(&raw).rate_gbps(), Some(2.5));
        // Not reported: no rate rather than a made-up one.
        let raw = sys::ibv_port_attr {
            active_width: 0,
            ..raw
        };
        assert_eq!(PortAttr::from_raw(&raw).rate_gbps(), None);
    }
}
