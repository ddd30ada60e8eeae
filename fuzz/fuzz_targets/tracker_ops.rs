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
//! * message matching (tags with masks, receives in post order, messages in arrival
//!   order), the bounded unexpected queue (a full queue refuses; a receive posted while its
//!   message is still arriving waits for the last byte) and grouped receives (one
//!   completion once every part is filled, with each part's buffer, length, tag and status):
//!   the model decides which receive (part) each arriving message goes to, or whether it is
//!   queued or stays on the wire, and the tracker must agree;
//! * tagged sends, write with immediate and flush (validation against the capability
//!   flags, the completion's kind, tag and immediate);
//! * the domain registry (ids with generations): reserve / publish / release / check
//!   against a model — a released id's keys are refused forever, even after the id is
//!   reused with a new generation; a double or stale release changes nothing; the table
//!   never holds more slots than the most ids live at once.
#![no_main]

use std::collections::{HashMap, VecDeque};

use arbitrary::Arbitrary;
use fabric_core::registry::{Entry, Registry};
use fabric_core::tracker::{tag_matches, OpDesc, Token, Tracker};
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
    /// A grouped receive of `n` parts (tags and masks from `tags`).
    PostGroup {
        region: u8,
        n: u8,
        tags: u32,
        part_len: u8,
        wr_id: u8,
    },
    /// A message (tag, payload length) arrives from the peer; `split`: its last bytes come
    /// in a later `StashEnd` when it is queued as unexpected.
    Arrive {
        tag: u8,
        len: u16,
        split: bool,
        imm: Option<u8>,
    },
    /// The rest of a split unexpected message arrives.
    StashEnd,
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
    /// A grouped receive with no parts or too many.
    Group,
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
    tagged: bool,
    write_imm: bool,
    max_group: u8,
    unexpected_messages: u8,
    unexpected_bytes: u16,
    ops: Vec<Op>,
}

/// One receive part in the model: its buffer and, once filled, (status, len, tag, imm).
#[derive(Debug, Clone)]
struct PartModel {
    region: u32,
    off: usize,
    cap: usize,
    done: Option<(Status, usize, u64, Option<u32>)>,
}

#[derive(Debug)]
struct Live {
    token: Token,
    wr_id: u64,
    kind: OpKind,
    region: u32,
    off: usize,
    len: usize,
    /// The completion's length, tag and immediate when they differ from the buffer's
    /// (receives, flush, write-imm).
    result: Option<(usize, u64, Option<u32>)>,
    /// Tagged sends: the tag.
    tag: u64,
    imm: Option<u32>,
    /// Receives: part 0 (plain) or every part (group).
    parts: Vec<PartModel>,
    done: Option<Status>,
}

/// A posted receive part in the model.
#[derive(Debug, Clone, Copy)]
struct PostedM {
    seq: u64,
    /// Kept: a receive finished and taken stays in the queue (stale) until it is matched.
    token: Token,
    part: u32,
    tag: u64,
    mask: u64,
}

/// A queued unexpected message in the model.
#[derive(Debug, Clone)]
struct UxM {
    tag: u64,
    imm: Option<u32>,
    len: usize,
    bytes: usize,
    complete: bool,
    bound: Option<(u64, u32)>,
}

/// Tags drawn from a small set so that masks make them collide.
fn tag_of(x: u8) -> u64 {
    [0u64, 1, 2, 0x100, 0x101, u64::MAX, 7 << 32, (7 << 32) | 1][x as usize % 8]
}
fn mask_of(x: u8) -> u64 {
    [0u64, !0, 0xff, 0xffff_ffff << 32, 1, !0, !0, 0x100][x as usize % 8]
}

struct Model {
    live: HashMap<u64, Live>,
    ready: VecDeque<u64>,
    recv: VecDeque<PostedM>,
    ux: VecDeque<UxM>,
    ux_bytes: usize,
}

