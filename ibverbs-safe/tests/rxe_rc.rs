//! RC end-to-end tests against a real verbs device (Soft-RoCE in the guest), on every layout
//! present (`lo`: two QPs on rxe0; `pair`: rxe1 <-> rxe2 over veth). On a machine without a
//! device each test prints `skipped: no RDMA device` and passes.
mod common;
use common::*;
use ibverbs_safe::*;
use std::time::{Duration, Instant};

#[test]
fn rxe_rc_send_recv_with_and_without_imm() {
    for l in layouts("rxe_rc_send_recv_with_and_without_imm") {
        let (mut a, mut b) = connected::<Rc>(&l, &Opts::default());
        let mut rx = b.pd.alloc_region(8192).unwrap();
        let mut tx = a.pd.alloc_region(8192).unwrap();
        tx.as_mut_slice().unwrap()[..11].copy_from_slice(b"hello, rxe!");
        tx.as_mut_slice().unwrap()[4096..4100].copy_from_slice(b"imm!");
        b.qp.post_recv(rx.slice(..4096).unwrap(), 10).unwrap();
        b.qp.post_recv(rx.slice(4096..).unwrap(), 11).unwrap();
        a.qp.send(tx.slice(..11).unwrap(), 20).unwrap();
        a.qp.post_send(
            SendRequest::send(tx.slice(4096..4100).unwrap())
                .imm(0xdead_beef)
                .wr_id(21),
        )
        .unwrap();
        assert_eq!(rx.outstanding(), 2);
        let sent = wait(&mut a.cq, 2);
        for (c, id) in sent.iter().zip([20, 21]) {
            c.result().unwrap();
            assert_eq!(c.wr_id(), id);
            assert_eq!(c.opcode(), WcOpcode::Send);
            assert_eq!(c.queue(), Some(QueueKind::Send));
            assert_eq!(c.qp_num(), a.qp.qp_num());
        }
        let mut got = wait(&mut b.cq, 2);
        got[0].result().unwrap();
        assert_eq!(got[0].wr_id(), 10);
        assert_eq!(got[0].byte_len(), 11);
        assert_eq!(got[0].imm(), None);
        assert_eq!(got[0].opcode(), WcOpcode::Recv);
        assert_eq!(got[0].queue(), Some(QueueKind::Recv));
        let buf = got[0].take_buf().unwrap();
        assert_eq!(&buf.to_vec().unwrap()[..11], b"hello, rxe!");
        assert_eq!(got[1].wr_id(), 11);
        assert_eq!(got[1].imm(), Some(0xdead_beef));
        assert_eq!(got[1].byte_len(), 4);
        drop((buf, got, sent));
        // Every handle came back: the regions may be borrowed again.
        assert_eq!(rx.outstanding(), 0);
        assert_eq!(&rx.as_slice().unwrap()[4096..4100], b"imm!");
        assert_eq!(a.qp.send_in_flight(), 0);
        assert_eq!(b.qp.recv_in_flight(), 0);
    }
}

#[test]
fn rxe_rc_write_with_and_without_imm() {
    for l in layouts("rxe_rc_write_with_and_without_imm") {
        let (mut a, mut b) = connected::<Rc>(&l, &Opts::default());
        let target =
            b.pd.register_remote(vec![0u8; 4096], RemoteAccess::WRITE)
                .unwrap();
        let remote = rkey(target.remote());
        let mut src = a.pd.alloc_region(4096).unwrap();
        for (i, x) in src.as_mut_slice().unwrap().iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        a.qp.write(src.slice(..1024).unwrap(), remote, 1).unwrap();
        let c = wait(&mut a.cq, 1);
        c[0].result().unwrap();
        assert_eq!(c[0].opcode(), WcOpcode::RdmaWrite);
        drop(c); // hands the source handle back, so the region can be borrowed again
        let mut back = vec![0u8; 1024];
        target.read_into(0, &mut back).unwrap();
        assert_eq!(back, src.as_slice().unwrap()[..1024]);

        // WRITE with immediate consumes a receive at the target.
        b.qp.post_recv(SgList::new(), 77).unwrap();
        let w = SendRequest::write(
            src.slice(1024..2048).unwrap(),
            remote.slice(2048, 1024).unwrap(),
        );
        a.qp.post_send(w.imm(42).wr_id(2)).unwrap();
        wait(&mut a.cq, 1)[0].result().unwrap();
        let r = wait(&mut b.cq, 1);
        r[0].result().unwrap();
        assert_eq!(r[0].wr_id(), 77);
        assert_eq!(r[0].opcode(), WcOpcode::RecvRdmaWithImm);
        assert_eq!(r[0].imm(), Some(42));
        target.read_into(2048, &mut back).unwrap();
        assert_eq!(&back[..], &src.as_slice().unwrap()[1024..2048]);
    }
}

