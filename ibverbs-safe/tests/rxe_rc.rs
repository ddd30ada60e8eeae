//! RC end-to-end tests against a real verbs device (Soft-RoCE in the guest).
//! On a machine without one each test prints `skipped: no RDMA device` and passes.
mod common;
use common::*;
use ibverbs_safe::*;

#[test]
fn rxe_rc_send_recv_with_and_without_imm() {
    let Some((mut a, mut b)) =
        connected::<Rc>("rxe_rc_send_recv_with_and_without_imm", Opts::default())
    else {
        return;
    };
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
    assert_eq!(&buf.to_vec()[..11], b"hello, rxe!");
    assert_eq!(got[1].wr_id(), 11);
    assert_eq!(got[1].imm(), Some(0xdead_beef));
    assert_eq!(got[1].byte_len(), 4);
    drop(buf);
    drop(got);
    drop(sent);
    // Every handle came back: the regions may be borrowed again.
    assert_eq!(rx.outstanding(), 0);
    assert_eq!(&rx.as_slice().unwrap()[4096..4100], b"imm!");
    assert_eq!(a.qp.send_in_flight(), 0);
    assert_eq!(b.qp.recv_in_flight(), 0);
}

#[test]
fn rxe_rc_write_with_and_without_imm() {
    let Some((mut a, mut b)) =
        connected::<Rc>("rxe_rc_write_with_and_without_imm", Opts::default())
    else {
        return;
    };
    let target =
        b.pd.register_remote(vec![0u8; 4096], RemoteAccess::WRITE)
            .unwrap();
    let remote = rkey(target.remote());
    let mut src = a.pd.alloc_region(4096).unwrap();
    for (i, x) in src.as_mut_slice().unwrap().iter_mut().enumerate() {
        *x = (i * 7) as u8;
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
    a.qp.post_send(
        SendRequest::write(
            src.slice(1024..2048).unwrap(),
            remote.slice(2048, 1024).unwrap(),
        )
        .imm(42)
        .wr_id(2),
    )
    .unwrap();
    wait(&mut a.cq, 1)[0].result().unwrap();
    let r = wait(&mut b.cq, 1);
    r[0].result().unwrap();
    assert_eq!(r[0].wr_id(), 77);
    assert_eq!(r[0].opcode(), WcOpcode::RecvRdmaWithImm);
    assert_eq!(r[0].imm(), Some(42));
    target.read_into(2048, &mut back).unwrap();
    drop(r);
    assert_eq!(&back[..], &src.as_slice().unwrap()[1024..2048]);
}
