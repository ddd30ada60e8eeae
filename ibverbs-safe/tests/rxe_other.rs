//! Device queries, SRQ, UD, UC, completion channels and the memlock error against a real
//! verbs device (Soft-RoCE in the guest). Without a device: `skipped: no RDMA device`.
mod common;
use common::*;
use ibverbs_safe::*;
use std::time::Duration;

#[test]
fn rxe_device_port_and_gid_queries() {
    for l in layouts("rxe_device_port_and_gid_queries") {
        for ctx in [&l.a, &l.b] {
            let attr = ctx.query_device().unwrap();
            assert!(
                attr.max_qp > 0 && attr.max_cqe > 0 && attr.max_sge > 0,
                "{attr:?}"
            );
            assert!(attr.phys_port_cnt >= 1);
            let port = ctx.query_port(1).unwrap();
            assert!(port.is_active(), "{port:?}");
            assert_eq!(port.link_layer, LinkLayer::Ethernet, "rxe is RoCE");
            assert!(port.active_mtu.is_some());
            let table = ctx.gid_table(1).unwrap();
            assert!(!table.is_empty());
            let e = table
                .iter()
                .find(|e| e.index == l.gid as u32)
                .expect("the layout's GID index is populated");
            assert_eq!(ctx.query_gid(1, e.index).unwrap(), e.gid);
            println!(
                "{}: GID[{}] = {} ({:?})",
                ctx.device().name,
                e.index,
                e.gid,
                e.gid_type
            );
            assert!(matches!(
                ctx.query_port(99),
                Err(Error::QueryPort { port: 99, .. })
            ));
        }
        let present = l.a.device().name.clone();
        match open(Some("no-such-rdma-device")) {
            Err(Error::NoDevice { name, available }) => {
                assert_eq!(name.as_deref(), Some("no-such-rdma-device"));
                assert!(available.contains(&present));
            }
            other => panic!("expected NoDevice, got {other:?}"),
        }
    }
}

#[test]
fn rxe_srq_shared_by_two_qps() {
    for l in layouts("rxe_srq_shared_by_two_qps") {
        let o = Opts::default();
        let (pda, pdb) = (l.a.alloc_pd().unwrap(), l.b.alloc_pd().unwrap());
        let (mut cqa, mut cqb) = (l.a.create_cq(64).unwrap(), l.b.create_cq(64).unwrap());
        let mut srq = pdb.create_srq(16, 1).unwrap();
        let mut qa = vec![];
        let mut qb = vec![];
        for _ in 0..2 {
            let a = builder(&pda, &cqa, l.gid, &o).build_rc().unwrap();
            let b = builder(&pdb, &cqb, l.gid, &o).srq(&srq).build_rc().unwrap();
            let (ea, eb) = (a.endpoint(), b.endpoint());
            qa.push(a.connect(&eb).unwrap());
            qb.push(b.connect(&ea).unwrap());
        }
        let mut rx = pdb.alloc_region(4 * 256).unwrap();
        for i in 0..4 {
            srq.post_recv(rx.slice(i * 256..(i + 1) * 256).unwrap(), 50 + i as u64)
                .unwrap();
        }
        // A QP attached to an SRQ refuses its own receives.
        let e = qb[0].post_recv(rx.slice(..8).unwrap(), 0).unwrap_err();
        assert!(matches!(e.error, Error::InvalidRequest(_)));
        drop(e);
        let mut tx = pda.alloc_region(64).unwrap();
        tx.as_mut_slice().unwrap()[..7].copy_from_slice(b"one!two");
        qa[0].send(tx.slice(0..4).unwrap(), 1).unwrap();
        qa[1].send(tx.slice(4..7).unwrap(), 2).unwrap();
        wait(&mut cqa, 2).iter().for_each(|c| c.result().unwrap());
        let mut got = wait(&mut cqb, 2);
        let mut seen = vec![];
        for c in &mut got {
            c.result().unwrap();
            assert_eq!(c.queue(), Some(QueueKind::Srq));
            let from = qb
                .iter()
                .position(|q| q.qp_num() == c.qp_num())
                .expect("completion names its QP");
            let data = c.take_buf().unwrap().to_vec().unwrap();
            seen.push((from, data[..c.byte_len() as usize].to_vec()));
        }
        seen.sort();
        assert_eq!(seen, vec![(0, b"one!".to_vec()), (1, b"two".to_vec())]);
        assert_eq!(srq.in_flight(), 2);
        drop((got, qa, qb));
        drop(srq); // releases the two receives still posted
        assert_eq!(rx.outstanding(), 0);
    }
}

