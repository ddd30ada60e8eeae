//! What a library chooses a device by: the RDMA devices ([`nics`]) with their PCI path,
//! NUMA node, ports (state, link layer, speed and width, GIDs) and the memory kinds they can
//! register (GPU memory by a reasoned probe, [`GpuMemoryProbe`]); and the GPUs (`gpus`,
//! feature `cuda-ipc`) with their NUMA node and the nearest NIC by PCI topology (like NCCL's
//! `getProperties` and `nvidia-smi topo -m`). Device facts come from libibverbs and CUDA
//! (loaded at run time) and sysfs (alone, for a device that cannot be opened); a missing
//! library is a typed error.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::transport::{MemoryKinds, TransportKind};

/// Where a port's facts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortSource {
    /// `ibv_query_port` on the opened device (speed and width decoded from its
    /// `active_speed` / `active_width` codes).
    Verbs,
    /// sysfs (`/sys/class/infiniband/DEV/ports/N/`): the device could not be opened (no
    /// permission on its `uverbs` node, a provider missing); speed and width are parsed
    /// from the kernel's `rate` string.
    Sysfs,
}

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq)]
pub struct NicPort {
    /// Port number (1-based).
    pub port: u8,
    /// Whether the port is `Active`.
    pub active: bool,
    /// `InfiniBand`, `Ethernet` (RoCE) or `Unspecified`.
    pub link_layer: String,
    /// Lanes in use (1, 2, 4, 8, 12), if known.
    pub lanes: Option<u8>,
    /// Data rate of one lane in Gb/s (2.5 SDR ... 100 NDR), if known.
    pub gbps_per_lane: Option<f64>,
    /// The speed's name (`EDR`), if known.
    pub speed: Option<String>,
    /// Speed and width as the kernel reports them (sysfs `rate`, e.g.
    /// `100 Gb/sec (4X EDR)`), if known.
    pub rate: Option<String>,
    /// Non-zero GIDs: `(index, gid, type)`.
    pub gids: Vec<(u32, String, Option<String>)>,
    /// Where these facts came from.
    pub source: PortSource,
}

impl NicPort {
    /// Data rate of the port in Gb/s (lanes × per-lane rate), if both are known.
    pub fn gbps(&self) -> Option<f64> {
        Some(f64::from(self.lanes?) * self.gbps_per_lane?)
    }
}

/// A kernel `rate` string (`100 Gb/sec (4X EDR)`, `2.5 Gb/sec (1X SDR)`) as
/// `(lanes, Gb/s per lane, speed name)`; `None` for anything else.
pub fn parse_rate(rate: &str) -> Option<(u8, f64, String)> {
    let (total, rest) = rate.trim().split_once(" Gb/sec")?;
    let total: f64 = total.trim().parse().ok()?;
    let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
    let (width, speed) = inner.split_once(' ')?;
    let lanes: u8 = width.strip_suffix('X')?.parse().ok()?;
    if lanes == 0 || !total.is_finite() || total <= 0.0 || speed.is_empty() {
        return None;
    }
    Some((lanes, total / f64::from(lanes), speed.trim().to_string()))
}

