//! A reference-counted cache of open resources, keyed by what opened them.
//!
//! Used for legacy IPC mappings (re-opening a handle already open in this process returns
//! the existing mapping and costs a lock and a hash lookup) and for peer-access enables
//! (two guards for the same pair share one `cuCtxEnablePeerAccess`).
//!
//! The driver is called *under the lock* on first open and last close, so an open can never
//! race a close of the same key: a handle is never opened twice, and never closed while a
//! user still holds it. The loom model below (`--cfg nvlink_loom`) checks exactly that.

use std::collections::HashMap;
use std::hash::Hash;

#[cfg(nvlink_loom)]
use loom::sync::Mutex;
#[cfg(not(nvlink_loom))]
use std::sync::Mutex;

/// Hit/miss counters and the number of live entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Opens served from the cache.
    pub hits: u64,
    /// Opens that called the driver.
    pub misses: u64,
    /// Keys open now.
    pub entries: usize,
}

struct Inner<K, V> {
    map: HashMap<K, (usize, V)>,
    hits: u64,
    misses: u64,
}

/// Keyed, reference-counted resources. `V` is the small value the opener returns.
pub(crate) struct RefCache<K, V> {
    inner: Mutex<Inner<K, V>>,
}

impl<K: Eq + Hash + Clone, V: Copy> RefCache<K, V> {
    pub(crate) fn new() -> Self {
        RefCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                hits: 0,
                misses: 0,
            }),
        }
    }

    /// Returns the value for `key`, calling `open` only if no reference to it is held.
    /// The `bool` is true on a cache hit. On error nothing is recorded.
    pub(crate) fn acquire<E>(
        &self,
        key: &K,
        open: impl FnOnce() -> Result<V, E>,
    ) -> Result<(V, bool), E> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((refs, v)) = g.map.get_mut(key) {
            *refs += 1;
            let v = *v;
            g.hits += 1;
            return Ok((v, true));
        }
        let v = open()?;
        g.map.insert(key.clone(), (1, v));
        g.misses += 1;
        Ok((v, false))
    }

    /// Drops one reference to `key`; the last one calls `close` (under the lock).
    /// Returns whether `close` ran.
    pub(crate) fn release(&self, key: &K, close: impl FnOnce(V)) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let last = match g.map.get_mut(key) {
            Some((refs, _)) => {
                *refs -= 1;
                *refs == 0
            }
            None => return false,
        };
        if last {
            if let Some((_, v)) = g.map.remove(key) {
                close(v);
            }
        }
        last
    }

    /// Whether `key` is open now.
    pub(crate) fn contains(&self, key: &K) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.map.contains_key(key)
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        CacheStats {
            hits: g.hits,
            misses: g.misses,
            entries: g.map.len(),
        }
    }
}

#[cfg(all(test, not(nvlink_loom)))]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn opens_once_closes_once() {
        let cache: RefCache<u32, u64> = RefCache::new();
        let opens = Cell::new(0);
        let closes = Cell::new(0);
        let open = || {
            opens.set(opens.get() + 1);
            Ok::<_, ()>(0xabc)
        };
        assert_eq!(cache.acquire(&7, open).unwrap(), (0xabc, false));
        assert_eq!(cache.acquire(&7, open).unwrap(), (0xabc, true));
        assert_eq!(opens.get(), 1);
        assert!(!cache.release(&7, |_| closes.set(closes.get() + 1)));
        assert_eq!(closes.get(), 0);
        assert!(cache.contains(&7));
        assert!(cache.release(&7, |v| {
            assert_eq!(v, 0xabc);
            closes.set(closes.get() + 1)
        }));
        assert_eq!(closes.get(), 1);
        assert!(!cache.contains(&7));
        // Re-open after the last close calls the opener again.
        assert_eq!(cache.acquire(&7, open).unwrap(), (0xabc, false));
        assert_eq!(opens.get(), 2);
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.entries), (1, 2, 1));
    }

    #[test]
    fn failed_open_records_nothing() {
        let cache: RefCache<u32, u64> = RefCache::new();
        assert_eq!(cache.acquire(&1, || Err::<u64, _>("nope")), Err("nope"));
        assert!(!cache.contains(&1));
        assert_eq!(cache.stats(), CacheStats::default());
        // A release of an unknown key is a no-op, not an underflow.
        assert!(!cache.release(&1, |_| panic!("must not close")));
    }

    #[test]
    fn threads_share_one_open() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let cache = Arc::new(RefCache::<u32, u64>::new());
        let opens = Arc::new(AtomicUsize::new(0));
        let closes = Arc::new(AtomicUsize::new(0));
        let live = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, opens, closes, live) =
                    (cache.clone(), opens.clone(), closes.clone(), live.clone());
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        cache
                            .acquire(&1, || {
                                assert_eq!(live.fetch_add(1, Ordering::SeqCst), 0);
                                opens.fetch_add(1, Ordering::SeqCst);
                                Ok::<_, ()>(5)
                            })
                            .unwrap();
                        cache.release(&1, |_| {
                            assert_eq!(live.fetch_sub(1, Ordering::SeqCst), 1);
                            closes.fetch_add(1, Ordering::SeqCst);
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(opens.load(Ordering::SeqCst), closes.load(Ordering::SeqCst));
        assert_eq!(live.load(Ordering::SeqCst), 0);
        assert_eq!(cache.stats().entries, 0);
    }
}

/// `RUSTFLAGS="--cfg nvlink_loom" cargo test -p nvlink-p2p --lib cache::loom_model --release`
#[cfg(all(test, nvlink_loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::sync::Arc;

    #[test]
    fn never_opened_twice_never_closed_while_held() {
        loom::model(|| {
            let cache = Arc::new(RefCache::<u8, u8>::new());
            // Number of driver-level opens that are not yet closed: must stay 0 or 1.
            let live = Arc::new(AtomicUsize::new(0));
            // Number of users holding a reference: a close must only happen when it is 0.
            let holders = Arc::new(AtomicUsize::new(0));
            let worker = |cache: Arc<RefCache<u8, u8>>,
                          live: Arc<AtomicUsize>,
                          holders: Arc<AtomicUsize>| {
                move || {
                    let (v, _) = cache
                        .acquire(&0, || {
                            assert_eq!(live.fetch_add(1, Ordering::SeqCst), 0, "opened twice");
                            Ok::<_, ()>(42)
                        })
                        .unwrap();
                    assert_eq!(v, 42);
                    holders.fetch_add(1, Ordering::SeqCst);
                    holders.fetch_sub(1, Ordering::SeqCst);
                    cache.release(&0, |_| {
                        assert_eq!(holders.load(Ordering::SeqCst), 0, "closed while held");
                        assert_eq!(live.fetch_sub(1, Ordering::SeqCst), 1);
                    });
                }
            };
            let t1 = loom::thread::spawn(worker(cache.clone(), live.clone(), holders.clone()));
            let t2 = loom::thread::spawn(worker(cache.clone(), live.clone(), holders.clone()));
            t1.join().unwrap();
            t2.join().unwrap();
            assert_eq!(live.load(Ordering::SeqCst), 0, "leaked an open");
            assert_eq!(cache.stats().entries, 0);
        });
    }
}
