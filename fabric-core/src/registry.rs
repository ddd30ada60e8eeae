//! A domain's registration table as a deterministic core with no I/O: ids with
//! generations, reused after release, and the target-side check of a peer's key.
//!
//! An id names a slot; each release bumps the slot's generation, so a key of a dropped
//! region (same id, older generation) is refused even after the id is reused, and the
//! table never holds more slots than the most regions that were alive at once.
//!
//! [`SharedRegistry`] is the table as a domain shares it between threads: registration,
//! revocation (a region's drop) and the target-side lookup of a peer's key. Its lock comes
//! from the `sync` shim, so `tests/loom_registry.rs` runs this very code under loom.

use std::sync::{Arc, Weak};

use crate::region::{check_range, Access};
use crate::sync::{Mutex, MutexGuard};
use crate::transport::Status;

/// What a live registration promises a peer.
#[derive(Debug, Clone)]
pub struct Entry<T> {
    /// The random capability value a key must carry.
    pub key: u64,
    /// Access granted.
    pub access: Access,
    /// Length in bytes.
    pub len: u64,
    /// The owner's payload (the region, weakly).
    pub value: T,
}

#[derive(Debug)]
struct Slot<T> {
    gen: u32,
    /// Reserved (id handed out) and not yet released.
    taken: bool,
    entry: Option<Entry<T>>,
}

/// Registration ids with generations.
#[derive(Debug)]
pub struct Registry<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

impl<T> Registry<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands out an id and its generation (the most recently freed id first). `None` when
    /// 2^32 ids are live.
    pub fn reserve(&mut self) -> Option<(u32, u32)> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = u32::try_from(self.slots.len()).ok()?;
                self.slots.push(Slot {
                    gen: 0,
                    taken: false,
                    entry: None,
                });
                id
            }
        };
        let slot = &mut self.slots[id as usize];
        slot.taken = true;
        self.live += 1;
        Some((id, slot.gen))
    }

    /// Publishes the registration behind a reserved `(id, gen)`; `false` (and nothing
    /// changes) when that pair is not reserved.
    pub fn publish(&mut self, id: u32, gen: u32, entry: Entry<T>) -> bool {
        match self.slots.get_mut(id as usize) {
            Some(s) if s.taken && s.gen == gen && s.entry.is_none() => {
                s.entry = Some(entry);
                true
            }
            _ => false,
        }
    }

    /// Releases `(id, gen)`: the id is free again with the next generation. Returns the
    /// entry if it was published; `None` (and nothing changes) for a pair that is not
    /// reserved (double release, stale generation).
    pub fn release(&mut self, id: u32, gen: u32) -> Option<Entry<T>> {
        let s = self.slots.get_mut(id as usize)?;
        if !s.taken || s.gen != gen {
            return None;
        }
        s.taken = false;
        s.gen = s.gen.wrapping_add(1);
        self.live -= 1;
        self.free.push(id);
        s.entry.take()
    }

    /// Whether `(id, gen)` is reserved (published or not) and not released.
    pub fn is_reserved(&self, id: u32, gen: u32) -> bool {
        matches!(self.slots.get(id as usize), Some(s) if s.taken && s.gen == gen)
    }

    /// The published entry behind `(id, gen)`.
    pub fn get(&self, id: u32, gen: u32) -> Option<&Entry<T>> {
        let s = self.slots.get(id as usize)?;
        if s.gen != gen {
            return None;
        }
        s.entry.as_ref()
    }

    /// Target-side check of a peer's access: the id is live with this generation, the key
    /// matches, the access was granted and `[off, off + len)` lies inside.
    ///
    /// # Errors
    /// [`Status::RemoteAccess`] for any failure.
    pub fn check(
        &self,
        id: u32,
        gen: u32,
        key: u64,
        off: u64,
        len: u64,
        need: Access,
    ) -> Result<&Entry<T>, Status> {
        let e = self.get(id, gen).ok_or(Status::RemoteAccess)?;
        if e.key != key || !e.access.contains(need) {
            return Err(Status::RemoteAccess);
        }
        check_range(off, len, e.len).map_err(|_| Status::RemoteAccess)?;
        Ok(e)
    }

    /// Ids reserved and not released.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Slots the table holds (the most ids that were live at once).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Live published entries as `(id, gen, entry)`.
    pub fn entries(&self) -> impl Iterator<Item = (u32, u32, &Entry<T>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.entry.as_ref().map(|e| (i as u32, s.gen, e)))
    }
}

/// A registration table shared by a domain's threads: the regions are held weakly (a
/// region's last handle going away revokes it through [`release`](Self::release), called
/// from the region's drop), and [`lookup`](Self::lookup) hands a peer's access a strong
/// handle, so a region found live stays alive for the access.
///
/// What it guarantees (checked under loom by `tests/loom_registry.rs`): once a region's
/// release has run, no lookup with its key succeeds, even after its id is reused; an id
/// comes back only with a new generation; nothing is left in the table once every region is
/// gone.
#[derive(Debug)]
pub struct SharedRegistry<T> {
    table: Mutex<Registry<Weak<T>>>,
}

