//! The bookkeeping every backend shares, as a deterministic core with no I/O
//! (in the manner of quinn-proto): validation of posts (ownership, bounds, access,
//! sizes, capabilities), a pre-allocated in-flight slot table with generation-checked
//! tokens, the submission and receive queues (bounded; full is backpressure), the ready
//! queue of finished operations, and failure of everything in flight when a connection
//! dies. Backends ("hals") only move bytes: they take tokens from the queues, and report
//! `complete(token, status, ...)`. A test (or a fuzz target) drives it with any sequence of
//! posts, completions and failures and checks that every buffer comes back exactly once.

use std::collections::VecDeque;

use crate::error::Error;
use crate::region::{check_range, Access, Buf, Region};
use crate::transport::{
    AtomicOp, Capabilities, Completion, OpKind, PostError, RemoteKey, Status, TransportKind,
};

/// A handle on an in-flight slot: index in the low 32 bits, generation in the high 32.
/// Safe to send to a peer and get back: a stale or forged token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub u64);

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
    /// The buffer, owned until the completion is taken.
    pub buf: Buf,
    /// Bytes already moved (backends that progress an operation in pieces).
    pub progress: usize,
    status: Status,
    len: usize,
    value: u64,
    done: bool,
    /// Handed to the wire in full and waiting for the peer's response (one-sided ops of
    /// backends whose peer answers them; see [`Tracker::mark_awaiting`]).
    awaiting: bool,
}

#[derive(Debug)]
struct Slot {
    gen: u32,
    op: Option<Pending>,
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
    recv: VecDeque<Token>,
    ready: VecDeque<Token>,
    live: usize,
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
            live: 0,
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
    pub fn post(&mut self, desc: OpDesc, buf: Buf, wr_id: u64) -> Result<Token, PostError> {
        if let Err(error) = self.validate(&desc, &buf) {
            return Err(PostError { error, buf });
        }
        let Some(idx) = self.free.pop() else {
            return Err(PostError {
                error: Error::WouldBlock("in-flight table"),
                buf,
            });
        };
        let slot = &mut self.slots[idx as usize];
        let token = Token::new(idx, slot.gen);
        slot.op = Some(Pending {
            wr_id,
            desc,
            buf,
            progress: 0,
            status: Status::Success,
            len: 0,
            value: 0,
            done: false,
            awaiting: false,
        });
        self.live += 1;
        // Capacity equals the slot count, so these never reallocate.
        if desc == OpDesc::Recv {
            self.recv.push_back(token);
        } else {
            self.submit.push_back(token);
        }
        Ok(token)
    }

    fn validate(&self, desc: &OpDesc, buf: &Buf) -> Result<(), Error> {
        if let Some((_, why)) = &self.failed {
            return Err(Error::Disconnected(why.clone()));
        }
        let r = &buf.region().inner;
        if r.owner != self.owner {
            return Err(Error::Foreign("buffer registered in another domain"));
        }
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
    /// Removes the front of the submission queue (the backend has taken it).
    pub fn submit_pop(&mut self) -> Option<Token> {
        self.submit.pop_front()
    }
    /// The oldest posted receive not yet matched.
    pub fn recv_front(&self) -> Option<Token> {
        self.recv.front().copied()
    }
    /// Removes the front receive (the backend matched it to a message).
    pub fn recv_pop(&mut self) -> Option<Token> {
        self.recv.pop_front()
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
    pub fn live(&self, token: Token, what: &'static str) -> Result<&Pending, Error> {
        self.get(token)
            .ok_or_else(|| Error::Protocol(format!("{what}: no live operation")))
    }

    /// [`get_mut`](Self::get_mut) as a typed error (see [`live`](Self::live)).
    ///
    /// # Errors
    /// [`Error::Protocol`] naming `what` for an unknown, stale or finished token.
    pub fn live_mut(&mut self, token: Token, what: &'static str) -> Result<&mut Pending, Error> {
        self.get_mut(token)
            .ok_or_else(|| Error::Protocol(format!("{what}: no live operation")))
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
    pub fn take(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(t) = self.ready.pop_front() else {
                break;
            };
            let slot = &mut self.slots[t.idx()];
            let Some(p) = slot.op.take() else { continue };
            slot.gen = slot.gen.wrapping_add(1);
            self.free.push(t.idx() as u32);
            self.live -= 1;
            out[n] = Completion {
                wr_id: p.wr_id,
                op: p.desc.kind(),
                status: p.status,
                len: p.len,
                value: p.value,
                buf: Some(p.buf),
            };
            n += 1;
        }
        n
    }

    /// Finished operations waiting for `take`.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }

    /// Operations posted and not yet taken.
    pub fn in_flight(&self) -> usize {
        self.live
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
        order.extend(self.recv.drain(..));
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
        }
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