impl Model {
    /// A receive part finished: the op completes when its last part does.
    fn finish_part(
        &mut self,
        seq: u64,
        part: u32,
        st: Status,
        len: usize,
        tag: u64,
        imm: Option<u32>,
    ) -> bool {
        let Some(l) = self.live.get_mut(&seq) else {
            return false;
        };
        if l.done.is_some() {
            return false;
        }
        let Some(p) = l.parts.get_mut(part as usize) else {
            return false;
        };
        if p.done.is_some() {
            return false;
        }
        p.done = Some((st, len, tag, imm));
        if l.parts.iter().all(|p| p.done.is_some()) {
            let status = l
                .parts
                .iter()
                .map(|p| p.done.unwrap().0)
                .find(|s| *s != Status::Success)
                .unwrap_or(Status::Success);
            let total = l.parts.iter().map(|p| p.done.unwrap().1).sum();
            l.done = Some(status);
            if l.kind == OpKind::Recv {
                l.result = Some((len, tag, imm));
            } else {
                l.result = Some((total, 0, None));
            }
            self.ready.push_back(seq);
        }
        true
    }

    fn deliver(&mut self, u: &UxM, seq: u64, part: u32) {
        let Some(cap) = self
            .live
            .get(&seq)
            .filter(|l| l.done.is_none())
            .and_then(|l| l.parts.get(part as usize))
            .filter(|p| p.done.is_none())
            .map(|p| p.cap)
        else {
            return;
        };
        let st = if u.bytes > cap {
            Status::MessageTooLong
        } else {
            Status::Success
        };
        self.finish_part(seq, part, st, u.len, u.tag, u.imm);
    }

    /// A receive part starts matching (the tracker's `enqueue_recv`).
    fn enqueue(&mut self, seq: u64, part: u32, tag: u64, mask: u64) {
        if let Some(i) = self
            .ux
            .iter()
            .position(|u| u.bound.is_none() && tag_matches(u.tag, tag, mask))
        {
            if self.ux[i].complete {
                let u = self.ux.remove(i).unwrap();
                self.ux_bytes -= u.bytes;
                self.deliver(&u, seq, part);
            } else {
                self.ux[i].bound = Some((seq, part));
            }
            return;
        }
        let token = self.live[&seq].token;
        self.recv.push_back(PostedM {
            seq,
            token,
            part,
            tag,
            mask,
        });
    }
}

const STATUSES: [Status; 6] = [
    Status::Success,
    Status::MessageTooLong,
    Status::RemoteAccess,
    Status::PeerGone,
    Status::ProtocolError,
    Status::Canceled,
];

/// Whether a completion is the model's op `l`, in every field and buffer.
fn same(c: &Completion, l: &Live) -> bool {
    let Some((len, tag, imm)) = l.result else {
        return false;
    };
    if (c.wr_id, c.op, Some(c.status), c.len, c.tag, c.imm)
        != (l.wr_id, l.kind, l.done, len, tag, imm)
    {
        return false;
    }
    let at = |b: &fabric_core::Buf| (b.region().id(), b.offset(), b.len());
    if l.kind != OpKind::RecvGroup {
        return c.parts.is_empty() && c.buf.as_ref().map(at) == Some((l.region, l.off, l.len));
    }
    let group = l.done.unwrap_or(Status::Success);
    c.buf.is_none()
        && c.parts.len() == l.parts.len()
        && c.parts.iter().zip(&l.parts).all(|(p, q)| {
            at(&p.buf) == (q.region, q.off, q.cap)
                && (p.status, p.len, p.tag, p.imm) == q.done.unwrap_or((group, 0, 0, None))
        })
}

