//! Requests routed to a worker key and not finished yet, and the load they put on it.
//!
//! A request is added when it is routed, marked prefilled at its first token, and freed at
//! completion, or by [`ActiveRequests::expire`] once its deadline (`added + timeout`) has
//! passed. Per worker slot this keeps the two numbers the cost function needs:
//! * `active_blocks`: distinct seq hashes over the slot's active requests. Two requests that
//!   share a prefix share its KV blocks on the engine, so a shared block counts once: each
//!   block carries a per-slot reference count.
//! * `active_prefill_tokens`: over the slot's requests not yet prefilled, the tokens the
//!   engine still has to compute, `input_tokens - overlap_blocks * block_size` (floored at 0).
//!
//! # Invariants
//! 1. `holders[h]` names each slot at most once, sorted by slot, with a count > 0 equal to
//!    the number of occurrences of `h` in that slot's active requests; no `holders` entry is
//!    empty.
//! 2. `per_slot[s].load.active_blocks` equals the number of hashes whose holders name `s`.
//! 3. `per_slot[s].load.active_prefill_tokens` is the sum of `pending_prefill` over `s`'s
//!    active requests; `active_requests` and `per_slot[s].requests` count and name them.
//! 4. `deadlines` holds `(deadline, id)` for exactly the active requests with a deadline (a
//!    timeout too large to add to `now` means "never").
//! 5. Each operation costs O(blocks of the requests it touches) hash operations, plus a
//!    binary search (and a short memmove) in the holders of a block shared by many slots,
//!    plus O(log n) for `deadlines`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};

use crate::error::{EngineError, Result};
use crate::ids::{RequestId, SeqHash};
use crate::sched::workers::WorkerSlot;

/// The load a worker key's active requests put on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActiveLoad {
    /// Distinct blocks over the active requests (shared blocks count once).
    pub active_blocks: u64,
    /// Tokens still to prefill over the requests not yet prefilled.
    pub active_prefill_tokens: u64,
    /// Active requests.
    pub active_requests: u64,
}

/// Active requests of every worker slot. Owned by the scheduler's thread.
#[derive(Debug)]
pub(crate) struct ActiveRequests {
    block_size: u64,
    timeout: Duration,
    requests: HashMap<RequestId, Active>,
    per_slot: Vec<SlotActive>,
    holders: HashMap<SeqHash, Holders>,
    deadlines: BTreeSet<(Instant, RequestId)>,
}

#[derive(Debug, Default)]
struct SlotActive {
    load: ActiveLoad,
    requests: HashSet<RequestId>,
}

#[derive(Debug)]
struct Active {
    slot: WorkerSlot,
    blocks: Box<[SeqHash]>,
    /// Prefill tokens this request still adds to its slot; 0 once prefilled.
    pending_prefill: u64,
    deadline: Option<Instant>,
}

impl ActiveRequests {
    /// Tracks requests for engines with `block_size` tokens per block; requests expire after
    /// `timeout`.
    pub(crate) fn new(block_size: u32, timeout: Duration) -> Self {
        Self {
            block_size: u64::from(block_size),
            timeout,
            requests: HashMap::new(),
            per_slot: Vec::new(),
            holders: HashMap::new(),
            deadlines: BTreeSet::new(),
        }
    }

    /// Number of active requests.
    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether `id` is active.
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// The load on `slot` (zero for a slot with no requests).
    #[inline]
    pub(crate) fn load(&self, slot: WorkerSlot) -> ActiveLoad {
        self.per_slot
            .get(slot.idx())
            .map(|s| s.load)
            .unwrap_or_default()
    }

    /// For every slot holding one of `blocks` in an active request, adds to `counts[slot]`
    /// the number of `blocks` it holds, and records the slot in `touched` the first time.
    ///
    /// Caller guarantees `counts` is zero for slots not in `touched`; slots past the end of
    /// `counts` are skipped.
    pub(crate) fn count_held(
        &self,
        blocks: &[SeqHash],
        counts: &mut [u32],
        touched: &mut Vec<WorkerSlot>,
    ) {
        if self.holders.is_empty() {
            return;
        }
        for h in blocks {
            let Some(holders) = self.holders.get(h) else {
                continue;
            };
            for &(slot, _) in holders.as_slice() {
                if let Some(c) = counts.get_mut(slot.idx()) {
                    if *c == 0 {
                        touched.push(slot);
                    }
                    *c = c.saturating_add(1);
                }
            }
        }
    }

