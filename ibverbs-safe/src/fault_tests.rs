//! Provider faults and misuse, driven through the crate's normal code paths on the fake
//! provider ([`crate::fake`]): no device needed, and Miri runs them (ci/hardening.sh).
#![allow(unsafe_code)]
use crate::fake::{Fake, PostSendMode, WC_FLUSH};
use crate::*;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// An RC QP on the fake device, connected to itself.
fn rc_qp(
    f: &Fake,
    scq: &CompletionQueue,
    rcq: &CompletionQueue,
    depth: u32,
) -> (ProtectionDomain, QueuePair<Rc>) {
    let pd = f.ctx.alloc_pd().unwrap();
    let qp = pd
        .queue_pair(scq, rcq)
        .max_send_wr(depth)
        .max_recv_wr(depth)
        .max_inline_data(64)
        .build_rc()
        .unwrap();
    let ep = qp.endpoint();
    (pd.clone(), qp.connect(&ep).unwrap())
}

/// Runs `f` on another thread and fails the test if it has not finished within `secs`
/// (a hang becomes a failure instead of a stuck test run).
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    let secs = if cfg!(miri) { secs * 60 } else { secs };
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("did not finish within {secs} s (hang)"))
}

/// A scope timeout that expires quickly on the host, and leaves Miri (far slower) time to
/// make more than one poll.
fn short() -> Duration {
    Duration::from_millis(if cfg!(miri) { 2000 } else { 20 })
}

fn remote() -> RemoteMemory {
    RemoteMemory {
        addr: 0x10_0000,
        len: 4096,
        rkey: 0x77,
    }
}

/// A DMA-BUF "owner" (what keeps device memory allocated) whose drop panics, or counts.
struct Owner {
    panic: bool,
    drops: Arc<AtomicUsize>,
}
impl Drop for Owner {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        if self.panic {
            panic!("owner drop panics (on purpose)");
        }
    }
}

fn device_region(
    pd: &ProtectionDomain,
    iova: u64,
    panic: bool,
) -> (DeviceMemoryRegion, Arc<AtomicUsize>) {
    let drops = Arc::new(AtomicUsize::new(0));
    let owner = Owner {
        panic,
        drops: drops.clone(),
    };
    let stdin = std::io::stdin();
    let r = pd
        .register_dmabuf(stdin.as_fd(), 0, 4096, iova, RemoteAccess::empty(), owner)
        .unwrap();
    (r, drops)
}

#[test]
fn fake_provider_round_trip() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let mut mr = pd.alloc_region(64).unwrap();
    qp.send(mr.slice(..8).unwrap(), 7).unwrap();
    assert_eq!(f.sends_on_device(qp.qp_num()), 1);
    assert_eq!(f.complete_sends(qp.qp_num(), 1, 0), 1);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 7);
    assert!(out[0].take_buf().is_some());
    assert_eq!(mr.outstanding(), 0);
}

/// Hole 1: a failing poll inside the scope's wait must not end the scope while its READ is
/// still on the device: it is retried, the QP is moved to ERR and the flush is waited for.
#[test]
fn scope_poll_error_never_returns_with_work_in_flight() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let mut target = pd.alloc_region(64).unwrap();
    // Fails in `finish` and again in the drop-time wait (both used to return early).
    f.fail_polls(cq.id(), 2);
    let qpn = qp.qp_num();
    let r = qp.scope(&mut cq, short(), |s| {
        s.read(&mut target, ..64, remote(), 1).unwrap();
    });
    assert!(r.is_err(), "the READ never completed: {r:?}");
    assert_eq!(
        f.sends_on_device(qpn),
        0,
        "the scope returned while its READ (into the borrowed region) was still on the device"
    );
    assert!(qp.state().unwrap() == QpState::Error);
    target.as_mut_slice().unwrap()[0] = 1;
}

/// Hole 2: completions of other work kept back by the scope must not hide the device CQ
/// from it (8+ stashed) nor stop its deadline (any stashed).
#[test]
fn scope_with_stashed_completions_polls_the_device_and_keeps_its_deadline() {
    // One receive completes during the scope; the scope's own WRITE never does: the timeout
    // must fire (then ERR + flush).
    let r = within(20, || {
        let f = Fake::new();
        let mut cq = f.ctx.create_cq(64).unwrap();
        let (pd, mut qp) = rc_qp(&f, &cq, &cq, 16);
        let mut rx = pd.alloc_region(64).unwrap();
        let src = pd.alloc_region(64).unwrap();
        qp.post_recv(rx.slice(..).unwrap(), 42).unwrap();
        let qpn = qp.qp_num();
        let r = qp.scope(&mut cq, short(), |s| {
            s.write(&src, ..8, remote(), 1).unwrap();
            f.complete_recv(qpn, 8, 0);
        });
        let flushed = f.sends_on_device(qpn);
        let mut out = Completion::buffer(4);
        let n = cq.poll(&mut out).unwrap();
        (format!("{r:?}"), flushed, n, out[0].wr_id())
    });
    assert!(r.0.contains("Timeout"), "{}", r.0);
    assert_eq!(r.1, 0);
    assert_eq!(
        (r.2, r.3),
        (1, 42),
        "the receive completion is handed out afterwards"
    );

    // Eight receives complete before the scope's WRITE: the scope must still see its own.
    let r = within(20, || {
        let f = Fake::new();
        let mut cq = f.ctx.create_cq(64).unwrap();
        let (pd, mut qp) = rc_qp(&f, &cq, &cq, 16);
        let mut rx = pd.alloc_region(64).unwrap();
        let src = pd.alloc_region(64).unwrap();
        for i in 0..8 {
            qp.post_recv(rx.slice(i * 8..i * 8 + 8).unwrap(), 100 + i as u64)
                .unwrap();
        }
        let qpn = qp.qp_num();
        for _ in 0..8 {
            f.complete_recv(qpn, 8, 0);
        }
        let r = qp.scope(&mut cq, Duration::from_secs(1), |s| {
            s.write(&src, ..8, remote(), 1).unwrap();
            f.complete_sends(qpn, 1, 0);
        });
        let mut out = Completion::buffer(16);
        let n = cq.poll(&mut out).unwrap();
        let ids: Vec<u64> = out[..n].iter().map(Completion::wr_id).collect();
        (format!("{r:?}"), ids)
    });
    assert_eq!(r.0, "Ok(())");
    assert_eq!(r.1, (100..108).collect::<Vec<u64>>());
}

