//! verbs' shared receive queue (`Options::verbs_srq_buffers`, eager mode): every queue pair
//! of a domain takes its receives from one SRQ of that many registered bounce buffers.
//! Runs for real where an RDMA device exists (the Soft-RoCE guest), else skipped by name;
//! the refusal without eager mode is checked everywhere.
//!
//! * eight endpoints on one worker receive tagged messages in order, payloads checked,
//!   with and without receives posted first (the SRQ's buffers recycled many times);
//! * one endpoint whose peer floods it with messages nobody receives does not stop the
//!   others: it fails alone once its share of the shared buffers is spent;
//! * resources: the domain's receive buffers stay the option's value however many
//!   endpoints connect (one registration per endpoint, its tag headers, against two
//!   without the SRQ);
//! * a peer that dies among SRQ endpoints fails only its endpoint, and the buffers its
//!   endpoint held come back to the SRQ;
//! * messages kept in shared buffers (the unexpected queue full) come out to their tags
//!   once receives are posted, and the buffers go back.
//!
//! Both ends live in this process (one thread drives two workers, one per domain).

// Endpoint k of both sides (`ea[k]`, `eb[k]`) and its message numbers go in step.
#![allow(clippy::needless_range_loop)]

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fabric_core::backend::{self, verbs, Options};
use fabric_core::{
    Access, Domain, EndpointId, Error, Event, OpKind, Region, Status, Transport, TransportKind,
    Worker,
};
use support::skip;

const DEADLINE: Duration = Duration::from_secs(120);
/// Bytes of each eager buffer: 1 KiB of payload and the 8-byte tag.
const EAGER: usize = 1024 + 8;
/// Buffers of the shared receive queue.
const SRQ: usize = 64;
const SLOT: usize = 1024;

fn opts(srq: usize) -> Options {
    Options {
        verbs_eager_bytes: EAGER,
        verbs_srq_buffers: srq,
        ..Options::default()
    }
}

fn open(o: &Options, test: &str) -> Option<Domain> {
    match Domain::open(TransportKind::Verbs, o) {
        Ok(d) => Some(d),
        Err(e @ Error::Unavailable { .. }) => {
            skip("rdma", format_args!("{test}: no RDMA device ({e})"));
            None
        }
        Err(e) => panic!("{test}: verbs domain: {e}"),
    }
}

/// Connects `n` pairs between `a` (accepting) and `b` (connecting) in this thread.
fn pairs(a: &Domain, b: &Domain, n: usize) -> Vec<(Box<dyn Transport>, Box<dyn Transport>)> {
    let mut l = a.listen().unwrap();
    (0..n)
        .map(|_| {
            let mut c = b.connect(l.address()).unwrap();
            backend::loopback(l.as_mut(), c.as_mut(), DEADLINE).expect("no connection")
        })
        .collect()
}

/// Two workers, `n` endpoints each, connected pairwise (`ea[i]` with `eb[i]`).
fn workers(a: &Domain, b: &Domain, n: usize) -> (Worker, Worker, Vec<EndpointId>, Vec<EndpointId>) {
    let (mut wa, mut wb) = (Worker::new(a).unwrap(), Worker::new(b).unwrap());
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    for (x, y) in pairs(a, b, n) {
        ea.push(wa.add(x).unwrap());
        eb.push(wb.add(y).unwrap());
    }
    (wa, wb, ea, eb)
}

/// Message `seq` of endpoint `k`: its endpoint and number, then a pattern; 8 to 1000 bytes.
fn message(k: usize, seq: usize) -> Vec<u8> {
    let len = 8 + (k * 131 + seq * 277) % 993;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(k as u32).to_le_bytes());
    m.extend_from_slice(&(seq as u32).to_le_bytes());
    m.extend((8..len).map(|i| (i as u8).wrapping_mul(13) ^ (k as u8) ^ (seq as u8)));
    m
}

fn tag(k: usize, seq: usize) -> u64 {
    ((k as u64) << 32) | seq as u64
}

