//! Pre-allocated in-flight slot tables: where posted buffers live until their completion.
//!
//! Every work queue (a QP's send queue, a QP's receive queue, an SRQ) has one table with as
//! many slots as the queue is deep. Posting puts the work request's buffers into a free slot
//! and uses the slot's address as the verbs `wr_id`; polling a CQ turns the `wr_id` back into
//! the slot and takes the buffers out. No allocation, lock or system call on either path:
//! one atomic state per slot, written with Release and read with Acquire.
//!
//! Send and receive queues of a QP complete in posting order, so their tables are rings: the
//! completion of slot `p` also retires every earlier (unsignalled) slot. SRQ receives
//! complete in any order, so an SRQ's table is searched for a free slot instead.
#![allow(unsafe_code)]

use crate::ah::AddressHandle;
use crate::mr::MrSlice;
#[cfg(ibverbs_loom)]
use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering},
};
#[cfg(not(ibverbs_loom))]
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// `std::cell::UnsafeCell` with loom's `with_mut` API, so the slot protocol can be modelled
/// with `--cfg ibverbs_loom` (then loom's tracked cell and atomics are used instead).
#[cfg(not(ibverbs_loom))]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(ibverbs_loom))]
impl<T> UnsafeCell<T> {
    fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    #[inline(always)]
    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
    /// The raw pointer (the hot paths; under loom, `with_mut` tracks the access instead).
    #[inline(always)]
    fn get_mut_ptr(&self) -> *mut T {
        self.0.get()
    }
}
use std::mem::MaybeUninit;
use std::sync::Arc;

/// The most scatter/gather elements one safe work request can carry (use the raw layer for
/// more).
pub const MAX_SGE: usize = 4;

/// The scatter/gather elements of one work request, written by [`SgList::encode`] (only the
/// first `num_sge` are initialised; nothing else is read).
pub(crate) type Sges = [MaybeUninit<crate::sys::ibv_sge>; MAX_SGE];

/// The buffers of one work request: up to [`MAX_SGE`] [`MrSlice`] handles.
///
/// Stored inline (no heap), the first `len` entries initialised: posting and polling move
/// it and read only what is there.
pub struct SgList {
    items: [MaybeUninit<MrSlice>; MAX_SGE],
    len: u8,
}

impl Default for SgList {
    #[inline]
    fn default() -> Self {
        SgList {
            items: [const { MaybeUninit::uninit() }; MAX_SGE],
            len: 0,
        }
    }
}

impl Drop for SgList {
    #[inline]
    fn drop(&mut self) {
        self.clear();
    }
}

impl Clone for SgList {
    fn clone(&self) -> Self {
        let mut l = SgList::new();
        for s in self.iter() {
            let _ = l.push(s.clone());
        }
        l
    }
}

impl std::fmt::Debug for SgList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl SgList {
    /// An empty list (a zero-length message).
    #[inline]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a buffer; gives it back when the list is full.
    ///
    /// # Errors
    /// The slice itself, when [`MAX_SGE`] buffers are already in the list.
    #[inline]
    pub fn push(&mut self, s: MrSlice) -> Result<(), MrSlice> {
        let n = self.len as usize;
        if n >= MAX_SGE {
            return Err(s);
        }
        self.items[n].write(s);
        self.len += 1;
        Ok(())
    }

    /// Number of buffers.
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether there is no buffer.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Total bytes.
    pub fn total_len(&self) -> u64 {
        self.iter().map(|s| s.len() as u64).sum()
    }

    /// The buffers, as a slice.
    #[inline]
    pub fn as_slice(&self) -> &[MrSlice] {
        let n = (self.len as usize).min(MAX_SGE);
        // SAFETY: the first `len` (<= MAX_SGE) entries are initialised; MaybeUninit<T> has
        // T's layout.
        unsafe { std::slice::from_raw_parts(self.items.as_ptr().cast::<MrSlice>(), n) }
    }