/// Checks a completion's length, tag, immediate and (grouped receives) parts against the
/// model; returns its (first) buffer as (region, offset, len).
fn check_completion(c: &mut Completion, l: &Live) -> (u32, usize, usize) {
    let (len, tag, imm) = l.result.expect("a finished op has its result");
    assert_eq!(
        (c.len, c.tag, c.imm),
        (len, tag, imm),
        "result of {:?}",
        l.kind
    );
    if l.kind != OpKind::RecvGroup {
        assert!(c.parts.is_empty(), "parts on a {:?}", l.kind);
        let buf = c.buf.take().expect("completion without its buffer");
        return (buf.region().id(), buf.offset(), buf.len());
    }
    assert!(c.buf.is_none(), "a group's buffers are in its parts");
    assert_eq!(c.parts.len(), l.parts.len(), "every part comes back");
    let group = l.done.expect("finished");
    for (p, q) in c.parts.iter().zip(&l.parts) {
        assert_eq!(
            (p.buf.region().id(), p.buf.offset(), p.buf.len()),
            (q.region, q.off, q.cap),
            "part buffer"
        );
        let want = q.done.unwrap_or((group, 0, 0, None));
        assert_eq!((p.status, p.len, p.tag, p.imm), want, "part result");
    }
    let p = &c.parts[0].buf;
    (p.region().id(), p.offset(), p.len())
}