/// A scope's `poll` counts its own completions as it takes them in: the completions of
/// another QP's work on the same CQ, the QP's receives and its send posted before the
/// scope count for nothing, the scope's
/// own error status is the one the scope reports, and once its own completions were polled
/// nothing of it is outstanding.
#[test]
fn scope_poll_counts_only_its_own_completions_and_its_first_error() {
    let r = within(20, || {
        let f = Fake::new();
        let mut cq = f.ctx.create_cq(64).unwrap();
        let (pd, mut qp) = rc_qp(&f, &cq, &cq, 16);
        let o = pd
            .queue_pair(&cq, &cq)
            .max_send_wr(8)
            .max_recv_wr(8)
            .build_rc()
            .unwrap();
        let ep = o.endpoint();
        let mut other = o.connect(&ep).unwrap();
        let src = pd.alloc_region(64).unwrap();
        let mut rx = pd.alloc_region(64).unwrap();
        let mut osrc = pd.alloc_region(64).unwrap();
        qp.post_recv(rx.slice(..8).unwrap(), 42).unwrap();
        // An owned send of the scope's own QP, posted before the scope: not the scope's.
        qp.send(osrc.slice(8..16).unwrap(), 8).unwrap();
        other.send(osrc.slice(..8).unwrap(), 7).unwrap();
        let (qpn, oqpn) = (qp.qp_num(), other.qp_num());
        let mut seen = Vec::new();
        let r = qp.scope(&mut cq, Duration::from_secs(5), |s| {
            s.write(&src, ..8, remote(), 1).unwrap();
            s.write(&src, 8..16, remote(), 2).unwrap();
            // Other work completes first, then the scope's two: the first with an error.
            f.complete_sends(oqpn, 1, 0);
            f.complete_recv(qpn, 8, 0);
            f.complete_sends(qpn, 1, 0);
            let mut out = Completion::buffer(8);
            let n = s.poll(&mut out).unwrap();
            seen.push((n, s.outstanding()));
            f.complete_sends(qpn, 1, WC_FLUSH);
            f.complete_sends(qpn, 1, 0);
            let mut n = 0;
            while n < 2 {
                n += s.poll(&mut out[n..]).unwrap();
            }
            seen.push((n, s.outstanding()));
        });
        (format!("{r:?}"), seen)
    });
    assert_eq!(
        r.1,
        vec![(3, 2), (2, 0)],
        "other work counted as the scope's, or the scope's own not counted"
    );
    assert!(
        r.0.contains("Completion"),
        "the scope's error status: {}",
        r.0
    );
}