/// The ports of the device whose sysfs directory is `dev` (`/sys/class/infiniband/DEV`),
/// read from sysfs alone: for a device that cannot be opened.
pub fn ports_from_sysfs(dev: &Path) -> Vec<NicPort> {
    let mut numbers: Vec<u8> = std::fs::read_dir(dev.join("ports"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    numbers.sort_unstable();
    numbers
        .into_iter()
        .map(|port| {
            let dir = dev.join(format!("ports/{port}"));
            // `4: ACTIVE`
            let active = read_trim(dir.join("state"))
                .and_then(|s| s.split(':').next()?.trim().parse::<u32>().ok())
                == Some(4);
            let link_layer = match read_trim(dir.join("link_layer")).as_deref() {
                Some("InfiniBand") => "InfiniBand",
                Some("Ethernet") => "Ethernet",
                _ => "Unspecified",
            }
            .to_string();
            let rate = read_trim(dir.join("rate"));
            let parsed = rate.as_deref().and_then(parse_rate);
            let mut gids: Vec<(u32, String, Option<String>)> = std::fs::read_dir(dir.join("gids"))
                .map(|d| {
                    d.filter_map(|e| {
                        let index: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
                        let gid: std::net::Ipv6Addr =
                            read_trim(dir.join(format!("gids/{index}")))?.parse().ok()?;
                        if gid.is_unspecified() {
                            return None;
                        }
                        let kind = read_trim(dir.join(format!("gid_attrs/types/{index}")))
                            .map(|t| gid_type_name(&t, &link_layer));
                        Some((index, gid.to_string(), kind))
                    })
                    .collect()
                })
                .unwrap_or_default();
            gids.sort();
            NicPort {
                port,
                active,
                link_layer,
                lanes: parsed.as_ref().map(|p| p.0),
                gbps_per_lane: parsed.as_ref().map(|p| p.1),
                speed: parsed.map(|p| p.2),
                rate,
                gids,
                source: PortSource::Sysfs,
            }
        })
        .collect()
}

/// sysfs GID type names as the verbs path names them (`ibverbs_safe::GidType`'s).
fn gid_type_name(sysfs: &str, link_layer: &str) -> String {
    match sysfs {
        "RoCE v2" => "RoceV2".into(),
        "IB/RoCE v1" if link_layer == "Ethernet" => "RoceV1".into(),
        "IB/RoCE v1" => "Ib".into(),
        other => other.into(),
    }
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq)]
pub struct NicInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Canonical sysfs path of its PCI function; `None` for software devices (Soft-RoCE).
    pub pci_path: Option<PathBuf>,
    /// NUMA node of the PCI function, if the platform says.
    pub numa_node: Option<i32>,
    /// Its ports.
    pub ports: Vec<NicPort>,
    /// Memory kinds it can register: host memory always; GPU memory when every check of
    /// [`gpu_memory`](Self::gpu_memory) holds.
    pub memory: MemoryKinds,
    /// Whether GPU memory (DMA-BUF: `Domain::register_dmabuf`, feature `cuda-ipc`) can be
    /// registered here, check by check, with how each was decided.
    pub gpu_memory: GpuMemoryProbe,
}

/// The outcome of one check, with how it was decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// It holds.
    Yes(String),
    /// It does not.
    No(String),
    /// It could not be decided.
    Unknown(String),
}

impl Check {
    /// Whether it holds.
    pub fn holds(&self) -> bool {
        matches!(self, Check::Yes(_))
    }

    /// How it was decided.
    pub fn reason(&self) -> &str {
        match self {
            Check::Yes(r) | Check::No(r) | Check::Unknown(r) => r,
        }
    }
}

/// Whether a NIC can register GPU memory (GPUDirect RDMA over DMA-BUF), as three checks that
/// need no GPU memory and register nothing:
///
/// 1. `library`: libibverbs exports `ibv_reg_dmabuf_mr` (rdma-core 34 or newer);
/// 2. `device`: the device's provider and kernel driver implement DMA-BUF registration.
///    Asked by calling `ibv_reg_dmabuf_mr` on a one-page memfd, which is not a DMA-BUF: a
///    provider without the verb (Soft-RoCE's, whose library does not even import
///    `ibv_cmd_reg_dmabuf_mr`) or a kernel driver without it answers `EOPNOTSUPP` before
///    looking at the fd; one that has it passes the fd to the kernel, which refuses it
///    as not a DMA-BUF (`EINVAL`/`EBADF`), so nothing is registered either way;
/// 3. `gpu`: a CUDA GPU is present whose driver can export DMA-BUFs
///    (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`; needs the `cuda-ipc` feature).
///
/// This is a well-founded expectation, not a promise: registration is the final word
/// (`Domain::register_dmabuf`, feature `cuda-ipc`, can still be refused, e.g.
/// by the IOMMU or a GPU on another PCI root, and says so with a typed error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMemoryProbe {
    /// libibverbs exports `ibv_reg_dmabuf_mr`.
    pub library: Check,
    /// The provider and kernel driver implement it.
    pub device: Check,
    /// A GPU that exports DMA-BUFs is present.
    pub gpu: Check,
}