    /// The buffers.
    #[inline]
    pub fn iter(&self) -> std::slice::Iter<'_, MrSlice> {
        self.as_slice().iter()
    }

    /// Writes the scatter/gather elements; returns their number and total length.
    #[inline]
    pub(crate) fn encode(&self, sges: &mut Sges) -> (usize, u64) {
        let n = self.len as usize;
        debug_assert!(n <= MAX_SGE);
        let mut total = 0u64;
        at_constant_indices(n, |i| {
            // SAFETY: called only for `i < len`: an initialised entry.
            let s = unsafe { self.items[i].assume_init_ref() };
            sges[i].write(s.sge());
            total += s.len() as u64;
        });
        (n, total)
    }

    /// Whether a buffer is registered in another protection domain than `pd` (its lkey
    /// means nothing there — or, on another device, possibly another region of `pd`).
    /// Only asked while several PDs are alive ([`crate::pd::several`]).
    #[cold]
    #[inline(never)]
    pub(crate) fn any_foreign(&self, pd: *const crate::pd::PdInner) -> bool {
        self.iter()
            .any(|s| !std::ptr::eq(Arc::as_ptr(&s.owner.pd.inner), pd))
    }

    /// What the checks of a send's buffers look at (their PDs, whether host memory), read
    /// at constant indices: a list on the stack can then stay out of memory (its address is
    /// never taken), which a borrow of it handed to an out-of-line check would prevent.
    #[inline(always)]
    pub(crate) fn owners(&self) -> BufOwners {
        let mut o = BufOwners {
            n: self.len,
            pd: [std::ptr::null(); MAX_SGE],
            host: [true; MAX_SGE],
        };
        at_constant_indices(self.len as usize, |i| {
            // SAFETY: called only for `i < len`: an initialised entry.
            let s = unsafe { self.items[i].assume_init_ref() };
            o.pd[i] = Arc::as_ptr(&s.owner.pd.inner);
            o.host[i] = s.owner.host;
        });
        o
    }

    /// The first buffer.
    #[inline]
    pub fn first(&self) -> Option<&MrSlice> {
        self.as_slice().first()
    }

    /// Takes the first buffer, dropping the others.
    pub fn into_first(self) -> Option<MrSlice> {
        self.into_iter().next()
    }

    /// Removes and returns every buffer, leaving the list empty.
    #[inline]
    pub fn take(&mut self) -> SgList {
        std::mem::take(self)
    }

    /// Drops every buffer in place, leaving the list empty. Emptied first: should a drop
    /// panic, nothing is dropped twice (the rest is leaked). The one-buffer case (the usual
    /// one) is inline; more buffers take an out-of-line loop.
    #[inline(always)]
    pub(crate) fn clear(&mut self) {
        let n = self.len as usize;
        debug_assert!(n <= MAX_SGE);
        if n == 0 {
            return;
        }
        self.len = 0;
        // Constant indices only (no loop, no out-of-line call taking the list's address):
        // a list on the stack can then live in registers.
        // SAFETY: the first `n` entries were initialised; `len` is 0 now, so each is dropped
        // exactly once (a panicking drop leaks the rest).
        unsafe {
            self.items[0].assume_init_drop();
            if n > 1 {
                self.items[1].assume_init_drop();
                if n > 2 {
                    self.items[2].assume_init_drop();
                    if n > 3 {
                        self.items[3].assume_init_drop();
                    }
                }
            }
        }
    }

    /// Moves `src`'s buffers into this list, which must be empty (nothing is dropped, so
    /// this cannot panic), leaving `src` empty. The first entry is copied unconditionally
    /// (as `MaybeUninit` bytes: it is only read as a buffer when `len` says so), the others
    /// only when there are more.
    #[inline(always)]
    pub(crate) fn move_into_empty(&mut self, src: &mut SgList) {
        debug_assert!(self.is_empty());
        let m = src.len as usize;
        debug_assert!(m <= MAX_SGE);
        src.len = 0;
        // Copies of `MaybeUninit` entries between two distinct lists (`&mut` to both), at
        // constant indices: an uninitialised entry stays uninitialised and is read as a
        // buffer only when `len` (set below) covers it; a copied buffer is owned by `self`
        // alone (`src`'s `len` is 0 now).
        let copy = |i: usize, dst: &mut Self, src: &Self| {
            // SAFETY: as above (the two lists are distinct).
            unsafe { std::ptr::copy_nonoverlapping(&src.items[i], &mut dst.items[i], 1) }
        };
        copy(0, self, src);
        if m > 1 {
            copy(1, self, src);
            if m > 2 {
                copy(2, self, src);
                if m > 3 {
                    copy(3, self, src);
                }
            }
        }
        self.len = m as u8;
    }
}

impl IntoIterator for SgList {
    type Item = MrSlice;
    type IntoIter = std::iter::Flatten<std::array::IntoIter<Option<MrSlice>, MAX_SGE>>;
    fn into_iter(self) -> Self::IntoIter {
        let this = std::mem::ManuallyDrop::new(self);
        let n = this.len as usize;
        let mut out: [Option<MrSlice>; MAX_SGE] = Default::default();
        for (i, o) in out.iter_mut().enumerate().take(n) {
            // SAFETY: entry `i < len` is initialised; `this` is never dropped, so each entry
            // is moved out exactly once.
            *o = Some(unsafe { this.items[i].assume_init_read() });
        }
        out.into_iter().flatten()
    }
}

impl From<MrSlice> for SgList {
    #[inline]
    fn from(s: MrSlice) -> Self {
        let mut l = SgList::new();
        l.items[0].write(s);
        l.len = 1;
        l
    }
}

