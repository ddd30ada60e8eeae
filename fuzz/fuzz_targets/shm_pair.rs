//! Op-sequence fuzzing of the shm transport: two endpoints connected in one process (the
//! real memfd channel, rings, eventfds and fd passing), driven by any sequence of
//! registrations, posts, polls and finally the death of one side.
//!
//! Checked: every posted buffer comes back exactly once (in a completion or in the post's
//! error) with its own region/offset/length; `in_flight` matches; messages arrive in order
//! and untorn (when no one-sided op touched the regions involved), a receive shorter than
//! the message completes with `MessageTooLong`; one-sided ops with a forged key never
//! succeed; after a peer dies everything in flight completes with an error in bounded polls.
#![no_main]

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use arbitrary::Arbitrary;
use fabric_core::backend::{self, Options};
use fabric_core::{
    Access, AtomicOp, Buf, Completion, OpKind, Region, Status, Transport, TransportKind,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Op {
    Send {
        side: bool,
        region: u8,
        off: u16,
        len: u16,
    },
    Recv {
        side: bool,
        region: u8,
        off: u16,
        len: u16,
    },
    Write {
        side: bool,
        region: u8,
        off: u16,
        len: u16,
        remote: u8,
        roff: u16,
        forge: bool,
    },
    Read {
        side: bool,
        region: u8,
        off: u16,
        len: u16,
        remote: u8,
        roff: u16,
        forge: bool,
    },
    Atomic {
        side: bool,
        region: u8,
        off: u16,
        remote: u8,
        roff: u16,
        cas: bool,
        a: u64,
        b: u64,
    },
    Poll {
        side: bool,
        times: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    /// Regions registered up front: (side, len, access bits).
    regions: Vec<(bool, u16, u8)>,
    ops: Vec<Op>,
    kill: Option<bool>,
}

struct Posted {
    region: u32,
    off: usize,
    len: usize,
    kind: OpKind,
    forged: bool,
}

#[derive(Default)]
struct Side {
    regions: Vec<Region>,
    /// Regions a one-sided op may have touched: their bytes are not predictable.
    dirty: Vec<bool>,
    posted: HashMap<u64, Posted>,
    /// Receives in post order (the order messages fill them).
    recvs: VecDeque<u64>,
    /// Messages sent by this side not yet matched by a peer receive: (wr_id, len, bytes at
    /// post time when the region is never touched one-sidedly).
    sent: VecDeque<(u64, usize, Option<Vec<u8>>)>,
}

fn pair(opts: &Options) -> (Box<dyn Transport>, Box<dyn Transport>) {
    let mut l = backend::listen(TransportKind::Shm, opts).expect("listen");
    let mut c = backend::connect(l.address(), opts).expect("connect");
    let (mut a, mut b) = (None, None);
    for _ in 0..10_000 {
        if a.is_none() {
            a = l.accept().expect("accept");
        }
        if b.is_none() {
            b = c.poll_connect().expect("poll_connect");
        }
        if let (Some(_), Some(_)) = (&a, &b) {
            return (a.unwrap(), b.unwrap());
        }
        std::thread::yield_now();
    }
    panic!("shm handshake did not finish in one process");
}

fn buf_of(s: &Side, region: u8, off: u16, len: u16) -> Option<(u32, Buf)> {
    if s.regions.is_empty() {
        return None;
    }
    let r = &s.regions[region as usize % s.regions.len()];
    let off = off as usize % (r.len() + 1);
    let len = len as usize % (r.len() - off + 1);
    Some((
        r.id(),
        r.slice(off, len).expect("in bounds by construction"),
    ))
}

struct World {
    t: [Option<Box<dyn Transport>>; 2],
    s: [Side; 2],
    next_id: u64,
}

impl World {
    fn post(
        &mut self,
        side: usize,
        kind: OpKind,
        buf: Buf,
        forged: bool,
        post: impl FnOnce(&mut dyn Transport, Buf, u64) -> fabric_core::PostResult,
    ) {
        let id = self.next_id;
        self.next_id += 1;
        let region = buf.region().id();
        let (off, len) = (buf.offset(), buf.len());
        let clean = !self.s[side].dirty[region as usize];
        let bytes = (kind == OpKind::Send && clean).then(|| buf.to_vec());
        let t = self.t[side].as_deref_mut().expect("live side");
        match post(t, buf, id) {
            Ok(()) => {
                self.s[side].posted.insert(
                    id,
                    Posted {
                        region,
                        off,
                        len,
                        kind,
                        forged,
                    },
                );
                match kind {
                    OpKind::Recv => self.s[side].recvs.push_back(id),
                    OpKind::Send => self.s[side].sent.push_back((id, len, bytes)),
                    _ => {}
                }
            }
            Err(e) => {
                // Refused: nothing queued, the very same buffer comes back.
                assert_eq!(
                    (e.buf.region().id(), e.buf.offset(), e.buf.len()),
                    (region, off, len)
                );
            }
        }
        assert_eq!(self.t(side).in_flight(), self.s[side].posted.len());
    }

    fn t(&mut self, side: usize) -> &mut dyn Transport {
        self.t[side].as_deref_mut().expect("live side")
    }

    fn poll(&mut self, side: usize) {
        let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
        let n = self.t(side).poll(&mut out).expect("poll: local failure");
        for c in out.iter_mut().take(n) {
            let p = self.s[side]
                .posted
                .remove(&c.wr_id)
                .expect("completion for a wr_id not in flight (duplicate or invented)");
            let buf = c.buf.take().expect("completion without its buffer");
            assert_eq!(
                (buf.region().id(), buf.offset(), buf.len()),
                (p.region, p.off, p.len),
                "wrong buffer returned"
            );
            assert_eq!(c.op, p.kind);
            if p.forged {
                assert!(
                    !c.status.is_ok(),
                    "one-sided op with a forged key succeeded"
                );
            }
            if p.kind == OpKind::Recv {
                let other = 1 - side;
                let pos = self.s[side]
                    .recvs
                    .iter()
                    .position(|&w| w == c.wr_id)
                    .expect("recv queued");
                if c.status == Status::Success || c.status == Status::MessageTooLong {
                    assert_eq!(pos, 0, "receives must be filled in post order");
                    self.s[side].recvs.pop_front();
                    let (_sid, mlen, bytes) = self.s[other]
                        .sent
                        .pop_front()
                        .expect("a receive completed with no message sent");
                    assert_eq!(c.len, mlen, "received length differs from the sent length");
                    if c.status == Status::Success {
                        assert!(mlen <= p.len);
                        if let (Some(b), false) = (bytes, self.s[side].dirty[p.region as usize]) {
                            assert_eq!(buf.to_vec()[..mlen], b[..], "message torn or reordered");
                        }
                    } else {
                        assert!(mlen > p.len, "MessageTooLong for a message that fits");
                    }
                } else {
                    self.s[side].recvs.remove(pos);
                }
            }
            if p.kind == OpKind::Send && c.status == Status::Success {
                assert_eq!(c.len, p.len);
            }
        }
        assert_eq!(self.t(side).in_flight(), self.s[side].posted.len());
    }
}

fuzz_target!(|inp: Input| {
    let opts = Options {
        max_in_flight: 8,
        ring_bytes: 4096,
        chunk_bytes: 256,
        max_message: 16 << 10,
        handshake_timeout: Duration::from_secs(5),
        ..Options::default()
    };
    let (a, b) = pair(&opts);
    let mut w = World {
        t: [Some(a), Some(b)],
        s: [Side::default(), Side::default()],
        next_id: 1,
    };
    for &(side, len, access) in inp.regions.iter().take(8) {
        let side = side as usize;
        let access = Access::from_bits_truncate(access as u32);
        let r = w
            .t(side)
            .register(len as usize % 8192, access)
            .expect("register");
        assert!(r.access().contains(access));
        w.s[side].dirty.push(false);
        w.s[side].regions.push(r);
    }
    for op in inp.ops.iter().take(256) {
        match *op {
            Op::Send {
                side,
                region,
                off,
                len,
            } => {
                let side = side as usize;
                let Some((_, buf)) = buf_of(&w.s[side], region, off, len) else {
                    continue;
                };
                w.post(side, OpKind::Send, buf, false, |t, b, id| {
                    t.post_send(b, id)
                });
            }
            Op::Recv {
                side,
                region,
                off,
                len,
            } => {
                let side = side as usize;
                let Some((_, buf)) = buf_of(&w.s[side], region, off, len) else {
                    continue;
                };
                w.post(side, OpKind::Recv, buf, false, |t, b, id| {
                    t.post_recv(b, id)
                });
            }
            Op::Write {
                side,
                region,
                off,
                len,
                remote,
                roff,
                forge,
            }
            | Op::Read {
                side,
                region,
                off,
                len,
                remote,
                roff,
                forge,
            } => {
                let side = side as usize;
                let other = 1 - side;
                let write = matches!(op, Op::Write { .. });
                let Some((lid, buf)) = buf_of(&w.s[side], region, off, len) else {
                    continue;
                };
                if w.s[other].regions.is_empty() {
                    continue;
                }
                let ri = remote as usize % w.s[other].regions.len();
                let Some(mut key) = w.s[other].regions[ri].remote_key() else {
                    continue;
                };
                if forge {
                    key.key ^= 1;
                }
                if write {
                    w.s[other].dirty[ri] = true;
                } else {
                    w.s[side].dirty[lid as usize] = true;
                }
                let roff = roff as u64;
                if write {
                    w.post(side, OpKind::Write, buf, forge, |t, b, id| {
                        t.post_write(b, &key, roff, id)
                    });
                } else {
                    w.post(side, OpKind::Read, buf, forge, |t, b, id| {
                        t.post_read(b, &key, roff, id)
                    });
                }
            }
            Op::Atomic {
                side,
                region,
                off,
                remote,
                roff,
                cas,
                a,
                b,
            } => {
                let side = side as usize;
                let other = 1 - side;
                let Some((lid, buf)) = buf_of(&w.s[side], region, off, 8) else {
                    continue;
                };
                if w.s[other].regions.is_empty() {
                    continue;
                }
                let ri = remote as usize % w.s[other].regions.len();
                let Some(key) = w.s[other].regions[ri].remote_key() else {
                    continue;
                };
                w.s[other].dirty[ri] = true;
                w.s[side].dirty[lid as usize] = true;
                let aop = if cas {
                    AtomicOp::CompareSwap { expect: a, new: b }
                } else {
                    AtomicOp::FetchAdd { add: a }
                };
                let kind = aop.kind();
                let roff = (roff as u64) & !7;
                w.post(side, kind, buf, false, |t, bf, id| {
                    t.post_atomic(bf, &key, roff, aop, id)
                });
            }
            Op::Poll { side, times } => {
                for _ in 0..=times % 8 {
                    w.poll(side as usize);
                }
            }
        }
    }
    if let Some(k) = inp.kill {
        // One side dies: the survivor completes everything in flight, with errors (or
        // successes for what the dead side had already published), within a bounded number
        // of polls (the hang-up check runs every CHECK_EVERY idle polls).
        let (dead, alive) = (k as usize, 1 - k as usize);
        w.t[dead] = None;
        for _ in 0..(4 * fabric_core::backend::shm::CHECK_EVERY) {
            if w.s[alive].posted.is_empty() {
                break;
            }
            w.poll(alive);
        }
        assert!(
            w.s[alive].posted.is_empty(),
            "operations still in flight after the peer died"
        );
    }
});