/// Hole 3: a drop that panics while earlier unsignalled requests are retired must not leave
/// the ring's tail behind, or the next completion frees a request posted later.
#[test]
#[cfg_attr(
    miri,
    ignore = "leaks by design: the Arc whose drop panics, and the handles after it"
)]
fn panicking_drop_in_the_sweep_does_not_release_a_later_request() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 4);
    let qpn = qp.qp_num();
    let (a, _) = device_region(&pd, 0x1000_0000, true);
    let mut b = pd.alloc_region(64).unwrap();
    let mut c = pd.alloc_region(64).unwrap();
    let mut e = pd.alloc_region(64).unwrap();
    // A (unsignalled, its handle is the last one of a region whose owner panics on drop),
    // B (unsignalled), C (signalled) in slots 0, 1, 2.
    qp.post_send(SendRequest::send(a.slice(..8).unwrap()).unsignaled())
        .unwrap();
    drop(a);
    qp.post_send(SendRequest::send(b.slice(..8).unwrap()).unsignaled())
        .unwrap();
    qp.send(c.slice(..8).unwrap(), 3).unwrap();
    assert_eq!(f.complete_sends(qpn, 3, 0), 1);
    let mut out = Completion::buffer(4);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cq.poll(&mut out)));
    assert!(r.is_err(), "the owner's drop panicked through poll");
    // D into slot 3, E into slot 0 (the ring wrapped): both on the device.
    qp.send(c.slice(8..16).unwrap(), 4).unwrap();
    qp.send(e.slice(..8).unwrap(), 5).unwrap();
    assert_eq!(f.complete_sends(qpn, 1, 0), 1);
    let n = cq.poll(&mut out).unwrap();
    let ids: Vec<u64> = out[..n].iter().map(Completion::wr_id).collect();
    assert_eq!(
        ids,
        vec![3, 4],
        "C's completion (filled before the panic) is not lost"
    );
    assert_eq!(f.sends_on_device(qpn), 1, "E is still on the device");
    assert_eq!(
        e.outstanding(),
        1,
        "E's buffer was released while E is still on the device"
    );
    // B completed before C; its drop came after the panicking one, so its handle was leaked
    // (its slot freed): never dropped twice, never left in flight.
    assert_eq!(b.outstanding(), 1);
    assert_eq!(qp.send_in_flight(), 1, "only E is in flight");
    drop(out);
    // E completes normally and comes back.
    f.complete_sends(qpn, 1, 0);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 5);
    drop(out);
    assert_eq!(e.outstanding(), 0);
    assert!(matches!(b.as_mut_slice(), Err(Error::RegionBusy(1))));
}

/// Hole 3, second half: a handle left in the output buffer whose drop panics when the next
/// poll overwrites it must neither wedge that slot nor lose the rest of the polled chunk.
#[test]
#[cfg_attr(
    miri,
    ignore = "leaks by design: the Arc whose drop panics, and the handles after it"
)]
fn panicking_drop_while_filling_loses_no_completion() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 4);
    let qpn = qp.qp_num();
    let (a, drops) = device_region(&pd, 0x1000_0000, true);
    let mut x = pd.alloc_region(64).unwrap();
    qp.send(a.slice(..8).unwrap(), 1).unwrap();
    drop(a);
    f.complete_sends(qpn, 1, 0);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    // out[0] still holds the last handle of the panicking region.
    qp.send(x.slice(..8).unwrap(), 2).unwrap();
    qp.send(x.slice(8..16).unwrap(), 3).unwrap();
    f.complete_sends(qpn, 2, 0);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cq.poll(&mut out)));
    assert!(r.is_err());
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let mut got = Vec::new();
    for _ in 0..4 {
        let n = cq.poll(&mut out).unwrap();
        got.extend(out[..n].iter().map(Completion::wr_id));
    }
    assert_eq!(got, vec![2, 3], "completions lost by the panic");
    assert_eq!(qp.send_in_flight(), 0, "a slot was left claimed (wedged)");
    drop(out);
    assert_eq!(x.outstanding(), 0);
    // The ring still takes a full round of work.
    for i in 0..4 {
        qp.send(x.slice(..8).unwrap(), 10 + i).unwrap();
    }
}

/// Hole 4: inline work requests make the provider copy from the buffer's address with the
/// CPU: never from device memory, and never for READ/atomics (whose buffers are targets).
#[test]
fn inline_is_refused_for_device_memory_and_read_and_atomics() {
    let f = Fake::new();
    let cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let (dm, _) = device_region(&pd, 0xdead_0000, false);
    let e = qp
        .post_send(SendRequest::send(dm.slice(..8).unwrap()).inline())
        .unwrap_err();
    assert!(matches!(e.error, Error::InvalidRequest(_)), "{e:?}");
    let mut host = pd.alloc_region(64).unwrap();
    let e = qp
        .post_send(SendRequest::read(host.slice(..8).unwrap(), remote()).inline())
        .unwrap_err();
    assert!(matches!(e.error, Error::InvalidRequest(_)), "{e:?}");
    let e = qp
        .post_send(SendRequest::fetch_add(host.slice(..8).unwrap(), remote(), 1).inline())
        .unwrap_err();
    assert!(matches!(e.error, Error::InvalidRequest(_)), "{e:?}");
    let mut batch = SendBatch::new();
    batch
        .push(SendRequest::send(dm.slice(..8).unwrap()).inline())
        .unwrap();
    assert!(qp.post_batch(&mut batch).is_err());
    assert!(
        f.with(|s| s.log.is_empty()),
        "the provider was handed an inline request"
    );
    // Host memory inline SEND is fine.
    qp.post_send(SendRequest::send(host.slice(..8).unwrap()).inline())
        .unwrap();
}