macro_rules! sglist_from_array {
    ($($n:literal),*) => {$(
        impl From<[MrSlice; $n]> for SgList {
            fn from(a: [MrSlice; $n]) -> Self {
                let mut l = SgList::new();
                for s in a {
                    let _ = l.push(s);
                }
                l
            }
        }
    )*};
}
sglist_from_array!(1, 2, 3, 4);

/// Calls `f(0)`, `f(1)`, ... up to `f(n - 1)` (`n <= MAX_SGE`) at constant indices, not in a
/// loop: a list on the stack whose entries are read this way can stay in registers (see
/// [`SgList::clear`]).
#[inline(always)]
fn at_constant_indices(n: usize, mut f: impl FnMut(usize)) {
    if n > 0 {
        f(0);
        if n > 1 {
            f(1);
            if n > 2 {
                f(2);
                if n > 3 {
                    f(3);
                }
            }
        }
    }
}

/// The owners of a list's buffers, as the send checks see them ([`SgList::owners`]).
#[derive(Clone, Copy)]
pub(crate) struct BufOwners {
    pub(crate) n: u8,
    pub(crate) pd: [*const crate::pd::PdInner; MAX_SGE],
    pub(crate) host: [bool; MAX_SGE],
}

impl BufOwners {
    /// As [`SgList::any_foreign`].
    pub(crate) fn any_foreign(&self, pd: *const crate::pd::PdInner) -> bool {
        self.pd[..self.n as usize]
            .iter()
            .any(|&p| !std::ptr::eq(p, pd))
    }
    /// Whether every buffer is host memory the CPU may read (not device memory).
    pub(crate) fn all_host(&self) -> bool {
        self.host[..self.n as usize].iter().all(|&h| h)
    }
}

/// What one slot holds while its work request is in flight (a free slot holds an empty
/// list, no address handle).
pub(crate) struct SlotData {
    pub(crate) bufs: SgList,
    pub(crate) user: u64,
    /// UD sends keep their address handle alive until completion.
    pub(crate) _ah: Option<AddressHandle>,
    /// Posted inside a [`QueuePair::scope`](crate::QueuePair::scope) (borrows, no handles).
    pub(crate) scoped: bool,
}

impl SlotData {
    fn empty() -> Self {
        SlotData {
            bufs: SgList::new(),
            user: 0,
            _ah: None,
            scoped: false,
        }
    }
}

const FREE: u8 = 0;
const POSTED: u8 = 1;
const BUSY: u8 = 2;

pub(crate) struct Slot {
    state: AtomicU8,
    index: u32,
    /// The index after this one in its table (wrapping).
    next: u32,
    /// The slot after this one in its table (wrapping): a ring's next cursor and tail. Set
    /// once, through a shared borrow of the queue once it sits in its `Arc` (so that, under
    /// Stacked Borrows, the address stays valid for every later shared borrow of the slots),
    /// and only read after that (a plain load). Not a loom atomic: loom has nothing to model
    /// in a value written before the queue is shared.
    next_slot: std::sync::atomic::AtomicPtr<Slot>,
    queue: *const WorkQueue,
    /// Always initialised; owned by the producer while FREE (and then empty: no buffers,
    /// no address handle), by nobody on the CPU while POSTED (the device may use the
    /// buffers), by whoever moved it POSTED -> BUSY until it stores FREE.
    data: UnsafeCell<SlotData>,
}

impl Slot {
    /// Fills this FREE slot (from [`WorkQueue::free_at`], or found free by `fill`) with the
    /// buffers of `bufs` (moved out, leaving it empty), the user's id and, for UD sends,
    /// the address handle; publishes it POSTED and returns its `wr_id`.
    ///
    /// Must only be called by the queue's single producer, on a slot it saw FREE.
    #[inline(always)]
    pub(crate) fn post(
        &self,
        bufs: &mut SgList,
        user: u64,
        ah: Option<AddressHandle>,
        scoped: bool,
    ) -> u64 {
        // SAFETY: FREE slots are owned by the single producer (us) and empty (every taker
        // moved the contents out); the caller's Acquire load of FREE synchronises with the
        // taker's Release store of FREE. Nothing here drops anything.
        #[cfg(not(ibverbs_loom))]
        let d = unsafe { &mut *self.data.get_mut_ptr() };
        #[cfg(ibverbs_loom)]
        let guard = self.data.get_mut();
        // SAFETY: as above (loom tracks the access while `guard` lives).
        #[cfg(ibverbs_loom)]
        let d = unsafe { guard.deref() };
        d.bufs.move_into_empty(bufs);
        d.user = user;
        if ah.is_some() {
            // SAFETY: as above; the empty slot's handle is `None` (nothing to drop).
            unsafe { std::ptr::write(&mut d._ah, ah) };
        }
        d.scoped = scoped;
        self.state.store(POSTED, Ordering::Release);
        self as *const Slot as u64
    }
}

