//! Op-sequence fuzzing of ibverbs-safe's host-side checks, the ones made before anything
//! reaches the device (through `ibverbs_safe::fuzzing`, which runs the very code the QP, MR
//! and CQ paths use), against a reference model:
//!
//! * region bounds (`MemoryRegion::slice` / `MrSlice::slice`, scoped posts): `start..end`
//!   is accepted exactly when it lies in the region (and fits one SGE), typed error else;
//! * send work requests (`SendShape::check`, what `post_send`/`post_batch` run): SGE count
//!   limit, inline size limit, no inline READ/atomics, opcode allowed for the QP type
//!   (RC/UC/UD), no immediate on READ/atomics, local length within the remote window, atomics on one 8-byte 8-aligned
//!   buffer and an 8-byte 8-aligned target — the model's verdict and error kind must agree;
//!   only requests that pass are posted;
//! * in-flight slot tables (a QP's ordered send queue and an SRQ's unordered table):
//!   backpressure when full, a refused post hands the buffer back, every accepted buffer is
//!   returned exactly once (by its completion, by a later completion that retires it, or by
//!   teardown), stale completions return nothing, per-slot contents and `in_flight` match.
//!
//! QP state order (RESET -> INIT -> RTR -> RTS) is enforced by types (`PreparedQp` cannot
//! post sends; `connect`/`activate` consume it), so there is no run-time check to fuzz.
#![no_main]

use std::collections::HashSet;

use arbitrary::Arbitrary;
use ibverbs_safe::fuzzing::{
    region_range, sge_range, OpClass, SendShape, SlotTable, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD,
};
use ibverbs_safe::{Error, MAX_SGE};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary, Clone, Copy, PartialEq)]
enum Qpt {
    Rc,
    Uc,
    Ud,
}

#[derive(Debug, Arbitrary, Clone, Copy, PartialEq)]
enum Class {
    Send,
    SendTo,
    Write,
    Read,
    Atomic,
}

#[derive(Debug, Arbitrary)]
enum Op {
    /// A slice `start..end` of a region `len` bytes long.
    Slice { start: u64, end: u64, len: u64 },
    /// Build a send work request, check it, post it to the send queue if it passes.
    PostSend {
        qpt: Qpt,
        class: Class,
        imm: bool,
        inline: bool,
        bufs: Vec<(u32, u32)>,
        remote: Option<(u64, u64)>,
        max_sge: u8,
        max_inline: u16,
        refused_by_provider: bool,
    },
    /// Post a receive to the SRQ (unordered table).
    PostSrq { refused_by_provider: bool },
    /// A completion naming a slot of the send queue / SRQ.
    Complete { srq: bool, slot: u8 },
    /// The QP/SRQ is destroyed: everything in flight is released, a fresh one replaces it.
    Teardown { srq: bool },
}

#[derive(Debug, Arbitrary)]
struct Input {
    sq_depth: u8,
    srq_depth: u8,
    ops: Vec<Op>,
}

/// The reference model of one slot table.
struct Model {
    slots: Vec<Option<u64>>,
    ordered: bool,
    cursor: usize,
    tail: usize,
}