/// Hole 5: CQs, SRQs, address handles and memory of another device context (or PD) are
/// refused with a typed error before the provider sees them.
#[test]
fn objects_of_another_context_are_refused() {
    let f1 = Fake::new();
    let f2 = Fake::new();
    let pd1 = f1.ctx.alloc_pd().unwrap();
    let pd2 = f2.ctx.alloc_pd().unwrap();
    let cq1 = f1.ctx.create_cq(16).unwrap();
    let cq2 = f2.ctx.create_cq(16).unwrap();
    let e = pd1.queue_pair(&cq2, &cq1).build_rc().unwrap_err();
    assert!(matches!(e, Error::ForeignObject(_)), "{e:?}");
    let e = pd1.queue_pair(&cq1, &cq2).build_rc().unwrap_err();
    assert!(matches!(e, Error::ForeignObject(_)), "{e:?}");
    let srq2 = pd2.create_srq(8, 1).unwrap();
    let e = pd1
        .queue_pair(&cq1, &cq1)
        .srq(&srq2)
        .build_rc()
        .unwrap_err();
    assert!(matches!(e, Error::ForeignObject(_)), "{e:?}");
    // UD: an address handle of the other context.
    let ud = pd1.queue_pair(&cq1, &cq1).build_ud().unwrap();
    let mut ud = ud.activate().unwrap();
    let ah2 = pd2
        .create_ah(&AhAttr {
            dlid: 1,
            sl: 0,
            port: 1,
            grh: None,
        })
        .unwrap();
    let dest = UdDest {
        ah: ah2,
        qpn: 5,
        qkey: 0x1111_1111,
    };
    let mut buf = pd1.alloc_region(64).unwrap();
    let e = ud.send_to(buf.slice(..8).unwrap(), &dest, 1).unwrap_err();
    assert!(matches!(e.error, Error::ForeignObject(_)), "{e:?}");
    // Memory of another context's PD.
    let (_, mut rc) = rc_qp(&f1, &cq1, &cq1, 8);
    let mut other = pd2.alloc_region(64).unwrap();
    let e = rc.send(other.slice(..8).unwrap(), 1).unwrap_err();
    assert!(matches!(e.error, Error::ForeignObject(_)), "{e:?}");
    let e = rc.post_recv(other.slice(..8).unwrap(), 2).unwrap_err();
    assert!(matches!(e.error, Error::ForeignObject(_)), "{e:?}");
    let mut cq1 = cq1;
    let r = rc.scope(&mut cq1, Duration::from_secs(1), |s| s.send(&other, ..8, 3));
    assert!(matches!(r, Ok(Err(Error::ForeignObject(_)))), "{r:?}");
    let e = rc
        .scope(
            &mut f1.ctx.create_cq(1).unwrap(),
            Duration::from_secs(1),
            |_| (),
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(
        f1.with(|s| s.foreign.is_empty()),
        "{:?}",
        f1.with(|s| s.foreign.clone())
    );
    assert!(f1.with(|s| s.log.is_empty()));
    drop(buf.slice(..).unwrap());
}

/// Hole 6: a failed `ibv_dereg_mr` keeps the registration (and so the buffer): nothing is
/// handed back or lent while the old keys may still work.
#[test]
fn failed_deregistration_keeps_the_registration() {
    let f = Fake::new();
    let pd = f.ctx.alloc_pd().unwrap();
    let mr = pd.register(vec![7u8; 64]).unwrap();
    f.with(|s| s.fail_dereg = 1);
    let mr = match mr.into_inner() {
        Ok(_) => panic!("the buffer was handed back although ibv_dereg_mr failed"),
        Err((e, mr)) => {
            assert!(matches!(e, Error::DeregMr(_)), "{e:?}");
            mr
        }
    };
    assert_eq!(f.with(|s| s.mrs), 1, "still registered");
    assert_eq!(mr.into_inner().unwrap(), vec![7u8; 64]);
    assert_eq!(f.with(|s| s.mrs), 0);

    let remote = pd
        .register_remote(vec![0u8; 64], RemoteAccess::WRITE)
        .unwrap();
    let rkey = remote.rkey();
    f.with(|s| s.fail_dereg = 1);
    let remote = match remote.close_remote_access() {
        Ok(_) => panic!("lent as local although the remote registration may still be live"),
        Err((e, r)) => {
            assert!(matches!(e, Error::DeregMr(_)), "{e:?}");
            r
        }
    };
    assert_eq!(remote.rkey(), rkey, "still the remote registration");
    assert_eq!(
        f.with(|s| s.mrs),
        1,
        "the new local registration was undone"
    );
    let mut local = remote.close_remote_access().map_err(|(e, _)| e).unwrap();
    local.as_mut_slice().unwrap()[0] = 1;
}

/// Leak: slot tables of destroyed QPs stay attached to a long-lived CQ forever.
#[test]
fn destroyed_queue_pairs_are_detached_from_their_cq() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(64).unwrap();
    let pd = f.ctx.alloc_pd().unwrap();
    let mut mr = pd.alloc_region(64).unwrap();
    let mut out = Completion::buffer(4);
    for i in 0..20u64 {
        let qp = pd.queue_pair(&cq, &cq).build_rc().unwrap();
        let ep = qp.endpoint();
        let mut qp = qp.connect(&ep).unwrap();
        qp.send(mr.slice(..8).unwrap(), i).unwrap();
        // Dropping moves it to ERR: the fake queues a flushed completion, which is still in
        // the CQ when the QP is gone (a late completion naming a dead slot).
        drop(qp);
        assert_eq!(mr.outstanding(), 0, "released at destroy");
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!(
            out[0].wr_id(),
            0,
            "a late completion of a dead QP carries nothing"
        );
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
    }
    let attached = cq.inner.attached_len();
    assert!(attached <= 2, "{attached} slot tables still attached");
}

