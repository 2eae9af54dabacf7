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
//! 4. `by_role[r]` holds exactly the entries of `order` whose role is `r`, in the same
//!    (key) order; `roles[s]` is the role of the key on slot `s`.

use hashbrown::HashMap;

use crate::error::{EngineError, Result};
use crate::ids::{WorkerId, WorkerKey};
use crate::sched::config::WorkerLoad;
use crate::sched::role::{Pool, WorkerRole};

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
    roles: Vec<WorkerRole>,
    by_role: [Vec<(WorkerKey, WorkerSlot)>; 3],
    free: Vec<WorkerSlot>,
}

/// Inserts `entry` into the key-sorted `list`.
fn insert_sorted(list: &mut Vec<(WorkerKey, WorkerSlot)>, entry: (WorkerKey, WorkerSlot)) {
    let at = list.partition_point(|(k, _)| *k < entry.0);
    list.insert(at, entry);
}

/// Removes `key`'s entry from the key-sorted `list`, if present.
fn remove_sorted(list: &mut Vec<(WorkerKey, WorkerSlot)>, key: WorkerKey) {
    if let Ok(at) = list.binary_search_by_key(&key, |(k, _)| *k) {
        list.remove(at);
    }
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

    /// The keys a call routed to `pool` chooses among: the first non-empty role list of
    /// [`Pool::roles`] (empty if none is).
    pub(crate) fn pool(&self, pool: Pool) -> &[(WorkerKey, WorkerSlot)] {
        pool.roles()
            .iter()
            .map(|r| self.by_role[r.index()].as_slice())
            .find(|l| !l.is_empty())
            .unwrap_or(&[])
    }

    /// Whether any key has `role`.
    pub(crate) fn has_role(&self, role: WorkerRole) -> bool {
        !self.by_role[role.index()].is_empty()
    }

    /// The role of the key on `slot`.
    pub(crate) fn role(&self, slot: WorkerSlot) -> WorkerRole {
        self.roles.get(slot.idx()).copied().unwrap_or_default()
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

    /// Registers `key` with `role`. Returns its new slot, or `None` if it was already
    /// registered (its role then becomes `role`).
    pub(crate) fn add(&mut self, key: WorkerKey, role: WorkerRole) -> Result<Option<WorkerSlot>> {
        if let Some(slot) = self.slot(key) {
            let old = self.role(slot);
            if old != role {
                remove_sorted(&mut self.by_role[old.index()], key);
                insert_sorted(&mut self.by_role[role.index()], (key, slot));
                if let Some(r) = self.roles.get_mut(slot.idx()) {
                    *r = role;
                }
            }
            return Ok(None);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let n = u32::try_from(self.loads.len()).map_err(|_| EngineError::TooManyWorkers)?;
                self.loads.push(None);
                self.roles.push(WorkerRole::default());
                WorkerSlot(n)
            }
        };
        self.slot_of.insert(key, slot);
        if let Some(r) = self.roles.get_mut(slot.idx()) {
            *r = role;
        }
        insert_sorted(&mut self.order, (key, slot));
        insert_sorted(&mut self.by_role[role.index()], (key, slot));
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
            let role = self.role(slot);
            remove_sorted(&mut self.by_role[role.index()], key);
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
            assert!(
                t.add(WorkerKey::new(w, r), WorkerRole::Aggregated)
                    .unwrap()
                    .is_some()
            );
        }
        assert!(
            t.add(WorkerKey::new(1, 0), WorkerRole::Aggregated)
                .unwrap()
                .is_none()
        );
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
        t.add(WorkerKey::new(7, 0), WorkerRole::Aggregated).unwrap();
        t.add(WorkerKey::new(8, 0), WorkerRole::Aggregated).unwrap();
        t.add(WorkerKey::new(9, 0), WorkerRole::Aggregated).unwrap();
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
        let slot = t.add(k, WorkerRole::Aggregated).unwrap().unwrap();
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

    #[test]
    fn pools_follow_roles_and_role_changes() {
        let mut t = WorkerTable::default();
        let (p1, p2, d1, a1) = (
            WorkerKey::new(1, 0),
            WorkerKey::new(2, 0),
            WorkerKey::new(3, 0),
            WorkerKey::new(4, 0),
        );
        t.add(p2, WorkerRole::Prefill).unwrap();
        t.add(p1, WorkerRole::Prefill).unwrap();
        t.add(d1, WorkerRole::Decode).unwrap();
        let keys = |l: &[(WorkerKey, WorkerSlot)]| l.iter().map(|(k, _)| *k).collect::<Vec<_>>();
        assert_eq!(keys(t.pool(Pool::Prefill)), [p1, p2]);
        assert_eq!(keys(t.pool(Pool::Decode)), [d1]);
        // No aggregated worker: whole requests go to decode workers.
        assert_eq!(keys(t.pool(Pool::Whole)), [d1]);
        assert!(!t.has_role(WorkerRole::Aggregated) && t.has_role(WorkerRole::Decode));
        t.add(a1, WorkerRole::Aggregated).unwrap();
        assert_eq!(keys(t.pool(Pool::Whole)), [a1]);
        // Re-registering with another role moves the key.
        assert!(t.add(p2, WorkerRole::Decode).unwrap().is_none());
        assert_eq!(keys(t.pool(Pool::Prefill)), [p1]);
        assert_eq!(keys(t.pool(Pool::Decode)), [p2, d1]);
        t.remove_worker(WorkerId(3));
        assert_eq!(keys(t.pool(Pool::Decode)), [p2]);
        assert_eq!(t.all().len(), 3);
        let slot = t
            .add(WorkerKey::new(5, 0), WorkerRole::Prefill)
            .unwrap()
            .unwrap();
        assert_eq!(
            t.role(slot),
            WorkerRole::Prefill,
            "a reused slot takes its new role"
        );
        assert_eq!(keys(t.pool(Pool::Prefill)), [p1, WorkerKey::new(5, 0)]);
    }
}