    /// Records `id` as active on `slot` from `now`.
    ///
    /// `overlap_blocks` is the prefix the engine already caches: those tokens need no prefill.
    pub(crate) fn add(
        &mut self,
        now: Instant,
        slot: WorkerSlot,
        id: RequestId,
        blocks: &[SeqHash],
        input_tokens: u64,
        overlap_blocks: u32,
    ) -> Result<()> {
        if self.requests.contains_key(&id) {
            return Err(EngineError::DuplicateRequest(id));
        }
        if self.per_slot.len() <= slot.idx() {
            self.per_slot
                .resize_with(slot.idx() + 1, SlotActive::default);
        }
        let Some(per) = self.per_slot.get_mut(slot.idx()) else {
            return Err(EngineError::NoWorkers);
        };
        let cached_tokens = u64::from(overlap_blocks).saturating_mul(self.block_size);
        let pending_prefill = input_tokens.saturating_sub(cached_tokens);
        for &h in blocks {
            let new_for_slot = match self.holders.entry(h) {
                hashbrown::hash_map::Entry::Occupied(mut e) => e.get_mut().add(slot),
                hashbrown::hash_map::Entry::Vacant(e) => {
                    e.insert(Holders::One([(slot, 1)]));
                    true
                }
            };
            if new_for_slot {
                per.load.active_blocks += 1;
            }
        }
        per.load.active_prefill_tokens = per
            .load
            .active_prefill_tokens
            .saturating_add(pending_prefill);
        per.load.active_requests += 1;
        per.requests.insert(id);
        let deadline = now.checked_add(self.timeout);
        if let Some(d) = deadline {
            self.deadlines.insert((d, id));
        }
        self.requests.insert(
            id,
            Active {
                slot,
                blocks: blocks.into(),
                pending_prefill,
                deadline,
            },
        );
        Ok(())
    }

    /// Marks `id` prefilled: its tokens no longer count as pending prefill. Idempotent.
    pub(crate) fn prefilled(&mut self, id: RequestId) -> Result<()> {
        let active = self
            .requests
            .get_mut(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        let pending = std::mem::take(&mut active.pending_prefill);
        if let Some(per) = self.per_slot.get_mut(active.slot.idx()) {
            per.load.active_prefill_tokens = per.load.active_prefill_tokens.saturating_sub(pending);
        }
        Ok(())
    }

    /// Frees `id` and returns the slot it was active on.
    pub(crate) fn free(&mut self, id: RequestId) -> Result<WorkerSlot> {
        let active = self
            .requests
            .remove(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        if let Some(d) = active.deadline {
            self.deadlines.remove(&(d, id));
        }
        let slot = active.slot;
        self.release(id, active);
        Ok(slot)
    }

    /// Frees every request whose deadline is at or before `now`; returns their ids, oldest
    /// first.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        let mut expired = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(active) = self.requests.remove(&id) {
                self.release(id, active);
            }
            expired.push(id);
        }
        expired
    }

    /// Frees every request on `slot` (its worker is going away); returns how many.
    pub(crate) fn drop_slot(&mut self, slot: WorkerSlot) -> usize {
        let Some(per) = self.per_slot.get_mut(slot.idx()) else {
            return 0;
        };
        let ids: Vec<RequestId> = per.requests.drain().collect();
        let n = ids.len();
        for id in ids {
            // `free` cannot fail here: invariant 3 says every id in the set is active.
            let _ = self.free(id);
        }
        if let Some(per) = self.per_slot.get_mut(slot.idx()) {
            // Drop the set's allocation: the slot may stay unused for a long time.
            *per = SlotActive::default();
        }
        n
    }

    /// Undoes everything `add` (and `prefilled`) did for `active`, except its deadline.
    fn release(&mut self, id: RequestId, active: Active) {
        let slot = active.slot;
        let Some(per) = self.per_slot.get_mut(slot.idx()) else {
            return;
        };
        for h in active.blocks.iter() {
            let hashbrown::hash_map::EntryRef::Occupied(mut e) = self.holders.entry_ref(h) else {
                continue;
            };
            match e.get_mut().release(slot) {
                Released::Held => {}
                Released::SlotGone => {
                    per.load.active_blocks = per.load.active_blocks.saturating_sub(1)
                }
                Released::Empty => {
                    per.load.active_blocks = per.load.active_blocks.saturating_sub(1);
                    e.remove();
                }
            }
        }
        per.load.active_prefill_tokens = per
            .load
            .active_prefill_tokens
            .saturating_sub(active.pending_prefill);
        per.load.active_requests = per.load.active_requests.saturating_sub(1);
        per.requests.remove(&id);
        shrink_if_sparse(&mut per.requests);
        shrink_if_sparse(&mut self.requests);
        shrink_if_sparse(&mut self.holders);
    }

    /// Recomputes every per-slot number from the requests and checks invariants 1-4.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let mut counts: HashMap<(SeqHash, WorkerSlot), u32> = HashMap::new();
        let mut want: Vec<ActiveLoad> = vec![ActiveLoad::default(); self.per_slot.len()];
        for (id, a) in &self.requests {
            for &h in a.blocks.iter() {
                *counts.entry((h, a.slot)).or_default() += 1;
            }
            let w = &mut want[a.slot.idx()];
            w.active_prefill_tokens += a.pending_prefill;
            w.active_requests += 1;
            assert!(self.per_slot[a.slot.idx()].requests.contains(id));
            if let Some(d) = a.deadline {
                assert!(self.deadlines.contains(&(d, *id)));
            }
        }
        for &(_, slot) in counts.keys() {
            want[slot.idx()].active_blocks += 1;
        }
        let mut held = 0;
        for (h, holders) in &self.holders {
            assert!(!holders.as_slice().is_empty());
            assert!(holders.as_slice().windows(2).all(|p| p[0].0 < p[1].0));
            for &(slot, n) in holders.as_slice() {
                assert_eq!(counts.get(&(*h, slot)), Some(&n), "holder count of {h}");
                held += 1;
            }
        }
        assert_eq!(held, counts.len());
        for (s, per) in self.per_slot.iter().enumerate() {
            assert_eq!(per.load, want[s], "slot {s}");
            assert_eq!(per.requests.len() as u64, want[s].active_requests);
        }
        assert_eq!(
            self.deadlines.len(),
            self.requests
                .values()
                .filter(|a| a.deadline.is_some())
                .count()
        );
    }
}

