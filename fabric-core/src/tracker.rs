//! The bookkeeping every backend shares, as a deterministic core with no I/O
//! (in the manner of quinn-proto): validation of posts (ownership, bounds, access,
//! sizes, capabilities), a pre-allocated in-flight slot table with generation-checked
//! tokens, the submission and receive queues (bounded; full is backpressure), the ready
//! queue of finished operations, and failure of everything in flight when a connection
//! dies. Backends ("hals") only move bytes: they take tokens from the queues, and report
//! `complete(token, status, ...)`. A test (or a fuzz target) drives it with any sequence of
//! posts, completions and failures and checks that every buffer comes back exactly once.
//!
//! Message matching lives here too (see [`Capabilities`] for the semantics): posted
//! receives (and parts of grouped receives) with their `(tag, mask)` in post order
//! ([`match_message`](Tracker::match_message)), and the bounded unexpected queue
//! ([`stash_begin`](Tracker::stash_begin) / [`stash_end`](Tracker::stash_end)) that a
//! later receive takes messages from. Backends only say "a message with tag T and this
//! many bytes is here" and copy the bytes where they are told.

use std::collections::VecDeque;

use crate::error::Error;
use crate::region::{check_range, Access, Buf, Region};
use crate::transport::{
    AtomicOp, Capabilities, Completion, GroupPostError, OpKind, PostError, RecvPart, RemoteKey,
    Status, TransportKind,
};

/// A handle on an in-flight slot: index in the low 32 bits, generation (the low
/// [`GEN_BITS`] of its upper half) in the high 32.
/// Safe to send to a peer and get back: a stale or forged token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub u64);

/// Bits of a slot's generation: it wraps at `2^GEN_BITS`, so a token fits, with a
/// slot index below `2^16`, in 46 bits (verbs packs it with flags into a work request id).
pub const GEN_BITS: u32 = 30;

impl Token {
    fn new(idx: u32, gen: u32) -> Self {
        Token(((gen as u64) << 32) | idx as u64)
    }
    fn idx(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
    fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// What was posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpDesc {
    /// Two-sided send.
    Send,
    /// Two-sided receive.
    Recv,
    /// One-sided write to `(key, off)`.
    Write {
        /// Target region.
        key: RemoteKey,
        /// Target offset.
        off: u64,
    },
    /// One-sided read from `(key, off)`.
    Read {
        /// Source region.
        key: RemoteKey,
        /// Source offset.
        off: u64,
    },
    /// Remote atomic on `(key, off)`.
    Atomic {
        /// Target region.
        key: RemoteKey,
        /// Target offset.
        off: u64,
        /// Operation.
        op: AtomicOp,
    },
}

impl OpDesc {
    /// The completion kind.
    pub fn kind(&self) -> OpKind {
        match self {
            OpDesc::Send => OpKind::Send,
            OpDesc::Recv => OpKind::Recv,
            OpDesc::Write { .. } => OpKind::Write,
            OpDesc::Read { .. } => OpKind::Read,
            OpDesc::Atomic { op, .. } => op.kind(),
        }
    }
}

/// An in-flight operation.
#[derive(Debug)]
pub struct Pending {
    /// Caller's id.
    pub wr_id: u64,
    /// What it is.
    pub desc: OpDesc,
    /// The buffer, owned until the completion is taken (a grouped receive: its first
    /// part's).
    pub buf: Buf,
    /// Bytes already moved (backends that progress an operation in pieces).
    pub progress: usize,
    /// Sends: the tag the message carries (0 for a plain send). Receives: the matched
    /// message's tag, once it completed.
    pub tag: u64,
    /// Writes with immediate: the immediate (`None` for a plain write). Receives: the
    /// immediate of the write-imm notification that completed it.
    pub imm: Option<u32>,
    kind: OpKind,
    status: Status,
    len: usize,
    value: u64,
    done: bool,
    /// Handed to the wire in full and waiting for the peer's response (one-sided ops of
    /// backends whose peer answers them; see [`Tracker::mark_awaiting`]).
    awaiting: bool,
    /// The parts of a grouped receive (empty otherwise; part 0's buffer is `buf`).
    parts: Vec<PartState>,
    /// Parts not yet filled.
    parts_left: usize,
}

impl Pending {
    /// Whether this is a write with immediate data.
    pub fn is_write_imm(&self) -> bool {
        self.imm.is_some() && matches!(self.desc, OpDesc::Write { .. })
    }
}

/// One part of a grouped receive.
#[derive(Debug)]
struct PartState {
    /// `None` for part 0 (its buffer is the operation's `buf`).
    buf: Option<Buf>,
    len: usize,
    tag: u64,
    imm: Option<u32>,
    status: Status,
    done: bool,
}

/// Where an incoming message goes: a posted receive, or one part of a grouped receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvRef {
    /// The receive's token.
    pub token: Token,
    /// The part (0 for a plain receive).
    pub part: u32,
}

/// A posted receive waiting for a message.
#[derive(Debug, Clone, Copy)]
struct Posted {
    at: RecvRef,
    tag: u64,
    mask: u64,
}

/// A message that arrived with no matching receive posted.
#[derive(Debug)]
struct Unexpected {
    tag: u64,
    imm: Option<u32>,
    /// The length the receive reports (the payload's, or a write-imm's written bytes).
    len: usize,
    data: Vec<u8>,
    /// Every byte arrived.
    complete: bool,
    /// A receive that matched it before it was complete.
    bound: Option<RecvRef>,
}

/// Where a backend writes completions while a `poll` runs: the caller's `out[*n..]`
/// (empty outside a poll). See [`Tracker::finish`] and
/// [`complete_recv_into`](Tracker::complete_recv_into).
#[derive(Debug)]
pub struct Sink<'a> {
    pub(crate) out: &'a mut [Completion],
    pub(crate) n: &'a mut usize,
}

impl<'a> Sink<'a> {
    /// The caller's array and how much of it is already filled.
    pub fn new(out: &'a mut [Completion], n: &'a mut usize) -> Self {
        Sink { out, n }
    }

    /// The next free completion, if any.
    #[inline(always)]
    #[cfg_attr(fabric_loom, allow(dead_code))] // (its user, the verbs backend, is not built for loom)
    pub(crate) fn next(&mut self) -> Option<&mut Completion> {
        self.out.get_mut(*self.n)
    }
}

/// The error of a backend's token that names no live operation (out of line: the hot
/// paths only test for it).
#[cold]
#[inline(never)]
fn not_live(what: &'static str) -> Error {
    Error::Protocol(format!("{what}: no live operation"))
}

/// Whether a message tagged `msg` matches a receive `(tag, mask)`.
#[inline]
pub fn tag_matches(msg: u64, tag: u64, mask: u64) -> bool {
    (msg ^ tag) & mask == 0
}

/// The parts of a finished grouped receive (part 0's buffer is the operation's `first`);
/// a part that was never filled reports the group's status.
fn group_parts(first: Buf, group: Status, parts: Vec<PartState>) -> Vec<RecvPart> {
    let mut first = Some(first);
    parts
        .into_iter()
        .filter_map(|s| {
            Some(RecvPart {
                buf: s.buf.or_else(|| first.take())?,
                len: s.len,
                tag: s.tag,
                imm: s.imm,
                status: if s.done { s.status } else { group },
            })
        })
        .collect()
}

impl PartState {
    fn new(buf: Option<Buf>) -> Self {
        PartState {
            buf,
            len: 0,
            tag: 0,
            imm: None,
            status: Status::Success,
            done: false,
        }
    }
}

#[derive(Debug)]
struct Slot {
    gen: u32,
    op: Option<Pending>,
}

/// What [`Tracker::finish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Written into the caller's completion; the slot is free.
    Taken,
    /// Queued for [`Tracker::take`].
    Queued,
    /// A grouped receive: not finished (see [`Tracker::complete_recv`]).
    Grouped,
    /// No live, unfinished operation behind the token.
    Stale,
}