impl Slot {
    /// As [`post`](Self::post) for a work request without buffers to hold (scoped work
    /// requests borrow their memory): a FREE slot's list is empty already.
    #[inline(always)]
    pub(crate) fn post_borrowed(&self, user: u64) -> u64 {
        debug_assert_eq!(self.state.load(Ordering::Relaxed), FREE);
        // SAFETY: as in `post`: a FREE slot is the producer's, and empty.
        #[cfg(not(ibverbs_loom))]
        let d = unsafe { &mut *self.data.get_mut_ptr() };
        #[cfg(ibverbs_loom)]
        let guard = self.data.get_mut();
        // SAFETY: as above (loom tracks the access while `guard` lives).
        #[cfg(ibverbs_loom)]
        let d = unsafe { guard.deref() };
        debug_assert!(d.bufs.is_empty() && d._ah.is_none());
        d.user = user;
        d.scoped = true;
        self.state.store(POSTED, Ordering::Release);
        self as *const Slot as u64
    }
}

/// What a completion's slot held besides its buffers.
#[derive(Clone, Copy)]
pub(crate) struct Completed {
    pub(crate) user: u64,
    pub(crate) scoped: bool,
    pub(crate) kind: QueueKind,
    /// The queue the slot belongs to (compared, never dereferenced, by a scope's poll).
    pub(crate) queue: *const WorkQueue,
}

/// Drops a UD send's address handle once its slot is free (out of line: rare).
#[cold]
#[inline(never)]
fn drop_ah(ah: Option<AddressHandle>) {
    drop(ah);
}

/// A ring's producer cursor: the address of the slot its next work request goes into
/// (one load to find it, one to move past it). Only meaningful with the queue it came from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingCursor(*const Slot);

// SAFETY: an address into the slots of a queue that the cursor's owner keeps alive (an
// `Arc<WorkQueue>` beside it); it is dereferenced only through that queue's methods, by the
// queue's single producer (`&mut` of its owner).
unsafe impl Send for RingCursor {}
// SAFETY: as above.
unsafe impl Sync for RingCursor {}

/// Which queue a completion came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QueueKind {
    /// A QP's send queue.
    Send,
    /// A QP's receive queue.
    Recv,
    /// A shared receive queue.
    Srq,
}

pub(crate) struct WorkQueue {
    slots: Box<[Slot]>,
    ordered: bool,
    /// The address of the slot a completion is expected for next (ordered queues; touched
    /// only by the single poller of this queue's CQ).
    tail: AtomicUsize,
    dead: AtomicBool,
    /// Set (to its CQ's retire sequence number) once the queue's QP is destroyed: the CQ
    /// detaches the table after a poll that started later found the CQ empty.
    pub(crate) retired_at: std::sync::atomic::AtomicUsize,
    pub(crate) kind: QueueKind,
}

// SAFETY: slot data is handed between the poster and the completer through the per-slot
// atomic state (FREE -> POSTED by the poster, POSTED -> BUSY -> FREE by whoever completes or
// releases it); `queue` points at the Arc-owned WorkQueue that contains the slot.
unsafe impl Send for WorkQueue {}
// SAFETY: as above.
unsafe impl Sync for WorkQueue {}

impl Drop for WorkQueue {
    fn drop(&mut self) {
        // The last reference: whatever is still posted (a QP that was forgotten, not
        // destroyed, keeps its queue alive, so the device is done with these) is dropped.
        for slot in self.slots.iter() {
            drop(Self::take(slot));
        }
    }
}

impl WorkQueue {
    pub(crate) fn new(depth: usize, ordered: bool, kind: QueueKind) -> Arc<WorkQueue> {
        let depth = depth.max(1);
        let queue = Arc::new_cyclic(|w| {
            let q = w.as_ptr();
            let slots: Box<[Slot]> = (0..depth)
                .map(|i| Slot {
                    state: AtomicU8::new(FREE),
                    index: i as u32,
                    next: if i + 1 == depth { 0 } else { i as u32 + 1 },
                    next_slot: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
                    queue: q,
                    data: UnsafeCell::new(SlotData::empty()),
                })
                .collect();
            WorkQueue {
                slots,
                ordered,
                tail: AtomicUsize::new(0),
                dead: AtomicBool::new(false),
                retired_at: std::sync::atomic::AtomicUsize::new(0),
                kind,
            }
        });
        // The slots never move again: their addresses are final. Every address below comes
        // from one shared borrow of them, as every later use (`&self.slots`) is.
        let base = queue.slots.as_ptr();
        for s in queue.slots.iter() {
            // SAFETY: `next < depth`: inside the allocation.
            let next = unsafe { base.add(s.next as usize) };
            s.next_slot
                .store(next.cast_mut(), std::sync::atomic::Ordering::Relaxed);
        }
        queue.tail.store(base as usize, Ordering::Relaxed);
        queue
    }