fn events(n: usize) -> Vec<Event> {
    (0..n).map(|_| Event::default()).collect()
}

/// Polls both workers, handing every event to `on` (`true`: from `wa`), until `on` says
/// it is done.
fn drive(wa: &mut Worker, wb: &mut Worker, mut on: impl FnMut(bool, Event) -> bool) {
    let mut evs = events(32);
    let end = Instant::now() + DEADLINE;
    let mut done = false;
    while !done {
        let mut got = 0;
        for (first, w) in [(true, &mut *wa), (false, &mut *wb)] {
            let n = w.poll(&mut evs).expect("poll");
            got += n;
            for ev in &mut evs[..n] {
                done |= on(first, std::mem::take(ev));
            }
        }
        if got == 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
        assert!(Instant::now() < end, "no progress within {DEADLINE:?}");
    }
}

/// Posts on `ep` of `w` a receive for exactly tag (`k`, `seq`) into slot `slot` of `rx`.
fn recv_tagged(w: &mut Worker, ep: EndpointId, rx: &Region, slot: usize, k: usize, seq: usize) {
    let b = rx.slice(slot * SLOT, SLOT).unwrap();
    w.endpoint(ep)
        .unwrap()
        .post_recv_tagged(b, tag(k, seq), !0, tag(k, seq))
        .map_err(|e| e.error)
        .unwrap();
}

/// Posts on `ep` of `w` message (`k`, `seq`), tagged so, from slot `slot` of `tx`.
fn send_tagged(w: &mut Worker, ep: EndpointId, tx: &Region, slot: usize, k: usize, seq: usize) {
    let m = message(k, seq);
    let b = tx.slice(slot * SLOT, m.len()).unwrap();
    b.copy_from(&m).unwrap();
    w.endpoint(ep)
        .unwrap()
        .post_send_tagged(b, tag(k, seq), tag(k, seq))
        .map_err(|e| e.error)
        .unwrap();
}

/// Checks a receive completion of endpoint `k`: its tag says `seq`, which must be the
/// next one (`next[k]`), and the bytes are that message's.
fn check_recv(ev: &Event, k: usize, next: &mut [usize]) {
    let c = &ev.completion;
    assert_eq!((c.op, c.status), (OpKind::Recv, Status::Success), "{c:?}");
    let seq = (c.tag & 0xffff_ffff) as usize;
    assert_eq!(
        c.tag >> 32,
        k as u64,
        "endpoint {k} got a tag of another: {c:?}"
    );
    assert_eq!(seq, next[k], "endpoint {k}: messages out of order");
    next[k] += 1;
    let got = &c.buf.as_ref().unwrap().to_vec()[..c.len];
    assert_eq!(got, &message(k, seq)[..], "endpoint {k} message {seq}");
}

#[test]
fn verbs_srq_refused_without_eager_mode() {
    let o = Options {
        verbs_eager_bytes: 0,
        verbs_srq_buffers: SRQ,
        ..Options::default()
    };
    // Checked before any device is looked for: the same answer on every machine.
    let e = Domain::open(TransportKind::Verbs, &o).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("verbs_eager_bytes")),
        "{e}"
    );
    let e = Domain::open(
        TransportKind::Verbs,
        &Options {
            verbs_srq_buffers: 1 << 20,
            ..opts(0)
        },
    )
    .unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(_)), "{e}");
    println!("verbs: verbs_srq_buffers without eager mode or over 65,536 refused: {e}");
}

