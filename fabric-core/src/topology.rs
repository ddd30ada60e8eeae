//! What a library chooses a device by: the RDMA devices with their PCI path, NUMA node,
//! ports (state, link layer, rate, GIDs) and the memory kinds they can register, and for
//! a GPU the nearest NIC by PCI topology (like NCCL's `getProperties` and
//! `nvidia-smi topo -m`). Device facts come from libibverbs (loaded at run time) and
//! sysfs; a missing library is a typed error.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::transport::{MemoryKinds, TransportKind};

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPort {
    /// Port number (1-based).
    pub port: u8,
    /// Whether the port is `Active`.
    pub active: bool,
    /// `InfiniBand`, `Ethernet` (RoCE) or `Unspecified`.
    pub link_layer: String,
    /// Speed and width as the kernel reports them (sysfs `rate`, e.g.
    /// `100 Gb/sec (4X EDR)`), if known.
    pub rate: Option<String>,
    /// Non-zero GIDs: `(index, gid, type)`.
    pub gids: Vec<(u32, String, Option<String>)>,
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Canonical sysfs path of its PCI function; `None` for software devices (Soft-RoCE).
    pub pci_path: Option<PathBuf>,
    /// NUMA node of the PCI function, if the platform says.
    pub numa_node: Option<i32>,
    /// Its ports.
    pub ports: Vec<NicPort>,
    /// Memory kinds it can register: host memory always; GPU memory
    /// ([`Domain::register_dmabuf`](crate::Domain::register_dmabuf)) is attempted on PCI
    /// devices and refused with a typed error where the provider cannot; a software device
    /// never can.
    pub memory: MemoryKinds,
}

impl NicInfo {
    /// Whether any port is active.
    pub fn is_active(&self) -> bool {
        self.ports.iter().any(|p| p.active)
    }
}

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The RDMA devices of this machine.
///
/// # Errors
/// [`Error::Unavailable`] when libibverbs cannot be loaded.
pub fn nics() -> Result<Vec<NicInfo>> {
    let devs = ibverbs_safe::devices().map_err(|e| Error::Unavailable {
        transport: TransportKind::Verbs,
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    for d in devs {
        let sys = Path::new("/sys/class/infiniband").join(&d.name);
        let pci_path = std::fs::canonicalize(sys.join("device")).ok().filter(|p| {
            p.components()
                .any(|c| c.as_os_str().to_string_lossy().starts_with("pci"))
        });
        let numa_node = pci_path
            .as_ref()
            .and_then(|p| read_trim(p.join("numa_node")))
            .and_then(|s| s.parse().ok())
            .filter(|&n: &i32| n >= 0);
        let mut ports = Vec::new();
        if let Ok(ctx) = ibverbs_safe::open(Some(&d.name)) {
            let count = ctx.query_device().map(|a| a.phys_port_cnt).unwrap_or(0);
            for port in 1..=count {
                let Ok(p) = ctx.query_port(port) else {
                    continue;
                };
                let gids = ctx
                    .gid_table(port)
                    .unwrap_or_default()
                    .iter()
                    .filter(|g| !g.gid.is_zero())
                    .map(|g| {
                        (
                            g.index,
                            g.gid.to_string(),
                            g.gid_type.map(|t| format!("{t:?}")),
                        )
                    })
                    .collect();
                ports.push(NicPort {
                    port,
                    active: p.is_active(),
                    link_layer: format!("{:?}", p.link_layer),
                    rate: read_trim(sys.join(format!("ports/{port}/rate"))),
                    gids,
                });
            }
        }
        let memory = if pci_path.is_some() {
            MemoryKinds::HOST | MemoryKinds::CUDA_DEVICE
        } else {
            MemoryKinds::HOST
        };
        out.push(NicInfo {
            name: d.name,
            pci_path,
            numa_node,
            ports,
            memory,
        });
    }
    Ok(out)
}

/// The canonical sysfs path of the PCI function `domain:bus:device.0` (a GPU's address
/// as CUDA reports it).
pub fn pci_path(domain: u32, bus: u32, device: u32) -> Option<PathBuf> {
    std::fs::canonicalize(format!(
        "/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0"
    ))
    .ok()
}

/// How many leading path components two PCI paths share (the deeper, the closer: same
/// switch beats same root complex beats same host).
pub fn pci_affinity(a: &Path, b: &Path) -> usize {
    a.components()
        .zip(b.components())
        .take_while(|(x, y)| x == y)
        .count()
}

/// The NIC nearest to the PCI function at `gpu` (by shared PCI path), among `nics` with
/// an active port; ties go to the first. `None` when no PCI NIC is active.
pub fn nearest_nic<'a>(gpu: &Path, nics: &'a [NicInfo]) -> Option<&'a NicInfo> {
    let mut best: Option<(usize, &NicInfo)> = None;
    for n in nics.iter().filter(|n| n.is_active()) {
        let Some(p) = &n.pci_path else { continue };
        let score = pci_affinity(gpu, p);
        if best.map_or(true, |(s, _)| score > s) {
            best = Some((score, n));
        }
    }
    best.map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, path: Option<&str>, active: bool) -> NicInfo {
        NicInfo {
            name: name.into(),
            pci_path: path.map(PathBuf::from),
            numa_node: None,
            ports: vec![NicPort {
                port: 1,
                active,
                link_layer: "Ethernet".into(),
                rate: None,
                gids: Vec::new(),
            }],
            memory: MemoryKinds::HOST,
        }
    }

    #[test]
    fn the_nearest_nic_shares_the_deepest_pci_path() {
        let gpu = Path::new("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0");
        let nics = [
            nic(
                "far",
                Some("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"),
                true,
            ),
            nic(
                "same_switch",
                Some("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:83:00.0"),
                true,
            ),
            nic(
                "same_root",
                Some("/sys/devices/pci0000:80/0000:80:02.0/0000:90:00.0"),
                true,
            ),
            nic(
                "down",
                Some("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:84:00.0"),
                false,
            ),
            nic("rxe0", None, true),
        ];
        assert_eq!(nearest_nic(gpu, &nics).unwrap().name, "same_switch");
        assert_eq!(nearest_nic(gpu, &nics[..1]).unwrap().name, "far");
        assert!(
            nearest_nic(gpu, &nics[3..]).is_none(),
            "inactive and software NICs"
        );
    }
}
