//! Which GPUs can reach which, and how well (`cuDeviceCanAccessPeer`,
//! `cuDeviceGetP2PAttribute`). No contexts are created.
#![allow(unsafe_code)]

use cudarc::driver::sys;

use crate::driver::{check, Cuda};
use crate::error::Result;

/// One GPU as the topology sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// PCI domain, bus and device numbers.
    pub pci: (i32, i32, i32),
}

/// What connects two GPUs, as far as the CUDA driver lets us know.
///
/// The driver API does not name the link; NVML would. The inference used here: CUDA only
/// offers native peer atomics over NVLink/NVSwitch (and C2C), never over PCIe, so a peer
/// path with native atomics is reported as `LikelyNvLink`, one without as `LikelyPcie`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkKind {
    /// No direct peer path: copies would have to go through host memory.
    NoPeerPath,
    /// A peer path with native atomics: NVLink / NVSwitch.
    LikelyNvLink,
    /// A peer path without native atomics: PCIe peer-to-peer.
    LikelyPcie,
}

/// The directed relation from one GPU to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink {
    /// Accessing device.
    pub from: usize,
    /// Accessed device.
    pub to: usize,
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is better).
    pub performance_rank: i32,
    /// The link, inferred.
    pub kind: LinkKind,
}

/// Every device and every ordered device pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The devices.
    pub devices: Vec<DeviceInfo>,
    /// One entry per ordered pair of distinct devices.
    pub links: Vec<PeerLink>,
}

impl Topology {
    /// The link from `from` to `to`, if both exist and differ.
    pub fn link(&self, from: usize, to: usize) -> Option<&PeerLink> {
        self.links.iter().find(|l| l.from == from && l.to == to)
    }
}

fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let mut d = 0;
    // SAFETY: valid out-pointer; the driver is initialised (we hold a `Cuda`).
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut d, ordinal as i32)
    })?;
    Ok(d)
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer and device.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

fn p2p_attribute(
    a: sys::CUdevice,
    b: sys::CUdevice,
    attr: sys::CUdevice_P2PAttribute,
) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer and devices.
    check("cuDeviceGetP2PAttribute", unsafe {
        sys::cuDeviceGetP2PAttribute(&mut v, attr, a, b)
    })?;
    Ok(v)
}

impl Cuda {
    /// Queries every device and every ordered pair.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver).
    pub fn topology(&self) -> Result<Topology> {
        use sys::CUdevice_P2PAttribute as P;
        use sys::CUdevice_attribute as A;
        let n = self.device_count();
        let devs: Vec<sys::CUdevice> = (0..n).map(cu_device).collect::<Result<_>>()?;
        let mut devices = Vec::with_capacity(n);
        for (ordinal, &d) in devs.iter().enumerate() {
            let mut name = [0 as std::ffi::c_char; 256];
            // SAFETY: the buffer is 256 bytes and the driver NUL-terminates within `len`.
            check("cuDeviceGetName", unsafe {
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, d)
            })?;
            let name: Vec<u8> = name
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            devices.push(DeviceInfo {
                ordinal,
                name: String::from_utf8_lossy(&name).into_owned(),
                pci: (
                    attribute(d, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                    attribute(d, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                    attribute(d, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
                ),
            });
        }
        let mut links = Vec::new();
        for (i, &a) in devs.iter().enumerate() {
            for (j, &b) in devs.iter().enumerate() {
                if i == j {
                    continue;
                }
                let mut can = 0;
                // SAFETY: valid out-pointer and devices.
                check("cuDeviceCanAccessPeer", unsafe {
                    sys::cuDeviceCanAccessPeer(&mut can, a, b)
                })?;
                let can_access_peer = can != 0;
                let native_atomics =
                    p2p_attribute(a, b, P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0;
                let performance_rank =
                    p2p_attribute(a, b, P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?;
                let kind = match (can_access_peer, native_atomics) {
                    (false, _) => LinkKind::NoPeerPath,
                    (true, true) => LinkKind::LikelyNvLink,
                    (true, false) => LinkKind::LikelyPcie,
                };
                links.push(PeerLink {
                    from: i,
                    to: j,
                    can_access_peer,
                    native_atomics,
                    performance_rank,
                    kind,
                });
            }
        }
        Ok(Topology { devices, links })
    }
}
