//! Op-sequence fuzzing of the in-flight tracker that every backend shares (the
//! deterministic core: validation, slots with generation-checked tokens, submission /
//! receive / ready queues, failure of everything in flight), against a model:
//!
//! * a refused post hands back the very buffer; an accepted one is returned by `take`
//!   exactly once, with its own buffer, kind and status;
//! * `complete` accepts exactly the live, unfinished tokens — stale, finished or forged
//!   ones are refused (a peer's response matching nothing is a protocol error);
//! * `in_flight` / `ready_len` match the model; completions come out in completion order;
//! * after `fail_all` every unfinished operation completes with its status and later posts
//!   fail with `Disconnected`;
//! * validation: the model computes the verdict of every post — accepted, or refused for
//!   the buffer's owner (another domain), one-sided support, the key's transport, access,
//!   range, size (message size, atomic word) or a full table — and the tracker must agree,
//!   error kind included;
//! * the domain registry (ids with generations): reserve / publish / release / check
//!   against a model — a released id's keys are refused forever, even after the id is
//!   reused with a new generation; a double or stale release changes nothing; the table
//!   never holds more slots than the most ids live at once.
#![no_main]

use std::collections::{HashMap, VecDeque};

use arbitrary::Arbitrary;
use fabric_core::registry::{Entry, Registry};
use fabric_core::tracker::{OpDesc, Token, Tracker};
use fabric_core::transport::{Capabilities, MemoryKinds, MessageOrdering};
use fabric_core::{Access, AtomicOp, Completion, Error, OpKind, Region, Status, TransportKind};
use libfuzzer_sys::fuzz_target;

const CONN: u64 = 7;

#[derive(Debug, Arbitrary)]
enum Op {
    AddRegion {
        len: u16,
        access: u8,
        foreign: bool,
    },
    Post {
        what: u8,
        region: u8,
        off: u16,
        len: u16,
        target: u8,
        roff: u16,
        forge: u8,
        wr_id: u8,
    },
    SubmitPop,
    RecvPop,
    Complete {
        pick: u8,
        raw: Option<u64>,
        status: u8,
        len: u16,
    },
    Take {
        n: u8,
    },
    FailAll {
        status: u8,
    },
    /// Registry: a new registration.
    Register {
        key: u8,
        access: u8,
        len: u16,
    },
    /// Registry: release a live, stale or forged `(id, gen)`.
    Release {
        pick: u8,
        forge: Option<(u8, u8)>,
    },
    /// Registry: a peer's access with a live, stale or forged key.
    Check {
        pick: u8,
        forge: u8,
        off: u16,
        len: u16,
        need: u8,
    },
}

/// What the tracker must answer to a post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Accept,
    Disconnected,
    Owner,
    OneSided,
    Transport,
    Access,
    Range,
    Size,
    Full,
}