/// Leak: `poll_raw` taking the completion of a safe-layer SRQ receive loses the slot.
#[test]
fn poll_raw_releases_safe_layer_slots() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let pd = f.ctx.alloc_pd().unwrap();
    let mut srq = pd.create_srq(4, 1).unwrap();
    let qp = pd.queue_pair(&cq, &cq).srq(&srq).build_rc().unwrap();
    let mut mr = pd.alloc_region(64).unwrap();
    srq.post_recv(mr.slice(..).unwrap(), 1).unwrap();
    f.complete_recv(qp.qp_num(), 8, 0);
    let mut wc = [raw::ibv_wc::default(); 4];
    assert_eq!(cq.poll_raw(&mut wc).unwrap(), 1);
    assert_eq!(srq.in_flight(), 0, "the SRQ slot was lost");
    assert_eq!(mr.outstanding(), 0, "the buffer was lost");
}

/// Leak vs. free: a `bad_wr` that names no request of the batch says nothing about what was
/// posted; the safe default is to keep (leak) the buffers, never to free them.
#[test]
fn post_batch_with_a_bad_wr_naming_nothing_keeps_the_buffers() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let qpn = qp.qp_num();
    let mut mr = pd.alloc_region(64).unwrap();
    let mut batch = SendBatch::new();
    batch
        .push(SendRequest::send(mr.slice(..8).unwrap()).wr_id(1))
        .unwrap();
    batch
        .push(SendRequest::send(mr.slice(8..16).unwrap()).wr_id(2))
        .unwrap();
    f.with(|s| s.post_send_mode = Some(PostSendMode::FailForeign { rc: libc::EINVAL }));
    assert!(qp.post_batch(&mut batch).is_err());
    drop(batch);
    assert_eq!(f.sends_on_device(qpn), 2, "the provider did post both");
    assert_eq!(mr.outstanding(), 2, "buffers on the device were freed");
    f.with(|s| s.post_send_mode = None);
    // They come back with their completions.
    f.complete_sends(qpn, 2, 0);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 2);
    drop(out);
    assert_eq!(mr.outstanding(), 0);
    // A provider that names the failing request: those before it were posted, the rest
    // come back.
    let mut batch = SendBatch::new();
    batch
        .push(SendRequest::send(mr.slice(..8).unwrap()).wr_id(3))
        .unwrap();
    batch
        .push(SendRequest::send(mr.slice(8..16).unwrap()).wr_id(4))
        .unwrap();
    f.with(|s| {
        s.post_send_mode = Some(PostSendMode::FailAt {
            n: 1,
            rc: libc::ENOMEM,
        })
    });
    assert!(qp.post_batch(&mut batch).is_err());
    assert_eq!(batch.len(), 1);
    assert_eq!(f.sends_on_device(qpn), 1);
    let _ = WC_FLUSH;
}

/// A UD send's address handle: the slot holds one reference while the send is in flight
/// and gives it up at the completion; a send the provider refuses comes back with its
/// destination (and nothing leaks or is dropped twice either way).
#[test]
fn ud_send_holds_its_address_handle_until_the_completion() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let pd = f.ctx.alloc_pd().unwrap();
    let ud = pd.queue_pair(&cq, &cq).max_send_wr(4).build_ud().unwrap();
    let mut ud = ud.activate().unwrap();
    let qpn = ud.qp_num();
    let ah = pd
        .create_ah(&AhAttr {
            dlid: 1,
            sl: 0,
            port: 1,
            grh: None,
        })
        .unwrap();
    let refs = || Arc::strong_count(&ah.inner);
    let dest = UdDest {
        ah: ah.clone(),
        qpn: 5,
        qkey: 0x1111_1111,
    };
    let mut buf = pd.alloc_region(64).unwrap();
    let base = refs();
    ud.post_send(SendRequest::send_to(buf.slice(..8).unwrap(), dest.clone()).wr_id(1))
        .unwrap();
    assert_eq!(refs(), base + 1, "the slot holds the address handle");
    assert_eq!(f.complete_sends(qpn, 1, 0), 1);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 1);
    assert_eq!(refs(), base, "the completion released it");
    f.with(|s| {
        s.post_send_mode = Some(PostSendMode::FailAt {
            n: 0,
            rc: libc::ENOMEM,
        })
    });
    let e = ud
        .post_send(SendRequest::send_to(buf.slice(..8).unwrap(), dest).wr_id(2))
        .unwrap_err();
    assert_eq!(
        refs(),
        base,
        "the refused request holds the only extra reference"
    );
    assert_eq!(e.request.bufs().len(), 1, "its buffer came back");
    drop(e);
    assert_eq!(refs(), base - 1, "dropping it dropped its destination once");
    drop(out);
    assert_eq!(buf.outstanding(), 0);
}

