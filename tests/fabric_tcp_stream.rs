//! tcp's framing under a stream of mixed sizes: many frames in flight back to back, from one
//! byte to more than a socket buffer, with receives posted ahead, one at a time, or long
//! after the bytes arrived, and with too-long messages whose payload the receiver must drop
//! without losing its place in the stream. Every byte of every message is checked, so a
//! frame header read from the middle of a payload (or a payload cut short) fails here.
//! Both ends live in this process; one thread drives both.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{Access, Completion, OpKind, PostError, Status, Transport, TransportKind};

const DEADLINE: Duration = Duration::from_secs(60);

/// Sizes that straddle the cases a framing reader has: tiny frames several to a read,
/// a frame ending exactly on a page, payloads larger than the socket buffers (the reader
/// sees them in pieces), and odd lengths that leave the next header unaligned.
const SIZES: [usize; 10] = [1, 8, 63, 4096, 4097, 65_536, 131_073, 1, 1_048_579, 24];

/// The largest of [`SIZES`], rounded up: the stride of the slices in flight at once.
const STRIDE: usize = 1_048_579 + 5;

fn pair(opts: &Options) -> (Box<dyn Transport>, Box<dyn Transport>) {
    let mut l = backend::listen(TransportKind::Tcp, opts).expect("tcp listener");
    let mut c = backend::connect(l.address(), opts).expect("connect");
    backend::loopback(l.as_mut(), c.as_mut(), DEADLINE).expect("tcp connection")
}

/// The bytes of message `i` (different for every message and every offset in it).
fn pattern(i: usize, len: usize) -> Vec<u8> {
    let seed = (i as u32).wrapping_mul(2_654_435_761);
    (0..len)
        .map(|k| (seed.wrapping_add((k as u32).wrapping_mul(40_503)) >> 11) as u8)
        .collect()
}

fn size_of(i: usize) -> usize {
    SIZES[i % SIZES.len()]
}

/// Posts operation `*posted`, `*posted + 1`, ... (up to `count`) into free slots with
/// `post(slot, operation)`; stops when no slot is free or the transport pushes back (the
/// slot goes back to `free`). Any other refusal fails the test.
fn fill(
    free: &mut Vec<usize>,
    posted: &mut usize,
    count: usize,
    mut post: impl FnMut(usize, usize) -> Result<(), PostError>,
) {
    while *posted < count {
        let Some(s) = free.pop() else { break };
        match post(s, *posted) {
            Ok(()) => *posted += 1,
            Err(e) if e.is_would_block() => {
                free.push(s);
                break;
            }
            Err(e) => panic!("operation {}: {}", *posted, e.error),
        }
    }
}

/// Drives a sender (`tx`) and a receiver (`rx`) through `count` messages, with at most
/// `send_window` sends and `recv_window` receives in flight. With `recv_after`, the
/// receiver posts nothing until every send was posted and the sender polled for a while
/// (the bytes wait in the socket and the receiver's queue). Checks every message's
/// length, order and bytes.
fn stream(
    tx: &mut dyn Transport,
    rx: &mut dyn Transport,
    count: usize,
    send_window: usize,
    recv_window: usize,
    recv_after: bool,
) {
    let src = tx.register(send_window * STRIDE, Access::empty()).unwrap();
    let dst = rx
        .register(recv_window * STRIDE, Access::LOCAL_WRITE)
        .unwrap();
    let mut free_tx: Vec<usize> = (0..send_window).rev().collect();
    let mut free_rx: Vec<usize> = (0..recv_window).rev().collect();
    // Receive slots in post order: receives complete in the order of the messages.
    let mut rx_order: VecDeque<usize> = VecDeque::new();
    let (mut sent, mut sends_done, mut posted_rx, mut received) = (0, 0, 0, 0);
    let mut out = [Completion::default(), Completion::default()];
    let end = Instant::now() + DEADLINE;
    let mut idle_until = None;
    while received < count {
        assert!(
            Instant::now() < end,
            "stalled: {sent} sent, {sends_done} send completions, {received} received of {count}"
        );
        fill(&mut free_tx, &mut sent, count, |s, i| {
            let n = size_of(i);
            let b = src.slice(s * STRIDE, n).unwrap();
            b.copy_from(&pattern(i, n)).unwrap();
            tx.post_send(b, s as u64).map(|_| ())
        });
        let k = tx.poll(&mut out).expect("sender poll");
        for c in out.iter_mut().take(k) {
            assert_eq!((c.op, c.status), (OpKind::Send, Status::Success), "{c:?}");
            free_tx.push(c.wr_id as usize);
            sends_done += 1;
        }
        if recv_after && sent < count {
            continue;
        }
        if recv_after && idle_until.is_none() {
            // Everything is posted; let the bytes pile up before the first receive.
            idle_until = Some(Instant::now() + Duration::from_millis(200));
        }
        if let Some(t) = idle_until {
            if Instant::now() < t {
                let _ = rx.poll(&mut []).expect("receiver poll");
                continue;
            }
        }
        fill(&mut free_rx, &mut posted_rx, count, |s, _| {
            let b = dst.slice(s * STRIDE, STRIDE).unwrap();
            rx.post_recv(b, s as u64).map(|_| rx_order.push_back(s))
        });
        let k = rx.poll(&mut out).expect("receiver poll");
        for c in out.iter_mut().take(k) {
            let want = size_of(received);
            assert_eq!(
                (c.op, c.status, c.len),
                (OpKind::Recv, Status::Success, want),
                "message {received}"
            );
            let s = c.wr_id as usize;
            assert_eq!(
                rx_order.pop_front(),
                Some(s),
                "message {received} out of order"
            );
            let buf = c.buf.take().expect("the receive's buffer");
            let mut got = vec![0u8; want];
            buf.copy_to(&mut got).unwrap();
            if got != pattern(received, want) {
                let at = got
                    .iter()
                    .zip(pattern(received, want))
                    .position(|(a, b)| *a != b)
                    .unwrap();
                panic!("message {received} ({want} bytes) differs from byte {at}");
            }
            free_rx.push(s);
            received += 1;
        }
    }
    // The last sends complete too.
    while sends_done < count {
        assert!(
            Instant::now() < end,
            "{sends_done} of {count} sends completed"
        );
        let k = tx.poll(&mut out).expect("sender poll");
        for c in out.iter().take(k) {
            assert_eq!(c.status, Status::Success, "{c:?}");
        }
        sends_done += k;
        let _ = rx.poll(&mut []).expect("receiver poll");
    }
}