/// The shared bookkeeping of one connection.
#[derive(Debug)]
pub struct Tracker {
    owner: u64,
    kind: TransportKind,
    caps: Capabilities,
    slots: Vec<Slot>,
    free: Vec<u32>,
    submit: VecDeque<Token>,
    recv: VecDeque<Posted>,
    ready: VecDeque<Token>,
    unexpected: VecDeque<Unexpected>,
    unexpected_bytes: usize,
    failed: Option<(Status, String)>,
    regions: Vec<Option<Region>>,
}

impl Tracker {
    /// A tracker for a connection whose buffers must belong to `owner` (its domain's id;
    /// the connection's own id for backends that register per connection), with
    /// `caps.max_in_flight` slots.
    pub fn new(owner: u64, kind: TransportKind, caps: Capabilities) -> Self {
        let n = caps.max_in_flight.max(1);
        Tracker {
            owner,
            kind,
            caps,
            slots: (0..n).map(|_| Slot { gen: 0, op: None }).collect(),
            free: (0..n as u32).rev().collect(),
            submit: VecDeque::with_capacity(n),
            recv: VecDeque::with_capacity(n),
            ready: VecDeque::with_capacity(n),
            unexpected: VecDeque::new(),
            unexpected_bytes: 0,
            failed: None,
            regions: Vec::new(),
        }
    }

    /// The owner id (domain) buffers must belong to.
    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// The capabilities it validates against.
    pub fn caps(&self) -> &Capabilities {
        &self.caps
    }

    /// Validates and queues an operation.
    ///
    /// # Errors
    /// A [`PostError`] (with the buffer) when the post is invalid, the table is full
    /// ([`Error::WouldBlock`]) or the connection has failed ([`Error::Disconnected`]).
    #[inline]
    pub fn post(&mut self, desc: OpDesc, buf: Buf, wr_id: u64) -> Result<Token, PostError> {
        // A plain receive has mask 0: it takes any message.
        self.post_with(desc, buf, wr_id, 0, 0, None)
    }

    /// [`post`](Self::post) of a send carrying `tag`.
    ///
    /// # Errors
    /// As [`post`](Self::post); [`Error::Unsupported`] without [`Capabilities::tagged`].
    pub fn post_send_tagged(&mut self, buf: Buf, tag: u64, wr_id: u64) -> Result<Token, PostError> {
        if let Err(error) = self.need(self.caps.tagged, "tagged messages") {
            return Err(PostError { error, buf });
        }
        self.post_with(OpDesc::Send, buf, wr_id, tag, !0, None)
    }

    /// [`post`](Self::post) of a receive matching `(tag, mask)`; it takes a queued
    /// unexpected message at once when one matches.
    ///
    /// # Errors
    /// As [`post`](Self::post); [`Error::Unsupported`] without [`Capabilities::tagged`].
    pub fn post_recv_tagged(
        &mut self,
        buf: Buf,
        tag: u64,
        mask: u64,
        wr_id: u64,
    ) -> Result<Token, PostError> {
        if let Err(error) = self.need(self.caps.tagged, "tagged messages") {
            return Err(PostError { error, buf });
        }
        self.post_with(OpDesc::Recv, buf, wr_id, tag, mask, None)
    }

    /// [`post`](Self::post) of a write that notifies the target with `imm`.
    ///
    /// # Errors
    /// As [`post`](Self::post); [`Error::Unsupported`] without [`Capabilities::write_imm`].
    pub fn post_write_imm(
        &mut self,
        buf: Buf,
        key: RemoteKey,
        off: u64,
        imm: u32,
        wr_id: u64,
    ) -> Result<Token, PostError> {
        if let Err(error) = self.need(self.caps.write_imm, "write with immediate") {
            return Err(PostError { error, buf });
        }
        self.post_with(OpDesc::Write { key, off }, buf, wr_id, 0, !0, Some(imm))
    }

    /// A flush that has nothing to wait for (host memory; transports where the CPU moves
    /// the bytes): it completes at once ([`OpKind::Flush`], `len` = the buffer's).
    ///
    /// # Errors
    /// [`Error::Foreign`], [`Error::Disconnected`], [`Error::WouldBlock`] (table full).
    pub fn post_flush_done(&mut self, buf: Buf, wr_id: u64) -> Result<Token, PostError> {
        if let Err(error) = self.common(&buf) {
            return Err(PostError { error, buf });
        }
        let len = buf.len();
        let token = self.insert(OpDesc::Send, OpKind::Flush, buf, wr_id, 0, None)?;
        self.complete(token, Status::Success, len, 0);
        Ok(token)
    }

    /// Whether a send of `buf` passes a post's checks now with nothing queued ahead of it
    /// and a free slot: then a backend may put it on the wire before the bookkeeping
    /// ([`post_sent`](Self::post_sent)), so that the bookkeeping is not on the message's
    /// critical path.
    #[inline]
    pub fn can_send_now(&self, buf: &Buf) -> bool {
        self.submit.is_empty() && !self.free.is_empty() && self.passes_inline_checks(buf)
    }

    /// Records a send (tagged `tag`) that the backend already put on the wire in full,
    /// after [`can_send_now`](Self::can_send_now) said yes: it completes at once.
    ///
    /// # Errors
    /// Only when the table broke its own invariant (a free slot in use).
    #[inline]
    pub fn post_sent(&mut self, buf: Buf, wr_id: u64, tag: u64) -> Result<Token, PostError> {
        let len = buf.len();
        let token = self.insert(OpDesc::Send, OpKind::Send, buf, wr_id, tag, None)?;
        self.complete(token, Status::Success, len, 0);
        Ok(token)
    }

    /// A grouped receive: every part `(buf, tag, mask)` is matched as its own receive, in
    /// the order given; one [`OpKind::RecvGroup`] completion comes when all are filled.
    ///
    /// # Errors
    /// [`GroupPostError`] with every buffer back: [`Error::Unsupported`] without grouped
    /// receives, [`Error::InvalidArgument`] for no parts or more than
    /// [`Capabilities::max_group`], a part's own validation error, or backpressure.
    pub fn post_recv_group(
        &mut self,
        parts: Vec<(Buf, u64, u64)>,
        wr_id: u64,
    ) -> Result<Token, GroupPostError> {
        let fail = |error, parts: Vec<(Buf, u64, u64)>| GroupPostError {
            error,
            bufs: parts.into_iter().map(|(b, _, _)| b).collect(),
        };
        if let Err(e) = self.need(self.caps.max_group > 0, "grouped receives") {
            return Err(fail(e, parts));
        }
        if parts.is_empty() || parts.len() > self.caps.max_group {
            let e = Error::InvalidArgument(format!(
                "a grouped receive needs 1 to {} parts, not {}",
                self.caps.max_group,
                parts.len()
            ));
            return Err(fail(e, parts));
        }
        for (b, _, _) in &parts {
            if let Err(e) = self.validate(OpDesc::Recv, b) {
                return Err(fail(e, parts));
            }
        }
        if self.free.is_empty() {
            return Err(fail(Error::WouldBlock("in-flight table"), parts));
        }
        let n = parts.len();
        let mut it = parts.into_iter();
        let Some((first, tag0, mask0)) = it.next() else {
            return Err(fail(Error::InvalidArgument("no parts".into()), Vec::new()));
        };
        let mut matching = Vec::with_capacity(n);
        matching.push((tag0, mask0));
        let mut states = Vec::with_capacity(n);
        states.push(PartState::new(None));
        for (b, tag, mask) in it {
            matching.push((tag, mask));
            states.push(PartState::new(Some(b)));
        }
        let token = match self.insert(OpDesc::Recv, OpKind::RecvGroup, first, wr_id, 0, None) {
            Ok(t) => t,
            Err(e) => {
                let mut bufs = vec![e.buf];
                bufs.extend(states.into_iter().filter_map(|p| p.buf));
                return Err(GroupPostError {
                    error: e.error,
                    bufs,
                });
            }
        };
        if let Some(p) = self.get_mut(token) {
            p.parts = states;
            p.parts_left = n;
        }
        for (i, (tag, mask)) in matching.into_iter().enumerate() {
            self.enqueue_recv(
                RecvRef {
                    token,
                    part: i as u32,
                },
                tag,
                mask,
            );
        }
        Ok(token)
    }