/// A batch the provider refuses part-way hands the refused requests back whole (operation,
/// remote target, immediate data, flags, id and buffers), so they can be posted again as
/// they were; before, they came back as plain SENDs of their buffers.
#[test]
fn post_batch_refused_part_way_hands_the_requests_back_whole() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(16).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let qpn = qp.qp_num();
    let mut mr = pd.alloc_region(64).unwrap();
    let mut batch = SendBatch::new();
    batch
        .push(
            SendRequest::write(mr.slice(..8).unwrap(), remote())
                .unsignaled()
                .wr_id(1),
        )
        .unwrap();
    batch
        .push(SendRequest::read(mr.slice(8..16).unwrap(), remote()).wr_id(2))
        .unwrap();
    batch
        .push(
            SendRequest::write(mr.slice(16..24).unwrap(), remote())
                .imm(7)
                .unsignaled()
                .wr_id(3),
        )
        .unwrap();
    f.with(|s| {
        s.post_send_mode = Some(PostSendMode::FailAt {
            n: 1,
            rc: libc::ENOMEM,
        })
    });
    let e = qp.post_batch(&mut batch).unwrap_err();
    assert!(matches!(e, Error::PostSend { .. }), "{e:?}");
    assert_eq!(batch.len(), 2, "the two refused requests stay in the batch");
    assert_eq!(f.sends_on_device(qpn), 1);
    assert_eq!(qp.send_in_flight(), 1, "refused slots were taken back");
    assert_eq!(mr.outstanding(), 3, "no buffer was lost or freed");
    // Posted again as they came back: the device sees the original operations.
    f.with(|s| {
        s.post_send_mode = None;
        s.log.clear();
    });
    for r in batch.drain() {
        assert_eq!(r.bufs().len(), 1, "the request has its buffer back");
        qp.post_send(r).unwrap();
    }
    let seen: Vec<(u64, u32, bool)> = f.with(|s| {
        s.log
            .iter()
            .map(|w| (w.wr_id, w.opcode, w.flags & raw::IBV_SEND_SIGNALED != 0))
            .collect()
    });
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].1, raw::IBV_WR_RDMA_READ, "{seen:?}");
    assert!(seen[0].2, "the READ stays signalled");
    assert_eq!(seen[1].1, raw::IBV_WR_RDMA_WRITE_WITH_IMM, "{seen:?}");
    assert!(!seen[1].2, "the WRITE stays unsignalled");
    // Everything completes; the signalled READ's completion retires all three.
    f.complete_sends(qpn, 3, 0);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 2);
    drop(out);
    assert_eq!(
        qp.send_in_flight(),
        1,
        "the last (unsignalled) WRITE is in flight"
    );
    assert_eq!(mr.outstanding(), 1);
}

/// Selective signalling stays sound: the buffers of unsignalled work requests are held
/// until a later signalled completion of the same QP (or a flush, or the QP's destruction)
/// shows the device is done with them — never handed back or freed before, even when the
/// device has finished them.
#[test]
fn unsignalled_buffers_wait_for_a_later_signalled_completion() {
    let f = Fake::new();
    let mut cq = f.ctx.create_cq(32).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 8);
    let qpn = qp.qp_num();
    let mut mr = pd.alloc_region(64).unwrap();
    for i in 0..3u64 {
        let s = mr.slice(8 * i as usize..8 * (i as usize + 1)).unwrap();
        qp.post_send(SendRequest::write(s, remote()).unsignaled().wr_id(i))
            .unwrap();
    }
    // The device finished them (no completion: unsignalled); nothing comes back yet.
    assert_eq!(f.complete_sends(qpn, 3, 0), 0);
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 0);
    assert_eq!(
        mr.outstanding(),
        3,
        "unsignalled buffers released without a completion"
    );
    assert_eq!(qp.send_in_flight(), 3);
    assert!(
        matches!(mr.as_mut_slice(), Err(Error::RegionBusy(3))),
        "the CPU may not touch memory the device may still use"
    );
    // A batch: one more unsignalled, then a signalled one behind the same doorbell.
    let mut batch = SendBatch::new();
    batch
        .push(
            SendRequest::write(mr.slice(24..32).unwrap(), remote())
                .unsignaled()
                .wr_id(3),
        )
        .unwrap();
    batch
        .push(SendRequest::write(mr.slice(32..40).unwrap(), remote()).wr_id(4))
        .unwrap();
    assert_eq!(qp.post_batch(&mut batch).unwrap(), 2);
    assert_eq!(f.with(|s| s.log.len()), 5);
    assert_eq!(cq.poll(&mut out).unwrap(), 0, "nothing completed yet");
    assert_eq!(mr.outstanding(), 5);
    // Only the signalled completion retires the four before it, and hands back its own.
    assert_eq!(f.complete_sends(qpn, 2, 0), 1);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 4);
    assert_eq!(out[0].bufs().len(), 1, "its own buffer comes back");
    assert_eq!(qp.send_in_flight(), 0);
    assert_eq!(
        mr.outstanding(),
        1,
        "the retired unsignalled buffers were released"
    );
    drop(out);
    assert_eq!(mr.outstanding(), 0);
    // Unsignalled work flushed by an error hands its buffers back in its flush completion.
    qp.post_send(
        SendRequest::write(mr.slice(..8).unwrap(), remote())
            .unsignaled()
            .wr_id(9),
    )
    .unwrap();
    qp.set_error().unwrap();
    let mut out = Completion::buffer(4);
    assert_eq!(cq.poll(&mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id(), 9);
    assert_eq!(out[0].status(), WcStatus::WrFlush);
    assert_eq!(out[0].bufs().len(), 1);
    drop(out);
    assert_eq!(mr.outstanding(), 0);
}