#[test]
fn verbs_srq_eight_endpoints_receive_tagged_messages_in_order() {
    const N: usize = 8;
    const M: usize = 48;
    let test = "verbs_srq_eight_endpoints_receive_tagged_messages_in_order";
    let Some(a) = open(&opts(SRQ), test) else {
        return;
    };
    let b = open(&opts(SRQ), test).unwrap();
    let (mut wa, mut wb, ea, eb) = workers(&a, &b, N);
    let tx = b.register(N * M * SLOT, Access::empty()).unwrap();
    let rx = a.register(N * M * SLOT, Access::empty()).unwrap();
    // Endpoints 0-3 post their receives first; 4-7 only after every message was sent (so
    // the messages wait in the unexpected queue, their shared buffers already reposted).
    for k in 0..N / 2 {
        for seq in 0..M {
            recv_tagged(&mut wa, ea[k], &rx, k * M + seq, k, seq);
        }
    }
    // Interleaved across endpoints: 384 messages through 64 shared buffers.
    for seq in 0..M {
        for k in 0..N {
            send_tagged(&mut wb, eb[k], &tx, k * M + seq, k, seq);
        }
    }
    let index: HashMap<EndpointId, usize> = ea.iter().enumerate().map(|(k, &e)| (e, k)).collect();
    let mut next = vec![0usize; N];
    let (mut sent, mut got) = (0, 0);
    drive(&mut wa, &mut wb, |from_a, ev| {
        if from_a {
            check_recv(&ev, index[&ev.endpoint], &mut next);
            got += 1;
        } else {
            assert_eq!(ev.completion.status, Status::Success, "{:?}", ev.completion);
            sent += 1;
        }
        sent == N * M && got == N / 2 * M
    });
    let s = verbs::srq_stats(&a).expect("the domain made its SRQ");
    println!("verbs srq: all sent; the late endpoints' messages wait unexpected: {s:?}");
    assert_eq!(
        s.held, 0,
        "nothing needs holding while the unexpected queue has room"
    );
    for k in N / 2..N {
        for seq in 0..M {
            recv_tagged(&mut wa, ea[k], &rx, k * M + seq, k, seq);
        }
    }
    drive(&mut wa, &mut wb, |from_a, ev| {
        assert!(from_a, "{:?}", ev.completion);
        check_recv(&ev, index[&ev.endpoint], &mut next);
        got += 1;
        got == N * M
    });
    assert_eq!(next, vec![M; N]);
    let s = verbs::srq_stats(&a).unwrap();
    assert_eq!(
        (s.buffers, s.buffer_bytes, s.posted, s.held, s.lost),
        (SRQ, EAGER, SRQ, 0, 0),
        "every shared buffer is posted again: {s:?}"
    );
    println!(
        "verbs srq: {N} endpoints x {M} tagged messages in order through {SRQ} shared buffers"
    );
}