impl GpuMemoryProbe {
    /// Whether every check holds (then registration is expected to work).
    pub fn expected(&self) -> bool {
        self.library.holds() && self.device.holds() && self.gpu.holds()
    }

    /// Why not (the first check that does not hold), or that all hold.
    pub fn reason(&self) -> String {
        for (what, c) in [
            ("libibverbs", &self.library),
            ("device", &self.device),
            ("GPU", &self.gpu),
        ] {
            match c {
                Check::No(r) => return format!("no: {what}: {r}"),
                Check::Unknown(r) => return format!("unknown: {what}: {r}"),
                Check::Yes(_) => {}
            }
        }
        "expected: libibverbs, provider, kernel driver and GPU support it (registration is \
         the final word)"
            .into()
    }
}

/// The whole [`GpuMemoryProbe`] for an opened device (the verbs domain's
/// [`MemorySupport`](crate::MemorySupport) lists GPU memory only when it is expected).
pub fn probe_gpu_memory(ctx: &ibverbs_safe::Context) -> GpuMemoryProbe {
    let (library, device) = probe_dmabuf(ctx);
    GpuMemoryProbe {
        library,
        device,
        gpu: probe_gpu(),
    }
}

/// Check 2 (and 1) of [`GpuMemoryProbe`] on an opened device.
fn probe_dmabuf(ctx: &ibverbs_safe::Context) -> (Check, Check) {
    let unknown = |why: String| (Check::Unknown(why.clone()), Check::Unknown(why));
    let pd = match ctx.alloc_pd() {
        Ok(pd) => pd,
        Err(e) => return unknown(format!("no protection domain to probe with: {e}")),
    };
    let fd = match crate::sys::memfd("fabric-dmabuf-probe", 4096) {
        Ok(fd) => fd,
        Err(e) => return unknown(format!("no memfd to probe with: {e}")),
    };
    let has_verb = || Check::Yes("libibverbs exports ibv_reg_dmabuf_mr".into());
    use std::os::fd::AsFd;
    match pd.try_register_dmabuf(
        fd.as_fd(),
        0,
        4096,
        0,
        ibverbs_safe::RemoteAccess::empty(),
        (),
    ) {
        // Not expected for a memfd; the device registered it, so it has the verb.
        Ok(_) => (
            has_verb(),
            Check::Yes("ibv_reg_dmabuf_mr accepted a probe".into()),
        ),
        Err((ibverbs_safe::Error::Unsupported { .. }, _)) => (
            Check::No("libibverbs has no ibv_reg_dmabuf_mr (needs rdma-core 34 or newer)".into()),
            Check::Unknown("not asked: the library lacks the verb".into()),
        ),
        Err((e @ ibverbs_safe::Error::RegDmabufMr { .. }, _)) if e.is_unsupported() => (
            has_verb(),
            Check::No(format!(
                "the provider or kernel driver has no DMA-BUF registration (ibv_reg_dmabuf_mr \
                 answered {}; Soft-RoCE never has it)",
                errno_name(&e)
            )),
        ),
        Err((e @ ibverbs_safe::Error::RegDmabufMr { .. }, _)) => (
            has_verb(),
            Check::Yes(format!(
                "the kernel driver took the verb and refused the probe's non-DMA-BUF fd ({})",
                errno_name(&e)
            )),
        ),
        Err((e, _)) => (has_verb(), Check::Unknown(format!("probe failed: {e}"))),
    }
}

fn errno_name(e: &ibverbs_safe::Error) -> String {
    let code = match e {
        ibverbs_safe::Error::RegDmabufMr { source, .. } => source.raw_os_error(),
        _ => None,
    };
    match code {
        Some(libc::EOPNOTSUPP) => "EOPNOTSUPP".into(),
        Some(libc::EPROTONOSUPPORT) => "EPROTONOSUPPORT".into(),
        Some(libc::ENOSYS) => "ENOSYS".into(),
        Some(libc::EINVAL) => "EINVAL".into(),
        Some(libc::EBADF) => "EBADF".into(),
        Some(n) => format!("errno {n}"),
        None => e.to_string(),
    }
}