#[test]
fn rxe_ud_send_through_address_handle_with_grh() {
    for l in layouts("rxe_ud_send_through_address_handle_with_grh") {
        let o = Opts::default();
        let (pda, pdb) = (l.a.alloc_pd().unwrap(), l.b.alloc_pd().unwrap());
        let (mut cqa, mut cqb) = (l.a.create_cq(64).unwrap(), l.b.create_cq(64).unwrap());
        let mut a = builder(&pda, &cqa, l.gid, &o)
            .qkey(0x1234)
            .build_ud()
            .unwrap()
            .activate()
            .unwrap();
        let b = builder(&pdb, &cqb, l.gid, &o)
            .qkey(0x1234)
            .build_ud()
            .unwrap();
        let eb = Endpoint::from_bytes(&b.endpoint().to_bytes()).unwrap();
        assert_eq!(eb.qkey, 0x1234);
        let mut b = b.activate().unwrap();
        let mut rx = pdb.alloc_region(40 + 256).unwrap();
        b.post_recv(rx.slice(..).unwrap(), 7).unwrap();
        let dest = a.dest(&eb).unwrap();
        let mut tx = pda.alloc_region(256).unwrap();
        tx.as_mut_slice().unwrap()[..9].copy_from_slice(b"datagram!");
        a.send_to(tx.slice(..9).unwrap(), &dest, 8).unwrap();
        // RDMA WRITE is not a UD operation.
        let e = a
            .post_send(SendRequest::write(
                tx.slice(..9).unwrap(),
                RemoteMemory::default(),
            ))
            .unwrap_err();
        assert!(matches!(e.error, Error::InvalidRequest(_)));
        drop(e);
        wait(&mut cqa, 1)[0].result().unwrap();
        let mut r = wait(&mut cqb, 1);
        r[0].result().unwrap();
        assert!(r[0].has_grh(), "RoCE UD receives carry a GRH");
        assert_eq!(r[0].byte_len(), 40 + 9);
        assert_eq!(r[0].src_qp(), a.qp_num());
        assert_eq!(r[0].wr_id(), 7);
        let data = r[0].take_buf().unwrap().to_vec().unwrap();
        assert_eq!(&data[40..49], b"datagram!");
        drop((r, dest));
    }
}

#[test]
fn rxe_uc_write_and_send() {
    for l in layouts("rxe_uc_write_and_send") {
        let (mut a, mut b) = connected::<Uc>(&l, &Opts::default());
        let target =
            b.pd.register_remote(vec![0u8; 1024], RemoteAccess::WRITE)
                .unwrap();
        let mut tx = a.pd.alloc_region(1024).unwrap();
        tx.as_mut_slice().unwrap()[..10].copy_from_slice(b"uc-write!!");
        a.qp.write(
            tx.slice(..10).unwrap(),
            rkey(target.remote()).slice(100, 10).unwrap(),
            1,
        )
        .unwrap();
        wait(&mut a.cq, 1)[0].result().unwrap();
        let mut rx = b.pd.alloc_region(64).unwrap();
        b.qp.post_recv(rx.slice(..).unwrap(), 2).unwrap();
        a.qp.send(tx.slice(..7).unwrap(), 3).unwrap();
        wait(&mut a.cq, 1)[0].result().unwrap();
        let r = wait(&mut b.cq, 1);
        r[0].result().unwrap();
        assert_eq!(r[0].byte_len(), 7);
        drop(r);
        let mut got = [0u8; 10];
        target.read_into(100, &mut got).unwrap();
        assert_eq!(&got, b"uc-write!!");
        assert_eq!(&rx.as_slice().unwrap()[..7], b"uc-writ");
        // READ is not a UC operation.
        let e =
            a.qp.post_send(SendRequest::read(tx.slice(..8).unwrap(), target.remote()))
                .unwrap_err();
        assert!(matches!(e.error, Error::InvalidRequest(_)));
    }
}