    pub(crate) fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Finds a free slot at or after `*cursor` (rings look only at `*cursor`), fills it with
    /// `data`, marks it posted and returns its `wr_id`. The caller advances the cursor with
    /// [`advance`](Self::advance) once the post succeeded.
    ///
    /// Must only be called by the queue's single producer (the `&mut` owner of the QP/SRQ).
    #[inline]
    #[allow(clippy::result_large_err)] // hands the caller's data back; no allocation
    pub(crate) fn fill(&self, cursor: &mut usize, mut data: SlotData) -> Result<u64, SlotData> {
        if self.ordered {
            // A ring: only the slot at the cursor can be next.
            return match self.free_at(*cursor) {
                Some(slot) => Ok(slot.post(&mut data.bufs, data.user, data._ah, data.scoped)),
                None => Err(data),
            };
        }
        let n = self.slots.len();
        let mut i = *cursor;
        for _ in 0..n {
            let slot = &self.slots[i];
            if slot.state.load(Ordering::Acquire) == FREE {
                *cursor = i;
                return Ok(slot.post(&mut data.bufs, data.user, data._ah, data.scoped));
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        Err(data)
    }

    /// The slot at a ring's cursor, if it is free (else the ring is full). Producer only.
    #[inline(always)]
    pub(crate) fn free_at(&self, cursor: usize) -> Option<&Slot> {
        debug_assert!(self.ordered);
        // The cursor is always below the depth: `advance` wraps it, `fill` sets it to an
        // index it just checked.
        debug_assert!(cursor < self.slots.len());
        // SAFETY: in bounds, as said above.
        let slot = unsafe { self.slots.get_unchecked(cursor) };
        (slot.state.load(Ordering::Acquire) == FREE).then_some(slot)
    }

    /// A ring's first slot: where its producer cursor ([`RingCursor`]) starts.
    pub(crate) fn ring_start(&self) -> RingCursor {
        debug_assert!(self.ordered);
        RingCursor(self.slots.as_ptr())
    }

    /// The slot at a ring's cursor, if it is free (else the ring is full). Producer only.
    ///
    /// # Safety
    /// `cursor` must be this queue's: from its [`ring_start`](Self::ring_start), moved only
    /// by [`advance_past`](Self::advance_past) with slots of this queue.
    #[inline(always)]
    pub(crate) unsafe fn free_at_cursor(&self, cursor: RingCursor) -> Option<&Slot> {
        debug_assert!(self.ordered);
        debug_assert!(self.slots.as_ptr_range().contains(&cursor.0));
        // SAFETY: the caller's contract: one of our slots (they live as long as we do).
        let slot = unsafe { &*cursor.0 };
        (slot.state.load(Ordering::Acquire) == FREE).then_some(slot)
    }

    /// Moves a ring's cursor past `slot` (the one at the cursor, just posted).
    #[inline(always)]
    pub(crate) fn advance_past(cursor: &mut RingCursor, slot: &Slot) {
        cursor.0 = slot.next_slot.load(std::sync::atomic::Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn advance(&self, cursor: &mut usize) {
        let next = *cursor + 1;
        *cursor = if next == self.slots.len() { 0 } else { next };
    }

    /// Takes back a slot whose work request was never accepted by the provider.
    pub(crate) fn unfill(&self, wr_id: u64) -> Option<SlotData> {
        // SAFETY: `wr_id` was returned by `fill`/`Slot::post` on this queue just now.
        let slot = unsafe { &*(wr_id as *const Slot) };
        Self::take(slot)
    }

    #[inline]
    fn take(slot: &Slot) -> Option<SlotData> {
        if slot
            .state
            .compare_exchange(POSTED, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return None;
        }
        // SAFETY: the successful CAS made us the slot's only user until we store FREE; we
        // move its contents out, leaving it empty as a FREE slot must be.
        let d = slot.data.with_mut(|p| unsafe {
            let d = &mut *p;
            SlotData {
                bufs: d.bufs.take(),
                user: d.user,
                _ah: d._ah.take(),
                scoped: d.scoped,
            }
        });
        slot.state.store(FREE, Ordering::Release);
        Some(d)
    }

    /// Retires the slot named by a completion's `wr_id` (and, for rings, the unsignalled
    /// slots before it) and returns its data.
    ///
    /// # Safety
    /// `wr_id` must be a value returned by [`fill`](Self::fill) on a queue that is still
    /// allocated (CQs keep the queues attached to them alive), and for ordered queues this
    /// must only be called by the single poller of that queue's CQ.
    #[cfg(test)]
    pub(crate) unsafe fn complete(wr_id: u64) -> Option<(SlotData, QueueKind)> {
        let mut bufs = SgList::new();
        let mut got = None;
        // SAFETY: the caller's contract.
        unsafe { Self::complete_into(wr_id, &mut bufs, |c| got = Some(c)) };
        let done = got?;
        Some((
            SlotData {
                bufs,
                user: done.user,
                _ah: None,
                scoped: done.scoped,
            },
            done.kind,
        ))
    }

    /// As [`complete`](Self::complete), moving the slot's buffers into `bufs` (which must be
    /// empty: the hot path moves them straight into a `Completion`) and handing the rest to
    /// `done` (which must not panic) as soon as the slot is free; returns whether the slot
    /// was posted. Claiming the slot, moving the buffers and freeing the slot cannot panic.
    /// Dropped afterwards, once the slot is free and the ring's tail moved past it: the
    /// address handle of a UD send, and the buffers of the earlier unsignalled slots this
    /// completion retires; those drops may panic (see [`sweep`]), after `done` ran.
    ///
    /// # Safety
    /// As [`complete`](Self::complete).
    #[inline(always)]
    pub(crate) unsafe fn complete_into(
        wr_id: u64,
        bufs: &mut SgList,
        done: impl FnOnce(Completed),
    ) -> bool {
        // SAFETY: contract: the slot and its queue are alive.
        let slot = unsafe { &*(wr_id as *const Slot) };
        if slot
            .state
            .compare_exchange(POSTED, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // SAFETY: `queue` points at the WorkQueue owning this slot (set at construction).
        let q = unsafe { &*slot.queue };
        let (user, scoped) = slot.data.with_mut(|p| {
            // SAFETY: the successful CAS made us the slot's only user until we store FREE;
            // we move the buffers out and drop the address handle, leaving it empty.
            let d = unsafe { &mut *p };
            // A scoped slot holds neither buffers nor an address handle (`post_borrowed`
            // fills a FREE, empty slot with an id only): nothing to move or drop.
            if !d.scoped {
                bufs.move_into_empty(&mut d.bufs);
                if d._ah.is_some() {
                    // A UD send's address handle: its drop cannot panic (a failing
                    // `ibv_destroy_ah` is recorded, not raised).
                    drop_ah(d._ah.take());
                }
            }
            (d.user, d.scoped)
        });
        slot.state.store(FREE, Ordering::Release);
        done(Completed {
            user,
            scoped,
            kind: q.kind,
            queue: q,
        });
        if q.ordered {
            let from = q.tail.load(Ordering::Relaxed);
            // The tail moves past this slot *before* any earlier buffer is dropped: should
            // one of those drops panic, no later completion sweeps from a stale tail into
            // slots reused for newer, running work requests.
            let next = slot.next_slot.load(std::sync::atomic::Ordering::Relaxed);
            q.tail.store(next as usize, Ordering::Relaxed);
            if from != slot as *const Slot as usize {
                // SAFETY: the tail is always the address of one of `q`'s slots.
                let from = unsafe { (*(from as *const Slot)).index } as usize;
                sweep(q, from, slot.index as usize);
            }
        }
        true
    }

    /// Releases every in-flight slot (after the QP/SRQ was destroyed: the device no longer
    /// touches the buffers) and marks the queue dead so late completions are ignored.
    pub(crate) fn release_all(&self) -> usize {
        self.dead.store(true, Ordering::Release);
        self.slots.iter().filter_map(Self::take).count()
    }

    /// Number of slots currently posted.
    pub(crate) fn in_flight(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) != FREE)
            .count()
    }
}

/// Releases the slots `from..to` of a ring (wrapping): earlier, unsignalled work requests
/// that a completion retired (they completed before it). If one of those drops panics, the
/// slots not yet released are still freed for reuse, their data leaked (never dropped
/// twice, never left claimed), and the panic goes on.
#[cold]
#[inline(never)]
fn sweep(q: &WorkQueue, from: usize, to: usize) {
    let n = q.slots.len();
    struct Rest<'a> {
        q: &'a WorkQueue,
        i: usize,
        to: usize,
        n: usize,
    }
    impl Drop for Rest<'_> {
        fn drop(&mut self) {
            // Reached with slots left only when a drop below panicked: free the slots, leak
            // what they held (dropping more now could panic during unwinding).
            while self.i != self.to {
                if let Some(d) = WorkQueue::take(&self.q.slots[self.i]) {
                    std::mem::forget(d);
                }
                self.i = if self.i + 1 == self.n { 0 } else { self.i + 1 };
            }
        }
    }
    let mut rest = Rest { q, i: from, to, n };
    while rest.i != rest.to {
        let d = WorkQueue::take(&q.slots[rest.i]);
        rest.i = if rest.i + 1 == n { 0 } else { rest.i + 1 };
        // Earlier unsignalled work requests are complete too: release their buffers.
        drop(d);
    }
}

/// A device-free handle on one in-flight slot table, for fuzzing and tests
/// ([`crate::fuzzing`]): each posted "buffer" is a `u64`, and every call goes through the
/// same code the QP and CQ paths use.
#[doc(hidden)]
pub struct SlotTable {
    q: Arc<WorkQueue>,
    head: usize,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable")
            .field("depth", &self.q.depth())
            .field("head", &self.head)
            .finish()
    }
}