    fn need(&self, have: bool, what: &'static str) -> Result<(), Error> {
        if let Some((_, why)) = &self.failed {
            return Err(Error::Disconnected(why.clone()));
        }
        if have {
            Ok(())
        } else {
            Err(Error::Unsupported {
                transport: self.kind,
                what,
            })
        }
    }

    #[inline(always)]
    fn post_with(
        &mut self,
        desc: OpDesc,
        buf: Buf,
        wr_id: u64,
        tag: u64,
        mask: u64,
        imm: Option<u32>,
    ) -> Result<Token, PostError> {
        if let Err(error) = self.validate(desc, &buf) {
            return Err(PostError { error, buf });
        }
        let kind = match (desc, imm) {
            (OpDesc::Write { .. }, Some(_)) => OpKind::WriteImm,
            _ => desc.kind(),
        };
        let send_tag = if matches!(desc, OpDesc::Send) { tag } else { 0 };
        let token = self.insert(desc, kind, buf, wr_id, send_tag, imm)?;
        if matches!(desc, OpDesc::Recv) {
            self.enqueue_recv(RecvRef { token, part: 0 }, tag, mask);
        } else {
            // Capacity equals the slot count, so this never reallocates.
            self.submit.push_back(token);
        }
        Ok(token)
    }

    /// Takes a slot for an operation that already passed validation.
    #[inline(always)]
    fn insert(
        &mut self,
        desc: OpDesc,
        kind: OpKind,
        buf: Buf,
        wr_id: u64,
        tag: u64,
        imm: Option<u32>,
    ) -> Result<Token, PostError> {
        let Some(idx) = self.free.pop() else {
            return Err(PostError {
                error: Error::WouldBlock("in-flight table"),
                buf,
            });
        };
        let slot = &mut self.slots[idx as usize];
        let token = Token::new(idx, slot.gen);
        // A free slot holds nothing (`take_ready` took its operation before freeing it).
        // Checked, so that the store below has no old value to drop.
        if slot.op.is_some() {
            self.free.push(idx);
            return Err(PostError {
                error: Error::Protocol("in-flight table: a free slot in use".into()),
                buf,
            });
        }
        slot.op.get_or_insert_with(|| Pending {
            wr_id,
            desc,
            buf,
            progress: 0,
            tag,
            imm,
            kind,
            status: Status::Success,
            len: 0,
            value: 0,
            done: false,
            awaiting: false,
            parts: Vec::new(),
            parts_left: 0,
        });
        Ok(token)
    }

    /// A receive (part) starts matching: the oldest queued unexpected message that matches
    /// is its (now, or when its last byte arrives); else it waits in post order.
    #[inline]
    fn enqueue_recv(&mut self, at: RecvRef, tag: u64, mask: u64) {
        if !self.unexpected.is_empty() {
            self.enqueue_recv_unexpected(at, tag, mask);
            return;
        }
        // Capacity equals the slot count; only grouped receives (which allocate anyway)
        // can make it grow.
        self.recv.push_back(Posted { at, tag, mask });
    }

    /// [`enqueue_recv`](Self::enqueue_recv) while unexpected messages wait.
    #[inline(never)]
    fn enqueue_recv_unexpected(&mut self, at: RecvRef, tag: u64, mask: u64) {
        let hit = self
            .unexpected
            .iter()
            .position(|u| u.bound.is_none() && tag_matches(u.tag, tag, mask));
        let Some(i) = hit else {
            self.recv.push_back(Posted { at, tag, mask });
            return;
        };
        if self.unexpected[i].complete {
            if let Some(u) = self.unexpected.remove(i) {
                self.unexpected_bytes -= u.data.len();
                self.deliver(&u, at);
            }
        } else {
            self.unexpected[i].bound = Some(at);
        }
    }

    /// Hands a queued unexpected message to the receive `at`.
    fn deliver(&mut self, u: &Unexpected, at: RecvRef) {
        let Some(buf) = self.recv_buf(at) else { return };
        if u.data.len() > buf.len() {
            self.complete_recv(at, Status::MessageTooLong, u.len, u.tag, u.imm);
            return;
        }
        let status = match buf.copy_from(&u.data) {
            Ok(()) => Status::Success,
            Err(_) => Status::ProtocolError,
        };
        self.complete_recv(at, status, u.len, u.tag, u.imm);
    }

    /// The oldest posted receive (part) that a message tagged `tag` matches, taken off
    /// the receive queue; `None` when none matches (the message is unexpected).
    pub fn match_message(&mut self, tag: u64) -> Option<RecvRef> {
        // The common case (in-order traffic, plain receives): the oldest receive takes it.
        let front = self.recv.front()?;
        if tag_matches(tag, front.tag, front.mask) {
            return self.recv.pop_front().map(|p| p.at);
        }
        let i = self
            .recv
            .iter()
            .position(|p| tag_matches(tag, p.tag, p.mask))?;
        self.recv.remove(i).map(|p| p.at)
    }

    /// Whether any receive is posted and waiting for a message.
    pub fn has_posted_recv(&self) -> bool {
        !self.recv.is_empty()
    }

    /// The buffer of the live receive (part) `at`.
    pub fn recv_buf(&self, at: RecvRef) -> Option<&Buf> {
        let p = self.get(at.token)?;
        if at.part == 0 {
            return Some(&p.buf);
        }
        p.parts
            .get(at.part as usize)
            .filter(|s| !s.done)
            .and_then(|s| s.buf.as_ref())
    }

    /// Finishes the receive (part) `at` with a message of `len` bytes tagged `tag` (and
    /// the immediate of a write-imm notification). A grouped receive completes when its
    /// last part does. Returns `false` for a receive that is not live.
    pub fn complete_recv(
        &mut self,
        at: RecvRef,
        status: Status,
        len: usize,
        tag: u64,
        imm: Option<u32>,
    ) -> bool {
        let Some(p) = self.get_mut(at.token) else {
            return false;
        };
        if p.parts.is_empty() {
            if at.part != 0 {
                return false;
            }
            p.tag = tag;
            p.imm = imm;
            return self.complete(at.token, status, len, 0);
        }
        let Some(s) = p.parts.get_mut(at.part as usize) else {
            return false;
        };
        if s.done {
            return false;
        }
        s.done = true;
        s.len = len;
        s.tag = tag;
        s.imm = imm;
        s.status = status;
        p.parts_left -= 1;
        if p.parts_left > 0 {
            return true;
        }
        let st = p
            .parts
            .iter()
            .map(|s| s.status)
            .find(|s| *s != Status::Success)
            .unwrap_or(Status::Success);
        let total = p.parts.iter().map(|s| s.len).sum();
        self.complete(at.token, st, total, 0)
    }

    /// [`complete_recv`](Self::complete_recv), written straight into the sink's next
    /// completion (and the slot freed) when it is a plain receive, the sink has room and
    /// nothing waits in the ready queue (completions are handed out in the order they
    /// finished); otherwise as `complete_recv`. Returns `false` for a receive that is not
    /// live.
    #[inline]
    pub fn complete_recv_into(
        &mut self,
        at: RecvRef,
        status: Status,
        len: usize,
        tag: u64,
        imm: Option<u32>,
        sink: &mut Sink<'_>,
    ) -> bool {
        let idx = at.token.idx();
        if at.part == 0 && self.ready.is_empty() {
            if let Some(c) = sink.out.get_mut(*sink.n) {
                let plain = self.slots.get_mut(idx).and_then(|slot| {
                    (slot.gen == at.token.gen())
                        .then_some(slot.op.as_mut())
                        .flatten()
                        .filter(|p| !p.done && p.parts.is_empty())
                });
                if let Some(p) = plain {
                    p.tag = tag;
                    p.imm = imm;
                    self.retire(idx, c, status, len, 0);
                    *sink.n += 1;
                    return true;
                }
            }
        }
        self.complete_recv(at, status, len, tag, imm)
    }

    /// Whether the unexpected queue has room for one more message of `bytes` payload
    /// bytes.
    pub fn can_stash(&self, bytes: usize) -> bool {
        self.unexpected.len() < self.caps.unexpected_messages
            && bytes
                <= self
                    .caps
                    .unexpected_bytes
                    .saturating_sub(self.unexpected_bytes)
            && !matches!(self.unexpected.back(), Some(u) if !u.complete)
    }

