//! Requests routed to a worker key and not finished yet, and the load they put on it.
//!
//! A request is added when it is routed, marked prefilled at its first token, and freed at
//! completion, or by [`ActiveRequests::expire`] once its deadline (`added + timeout`) has
//! passed. Per worker slot this keeps the two numbers the cost function needs:
//! * `active_blocks`: distinct seq hashes over the slot's active requests. Two requests that
//!   share a prefix share its KV blocks on the engine, so a shared block counts once.
//! * `active_prefill_tokens`: over the slot's requests not yet prefilled, the tokens the
//!   engine still has to compute, `input_tokens - overlap_blocks * block_size` (floored at 0).
//!
//! A request's blocks are a chain (precondition 6), so a slot's active blocks form a tree of
//! prefixes: a block is active on the slot iff an active request ends at it or one of its
//! children is active there. Each active (block, slot) keeps those two counts ([`Hold`]), not
//! a reference per request: adding a request touches only the blocks the slot did not hold
//! yet (found by binary search along the chain), freeing it only the blocks it was the last
//! to hold. A prompt that shares most of its blocks with requests already active (a system
//! prompt, the next turn of a chat) costs O(log blocks), not O(blocks). Measured on
//! `/v1/route` with 500-block prompts: per-block reference counts (add, free, and a scan
//! for the held count) were 20% of the router's CPU, all of it under the routing lock.
//!
//! # Invariants
//! 1. `holders[h]` names each slot at most once, sorted by slot; slot `s` is named iff `h`
//!    is in an active request of `s`, with `ends` = the number of `s`'s active requests whose
//!    last block is `h` and `kids` = the number of distinct blocks that follow `h` in `s`'s
//!    active requests; no `holders` entry is empty.
//! 2. `per_slot[s].load.active_blocks` equals the number of hashes whose holders name `s`.
//! 3. `per_slot[s].load.active_prefill_tokens` is the sum of `pending_prefill` over `s`'s
//!    active requests; `active_requests` and `per_slot[s].requests` count and name them.
//! 4. `deadlines` holds `(deadline, id)` for exactly the active requests with a deadline (a
//!    timeout too large to add to `now` means "never").
//! 5. Adding a request costs O(log blocks) hash lookups plus one insert per block its slot
//!    did not hold; freeing one, one lookup plus one per block no longer held;
//!    [`ActiveRequests::count_held`], O(log blocks) per slot holding the first block. Each
//!    lookup includes a binary search in the holders of a block many slots share; O(log n)
//!    for `deadlines`.
//! 6. Precondition, not checked: a request's blocks are its prompt's chain of seq hashes
//!    from the first block (each names its whole prefix), as [`crate::hash`] computes them.
//!    Hence a slot that holds a block holds every block before it in any chain naming it,
//!    and no chain names a block twice. Input that breaks it gives wrong counts, never a
//!    panic (counts saturate).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};

use crate::error::{EngineError, Result};
use crate::ids::{RequestId, SeqHash};
use crate::sched::drain::Predicted;
use crate::sched::ttft::Prefill;
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
    /// What its slot looked like when it was routed, for the TTFT fit; taken (`None`) at
    /// its first token.
    routed: Option<Routed>,
}