impl SlotTable {
    /// A table of `depth` slots (at least one); `ordered` as a QP's send/receive queue
    /// (completions retire earlier slots), unordered as an SRQ's.
    pub fn new(depth: usize, ordered: bool) -> Self {
        let kind = if ordered {
            QueueKind::Send
        } else {
            QueueKind::Srq
        };
        SlotTable {
            q: WorkQueue::new(depth, ordered, kind),
            head: 0,
        }
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.q.depth()
    }

    fn data(user: u64) -> SlotData {
        SlotData {
            bufs: SgList::new(),
            user,
            _ah: None,
            scoped: false,
        }
    }

    fn index_of(&self, wr_id: u64) -> usize {
        let base = self.q.slots.as_ptr() as u64;
        ((wr_id - base) / std::mem::size_of::<Slot>() as u64) as usize
    }

    /// Posts `user` as a work request the provider accepts; returns its slot index.
    ///
    /// # Errors
    /// `user` back when no slot is free (backpressure: the caller must poll first).
    pub fn post(&mut self, user: u64) -> std::result::Result<usize, u64> {
        match self.q.fill(&mut self.head, Self::data(user)) {
            Ok(id) => {
                self.q.advance(&mut self.head);
                Ok(self.index_of(id))
            }
            Err(d) => Err(d.user),
        }
    }

