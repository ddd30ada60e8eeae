//! Host-side instruction counts of the safe post+poll path: the rounds of
//! `examples/post_poll_bench.rs` (owned, scoped, raw) on the fake provider's lean data path
//! ([`Fake::lean_data_path`]), so that callgrind can count the safe layer's own work on any
//! machine, per function and per source line (`ibverbs-safe/bench/callgrind-host.sh`). The
//! figures of record come from the same rounds on Soft-RoCE in the guest
//! (`ibverbs-safe/bench/callgrind-post-poll.sh`); these track the safe layer between guest
//! runs. The test itself checks that every variant completes every message and hands every
//! handle back.
#![allow(unsafe_code)]
use crate::fake::Fake;
use crate::raw::{self, ibv_sge, ibv_wc};
use crate::*;
use std::time::Duration;

const ITERS: usize = 1024;
const DEPTH: usize = 32;
const ROUNDS: usize = 5;

#[inline(never)]
fn owned_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    remote: RemoteMemory,
    out: &mut [Completion],
) -> usize {
    let (mut posted, mut done) = (0usize, 0usize);
    while done < ITERS {
        while posted < ITERS && posted - done < DEPTH {
            qp.post_send(SendRequest::write(src.clone(), remote).wr_id(posted as u64))
                .expect("post");
            posted += 1;
        }
        let n = cq.poll(out).expect("poll");
        for c in &out[..n] {
            assert!(c.is_ok(), "completion error {}", c.status());
        }
        done += n;
    }
    done
}

#[inline(never)]
fn scoped_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MemoryRegion,
    len: usize,
    remote: RemoteMemory,
    out: &mut [Completion],
) -> usize {
    qp.scope(cq, Duration::from_secs(30), |s| {
        let (mut posted, mut done) = (0usize, 0usize);
        while done < ITERS {
            while posted < ITERS && posted - done < DEPTH {
                s.write(src, ..len, remote, posted as u64).expect("post");
                posted += 1;
            }
            let n = s.poll(out).expect("poll");
            for c in &out[..n] {
                assert!(c.is_ok(), "completion error {}", c.status());
            }
            done += n;
        }
        done
    })
    .expect("scope")
}

#[inline(never)]
fn raw_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    remote: RemoteMemory,
    wcs: &mut [ibv_wc],
) -> usize {
    let mut sge = ibv_sge {
        addr: src.addr(),
        length: src.len() as u32,
        lkey: src.lkey(),
    };
    let (mut posted, mut done) = (0usize, 0usize);
    while done < ITERS {
        while posted < ITERS && posted - done < DEPTH {
            let mut wr = raw::send_wr();
            wr.wr_id = ((posted as u64) << 1) | 1;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = raw::IBV_WR_RDMA_WRITE;
            wr.send_flags = raw::IBV_SEND_SIGNALED;
            wr.wr.rdma = raw::ibv_send_wr_rdma {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            };
            // SAFETY: one valid WR with one SGE inside `src`'s registration, which stays
            // alive; the fake device never touches memory; polled below with poll_raw.
            unsafe { qp.post_send_raw(&mut wr) }.expect("raw post");
            posted += 1;
        }
        let n = cq.poll_raw(wcs).expect("raw poll");
        for wc in &wcs[..n] {
            assert_eq!(wc.status, 0, "completion error");
        }
        done += n;
    }
    done
}

/// `HOTPATH_ONLY=owned|scoped|raw` runs one variant (what the callgrind script does).
#[test]
#[cfg_attr(
    miri,
    ignore = "an instruction-count harness; the fault tests cover the paths"
)]
fn post_poll_rounds() {
    let only = std::env::var("HOTPATH_ONLY").unwrap_or_default();
    let f = Fake::new();
    f.lean_data_path();
    let pd = f.ctx.alloc_pd().unwrap();
    let mut cq = f.ctx.create_cq(4 * DEPTH as u32 + 16).unwrap();
    let qa = pd
        .queue_pair(&cq, &cq)
        .max_send_wr(DEPTH as u32)
        .build_rc()
        .unwrap();
    let ep = qa.endpoint();
    let mut qp = qa.connect(&ep).unwrap();
    let target = pd
        .register_remote(AlignedBuffer::new(64).unwrap(), RemoteAccess::WRITE)
        .unwrap();
    let remote = target.remote().slice(0, 8).unwrap();
    let mut src_mr = pd.alloc_region(64).unwrap();
    let src = src_mr.slice(..8).unwrap();
    let mut out = Completion::buffer(DEPTH);
    let mut wcs = vec![ibv_wc::default(); DEPTH];
    for _ in 0..ROUNDS {
        if only.is_empty() || only == "owned" {
            assert_eq!(owned_round(&mut qp, &mut cq, &src, remote, &mut out), ITERS);
        }
        if only.is_empty() || only == "scoped" {
            let n = scoped_round(&mut qp, &mut cq, &src_mr, 8, remote, &mut out);
            assert_eq!(n, ITERS);
        }
        if only.is_empty() || only == "raw" {
            assert_eq!(raw_round(&mut qp, &mut cq, &src, remote, &mut wcs), ITERS);
        }
    }
    assert_eq!(qp.send_in_flight(), 0, "every slot retired");
    drop(out);
    drop(src);
    assert_eq!(src_mr.outstanding(), 0, "every handle came back");
}