#[test]
fn rxe_rc_read() {
    for l in layouts("rxe_rc_read") {
        let (mut a, b) = connected::<Rc>(&l, &Opts::default());
        let source =
            b.pd.register_remote(vec![0u8; 8192], RemoteAccess::READ)
                .unwrap();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i ^ (i >> 8)) as u8).collect();
        source.write_from(0, &pattern).unwrap();
        let mut dst = a.pd.alloc_region(8192).unwrap();
        a.qp.read(
            dst.slice(..3000).unwrap(),
            rkey(source.remote()).slice(5000, 3000).unwrap(),
            9,
        )
        .unwrap();
        let mut c = wait(&mut a.cq, 1);
        c[0].result().unwrap();
        assert_eq!(c[0].opcode(), WcOpcode::RdmaRead);
        assert_eq!(c[0].wr_id(), 9);
        assert_eq!(
            c[0].take_buf().unwrap().to_vec().unwrap(),
            pattern[5000..8000]
        );
        drop(c);
        assert_eq!(dst.as_slice().unwrap()[..3000], pattern[5000..8000]);
        drop(b);
    }
}

#[test]
fn rxe_rc_atomics_compare_swap_and_fetch_add() {
    for l in layouts("rxe_rc_atomics_compare_swap_and_fetch_add") {
        let (mut a, b) = connected::<Rc>(&l, &Opts::default());
        let word =
            b.pd.register_remote(AlignedBuffer::new(64).unwrap(), RemoteAccess::ATOMIC)
                .unwrap();
        word.write_u64(8, 5).unwrap();
        let remote = rkey(word.remote()).slice(8, 8).unwrap();
        let mut res = a.pd.alloc_region(64).unwrap();
        let cases: [(SendRequest, u64, u64); 3] = [
            (
                SendRequest::compare_swap(res.slice(0..8).unwrap(), remote, 5, 9),
                5,
                9,
            ), // swaps
            (
                SendRequest::compare_swap(res.slice(8..16).unwrap(), remote, 5, 1),
                9,
                9,
            ), // no swap
            (
                SendRequest::fetch_add(res.slice(16..24).unwrap(), remote, 3),
                9,
                12,
            ),
        ];
        for (i, (req, old, new)) in cases.into_iter().enumerate() {
            a.qp.post_send(req.wr_id(i as u64)).unwrap();
            let mut c = wait(&mut a.cq, 1);
            c[0].result().unwrap();
            assert_eq!(
                c[0].opcode(),
                if i < 2 {
                    WcOpcode::CompareSwap
                } else {
                    WcOpcode::FetchAdd
                }
            );
            assert_eq!(
                c[0].take_buf().unwrap().read_u64(0).unwrap(),
                old,
                "old value, case {i}"
            );
            assert_eq!(word.read_u64(8).unwrap(), new, "remote value, case {i}");
        }
        // Misaligned or wrongly sized atomics are refused before posting.
        let e =
            a.qp.post_send(SendRequest::fetch_add(res.slice(1..9).unwrap(), remote, 1))
                .unwrap_err();
        assert!(matches!(e.error, Error::InvalidRequest(_)), "{e}");
        drop(e); // the refused request still holds its handle until dropped
        let e =
            a.qp.post_send(SendRequest::fetch_add(res.slice(0..16).unwrap(), remote, 1))
                .unwrap_err();
        assert!(matches!(e.error, Error::InvalidRequest(_)), "{e}");
        drop(e);
        assert_eq!(res.as_slice().unwrap().len(), 64);
        drop(b);
    }
}