#[test]
fn verbs_srq_one_flooded_endpoint_does_not_starve_the_others() {
    const N: usize = 6;
    const FLOOD: usize = 200;
    const M: usize = 40;
    const UNEXPECTED: usize = 16;
    let test = "verbs_srq_one_flooded_endpoint_does_not_starve_the_others";
    let oa = Options {
        unexpected_messages: UNEXPECTED,
        ..opts(SRQ)
    };
    let Some(a) = open(&oa, test) else {
        return;
    };
    let b = open(&opts(0), test).unwrap();
    let (mut wa, mut wb, ea, eb) = workers(&a, &b, N);
    let tx = b.register((FLOOD + N * M) * SLOT, Access::empty()).unwrap();
    let rx = a.register(N * M * SLOT, Access::empty()).unwrap();
    // Endpoint 0 gets a flood nobody receives, first; the others then M messages each,
    // with their receives posted.
    for seq in 0..FLOOD {
        send_tagged(&mut wb, eb[0], &tx, seq, 0, seq);
    }
    for k in 1..N {
        for seq in 0..M {
            recv_tagged(&mut wa, ea[k], &rx, k * M + seq, k, seq);
        }
    }
    for seq in 0..M {
        for k in 1..N {
            send_tagged(&mut wb, eb[k], &tx, FLOOD + k * M + seq, k, seq);
        }
    }
    let index: HashMap<EndpointId, usize> = ea.iter().enumerate().map(|(k, &e)| (e, k)).collect();
    let mut next = vec![0usize; N];
    let (mut got, mut flood_done) = (0, 0);
    let mut flood_status = HashMap::new();
    let mut evs = events(32);
    let t0 = Instant::now();
    let mut others_done = None;
    // The others' messages all arrive; the flooded endpoint fails at this side, which
    // hangs up, so the flood's sends end too (as PeerGone past the ones that landed).
    while got < (N - 1) * M || flood_done < FLOOD {
        let n = wa.poll(&mut evs).unwrap();
        for ev in &mut evs[..n] {
            // The flooded endpoint has nothing posted: nothing of it comes out here.
            check_recv(ev, index[&ev.endpoint], &mut next);
            got += 1;
        }
        let m = wb.poll(&mut evs).unwrap();
        for ev in &mut evs[..m] {
            let c = &ev.completion;
            if ev.endpoint == eb[0] {
                *flood_status.entry(format!("{:?}", c.status)).or_insert(0) += 1;
                flood_done += 1;
            } else {
                assert_eq!(c.status, Status::Success, "{c:?}");
            }
        }
        if got == (N - 1) * M && others_done.is_none() {
            others_done = Some(t0.elapsed());
        }
        if n + m == 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
        assert!(
            t0.elapsed() < DEADLINE,
            "stalled: {got} of {} messages to the others arrived (next {next:?}), {flood_done} \
             of the {FLOOD} flood sends ended ({flood_status:?}); {:?}",
            (N - 1) * M,
            verbs::srq_stats(&a)
        );
    }
    assert_eq!(&next[1..], &vec![M; N - 1][..]);
    // The flooded endpoint gave up, typed, and says why.
    let e = wa
        .post_recv(ea[0], rx.slice(0, SLOT).unwrap(), 0)
        .unwrap_err();
    assert!(
        matches!(&e.error, Error::Disconnected(m) if m.contains("verbs_srq_buffers")),
        "{e}"
    );
    // Its shared buffers came back (once the CQ's last completions were taken).
    let end = Instant::now() + DEADLINE;
    let s = loop {
        let s = verbs::srq_stats(&a).unwrap();
        if s.posted == SRQ || Instant::now() > end {
            break s;
        }
        assert_eq!(wa.poll(&mut evs).unwrap(), 0);
    };
    assert_eq!((s.posted, s.held, s.lost), (SRQ, 0, 0), "{s:?}");
    println!(
        "verbs srq: {got} messages reached the {} other endpoints (in {:?}) while one was \
         flooded with {FLOOD} (sender's outcomes {flood_status:?}); the flooded one failed: {}",
        N - 1,
        others_done.unwrap(),
        e.error
    );
}

/// Registrations per endpoint and receive bytes per endpoint, with or without the SRQ.
fn resources(srq: usize, n: usize, test: &str) -> Option<(usize, usize)> {
    let a = open(&opts(srq), test)?;
    let b = open(&opts(srq), test).unwrap();
    let before = a.live_regions();
    let (mut wa, mut wb, ea, eb) = workers(&a, &b, n);
    let regions = a.live_regions() - before;
    let stats = verbs::srq_stats(&a);
    // One message each way on every endpoint, so every one really works.
    let tx = b.register(n * SLOT, Access::empty()).unwrap();
    let rx = a.register(n * SLOT, Access::empty()).unwrap();
    for k in 0..n {
        recv_tagged(&mut wa, ea[k], &rx, k, k, 0);
        send_tagged(&mut wb, eb[k], &tx, k, k, 0);
    }
    let index: HashMap<EndpointId, usize> = ea.iter().enumerate().map(|(k, &e)| (e, k)).collect();
    let mut next = vec![0usize; n];
    let mut left = 2 * n;
    drive(&mut wa, &mut wb, |from_a, ev| {
        if from_a {
            check_recv(&ev, index[&ev.endpoint], &mut next);
        } else {
            assert_eq!(ev.completion.status, Status::Success);
        }
        left -= 1;
        left == 0
    });
    match stats {
        Some(s) => {
            assert_eq!(s.buffers, srq, "{s:?}");
            Some((regions, s.buffers * s.buffer_bytes))
        }
        None => {
            assert_eq!(srq, 0);
            Some((regions, 32 * EAGER * n))
        }
    }
}