/// Slots holding one block in active requests, with reference counts. One holder is the
/// common case and needs no allocation; `Many` is sorted by slot, so a block every worker
/// holds (a shared system prompt) costs a binary search, not a scan, per reference.
#[derive(Debug)]
enum Holders {
    One([(WorkerSlot, u32); 1]),
    Many(Vec<(WorkerSlot, u32)>),
}

/// What releasing one reference left behind.
enum Released {
    /// The slot still holds the block.
    Held,
    /// The slot no longer holds it; others do.
    SlotGone,
    /// Nobody holds it: drop the entry.
    Empty,
}

impl Holders {
    fn as_slice(&self) -> &[(WorkerSlot, u32)] {
        match self {
            Holders::One(one) => one,
            Holders::Many(v) => v,
        }
    }

    /// Adds a reference from `slot`; true if `slot` did not hold the block before.
    fn add(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Holders::One([(s, n)]) if *s == slot => {
                *n += 1;
                false
            }
            Holders::One([first]) => {
                let mut v = vec![*first, (slot, 1)];
                v.sort_unstable_by_key(|&(s, _)| s);
                *self = Holders::Many(v);
                true
            }
            Holders::Many(v) => match v.binary_search_by_key(&slot, |&(s, _)| s) {
                Ok(i) => {
                    if let Some((_, n)) = v.get_mut(i) {
                        *n += 1;
                    }
                    false
                }
                Err(i) => {
                    v.insert(i, (slot, 1));
                    true
                }
            },
        }
    }

    /// Drops a reference from `slot` (no-op if it holds none).
    fn release(&mut self, slot: WorkerSlot) -> Released {
        match self {
            Holders::One([(s, n)]) if *s == slot => {
                *n -= 1;
                if *n == 0 {
                    Released::Empty
                } else {
                    Released::Held
                }
            }
            Holders::One(_) => Released::Held,
            Holders::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&slot, |&(s, _)| s) else {
                    return Released::Held;
                };
                let gone = match v.get_mut(i) {
                    Some((_, n)) => {
                        *n -= 1;
                        *n == 0
                    }
                    None => false,
                };
                if !gone {
                    return Released::Held;
                }
                v.remove(i);
                match v.as_slice() {
                    [] => Released::Empty,
                    // Back to the inline form so a once-hot block stops costing a Vec.
                    [only] => {
                        *self = Holders::One([*only]);
                        Released::SlotGone
                    }
                    _ => Released::SlotGone,
                }
            }
        }
    }
}