    /// Queues an unexpected message (tag, immediate, the length its receive will report,
    /// `bytes` payload bytes to come) and returns where its payload goes: `bytes`
    /// writable bytes, valid until [`stash_end`](Self::stash_end) (the queue never drops
    /// an entry being filled). `None` when the queue is full ([`can_stash`](Self::can_stash)
    /// is false): leave the message on the wire.
    pub fn stash_begin(
        &mut self,
        tag: u64,
        imm: Option<u32>,
        len: usize,
        bytes: usize,
    ) -> Option<*mut u8> {
        if !self.can_stash(bytes) {
            return None;
        }
        self.unexpected_bytes += bytes;
        self.unexpected.push_back(Unexpected {
            tag,
            imm,
            len,
            data: vec![0u8; bytes],
            complete: false,
            bound: None,
        });
        self.unexpected.back_mut().map(|u| u.data.as_mut_ptr())
    }

    /// The message begun by [`stash_begin`](Self::stash_begin) arrived in full: it
    /// completes the receive that matched it meanwhile, or waits for one.
    pub fn stash_end(&mut self) {
        let Some(u) = self.unexpected.back_mut() else {
            return;
        };
        if u.complete {
            return;
        }
        u.complete = true;
        if let Some(at) = u.bound {
            if let Some(u) = self.unexpected.pop_back() {
                self.unexpected_bytes -= u.data.len();
                self.deliver(&u, at);
            }
        }
    }

    /// Where the payload of the unexpected message begun by
    /// [`stash_begin`](Self::stash_begin) goes (as it returned), while it is being filled.
    pub fn stash_tail(&mut self) -> Option<*mut u8> {
        self.unexpected
            .back_mut()
            .filter(|u| !u.complete)
            .map(|u| u.data.as_mut_ptr())
    }

    /// Copies `src` into the payload of the unexpected message being filled, at `at`
    /// (the safe form of writing through [`stash_tail`](Self::stash_tail)). Returns
    /// `false` when no message is being filled or the range passes its end.
    pub fn stash_fill(&mut self, at: usize, src: &[u8]) -> bool {
        let Some(u) = self.unexpected.back_mut().filter(|u| !u.complete) else {
            return false;
        };
        match at
            .checked_add(src.len())
            .and_then(|end| u.data.get_mut(at..end))
        {
            Some(d) => {
                d.copy_from_slice(src);
                true
            }
            None => false,
        }
    }

    /// Messages in the unexpected queue.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }

    /// Payload bytes in the unexpected queue.
    pub fn unexpected_bytes(&self) -> usize {
        self.unexpected_bytes
    }

    fn common(&self, buf: &Buf) -> Result<(), Error> {
        if let Some((_, why)) = &self.failed {
            return Err(Error::Disconnected(why.clone()));
        }
        if buf.region().inner.owner != self.owner {
            return Err(Error::Foreign("buffer registered in another domain"));
        }
        Ok(())
    }

    /// Checks a post. Sends and receives (the hot path) take the inline checks; one-sided
    /// operations go out of line.
    #[inline]
    fn validate(&self, desc: OpDesc, buf: &Buf) -> Result<(), Error> {
        if matches!(desc, OpDesc::Send | OpDesc::Recv) && self.passes_inline_checks(buf) {
            return Ok(());
        }
        self.validate_slow(&desc, buf)
    }

    /// A send's or receive's checks when they pass: connection up, buffer of this
    /// domain, length allowed ([`validate_slow`](Self::validate_slow) says which failed).
    #[inline]
    fn passes_inline_checks(&self, buf: &Buf) -> bool {
        self.failed.is_none()
            && buf.region().inner.owner == self.owner
            && buf.len() <= self.caps.max_message
    }

    #[inline(never)]
    fn validate_slow(&self, desc: &OpDesc, buf: &Buf) -> Result<(), Error> {
        self.common(buf)?;
        let max = self.caps.max_message;
        let remote = |key: &RemoteKey, off: u64, len: usize, need: Access, what| {
            if !self.caps.one_sided {
                return Err(Error::Unsupported {
                    transport: self.kind,
                    what: "one-sided operations",
                });
            }
            if key.transport != self.kind {
                return Err(Error::Foreign("remote key of another transport"));
            }
            if !key.access().contains(need) {
                return Err(Error::AccessDenied(what));
            }
            check_range(off, len as u64, key.len)
        };
        match desc {
            OpDesc::Send | OpDesc::Recv => {
                if buf.len() > max {
                    return Err(Error::MessageTooLarge {
                        len: buf.len(),
                        max,
                    });
                }
            }
            OpDesc::Write { key, off } => {
                if buf.len() > max {
                    return Err(Error::MessageTooLarge {
                        len: buf.len(),
                        max,
                    });
                }
                remote(key, *off, buf.len(), Access::REMOTE_WRITE, "REMOTE_WRITE")?
            }
            OpDesc::Read { key, off } => {
                if buf.len() > max {
                    return Err(Error::MessageTooLarge {
                        len: buf.len(),
                        max,
                    });
                }
                remote(key, *off, buf.len(), Access::REMOTE_READ, "REMOTE_READ")?
            }
            OpDesc::Atomic { key, off, .. } => {
                if !self.caps.atomics {
                    return Err(Error::Unsupported {
                        transport: self.kind,
                        what: "atomics",
                    });
                }
                if buf.len() != 8 || off % 8 != 0 {
                    return Err(Error::Unaligned);
                }
                remote(key, *off, 8, Access::REMOTE_ATOMIC, "REMOTE_ATOMIC")?
            }
        }
        Ok(())
    }