impl<T> Default for SharedRegistry<T> {
    fn default() -> Self {
        SharedRegistry {
            table: Mutex::new(Registry::new()),
        }
    }
}

impl<T> SharedRegistry<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Registry<Weak<T>>> {
        // A panic while holding the lock leaves the table consistent (every update is one
        // call on the table, which does not panic halfway), so a poisoned lock is taken over.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An id and its generation for a new registration; `None` when 2^32 are live.
    pub fn reserve(&self) -> Option<(u32, u32)> {
        self.lock().reserve()
    }

    /// Publishes `value` (weakly) behind a reserved `(id, gen)`; `false` when the pair is
    /// not reserved or already published.
    pub fn publish(
        &self,
        id: u32,
        gen: u32,
        key: u64,
        access: Access,
        len: u64,
        value: &Arc<T>,
    ) -> bool {
        self.lock().publish(
            id,
            gen,
            Entry {
                key,
                access,
                len,
                value: Arc::downgrade(value),
            },
        )
    }

    /// Releases `(id, gen)` (a region's drop, or a registration that failed before it was
    /// published): lookups with it fail from now on and the id is free again with the next
    /// generation. `false` when the pair was not reserved (double release, stale).
    pub fn release(&self, id: u32, gen: u32) -> bool {
        let mut table = self.lock();
        let was = table.is_reserved(id, gen);
        let entry = table.release(id, gen);
        drop(table);
        // The weak handle goes outside the lock.
        drop(entry);
        was
    }

    /// Target-side check of a peer's access ([`Registry::check`]) and a strong handle to
    /// the region, upgraded outside the lock: a region whose last handle went away
    /// meanwhile (its release is on its way) fails here.
    ///
    /// # Errors
    /// [`Status::RemoteAccess`] for an unknown, stale or revoked key, missing access, a
    /// range outside the region, or a region being dropped.
    pub fn lookup(
        &self,
        id: u32,
        gen: u32,
        key: u64,
        off: u64,
        len: u64,
        need: Access,
    ) -> Result<Arc<T>, Status> {
        let weak = self
            .lock()
            .check(id, gen, key, off, len, need)?
            .value
            .clone();
        weak.upgrade().ok_or(Status::RemoteAccess)
    }

    /// Ids reserved and not released.
    pub fn live(&self) -> usize {
        self.lock().live()
    }

    /// Slots the table holds (the most ids that were live at once).
    pub fn capacity(&self) -> usize {
        self.lock().capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u64) -> Entry<()> {
        Entry {
            key,
            access: Access::REMOTE_WRITE,
            len: 64,
            value: (),
        }
    }

    #[test]
    fn ids_are_reused_with_a_new_generation_and_stale_keys_are_refused() {
        let mut r = Registry::new();
        let (a, ga) = r.reserve().unwrap();
        assert!(r.publish(a, ga, entry(7)));
        assert!(r.check(a, ga, 7, 0, 64, Access::REMOTE_WRITE).is_ok());
        assert!(
            r.check(a, ga, 8, 0, 8, Access::REMOTE_WRITE).is_err(),
            "key"
        );
        assert!(
            r.check(a, ga, 7, 60, 8, Access::REMOTE_WRITE).is_err(),
            "range"
        );
        assert!(
            r.check(a, ga, 7, 0, 8, Access::REMOTE_READ).is_err(),
            "access"
        );
        assert!(r.release(a, ga).is_some());
        assert!(r.release(a, ga).is_none(), "double release");
        assert!(
            r.check(a, ga, 7, 0, 8, Access::REMOTE_WRITE).is_err(),
            "revoked"
        );
        let (b, gb) = r.reserve().unwrap();
        assert_eq!(b, a, "id reused");
        assert_ne!(gb, ga, "with a new generation");
        assert!(r.publish(b, gb, entry(7)));
        assert!(
            r.check(a, ga, 7, 0, 8, Access::REMOTE_WRITE).is_err(),
            "an old key with the same id and value is refused by its generation"
        );
        assert!(!r.publish(b, gb, entry(9)), "published twice");
        assert_eq!(r.live(), 1);
    }

    #[test]
    fn a_million_registrations_keep_the_table_bounded() {
        let mut r = Registry::new();
        let mut held = Vec::new();
        for i in 0..1_000_000u64 {
            let (id, gen) = r.reserve().unwrap();
            assert!(r.publish(id, gen, entry(i)));
            held.push((id, gen));
            if held.len() > 3 {
                let (id, gen) = held.remove(0);
                assert!(r.release(id, gen).is_some());
            }
        }
        assert_eq!(r.live(), 3);
        assert!(r.capacity() <= 4, "capacity {}", r.capacity());
    }
}
