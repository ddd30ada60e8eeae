//! Shared set-up for the real-verbs tests: they need an RDMA device (Soft-RoCE in the guest:
//! `SR_RXE=lo` → rxe0 with GID index 1 = ::ffff:127.0.0.1; `SR_RXE=pair` → rxe0/rxe1 on a veth
//! pair with GID index 0) and print `skipped: no RDMA device` elsewhere.
#![allow(dead_code)]

use ibverbs_safe::*;
use std::time::Duration;

pub const T: Duration = Duration::from_secs(10);

/// The two ends' contexts and the GID index to use, or `None` (after printing why) when
/// this machine has no RDMA device.
pub fn ends(test: &str) -> Option<(Context, Context, u8)> {
    let devs = match devices() {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: no RDMA device ({test}: {e})");
            return None;
        }
    };
    if devs.is_empty() {
        println!("skipped: no RDMA device ({test})");
        return None;
    }
    let env_gid = std::env::var("IBV_GID_INDEX")
        .ok()
        .and_then(|s| s.parse().ok());
    if devs.len() >= 2 && std::env::var_os("IBV_SINGLE_DEVICE").is_none() {
        // `pair` layout: rxe0 <-> rxe1 over veth, link-local GID index 0.
        let a = open(Some(&devs[0].name)).expect("open first device");
        let b = open(Some(&devs[1].name)).expect("open second device");
        return Some((a, b, env_gid.unwrap_or(0)));
    }
    let a = open(Some(&devs[0].name)).expect("open device");
    let gid = env_gid.unwrap_or_else(|| pick_gid(&a));
    Some((a.clone(), a, gid))
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

fn builder<'a>(
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

/// Two connected QPs of transport `T` (RC or UC), each with its own PD and CQ.
pub fn connected<T: Connected>(test: &str, o: Opts) -> Option<(Side<T>, Side<T>)> {
    let (ca, cb, gid) = ends(test)?;
    let (pda, pdb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (cqa, cqb) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
    let a = builder(&pda, &cqa, gid, &o).build::<T>().unwrap();
    let b = builder(&pdb, &cqb, gid, &o).build::<T>().unwrap();
    // Go through the wire format, as a real peer exchange would.
    let (ea, eb) = (a.endpoint().to_bytes(), b.endpoint().to_bytes());
    let a = a.connect_bytes(&eb).unwrap();
    let b = b.connect_bytes(&ea).unwrap();
    Some((
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
    ))
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