fuzz_target!(|inp: Input| {
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: inp.one_sided,
        atomics: inp.atomics,
        max_message: inp.max_message as usize,
        max_in_flight: 1 + inp.max_in_flight as usize % 8,
        inline_size: 0,
        memory_kinds: MemoryKinds::HOST,
        tagged: inp.tagged,
        max_group: inp.max_group as usize % 5,
        write_imm: inp.write_imm,
        unexpected_messages: inp.unexpected_messages as usize % 4,
        unexpected_bytes: inp.unexpected_bytes as usize % 4096,
        too_long_kills_connection: false,
        remote_error_kills_connection: false,
        remote_window: false,
    };
    let mut t = Tracker::new(CONN, TransportKind::Tcp, caps);
    let mut regions: Vec<Region> = Vec::new();
    let mut owners: HashMap<u32, u64> = HashMap::new();
    // Ops by internal sequence number, completion order, posted receives, unexpected queue.
    let mut m = Model {
        live: HashMap::new(),
        ready: VecDeque::new(),
        recv: VecDeque::new(),
        ux: VecDeque::new(),
        ux_bytes: 0,
    };
    let mut seq = 0u64;
    let mut submit: VecDeque<u64> = VecDeque::new();
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
                // 5 tagged send, 6 tagged receive, 7 write with immediate, 8 flush.
                let kind = what % 9;
                let desc = match (kind, key) {
                    (0 | 5 | 8, _) => OpDesc::Send,
                    (1 | 6, _) => OpDesc::Recv,
                    (2 | 7, Some(key)) => OpDesc::Write {
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
                let (tag, mask) = match kind {
                    5 => (tag_of(forge), 0),
                    6 => (tag_of(roff as u8), mask_of(forge)),
                    _ => (0, 0),
                };
                let imm = (kind == 7).then_some(roff as u32 ^ 0xabcd_0000);
                let region_id = r.id();
                let full = m.live.len() >= caps.max_in_flight;
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
                let unsupported = match kind {
                    5 | 6 => !caps.tagged,
                    7 => !caps.write_imm,
                    _ => false,
                };
                let expect = if failed {
                    Verdict::Disconnected
                } else if unsupported {
                    Verdict::OneSided
                } else if foreign {
                    Verdict::Owner
                } else {
                    let v = match &desc {
                        _ if kind == 8 => Verdict::Accept,
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
                let posted = match (kind, desc) {
                    (5, _) => t.post_send_tagged(buf, tag, wr_id as u64),
                    (6, _) => t.post_recv_tagged(buf, tag, mask, wr_id as u64),
                    (7, OpDesc::Write { key, off }) => {
                        t.post_write_imm(buf, key, off, imm.unwrap_or(0), wr_id as u64)
                    }
                    (8, _) => t.post_flush_done(buf, wr_id as u64),
                    _ => t.post(desc, buf, wr_id as u64),
                };
                match posted {
                    Ok(token) => {
                        assert_eq!(
                            expect,
                            Verdict::Accept,
                            "tracker accepted {desc:?} ({kind})"
                        );
                        assert!(!failed, "post accepted after fail_all");
                        assert!(!full, "post accepted with every slot in use");
                        seq += 1;
                        let op_kind = match kind {
                            7 => OpKind::WriteImm,
                            8 => OpKind::Flush,
                            _ => desc.kind(),
                        };
                        let is_recv = desc == OpDesc::Recv;
                        m.live.insert(
                            seq,
                            Live {
                                token,
                                wr_id: wr_id as u64,
                                kind: op_kind,
                                region: region_id,
                                off,
                                len,
                                result: None,
                                tag: if kind == 5 { tag } else { 0 },
                                imm,
                                parts: if is_recv {
                                    vec![PartModel {
                                        region: region_id,
                                        off,
                                        cap: len,
                                        done: None,
                                    }]
                                } else {
                                    Vec::new()
                                },
                                done: None,
                            },
                        );
                        if is_recv {
                            // A plain receive has mask 0: it takes any message.
                            m.enqueue(seq, 0, tag, mask);
                        } else if kind == 8 {
                            // Host flush: done at once.
                            let l = m.live.get_mut(&seq).unwrap();
                            l.done = Some(Status::Success);
                            l.result = Some((len, 0, None));
                            m.ready.push_back(seq);
                        } else {
                            submit.push_back(seq);
                        }
                        // Finished at once (a flush; a receive that took a queued message)
                        // or live.
                        let done = m.live[&seq].done.is_some();
                        assert_eq!(
                            t.get(token).map(|p| p.wr_id),
                            (!done).then_some(wr_id as u64)
                        );
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
                            "tracker refused {desc:?} ({kind}) with {}",
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
            Op::PostGroup {
                region,
                n,
                tags,
                part_len,
                wr_id,
            } => {
                if regions.is_empty() {
                    continue;
                }
                let r = &regions[region as usize % regions.len()];
                let n = n as usize % 6;
                let plen = part_len as usize % 64;
                if n * plen > r.len() {
                    continue;
                }
                let region_id = r.id();
                let parts: Vec<_> = (0..n)
                    .map(|i| {
                        let x = (tags >> (4 * i)) as u8;
                        (
                            r.slice(i * plen, plen).expect("in bounds"),
                            tag_of(x & 7),
                            mask_of(x >> 3),
                        )
                    })
                    .collect();
                let matching: Vec<(u64, u64)> = parts.iter().map(|p| (p.1, p.2)).collect();
                let foreign = owners.get(&region_id).copied() != Some(CONN);
                let full = m.live.len() >= caps.max_in_flight;
                let expect = if failed {
                    Verdict::Disconnected
                } else if caps.max_group == 0 {
                    Verdict::OneSided
                } else if n == 0 || n > caps.max_group {
                    Verdict::Group
                } else if foreign {
                    Verdict::Owner
                } else if plen > caps.max_message {
                    Verdict::Size
                } else if full {
                    Verdict::Full
                } else {
                    Verdict::Accept
                };
                match t.post_recv_group(parts, wr_id as u64) {
                    Ok(token) => {
                        assert_eq!(expect, Verdict::Accept, "tracker accepted a group of {n}");
                        seq += 1;
                        m.live.insert(
                            seq,
                            Live {
                                token,
                                wr_id: wr_id as u64,
                                kind: OpKind::RecvGroup,
                                region: region_id,
                                off: 0,
                                len: plen,
                                result: None,
                                tag: 0,
                                imm: None,
                                parts: (0..n)
                                    .map(|i| PartModel {
                                        region: region_id,
                                        off: i * plen,
                                        cap: plen,
                                        done: None,
                                    })
                                    .collect(),
                                done: None,
                            },
                        );
                        for (i, (tag, mask)) in matching.into_iter().enumerate() {
                            m.enqueue(seq, i as u32, tag, mask);
                        }
                    }
                    Err(e) => {
                        assert_eq!(e.bufs.len(), n, "refused group lost buffers");
                        for (i, b) in e.bufs.iter().enumerate() {
                            assert_eq!(
                                (b.region().id(), b.offset(), b.len()),
                                (region_id, i * plen, plen)
                            );
                        }
                        let got = match &e.error {
                            Error::InvalidArgument(_) => Verdict::Group,
                            other => verdict_of(other),
                        };
                        assert_eq!(
                            got, expect,
                            "tracker refused a group of {n} with {}",
                            e.error
                        );
                    }
                }
            }
            Op::Arrive {
                tag,
                len,
                split,
                imm,
            } => {
                let tag = if imm.is_some() { 0 } else { tag_of(tag) };
                let imm = imm.map(|x| x as u32);
                let bytes = if imm.is_some() { 0 } else { len as usize % 512 };
                let want = m.recv.iter().position(|p| tag_matches(tag, p.tag, p.mask));
                let got = t.match_message(tag);
                match (got, want) {
                    (None, None) => {}
                    (Some(at), Some(i)) => {
                        let p = m.recv.remove(i).unwrap();
                        assert_eq!(
                            (at.token, at.part),
                            (p.token, p.part),
                            "matched another receive"
                        );
                        // The backend copies into the receive's buffer when it is live.
                        let live_buf = t.recv_buf(at).map(|b| b.len());
                        let model_cap = m
                            .live
                            .get(&p.seq)
                            .filter(|l| l.done.is_none())
                            .and_then(|l| l.parts.get(p.part as usize))
                            .filter(|q| q.done.is_none())
                            .map(|q| q.cap);
                        assert_eq!(live_buf, model_cap, "recv_buf of {at:?}");
                        if let Some(cap) = live_buf {
                            let st = if bytes > cap {
                                Status::MessageTooLong
                            } else {
                                Status::Success
                            };
                            let len = if imm.is_some() { len as usize } else { bytes };
                            assert!(t.complete_recv(at, st, len, tag, imm));
                            assert!(m.finish_part(p.seq, p.part, st, len, tag, imm));
                        } else {
                            assert!(!t.complete_recv(at, Status::Success, 0, tag, imm));
                        }
                        continue;
                    }
                    (g, w) => panic!("match_message({tag:#x}) = {g:?}, model {w:?}"),
                }
                // No receive matched: queued only while receives wait for other tags.
                assert_eq!(t.has_posted_recv(), !m.recv.is_empty());
                if m.recv.is_empty() {
                    continue;
                }
                let room = m.ux.len() < caps.unexpected_messages
                    && m.ux_bytes + bytes <= caps.unexpected_bytes
                    && !matches!(m.ux.back(), Some(u) if !u.complete);
                assert_eq!(t.can_stash(bytes), room, "can_stash({bytes})");
                let len = if imm.is_some() { len as usize } else { bytes };
                let dst = t.stash_begin(tag, imm, len, bytes);
                assert_eq!(dst.is_some(), room, "stash_begin");
                if !room {
                    continue;
                }
                let data: Vec<u8> = (0..bytes).map(|i| i as u8 ^ tag as u8).collect();
                assert!(t.stash_fill(0, &data));
                assert!(!t.stash_fill(bytes, &[1]), "filled past the end");
                m.ux_bytes += bytes;
                m.ux.push_back(UxM {
                    tag,
                    imm,
                    len,
                    bytes,
                    complete: false,
                    bound: None,
                });
                if !split {
                    t.stash_end();
                    let u = m.ux.back_mut().unwrap();
                    u.complete = true;
                    if let Some((s, part)) = u.bound {
                        let u = m.ux.pop_back().unwrap();
                        m.ux_bytes -= u.bytes;
                        m.deliver(&u, s, part);
                    }
                }
            }
            Op::StashEnd => {
                t.stash_end();
                if let Some(u) = m.ux.back_mut().filter(|u| !u.complete) {
                    u.complete = true;
                    if let Some((s, part)) = u.bound {
                        let u = m.ux.pop_back().unwrap();
                        m.ux_bytes -= u.bytes;
                        m.deliver(&u, s, part);
                    }
                }
            }
            Op::SubmitPop => {
                let got = t.submit_pop();
                let want = submit
                    .pop_front()
                    .map(|s| (m.live.get(&s).map(|l| l.token), s));
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
                let want = m
                    .recv
                    .pop_front()
                    .map(|p| (m.live.contains_key(&p.seq).then_some(p.token), p.seq));
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
                        let mut pool: Vec<Token> = m.live.values().map(|l| l.token).collect();
                        pool.extend(taken_tokens.iter().copied());
                        pool.sort_by_key(|t| t.0);
                        if pool.is_empty() {
                            continue;
                        }
                        pool[pick as usize % pool.len()]
                    }
                };
                let target = m
                    .live
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
                    let l = m.live.get_mut(&s).unwrap();
                    l.done = Some(status);
                    l.result = Some((len as usize, l.tag, l.imm));
                    // The tracker's contract: a finished op stays in its queue until the
                    // backend pops it (backends must skip it then; see tcp `next_frame`).
                    m.ready.push_back(s);
                }
            }
            Op::Take { n } => {
                let mut out: Vec<Completion> = (0..n % 5).map(|_| Completion::default()).collect();
                let k = t.take(&mut out);
                assert_eq!(k, (n as usize % 5).min(m.ready.len()));
                for c in out.iter_mut().take(k) {
                    let s = m.ready.pop_front().expect("model ready");
                    let l = m.live.remove(&s).expect("model live");
                    assert_eq!(
                        (c.wr_id, c.op, Some(c.status)),
                        (l.wr_id, l.kind, l.done),
                        "completion out of order or mixed up"
                    );
                    let buf = check_completion(c, &l);
                    assert_eq!(buf, (l.region, l.off, l.len), "wrong buffer returned");
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
                let mut newly: Vec<u64> = m
                    .live
                    .iter()
                    .filter(|(_, l)| l.done.is_none())
                    .map(|(s, _)| *s)
                    .collect();
                newly.sort();
                for s in &newly {
                    let l = m.live.get_mut(s).unwrap();
                    l.done = Some(status);
                    l.result = Some((0, l.tag, l.imm));
                }
                submit.clear();
                m.recv.clear();
                for u in &mut m.ux {
                    u.bound = None;
                }
                assert_eq!(t.submit_front(), None);
                assert_eq!(t.recv_front(), None);
                assert!(t.failure().is_some());
                // Drain everything and check it as a set.
                let mut out: Vec<Completion> = (0..m.live.len() + 1)
                    .map(|_| Completion::default())
                    .collect();
                let k = t.take(&mut out);
                assert_eq!(k, m.live.len(), "fail_all left operations unfinished");
                for c in out.iter_mut().take(k) {
                    // Completions of one failure come in the tracker's order: find the op
                    // in flight that this one is, all of it (kind, status, result, buffers).
                    let (&s, _) = m
                        .live
                        .iter()
                        .find(|(_, l)| same(c, l))
                        .expect("completion matches an op in flight, with its own buffer");
                    let l = m.live.remove(&s).unwrap();
                    check_completion(c, &l);
                    taken_tokens.push(l.token);
                }
                m.ready.clear();
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
        assert_eq!(t.in_flight(), m.live.len(), "in_flight");
        assert_eq!(t.unexpected_len(), m.ux.len(), "unexpected messages");
        assert_eq!(t.unexpected_bytes(), m.ux_bytes, "unexpected bytes");
        assert_eq!(t.ready_len(), m.ready.len(), "ready_len");
    }
});
