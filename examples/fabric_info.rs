//! What this machine offers, in one view (like `ibv_devinfo`, `fi_info`, `ucx_info` and
//! `nvidia-smi topo -m` together): RDMA devices, ports, GIDs and link state; what a library
//! chooses a NIC by (fabric-core's `topology`: PCI path, NUMA node, speed and width, memory
//! kinds with the GPU-memory probe, the nearest NIC per GPU) and how to pick one
//! (`Options::verbs_device` / `verbs_port` / `verbs_gid_index`); which transports are
//! usable and what memory each domain registers; GPUs and their peer matrix. Every absent
//! piece is reported with its typed error's message; nothing here panics.
//!
//! ```text
//! cargo run --example fabric_info
//! ```

use fabric_core::{backend, bootstrap, topology, Domain, TransportKind};

fn rdma() -> bool {
    println!("== RDMA devices (ibverbs-safe)");
    let devs = match ibverbs_safe::devices() {
        Ok(d) if d.is_empty() => {
            println!("  none: libibverbs loaded, but it lists no RDMA device");
            return false;
        }
        Ok(d) => d,
        Err(e) => {
            println!("  unavailable: {e}");
            return false;
        }
    };
    let mut any_active = false;
    for d in devs {
        println!("  {} (node guid {:016x})", d.name, d.guid);
        let ctx = match ibverbs_safe::open(Some(&d.name)) {
            Ok(c) => c,
            Err(e) => {
                println!("    cannot open: {e}");
                continue;
            }
        };
        let attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                println!("    query_device: {e}");
                continue;
            }
        };
        println!(
            "    fw {}  vendor {:#x}:{:#x}  max_qp {}  max_qp_wr {}  max_sge {}  max_mr_size {}",
            attr.fw_ver,
            attr.vendor_id,
            attr.vendor_part_id,
            attr.max_qp,
            attr.max_qp_wr,
            attr.max_sge,
            attr.max_mr_size
        );
        for port in 1..=attr.phys_port_cnt {
            match ctx.query_port(port) {
                Ok(p) => {
                    any_active |= p.is_active();
                    println!(
                        "    port {port}: {:?}, link layer {:?}, active mtu {:?}, lid {}, {} GIDs",
                        p.state, p.link_layer, p.active_mtu, p.lid, p.gid_table_len
                    );
                    match ctx.gid_table(port) {
                        Ok(gids) => {
                            for g in gids.iter().filter(|g| !g.gid.is_zero()) {
                                println!("      gid[{}] {} {:?}", g.index, g.gid, g.gid_type);
                            }
                        }
                        Err(e) => println!("      gid table: {e}"),
                    }
                }
                Err(e) => println!("    port {port}: {e}"),
            }
        }
    }
    any_active
}

fn nics() -> Vec<topology::NicInfo> {
    println!("== NICs as a library chooses them (fabric-core topology)");
    let nics = match topology::nics() {
        Ok(n) => n,
        Err(e) => {
            println!("  unavailable: {e}");
            return Vec::new();
        }
    };
    if nics.is_empty() {
        println!("  none");
    }
    for n in &nics {
        println!(
            "  {}: pci {}, numa {}, registers {:?}",
            n.name,
            n.pci_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "none (software device)".into()),
            n.numa_node
                .map(|x| x.to_string())
                .unwrap_or_else(|| "unknown".into()),
            n.memory
        );
        println!("    GPU memory (DMA-BUF): {}", n.gpu_memory.reason());
        for (what, c) in [
            ("libibverbs", &n.gpu_memory.library),
            ("device", &n.gpu_memory.device),
            ("GPU", &n.gpu_memory.gpu),
        ] {
            let verdict = match c {
                topology::Check::Yes(_) => "yes",
                topology::Check::No(_) => "no",
                topology::Check::Unknown(_) => "unknown",
            };
            println!("      {what:<10} {verdict}: {}", c.reason());
        }
        for p in &n.ports {
            let speed = match (p.lanes, p.gbps_per_lane, p.gbps()) {
                (Some(l), Some(g), Some(t)) => format!(
                    "{t} Gb/s ({l} lane{} x {g} Gb/s {})",
                    if l == 1 { "" } else { "s" },
                    p.speed.as_deref().unwrap_or("")
                ),
                _ => format!(
                    "unknown (kernel: {})",
                    p.rate.as_deref().unwrap_or("no rate")
                ),
            };
            println!(
                "    port {}: {}, {}, {speed} [{:?}], {} GIDs{}",
                p.port,
                if p.active { "active" } else { "down" },
                p.link_layer,
                p.source,
                p.gids.len(),
                p.gids
                    .first()
                    .map(|g| format!(" (gid[{}] {} {})", g.0, g.1, g.2.as_deref().unwrap_or("")))
                    .unwrap_or_default()
            );
        }
    }
    println!(
        "  pick one: Options {{ verbs_device: Some(NAME), verbs_port: Some(N), verbs_gid_index: Some(I), .. }} \
         (or FABRIC_VERBS_DEVICE=NAME)"
    );
    nics
}