/// A region whose first byte is 3 bytes past an 8-aligned address (so its first word
/// straddles its start).
struct Offset3(AlignedBuffer);
// SAFETY: a sub-range of an AlignedBuffer's stable, initialised heap storage.
unsafe impl RegionBuffer for Offset3 {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: the buffer is 64 bytes long.
        unsafe { self.0.as_mut_ptr().add(3) }
    }
    fn len(&self) -> usize {
        self.0.len() - 3
    }
}

/// Hole 7: every byte of a region is accessed by the CPU with one access width only, so
/// copies and word accesses through different handles never race as mixed-size atomics.
#[test]
fn every_byte_is_accessed_with_a_single_width() {
    let f = Fake::new();
    let pd = f.ctx.alloc_pd().unwrap();
    let aligned = pd
        .register_remote(AlignedBuffer::new(64).unwrap(), RemoteAccess::WRITE)
        .unwrap();
    let mut offset = pd
        .register_remote(
            Offset3(AlignedBuffer::new(64).unwrap()),
            RemoteAccess::WRITE,
        )
        .unwrap();
    let mut aligned = aligned;
    crate::mr::access_log::start();
    for r in [&mut aligned as &mut dyn Access, &mut offset] {
        r.run();
    }
    let log = crate::mr::access_log::take();
    let mut width = std::collections::HashMap::new();
    for (addr, w) in log {
        for b in addr..addr + w {
            let prev = *width.entry(b).or_insert(w);
            assert_eq!(
                prev, w,
                "byte {b:#x} accessed with {prev}- and {w}-byte atomics"
            );
        }
    }
    // The copies still copy.
    let mut back = [0u8; 8];
    aligned.read_into(5, &mut back).unwrap();
    assert_eq!(back, [9u8; 8]);
    offset.read_into(0, &mut back).unwrap();
    assert_eq!(&back[..5], &[9u8; 5]);
}

trait Access {
    fn run(&mut self);
}
impl<B: RegionBuffer> Access for MemoryRegion<B, Remote> {
    fn run(&mut self) {
        let base = self.addr() as usize;
        // Offsets of the first two whole 8-aligned words inside the region.
        let w0 = (8 - base % 8) % 8;
        self.write_u64(w0, 7).unwrap();
        let _ = self.read_u64(w0 + 8).unwrap();
        self.write_from(w0 + 5, &[9u8; 14]).unwrap();
        self.write_from(0, &[9u8; 5]).unwrap();
        let mut d = [0u8; 9];
        self.read_into(w0 + 1, &mut d).unwrap();
        let h = self.slice(..).unwrap();
        let _ = h.read_u64(w0 + 16).unwrap();
        h.write_from(w0 + 13, &[1u8; 6]).unwrap();
        let mut d = [0u8; 3];
        h.read_into(w0 + 22, &mut d).unwrap();
    }
}

/// Not a check: a fixed post+poll workload on the fake provider (32 owned WRITEs, one poll,
/// repeated) whose instructions per message `valgrind --tool=callgrind
/// --toggle-collect='*fake_owned_round*'` counts on the host, to compare builds of the safe
/// layer (the fake provider's own cost is the same in every build).
#[test]
#[ignore = "a callgrind workload, not a test"]
fn fake_post_poll_workload() {
    let f = Fake::new();
    f.with(|s| {
        s.auto_complete = true;
        s.no_log = true;
    });
    let mut cq = f.ctx.create_cq(64).unwrap();
    let (pd, mut qp) = rc_qp(&f, &cq, &cq, 64);
    let mut mr = pd.alloc_region(64).unwrap();
    let src = mr.slice(..8).unwrap();
    let mut out = Completion::buffer(32);
    let mut raw_wcs = [raw::ibv_wc::default(); 32];
    for _ in 0..100 {
        fake_owned_round(&mut qp, &mut cq, &src, &mut out);
        fake_scoped_round(&mut qp, &mut cq, &mr, &mut out);
        fake_raw_round(&mut qp, &mut cq, &src, &mut raw_wcs);
    }
}

#[inline(never)]
fn fake_owned_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    out: &mut [Completion],
) {
    for i in 0..32 {
        qp.post_send(SendRequest::write(src.clone(), remote()).wr_id(i))
            .unwrap();
    }
    assert_eq!(cq.poll(out).unwrap(), 32);
}

#[inline(never)]
fn fake_scoped_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    mr: &MemoryRegion,
    out: &mut [Completion],
) {
    qp.scope(cq, Duration::from_secs(5), |s| {
        for i in 0..32 {
            s.write(mr, ..8, remote(), i).unwrap();
        }
        assert_eq!(s.poll(out).unwrap(), 32);
    })
    .unwrap();
}