    /// Posts `user` as a work request the provider then refuses: the slot is taken back.
    /// Returns what came back (`None` would be a lost buffer).
    ///
    /// # Errors
    /// `user` back when no slot is free.
    pub fn post_refused(&mut self, user: u64) -> std::result::Result<Option<u64>, u64> {
        match self.q.fill(&mut self.head, Self::data(user)) {
            Ok(id) => Ok(self.q.unfill(id).map(|d| d.user)),
            Err(d) => Err(d.user),
        }
    }

    /// A completion naming slot `index` (`index < depth`, else ignored): the buffer it
    /// hands back, if any, and the buffers of the earlier slots it retired (ordered tables).
    pub fn complete(&mut self, index: usize) -> (Option<u64>, Vec<u64>) {
        let Some(slot) = self.q.slots.get(index) else {
            return (None, Vec::new());
        };
        let before: Vec<Option<u64>> = (0..self.q.depth()).map(|i| self.posted(i)).collect();
        let mut bufs = SgList::new();
        // SAFETY: the id names a slot of `self.q`, alive while `self` is; `&mut self` makes
        // this the table's single poller.
        let mut got = None;
        // SAFETY: as above.
        unsafe {
            WorkQueue::complete_into(slot as *const Slot as u64, &mut bufs, |c| {
                got = Some(c.user)
            })
        };
        let swept = before
            .iter()
            .enumerate()
            .filter(|&(i, u)| i != index && u.is_some() && self.posted(i).is_none())
            .filter_map(|(_, u)| *u)
            .collect();
        (got, swept)
    }

    /// What slot `index` holds, if it is posted.
    pub fn posted(&self, index: usize) -> Option<u64> {
        let slot = self.q.slots.get(index)?;
        if slot.state.load(Ordering::Acquire) != POSTED {
            return None;
        }
        // SAFETY: `&self` with the table's `&mut` methods means no taker runs concurrently;
        // we only read `user`.
        Some(slot.data.with_mut(|p| unsafe { (*p).user }))
    }

    /// Releases everything in flight (QP destroyed); returns how many slots were released.
    pub fn release_all(&mut self) -> usize {
        self.q.release_all()
    }