#[test]
fn rxe_rc_inline_sgl_unsignaled_and_batches() {
    for l in layouts("rxe_rc_inline_sgl_unsignaled_and_batches") {
        let (mut a, mut b) = connected::<Rc>(&l, &Opts::default());
        assert!(a.qp.max_inline_data() >= 64, "asked for 64 inline bytes");
        let mut rx = b.pd.alloc_region(4096).unwrap();
        let mut tx = a.pd.alloc_region(4096).unwrap();

        // Inline from a plain slice (no registration), then inline from a registered slice.
        b.qp.post_recv(rx.slice(0..64).unwrap(), 1).unwrap();
        b.qp.post_recv(rx.slice(64..128).unwrap(), 2).unwrap();
        a.qp.send_inline(b"inline data", 100, true).unwrap();
        tx.as_mut_slice().unwrap()[..6].copy_from_slice(b"inline");
        a.qp.post_send(
            SendRequest::send(tx.slice(..6).unwrap())
                .inline()
                .wr_id(101),
        )
        .unwrap();
        let too_big = vec![0u8; a.qp.max_inline_data() as usize + 1];
        assert!(matches!(
            a.qp.send_inline(&too_big, 0, true),
            Err(Error::InvalidRequest(_))
        ));
        wait(&mut a.cq, 2).iter().for_each(|c| c.result().unwrap());
        let mut r = wait(&mut b.cq, 2);
        assert_eq!(r[0].byte_len(), 11);
        assert_eq!(
            r[0].take_buf().unwrap().to_vec().unwrap()[..11],
            *b"inline data"
        );
        assert_eq!(r[1].take_buf().unwrap().to_vec().unwrap()[..6], *b"inline");
        drop(r);

        // Scatter/gather: two source pieces into two destination pieces.
        tx.as_mut_slice().unwrap()[..5].copy_from_slice(b"ABCDE");
        tx.as_mut_slice().unwrap()[100..110].copy_from_slice(b"0123456789");
        b.qp.post_recv([rx.slice(0..3).unwrap(), rx.slice(200..300).unwrap()], 3)
            .unwrap();
        a.qp.send([tx.slice(0..5).unwrap(), tx.slice(100..110).unwrap()], 102)
            .unwrap();
        let mut s = wait(&mut a.cq, 1);
        s[0].result().unwrap();
        assert_eq!(s[0].take_bufs().len(), 2, "both SGEs come back");
        let r = wait(&mut b.cq, 1);
        r[0].result().unwrap();
        assert_eq!(r[0].byte_len(), 15);
        assert_eq!(r[0].bufs().len(), 2);
        drop((s, r));
        assert_eq!(&rx.as_slice().unwrap()[..3], b"ABC");
        assert_eq!(&rx.as_slice().unwrap()[200..212], b"DE0123456789");

        // Unsignalled: 7 unsignalled WRITEs and one signalled one -> one completion, and all
        // eight handles are retired by it.
        let target =
            b.pd.register_remote(vec![0u8; 4096], RemoteAccess::WRITE)
                .unwrap();
        let remote = rkey(target.remote());
        let src = tx.slice(0..512).unwrap();
        for i in 0..7u64 {
            let req = SendRequest::write(src.clone(), remote.slice(i * 512, 512).unwrap());
            a.qp.post_send(req.unsignaled().wr_id(i)).unwrap();
        }
        a.qp.write(src.clone(), remote.slice(7 * 512, 512).unwrap(), 7)
            .unwrap();
        let c = wait(&mut a.cq, 1);
        c[0].result().unwrap();
        assert_eq!(c[0].wr_id(), 7);
        std::thread::sleep(Duration::from_millis(50));
        let mut extra = Completion::buffer(4);
        assert_eq!(
            a.cq.poll(&mut extra).unwrap(),
            0,
            "unsignalled WRs produce no completion"
        );
        assert_eq!(
            a.qp.send_in_flight(),
            0,
            "the signalled completion retired the unsignalled ones"
        );
        drop((c, src));
        assert_eq!(tx.outstanding(), 0);

        // A batch of 8 WRITEs in one post.
        let mut batch = SendBatch::new();
        for i in 0..8u64 {
            let piece = tx.slice(i as usize * 64..(i as usize + 1) * 64).unwrap();
            batch
                .push(SendRequest::write(piece, remote.slice(i * 64, 64).unwrap()).wr_id(1000 + i))
                .unwrap();
        }
        assert_eq!(a.qp.post_batch(&mut batch).unwrap(), 8);
        assert!(batch.is_empty());
        let done = wait(&mut a.cq, 8);
        for (i, c) in done.iter().enumerate() {
            c.result().unwrap();
            assert_eq!(c.wr_id(), 1000 + i as u64, "batch completes in order");
        }
        drop(done);
        let mut got = vec![0u8; 512];
        target.read_into(0, &mut got).unwrap();
        assert_eq!(got, tx.as_slice().unwrap()[..512]);
    }
}