    /// The oldest queued send / one-sided operation not yet taken by the backend.
    pub fn submit_front(&self) -> Option<Token> {
        self.submit.front().copied()
    }
    /// The `i`-th queued send / one-sided operation (0: the front), for a backend that
    /// takes several at once.
    pub fn submit_get(&self, i: usize) -> Option<Token> {
        self.submit.get(i).copied()
    }
    /// Number of queued sends / one-sided operations.
    pub fn submit_len(&self) -> usize {
        self.submit.len()
    }
    /// Removes the front of the submission queue (the backend has taken it).
    pub fn submit_pop(&mut self) -> Option<Token> {
        self.submit.pop_front()
    }
    /// The oldest posted receive not yet matched (backends without tags: every receive
    /// is a plain one).
    pub fn recv_front(&self) -> Option<Token> {
        self.recv.front().map(|p| p.at.token)
    }
    /// The first `n` posted receives (in post order), for a backend that takes several at
    /// once.
    pub fn recv_first(&self, n: usize) -> impl Iterator<Item = Token> + '_ {
        self.recv.iter().take(n).map(|p| p.at.token)
    }
    /// Removes the first `n` posted receives (the backend took them).
    pub fn recv_pop_n(&mut self, n: usize) {
        self.recv.drain(..n.min(self.recv.len()));
    }
    /// Number of posted receives waiting.
    pub fn recv_len(&self) -> usize {
        self.recv.len()
    }
    /// Removes the front receive (the backend matched it to a message).
    pub fn recv_pop(&mut self) -> Option<Token> {
        self.recv.pop_front().map(|p| p.at.token)
    }
    /// Whether sends / one-sided ops wait for the backend.
    pub fn has_submissions(&self) -> bool {
        !self.submit.is_empty()
    }

    /// The live, unfinished operation behind `token`.
    pub fn get(&self, token: Token) -> Option<&Pending> {
        let slot = self.slots.get(token.idx())?;
        if slot.gen != token.gen() {
            return None;
        }
        slot.op.as_ref().filter(|p| !p.done)
    }

    /// Mutable access to the live, unfinished operation behind `token`.
    pub fn get_mut(&mut self, token: Token) -> Option<&mut Pending> {
        let slot = self.slots.get_mut(token.idx())?;
        if slot.gen != token.gen() {
            return None;
        }
        slot.op.as_mut().filter(|p| !p.done)
    }

    /// [`get`](Self::get) as a typed error: a backend's token that does not name a live
    /// operation is a [`Error::Protocol`] failing the connection, never a panic.
    ///
    /// # Errors
    /// [`Error::Protocol`] naming `what` for an unknown, stale or finished token.
    #[inline]
    pub fn live(&self, token: Token, what: &'static str) -> Result<&Pending, Error> {
        match self.get(token) {
            Some(p) => Ok(p),
            None => Err(not_live(what)),
        }
    }

    /// [`get_mut`](Self::get_mut) as a typed error (see [`live`](Self::live)).
    ///
    /// # Errors
    /// [`Error::Protocol`] naming `what` for an unknown, stale or finished token.
    #[inline]
    pub fn live_mut(&mut self, token: Token, what: &'static str) -> Result<&mut Pending, Error> {
        match self.get_mut(token) {
            Some(p) => Ok(p),
            None => Err(not_live(what)),
        }
    }

    /// Records that the operation behind `token` was sent to the peer in full and now
    /// waits for its response. Only such operations can be matched by a peer's response
    /// ([`awaiting`](Self::awaiting)): a response naming a queued or half-sent operation
    /// is a protocol error, never a completion. Returns `false` for an unknown, stale or
    /// finished token.
    pub fn mark_awaiting(&mut self, token: Token) -> bool {
        match self.get_mut(token) {
            Some(p) => {
                p.awaiting = true;
                true
            }
            None => false,
        }
    }

    /// The live operation behind `token` if it is waiting for the peer's response (see
    /// [`mark_awaiting`](Self::mark_awaiting)); `None` for anything a peer must not answer.
    pub fn awaiting(&self, token: Token) -> Option<&Pending> {
        self.get(token).filter(|p| p.awaiting)
    }

    /// Finishes the operation behind `token`. Returns `false` for an unknown, stale or
    /// already finished token (a peer's response that matches nothing: a protocol error).
    pub fn complete(&mut self, token: Token, status: Status, len: usize, value: u64) -> bool {
        let Some(p) = self.get_mut(token) else {
            return false;
        };
        p.done = true;
        p.status = status;
        p.len = len;
        p.value = value;
        self.ready.push_back(token);
        true
    }

    /// Moves finished operations into `out` (in completion order); returns how many.
    #[inline]
    pub fn take(&mut self, out: &mut [Completion]) -> usize {
        if self.ready.is_empty() {
            return 0;
        }
        self.take_ready(out)
    }

    #[inline(never)]
    fn take_ready(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(t) = self.ready.pop_front() else {
                break;
            };
            let idx = t.idx();
            let Some((status, len, value)) = self.slots[idx]
                .op
                .as_ref()
                .map(|p| (p.status, p.len, p.value))
            else {
                continue;
            };
            self.retire(idx, &mut out[n], status, len, value);
            n += 1;
        }
        n
    }

    /// Moves the operation in slot `idx` out into `c` with the given result and frees the
    /// slot (its generation moves on: the token is stale from now on). Does nothing for an
    /// empty slot.
    #[inline(always)]
    fn retire(&mut self, idx: usize, c: &mut Completion, status: Status, len: usize, value: u64) {
        let slot = &mut self.slots[idx];
        // Only the fields the completion needs leave the slot (not the whole `Pending`).
        let Some(Pending {
            wr_id,
            buf,
            tag,
            imm,
            kind,
            parts,
            ..
        }) = slot.op.take()
        else {
            return;
        };
        slot.gen = slot.gen.wrapping_add(1) & ((1 << GEN_BITS) - 1);
        self.free.push(idx as u32);
        // Written field by field over the caller's old completion (whatever it still
        // holds is dropped here, as an assignment of the whole would).
        c.wr_id = wr_id;
        c.op = kind;
        c.status = status;
        c.len = len;
        c.value = value;
        c.tag = tag;
        c.imm = imm;
        if parts.capacity() == 0 {
            // (An operation that is not a grouped receive has no parts and no allocation:
            // nothing to drop, and no call to the vector's out-of-line drop.)
            std::mem::forget(parts);
            c.buf = Some(buf);
            if !c.parts.is_empty() {
                c.parts = Vec::new();
            }
        } else {
            c.buf = None;
            c.parts = group_parts(buf, status, parts);
        }
    }

    /// Finishes the live operation behind `token` (one lookup), for a backend whose
    /// completion source says only which operation ended and how: `len_value` gives the
    /// completion's length and value from the operation, and a receive takes `imm`.
    ///
    /// With `into`, the completion is written there at once and the slot freed (what
    /// [`complete`](Self::complete) and then [`take`](Self::take) do, without the ready
    /// queue). Only when nothing waits in the ready queue: completions are handed out in
    /// the order they finished, so the caller checks [`ready_len`](Self::ready_len) is 0
    /// (else this queues it, as without `into`).
    ///
    /// A grouped receive is not finished here ([`Finish::Grouped`]: one part filled, use
    /// [`complete_recv`](Self::complete_recv)).
    #[inline(always)]
    pub fn finish(
        &mut self,
        token: Token,
        status: Status,
        imm: Option<u32>,
        len_value: impl FnOnce(&Pending) -> (usize, u64),
        into: Option<&mut Completion>,
    ) -> Finish {
        let idx = token.idx();
        let Some(slot) = self.slots.get_mut(idx) else {
            return Finish::Stale;
        };
        if slot.gen != token.gen() {
            return Finish::Stale;
        }
        let Some(p) = slot.op.as_mut().filter(|p| !p.done) else {
            return Finish::Stale;
        };
        if !p.parts.is_empty() {
            return Finish::Grouped;
        }
        let (len, value) = len_value(p);
        if p.desc == OpDesc::Recv {
            p.imm = imm;
        }
        match into {
            Some(c) if self.ready.is_empty() => {
                self.retire(idx, c, status, len, value);
                Finish::Taken
            }
            _ => {
                p.done = true;
                p.status = status;
                p.len = len;
                p.value = value;
                self.ready.push_back(token);
                Finish::Queued
            }
        }
    }

    /// Finished operations waiting for `take`.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }

    /// Operations posted and not yet taken.
    pub fn in_flight(&self) -> usize {
        // (Every slot is free or holds an operation: no counter to keep per post.)
        self.slots.len() - self.free.len()
    }

    /// The failure recorded by [`fail_all`](Self::fail_all), if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_ref().map(|(_, s)| s.as_str())
    }

    /// The connection is dead: every unfinished operation completes with `status`, in
    /// post order for queued ones; later posts fail with [`Error::Disconnected`].
    pub fn fail_all(&mut self, status: Status, why: impl Into<String>) {
        if self.failed.is_none() {
            self.failed = Some((status, why.into()));
        }
        let mut order: Vec<Token> = self.submit.drain(..).collect();
        order.extend(self.recv.drain(..).map(|p| p.at.token));
        for u in &mut self.unexpected {
            u.bound = None;
        }
        for t in order {
            self.complete(t, status, 0, 0);
        }
        for i in 0..self.slots.len() {
            let gen = self.slots[i].gen;
            self.complete(Token::new(i as u32, gen), status, 0, 0);
        }
    }

    /// Records a region registered per connection (backends without a domain call this
    /// from `register`; their ids are not reused).
    pub fn add_region(&mut self, region: Region) {
        let id = region.id() as usize;
        if self.regions.len() <= id {
            self.regions.resize(id + 1, None);
        }
        self.regions[id] = Some(region);
    }

    /// The next free region id.
    pub fn next_region_id(&self) -> u32 {
        self.regions.len() as u32
    }

    /// Target-side check of a peer's access to one of our regions: the id exists, the key
    /// matches, the access was granted and the range lies inside.
    ///
    /// # Errors
    /// [`Status::RemoteAccess`] for any failure (the peer gets an error completion).
    pub fn check_target(
        &self,
        region: u32,
        key: u64,
        off: u64,
        len: u64,
        need: Access,
    ) -> Result<&Region, Status> {
        let r = self
            .regions
            .get(region as usize)
            .and_then(|r| r.as_ref())
            .ok_or(Status::RemoteAccess)?;
        if r.inner.key != key || !r.access().contains(need) {
            return Err(Status::RemoteAccess);
        }
        check_range(off, len, r.len() as u64).map_err(|_| Status::RemoteAccess)?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{MemoryKinds, MessageOrdering};

    fn caps(n: usize) -> Capabilities {
        Capabilities {
            ordering: MessageOrdering::InOrder,
            one_sided: true,
            atomics: true,
            max_message: 1 << 20,
            max_in_flight: n,
            inline_size: 0,
            memory_kinds: MemoryKinds::HOST,
            tagged: true,
            max_group: 4,
            write_imm: true,
            unexpected_messages: 2,
            unexpected_bytes: 64,
            too_long_kills_connection: false,
            remote_error_kills_connection: false,
            remote_window: false,
        }
    }

    fn drain(t: &mut Tracker) -> Vec<Completion> {
        let mut out: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
        let n = t.take(&mut out);
        out.truncate(n);
        out
    }

    /// A message of `data` tagged `tag` arrives: into the receive it matches, else into
    /// the unexpected queue when receives are posted; `false` = it waits on the wire.
    fn arrive(t: &mut Tracker, tag: u64, data: &[u8]) -> bool {
        if let Some(at) = t.match_message(tag) {
            let buf = t.recv_buf(at).unwrap();
            if data.len() > buf.len() {
                t.complete_recv(at, Status::MessageTooLong, data.len(), tag, None);
            } else {
                buf.copy_from(data).unwrap();
                t.complete_recv(at, Status::Success, data.len(), tag, None);
            }
            return true;
        }
        if !t.has_posted_recv() {
            return false;
        }
        if t.stash_begin(tag, None, data.len(), data.len()).is_none() {
            return false;
        }
        assert!(t.stash_fill(0, data));
        t.stash_end();
        true
    }

    #[test]
    fn tags_match_with_masks_in_post_order() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 256, Access::empty());
        // Receive A: exactly tag 0x12; receive B: any tag whose low byte is 0x34.
        t.post_recv_tagged(r.slice(0, 16).unwrap(), 0x12, !0, 1)
            .unwrap();
        t.post_recv_tagged(r.slice(16, 16).unwrap(), 0x34, 0xff, 2)
            .unwrap();
        assert!(arrive(&mut t, 0x5534, b"bee"));
        assert!(arrive(&mut t, 0x12, b"ay"));
        let c = drain(&mut t);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].wr_id, c[0].tag, c[0].len), (2, 0x5534, 3));
        assert_eq!((c[1].wr_id, c[1].tag, c[1].len), (1, 0x12, 2));
        assert_eq!(c[0].buf.as_ref().unwrap().to_vec()[..3], *b"bee");
        // Two receives that both match: the older takes the message.
        t.post_recv_tagged(r.slice(0, 16).unwrap(), 0, 0, 3)
            .unwrap();
        t.post_recv_tagged(r.slice(16, 16).unwrap(), 0, 0, 4)
            .unwrap();
        assert!(arrive(&mut t, 9, b"x"));
        assert_eq!(drain(&mut t)[0].wr_id, 3);
    }

    #[test]
    fn unexpected_messages_are_queued_bounded_and_taken_in_arrival_order() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 256, Access::empty());
        // Nothing posted: the message waits on the wire.
        assert!(!arrive(&mut t, 1, b"one"));
        // A receive for tag 3 is posted: tags 1 and 2 are queued so 3 can pass them.
        t.post_recv_tagged(r.slice(0, 16).unwrap(), 3, !0, 30)
            .unwrap();
        assert!(arrive(&mut t, 1, b"one"));
        assert!(arrive(&mut t, 1, b"uno"));
        assert_eq!(t.unexpected_len(), 2);
        // The queue holds 2 messages: a third waits on the wire.
        assert!(!arrive(&mut t, 2, b"two"));
        assert!(!t.can_stash(0));
        // Taking one frees room; the oldest of equal tags goes first.
        t.post_recv_tagged(r.slice(16, 16).unwrap(), 1, !0, 10)
            .unwrap();
        let c = drain(&mut t);
        assert_eq!((c[0].wr_id, c[0].len), (10, 3));
        assert_eq!(c[0].buf.as_ref().unwrap().to_vec()[..3], *b"one");
        assert!(arrive(&mut t, 2, b"two"));
        assert!(arrive(&mut t, 3, b"three"));
        assert_eq!(drain(&mut t)[0].wr_id, 30);
        // The byte bound: 64 bytes in all.
        assert!(!t.can_stash(64 - t.unexpected_bytes() + 1));
        // A receive too small for a queued message fails alone.
        t.post_recv_tagged(r.slice(32, 2).unwrap(), 2, !0, 20)
            .unwrap();
        let c = drain(&mut t);
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].len),
            (20, Status::MessageTooLong, 3)
        );
        assert_eq!(t.unexpected_len(), 1);
    }

    #[test]
    fn a_receive_posted_while_its_message_is_filling_waits_for_the_last_byte() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 256, Access::empty());
        t.post_recv_tagged(r.slice(0, 8).unwrap(), 9, !0, 1)
            .unwrap();
        t.stash_begin(5, None, 4, 4).unwrap();
        assert!(t.stash_fill(0, b"ab"));
        assert!(!t.stash_fill(3, b"ab"), "past the end");
        t.post_recv_tagged(r.slice(8, 8).unwrap(), 5, !0, 2)
            .unwrap();
        assert!(drain(&mut t).is_empty(), "completed before its bytes");
        assert!(t.stash_tail().is_some());
        assert!(t.stash_fill(2, b"cd"));
        t.stash_end();
        assert!(t.stash_tail().is_none());
        let c = drain(&mut t);
        assert_eq!((c[0].wr_id, c[0].tag, c[0].len), (2, 5, 4));
        assert_eq!(c[0].buf.as_ref().unwrap().to_vec()[..4], *b"abcd");
    }

    #[test]
    fn grouped_receive_completes_once_with_every_part() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 256, Access::empty());
        let parts = vec![
            (r.slice(0, 8).unwrap(), 1, !0),
            (r.slice(8, 8).unwrap(), 2, !0),
            (r.slice(16, 8).unwrap(), 3, !0),
        ];
        t.post_recv_group(parts, 77).unwrap();
        assert_eq!(t.in_flight(), 1, "one slot for the group");
        assert!(arrive(&mut t, 3, b"ccc"));
        assert!(arrive(&mut t, 1, b"a"));
        assert!(drain(&mut t).is_empty(), "completed with a part missing");
        assert!(arrive(&mut t, 2, b"bb"));
        let c = drain(&mut t);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].op, c[0].wr_id, c[0].len), (OpKind::RecvGroup, 77, 6));
        assert!(c[0].buf.is_none());
        let lens: Vec<_> = c[0].parts.iter().map(|p| (p.tag, p.len)).collect();
        assert_eq!(lens, [(1, 1), (2, 2), (3, 3)]);
        assert_eq!(c[0].parts[2].buf.to_vec()[..3], *b"ccc");
        // Refusals hand every buffer back.
        let e = t.post_recv_group(Vec::new(), 1).unwrap_err();
        assert!(matches!(e.error, Error::InvalidArgument(_)));
        let five = (0..5).map(|i| (r.slice(i * 8, 8).unwrap(), 0, 0)).collect();
        let e = t.post_recv_group(five, 1).unwrap_err();
        assert_eq!(e.bufs.len(), 5);
        // A failure completes the group with its parts' buffers.
        let parts = vec![
            (r.slice(0, 8).unwrap(), 1, !0),
            (r.slice(8, 8).unwrap(), 2, !0),
        ];
        t.post_recv_group(parts, 78).unwrap();
        assert!(arrive(&mut t, 1, b"a"));
        t.fail_all(Status::PeerGone, "test");
        let c = drain(&mut t);
        assert_eq!(c[0].status, Status::PeerGone);
        assert_eq!(c[0].parts.len(), 2);
        assert_eq!(c[0].parts[0].status, Status::Success);
        assert_eq!(c[0].parts[1].status, Status::PeerGone);
    }

    /// `take` writes a completion field by field over the caller's old one: whatever the old
    /// one held (a group's parts, a buffer) must not show through in the new one.
    #[test]
    fn a_reused_completion_shows_nothing_of_the_old_one() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 256, Access::empty());
        let mut out = [Completion::default()];
        let group = |t: &mut Tracker, id| {
            let parts = vec![
                (r.slice(0, 8).unwrap(), 1, !0),
                (r.slice(8, 8).unwrap(), 2, !0),
            ];
            t.post_recv_group(parts, id).unwrap();
            assert!(arrive(t, 1, b"a") && arrive(t, 2, b"bb"));
        };
        group(&mut t, 10);
        assert_eq!(t.take(&mut out), 1);
        assert_eq!((out[0].op, out[0].parts.len()), (OpKind::RecvGroup, 2));
        // A plain receive into the same completion: its buffer, no parts.
        t.post(OpDesc::Recv, r.slice(32, 16).unwrap(), 11).unwrap();
        assert!(arrive(&mut t, 7, b"plain"));
        assert_eq!(t.take(&mut out), 1);
        let c = &out[0];
        assert_eq!((c.op, c.wr_id, c.len, c.tag), (OpKind::Recv, 11, 5, 7));
        assert!(
            c.parts.is_empty(),
            "a group's parts left in a plain completion"
        );
        assert_eq!(
            c.buf.as_ref().map(|b| (b.offset(), b.len())),
            Some((32, 16))
        );
        // And a group over a completion that still holds a buffer: no buffer, its parts.
        group(&mut t, 12);
        assert_eq!(t.take(&mut out), 1);
        assert!(
            out[0].buf.is_none(),
            "a plain receive's buffer left in a group's completion"
        );
        assert_eq!((out[0].wr_id, out[0].parts.len()), (12, 2));
        assert_eq!(out[0].parts[1].buf.to_vec()[..2], *b"bb");
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn untagged_capabilities_refuse_tags_groups_and_write_imm() {
        let mut c = caps(4);
        c.tagged = false;
        c.max_group = 0;
        c.write_imm = false;
        let mut t = Tracker::new(1, TransportKind::Tcp, c);
        let r = region(&mut t, 64, Access::REMOTE_WRITE);
        let key = r.remote_key().unwrap();
        let un = |e: &Error| matches!(e, Error::Unsupported { .. });
        assert!(un(&t
            .post_send_tagged(r.slice(0, 8).unwrap(), 1, 1)
            .unwrap_err()
            .error));
        assert!(un(&t
            .post_recv_tagged(r.slice(0, 8).unwrap(), 1, 1, 1)
            .unwrap_err()
            .error));
        assert!(un(&t
            .post_recv_group(vec![(r.slice(0, 8).unwrap(), 0, 0)], 1)
            .unwrap_err()
            .error));
        assert!(un(&t
            .post_write_imm(r.slice(0, 8).unwrap(), key, 0, 5, 1)
            .unwrap_err()
            .error));
        // Flush of host memory completes at once.
        t.post_flush_done(r.slice(0, 8).unwrap(), 9).unwrap();
        let c = drain(&mut t);
        assert_eq!((c[0].op, c[0].wr_id, c[0].len), (OpKind::Flush, 9, 8));
        assert_eq!(t.in_flight(), 0);
    }

    fn region(t: &mut Tracker, len: usize, access: Access) -> Region {
        let r = Region::anonymous(
            t.next_region_id(),
            t.owner(),
            TransportKind::Tcp,
            access,
            len,
        )
        .unwrap();
        t.add_region(r.clone());
        r
    }

    #[test]
    fn finish_writes_straight_into_the_completion_only_behind_an_empty_ready_queue() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(8));
        let r = region(&mut t, 64, Access::empty());
        let s1 = t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 1).unwrap();
        let s2 = t.post(OpDesc::Send, r.slice(8, 8).unwrap(), 2).unwrap();
        let rv = t.post(OpDesc::Recv, r.slice(16, 16).unwrap(), 3).unwrap();
        let len = |p: &Pending| (p.buf.len(), 0);
        let mut c = Completion::default();
        // One finished the usual way waits in the ready queue: the next may not overtake
        // it, so it is queued behind it even when offered a completion.
        assert!(t.complete(s1, Status::Success, 8, 0));
        assert_eq!(
            t.finish(s2, Status::Success, None, len, Some(&mut c)),
            Finish::Queued
        );
        assert!(c.buf.is_none(), "nothing written");
        let got = drain(&mut t);
        assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2]);
        // Behind an empty queue: written at once, the slot freed, the token stale.
        assert_eq!(t.in_flight(), 1);
        let r9 = |_: &Pending| (9, 0);
        assert_eq!(
            t.finish(rv, Status::Success, Some(7), r9, Some(&mut c)),
            Finish::Taken
        );
        assert_eq!((c.wr_id, c.op, c.len, c.imm), (3, OpKind::Recv, 9, Some(7)));
        assert_eq!(
            c.buf.as_ref().map(|b| (b.offset(), b.len())),
            Some((16, 16))
        );
        assert_eq!(t.in_flight(), 0);
        assert_eq!(
            t.finish(rv, Status::Success, None, r9, Some(&mut c)),
            Finish::Stale
        );
        assert!(drain(&mut t).is_empty());
        // A grouped receive is left to `complete_recv`.
        let parts = vec![
            (r.slice(0, 8).unwrap(), 0, 0),
            (r.slice(8, 8).unwrap(), 0, 0),
        ];
        let g = t.post_recv_group(parts, 4).unwrap();
        assert_eq!(
            t.finish(g, Status::Success, None, r9, Some(&mut c)),
            Finish::Grouped
        );
        assert_eq!(t.in_flight(), 1);
    }

    #[test]
    fn complete_recv_into_writes_a_plain_receive_only_behind_an_empty_ready_queue() {
        let mut t = Tracker::new(1, TransportKind::Shm, caps(8));
        let r = region(&mut t, 64, Access::empty());
        let s1 = t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 1).unwrap();
        let r1 = t.post(OpDesc::Recv, r.slice(16, 16).unwrap(), 2).unwrap();
        let r2 = t.post(OpDesc::Recv, r.slice(32, 16).unwrap(), 3).unwrap();
        let at = |token| RecvRef { token, part: 0 };
        let mut out: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
        let mut n = 0;
        // A send finished first waits in the ready queue: the receive queues behind it.
        assert!(t.complete(s1, Status::Success, 8, 0));
        let mut sink = Sink::new(&mut out, &mut n);
        assert!(t.complete_recv_into(at(r1), Status::Success, 5, 9, None, &mut sink));
        assert_eq!(n, 0, "nothing written past the ready queue");
        let got = drain(&mut t);
        assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((got[1].len, got[1].tag), (5, 9));
        // Behind an empty queue: written into the sink, the slot freed, the token stale.
        let mut sink = Sink::new(&mut out, &mut n);
        assert!(t.complete_recv_into(at(r2), Status::Success, 7, 4, Some(6), &mut sink));
        assert_eq!(n, 1);
        let c = &out[0];
        assert_eq!(
            (c.wr_id, c.op, c.len, c.tag, c.imm),
            (3, OpKind::Recv, 7, 4, Some(6))
        );
        assert_eq!(
            c.buf.as_ref().map(|b| (b.offset(), b.len())),
            Some((32, 16))
        );
        assert_eq!(t.in_flight(), 0);
        let mut sink = Sink::new(&mut out, &mut n);
        assert!(!t.complete_recv_into(at(r2), Status::Success, 7, 4, None, &mut sink));
        assert_eq!(n, 1, "a stale receive writes nothing");
        // A full sink: queued as `complete_recv` does.
        let r3 = t.post(OpDesc::Recv, r.slice(48, 16).unwrap(), 5).unwrap();
        let mut full = 2;
        let mut sink = Sink::new(&mut out, &mut full);
        assert!(t.complete_recv_into(at(r3), Status::Success, 1, 0, None, &mut sink));
        assert_eq!(full, 2);
        assert_eq!(
            drain(&mut t).iter().map(|c| c.wr_id).collect::<Vec<_>>(),
            [5]
        );
        // A grouped receive's part goes through `complete_recv`: the group stays live.
        let parts = vec![
            (r.slice(0, 8).unwrap(), 0, 0),
            (r.slice(8, 8).unwrap(), 0, 0),
        ];
        let g = t.post_recv_group(parts, 4).unwrap();
        let mut n = 0;
        let mut sink = Sink::new(&mut out, &mut n);
        assert!(t.complete_recv_into(at(g), Status::Success, 8, 0, None, &mut sink));
        assert_eq!((n, t.in_flight()), (0, 1));
    }

    #[test]
    fn validation_refuses_and_hands_buffers_back() {
        let mut t = Tracker::new(7, TransportKind::Tcp, caps(4));
        let r = region(&mut t, 64, Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
        let key = r.remote_key().unwrap();
        // Out of bounds on the remote side.
        let e = t
            .post(OpDesc::Write { key, off: 60 }, r.slice(0, 8).unwrap(), 1)
            .unwrap_err();
        assert!(matches!(e.error, Error::OutOfBounds { .. }), "{e}");
        assert_eq!(e.buf.len(), 8);
        // No REMOTE_READ.
        let e = t
            .post(OpDesc::Read { key, off: 0 }, r.slice(0, 8).unwrap(), 1)
            .unwrap_err();
        assert!(matches!(e.error, Error::AccessDenied(_)));
        // Unaligned atomic.
        let op = AtomicOp::FetchAdd { add: 1 };
        let e = t
            .post(
                OpDesc::Atomic { key, off: 4, op },
                r.slice(0, 8).unwrap(),
                1,
            )
            .unwrap_err();
        assert!(matches!(e.error, Error::Unaligned));
        // Foreign buffer.
        let other = Region::anonymous(0, 99, TransportKind::Tcp, Access::empty(), 8).unwrap();
        let e = t.post(OpDesc::Send, other.full(), 1).unwrap_err();
        assert!(
            matches!(e.error, Error::Foreign(w) if w.contains("domain")),
            "{}",
            e.error
        );
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn a_remote_key_of_another_transport_is_refused() {
        let mut t = Tracker::new(7, TransportKind::Tcp, caps(4));
        let r = region(&mut t, 64, Access::REMOTE_WRITE | Access::REMOTE_READ);
        let good = r.remote_key().unwrap();
        for kind in [
            TransportKind::Shm,
            TransportKind::Verbs,
            TransportKind::CudaIpc,
        ] {
            let key = RemoteKey {
                transport: kind,
                ..good
            };
            for desc in [
                OpDesc::Write { key, off: 0 },
                OpDesc::Read { key, off: 0 },
                OpDesc::Atomic {
                    key,
                    off: 0,
                    op: AtomicOp::FetchAdd { add: 1 },
                },
            ] {
                let e = t.post(desc, r.slice(0, 8).unwrap(), 1).unwrap_err();
                assert!(
                    matches!(e.error, Error::Foreign(w) if w.contains("transport")),
                    "{kind} key accepted for {desc:?}: {}",
                    e.error
                );
            }
        }
        // The same key with its own transport passes.
        t.post(
            OpDesc::Write { key: good, off: 0 },
            r.slice(0, 8).unwrap(),
            1,
        )
        .unwrap();
        assert_eq!(t.in_flight(), 1);
    }

    #[test]
    fn generations_wrap_within_gen_bits_and_stale_tokens_stay_refused() {
        let mut t = Tracker::new(1, TransportKind::Shm, caps(1));
        let r = region(&mut t, 64, Access::empty());
        t.slots[0].gen = (1 << GEN_BITS) - 1;
        let old = t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 1).unwrap();
        assert_eq!(old.gen(), (1 << GEN_BITS) - 1);
        assert!(t.complete(old, Status::Success, 8, 0));
        let mut out = vec![Completion::default()];
        assert_eq!(t.take(&mut out), 1);
        let new = t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 2).unwrap();
        assert_eq!(new.gen(), 0, "the generation wraps at 2^GEN_BITS");
        assert_eq!(new.0 >> 32 >> GEN_BITS, 0);
        assert!(t.get(old).is_none(), "the old token names nothing now");
        assert!(t.get(new).is_some());
    }

    #[test]
    fn backpressure_and_stale_tokens() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(2));
        let r = region(&mut t, 64, Access::empty());
        let a = t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 10).unwrap();
        let _b = t.post(OpDesc::Recv, r.slice(8, 8).unwrap(), 11).unwrap();
        let e = t
            .post(OpDesc::Send, r.slice(16, 8).unwrap(), 12)
            .unwrap_err();
        assert!(e.is_would_block());
        assert!(t.complete(a, Status::Success, 8, 0));
        assert!(
            !t.complete(a, Status::Success, 8, 0),
            "double completion refused"
        );
        let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
        assert_eq!(t.take(&mut out), 1);
        assert_eq!(out[0].wr_id, 10);
        assert!(!t.complete(a, Status::Success, 8, 0), "stale token refused");
        assert!(!t.complete(Token(u64::MAX), Status::Success, 8, 0));
        t.post(OpDesc::Send, r.slice(16, 8).unwrap(), 12).unwrap();
    }

    #[test]
    fn only_operations_sent_in_full_accept_responses() {
        let mut t = Tracker::new(1, TransportKind::Tcp, caps(4));
        let r = region(&mut t, 64, Access::REMOTE_WRITE);
        let key = r.remote_key().unwrap();
        let w = t
            .post(OpDesc::Write { key, off: 0 }, r.slice(0, 8).unwrap(), 1)
            .unwrap();
        assert!(
            t.awaiting(w).is_none(),
            "a queued op must not be answerable"
        );
        assert!(t.awaiting(Token(u64::MAX)).is_none());
        assert!(t.live(Token(u64::MAX), "test").is_err());
        assert_eq!(t.submit_pop(), Some(w));
        assert!(t.mark_awaiting(w));
        assert!(t.awaiting(w).is_some());
        assert!(t.complete(w, Status::Success, 8, 0));
        assert!(t.awaiting(w).is_none(), "answered once only");
        assert!(!t.mark_awaiting(w));
    }

    /// Deterministic simulation: random posts, completions (including forged and
    /// duplicate tokens), takes and a final failure; every posted buffer must come back
    /// exactly once.
    #[test]
    fn simulation_every_buffer_returns_exactly_once() {
        for seed in 1..200u64 {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut t = Tracker::new(3, TransportKind::Tcp, caps(8));
            let r = region(&mut t, 4096, Access::empty());
            let mut posted = std::collections::HashSet::new();
            let mut returned = std::collections::HashSet::new();
            let mut tokens = Vec::new();
            let mut next = 0u64;
            let mut out: Vec<Completion> = (0..3).map(|_| Completion::default()).collect();
            for _ in 0..300 {
                match rnd() % 5 {
                    0 | 1 => {
                        let desc = if rnd() % 2 == 0 {
                            OpDesc::Send
                        } else {
                            OpDesc::Recv
                        };
                        match t.post(desc, r.slice(0, 8).unwrap(), next) {
                            Ok(tok) => {
                                posted.insert(next);
                                tokens.push(tok);
                            }
                            Err(e) => assert!(e.is_would_block()),
                        }
                        next += 1;
                    }
                    2 if !tokens.is_empty() => {
                        let i = rnd() as usize % tokens.len();
                        t.complete(tokens[i], Status::Success, 8, 0);
                    }
                    3 => {
                        t.complete(Token(rnd()), Status::Success, 0, 0);
                    }
                    _ => {
                        let n = t.take(&mut out);
                        for c in &out[..n] {
                            assert!(returned.insert(c.wr_id), "returned twice");
                            assert!(c.buf.is_some());
                        }
                    }
                }
            }
            t.fail_all(Status::PeerGone, "test");
            loop {
                let n = t.take(&mut out);
                if n == 0 {
                    break;
                }
                for c in &out[..n] {
                    assert!(returned.insert(c.wr_id), "returned twice");
                }
            }
            assert_eq!(posted, returned);
            assert_eq!(t.in_flight(), 0);
            assert!(t.post(OpDesc::Send, r.slice(0, 8).unwrap(), 0).is_err());
        }
    }
}
