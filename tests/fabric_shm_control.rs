//! shm region announcements have their own path: registering a remote-accessible region
//! while the peer has not received the messages queued to it (ring partly or entirely
//! full) returns promptly, and the peer's one-sided write with the new key succeeds at
//! once; the queued messages are then received intact and in order.

use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{Access, Completion, OpKind, Status, Transport, TransportKind};

/// One ring record of exactly 16 KiB (16-byte record header + payload): four fill the
/// 64 KiB ring to the last byte.
const MSG: usize = (16 << 10) - 16;

fn pair(opts: &Options) -> (Box<dyn Transport>, Box<dyn Transport>) {
    let mut l = backend::listen(TransportKind::Shm, opts).unwrap();
    let mut c = backend::connect(l.address(), opts).unwrap();
    backend::loopback(l.as_mut(), c.as_mut(), Duration::from_secs(20))
        .expect("shm pair not connected")
}

fn next(t: &mut dyn Transport, within: Duration) -> Completion {
    let mut out = [Completion::default()];
    let end = Instant::now() + within;
    loop {
        if t.poll(&mut out).unwrap() == 1 {
            return std::mem::take(&mut out[0]);
        }
        assert!(Instant::now() < end, "no completion within {within:?}");
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn announcement_behind_unreceived_messages(messages: usize) {
    let opts = Options {
        ring_bytes: 64 << 10,
        chunk_bytes: 16 << 10,
        rndv_bytes: 0,
        ..Options::default()
    };
    let (mut a, mut b) = pair(&opts);
    // a queues messages b does not receive yet.
    let src = a.register(messages * MSG, Access::empty()).unwrap();
    for i in 0..messages {
        let s = src.slice(i * MSG, MSG).unwrap();
        s.copy_from(&vec![i as u8 + 1; MSG]).unwrap();
        a.post_send(s, i as u64).map_err(|e| e.error).unwrap();
    }
    let mut out: Vec<Completion> = (0..messages).map(|_| Completion::default()).collect();
    let mut sent = a.poll(&mut out).unwrap();
    // Now a registers a region b may write.
    let start = Instant::now();
    let target = a
        .register(4096, Access::REMOTE_WRITE)
        .expect("register must not depend on the peer receiving");
    let took = start.elapsed();
    let key = target.remote_key().unwrap();
    // b writes into it with the new key, without receiving anything first.
    let local = b.register(64, Access::empty()).unwrap();
    local.write_at(0, b"announced on its own path").unwrap();
    let start = Instant::now();
    b.post_write(local.slice(0, 25).unwrap(), &key, 100, 77)
        .map_err(|e| e.error)
        .unwrap();
    let c = next(b.as_mut(), Duration::from_secs(5));
    let write_took = start.elapsed();
    println!(
        "{messages} unreceived messages: register took {took:?}, write completed {:?} in {write_took:?}",
        c.status
    );
    assert_eq!(
        (c.wr_id, c.op, c.status),
        (77, OpKind::Write, Status::Success)
    );
    assert!(took < Duration::from_secs(1), "register blocked {took:?}");
    assert!(
        write_took < Duration::from_secs(1),
        "write waited {write_took:?}"
    );
    let mut got = [0u8; 25];
    target.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"announced on its own path");
    // The queued messages still arrive, intact and in order.
    let dst = b.register(messages * MSG, Access::empty()).unwrap();
    for i in 0..messages {
        b.post_recv(dst.slice(i * MSG, MSG).unwrap(), 1000 + i as u64)
            .map_err(|e| e.error)
            .unwrap();
    }
    let mut received = 0;
    let end = Instant::now() + Duration::from_secs(20);
    while received < messages || sent < messages {
        assert!(
            Instant::now() < end,
            "messages lost: {received} received, {sent} sent"
        );
        sent += a.poll(&mut out).unwrap();
        let n = b.poll(&mut out).unwrap();
        for c in &out[..n] {
            assert_eq!(c.wr_id, 1000 + received as u64, "out of order");
            assert_eq!((c.status, c.len), (Status::Success, MSG));
            received += 1;
        }
    }
    for i in 0..messages {
        let mut m = vec![0u8; MSG];
        dst.read_at(i * MSG, &mut m).unwrap();
        assert!(m.iter().all(|&x| x == i as u8 + 1), "message {i} corrupted");
    }
}

#[test]
fn shm_announcement_overtakes_unreceived_messages() {
    announcement_behind_unreceived_messages(2);
}

#[test]
fn shm_register_with_a_full_ring() {
    // 4 records fill the 64 KiB ring to the last byte; 4 more sends stay queued.
    announcement_behind_unreceived_messages(8);
}