fn verdict_of(e: &Error) -> Verdict {
    match e {
        Error::Disconnected(_) => Verdict::Disconnected,
        Error::Foreign(w) if w.contains("domain") => Verdict::Owner,
        Error::Foreign(w) if w.contains("transport") => Verdict::Transport,
        Error::Unsupported { .. } => Verdict::OneSided,
        Error::AccessDenied(_) => Verdict::Access,
        Error::OutOfBounds { .. } => Verdict::Range,
        Error::MessageTooLarge { .. } | Error::Unaligned => Verdict::Size,
        Error::WouldBlock(_) => Verdict::Full,
        other => panic!("unexpected validation error {other}"),
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    max_in_flight: u8,
    max_message: u16,
    one_sided: bool,
    atomics: bool,
    ops: Vec<Op>,
}

#[derive(Debug)]
struct Live {
    token: Token,
    wr_id: u64,
    kind: OpKind,
    region: u32,
    off: usize,
    len: usize,
    done: Option<Status>,
}

const STATUSES: [Status; 6] = [
    Status::Success,
    Status::MessageTooLong,
    Status::RemoteAccess,
    Status::PeerGone,
    Status::ProtocolError,
    Status::Canceled,
];

fuzz_target!(|inp: Input| {
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: inp.one_sided,
        atomics: inp.atomics,
        max_message: inp.max_message as usize,
        max_in_flight: 1 + inp.max_in_flight as usize % 8,
        inline_size: 0,
        memory_kinds: MemoryKinds::HOST,
    };
    let mut t = Tracker::new(CONN, TransportKind::Tcp, caps);
    let mut regions: Vec<Region> = Vec::new();
    let mut owners: HashMap<u32, u64> = HashMap::new();
    let mut live: HashMap<u64, Live> = HashMap::new(); // by internal sequence number
    let mut seq = 0u64;
    let mut ready: VecDeque<u64> = VecDeque::new(); // completion order (seq numbers)
    let mut submit: VecDeque<u64> = VecDeque::new();
    let mut recv: VecDeque<u64> = VecDeque::new();
    let mut taken_tokens: Vec<Token> = Vec::new(); // finished and taken: stale from now on
    let mut failed = false;
    let mut next_region = 0u32;
    // Registry model: live (id, gen) -> entry; released pairs; the most live at once.
    let mut reg: Registry<u8> = Registry::new();
    let mut reg_live: Vec<(u32, u32, u64, Access, u64)> = Vec::new();
    let mut reg_dead: Vec<(u32, u32, u64)> = Vec::new();
    let mut reg_peak = 0usize;

    for op in inp.ops.iter().take(400) {
        match *op {
            Op::AddRegion {
                len,
                access,
                foreign,
            } => {
                if regions.len() >= 6 {
                    continue;
                }
                let owner = if foreign { CONN + 1 } else { CONN };
                owners.insert(next_region, owner);
                let access = Access::from_bits_truncate(access as u32) | Access::LOCAL_WRITE;
                let r = Region::anonymous(
                    next_region,
                    owner,
                    TransportKind::Tcp,
                    access,
                    len as usize % 4096,
                )
                .expect("mmap");
                next_region += 1;
                regions.push(r);
            }
            Op::Post {
                what,
                region,
                off,
                len,
                target,
                roff,
                forge,
                wr_id,
            } => {
                if regions.is_empty() {
                    continue;
                }
                let r = &regions[region as usize % regions.len()];
                let off = off as usize % (r.len() + 1);
                let len = len as usize % (r.len() - off + 1);
                let buf = r.slice(off, len).expect("in bounds");
                let tr = &regions[target as usize % regions.len()];
                let key = tr.remote_key().map(|mut k| {
                    match forge % 5 {
                        1 => k.len += 64,
                        2 => k.access |= Access::REMOTE_ATOMIC.bits(),
                        3 => k.transport = TransportKind::Shm,
                        _ => {}
                    }
                    k
                });
                let desc = match (what % 5, key) {
                    (0, _) => OpDesc::Send,
                    (1, _) => OpDesc::Recv,
                    (2, Some(key)) => OpDesc::Write {
                        key,
                        off: roff as u64,
                    },
                    (3, Some(key)) => OpDesc::Read {
                        key,
                        off: roff as u64,
                    },
                    (4, Some(key)) => OpDesc::Atomic {
                        key,
                        off: roff as u64,
                        op: AtomicOp::FetchAdd { add: 1 },
                    },
                    _ => continue,
                };
                let region_id = r.id();
                let full = live.len() >= caps.max_in_flight;
                // The verdict, computed from the model in the tracker's documented order.
                // Regions were made with CONN or CONN + 1 as owner (remembered at creation).
                let foreign = owners.get(&region_id).copied() != Some(CONN);
                let remote = |key: &fabric_core::RemoteKey, off: u64, n: u64, need: Access| {
                    if !caps.one_sided {
                        Verdict::OneSided
                    } else if key.transport != TransportKind::Tcp {
                        Verdict::Transport
                    } else if !key.access().contains(need) {
                        Verdict::Access
                    } else if !matches!(off.checked_add(n), Some(e) if e <= key.len) {
                        Verdict::Range
                    } else {
                        Verdict::Accept
                    }
                };
                let expect = if failed {
                    Verdict::Disconnected
                } else if foreign {
                    Verdict::Owner
                } else {
                    let v = match &desc {
                        OpDesc::Send | OpDesc::Recv if len > caps.max_message => Verdict::Size,
                        OpDesc::Send | OpDesc::Recv => Verdict::Accept,
                        OpDesc::Write { .. } | OpDesc::Read { .. } if len > caps.max_message => {
                            Verdict::Size
                        }
                        OpDesc::Write { key, off } => {
                            remote(key, *off, len as u64, Access::REMOTE_WRITE)
                        }
                        OpDesc::Read { key, off } => {
                            remote(key, *off, len as u64, Access::REMOTE_READ)
                        }
                        OpDesc::Atomic { .. } if !caps.atomics => Verdict::OneSided,
                        OpDesc::Atomic { off, .. } if len != 8 || off % 8 != 0 => Verdict::Size,
                        OpDesc::Atomic { key, off, .. } => {
                            remote(key, *off, 8, Access::REMOTE_ATOMIC)
                        }
                    };
                    if v == Verdict::Accept && full {
                        Verdict::Full
                    } else {
                        v
                    }
                };
                match t.post(desc, buf, wr_id as u64) {
                    Ok(token) => {
                        assert_eq!(expect, Verdict::Accept, "tracker accepted {desc:?}");
                        assert!(!failed, "post accepted after fail_all");
                        assert!(!full, "post accepted with every slot in use");
                        seq += 1;
                        live.insert(
                            seq,
                            Live {
                                token,
                                wr_id: wr_id as u64,
                                kind: desc.kind(),
                                region: region_id,
                                off,
                                len,
                                done: None,
                            },
                        );
                        if desc == OpDesc::Recv {
                            recv.push_back(seq);
                        } else {
                            submit.push_back(seq);
                        }
                        assert_eq!(t.get(token).map(|p| p.wr_id), Some(wr_id as u64));
                    }
                    Err(e) => {
                        assert_eq!(
                            (e.buf.region().id(), e.buf.offset(), e.buf.len()),
                            (region_id, off, len),
                            "refused post returned another buffer"
                        );
                        assert_eq!(
                            verdict_of(&e.error),
                            expect,
                            "tracker refused {desc:?} with {}",
                            e.error
                        );
                        if failed {
                            assert!(
                                matches!(e.error, Error::Disconnected(_)),
                                "after fail_all: {}",
                                e.error
                            );
                        }
                    }
                }
            }
            Op::SubmitPop => {
                let got = t.submit_pop();
                let want = submit
                    .pop_front()
                    .map(|s| (live.get(&s).map(|l| l.token), s));
                match (got, want) {
                    (None, None) => {}
                    (Some(g), Some((Some(w), _))) => assert_eq!(g, w),
                    // finished and already taken while still queued: a stale token
                    (Some(g), Some((None, _))) => assert!(t.get(g).is_none()),
                    (g, w) => panic!("submit_pop {g:?}, model {w:?}"),
                }
            }
            Op::RecvPop => {
                let got = t.recv_pop();
                let want = recv.pop_front().map(|s| (live.get(&s).map(|l| l.token), s));
                match (got, want) {
                    (None, None) => {}
                    (Some(g), Some((Some(w), _))) => assert_eq!(g, w),
                    (Some(g), Some((None, _))) => assert!(t.get(g).is_none()),
                    (g, w) => panic!("recv_pop {g:?}, model {w:?}"),
                }
            }
            Op::Complete {
                pick,
                raw,
                status,
                len,
            } => {
                let status = STATUSES[status as usize % STATUSES.len()];
                let token = match raw {
                    Some(raw) => Token(raw),
                    None => {
                        let mut pool: Vec<Token> = live.values().map(|l| l.token).collect();
                        pool.extend(taken_tokens.iter().copied());
                        pool.sort_by_key(|t| t.0);
                        if pool.is_empty() {
                            continue;
                        }
                        pool[pick as usize % pool.len()]
                    }
                };
                let target = live
                    .iter()
                    .find(|(_, l)| l.token == token && l.done.is_none())
                    .map(|(s, _)| *s);
                let accepted = t.complete(token, status, len as usize, 0);
                assert_eq!(
                    accepted,
                    target.is_some(),
                    "complete({token:?}) accepted={accepted}, model {target:?}"
                );
                if let Some(s) = target {
                    live.get_mut(&s).unwrap().done = Some(status);
                    // The tracker's contract: a finished op stays in its queue until the
                    // backend pops it (backends must skip it then; see tcp `next_frame`).
                    ready.push_back(s);
                }
            }
            Op::Take { n } => {
                let mut out: Vec<Completion> = (0..n % 5).map(|_| Completion::default()).collect();
                let k = t.take(&mut out);
                assert_eq!(k, (n as usize % 5).min(ready.len()));
                for c in out.iter_mut().take(k) {
                    let s = ready.pop_front().expect("model ready");
                    let l = live.remove(&s).expect("model live");
                    let buf = c.buf.take().expect("completion without its buffer");
                    assert_eq!(
                        (c.wr_id, c.op, Some(c.status)),
                        (l.wr_id, l.kind, l.done),
                        "completion out of order or mixed up"
                    );
                    assert_eq!(
                        (buf.region().id(), buf.offset(), buf.len()),
                        (l.region, l.off, l.len),
                        "wrong buffer returned"
                    );
                    assert!(t.get(l.token).is_none(), "taken token still live");
                    taken_tokens.push(l.token);
                }
            }
            Op::FailAll { status } => {
                let status = STATUSES[status as usize % STATUSES.len()];
                t.fail_all(status, "fuzz: connection died");
                failed = true;
                // Every unfinished op is now finished with `status`, queued ones first in post
                // order; the exact order of the rest is the tracker's: resync the model to it.
                let mut newly: Vec<u64> = live
                    .iter()
                    .filter(|(_, l)| l.done.is_none())
                    .map(|(s, _)| *s)
                    .collect();
                newly.sort();
                for s in &newly {
                    live.get_mut(s).unwrap().done = Some(status);
                }
                submit.clear();
                recv.clear();
                assert_eq!(t.submit_front(), None);
                assert_eq!(t.recv_front(), None);
                assert!(t.failure().is_some());
                // Drain everything and check it as a set.
                let mut out: Vec<Completion> =
                    (0..live.len() + 1).map(|_| Completion::default()).collect();
                let k = t.take(&mut out);
                assert_eq!(k, live.len(), "fail_all left operations unfinished");
                for c in out.iter_mut().take(k) {
                    let buf = c.buf.take().expect("completion without its buffer");
                    let key = (
                        c.wr_id,
                        c.op,
                        Some(c.status),
                        buf.region().id(),
                        buf.offset(),
                        buf.len(),
                    );
                    let (&s, _) = live
                        .iter()
                        .find(|(_, l)| (l.wr_id, l.kind, l.done, l.region, l.off, l.len) == key)
                        .expect("completion matches an op in flight, with its own buffer");
                    let l = live.remove(&s).unwrap();
                    taken_tokens.push(l.token);
                }
                ready.clear();
            }
            Op::Register { key, access, len } => {
                let access = Access::from_bits_truncate(access as u32);
                let (id, gen) = reg.reserve().expect("ids left");
                assert!(
                    !reg_live.iter().any(|l| l.0 == id),
                    "id {id} handed out twice"
                );
                assert!(
                    !reg_dead.iter().any(|d| (d.0, d.1) == (id, gen)),
                    "(id, gen) ({id}, {gen}) reused: a stale key would match"
                );
                let entry = Entry {
                    key: key as u64,
                    access,
                    len: len as u64,
                    value: key,
                };
                assert!(reg.publish(id, gen, entry));
                reg_live.push((id, gen, key as u64, access, len as u64));
                reg_peak = reg_peak.max(reg_live.len());
            }
            Op::Release { pick, forge } => {
                let (id, gen, live_pick) = match forge {
                    Some((i, g)) => (i as u32 % 8, g as u32 % 4, None),
                    None if !reg_live.is_empty() => {
                        let i = pick as usize % reg_live.len();
                        (reg_live[i].0, reg_live[i].1, Some(i))
                    }
                    None if !reg_dead.is_empty() => {
                        let d = reg_dead[pick as usize % reg_dead.len()];
                        (d.0, d.1, None)
                    }
                    None => continue,
                };
                let model =
                    live_pick.or_else(|| reg_live.iter().position(|l| (l.0, l.1) == (id, gen)));
                let got = reg.release(id, gen);
                assert_eq!(got.is_some(), model.is_some(), "release({id}, {gen})");
                if let Some(i) = model {
                    let l = reg_live.swap_remove(i);
                    reg_dead.push((l.0, l.1, l.2));
                }
            }
            Op::Check {
                pick,
                forge,
                off,
                len,
                need,
            } => {
                let need = Access::from_bits_truncate(need as u32 & 0xe);
                let (id, gen, mut key) = if pick % 2 == 0 && !reg_live.is_empty() {
                    let l = reg_live[pick as usize / 2 % reg_live.len()];
                    (l.0, l.1, l.2)
                } else if !reg_dead.is_empty() {
                    reg_dead[pick as usize / 2 % reg_dead.len()]
                } else {
                    continue;
                };
                if forge % 3 == 1 {
                    key ^= 1;
                }
                let want = reg_live
                    .iter()
                    .find(|l| (l.0, l.1) == (id, gen))
                    .is_some_and(|l| {
                        l.2 == key && l.3.contains(need) && (off as u64) + (len as u64) <= l.4
                    });
                let got = reg.check(id, gen, key, off as u64, len as u64, need);
                assert_eq!(
                    got.is_ok(),
                    want,
                    "check({id}, {gen}, key {key}, {off}+{len}, {need:?})"
                );
                if let Err(s) = got {
                    assert_eq!(s, Status::RemoteAccess);
                }
            }
        }
        assert_eq!(reg.live(), reg_live.len(), "registry live");
        assert!(reg.capacity() <= reg_peak, "registry grew past its peak");
        assert_eq!(t.in_flight(), live.len(), "in_flight");
        assert_eq!(t.ready_len(), ready.len(), "ready_len");
    }
});
