//! Shared set-up for the real-verbs tests: they need an RDMA device (Soft-RoCE in the guest:
//! `SR_RXE=lo` → rxe0 with GID index 1 = ::ffff:127.0.0.1; `SR_RXE=pair` → rxe0/rxe1 on a veth
//! pair with GID index 0) and print `skipped: no RDMA device … [lacks rdma]` elsewhere (a
//! failure where `FABRIC_REQUIRE` lists `rdma`).
#![allow(dead_code)]

use ibverbs_safe::*;
use std::time::Duration;

pub const T: Duration = Duration::from_secs(10);

/// Prints `skipped: <reason> [lacks <capability>]` straight to the process's stdout, so it
/// shows in plain `cargo test` output (libtest captures `println!` of passing tests) — or,
/// where the comma-separated `FABRIC_REQUIRE` names the capability (the Soft-RoCE guest sets
/// `rdma,vgem,verbs-headers,…`), fails the test with that reason instead: a machine that
/// must have the hardware does not get to pass by skipping. Capabilities used here: `rdma`
/// (an RDMA device), `vgem` (a DMA-BUF exporter); the workspace's README lists them all.
pub fn skip(capability: &str, reason: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let required = std::env::var("FABRIC_REQUIRE").unwrap_or_default();
    if required.split(',').any(|c| c.trim() == capability) {
        panic!("this machine must have `{capability}` (FABRIC_REQUIRE={required}), but {reason}");
    }
    let _ = writeln!(
        std::io::stdout().lock(),
        "skipped: {reason} [lacks {capability}]"
    );
}

/// Prints a line past libtest's capture (for results a reader must see, like what a
/// device refused).
pub fn note(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// One device layout to run a test on: two contexts (the same device twice for loopback)
/// and the GID index to use.
pub struct Layout {
    pub name: String,
    pub a: Context,
    pub b: Context,
    pub gid: u8,
}

fn env_u8(k: &str) -> Option<u8> {
    std::env::var(k).ok().and_then(|s| s.parse().ok())
}

/// Every layout present: the harness's `SOFTROCE_LO_DEV`/`SOFTROCE_PAIR_DEVS` (ci/softroce),
/// else what the device list suggests (one device: loopback; two: a veth pair with GID 0).
/// Prints `skipped: no RDMA device` and returns nothing when there is no device.
pub fn layouts(test: &str) -> Vec<Layout> {
    let devs = match devices() {
        Ok(d) => d,
        Err(e) => {
            skip("rdma", format_args!("no RDMA device ({test}: {e})"));
            return vec![];
        }
    };
    if devs.is_empty() {
        skip("rdma", format_args!("no RDMA device ({test})"));
        return vec![];
    }
    let gid_override = env_u8("IBV_GID_INDEX");
    let mut out = vec![];
    let lo = std::env::var("SOFTROCE_LO_DEV").ok();
    let pair = std::env::var("SOFTROCE_PAIR_DEVS").ok();
    if lo.is_some() || pair.is_some() {
        if let Some(d) = lo {
            let c = open(Some(&d)).expect("open SOFTROCE_LO_DEV");
            let gid = gid_override
                .or(env_u8("SOFTROCE_LO_GID"))
                .unwrap_or_else(|| pick_gid(&c));
            out.push(Layout {
                name: format!("lo:{d}"),
                a: c.clone(),
                b: c,
                gid,
            });
        }
        if let Some(p) = pair {
            let mut it = p.split_whitespace();
            if let (Some(x), Some(y)) = (it.next(), it.next()) {
                let gid = gid_override.or(env_u8("SOFTROCE_PAIR_GID")).unwrap_or(0);
                out.push(Layout {
                    name: format!("pair:{x}-{y}"),
                    a: open(Some(x)).expect("open pair device"),
                    b: open(Some(y)).expect("open pair device"),
                    gid,
                });
            }
        }
    } else if devs.len() >= 2 {
        out.push(Layout {
            name: format!("pair:{}-{}", devs[0].name, devs[1].name),
            a: open(Some(&devs[0].name)).expect("open device"),
            b: open(Some(&devs[1].name)).expect("open device"),
            gid: gid_override.unwrap_or(0),
        });
    } else {
        let c = open(Some(&devs[0].name)).expect("open device");
        let gid = gid_override.unwrap_or_else(|| pick_gid(&c));
        out.push(Layout {
            name: format!("lo:{}", devs[0].name),
            a: c.clone(),
            b: c,
            gid,
        });
    }
    for l in &out {
        println!("{test}: layout {} (GID index {})", l.name, l.gid);
    }
    out
}

/// Prefer an IPv4-mapped RoCE v2 GID (the `lo` layout's index 1), else index 0.
pub fn pick_gid(ctx: &Context) -> u8 {
    let table = ctx.gid_table(1).unwrap_or_default();
    table
        .iter()
        .find(|e| e.gid.to_ipv6().to_ipv4_mapped().is_some() && e.gid_type != Some(GidType::RoceV1))
        .or_else(|| table.first())
        .map_or(0, |e| e.index as u8)
}

pub struct Side<T: Transport> {
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair<T>,
}

pub struct Opts {
    pub depth: u32,
    pub sge: u32,
    pub inline: u32,
    pub retry: u8,
    pub rnr_retry: u8,
    pub timeout: u8,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            depth: 64,
            sge: 4,
            inline: 64,
            retry: 7,
            rnr_retry: 7,
            timeout: 14,
        }
    }
}

