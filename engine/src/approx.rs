//! Approximate mode: a prefix index fed by routing decisions instead of KV events.
//!
//! When workers publish no KV events (`--no-kv-events`), each routing decision is taken as a
//! prediction: the chosen worker key now caches the request's blocks. [`ApproxIndex::insert`]
//! records that prediction with an expiry of `now + ttl`; re-inserting a block refreshes it.
//! A per-key size cap stands in for the engine's own eviction and prunes the
//! earliest-expiring blocks first. [`ApproxIndex::find_matches`] answers with exactly the
//! semantics of [`Matches`], so the scheduler cannot tell the two indexes apart.
//!
//! Typical wiring: `expire(now)`, then `find_matches`, route, then `insert(now, chosen, blocks)`.
//!
//! # Algorithm
//! `find_matches` intersects the sorted holder lists of the request's blocks depth by depth
//! (a merge, or binary searches when one list is much shorter): sequential memory and no
//! per-key hash lookup, even for a system-prompt block every key holds.
//!
//! Each key keeps `blocks: seq_hash -> (deadline, seq)` and a min-heap of `(deadline, seq,
//! seq_hash)` records for pruning and expiry. A refresh pushes a new record and leaves the old
//! one in the heap (lazy deletion: a record is live iff its `seq` is the block's current one);
//! the heap is rebuilt from `blocks` once stale records outnumber live ones, so memory stays
//! proportional to what is held. `seq` grows with every insertion, and within one `insert` the
//! blocks are numbered deepest first, so among equal deadlines the deepest blocks go first:
//! like an engine's LRU, which frees a sequence tail-first, the shared prefix that overlap
//! depends on is kept longest.
//!
//! # Invariants
//! 1. `workers[k].blocks` contains `h` iff `holders[h]` contains `k`; every holder list is
//!    sorted, non-empty and names each key once; no worker entry is empty.
//! 2. Every held `(k, h)` has exactly one live record in `workers[k].queue`.
//! 3. After `insert` returns, the key holds at most `max_blocks_per_worker` blocks.
//! 4. After every call, each queue holds at most `2 * blocks + COMPACT_SLACK` records.
//! 5. A block's deadline never moves earlier: a refresh keeps the later of the two.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use crate::error::{EngineError, Result};
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;

/// Stale heap records tolerated per key beyond the live ones before a rebuild.
const COMPACT_SLACK: usize = 64;

/// Settings of an [`ApproxIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApproxConfig {
    /// How long a predicted block is assumed cached after its last use.
    pub ttl: Duration,
    /// Blocks predicted per worker key at most (roughly its KV capacity in blocks).
    pub max_blocks_per_worker: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_blocks_per_worker: 1 << 16,
        }
    }
}

/// Sizes of an [`ApproxIndex`], for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApproxStats {
    /// Worker keys holding at least one block.
    pub workers: usize,
    /// `(worker key, block)` predictions held.
    pub entries: usize,
    /// Distinct blocks held by any key.
    pub blocks: usize,
    /// Heap records, stale ones included (invariant 4 bounds them).
    pub queued: usize,
}

/// When a prediction lapses. `Never` only if `now + ttl` does not fit in an `Instant`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Deadline {
    At(Instant),
    Never,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    deadline: Deadline,
    seq: u64,
}

#[derive(Debug, Default)]
struct WorkerBlocks {
    blocks: HashMap<SeqHash, Entry>,
    queue: BinaryHeap<Reverse<(Deadline, u64, SeqHash)>>,
}

/// The approximate index. Owned by one thread (the edge's routing task).
#[derive(Debug)]
pub struct ApproxIndex {
    config: ApproxConfig,
    workers: HashMap<WorkerKey, WorkerBlocks>,
    holders: HashMap<SeqHash, Vec<WorkerKey>>,
    next_seq: u64,
    entries: usize,
}

