//! The registry of worker keys a scheduler routes to, and the load each one reports.
//!
//! Keys get dense [`WorkerSlot`] numbers so that per-route scratch counters and per-worker
//! active load are vectors indexed by slot: scoring 1,024 candidates then costs no hash
//! lookups per candidate.
//!
//! # Invariants
//! 1. `order` holds every registered key exactly once with its slot, sorted by key (so by
//!    worker, then rank: one worker's ranks are contiguous); `slot_of[k] == s` iff `(k, s)` is
//!    in `order`.
//! 2. `loads[s]` is `None` for every free slot and for keys that never reported.
//! 3. A released slot goes on `free` and is reused before a new one is minted, so slot numbers
//!    stay below the peak number of registered keys.

use hashbrown::HashMap;

use crate::error::{EngineError, Result};
use crate::ids::{WorkerId, WorkerKey};
use crate::sched::config::WorkerLoad;

/// A registered worker key's dense number inside one scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct WorkerSlot(pub(crate) u32);

impl WorkerSlot {
    /// The slot as an index into per-slot vectors.
    #[inline]
    pub(crate) fn idx(self) -> usize {
        self.0 as usize
    }
}

/// Registered worker keys. Owned by the scheduler's thread.
#[derive(Debug, Default)]
pub(crate) struct WorkerTable {
    order: Vec<(WorkerKey, WorkerSlot)>,
    slot_of: HashMap<WorkerKey, WorkerSlot>,
    loads: Vec<Option<WorkerLoad>>,
    free: Vec<WorkerSlot>,
}

impl WorkerTable {
    /// Number of registered keys.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// One past the largest slot ever minted: the length per-slot vectors need.
    pub(crate) fn slot_bound(&self) -> usize {
        self.loads.len()
    }

    /// Every registered key with its slot, sorted by key.
    pub(crate) fn all(&self) -> &[(WorkerKey, WorkerSlot)] {
        &self.order
    }

    /// The registered ranks of `worker`, sorted by rank (empty if it is unknown).
    pub(crate) fn ranks(&self, worker: WorkerId) -> &[(WorkerKey, WorkerSlot)] {
        let lo = self.order.partition_point(|(k, _)| k.worker < worker);
        let hi = self.order.partition_point(|(k, _)| k.worker <= worker);
        self.order.get(lo..hi).unwrap_or(&[])
    }

    /// The slot of `key`, if registered.
    #[inline]
    pub(crate) fn slot(&self, key: WorkerKey) -> Option<WorkerSlot> {
        self.slot_of.get(&key).copied()
    }

    /// The last load `slot` reported.
    #[inline]
    pub(crate) fn load(&self, slot: WorkerSlot) -> Option<&WorkerLoad> {
        self.loads.get(slot.idx()).and_then(Option::as_ref)
    }

    /// Registers `key`. Returns its new slot, or `None` if it was already registered.
    pub(crate) fn add(&mut self, key: WorkerKey) -> Result<Option<WorkerSlot>> {
        if self.slot_of.contains_key(&key) {
            return Ok(None);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let n = u32::try_from(self.loads.len()).map_err(|_| EngineError::TooManyWorkers)?;
                self.loads.push(None);
                WorkerSlot(n)
            }
        };
        self.slot_of.insert(key, slot);
        let at = self.order.partition_point(|(k, _)| *k < key);
        self.order.insert(at, (key, slot));
        Ok(Some(slot))
    }

    /// Unregisters every rank of `worker` and returns them; their slots become free.
    ///
    /// The caller must drop any per-slot state of the returned slots before the slots are
    /// reused by a later [`WorkerTable::add`].
    pub(crate) fn remove_worker(&mut self, worker: WorkerId) -> Vec<(WorkerKey, WorkerSlot)> {
        let lo = self.order.partition_point(|(k, _)| k.worker < worker);
        let hi = self.order.partition_point(|(k, _)| k.worker <= worker);
        let removed: Vec<_> = self.order.drain(lo..hi).collect();
        for &(key, slot) in &removed {
            self.slot_of.remove(&key);
            if let Some(l) = self.loads.get_mut(slot.idx()) {
                *l = None;
            }
            self.free.push(slot);
        }
        removed
    }

    /// Records `key`'s latest load.
    pub(crate) fn set_load(&mut self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        load.validate()?;
        let slot = self
            .slot(key)
            .ok_or(EngineError::UnknownWorker { worker: key.worker })?;
        if let Some(l) = self.loads.get_mut(slot.idx()) {
            *l = Some(load);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_sorted_and_slots_are_reused() {
        let mut t = WorkerTable::default();
        for (w, r) in [(2, 0), (1, 1), (1, 0), (3, 0)] {
            assert!(t.add(WorkerKey::new(w, r)).unwrap().is_some());
        }
        assert!(t.add(WorkerKey::new(1, 0)).unwrap().is_none());
        let keys: Vec<_> = t.all().iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [(1, 0), (1, 1), (2, 0), (3, 0)].map(|(w, r)| WorkerKey::new(w, r))
        );
        assert_eq!(t.ranks(WorkerId(1)).len(), 2);
        assert!(t.ranks(WorkerId(9)).is_empty());

        let removed = t.remove_worker(WorkerId(1));
        assert_eq!(removed.len(), 2);
        assert_eq!(t.len(), 2);
        assert_eq!(t.slot_bound(), 4);
        t.add(WorkerKey::new(7, 0)).unwrap();
        t.add(WorkerKey::new(8, 0)).unwrap();
        t.add(WorkerKey::new(9, 0)).unwrap();
        assert_eq!(t.slot_bound(), 5, "two freed slots reused before minting");
    }

    #[test]
    fn load_of_unknown_or_invalid_is_rejected() {
        let mut t = WorkerTable::default();
        let k = WorkerKey::new(1, 0);
        let load = WorkerLoad {
            num_requests_waiting: 1,
            kv_usage: 0.5,
        };
        assert!(matches!(
            t.set_load(k, load),
            Err(EngineError::UnknownWorker { .. })
        ));
        let slot = t.add(k).unwrap().unwrap();
        t.set_load(k, load).unwrap();
        assert_eq!(t.load(slot), Some(&load));
        let nan = WorkerLoad {
            kv_usage: f64::NAN,
            ..load
        };
        assert!(t.set_load(k, nan).is_err());
        t.remove_worker(WorkerId(1));
        assert_eq!(t.load(slot), None);
    }
}