/// Two connected QPs of transport `T` (RC or UC), each with its own PD and CQ.
pub fn connected<T: Connected>(l: &Layout, o: &Opts) -> (Side<T>, Side<T>) {
    let (pda, pdb) = (l.a.alloc_pd().unwrap(), l.b.alloc_pd().unwrap());
    let (cqa, cqb) = (l.a.create_cq(256).unwrap(), l.b.create_cq(256).unwrap());
    let a = builder(&pda, &cqa, l.gid, o).build::<T>().unwrap();
    let b = builder(&pdb, &cqb, l.gid, o).build::<T>().unwrap();
    // Go through the wire format, as a real peer exchange would.
    let (ea, eb) = (a.endpoint().to_bytes(), b.endpoint().to_bytes());
    let a = a.connect_bytes(&eb).unwrap();
    let b = b.connect_bytes(&ea).unwrap();
    (
        Side {
            pd: pda,
            cq: cqa,
            qp: a,
        },
        Side {
            pd: pdb,
            cq: cqb,
            qp: b,
        },
    )
}

pub fn builder<'a>(
    pd: &'a ProtectionDomain,
    cq: &'a CompletionQueue,
    gid: u8,
    o: &Opts,
) -> QpBuilder<'a> {
    pd.queue_pair(cq, cq)
        .gid_index(gid)
        .max_send_wr(o.depth)
        .max_recv_wr(o.depth)
        .max_sge(o.sge, o.sge)
        .max_inline_data(o.inline)
        .retry_cnt(o.retry)
        .rnr_retry(o.rnr_retry)
        .timeout(o.timeout)
}

/// Polls exactly `n` completions and returns them.
pub fn wait(cq: &mut CompletionQueue, n: usize) -> Vec<Completion> {
    let mut out = Completion::buffer(n);
    cq.poll_exact(&mut out, n, T)
        .unwrap_or_else(|e| panic!("waiting for {n} completions: {e}"));
    out
}

/// A test-only knob that breaks the rkey of the WRITE tests, proving they can fail.
pub fn rkey(r: RemoteMemory) -> RemoteMemory {
    if std::env::var_os("IBVERBS_SAFE_BREAK_RKEY").is_some() {
        RemoteMemory {
            rkey: r.rkey ^ 0x5a5a,
            ..r
        }
    } else {
        r
    }
}