#[test]
fn rxe_rc_bounds_are_checked_before_posting() {
    for l in layouts("rxe_rc_bounds_are_checked_before_posting") {
        let (mut a, b) = connected::<Rc>(&l, &Opts::default());
        let mut mr = a.pd.alloc_region(100).unwrap();
        assert!(matches!(
            mr.slice(50..101),
            Err(Error::OutOfBounds {
                region_len: 100,
                ..
            })
        ));
        let target =
            b.pd.register_remote(vec![0u8; 64], RemoteAccess::WRITE)
                .unwrap();
        let e =
            a.qp.write(mr.slice(..100).unwrap(), target.remote(), 0)
                .unwrap_err();
        assert!(matches!(e.error, Error::OutOfBounds { .. }), "{e}");
        assert_eq!(e.request.bufs().len(), 1, "the buffer comes back");
        assert_eq!(a.qp.send_in_flight(), 0, "nothing was posted");
        drop(e);
        assert_eq!(mr.outstanding(), 0);
        assert!(target.remote().slice(60, 8).is_err());
    }
}

/// Remote access with a wrong rkey and outside the region: the WRITE completes with a
/// remote access error, the QP goes to the error state, and every other posted work
/// request is flushed and hands its buffer back.
#[test]
fn rxe_rc_remote_access_error_flushes_every_buffer() {
    for l in layouts("rxe_rc_remote_access_error_flushes_every_buffer") {
        for case in ["wrong rkey", "out of bounds"] {
            let (mut a, b) = connected::<Rc>(&l, &Opts::default());
            let target =
                b.pd.register_remote(vec![0u8; 4096], RemoteAccess::WRITE)
                    .unwrap();
            let good = target.remote();
            let bad = match case {
                "wrong rkey" => RemoteMemory {
                    rkey: good.rkey ^ 0x5a5a,
                    ..good
                },
                _ => RemoteMemory {
                    addr: good.addr + 4000,
                    len: 1024,
                    rkey: good.rkey,
                },
            };
            let mut mr = a.pd.alloc_region(8192).unwrap();
            for i in 0..3 {
                a.qp.post_recv(mr.slice(i * 1024..(i + 1) * 1024).unwrap(), 10 + i as u64)
                    .unwrap();
            }
            a.qp.write(mr.slice(4096..5120).unwrap(), bad, 1).unwrap();
            a.qp.send(mr.slice(6000..6100).unwrap(), 2).unwrap();
            a.qp.write(mr.slice(7000..7100).unwrap(), good, 3).unwrap();
            assert_eq!(mr.outstanding(), 6);
            let mut all = wait(&mut a.cq, 6);
            let first = all.iter().find(|c| c.wr_id() == 1).unwrap();
            assert_eq!(first.status(), WcStatus::RemoteAccess, "{case}");
            for c in all.iter().filter(|c| c.wr_id() != 1) {
                assert_eq!(c.status(), WcStatus::WrFlush, "{case}: wr {}", c.wr_id());
            }
            let mut ids: Vec<u64> = all.iter().map(|c| c.wr_id()).collect();
            ids.sort();
            assert_eq!(ids, [1, 2, 3, 10, 11, 12]);
            assert_eq!(a.qp.state().unwrap(), QpState::Error);
            let returned: usize = all.iter_mut().map(|c| c.take_bufs().len()).sum();
            assert_eq!(returned, 6, "every posted buffer came back");
            drop(all);
            assert_eq!(mr.outstanding(), 0);
            assert_eq!(a.qp.send_in_flight() + a.qp.recv_in_flight(), 0);
            let mut check = [0u8; 96];
            target.read_into(4000, &mut check).unwrap();
            assert!(check.iter().all(|&x| x == 0), "nothing was written");
        }
    }
}

