//! The synchronisation primitives the lock-free code uses, switched by `cfg(fabric_loom)`.
//!
//! Normal builds use `std`; `RUSTFLAGS="--cfg fabric_loom"` swaps in loom's so the very same
//! ring code (and the registration table's lock) runs under the loom model checker. [`DataCells`] lets loom see accesses to the
//! ring's payload bytes (which are plain memory, not atomics): in normal builds it is a
//! zero-cost no-op.

#[cfg(not(fabric_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(fabric_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};

/// The lock of a domain's registration table ([`crate::registry::SharedRegistry`]).
#[cfg(not(fabric_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(fabric_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Access tracking for payload granules (one per 64-byte line of ring data).
#[cfg(not(fabric_loom))]
#[derive(Debug, Default)]
pub(crate) struct DataCells;

#[cfg(not(fabric_loom))]
impl DataCells {
    pub(crate) fn new(_granules: usize) -> Self {
        DataCells
    }
    #[inline(always)]
    pub(crate) fn write(&self, _first: usize, _count: usize) {}
    #[inline(always)]
    pub(crate) fn read(&self, _first: usize, _count: usize) {}
}

/// Access tracking for payload granules: each granule is a loom `UnsafeCell<()>`, so an
/// unsynchronised write/read pair on the same granule is reported by loom.
#[cfg(fabric_loom)]
#[derive(Debug)]
pub(crate) struct DataCells(Vec<loom::cell::UnsafeCell<()>>);

#[cfg(fabric_loom)]
impl DataCells {
    pub(crate) fn new(granules: usize) -> Self {
        DataCells(
            (0..granules)
                .map(|_| loom::cell::UnsafeCell::new(()))
                .collect(),
        )
    }
    pub(crate) fn write(&self, first: usize, count: usize) {
        for c in &self.0[first..first + count] {
            c.with_mut(|_| ());
        }
    }
    pub(crate) fn read(&self, first: usize, count: usize) {
        for c in &self.0[first..first + count] {
            c.with(|_| ());
        }
    }
}