/// Check 3 of [`GpuMemoryProbe`]: a GPU whose driver exports DMA-BUFs.
#[cfg(feature = "cuda-ipc")]
pub fn probe_gpu() -> Check {
    use nvlink_p2p::cudarc::driver::sys::CUdevice_attribute;
    let cuda = match nvlink_p2p::Cuda::init() {
        Ok(c) => c,
        Err(e) => return Check::No(format!("no CUDA GPU ({e})")),
    };
    let count = cuda.device_count();
    if count == 0 {
        return Check::No("the CUDA driver lists no GPU".into());
    }
    let mut why = Vec::new();
    for i in 0..count {
        match cuda
            .device(i)
            .and_then(|d| d.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED))
        {
            Ok(v) if v != 0 => {
                return Check::Yes(format!("GPU {i} reports DMA-BUF export support"));
            }
            Ok(_) => why.push(format!("GPU {i} reports no DMA-BUF export support")),
            Err(e) => why.push(format!("GPU {i}: {e}")),
        }
    }
    Check::No(why.join("; "))
}

/// Check 3 of [`GpuMemoryProbe`] without the `cuda-ipc` feature: unknown.
#[cfg(not(feature = "cuda-ipc"))]
pub fn probe_gpu() -> Check {
    Check::Unknown("built without the cuda-ipc feature (no CUDA support)".into())
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
    let gpu = if devs.is_empty() {
        Check::Unknown("not asked (no RDMA device)".into())
    } else {
        probe_gpu()
    };
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
        let opened = ibverbs_safe::open(Some(&d.name));
        if let Ok(ctx) = &opened {
            let count = ctx.query_device().map(|a| a.phys_port_cnt).unwrap_or(0);
            for port in 1..=count {
                let Ok(p) = ctx.query_port(port) else {
                    // This port from sysfs, if it says.
                    ports.extend(
                        ports_from_sysfs(&sys)
                            .into_iter()
                            .filter(|s| s.port == port),
                    );
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
                    lanes: p.lanes(),
                    gbps_per_lane: p.gbps_per_lane(),
                    speed: p.active_speed.name().map(String::from),
                    rate: read_trim(sys.join(format!("ports/{port}/rate"))),
                    gids,
                    source: PortSource::Verbs,
                });
            }
        } else {
            ports = ports_from_sysfs(&sys);
        }
        let (library, device) = match &opened {
            Ok(ctx) => probe_dmabuf(ctx),
            Err(e) => {
                let why = format!("the device could not be opened: {e}");
                (Check::Unknown(why.clone()), Check::Unknown(why))
            }
        };
        drop(opened);
        let gpu_memory = GpuMemoryProbe {
            library,
            device,
            gpu: gpu.clone(),
        };
        let memory = if gpu_memory.expected() {
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
            gpu_memory,
        });
    }
    Ok(out)
}

/// One CUDA GPU as a library places work by: its PCI function, NUMA node and the nearest
/// RDMA NIC (the cuda-ipc backend's devices; [`gpus`]).
#[cfg(feature = "cuda-ipc")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA device ordinal (`FABRIC_CUDA_DEVICE`).
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// PCI domain, bus and device numbers, as CUDA reports them.
    pub pci: (u32, u32, u32),
    /// Canonical sysfs path of its PCI function, when this host shows it.
    pub pci_path: Option<PathBuf>,
    /// NUMA node of the PCI function, if the platform says.
    pub numa_node: Option<i32>,
    /// The nearest active PCI NIC ([`nearest_nic`]) and how many PCI path components they
    /// share (more is closer).
    pub nearest_nic: Option<(String, usize)>,
}