#[test]
fn rxe_rc_receiver_not_ready() {
    for l in layouts("rxe_rc_receiver_not_ready") {
        let o = Opts {
            rnr_retry: 0,
            ..Opts::default()
        };
        let (mut a, b) = connected::<Rc>(&l, &o);
        let mr = a.pd.alloc_region(64).unwrap();
        let mut mr = mr;
        a.qp.send(mr.slice(..).unwrap(), 1).unwrap(); // b posted no receive
        let c = wait(&mut a.cq, 1);
        assert_eq!(c[0].status(), WcStatus::RnrRetryExceeded);
        drop(b);
    }
}

#[test]
fn rxe_rc_peer_qp_destroyed_mid_stream() {
    for l in layouts("rxe_rc_peer_qp_destroyed_mid_stream") {
        let o = Opts {
            retry: 1,
            timeout: 12,
            ..Opts::default()
        };
        let (mut a, mut b) = connected::<Rc>(&l, &o);
        let mut rx = b.pd.alloc_region(64).unwrap();
        let mut tx = a.pd.alloc_region(64).unwrap();
        b.qp.post_recv(rx.slice(..).unwrap(), 1).unwrap();
        a.qp.send(tx.slice(..).unwrap(), 1).unwrap();
        wait(&mut a.cq, 1)[0].result().unwrap();
        wait(&mut b.cq, 1)[0].result().unwrap();
        drop(b); // the peer goes away
        let t0 = Instant::now();
        a.qp.send(tx.slice(..).unwrap(), 2).unwrap();
        let c = wait(&mut a.cq, 1);
        assert!(
            matches!(
                c[0].status(),
                WcStatus::RetryExceeded
                    | WcStatus::RemoteOperation
                    | WcStatus::RemoteInvalidRequest
            ),
            "got {}",
            c[0].status()
        );
        println!("survivor got {} after {:?}", c[0].status(), t0.elapsed());
        drop(c);
        assert_eq!(tx.outstanding(), 0);
        let _ = rx.as_slice();
    }
}

