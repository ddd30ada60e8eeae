//! Prints the driver, the GPUs and their peer matrix (like `nvidia-smi topo -m`, from the
//! CUDA driver API alone). Without a driver or GPU it says why and exits 0.
//!
//! `cargo run -p nvlink-p2p --example gpu_topology`
use nvlink_p2p::{Cuda, Error, LinkKind};

fn main() -> Result<(), Error> {
    let cuda = match Cuda::init() {
        Ok(c) => c,
        Err(e @ (Error::DriverUnavailable { .. } | Error::NoDevice)) => {
            println!("no GPU available: {e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let topo = cuda.topology()?;
    println!(
        "CUDA driver {}, {} device(s)",
        cuda.driver_version(),
        cuda.device_count()
    );
    for d in &topo.devices {
        let (dom, bus, dev) = d.pci;
        println!(
            "  GPU{} {} (PCI {dom:04x}:{bus:02x}:{dev:02x})",
            d.ordinal, d.name
        );
    }
    if topo.devices.len() < 2 {
        println!("one GPU: no peer matrix");
        return Ok(());
    }
    print!("{:>6}", "");
    for j in &topo.devices {
        print!("{:>8}", format!("GPU{}", j.ordinal));
    }
    println!();
    for i in &topo.devices {
        print!("{:>6}", format!("GPU{}", i.ordinal));
        for j in &topo.devices {
            let cell = match topo.link(i.ordinal, j.ordinal) {
                None => "X".to_string(),
                Some(l) => match l.kind {
                    LinkKind::LikelyNvLink => format!("NV r{}", l.performance_rank),
                    LinkKind::LikelyPcie => format!("PCIe r{}", l.performance_rank),
                    _ => "-".to_string(),
                },
            };
            print!("{cell:>8}");
        }
        println!();
    }
    println!("NV = peer path with native atomics (NVLink/NVSwitch), PCIe = peer path without, - = none; r = performance rank");
    Ok(())
}