#[test]
fn rxe_completion_channel_wakes_up() {
    for l in layouts("rxe_completion_channel_wakes_up") {
        let o = Opts::default();
        let (pda, pdb) = (l.a.alloc_pd().unwrap(), l.b.alloc_pd().unwrap());
        let ch = l.b.create_comp_channel().unwrap();
        let mut cqa = l.a.create_cq(16).unwrap();
        let mut cqb = l.b.create_cq_with_channel(16, &ch).unwrap();
        let a = builder(&pda, &cqa, l.gid, &o).build_rc().unwrap();
        let b = builder(&pdb, &cqb, l.gid, &o).build_rc().unwrap();
        let (ea, eb) = (a.endpoint(), b.endpoint());
        let (mut a, mut b) = (a.connect(&eb).unwrap(), b.connect(&ea).unwrap());
        let mut rx = pdb.alloc_region(64).unwrap();
        b.post_recv(rx.slice(..).unwrap(), 1).unwrap();
        cqb.req_notify(false).unwrap();
        assert_eq!(
            ch.wait(Some(Duration::from_millis(100))).unwrap(),
            None,
            "no event before any completion"
        );
        let mut tx = pda.alloc_region(64).unwrap();
        // Wake up from another thread's post, through poll(2) on the channel's fd.
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a.send(tx.slice(..16).unwrap(), 1).unwrap();
            wait(&mut cqa, 1)[0].result().unwrap();
            (a, cqa)
        });
        let ev = ch.wait(Some(T)).unwrap().expect("woken by the completion");
        assert_eq!(ev.cq_id, cqb.id());
        let r = wait(&mut cqb, 1);
        r[0].result().unwrap();
        let _keep = sender.join().unwrap();
        use std::os::fd::AsRawFd;
        assert!(ch.as_raw_fd() >= 0);
        drop(r);
        assert_eq!(rx.outstanding(), 0);
    }
}

/// Drops CAP_IPC_LOCK (which lets root ignore RLIMIT_MEMLOCK) from this process.
fn drop_ipc_lock_capability() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const CAP_IPC_LOCK: u32 = 14;
    let mut h = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget with a valid header and a two-element data array (capability v3).
    if unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) } != 0 {
        return false;
    }
    d[0].effective &= !(1 << CAP_IPC_LOCK);
    d[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset with the same valid header and data.
    unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) == 0 }
}

/// With a low RLIMIT_MEMLOCK and without CAP_IPC_LOCK, registering 64 MiB fails with
/// ENOMEM and the error names `ulimit -l` / `memlock`. Runs in a forked child, so the
/// lowered limit and dropped capability do not leak into other tests.
#[test]
fn rxe_memlock_too_low_is_a_clear_error() {
    let Some(l) = layouts("rxe_memlock_too_low_is_a_clear_error")
        .into_iter()
        .next()
    else {
        return;
    };
    let dev = l.a.device().name.clone();
    drop(l);
    // SAFETY: the child only calls async-signal-tolerant code paths of this crate and
    // libibverbs on its own new context, then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = (|| {
            let low = libc::rlimit {
                rlim_cur: 1 << 20,
                rlim_max: 1 << 20,
            };
            // SAFETY: valid rlimit.
            if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) } != 0
                || !drop_ipc_lock_capability()
            {
                return 3;
            }
            let ctx = match open(Some(&dev)) {
                Ok(c) => c,
                Err(_) => return 4,
            };
            let pd = ctx.alloc_pd().unwrap();
            match pd.alloc_region(64 << 20) {
                Err(e @ Error::RegMr { .. }) => {
                    let msg = e.to_string();
                    println!("child got: {msg}");
                    if msg.contains("ulimit -l") && msg.contains("memlock") {
                        0
                    } else {
                        1
                    }
                }
                Err(e) => {
                    println!("child got an unexpected error: {e}");
                    5
                }
                Ok(_) => 2,
            }
        })();
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: leaves the child without running the parent's atexit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child died: {status:#x}");
    match libc::WEXITSTATUS(status) {
        0 => {}
        2 => panic!("registration succeeded despite the low memlock limit"),
        1 => panic!("the ENOMEM message does not explain the memlock limit"),
        c => panic!("child failed with code {c}"),
    }
}