#[inline(never)]
fn fake_raw_round(
    qp: &mut QueuePair<Rc>,
    cq: &mut CompletionQueue,
    src: &MrSlice,
    wcs: &mut [raw::ibv_wc],
) {
    let mut sge = raw::ibv_sge {
        addr: src.addr(),
        length: src.len() as u32,
        lkey: src.lkey(),
    };
    for i in 0..32u64 {
        let mut wr = raw::send_wr();
        wr.wr_id = (i << 1) | 1;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = raw::IBV_WR_RDMA_WRITE;
        wr.send_flags = raw::IBV_SEND_SIGNALED;
        wr.wr.rdma = raw::ibv_send_wr_rdma {
            remote_addr: remote().addr,
            rkey: remote().rkey,
        };
        // SAFETY: one valid WR whose SGE lies in `src`'s live registration; the fake device
        // never touches memory.
        unsafe { qp.post_send_raw(&mut wr) }.unwrap();
    }
    assert_eq!(cq.poll_raw(wcs).unwrap(), 32);
}

/// Hole 7 under Miri: a word access and a partial copy racing on the same bytes from two
/// threads (Miri reports racing mixed-size atomics as undefined behaviour; on the host this
/// checks that neither update is torn inside the word's bytes it wrote).
#[test]
fn racing_word_and_byte_copies_are_not_mixed_size() {
    let f = Fake::new();
    let pd = f.ctx.alloc_pd().unwrap();
    let r = Arc::new(
        pd.register_remote(AlignedBuffer::new(64).unwrap(), RemoteAccess::WRITE)
            .unwrap(),
    );
    let r2 = r.clone();
    let t = std::thread::spawn(move || {
        for _ in 0..20 {
            r2.write_from(13, &[0xaa; 6]).unwrap();
        }
    });
    for _ in 0..20 {
        r.write_u64(8, u64::from_ne_bytes([0x55; 8])).unwrap();
        // Bytes 13..16 share the word at 8 (one load): all from one writer.
        let mut b = [0u8; 3];
        r.read_into(13, &mut b).unwrap();
        assert!(
            b.iter().all(|&x| x == 0x55) || b.iter().all(|&x| x == 0xaa),
            "{b:?}"
        );
    }
    t.join().unwrap();
}

/// Single posts (owned and scoped) fill one work request kept in the QP instead of a fresh
/// zeroed one: each must write every field its operation uses, so that nothing of an earlier
/// post (immediate data, SGE count, opcode, flags, remote address, a chained `next`) reaches
/// the provider.
#[test]
fn each_post_writes_every_field_its_operation_uses() {
    let f = Fake::new();
    f.with(|s| s.auto_complete = true);
    let mut cq = f.ctx.create_cq(64).unwrap();
    let pd = f.ctx.alloc_pd().unwrap();
    let qp = pd.queue_pair(&cq, &cq).max_sge(2, 1).build_rc().unwrap();
    let ep = qp.endpoint();
    let mut qp = qp.connect(&ep).unwrap();
    let mut mr = pd.alloc_region(64).unwrap();
    let r = remote();
    let r8 = r.slice(8, 8).unwrap();
    let bufs = [mr.slice(..8).unwrap(), mr.slice(8..16).unwrap()];
    qp.post_send(SendRequest::write(bufs, r).imm(0x1234))
        .unwrap();
    qp.post_send(SendRequest::fetch_add(mr.slice(16..24).unwrap(), r8, 5))
        .unwrap();
    qp.post_send(SendRequest::write(mr.slice(..4).unwrap(), r8).unsignaled())
        .unwrap();
    qp.post_send(SendRequest::send(mr.slice(..2).unwrap()))
        .unwrap();
    qp.scope(&mut cq, short(), |s| s.write(&mr, ..8, r, 5))
        .unwrap()
        .unwrap();
    qp.post_send(SendRequest::send(mr.slice(..3).unwrap()).imm(7))
        .unwrap();
    // opcode, flags, immediate, SGE count, last SGE's length, remote (address, rkey), compare
    type Seen = (u32, u32, u32, usize, u32, (u64, u32), u64);
    let seen: Vec<Seen> = f.with(|s| {
        s.log
            .iter()
            .map(|w| {
                let len = w.sges.last().map_or(0, |g| g.length);
                let (op, flags, imm) = (w.opcode, w.flags, w.imm_data);
                (op, flags, imm, w.sges.len(), len, w.rdma, w.compare_add)
            })
            .collect()
    });
    let sig = raw::IBV_SEND_SIGNALED;
    let (a, a8) = ((r.addr, r.rkey), (r8.addr, r.rkey));
    let imm = 0x1234u32.to_be();
    let want = vec![
        (raw::IBV_WR_RDMA_WRITE_WITH_IMM, sig, imm, 2, 8, a, 0),
        (raw::IBV_WR_ATOMIC_FETCH_AND_ADD, sig, 0, 1, 8, a8, 5),
        (raw::IBV_WR_RDMA_WRITE, 0, 0, 1, 4, a8, 0),
        (raw::IBV_WR_SEND, sig, 0, 1, 2, a8, 0),
        (raw::IBV_WR_RDMA_WRITE, sig, 0, 1, 8, a, 0),
        (raw::IBV_WR_SEND_WITH_IMM, sig, 7u32.to_be(), 1, 3, a, 0),
    ];
    // (A SEND's remote address is not read by any provider: it is whatever the previous
    // post left there, compared here only to pin the sequence.)
    assert_eq!(seen, want);
}