#[test]
fn mixed_size_frames_stream_intact_with_a_deep_window() {
    let (mut a, mut b) = pair(&Options::default());
    stream(b.as_mut(), a.as_mut(), 120, 32, 32, false);
    // And the other direction on the same connection.
    stream(a.as_mut(), b.as_mut(), 60, 32, 32, false);
}

#[test]
fn mixed_size_frames_stream_intact_with_one_receive_at_a_time() {
    let (mut a, mut b) = pair(&Options::default());
    stream(b.as_mut(), a.as_mut(), 60, 32, 1, false);
    // One send at a time, a deep receive window.
    stream(b.as_mut(), a.as_mut(), 30, 1, 32, false);
}

#[test]
fn mixed_size_frames_stream_intact_when_receives_come_late() {
    // Unexpected messages wait in the receiver's bounded queue or in the socket; raise the
    // queue's bounds so that a window of messages may wait there.
    let opts = Options {
        unexpected_messages: 64,
        unexpected_bytes: 8 << 20,
        ..Options::default()
    };
    let (mut a, mut b) = pair(&opts);
    stream(b.as_mut(), a.as_mut(), 40, 16, 16, true);
}

#[test]
fn too_long_payloads_are_dropped_and_the_stream_goes_on() {
    let (mut a, mut b) = pair(&Options::default());
    let caps = a.capabilities();
    assert!(
        !caps.too_long_kills_connection,
        "tcp's capabilities changed"
    );
    let n = 12;
    // Every third message is larger than its receive (by a little, or by much more than a
    // socket buffer); the others fit exactly.
    let len = |i: usize| [3000usize, 777, 2_000_003][i % 3];
    let recv_len = |i: usize| if i % 3 == 1 { 777 } else { 1000 };
    let src = b.register(n * 2_000_008, Access::empty()).unwrap();
    let dst = a.register(n * 1000, Access::LOCAL_WRITE).unwrap();
    for i in 0..n {
        a.post_recv(dst.slice(i * 1000, recv_len(i)).unwrap(), i as u64)
            .map_err(|e| e.error)
            .unwrap();
    }
    for i in 0..n {
        let s = src.slice(i * 2_000_008, len(i)).unwrap();
        s.copy_from(&pattern(i, len(i))).unwrap();
        b.post_send(s, i as u64).map_err(|e| e.error).unwrap();
    }
    let mut out = [Completion::default()];
    let (mut got, mut sends) = (0, 0);
    let end = Instant::now() + DEADLINE;
    while got < n || sends < n {
        assert!(
            Instant::now() < end,
            "{got} receives and {sends} sends of {n}"
        );
        if b.poll(&mut out).unwrap() == 1 {
            assert_eq!(out[0].status, Status::Success, "{:?}", out[0]);
            sends += 1;
        }
        if a.poll(&mut out).unwrap() == 1 {
            let c = &mut out[0];
            assert_eq!(c.wr_id, got as u64, "receives complete in order");
            let (l, r) = (len(got), recv_len(got));
            if l > r {
                assert_eq!(
                    (c.status, c.len),
                    (Status::MessageTooLong, l),
                    "message {got}"
                );
            } else {
                assert_eq!((c.status, c.len), (Status::Success, l), "message {got}");
                let mut bytes = vec![0u8; l];
                c.buf.take().unwrap().copy_to(&mut bytes).unwrap();
                assert!(bytes == pattern(got, l), "message {got}'s bytes");
            }
            got += 1;
        }
    }
}
