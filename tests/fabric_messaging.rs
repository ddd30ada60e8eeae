//! The messaging semantics a collective or RPC library needs, per backend (shm and tcp
//! here; verbs where an RDMA device exists, as in the Soft-RoCE guest): tagged sends and
//! receives matched with a mask and out of order, the bounded unexpected-message queue,
//! grouped receives, write with immediate data, flush of host memory, and what a too-long
//! message or a refused remote access does to the connection compared with what
//! [`Capabilities`] says. Both ends of each connection live in this process (one thread
//! drives both).

mod support;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fabric_core::backend::{self, tcp, Options};
use fabric_core::{
    Access, Completion, DecodeError, Error, OpKind, Region, Status, Transport, TransportKind,
};
use support::skip;

const DEADLINE: Duration = Duration::from_secs(20);

/// Counts the heap allocations of the current thread (other tests' threads do not
/// disturb a count).
struct Counting;

thread_local! {
    static ALLOCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; the counter is a const-initialised
// thread-local Cell, which does not allocate.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is passed on as is.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

type Pair = (Box<dyn Transport>, Box<dyn Transport>);

/// A connected pair (listener side, connector side), or `None` when the backend cannot
/// run here (verbs without a device: skipped with the reason).
fn pair(kind: TransportKind, opts: &Options) -> Option<Pair> {
    let mut l = match backend::listen(kind, opts) {
        Ok(l) => l,
        Err(e) => {
            assert_eq!(kind, TransportKind::Verbs, "{kind} listener: {e}");
            skip("rdma", format_args!("no RDMA device ({e})"));
            return None;
        }
    };
    let mut c = backend::connect(l.address(), opts).expect("connect");
    let pair = backend::loopback(l.as_mut(), c.as_mut(), DEADLINE);
    Some(pair.unwrap_or_else(|e| panic!("{kind}: no connection: {e}")))
}

/// Polls both ends until `rx` has a completion; `tx`'s completions are kept in `sent`.
fn next(rx: &mut dyn Transport, tx: &mut dyn Transport, sent: &mut Vec<Completion>) -> Completion {
    let mut out = [Completion::default()];
    let end = Instant::now() + DEADLINE;
    loop {
        if tx.poll(&mut out).expect("poll") == 1 {
            sent.push(std::mem::take(&mut out[0]));
        }
        if rx.poll(&mut out).expect("poll") == 1 {
            return std::mem::take(&mut out[0]);
        }
        assert!(Instant::now() < end, "no completion within {DEADLINE:?}");
    }
}

/// Polls both ends for `d`; returns what `rx` completed meanwhile (should be nothing).
fn idle(rx: &mut dyn Transport, tx: &mut dyn Transport, d: Duration) -> Vec<Completion> {
    let mut out = [Completion::default()];
    let mut got = Vec::new();
    let end = Instant::now() + d;
    while Instant::now() < end {
        let _ = tx.poll(&mut out).expect("poll");
        if rx.poll(&mut out).expect("poll") == 1 {
            got.push(std::mem::take(&mut out[0]));
        }
    }
    got
}

/// Waits for `n` sends of `tx` (polling `rx` too, which must not complete anything).
fn sends_done(
    tx: &mut dyn Transport,
    rx: &mut dyn Transport,
    sent: &mut Vec<Completion>,
    n: usize,
) {
    let mut out = [Completion::default()];
    let end = Instant::now() + DEADLINE;
    while sent.len() < n {
        if tx.poll(&mut out).expect("poll") == 1 {
            sent.push(std::mem::take(&mut out[0]));
        }
        let _ = rx.poll(&mut []).expect("poll");
        assert!(Instant::now() < end, "sends not done within {DEADLINE:?}");
    }
    for c in sent.iter() {
        assert!(c.status.is_ok(), "{c:?}");
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn send_tagged(t: &mut dyn Transport, r: &Region, off: usize, data: &[u8], tag: u64, id: u64) {
    let b = r.slice(off, data.len()).unwrap();
    b.copy_from(data).unwrap();
    t.post_send_tagged(b, tag, id).map_err(|e| e.error).unwrap();
}

fn kinds() -> [TransportKind; 2] {
    [TransportKind::Shm, TransportKind::Tcp]
}

/// The backends with tagged messages: shm, tcp, and verbs in its eager mode (where an RDMA
/// device exists; else skipped by `pair`).
fn tagged_kinds() -> [TransportKind; 3] {
    [TransportKind::Shm, TransportKind::Tcp, TransportKind::Verbs]
}

/// Eager receive buffers that hold the largest of [`SIZES`] (and its 8-byte tag).
const VERBS_EAGER: usize = 256 << 10;

/// `opts`, with verbs' eager mode on for verbs.
fn for_kind(kind: TransportKind, opts: &Options) -> Options {
    let mut o = opts.clone();
    if kind == TransportKind::Verbs {
        o.verbs_eager_bytes = VERBS_EAGER;
    }
    o
}

/// Sizes that take every path: several shm records (chunks of 64 KiB) or shm's
/// rendezvous (registered region >= 2 KiB), and one ring record / frame. The first is the
/// one a receiver waiting for another tag queues as unexpected.
const SIZES: [usize; 3] = [200_000, 3000, 24];

/// Default options, and (shm) eager copies only (no rendezvous), so that large messages
/// go through the ring in several records.
fn variants() -> [Options; 2] {
    [
        Options::default(),
        Options {
            rndv_bytes: 0,
            ..Options::default()
        },
    ]
}

#[test]
fn out_of_order_tags_are_never_confused() {
    for (kind, opts) in tagged_kinds()
        .into_iter()
        .flat_map(|k| variants().map(|o| (k, o)))
    {
        let Some((mut a, mut b)) = pair(kind, &for_kind(kind, &opts)) else {
            continue;
        };
        assert!(a.capabilities().tagged, "{kind}");
        let src = b.register(1 << 20, Access::empty()).unwrap();
        let dst = a.register(1 << 20, Access::LOCAL_WRITE).unwrap();
        // Sent 1, 2, 3 (each in a different size); received 3, 2, 1.
        for (i, &n) in SIZES.iter().enumerate() {
            send_tagged(
                b.as_mut(),
                &src,
                i * 300_000,
                &pattern(n, i as u8),
                1 + i as u64,
                i as u64,
            );
        }
        let mut sent = Vec::new();
        for i in (0..SIZES.len()).rev() {
            let buf = dst.slice(i * 300_000, 300_000).unwrap();
            a.post_recv_tagged(buf, 1 + i as u64, !0, 10 + i as u64)
                .map_err(|e| e.error)
                .unwrap();
            let c = next(a.as_mut(), b.as_mut(), &mut sent);
            assert_eq!(
                (c.op, c.status, c.wr_id, c.tag, c.len),
                (
                    OpKind::Recv,
                    Status::Success,
                    10 + i as u64,
                    1 + i as u64,
                    SIZES[i]
                ),
                "{kind}"
            );
            let got = c.buf.unwrap().to_vec();
            assert_eq!(
                got[..SIZES[i]],
                pattern(SIZES[i], i as u8)[..],
                "{kind} tag {}",
                i + 1
            );
        }
        sends_done(b.as_mut(), a.as_mut(), &mut sent, 3);
        assert!(sent.iter().all(|c| c.op == OpKind::Send));
        println!(
            "{kind} (rndv {}): tags 3, 2, 1 received in that order after being sent 1, 2, 3",
            opts.rndv_bytes
        );
    }
}

#[test]
fn masks_select_tags_and_plain_receives_take_any() {
    for kind in tagged_kinds() {
        let Some((mut a, mut b)) = pair(kind, &for_kind(kind, &Options::default())) else {
            continue;
        };
        let src = b.register(4096, Access::empty()).unwrap();
        let dst = a.register(4096, Access::LOCAL_WRITE).unwrap();
        // A receive for "collective 7, any step": high 32 bits = 7.
        a.post_recv_tagged(dst.slice(0, 64).unwrap(), 7 << 32, 0xffff_ffff << 32, 1)
            .map_err(|e| e.error)
            .unwrap();
        // An exact receive for tag 0x5_0000_0009.
        a.post_recv_tagged(dst.slice(64, 64).unwrap(), (5 << 32) | 9, !0, 2)
            .map_err(|e| e.error)
            .unwrap();
        // A plain receive (mask 0): any message.
        a.post_recv(dst.slice(128, 64).unwrap(), 3)
            .map_err(|e| e.error)
            .unwrap();
        send_tagged(b.as_mut(), &src, 0, b"first", (5 << 32) | 1, 0); // plain takes it
        send_tagged(b.as_mut(), &src, 64, b"second", (7 << 32) | 42, 0); // the masked one
        send_tagged(b.as_mut(), &src, 128, b"third", (5 << 32) | 9, 0); // the exact one
        let mut sent = Vec::new();
        let mut got: Vec<(u64, u64, Vec<u8>)> = (0..3)
            .map(|_| {
                let c = next(a.as_mut(), b.as_mut(), &mut sent);
                assert!(c.status.is_ok(), "{kind}: {c:?}");
                let mut v = c.buf.unwrap().to_vec();
                v.truncate(c.len);
                (c.wr_id, c.tag, v)
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                (1, (7 << 32) | 42, b"second".to_vec()),
                (2, (5 << 32) | 9, b"third".to_vec()),
                (3, (5 << 32) | 1, b"first".to_vec()),
            ],
            "{kind}"
        );
        // A plain send carries tag 0 and matches a receive for tag 0 only through the mask.
        a.post_recv_tagged(dst.slice(0, 64).unwrap(), 1, !0, 4)
            .map_err(|e| e.error)
            .unwrap();
        a.post_recv_tagged(dst.slice(64, 64).unwrap(), 0, !0, 5)
            .map_err(|e| e.error)
            .unwrap();
        let s = src.slice(0, 4).unwrap();
        s.copy_from(b"zero").unwrap();
        b.post_send(s, 9).map_err(|e| e.error).unwrap();
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!((c.wr_id, c.tag, c.len), (5, 0, 4), "{kind}");
    }
}

#[test]
fn the_unexpected_queue_is_bounded_and_recovers() {
    for kind in tagged_kinds() {
        let opts = Options {
            unexpected_messages: 1,
            unexpected_bytes: 1 << 20,
            ..Options::default()
        };
        let Some((mut a, mut b)) = pair(kind, &for_kind(kind, &opts)) else {
            continue;
        };
        let caps = a.capabilities();
        assert_eq!(
            (caps.unexpected_messages, caps.unexpected_bytes),
            (1, 1 << 20)
        );
        let src = b.register(1 << 16, Access::empty()).unwrap();
        let dst = a.register(1 << 16, Access::LOCAL_WRITE).unwrap();
        for tag in 1..=3u64 {
            send_tagged(
                b.as_mut(),
                &src,
                tag as usize * 100,
                &pattern(50, tag as u8),
                tag,
                tag,
            );
        }
        let mut sent = Vec::new();
        sends_done(b.as_mut(), a.as_mut(), &mut sent, 3);
        // Waiting for tag 3: tag 1 goes to the queue (1 message), tag 2 must wait on the
        // wire, so tag 3 cannot arrive yet: bounded, and nothing lost.
        a.post_recv_tagged(dst.slice(0, 100).unwrap(), 3, !0, 30)
            .map_err(|e| e.error)
            .unwrap();
        let early = idle(a.as_mut(), b.as_mut(), Duration::from_millis(200));
        assert!(early.is_empty(), "{kind}: queue bound not kept: {early:?}");
        // Taking tag 1 from the queue makes room: tag 2 is queued, tag 3 arrives.
        a.post_recv_tagged(dst.slice(100, 100).unwrap(), 1, !0, 10)
            .map_err(|e| e.error)
            .unwrap();
        let mut done = Vec::new();
        for _ in 0..2 {
            let c = next(a.as_mut(), b.as_mut(), &mut sent);
            assert!(c.status.is_ok(), "{kind}: {c:?}");
            let v = c.buf.unwrap().to_vec();
            assert_eq!(v[..50], pattern(50, c.tag as u8)[..], "{kind}");
            done.push((c.wr_id, c.tag));
        }
        done.sort();
        assert_eq!(done, [(10, 1), (30, 3)], "{kind}");
        a.post_recv_tagged(dst.slice(200, 100).unwrap(), 2, !0, 20)
            .map_err(|e| e.error)
            .unwrap();
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!((c.wr_id, c.tag, c.len), (20, 2, 50), "{kind}");
        println!(
            "{kind}: a 1-message unexpected queue held tag 1, kept tag 2 on the wire, recovered"
        );
    }
}

#[test]
fn grouped_receive_completes_once_with_part_lengths() {
    for (kind, opts) in tagged_kinds()
        .into_iter()
        .flat_map(|k| variants().map(|o| (k, o)))
    {
        let Some((mut a, mut b)) = pair(kind, &for_kind(kind, &opts)) else {
            continue;
        };
        assert!(a.capabilities().max_group >= 3, "{kind}");
        let src = b.register(1 << 20, Access::empty()).unwrap();
        let dst = a.register(1 << 20, Access::LOCAL_WRITE).unwrap();
        let parts = (0..3)
            .map(|i| (dst.slice(i * 300_000, 300_000).unwrap(), 100 + i as u64, !0))
            .collect();
        a.post_recv_group(parts, 55).map_err(|e| e.error).unwrap();
        // Parts filled out of order: 2, 0, 1.
        let mut sent = Vec::new();
        for i in [2usize, 0, 1] {
            send_tagged(
                b.as_mut(),
                &src,
                i * 300_000,
                &pattern(SIZES[i], i as u8),
                100 + i as u64,
                i as u64,
            );
            if i != 1 {
                let early = idle(a.as_mut(), b.as_mut(), Duration::from_millis(30));
                assert!(early.is_empty(), "{kind}: group completed early: {early:?}");
            }
        }
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!(
            (c.op, c.status, c.wr_id, c.len),
            (
                OpKind::RecvGroup,
                Status::Success,
                55,
                SIZES.iter().sum::<usize>()
            ),
            "{kind}"
        );
        assert!(c.buf.is_none());
        assert_eq!(c.parts.len(), 3);
        for (i, p) in c.parts.iter().enumerate() {
            assert_eq!(
                (p.tag, p.len, p.status),
                (100 + i as u64, SIZES[i], Status::Success)
            );
            assert_eq!(
                p.buf.to_vec()[..SIZES[i]],
                pattern(SIZES[i], i as u8)[..],
                "{kind} part {i}"
            );
        }
        // Too many parts: refused with every buffer back.
        let n = a.capabilities().max_group + 1;
        let parts = (0..n).map(|i| (dst.slice(i, 1).unwrap(), 0, 0)).collect();
        let e = a.post_recv_group(parts, 1).unwrap_err();
        assert!(matches!(e.error, Error::InvalidArgument(_)), "{}", e.error);
        assert_eq!(e.bufs.len(), n);
        assert_eq!(a.in_flight(), 0);
    }
}

#[test]
fn write_with_immediate_notifies_with_imm_and_length() {
    for kind in kinds() {
        let (mut a, mut b) = pair(kind, &Options::default()).unwrap();
        assert!(a.capabilities().write_imm, "{kind}");
        let target = a.register(1 << 16, Access::REMOTE_WRITE).unwrap();
        let key = target.remote_key().unwrap();
        let notes = a.register(4096, Access::LOCAL_WRITE).unwrap();
        let src = b.register(1 << 16, Access::empty()).unwrap();
        // A receive for another tag does not take the notification; one for tag 0 does.
        a.post_recv_tagged(notes.slice(0, 8).unwrap(), 5, !0, 1)
            .map_err(|e| e.error)
            .unwrap();
        a.post_recv_tagged(notes.slice(8, 8).unwrap(), 0, !0, 2)
            .map_err(|e| e.error)
            .unwrap();
        let data = pattern(40_000, 3);
        let w = src.slice(0, data.len()).unwrap();
        w.copy_from(&data).unwrap();
        b.post_write_imm(w, &key, 1000, 0xdead_beef, 7)
            .map_err(|e| e.error)
            .unwrap();
        let mut sent = Vec::new();
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!(
            (c.op, c.status, c.wr_id, c.len, c.imm, c.tag),
            (
                OpKind::Recv,
                Status::Success,
                2,
                data.len(),
                Some(0xdead_beef),
                0
            ),
            "{kind}"
        );
        // The receive's buffer is untouched; the bytes are in the target region.
        assert_eq!(c.buf.unwrap().to_vec(), [0u8; 8]);
        let mut got = vec![0u8; data.len()];
        target.read_at(1000, &mut got).unwrap();
        assert_eq!(
            got, data,
            "{kind}: bytes not there when the notification came"
        );
        sends_done(b.as_mut(), a.as_mut(), &mut sent, 1);
        assert_eq!(
            (sent[0].op, sent[0].wr_id, sent[0].len),
            (OpKind::WriteImm, 7, data.len())
        );
        // A notification with no receive posted for it waits; a later receive takes it.
        let w = src.slice(0, 16).unwrap();
        b.post_write_imm(w, &key, 0, 42, 8)
            .map_err(|e| e.error)
            .unwrap();
        sent.clear();
        sends_done(b.as_mut(), a.as_mut(), &mut sent, 1);
        a.post_recv(notes.slice(16, 8).unwrap(), 3)
            .map_err(|e| e.error)
            .unwrap();
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!((c.wr_id, c.len, c.imm), (3, 16, Some(42)), "{kind}");
        // The tag-5 receive is still waiting: it takes a tag-5 message, not a notification.
        assert_eq!(a.in_flight(), 1);
        // A write-imm with a bad key: the initiator's op fails, no notification.
        let mut bad = key;
        bad.key ^= 1;
        b.post_write_imm(src.slice(0, 8).unwrap(), &bad, 0, 1, 9)
            .map_err(|e| e.error)
            .unwrap();
        let c = next(b.as_mut(), a.as_mut(), &mut sent);
        assert_eq!(
            (c.op, c.status),
            (OpKind::WriteImm, Status::RemoteAccess),
            "{kind}"
        );
        assert!(idle(a.as_mut(), b.as_mut(), Duration::from_millis(50)).is_empty());
    }
}

#[test]
fn flush_of_host_memory_completes_at_once() {
    for kind in kinds() {
        let (mut a, _b) = pair(kind, &Options::default()).unwrap();
        let r = a.register(4096, Access::REMOTE_WRITE).unwrap();
        a.post_flush(r.slice(0, 4096).unwrap(), 4)
            .map_err(|e| e.error)
            .unwrap();
        let mut out = [Completion::default()];
        assert_eq!(
            a.poll(&mut out).unwrap(),
            1,
            "{kind}: flush did not complete at once"
        );
        assert_eq!(
            (out[0].op, out[0].status, out[0].wr_id, out[0].len),
            (OpKind::Flush, Status::Success, 4, 4096)
        );
        assert!(out[0].buf.is_some());
    }
}

#[test]
fn a_too_long_message_or_refused_access_does_what_capabilities_say() {
    for kind in kinds() {
        let (mut a, mut b) = pair(kind, &Options::default()).unwrap();
        let caps = a.capabilities();
        assert!(
            !caps.too_long_kills_connection && !caps.remote_error_kills_connection,
            "{kind}"
        );
        let src = b.register(1 << 16, Access::empty()).unwrap();
        let dst = a
            .register(1 << 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let mut sent = Vec::new();
        for n in [100usize, 30_000] {
            a.post_recv_tagged(dst.slice(0, 10).unwrap(), 4, !0, 1)
                .map_err(|e| e.error)
                .unwrap();
            send_tagged(b.as_mut(), &src, 0, &pattern(n, 1), 4, 2);
            let c = next(a.as_mut(), b.as_mut(), &mut sent);
            assert_eq!(
                (c.status, c.len, c.tag),
                (Status::MessageTooLong, n, 4),
                "{kind}"
            );
            // Only the receive failed: the connection goes on.
            a.post_recv_tagged(dst.slice(0, 64).unwrap(), 4, !0, 3)
                .map_err(|e| e.error)
                .unwrap();
            send_tagged(b.as_mut(), &src, 0, b"still here", 4, 4);
            let c = next(a.as_mut(), b.as_mut(), &mut sent);
            assert_eq!((c.status, c.len), (Status::Success, 10), "{kind}");
        }
        // A revoked key: only that write fails.
        let old = a.register(4096, Access::REMOTE_WRITE).unwrap();
        let stale = old.remote_key().unwrap();
        drop(old);
        // The revocation reaches the peer before anything the owner sends after the drop.
        let note = a.register(64, Access::empty()).unwrap();
        let inbox = b.register(64, Access::LOCAL_WRITE).unwrap();
        b.post_recv(inbox.slice(0, 8).unwrap(), 90)
            .map_err(|e| e.error)
            .unwrap();
        a.post_send(note.slice(0, 8).unwrap(), 91)
            .map_err(|e| e.error)
            .unwrap();
        let c = loop {
            // b's earlier sends may complete first.
            let c = next(b.as_mut(), a.as_mut(), &mut sent);
            if c.op != OpKind::Send {
                break c;
            }
        };
        assert_eq!((c.wr_id, c.status), (90, Status::Success), "{kind}");
        b.post_write(src.slice(0, 8).unwrap(), &stale, 0, 5)
            .map_err(|e| e.error)
            .unwrap();
        let c = loop {
            let c = next(b.as_mut(), a.as_mut(), &mut sent);
            if c.op != OpKind::Send {
                break c;
            }
        };
        assert_eq!(c.status, Status::RemoteAccess, "{kind}");
        let key = dst.remote_key().unwrap();
        b.post_write_imm(src.slice(0, 8).unwrap(), &key, 0, 6, 6)
            .map_err(|e| e.error)
            .unwrap();
        a.post_recv(dst.slice(100, 8).unwrap(), 7)
            .map_err(|e| e.error)
            .unwrap();
        let c = next(a.as_mut(), b.as_mut(), &mut sent);
        assert_eq!(
            (c.status, c.imm),
            (Status::Success, Some(6)),
            "{kind}: connection died"
        );
    }
}

/// The verbs backend, where an RDMA device exists: write with immediate consumes a
/// receive; tags and grouped receives are refused as its capabilities say; host flush
/// completes at once; a too-long message fails its receive and kills the connection, as
/// the flag says.
#[test]
fn verbs_messaging_matches_its_capabilities() {
    let Some((mut a, mut b)) = pair(TransportKind::Verbs, &Options::default()) else {
        return;
    };
    let caps = a.capabilities();
    assert!(caps.write_imm && !caps.tagged && caps.max_group == 0);
    assert!(caps.too_long_kills_connection && caps.remote_error_kills_connection);
    let target = a.register(1 << 16, Access::REMOTE_WRITE).unwrap();
    let key = target.remote_key().unwrap();
    let notes = a.register(4096, Access::LOCAL_WRITE).unwrap();
    let src = b.register(1 << 16, Access::empty()).unwrap();
    let e = b
        .post_send_tagged(src.slice(0, 8).unwrap(), 1, 1)
        .unwrap_err();
    assert!(matches!(e.error, Error::Unsupported { .. }), "{}", e.error);
    let e = a
        .post_recv_tagged(notes.slice(0, 8).unwrap(), 1, !0, 1)
        .unwrap_err();
    assert!(matches!(e.error, Error::Unsupported { .. }), "{}", e.error);
    let e = a
        .post_recv_group(vec![(notes.slice(0, 8).unwrap(), 0, 0)], 1)
        .unwrap_err();
    assert!(matches!(e.error, Error::Unsupported { .. }), "{}", e.error);
    a.post_flush(notes.slice(0, 8).unwrap(), 2)
        .map_err(|e| e.error)
        .unwrap();
    let mut sent = Vec::new();
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!((c.op, c.status), (OpKind::Flush, Status::Success));

    a.post_recv(notes.slice(0, 8).unwrap(), 3)
        .map_err(|e| e.error)
        .unwrap();
    let data = pattern(5000, 9);
    let w = src.slice(0, data.len()).unwrap();
    w.copy_from(&data).unwrap();
    b.post_write_imm(w, &key, 100, 0x1234_5678, 4)
        .map_err(|e| e.error)
        .unwrap();
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!(
        (c.op, c.status, c.wr_id, c.len, c.imm),
        (
            OpKind::Recv,
            Status::Success,
            3,
            data.len(),
            Some(0x1234_5678)
        )
    );
    let mut got = vec![0u8; data.len()];
    target.read_at(100, &mut got).unwrap();
    assert_eq!(got, data);
    sends_done(b.as_mut(), a.as_mut(), &mut sent, 1);
    assert_eq!(sent[0].op, OpKind::WriteImm);

    // Too long: the receive fails and (RC) so does the connection.
    a.post_recv(notes.slice(0, 8).unwrap(), 5)
        .map_err(|e| e.error)
        .unwrap();
    a.post_recv(notes.slice(8, 64).unwrap(), 6)
        .map_err(|e| e.error)
        .unwrap();
    b.post_send(src.slice(0, 100).unwrap(), 7)
        .map_err(|e| e.error)
        .unwrap();
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    // The provider names the error (rxe: a local QP operation error, hence ProtocolError;
    // other NICs: a local length error, MessageTooLong); either way the receive fails.
    println!("verbs too-long receive: {:?}", c.status);
    assert_eq!(c.wr_id, 5);
    assert!(!c.status.is_ok(), "a too-long message was received: {c:?}");
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!(c.wr_id, 6);
    assert!(
        !c.status.is_ok(),
        "the RC connection survived a too-long message: {c:?}"
    );
}

/// verbs in eager mode (where an RDMA device exists): tags and grouped receives are on, a
/// write-imm notification takes a receive for tag 0 (or waits for one), a too-long
/// message fails only its receive, and peers that disagree on the eager size are refused,
/// typed, at the handshake.
#[test]
fn verbs_eager_mode_matches_its_capabilities() {
    let opts = Options {
        verbs_eager_bytes: 4096,
        ..Options::default()
    };
    let Some((mut a, mut b)) = pair(TransportKind::Verbs, &opts) else {
        return;
    };
    let caps = a.capabilities();
    assert!(
        caps.tagged && caps.max_group > 0 && caps.write_imm,
        "{caps:?}"
    );
    assert!(!caps.too_long_kills_connection && caps.remote_error_kills_connection);
    // Only sends are bounded by the eager buffer (one-sided operations are not).
    assert!(caps.max_message > 4096, "{caps:?}");
    let target = a.register(1 << 16, Access::REMOTE_WRITE).unwrap();
    let key = target.remote_key().unwrap();
    let notes = a.register(1 << 16, Access::LOCAL_WRITE).unwrap();
    let src = b.register(1 << 16, Access::empty()).unwrap();
    let mut sent = Vec::new();
    // Larger than the eager buffer: refused at the sender, typed, buffer back.
    let e = b
        .post_send_tagged(src.slice(0, 4096).unwrap(), 1, 1)
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::MessageTooLarge {
                len: 4096,
                max: 4088
            }
        ),
        "{}",
        e.error
    );
    assert_eq!(e.buf.len(), 4096);
    let e = b.post_send(src.slice(0, 4089).unwrap(), 1).unwrap_err();
    assert!(
        matches!(e.error, Error::MessageTooLarge { .. }),
        "{}",
        e.error
    );
    assert_eq!(b.in_flight(), 0);
    // A write-imm notification: the tag-5 receive does not take it, the tag-0 one does.
    a.post_recv_tagged(notes.slice(0, 8).unwrap(), 5, !0, 1)
        .map_err(|e| e.error)
        .unwrap();
    a.post_recv_tagged(notes.slice(8, 8).unwrap(), 0, !0, 2)
        .map_err(|e| e.error)
        .unwrap();
    let data = pattern(40_000, 3);
    let w = src.slice(0, data.len()).unwrap();
    w.copy_from(&data).unwrap();
    b.post_write_imm(w, &key, 1000, 0xdead_beef, 7)
        .map_err(|e| e.error)
        .unwrap();
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!(
        (c.op, c.status, c.wr_id, c.len, c.imm, c.tag),
        (
            OpKind::Recv,
            Status::Success,
            2,
            data.len(),
            Some(0xdead_beef),
            0
        )
    );
    let mut got = vec![0u8; data.len()];
    target.read_at(1000, &mut got).unwrap();
    assert_eq!(got, data);
    sends_done(b.as_mut(), a.as_mut(), &mut sent, 1);
    sent.clear();
    // A notification with no receive for it waits; a later receive takes it.
    b.post_write_imm(src.slice(0, 16).unwrap(), &key, 0, 42, 8)
        .map_err(|e| e.error)
        .unwrap();
    sends_done(b.as_mut(), a.as_mut(), &mut sent, 1);
    a.post_recv(notes.slice(16, 8).unwrap(), 3)
        .map_err(|e| e.error)
        .unwrap();
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!((c.wr_id, c.len, c.imm), (3, 16, Some(42)));
    // Too long for the receive: only the receive fails; the tag-5 receive is still there.
    a.post_recv_tagged(notes.slice(100, 10).unwrap(), 4, !0, 10)
        .map_err(|e| e.error)
        .unwrap();
    send_tagged(b.as_mut(), &src, 0, &pattern(3000, 1), 4, 11);
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!(
        (c.wr_id, c.status, c.len, c.tag),
        (10, Status::MessageTooLong, 3000, 4)
    );
    send_tagged(b.as_mut(), &src, 0, b"tag five", 5, 12);
    let c = next(a.as_mut(), b.as_mut(), &mut sent);
    assert_eq!(
        (c.wr_id, c.status, c.len, c.tag),
        (1, Status::Success, 8, 5)
    );
    assert_eq!(c.buf.unwrap().to_vec(), b"tag five");
    println!("verbs eager: tags, write-imm notifications and a too-long receive as on tcp");

    // Peers that disagree on the eager size: the connector gets a typed error.
    let mut l = backend::listen(TransportKind::Verbs, &opts).unwrap();
    let mut c = backend::connect(l.address(), &Options::default()).unwrap();
    let end = Instant::now() + DEADLINE;
    let err = loop {
        assert!(
            l.accept().unwrap().is_none(),
            "a mismatched peer was accepted"
        );
        match c.poll_connect() {
            Ok(None) => {}
            Ok(Some(_)) => panic!("connected with mismatched eager sizes"),
            Err(e) => break e,
        }
        assert!(Instant::now() < end, "no handshake verdict");
    };
    assert!(
        matches!(&err, Error::Protocol(m) if m.contains("verbs_eager_bytes")),
        "{err}"
    );
}

/// A tcp peer of wire version 1 (no tags) is refused with a typed version error, not
/// misread.
#[test]
fn tcp_old_peer_gets_a_typed_version_error() {
    let raw = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp:{}", raw.local_addr().unwrap());
    let mut c = backend::connect(&addr, &Options::default()).unwrap();
    let (mut s, _) = raw.accept().unwrap();
    let mut hello = [0u8; tcp::HELLO_LEN];
    hello[..8].copy_from_slice(&tcp::HELLO_MAGIC_V1.to_le_bytes());
    s.write_all(&hello).unwrap();
    let end = Instant::now() + DEADLINE;
    let e = loop {
        match c.poll_connect() {
            Ok(None) => assert!(Instant::now() < end, "no verdict on an old peer"),
            Ok(Some(_)) => panic!("a version 1 peer was accepted"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            e,
            Error::Decode(DecodeError::Version {
                found: 1,
                expected: 2,
                ..
            })
        ),
        "{e}"
    );
    assert!(matches!(
        tcp::decode_hello(&hello),
        Err(DecodeError::Version { found: 1, .. })
    ));
}

/// A hostile tcp peer sends malformed tagged / write-imm frames: typed errors, the
/// pending receive completes with an error, nothing panics or hangs.
#[test]
fn tcp_malformed_tag_frames_fail_the_connection_cleanly() {
    for bad in ["imm over 32 bits", "aux1 set"] {
        let mut l = backend::listen(TransportKind::Tcp, &Options::default()).unwrap();
        let addr = l.address().strip_prefix("tcp:").unwrap().to_string();
        let mut raw = TcpStream::connect(&addr).unwrap();
        let mut hello = [0u8; tcp::HELLO_LEN];
        hello[..8].copy_from_slice(&tcp::HELLO_MAGIC.to_le_bytes());
        raw.write_all(&hello).unwrap();
        let end = Instant::now() + DEADLINE;
        let mut t = loop {
            if let Some(t) = l.accept().unwrap() {
                break t;
            }
            assert!(Instant::now() < end, "raw peer not accepted");
        };
        let r = t
            .register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let key = r.remote_key().unwrap();
        t.post_recv(r.slice(0, 64).unwrap(), 1)
            .map_err(|e| e.error)
            .unwrap();
        let mut h = [0u8; tcp::FRAME_HEADER];
        h[0] = 8; // WriteImm
        h[4..8].copy_from_slice(&8u32.to_le_bytes());
        h[16..24].copy_from_slice(&key.key.to_le_bytes());
        h[32..36].copy_from_slice(&key.region.to_le_bytes());
        h[36..40].copy_from_slice(&key.gen.to_le_bytes());
        match bad {
            "imm over 32 bits" => h[40..48].copy_from_slice(&(1u64 << 40).to_le_bytes()),
            _ => h[48] = 1,
        }
        assert!(
            tcp::decode_header(&h).is_err(),
            "{bad}: decoder accepted it"
        );
        raw.write_all(&h).unwrap();
        raw.write_all(&[0xAB; 8]).unwrap();
        let mut out = [Completion::default()];
        let end = Instant::now() + DEADLINE;
        while t.poll(&mut out).unwrap() == 0 {
            assert!(Instant::now() < end, "{bad}: no completion");
        }
        assert_eq!(out[0].wr_id, 1);
        assert_eq!(out[0].status, Status::ProtocolError, "{bad}");
        let mut v = [0u8; 8];
        r.read_at(0, &mut v).unwrap();
        assert_eq!(v, [0u8; 8], "{bad}: bytes of a malformed frame landed");
        let e = t.post_recv(r.slice(0, 8).unwrap(), 2).unwrap_err();
        assert!(
            matches!(e.error, Error::Disconnected(_)),
            "{bad}: {}",
            e.error
        );
    }
}

/// The matching costs nothing on the hot path: plain messages, and tagged ones whose
/// receive is posted first, allocate nothing per message (shm: eager and rendezvous).
#[test]
fn in_order_traffic_allocates_nothing_per_message() {
    let before = allocs();
    let probe = std::hint::black_box(vec![1u8; 10]);
    assert!(allocs() > before, "the counting allocator counts nothing");
    drop(probe);
    for kind in kinds() {
        let (mut a, mut b) = pair(kind, &Options::default()).unwrap();
        let src = b.register(1 << 16, Access::empty()).unwrap();
        let dst = a.register(1 << 16, Access::LOCAL_WRITE).unwrap();
        let mut out = [Completion::default(), Completion::default()];
        let mut round = |a: &mut dyn Transport, b: &mut dyn Transport, n: usize, tagged: bool| {
            let (rb, sb) = (dst.slice(0, n).unwrap(), src.slice(0, n).unwrap());
            if tagged {
                a.post_recv_tagged(rb, 5, !0, 1)
                    .map_err(|e| e.error)
                    .unwrap();
                b.post_send_tagged(sb, 5, 2).map_err(|e| e.error).unwrap();
            } else {
                a.post_recv(rb, 1).map_err(|e| e.error).unwrap();
                b.post_send(sb, 2).map_err(|e| e.error).unwrap();
            }
            let (mut got_a, mut got_b) = (false, false);
            let end = Instant::now() + DEADLINE;
            while !(got_a && got_b) {
                assert!(Instant::now() < end, "round stuck");
                if a.poll(&mut out[..1]).unwrap() == 1 {
                    assert!(out[0].status.is_ok());
                    out[0].buf = None;
                    got_a = true;
                }
                if b.poll(&mut out[1..]).unwrap() == 1 {
                    assert!(out[1].status.is_ok());
                    out[1].buf = None;
                    got_b = true;
                }
            }
        };
        for (n, tagged) in [(64, false), (64, true), (8192, false), (8192, true)] {
            for _ in 0..50 {
                round(a.as_mut(), b.as_mut(), n, tagged); // warm-up
            }
            let before = allocs();
            for _ in 0..500 {
                round(a.as_mut(), b.as_mut(), n, tagged);
            }
            let per = (allocs() - before) as f64 / 500.0;
            println!("{kind}: {n} B, tagged {tagged}: {per} allocations per message");
            assert_eq!(
                per, 0.0,
                "{kind}: {n} B tagged={tagged} allocates per message"
            );
        }
    }
}