#[test]
fn verbs_srq_receive_buffers_per_domain_stay_fixed() {
    let test = "verbs_srq_receive_buffers_per_domain_stay_fixed";
    let mut seen = Vec::new();
    for n in [1, 8, 32] {
        let Some((with, bytes_with)) = resources(SRQ, n, test) else {
            return;
        };
        let (without, bytes_without) = resources(0, n, test).unwrap();
        println!(
            "verbs, {n} endpoints: with the SRQ {with} registrations ({:.2} per endpoint), \
             {bytes_with} B of receive buffers in the domain ({:.0} B per endpoint); without \
             it {without} registrations, {bytes_without} B ({:.0} B per endpoint)",
            with as f64 / n as f64,
            bytes_with as f64 / n as f64,
            bytes_without as f64 / n as f64
        );
        // With the SRQ an endpoint registers its tag headers only; without, its 32 bounce
        // buffers too.
        assert_eq!(with, n, "registrations with the SRQ");
        assert_eq!(without, 2 * n, "registrations without the SRQ");
        seen.push(bytes_with);
    }
    assert!(seen.iter().all(|&b| b == SRQ * EAGER), "{seen:?}");
}

#[test]
fn verbs_srq_peer_death_fails_only_its_endpoint() {
    const N: usize = 4;
    const VICTIM: usize = 1;
    let test = "verbs_srq_peer_death_fails_only_its_endpoint";
    // A small unexpected queue, so the victim holds shared buffers when its peer dies.
    let oa = Options {
        unexpected_messages: 2,
        ..opts(SRQ)
    };
    let Some(a) = open(&oa, test) else {
        return;
    };
    let b = open(&opts(SRQ), test).unwrap();
    let (mut wa, mut wb, ea, eb) = workers(&a, &b, N);
    let tx = b.register(64 * SLOT, Access::empty()).unwrap();
    let rx = a.register(64 * SLOT, Access::empty()).unwrap();
    // Three messages to the victim, nobody receiving: two in its unexpected queue, one
    // kept in a shared buffer.
    for seq in 0..3 {
        send_tagged(&mut wb, eb[VICTIM], &tx, seq, VICTIM, seq);
    }
    let mut sent = 0;
    drive(&mut wa, &mut wb, |from_a, ev| {
        assert!(!from_a, "{:?}", ev.completion);
        assert_eq!(ev.completion.status, Status::Success);
        sent += 1;
        sent == 3
    });
    let end = Instant::now() + DEADLINE;
    let mut evs = events(4);
    while verbs::srq_stats(&a).unwrap().held != 1 {
        assert_eq!(wa.poll(&mut evs).unwrap(), 0);
        assert!(Instant::now() < end, "{:?}", verbs::srq_stats(&a));
    }
    // The victim's receive for a tag that never comes is in flight when its peer dies.
    let victim = ea[VICTIM];
    recv_tagged(&mut wa, victim, &rx, 63, VICTIM, 99);
    let peer = wb.remove(eb[VICTIM]).unwrap();
    drop(peer);
    let killed = Instant::now();
    // The others keep exchanging; the victim's receive fails meanwhile.
    let others: Vec<usize> = (0..N).filter(|&k| k != VICTIM).collect();
    let index: HashMap<EndpointId, usize> = ea.iter().enumerate().map(|(k, &e)| (e, k)).collect();
    let mut next = vec![0usize; N];
    let mut victim_failed = None;
    let mut round = 0;
    while victim_failed.is_none() || round < 5 {
        for &k in &others {
            recv_tagged(&mut wa, ea[k], &rx, k * 8 + round % 8, k, round);
            send_tagged(&mut wb, eb[k], &tx, 8 + k * 8 + round % 8, k, round);
        }
        let mut left = 2 * others.len();
        drive(&mut wa, &mut wb, |from_a, ev| {
            if from_a && ev.endpoint == victim {
                victim_failed = Some((ev.completion.op, ev.completion.status, killed.elapsed()));
                return left == 0;
            }
            if from_a {
                check_recv(&ev, index[&ev.endpoint], &mut next);
            } else {
                assert_eq!(ev.completion.status, Status::Success, "{:?}", ev.completion);
            }
            left -= 1;
            left == 0
        });
        round += 1;
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the dead peer's endpoint did not fail within 30 s"
        );
    }
    let (op, status, after) = victim_failed.unwrap();
    assert_eq!((op, status), (OpKind::Recv, Status::PeerGone));
    for &k in &others {
        assert_eq!(next[k], round, "endpoint {k}");
    }
    // The buffer the victim held is back in the SRQ.
    let s = verbs::srq_stats(&a).unwrap();
    assert_eq!((s.posted, s.held, s.lost), (SRQ, 0, 0), "{s:?}");
    println!(
        "verbs srq: the dead peer's endpoint failed after {after:?}; {round} rounds on the \
         {} others; its held buffer returned ({s:?})",
        others.len()
    );
}