fn transports(rdma_active: bool) {
    println!("== transports (fabric-core)");
    for kind in TransportKind::ALL {
        let line = match backend::entry(kind) {
            Err(e) => format!("not usable: {e}"),
            Ok(e) => match (e.probe)() {
                Ok(()) => "usable".to_string(),
                Err(err) => format!("not usable: {err}"),
            },
        };
        let note = match kind {
            TransportKind::Shm => " (chosen for peers on this host)",
            TransportKind::Verbs if rdma_active => " (an active RDMA port is present)",
            TransportKind::Verbs => " (needs an active RDMA port on both ends)",
            TransportKind::Tcp => " (any two hosts)",
            _ => "",
        };
        println!("  {:<9} {line}{note}", kind.name());
        if let Ok(d) = Domain::open(kind, &backend::Options::default()) {
            let m = d.memory_support();
            println!(
                "            registers: allocated {:?} (one-sided {:?}), caller memory {:?} (one-sided {:?})",
                m.allocated, m.allocated_remote, m.caller, m.caller_remote
            );
        }
    }
    println!("  host id   {}", bootstrap::host_id());
    match bootstrap::Launch::from_env() {
        Ok(Some(l)) => println!(
            "  launcher  {:?}: rank {} of {}{}",
            l.launcher,
            l.rank,
            l.size,
            l.server
                .map(|s| format!(", rendezvous {s}"))
                .unwrap_or_default()
        ),
        Ok(None) => {
            println!("  launcher  none detected (Slurm, Open MPI, PMI, torchrun variables absent)")
        }
        Err(e) => println!("  launcher  {e}"),
    }
}

fn gpus(nics: &[topology::NicInfo]) {
    println!("== GPUs (nvlink-p2p)");
    let cuda = match nvlink_p2p::Cuda::init() {
        Ok(c) => c,
        Err(e) => {
            println!("  unavailable: {e}");
            return;
        }
    };
    let topo = match cuda.topology() {
        Ok(t) => t,
        Err(e) => {
            println!("  topology: {e}");
            return;
        }
    };
    match topology::gpus(nics) {
        Err(e) => println!("  {e}"),
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "  GPU{} {} (pci {:04x}:{:02x}:{:02x}, numa {})",
                    g.ordinal,
                    g.name,
                    g.pci.0,
                    g.pci.1,
                    g.pci.2,
                    g.numa_node
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| "unknown".into())
                );
                match g.nearest_nic {
                    Some((n, depth)) => println!("    nearest NIC: {n} (shares {depth} PCI path components)"),
                    None => println!("    nearest NIC: none (no active PCI RDMA device, or the GPU's PCI path is unknown)"),
                }
            }
        }
    }
    if topo.devices.len() > 1 {
        print!("  peer   ");
        for d in &topo.devices {
            print!(" GPU{:<4}", d.ordinal);
        }
        println!();
        for a in &topo.devices {
            print!("  GPU{:<4}", a.ordinal);
            for b in &topo.devices {
                let cell = match topo.link(a.ordinal, b.ordinal) {
                    None => "X",
                    Some(l) => match l.kind {
                        nvlink_p2p::LinkKind::LikelyNvLink => "NV",
                        nvlink_p2p::LinkKind::LikelyPcie => "PCIe",
                        _ => "none",
                    },
                };
                print!(" {cell:<7}");
            }
            println!();
        }
        println!("  (NV = peer path with native atomics, i.e. NVLink/NVSwitch; PCIe = peer path without)");
    }
}

fn main() {
    fabric::cli::die_on_broken_pipe();
    let active = rdma();
    let nics = nics();
    transports(active);
    gpus(&nics);
}