impl ApproxIndex {
    /// An empty index. Fails if `max_blocks_per_worker` is 0.
    pub fn new(config: ApproxConfig) -> Result<Self> {
        if config.max_blocks_per_worker == 0 {
            return Err(EngineError::InvalidArgument {
                name: "max_blocks_per_worker",
                reason: "must be positive",
            });
        }
        Ok(Self {
            config,
            workers: HashMap::new(),
            holders: HashMap::new(),
            next_seq: 0,
            entries: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    /// Predicts that `key` caches `blocks` from `now` until `now + ttl`, then prunes `key`
    /// down to the size cap, earliest deadline first.
    pub fn insert(&mut self, now: Instant, key: WorkerKey, blocks: &[SeqHash]) {
        if blocks.is_empty() {
            return;
        }
        let deadline = now
            .checked_add(self.config.ttl)
            .map_or(Deadline::Never, Deadline::At);
        let w = self.workers.entry(key).or_default();
        // Deepest first: see "# Algorithm" for why the tail gets the smaller numbers.
        for &h in blocks.iter().rev() {
            let seq = self.next_seq;
            self.next_seq += 1;
            let entry = w.blocks.entry(h).or_insert_with(|| {
                let holders = self.holders.entry(h).or_default();
                if let Err(i) = holders.binary_search(&key) {
                    holders.insert(i, key);
                }
                self.entries += 1;
                Entry { deadline, seq }
            });
            entry.deadline = entry.deadline.max(deadline);
            entry.seq = seq;
            w.queue.push(Reverse((entry.deadline, seq, h)));
        }
        while w.blocks.len() > self.config.max_blocks_per_worker {
            match pop_record(w, &mut self.holders, key) {
                Some(true) => self.entries -= 1,
                Some(false) => {}
                // Unreachable by invariant 2 (every held block has a record); stop, don't spin.
                None => break,
            }
        }
        compact(w);
    }

    /// Drops every prediction whose deadline is at or before `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.entries;
        let holders = &mut self.holders;
        let entries = &mut self.entries;
        self.workers.retain(|&key, w| {
            while let Some(Reverse((deadline, _, _))) = w.queue.peek() {
                if *deadline > Deadline::At(now) {
                    break;
                }
                // One record at a time: the next one may not be due yet.
                if pop_record(w, holders, key) == Some(true) {
                    *entries -= 1;
                }
            }
            compact(w);
            // An empty key goes entirely, so its maps' memory goes with it.
            !w.blocks.is_empty()
        });
        shrink_if_sparse(&mut self.workers);
        shrink_if_sparse(&mut self.holders);
        before - self.entries
    }

    /// Forgets every rank of `worker`; returns how many predictions went.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let keys: Vec<WorkerKey> = self
            .workers
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        let mut removed = 0;
        for key in keys {
            let Some(w) = self.workers.remove(&key) else {
                continue;
            };
            for h in w.blocks.keys() {
                unhold(&mut self.holders, *h, key);
            }
            removed += w.blocks.len();
        }
        self.entries -= removed;
        shrink_if_sparse(&mut self.workers);
        shrink_if_sparse(&mut self.holders);
        removed
    }

    /// The overlaps of a request with blocks `blocks` (see [`Matches`]). Predictions past
    /// their deadline count until [`ApproxIndex::expire`] drops them.
    pub fn find_matches(&self, blocks: &[SeqHash]) -> Matches {
        let Some(first) = blocks.first() else {
            return Matches::default();
        };
        let Some(start) = self.holders.get(first) else {
            return Matches::default();
        };
        let mut live: Vec<WorkerKey> = start.clone();
        let mut overlaps = Vec::with_capacity(live.len());
        let mut depth_counts = vec![count(live.len())];
        for (depth, h) in blocks.iter().enumerate().skip(1) {
            let holders = self.holders.get(h).map_or(&[][..], Vec::as_slice);
            // A key that lacks block `depth` holds exactly the first `depth` blocks.
            intersect(&mut live, holders, |k| overlaps.push((k, count(depth))));
            if live.is_empty() {
                break;
            }
            depth_counts.push(count(live.len()));
        }
        let full = count(blocks.len());
        overlaps.extend(live.into_iter().map(|k| (k, full)));
        overlaps.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        Matches {
            overlaps,
            depth_counts,
        }
    }

    /// Whether `key` is predicted to hold `block`.
    pub fn holds(&self, key: WorkerKey, block: SeqHash) -> bool {
        self.workers
            .get(&key)
            .is_some_and(|w| w.blocks.contains_key(&block))
    }

    /// Blocks predicted on `key` (for the scheduler's `cached_blocks` tie-break).
    pub fn worker_blocks(&self, key: WorkerKey) -> usize {
        self.workers.get(&key).map_or(0, |w| w.blocks.len())
    }

    /// Number of `(worker key, block)` predictions held.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether nothing is predicted.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Current sizes.
    pub fn stats(&self) -> ApproxStats {
        ApproxStats {
            workers: self.workers.len(),
            entries: self.entries,
            blocks: self.holders.len(),
            queued: self.workers.values().map(|w| w.queue.len()).sum(),
        }
    }
}

/// Keeps the keys of `live` that are in `holders` (both sorted), reporting the others to
/// `dropped` in order. Merges when the lists are of similar size, else binary-searches the
/// longer one, so a hot block held by every key costs O(live), not O(keys) per query.
fn intersect(live: &mut Vec<WorkerKey>, holders: &[WorkerKey], mut dropped: impl FnMut(WorkerKey)) {
    if live.len().saturating_mul(8) < holders.len() {
        live.retain(|k| {
            let keep = holders.binary_search(k).is_ok();
            if !keep {
                dropped(*k);
            }
            keep
        });
    } else {
        let mut j = 0;
        live.retain(|k| {
            while holders.get(j).is_some_and(|h| h < k) {
                j += 1;
            }
            let keep = holders.get(j) == Some(k);
            if !keep {
                dropped(*k);
            }
            keep
        });
    }
}

/// Counts and depths fit in u32 (Matches' type); saturate rather than wrap beyond that.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Pops `key`'s earliest heap record and drops its block if the record is live; returns
/// `None` when the heap is empty, else whether a block was dropped.
fn pop_record(
    w: &mut WorkerBlocks,
    holders: &mut HashMap<SeqHash, Vec<WorkerKey>>,
    key: WorkerKey,
) -> Option<bool> {
    let Reverse((_, seq, h)) = w.queue.pop()?;
    let live = w.blocks.get(&h).is_some_and(|e| e.seq == seq);
    if live {
        w.blocks.remove(&h);
        unhold(holders, h, key);
    }
    Some(live)
}

/// Drops `key` from `h`'s holders, and the entry once nobody holds `h`.
fn unhold(holders: &mut HashMap<SeqHash, Vec<WorkerKey>>, h: SeqHash, key: WorkerKey) {
    let hashbrown::hash_map::EntryRef::Occupied(mut e) = holders.entry_ref(&h) else {
        return;
    };
    let v = e.get_mut();
    if let Ok(i) = v.binary_search(&key) {
        v.remove(i);
    }
    if v.is_empty() {
        e.remove();
    }
}

/// Rebuilds the heap from the live entries once stale records dominate (invariant 4).
fn compact(w: &mut WorkerBlocks) {
    if w.queue.len() > 2 * w.blocks.len() + COMPACT_SLACK {
        w.queue = w
            .blocks
            .iter()
            .map(|(h, e)| Reverse((e.deadline, e.seq, *h)))
            .collect();
    }
    shrink_if_sparse(&mut w.blocks);
}

/// Gives back memory after a burst: a map a quarter full shrinks to half full.
fn shrink_if_sparse<K: Eq + std::hash::Hash, V>(m: &mut HashMap<K, V>) {
    if m.capacity() > 64 && m.len() * 4 < m.capacity() {
        m.shrink_to(m.len() * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(v: &[u64]) -> Vec<SeqHash> {
        v.iter().copied().map(SeqHash).collect()
    }

    fn index(ttl_secs: u64, cap: usize) -> ApproxIndex {
        ApproxIndex::new(ApproxConfig {
            ttl: Duration::from_secs(ttl_secs),
            max_blocks_per_worker: cap,
        })
        .unwrap()
    }

    #[test]
    fn intersect_agrees_with_a_filter_on_both_branches() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(3);
        let mut branches = [0; 2];
        for _ in 0..2000 {
            let pick = |rng: &mut SmallRng, density: u32| -> Vec<WorkerKey> {
                (0..200u64)
                    .filter(|_| rng.random_range(0..100) < density)
                    .map(|w| WorkerKey::new(w / 2, (w % 2) as u32))
                    .collect()
            };
            let d = rng.random_range(1..30);
            let live = pick(&mut rng, d);
            let d = rng.random_range(1..100);
            let holders = pick(&mut rng, d);
            branches[usize::from(live.len() * 8 < holders.len())] += 1;
            let want_kept: Vec<_> = live
                .iter()
                .filter(|k| holders.contains(k))
                .copied()
                .collect();
            let want_dropped: Vec<_> = live
                .iter()
                .filter(|k| !holders.contains(k))
                .copied()
                .collect();
            let mut kept = live.clone();
            let mut dropped = vec![];
            intersect(&mut kept, &holders, |k| dropped.push(k));
            assert_eq!((kept, dropped), (want_kept, want_dropped));
        }
        assert!(branches.iter().all(|&n| n > 100), "{branches:?}");
    }

    #[test]
    fn zero_cap_is_rejected() {
        assert!(
            ApproxIndex::new(ApproxConfig {
                max_blocks_per_worker: 0,
                ..Default::default()
            })
            .is_err()
        );
    }

    #[test]
    fn refreshes_keep_the_queue_bounded() {
        let t0 = Instant::now();
        let mut ix = index(10, 100);
        let k = WorkerKey::new(1, 0);
        let blocks = hs(&[1, 2, 3, 4]);
        for i in 0..10_000 {
            ix.insert(t0 + Duration::from_millis(i), k, &blocks);
            let s = ix.stats();
            assert!(s.queued <= 2 * s.entries + COMPACT_SLACK, "{s:?}");
        }
        assert_eq!(ix.len(), 4);
    }

    #[test]
    fn huge_ttl_never_expires_and_does_not_panic() {
        let t0 = Instant::now();
        let mut ix = ApproxIndex::new(ApproxConfig {
            ttl: Duration::MAX,
            max_blocks_per_worker: 4,
        })
        .unwrap();
        ix.insert(t0, WorkerKey::new(1, 0), &hs(&[1, 2]));
        assert_eq!(ix.expire(t0 + Duration::from_secs(1 << 40)), 0);
        assert_eq!(ix.len(), 2);
    }
}
