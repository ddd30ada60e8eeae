//! A lock whose release is a plain store, for state held for short, bounded stretches by
//! the threads of one process: the async worker's table (a post, a poll of the worker, or an
//! `Op`'s spin of at most 16 polls before it lets go).
//!
//! Why not `std::sync::Mutex`: its release is an atomic read-modify-write (it must see
//! whether a thread sleeps on it), and a round trip on the async worker takes and releases
//! the table three times per side on its critical path. Measured with `async_echo` on shm
//! (BENCHMARKS.md, issue 15), the two read-modify-writes saved per side are ~0.03 µs of a
//! ~0.55 µs round trip. A contended `lock` spins 100 times, then yields the thread between
//! looks (no thread sleeps on it, so the release need not look for sleepers); the same choice
//! as UCX's thread-safe worker, whose lock is a spinlock.
//!
//! `RUSTFLAGS="--cfg fabric_loom" cargo test --release -p fabric-core --lib spin` runs the
//! loom model below (mutual exclusion, and the release publishing the holder's writes).
#![allow(unsafe_code)]
#![cfg_attr(fabric_loom, allow(dead_code))]

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

#[cfg(fabric_loom)]
use loom::{
    hint::spin_loop,
    sync::atomic::{AtomicBool, Ordering},
    thread::yield_now,
};
#[cfg(not(fabric_loom))]
use std::{
    hint::spin_loop,
    sync::atomic::{AtomicBool, Ordering},
    thread::yield_now,
};

/// Spins a little, then yields the thread, while another holder has it. A panic while it is
/// held releases it (the guard's drop runs on unwinding); there is no poisoning.
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and one guard exists at a time (the
// flag is taken with an acquire exchange and released with a release store).
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: as for a `Mutex<T>`: it owns `T`.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_slow();
        }
        SpinGuard { lock: self }
    }

    #[cold]
    fn lock_slow(&self) {
        let mut spins = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                if spins < 100 {
                    spin_loop();
                } else {
                    yield_now();
                }
                spins = spins.saturating_add(1);
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// Holds a [`SpinLock`]; releases it when dropped.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `SpinLock`).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one (see `SpinLock`).
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::SpinLock;
    use std::sync::Arc;

    #[test]
    fn holders_exclude_each_other() {
        // A plain (non-atomic) read-modify-write under the lock: a lock that let two
        // holders in at once would lose increments.
        let lock = Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        let mut g = lock.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 200_000);
    }

    #[test]
    fn a_panic_while_held_releases_it() {
        let lock = SpinLock::new(1u32);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = lock.lock();
            *g = 2;
            panic!("holder panics");
        }));
        assert!(r.is_err());
        // not left locked (this would spin for ever)
        assert_eq!(*lock.lock(), 2);
    }
}

#[cfg(all(test, fabric_loom))]
mod loom_tests {
    use super::SpinLock;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    #[test]
    fn loom_two_holders_never_overlap() {
        loom::model(|| {
            // The data the lock guards lives in a loom cell, so that loom reports any two
            // accesses the lock does not order.
            let shared = Arc::new((SpinLock::new(()), UnsafeCell::new(0u32)));
            let other = shared.clone();
            let t = loom::thread::spawn(move || {
                let _g = other.0.lock();
                // SAFETY: under the lock (what loom checks).
                other.1.with_mut(|v| unsafe { *v += 1 });
            });
            {
                let _g = shared.0.lock();
                // SAFETY: under the lock (what loom checks).
                shared.1.with_mut(|v| unsafe { *v += 1 });
            }
            t.join().unwrap();
            let _g = shared.0.lock();
            // SAFETY: under the lock, both holders done.
            assert_eq!(shared.1.with(|v| unsafe { *v }), 2);
        });
    }
}