/// Dropping QPs with receives and sends in flight releases every buffer (after the QP is
/// destroyed), so the region can be taken apart.
#[test]
fn rxe_rc_drop_with_work_in_flight() {
    for l in layouts("rxe_rc_drop_with_work_in_flight") {
        let (mut a, b) = connected::<Rc>(&l, &Opts::default());
        let mut mr = a.pd.alloc_region(8192).unwrap();
        for i in 0..8 {
            a.qp.post_recv(mr.slice(i * 512..(i + 1) * 512).unwrap(), i as u64)
                .unwrap();
        }
        // b has no receives and rnr_retry is infinite: these sends stay in flight.
        for i in 0..4 {
            a.qp.send(
                mr.slice(4096 + i * 64..4096 + (i + 1) * 64).unwrap(),
                100 + i as u64,
            )
            .unwrap();
        }
        assert_eq!(mr.outstanding(), 12);
        std::thread::sleep(Duration::from_millis(20));
        let Side { qp, cq, pd } = a;
        drop(qp);
        assert_eq!(
            mr.outstanding(),
            0,
            "the dropped QP released every in-flight buffer"
        );
        let buf = mr.into_inner().expect("no handle left");
        assert_eq!(buf.as_slice().len(), 8192);
        // Late flushed completions of the dropped QP are ignored by the CQ, safely.
        let mut cq = cq;
        let mut out = Completion::buffer(16);
        let n = cq.poll(&mut out).unwrap();
        assert!(out[..n].iter().all(|c| c.bufs().is_empty()));
        drop((pd, b));
        assert_eq!(drop_failures(), 0);
    }
}

/// Scoped work requests borrow registered memory (no handles) and the scope returns only
/// after all of them completed — also when the closure panics.
#[test]
fn rxe_rc_scope_borrows_and_waits() {
    for l in layouts("rxe_rc_scope_borrows_and_waits") {
        let (mut a, mut b) = connected::<Rc>(&l, &Opts::default());
        let target =
            b.pd.register_remote(vec![0u8; 4096], RemoteAccess::WRITE | RemoteAccess::READ)
                .unwrap();
        let remote = rkey(target.remote());
        let mut rx = b.pd.alloc_region(256).unwrap();
        b.qp.post_recv(rx.slice(..).unwrap(), 5).unwrap();
        let mut src = a.pd.alloc_region(4096).unwrap();
        src.as_mut_slice().unwrap()[..16].copy_from_slice(b"scoped writes!!!");
        let mut dst = a.pd.alloc_region(64).unwrap();
        let n =
            a.qp.scope(&mut a.cq, T, |s| {
                for i in 0..8u64 {
                    s.write(&src, ..16, remote.slice(i * 16, 16).unwrap(), i)
                        .unwrap();
                }
                s.send(&src, ..16, 100).unwrap();
                // Shared borrows stay readable while the device reads them.
                assert_eq!(&src.as_slice().unwrap()[..6], b"scoped");
                assert!(
                    s.write(&src, ..4096, remote.slice(0, 16).unwrap(), 0)
                        .is_err(),
                    "bounds checked"
                );
                s.outstanding()
            })
            .unwrap();
        assert_eq!(n, 9);
        assert_eq!(a.qp.send_in_flight(), 0, "the scope waited for everything");
        let mut got = [0u8; 16];
        target.read_into(7 * 16, &mut got).unwrap();
        assert_eq!(&got, b"scoped writes!!!");
        wait(&mut b.cq, 1)[0].result().unwrap();
        assert_eq!(&rx.as_slice().unwrap()[..16], b"scoped writes!!!");

        // READ into an exclusively borrowed region.
        a.qp.scope(&mut a.cq, T, |s| {
            s.read(&mut dst, ..16, remote.slice(16, 16).unwrap(), 1)
                .unwrap()
        })
        .unwrap();
        assert_eq!(&dst.as_slice().unwrap()[..16], b"scoped writes!!!");

        // A panic inside the scope still waits for the posted work before unwinding.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            a.qp.scope(&mut a.cq, T, |s| {
                s.write(&src, ..16, remote.slice(0, 16).unwrap(), 1)
                    .unwrap();
                panic!("boom");
            })
        }));
        assert!(r.is_err());
        assert_eq!(a.qp.send_in_flight(), 0);

        // A scope needs the QP's own send CQ.
        let mut other = l.a.create_cq(4).unwrap();
        assert!(matches!(
            a.qp.scope(&mut other, T, |_| ()),
            Err(Error::InvalidArgument(_))
        ));
    }
}