/// A request at routing time: what its time to first token is explained by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Routed {
    /// When it was added.
    pub at: Instant,
    /// Its prefill as the TTFT model saw it.
    pub prefill: Prefill,
    /// When its prefill was predicted to end ([`crate::sched::drain`]).
    pub done: Predicted,
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

    /// `id`'s slot, blocks and the prefill tokens it still adds, if it is active.
    pub(crate) fn get(&self, id: RequestId) -> Option<(WorkerSlot, &[SeqHash], u64)> {
        self.requests
            .get(&id)
            .map(|a| (a.slot, &a.blocks[..], a.pending_prefill))
    }

    /// The load on `slot` (zero for a slot with no requests).
    #[inline]
    pub(crate) fn load(&self, slot: WorkerSlot) -> ActiveLoad {
        self.per_slot
            .get(slot.idx())
            .map(|s| s.load)
            .unwrap_or_default()
    }

    /// For every slot holding some of `blocks` in active requests, adds to `counts[slot]`
    /// the number of `blocks` it holds, and records the slot in `touched` the first time.
    ///
    /// What a slot holds is a prefix of `blocks` (precondition 6), found by binary search.
    ///
    /// Caller guarantees `counts` is zero for slots not in `touched`; slots past the end of
    /// `counts` are skipped.
    pub(crate) fn count_held(
        &self,
        blocks: &[SeqHash],
        counts: &mut [u32],
        touched: &mut Vec<WorkerSlot>,
    ) {
        let Some(first) = blocks.first().and_then(|h| self.holders.get(h)) else {
            return;
        };
        for &(slot, _) in first.as_slice() {
            let Some(c) = counts.get_mut(slot.idx()) else {
                continue;
            };
            let held = self.held_prefix(blocks, slot);
            if held > 0 {
                if *c == 0 {
                    touched.push(slot);
                }
                *c = c.saturating_add(u32::try_from(held).unwrap_or(u32::MAX));
            }
        }
    }

    /// How many leading blocks of `blocks` `slot` holds: the slot holds `blocks[i]` only if
    /// it holds every block before it (precondition 6), so this is a binary search.
    fn held_prefix(&self, blocks: &[SeqHash], slot: WorkerSlot) -> usize {
        let holds = |i: usize| blocks.get(i).is_some_and(|h| self.hold(h, slot).is_some());
        if !holds(0) {
            return 0;
        }
        // The slot holds blocks[lo]; it does not hold blocks[hi] (or hi is the end).
        let (mut lo, mut hi) = (0usize, blocks.len());
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if holds(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo + 1
    }

    /// What `slot` keeps for `h`, if it holds it.
    fn hold(&self, h: &SeqHash, slot: WorkerSlot) -> Option<Hold> {
        self.holders.get(h).and_then(|hs| hs.get(slot))
    }

    /// Changes what `slot` keeps for `h` (no-op if it does not hold it).
    fn update(&mut self, h: &SeqHash, slot: WorkerSlot, f: impl FnOnce(&mut Hold)) {
        if let Some(hold) = self.holders.get_mut(h).and_then(|hs| hs.get_mut(slot)) {
            f(hold);
        }
    }

    /// Records `id` as active on `slot` from `now`, its prefill predicted to end as
    /// `done` says.
    ///
    /// `overlap_blocks` is the prefix the engine already caches: those tokens need no prefill.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add(
        &mut self,
        now: Instant,
        slot: WorkerSlot,
        id: RequestId,
        blocks: &[SeqHash],
        input_tokens: u64,
        overlap_blocks: u32,
        done: Predicted,
    ) -> Result<()> {
        if self.requests.contains_key(&id) {
            return Err(EngineError::DuplicateRequest(id));
        }
        if self.per_slot.len() <= slot.idx() {
            self.per_slot
                .resize_with(slot.idx() + 1, SlotActive::default);
        }
        let cached_tokens = u64::from(overlap_blocks).saturating_mul(self.block_size);
        let pending_prefill = input_tokens.saturating_sub(cached_tokens);
        // Blocks the slot did not hold become active, each a new child of the one before.
        let held = self.held_prefix(blocks, slot);
        let mut added = 0u64;
        for (i, h) in blocks.iter().enumerate().skip(held) {
            let new = match self.holders.entry(*h) {
                hashbrown::hash_map::Entry::Occupied(mut e) => e.get_mut().insert(slot),
                hashbrown::hash_map::Entry::Vacant(e) => {
                    e.insert(Holders::One([(slot, Hold::default())]));
                    true
                }
            };
            if new {
                added += 1;
                if let Some(parent) = i.checked_sub(1).and_then(|p| blocks.get(p)) {
                    self.update(parent, slot, |p| p.kids = p.kids.saturating_add(1));
                }
            }
        }
        if let Some(last) = blocks.last() {
            self.update(last, slot, |l| l.ends = l.ends.saturating_add(1));
        }
        let Some(per) = self.per_slot.get_mut(slot.idx()) else {
            return Err(EngineError::NoWorkers);
        };
        per.load.active_blocks += added;
        per.load.active_prefill_tokens = per
            .load
            .active_prefill_tokens
            .saturating_add(pending_prefill);
        let routed = Routed {
            at: now,
            prefill: Prefill {
                tokens: pending_prefill,
                cached: cached_tokens.min(input_tokens),
                batch_blocks: per.load.active_blocks,
            },
            done,
        };
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
                routed: Some(routed),
            },
        );
        Ok(())
    }

    /// Marks `id` prefilled: its tokens no longer count as pending prefill. Idempotent.
    pub(crate) fn prefilled(&mut self, id: RequestId) -> Result<()> {
        self.first_token(id).map(|_| ())
    }

    /// [`Self::prefilled`], returning `id`'s slot and what it looked like at routing the
    /// first time only (`None` after).
    pub(crate) fn first_token(&mut self, id: RequestId) -> Result<Option<(WorkerSlot, Routed)>> {
        let active = self
            .requests
            .get_mut(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        let routed = active.routed.take().map(|r| (active.slot, r));
        let pending = std::mem::take(&mut active.pending_prefill);
        if let Some(per) = self.per_slot.get_mut(active.slot.idx()) {
            per.load.active_prefill_tokens = per.load.active_prefill_tokens.saturating_sub(pending);
        }
        Ok(routed)
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

    /// Moves `id`'s deadline to `deadline` (a reservation that lives shorter than the
    /// configured timeout).
    pub(crate) fn set_deadline(&mut self, id: RequestId, deadline: Instant) -> Result<()> {
        let active = self
            .requests
            .get_mut(&id)
            .ok_or(EngineError::UnknownRequest(id))?;
        if let Some(old) = active.deadline.replace(deadline) {
            self.deadlines.remove(&(old, id));
        }
        self.deadlines.insert((deadline, id));
        Ok(())
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
        let blocks = &active.blocks;
        if let Some(last) = blocks.last() {
            self.update(last, slot, |l| l.ends = l.ends.saturating_sub(1));
        }
        // From the last block up, drop what nothing holds any more; stop at the first block
        // still held (every block before it is then held too).
        let mut dropped = 0u64;
        for (i, h) in blocks.iter().enumerate().rev() {
            let hashbrown::hash_map::EntryRef::Occupied(mut e) = self.holders.entry_ref(h) else {
                break;
            };
            match e.get().get(slot) {
                Some(hold) if hold.unused() => {}
                _ => break,
            }
            if e.get_mut().remove(slot) {
                e.remove();
            }
            dropped += 1;
            if let Some(parent) = i.checked_sub(1).and_then(|p| blocks.get(p)) {
                self.update(parent, slot, |p| p.kids = p.kids.saturating_sub(1));
            }
        }
        let Some(per) = self.per_slot.get_mut(slot.idx()) else {
            return;
        };
        per.load.active_blocks = per.load.active_blocks.saturating_sub(dropped);
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
        let mut want_holds: HashMap<(SeqHash, WorkerSlot), Hold> = HashMap::new();
        let mut edges: HashSet<(SeqHash, SeqHash, WorkerSlot)> = HashSet::new();
        let mut want: Vec<ActiveLoad> = vec![ActiveLoad::default(); self.per_slot.len()];
        for (id, a) in &self.requests {
            for (i, &h) in a.blocks.iter().enumerate() {
                want_holds.entry((h, a.slot)).or_default();
                if let Some(&parent) = i.checked_sub(1).and_then(|p| a.blocks.get(p)) {
                    edges.insert((parent, h, a.slot));
                }
            }
            if let Some(&last) = a.blocks.last() {
                want_holds.entry((last, a.slot)).or_default().ends += 1;
            }
            let w = &mut want[a.slot.idx()];
            w.active_prefill_tokens += a.pending_prefill;
            w.active_requests += 1;
            assert!(self.per_slot[a.slot.idx()].requests.contains(id));
            if let Some(d) = a.deadline {
                assert!(self.deadlines.contains(&(d, *id)));
            }
        }
        for &(parent, _, slot) in &edges {
            want_holds.entry((parent, slot)).or_default().kids += 1;
        }
        for &(_, slot) in want_holds.keys() {
            want[slot.idx()].active_blocks += 1;
        }
        let mut held = 0;
        for (h, holders) in &self.holders {
            assert!(!holders.as_slice().is_empty());
            assert!(holders.as_slice().windows(2).all(|p| p[0].0 < p[1].0));
            for &(slot, hold) in holders.as_slice() {
                assert_eq!(want_holds.get(&(*h, slot)), Some(&hold), "hold of {h}");
                held += 1;
            }
        }
        assert_eq!(held, want_holds.len());
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

/// What a slot keeps for one block it holds (invariant 1): the block stays active on the
/// slot while either count is above 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Hold {
    /// Active requests of the slot that end at the block.
    ends: u32,
    /// Distinct blocks that follow it in the slot's active requests.
    kids: u32,
}

impl Hold {
    fn unused(self) -> bool {
        self.ends == 0 && self.kids == 0
    }
}

/// Slots holding one block in active requests. One holder is the common case and needs no
/// allocation; `Many` is sorted by slot, so a block every worker holds (a shared system
/// prompt) costs a binary search, not a scan.
#[derive(Debug)]
enum Holders {
    One([(WorkerSlot, Hold); 1]),
    Many(Vec<(WorkerSlot, Hold)>),
}

impl Holders {
    fn as_slice(&self) -> &[(WorkerSlot, Hold)] {
        match self {
            Holders::One(one) => one,
            Holders::Many(v) => v,
        }
    }

    fn get(&self, slot: WorkerSlot) -> Option<Hold> {
        let v = self.as_slice();
        let i = v.binary_search_by_key(&slot, |&(s, _)| s).ok()?;
        v.get(i).map(|&(_, hold)| hold)
    }

    fn get_mut(&mut self, slot: WorkerSlot) -> Option<&mut Hold> {
        let v: &mut [(WorkerSlot, Hold)] = match self {
            Holders::One(one) => one,
            Holders::Many(v) => v,
        };
        let i = v.binary_search_by_key(&slot, |&(s, _)| s).ok()?;
        v.get_mut(i).map(|(_, hold)| hold)
    }

    /// Adds `slot` with nothing held yet; false if it was there.
    fn insert(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Holders::One([(s, _)]) if *s == slot => false,
            Holders::One([first]) => {
                let mut v = vec![*first, (slot, Hold::default())];
                v.sort_unstable_by_key(|&(s, _)| s);
                *self = Holders::Many(v);
                true
            }
            Holders::Many(v) => match v.binary_search_by_key(&slot, |&(s, _)| s) {
                Ok(_) => false,
                Err(i) => {
                    v.insert(i, (slot, Hold::default()));
                    true
                }
            },
        }
    }

    /// Removes `slot`; true if no slot is left (drop the entry).
    fn remove(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Holders::One([(s, _)]) => *s == slot,
            Holders::Many(v) => {
                if let Ok(i) = v.binary_search_by_key(&slot, |&(s, _)| s) {
                    v.remove(i);
                }
                match v.as_slice() {
                    [] => true,
                    // Back to the inline form so a once-hot block stops costing a Vec.
                    [only] => {
                        *self = Holders::One([*only]);
                        false
                    }
                    _ => false,
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

    fn done(at: Instant) -> Predicted {
        Predicted {
            done_at: at,
            drift_ms: 0.0,
        }
    }

    #[test]
    fn shared_blocks_count_once_and_prefill_floors_at_zero() {
        let now = Instant::now();
        let s = WorkerSlot(0);
        let mut a = ActiveRequests::new(16, Duration::from_secs(10));
        a.add(now, s, RequestId(1), &hs(&[1, 2, 3]), 48, 1, done(now))
            .unwrap();
        a.add(now, s, RequestId(2), &hs(&[1, 2, 4, 5]), 64, 0, done(now))
            .unwrap();
        let l = a.load(s);
        assert_eq!(l.active_blocks, 5);
        assert_eq!(l.active_prefill_tokens, 32 + 64);
        a.add(now, s, RequestId(3), &hs(&[9]), 10, 4, done(now))
            .unwrap();
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
    fn a_shortened_deadline_expires_the_request_then_and_not_before() {
        let now = Instant::now();
        let s = WorkerSlot(0);
        let mut a = ActiveRequests::new(16, Duration::from_secs(300));
        a.add(now, s, RequestId(1), &hs(&[1]), 16, 0, done(now))
            .unwrap();
        a.add(now, s, RequestId(2), &hs(&[2]), 16, 0, done(now))
            .unwrap();
        a.set_deadline(RequestId(1), now + Duration::from_secs(60))
            .unwrap();
        a.check_invariants();
        assert!(a.expire(now + Duration::from_secs(59)).is_empty());
        assert_eq!(a.expire(now + Duration::from_secs(60)), vec![RequestId(1)]);
        assert!(
            a.contains(RequestId(2)),
            "the other keeps the configured timeout"
        );
        assert!(a.set_deadline(RequestId(1), now).is_err(), "gone");
        a.check_invariants();
        assert_eq!(a.expire(now + Duration::from_secs(300)), vec![RequestId(2)]);
    }

    /// A path from the root of a small tree of blocks (3 children each, up to 6 deep), as
    /// a prompt's seq hashes are: requests share prefixes and diverge.
    fn chain(rng: &mut SmallRng) -> Vec<SeqHash> {
        let mut prev = None;
        (0..rng.random_range(0..7))
            .map(|_| {
                let h = crate::hash::seq_hash(prev, crate::ids::TokensHash(rng.random_range(0..3)));
                prev = Some(h);
                h
            })
            .collect()
    }

    /// `count_held` per slot (4 slots).
    fn held(a: &ActiveRequests, blocks: &[SeqHash]) -> Vec<u32> {
        let mut counts = vec![0; 4];
        let mut touched = vec![];
        a.count_held(blocks, &mut counts, &mut touched);
        touched.sort();
        let mut nonzero: Vec<WorkerSlot> = (0..4u32)
            .map(WorkerSlot)
            .filter(|s| counts[s.idx()] > 0)
            .collect();
        nonzero.sort();
        assert_eq!(touched, nonzero, "touched names exactly the slots counted");
        counts
    }

    /// The reference: per slot, the blocks of `blocks` some active request on it holds.
    fn held_by_scan(a: &ActiveRequests, blocks: &[SeqHash]) -> Vec<u32> {
        (0..4u32)
            .map(|s| {
                let slot = WorkerSlot(s);
                blocks
                    .iter()
                    .filter(|h| {
                        a.requests
                            .values()
                            .any(|r| r.slot == slot && r.blocks.contains(h))
                    })
                    .count() as u32
            })
            .collect()
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
                    let blocks = chain(&mut rng);
                    let slot = WorkerSlot(rng.random_range(0..4));
                    a.add(
                        now,
                        slot,
                        id,
                        &blocks,
                        rng.random_range(0..40),
                        rng.random_range(0..4),
                        done(now),
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
            let query = chain(&mut rng);
            assert_eq!(held(&a, &query), held_by_scan(&a, &query), "{query:?}");
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