/// Gives back memory after a burst: a map a quarter full shrinks to half full.
fn shrink_if_sparse<M: Sparse>(m: &mut M) {
    if m.capacity() > 64 && m.len() * 4 < m.capacity() {
        m.shrink_to(m.len() * 2);
    }
}

trait Sparse {
    fn len(&self) -> usize;
    fn capacity(&self) -> usize;
    fn shrink_to(&mut self, n: usize);
}

impl<K: Eq + std::hash::Hash, V> Sparse for HashMap<K, V> {
    fn len(&self) -> usize {
        HashMap::len(self)
    }
    fn capacity(&self) -> usize {
        HashMap::capacity(self)
    }
    fn shrink_to(&mut self, n: usize) {
        HashMap::shrink_to(self, n)
    }
}

impl<K: Eq + std::hash::Hash> Sparse for HashSet<K> {
    fn len(&self) -> usize {
        HashSet::len(self)
    }
    fn capacity(&self) -> usize {
        HashSet::capacity(self)
    }
    fn shrink_to(&mut self, n: usize) {
        HashSet::shrink_to(self, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn hs(v: &[u64]) -> Vec<SeqHash> {
        v.iter().copied().map(SeqHash).collect()
    }

    #[test]
    fn shared_blocks_count_once_and_prefill_floors_at_zero() {
        let now = Instant::now();
        let s = WorkerSlot(0);
        let mut a = ActiveRequests::new(16, Duration::from_secs(10));
        a.add(now, s, RequestId(1), &hs(&[1, 2, 3]), 48, 1).unwrap();
        a.add(now, s, RequestId(2), &hs(&[1, 2, 4, 5]), 64, 0)
            .unwrap();
        let l = a.load(s);
        assert_eq!(l.active_blocks, 5);
        assert_eq!(l.active_prefill_tokens, 32 + 64);
        a.add(now, s, RequestId(3), &hs(&[9]), 10, 4).unwrap();
        assert_eq!(
            a.load(s).active_prefill_tokens,
            96,
            "overlap beyond input adds nothing"
        );
        a.check_invariants();
        a.free(RequestId(1)).unwrap();
        assert_eq!(
            a.load(s).active_blocks,
            5,
            "1 and 2 still held by request 2"
        );
        a.check_invariants();
    }

    #[test]
    fn randomized_operations_keep_invariants() {
        let mut rng = SmallRng::seed_from_u64(7);
        let t0 = Instant::now();
        let mut a = ActiveRequests::new(4, Duration::from_secs(50));
        let mut live: Vec<RequestId> = Vec::new();
        for step in 0..4000u64 {
            let now = t0 + Duration::from_secs(step / 10);
            match rng.random_range(0..10) {
                0..=4 => {
                    let id = RequestId(step);
                    let n = rng.random_range(0..6);
                    let blocks: Vec<SeqHash> =
                        (0..n).map(|_| SeqHash(rng.random_range(0..12))).collect();
                    let slot = WorkerSlot(rng.random_range(0..4));
                    a.add(
                        now,
                        slot,
                        id,
                        &blocks,
                        rng.random_range(0..40),
                        rng.random_range(0..4),
                    )
                    .unwrap();
                    live.push(id);
                }
                5 if !live.is_empty() => {
                    let id = live[rng.random_range(0..live.len())];
                    a.prefilled(id).unwrap();
                }
                6..=7 if !live.is_empty() => {
                    let id = live.swap_remove(rng.random_range(0..live.len()));
                    a.free(id).unwrap();
                }
                8 => {
                    for id in a.expire(now) {
                        live.retain(|x| *x != id);
                    }
                }
                9 if rng.random_range(0..20) == 0 => {
                    a.drop_slot(WorkerSlot(rng.random_range(0..4)));
                    live.retain(|id| a.contains(*id));
                }
                _ => {}
            }
            a.check_invariants();
        }
        for id in live {
            a.free(id).unwrap();
        }
        a.check_invariants();
        assert!(a.holders.is_empty() && a.deadlines.is_empty() && a.len() == 0);
        for s in 0..4 {
            assert_eq!(a.load(WorkerSlot(s)), ActiveLoad::default());
        }
    }
}