/// A GPU's description from its CUDA facts and its sysfs PCI path (if any).
#[cfg(feature = "cuda-ipc")]
fn describe_gpu(
    ordinal: usize,
    name: String,
    pci: (u32, u32, u32),
    pci_path: Option<PathBuf>,
    nics: &[NicInfo],
) -> GpuInfo {
    let numa_node = pci_path
        .as_ref()
        .and_then(|p| read_trim(p.join("numa_node")))
        .and_then(|s| s.parse().ok())
        .filter(|&n: &i32| n >= 0);
    let nearest_nic = pci_path.as_ref().and_then(|p| {
        let n = nearest_nic(p, nics)?;
        Some((n.name.clone(), pci_affinity(p, n.pci_path.as_deref()?)))
    });
    GpuInfo {
        ordinal,
        name,
        pci,
        pci_path,
        numa_node,
        nearest_nic,
    }
}

/// The CUDA GPUs of this machine, each with its nearest NIC among `nics` (from [`nics`]).
///
/// # Errors
/// [`Error::Unavailable`] (cuda-ipc) when the CUDA driver cannot be loaded, lists no GPU
/// or cannot describe one.
#[cfg(feature = "cuda-ipc")]
pub fn gpus(nics: &[NicInfo]) -> Result<Vec<GpuInfo>> {
    let unavailable = |e: nvlink_p2p::Error| Error::Unavailable {
        transport: TransportKind::CudaIpc,
        reason: e.to_string(),
    };
    let topo = nvlink_p2p::Cuda::init()
        .and_then(|c| c.topology())
        .map_err(unavailable)?;
    Ok(topo
        .devices
        .into_iter()
        .map(|d| {
            let pci = (d.pci.0 as u32, d.pci.1 as u32, d.pci.2 as u32);
            let path = pci_path(pci.0, pci.1, pci.2);
            describe_gpu(d.ordinal, d.name, pci, path, nics)
        })
        .collect())
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
        if best.is_none_or(|(s, _)| score > s) {
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
                lanes: None,
                gbps_per_lane: None,
                speed: None,
                rate: None,
                gids: Vec::new(),
                source: PortSource::Verbs,
            }],
            memory: MemoryKinds::HOST,
            gpu_memory: GpuMemoryProbe {
                library: Check::Unknown(String::new()),
                device: Check::Unknown(String::new()),
                gpu: Check::Unknown(String::new()),
            },
        }
    }

    #[test]
    fn gpu_memory_is_expected_only_when_every_check_holds_and_says_which_fails() {
        let yes = || Check::Yes("y".into());
        let all = GpuMemoryProbe {
            library: yes(),
            device: yes(),
            gpu: yes(),
        };
        assert!(all.expected());
        assert!(all.reason().contains("final word"), "{}", all.reason());
        let no_dev = GpuMemoryProbe {
            device: Check::No("EOPNOTSUPP".into()),
            gpu: Check::Unknown("no cuda".into()),
            ..all.clone()
        };
        assert!(!no_dev.expected());
        assert_eq!(no_dev.reason(), "no: device: EOPNOTSUPP");
        let no_gpu = GpuMemoryProbe {
            gpu: Check::Unknown("no cuda".into()),
            ..all
        };
        assert!(!no_gpu.expected());
        assert_eq!(no_gpu.reason(), "unknown: GPU: no cuda");
    }

    #[cfg(feature = "cuda-ipc")]
    #[test]
    fn a_gpu_is_described_with_its_numa_node_and_nearest_nic() {
        let root = std::env::temp_dir().join(format!("fabric-gpu-{}", std::process::id()));
        let gpu = root.join("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0");
        std::fs::create_dir_all(&gpu).unwrap();
        std::fs::write(gpu.join("numa_node"), "1\n").unwrap();
        let near = root.join("pci0000:80/0000:80:01.0/0000:81:00.0/0000:83:00.0");
        let far = root.join("pci0000:00/0000:00:01.0/0000:01:00.0");
        let nics = [
            nic("far", far.to_str(), true),
            nic("near", near.to_str(), true),
        ];
        let g = describe_gpu(0, "GPU".into(), (0, 0x82, 0), Some(gpu.clone()), &nics);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(g.numa_node, Some(1));
        let (name, depth) = g.nearest_nic.unwrap();
        assert_eq!(name, "near");
        assert_eq!(depth, pci_affinity(&gpu, &near));
        // No PCI path on this host: no NUMA node, no nearest NIC (not a guess).
        let g = describe_gpu(1, "GPU".into(), (0, 0x40, 0), None, &nics);
        assert_eq!((g.numa_node, g.nearest_nic), (None, None));
    }

    #[test]
    fn kernel_rate_strings_parse_to_lanes_and_per_lane_speed() {
        assert_eq!(
            parse_rate("100 Gb/sec (4X EDR)"),
            Some((4, 25.0, "EDR".into()))
        );
        assert_eq!(
            parse_rate("2.5 Gb/sec (1X SDR)\n"),
            Some((1, 2.5, "SDR".into()))
        );
        assert_eq!(
            parse_rate("56 Gb/sec (4X FDR)"),
            Some((4, 14.0, "FDR".into()))
        );
        assert_eq!(
            parse_rate("400 Gb/sec (4X NDR)"),
            Some((4, 100.0, "NDR".into()))
        );
        for bad in [
            "",
            "fast",
            "100 Gb/sec",
            "100 Gb/sec (0X EDR)",
            "x Gb/sec (4X EDR)",
            "100 Gb/sec (4 EDR)",
        ] {
            assert_eq!(parse_rate(bad), None, "{bad:?}");
        }
    }

    /// A device that cannot be opened is described from sysfs: ports in order, state,
    /// link layer, speed and width from `rate`, non-zero GIDs with their types.
    #[test]
    fn ports_come_from_sysfs_when_the_device_cannot_be_opened() {
        let dev = std::env::temp_dir().join(format!("fabric-topology-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dev);
        let put = |rel: &str, text: &str| {
            let p = dev.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        put("ports/2/state", "1: DOWN\n");
        put("ports/2/link_layer", "InfiniBand\n");
        put("ports/1/state", "4: ACTIVE\n");
        put("ports/1/link_layer", "Ethernet\n");
        put("ports/1/rate", "100 Gb/sec (4X EDR)\n");
        put(
            "ports/1/gids/0",
            "fe80:0000:0000:0000:5054:00ff:fe12:3456\n",
        );
        put("ports/1/gid_attrs/types/0", "IB/RoCE v1\n");
        put(
            "ports/1/gids/1",
            "0000:0000:0000:0000:0000:ffff:0a4d:0001\n",
        );
        put("ports/1/gid_attrs/types/1", "RoCE v2\n");
        put(
            "ports/1/gids/2",
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        );
        let ports = ports_from_sysfs(&dev);
        let _ = std::fs::remove_dir_all(&dev);
        assert_eq!(ports.len(), 2);
        let p = &ports[0];
        assert_eq!(
            (p.port, p.active, p.link_layer.as_str()),
            (1, true, "Ethernet")
        );
        assert_eq!(
            (p.lanes, p.gbps_per_lane, p.speed.as_deref()),
            (Some(4), Some(25.0), Some("EDR"))
        );
        assert_eq!(p.gbps(), Some(100.0));
        assert_eq!(p.source, PortSource::Sysfs);
        assert_eq!(
            p.gids,
            vec![
                (
                    0,
                    "fe80::5054:ff:fe12:3456".to_string(),
                    Some("RoceV1".to_string())
                ),
                (
                    1,
                    "::ffff:10.77.0.1".to_string(),
                    Some("RoceV2".to_string())
                ),
            ]
        );
        let q = &ports[1];
        assert_eq!(
            (q.port, q.active, q.link_layer.as_str()),
            (2, false, "InfiniBand")
        );
        assert_eq!((q.lanes, q.gbps(), q.rate.as_deref()), (None, None, None));
        assert!(ports_from_sysfs(Path::new("/nonexistent/fabric")).is_empty());
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