impl Model {
    fn new(depth: usize, ordered: bool) -> Self {
        Model {
            slots: vec![None; depth.max(1)],
            ordered,
            cursor: 0,
            tail: 0,
        }
    }
    fn free_slot(&mut self) -> Option<usize> {
        let n = self.slots.len();
        if self.ordered {
            return self.slots[self.cursor].is_none().then_some(self.cursor);
        }
        let i = (0..n)
            .map(|k| (self.cursor + k) % n)
            .find(|&i| self.slots[i].is_none())?;
        self.cursor = i;
        Some(i)
    }
    fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

/// Fixed expectations for a send request, from the rules (not from the code).
#[derive(Debug, PartialEq)]
enum Verdict {
    Ok,
    Invalid,
    OutOfBounds,
}

fn expected(s: &SendShape, qpt: Qpt, max_sge: usize, max_inline: u32) -> Verdict {
    if s.nbufs > max_sge || (s.inline && s.total > max_inline as u64) {
        return Verdict::Invalid;
    }
    // Inline data is a SEND/WRITE source copied by the CPU: never READ or atomic targets.
    if s.inline && matches!(s.class, OpClass::Read | OpClass::Atomic) {
        return Verdict::Invalid;
    }
    let allowed = match s.class {
        OpClass::Send | OpClass::Write => qpt != Qpt::Ud,
        OpClass::SendTo => qpt == Qpt::Ud,
        OpClass::Read | OpClass::Atomic => qpt == Qpt::Rc,
    };
    if !allowed {
        return Verdict::Invalid;
    }
    let (raddr, rlen) = s.remote.unwrap_or((0, 0));
    match s.class {
        OpClass::Send | OpClass::SendTo => Verdict::Ok,
        OpClass::Read if s.imm => Verdict::Invalid,
        OpClass::Write | OpClass::Read if s.total > rlen => Verdict::OutOfBounds,
        OpClass::Write | OpClass::Read => Verdict::Ok,
        OpClass::Atomic => {
            let local_ok =
                s.nbufs == 1 && matches!(s.first, Some((addr, 8)) if addr.is_multiple_of(8));
            if s.imm || !local_ok || rlen < 8 || !raddr.is_multiple_of(8) {
                Verdict::Invalid
            } else {
                Verdict::Ok
            }
        }
    }
}

fn verdict(r: &Result<(), Error>) -> Verdict {
    match r {
        Ok(()) => Verdict::Ok,
        Err(Error::InvalidRequest(_)) => Verdict::Invalid,
        Err(Error::OutOfBounds { .. }) => Verdict::OutOfBounds,
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
}

struct Side {
    table: SlotTable,
    model: Model,
}

impl Side {
    fn new(depth: usize, ordered: bool) -> Self {
        let depth = depth.clamp(1, 16);
        Side {
            table: SlotTable::new(depth, ordered),
            model: Model::new(depth, ordered),
        }
    }
    fn check(&self) {
        assert_eq!(self.table.in_flight(), self.model.in_flight());
        for (i, m) in self.model.slots.iter().enumerate() {
            assert_eq!(self.table.posted(i), *m, "slot {i}");
        }
    }
    fn post(&mut self, user: u64, refused: bool, ledger: &mut HashSet<u64>) {
        let free = self.model.free_slot();
        if refused {
            match (self.table.post_refused(user), free) {
                (Ok(back), Some(_)) => assert_eq!(back, Some(user), "refused post lost its buffer"),
                (Err(back), None) => assert_eq!(back, user),
                (r, f) => panic!("refused post: table {r:?}, model free slot {f:?}"),
            }
            return;
        }
        match (self.table.post(user), free) {
            (Ok(i), Some(j)) => {
                assert_eq!(i, j, "slot chosen");
                self.model.slots[i] = Some(user);
                let n = self.model.slots.len();
                self.model.cursor = (i + 1) % n;
                assert!(ledger.insert(user));
            }
            (Err(back), None) => assert_eq!(back, user, "backpressure hands the buffer back"),
            (r, f) => panic!("post: table {r:?}, model free slot {f:?}"),
        }
    }
    fn complete(&mut self, slot: usize, ledger: &mut HashSet<u64>) {
        let (got, mut swept) = self.table.complete(slot);
        let n = self.model.slots.len();
        let (want, mut want_swept) = match self.model.slots.get_mut(slot).and_then(Option::take) {
            None => (None, vec![]),
            Some(u) => {
                let mut sw = vec![];
                if self.model.ordered {
                    let mut i = self.model.tail;
                    while i != slot {
                        sw.extend(self.model.slots[i].take());
                        i = (i + 1) % n;
                    }
                    self.model.tail = (slot + 1) % n;
                }
                (Some(u), sw)
            }
        };
        swept.sort_unstable();
        want_swept.sort_unstable();
        assert_eq!(got, want, "completion of slot {slot}");
        assert_eq!(
            swept, want_swept,
            "retired by the completion of slot {slot}"
        );
        for u in got.iter().chain(&swept) {
            assert!(ledger.remove(u), "buffer {u} returned twice");
        }
    }
    fn teardown(&mut self, ledger: &mut HashSet<u64>) {
        let want = self.model.in_flight();
        for u in self.model.slots.iter().flatten() {
            assert!(ledger.remove(u), "buffer {u} returned twice");
        }
        assert_eq!(
            self.table.release_all(),
            want,
            "teardown releases what is in flight"
        );
        assert_eq!(self.table.in_flight(), 0);
        assert_eq!(
            self.table.complete(0).0,
            None,
            "late completion after teardown"
        );
    }
}

fuzz_target!(|input: Input| {
    let mut sq = Side::new(input.sq_depth as usize, true);
    let mut srq = Side::new(input.srq_depth as usize, false);
    let mut ledger = HashSet::new();
    let mut next_user = 0u64;
    for op in input.ops.into_iter().take(512) {
        match op {
            Op::Slice { start, end, len } => {
                let (s, e, l) = (start as usize, end as usize, len as usize);
                let want = (s <= e && e <= l).then(|| (s, e - s));
                let got = region_range(s, e, l);
                match (&got, want) {
                    (Ok(g), Some(w)) => assert_eq!(*g, w),
                    (Err(Error::OutOfBounds { region_len, .. }), None) => {
                        assert_eq!(*region_len, l)
                    }
                    _ => panic!("region_range({s}, {e}, {l}) = {got:?}, model {want:?}"),
                }
                let want_sge = want.filter(|&(_, n)| n <= u32::MAX as usize);
                match (sge_range(s, e, l), want_sge) {
                    (Ok(g), Some(w)) => assert_eq!(g, w),
                    (Err(Error::OutOfBounds { .. }), None) => {}
                    (g, w) => panic!("sge_range({s}, {e}, {l}) = {g:?}, model {w:?}"),
                }
            }
            Op::PostSend {
                qpt,
                class,
                imm,
                inline,
                bufs,
                remote,
                max_sge,
                max_inline,
                refused_by_provider,
            } => {
                let bufs = &bufs[..bufs.len().min(MAX_SGE)];
                let shape = SendShape {
                    qpt: match qpt {
                        Qpt::Rc => IBV_QPT_RC,
                        Qpt::Uc => IBV_QPT_UC,
                        Qpt::Ud => IBV_QPT_UD,
                    },
                    class: match class {
                        Class::Send => OpClass::Send,
                        Class::SendTo => OpClass::SendTo,
                        Class::Write => OpClass::Write,
                        Class::Read => OpClass::Read,
                        Class::Atomic => OpClass::Atomic,
                    },
                    imm,
                    inline,
                    nbufs: bufs.len(),
                    total: bufs.iter().map(|b| b.1 as u64).sum(),
                    first: bufs.first().map(|&(a, l)| (a as u64, l as u64)),
                    remote,
                };
                // As a QP reports them: max_send_sge is 1..=MAX_SGE.
                let max_sge = (max_sge as usize).clamp(1, MAX_SGE);
                let r = shape.check(max_sge, max_inline as u32);
                let want = expected(&shape, qpt, max_sge, max_inline as u32);
                assert_eq!(
                    verdict(&r),
                    want,
                    "{shape:?} max_sge {max_sge} max_inline {max_inline}: {r:?}"
                );
                if r.is_ok() {
                    next_user += 1;
                    sq.post(next_user, refused_by_provider, &mut ledger);
                }
            }
            Op::PostSrq {
                refused_by_provider,
            } => {
                next_user += 1;
                srq.post(next_user, refused_by_provider, &mut ledger);
            }
            Op::Complete { srq: on_srq, slot } => {
                let side = if on_srq { &mut srq } else { &mut sq };
                let n = side.model.slots.len();
                // Mostly real slots, sometimes one past the end (ignored).
                side.complete(slot as usize % (n + 1), &mut ledger);
            }
            Op::Teardown { srq: on_srq } => {
                let side = if on_srq { &mut srq } else { &mut sq };
                side.teardown(&mut ledger);
                let (n, ordered) = (side.model.slots.len(), side.model.ordered);
                *side = Side::new(n, ordered);
            }
        }
        sq.check();
        srq.check();
    }
    sq.teardown(&mut ledger);
    srq.teardown(&mut ledger);
    assert!(ledger.is_empty(), "buffers never returned: {ledger:?}");
});