    /// Number of slots in flight.
    pub fn in_flight(&self) -> usize {
        self.q.in_flight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(user: u64) -> SlotData {
        SlotData {
            bufs: SgList::new(),
            user,
            _ah: None,
            scoped: false,
        }
    }

    #[test]
    fn ring_fills_in_order_and_sweeps_unsignalled() {
        let q = WorkQueue::new(4, true, QueueKind::Send);
        let mut head = 0;
        let mut ids = vec![];
        for u in 0..4 {
            let id = q.fill(&mut head, data(u)).ok().unwrap();
            q.advance(&mut head);
            ids.push(id);
        }
        assert_eq!(q.in_flight(), 4);
        assert!(q.fill(&mut head, data(9)).is_err(), "full ring rejects");
        // Completion of slot 2 retires 0, 1 (unsignalled) and 2.
        // SAFETY: ids come from `fill` on the live queue; single poller.
        let (d, k) = unsafe { WorkQueue::complete(ids[2]) }.unwrap();
        assert_eq!(k, QueueKind::Send);
        assert_eq!(d.user, 2);
        assert_eq!(q.in_flight(), 1);
        // A duplicate/stale completion is ignored.
        // SAFETY: as above.
        assert!(unsafe { WorkQueue::complete(ids[2]) }.is_none());
        // Slot 0 is free again.
        assert!(q.fill(&mut head, data(4)).is_ok());
        q.advance(&mut head);
        // SAFETY: as above.
        assert_eq!(unsafe { WorkQueue::complete(ids[3]) }.unwrap().0.user, 3);
        assert_eq!(q.release_all(), 1);
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn unordered_table_finds_free_slots() {
        let q = WorkQueue::new(3, false, QueueKind::Srq);
        let mut cur = 0;
        let a = q.fill(&mut cur, data(1)).ok().unwrap();
        q.advance(&mut cur);
        let b = q.fill(&mut cur, data(2)).ok().unwrap();
        q.advance(&mut cur);
        let _c = q.fill(&mut cur, data(3)).ok().unwrap();
        q.advance(&mut cur);
        assert!(q.fill(&mut cur, data(4)).is_err());
        // SAFETY: ids from `fill` on the live queue.
        assert_eq!(unsafe { WorkQueue::complete(b) }.unwrap().0.user, 2);
        assert_eq!(q.in_flight(), 2, "no sweep on unordered tables");
        let d = q.fill(&mut cur, data(5)).ok().unwrap();
        assert_eq!(d, b, "the freed slot is reused");
        assert_eq!(q.unfill(a).unwrap().user, 1);
    }
}

/// loom models of the slot protocol: `RUSTFLAGS="--cfg ibverbs_loom" cargo test --release
/// -p ibverbs-safe --lib -- loom` (run by ci/hardening.sh).
#[cfg(all(test, ibverbs_loom))]
mod loom_models {
    use super::*;
    use loom::sync::atomic::AtomicU64;

    fn data(user: u64) -> SlotData {
        SlotData {
            bufs: SgList::new(),
            user,
            _ah: None,
            scoped: false,
        }
    }

    /// A completer and a dropper (QP destroyed) race for the same posted slots: each slot's
    /// data is taken exactly once, with no data race on the slot.
    #[test]
    fn loom_completion_races_release_all() {
        loom::model(|| {
            let q = WorkQueue::new(2, true, QueueKind::Send);
            let mut head = 0;
            let a = q.fill(&mut head, data(1)).ok().unwrap();
            q.advance(&mut head);
            let b = q.fill(&mut head, data(2)).ok().unwrap();
            q.advance(&mut head);
            let q2 = q.clone();
            let completer = loom::thread::spawn(move || {
                let _keep = &q2;
                // SAFETY: ids from `fill` on a live queue; this is the single poller.
                let x = unsafe { WorkQueue::complete(a) }.is_some() as usize;
                // SAFETY: as above.
                x + unsafe { WorkQueue::complete(b) }.is_some() as usize
            });
            let released = q.release_all();
            let completed = completer.join().unwrap();
            assert_eq!(released + completed, 2, "every slot taken exactly once");
            assert_eq!(q.in_flight(), 0);
        });
    }

    /// The producer reuses a slot as soon as the completer frees it: the new data must not
    /// race with the completer's take of the old one (Release/Acquire on the slot state).
    #[test]
    fn loom_slot_reuse_after_completion() {
        loom::model(|| {
            let q = WorkQueue::new(1, true, QueueKind::Recv);
            let mut head = 0;
            let id = q.fill(&mut head, data(7)).ok().unwrap();
            q.advance(&mut head);
            let published = std::sync::Arc::new(AtomicU64::new(0));
            let (q2, p2) = (q.clone(), published.clone());
            let completer = loom::thread::spawn(move || {
                // SAFETY: id from `fill` on the live queue; single poller.
                let d = unsafe { WorkQueue::complete(id) }.expect("posted");
                p2.store(d.0.user, Ordering::Relaxed);
                drop(q2);
            });
            let mut spins = 0;
            let mut next = data(8);
            loop {
                match q.fill(&mut head, next) {
                    Ok(_) => break,
                    Err(d) => {
                        next = d;
                        spins += 1;
                        if spins > 3 {
                            // Let the model make progress (loom requires bounded spinning).
                            completer_yield();
                        }
                    }
                }
            }
            completer.join().unwrap();
            assert_eq!(published.load(Ordering::Relaxed), 7);
            assert_eq!(q.in_flight(), 1);
            assert_eq!(q.release_all(), 1);
        });
    }

    fn completer_yield() {
        loom::thread::yield_now();
    }
}