#[test]
fn verbs_srq_held_messages_come_out_in_order_once_received() {
    const K: usize = 0;
    const SENT: usize = 6;
    let test = "verbs_srq_held_messages_come_out_in_order_once_received";
    // Two messages fit the unexpected queue; the next four keep their shared buffers.
    let oa = Options {
        unexpected_messages: 2,
        ..opts(SRQ)
    };
    let Some(a) = open(&oa, test) else {
        return;
    };
    let b = open(&opts(SRQ), test).unwrap();
    let (mut wa, mut wb, ea, eb) = workers(&a, &b, 2);
    let tx = b.register(SENT * SLOT, Access::empty()).unwrap();
    let rx = a.register(SENT * SLOT, Access::empty()).unwrap();
    for seq in 0..SENT {
        send_tagged(&mut wb, eb[K], &tx, seq, K, seq);
    }
    let mut sent = 0;
    drive(&mut wa, &mut wb, |from_a, ev| {
        assert!(!from_a, "{:?}", ev.completion);
        assert_eq!(ev.completion.status, Status::Success);
        sent += 1;
        sent == SENT
    });
    let end = Instant::now() + DEADLINE;
    let mut evs = events(4);
    while verbs::srq_stats(&a).unwrap().held != SENT - 2 {
        assert_eq!(wa.poll(&mut evs).unwrap(), 0);
        assert!(Instant::now() < end, "{:?}", verbs::srq_stats(&a));
    }
    let s = verbs::srq_stats(&a).unwrap();
    assert_eq!(s.posted, SRQ - (SENT - 2), "{s:?}");
    // Receives posted newest tag first: each takes its own message, whichever way it waited.
    for seq in (0..SENT).rev() {
        recv_tagged(&mut wa, ea[K], &rx, seq, K, seq);
    }
    let mut got = HashMap::new();
    drive(&mut wa, &mut wb, |from_a, ev| {
        assert!(from_a, "{:?}", ev.completion);
        let c = &ev.completion;
        assert_eq!(
            (ev.endpoint, c.op, c.status),
            (ea[K], OpKind::Recv, Status::Success)
        );
        let seq = (c.tag & 0xffff_ffff) as usize;
        assert_eq!(c.wr_id, c.tag, "tag {seq} went to another receive");
        assert_eq!(
            &c.buf.as_ref().unwrap().to_vec()[..c.len],
            &message(K, seq)[..]
        );
        got.insert(seq, ());
        got.len() == SENT
    });
    let s = verbs::srq_stats(&a).unwrap();
    assert_eq!((s.posted, s.held, s.lost), (SRQ, 0, 0), "{s:?}");
    // The connection goes on: one more message each way of the pair.
    recv_tagged(&mut wa, ea[K], &rx, 0, K, SENT);
    send_tagged(&mut wb, eb[K], &tx, 0, K, SENT);
    let mut left = 2;
    drive(&mut wa, &mut wb, |_, ev| {
        assert_eq!(ev.completion.status, Status::Success);
        left -= 1;
        left == 0
    });
    println!("verbs srq: 2 messages queued unexpected and 4 held in shared buffers, all delivered to their tags once received; buffers back ({s:?})");
}
