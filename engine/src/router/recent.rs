//! Predict-on-route's memory: the routing decisions of the last `ttl`, each a prediction
//! that its worker key holds the request's blocks (router invariant 6).
//!
//! A prediction only has to bridge the time between a decision and the worker's KV events
//! for it (its prefill), a fraction of a second, so few are live at once. They are kept as
//! they came, in a queue: a decision is one copy of its block list (no per-block
//! bookkeeping), expiry pops the front, and a lookup takes, per key, the longest common
//! prefix of the request with that key's live decisions. Most live decisions share no first
//! block with the request and cost one comparison.
//!
//! # Invariants
//! 1. Deadlines never decrease along the queue, so everything expired is at the front (a
//!    `now` earlier than the last insert's is treated as that insert's).
//! 2. At most [`MAX_HELD_BLOCKS`] blocks are held: past it the oldest decisions go first.
//! 3. A key's predicted overlap is the longest prefix of the request that one of its live
//!    decisions routed, never more.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;

/// Blocks held at most, over every live decision (8 MiB of hashes).
pub const MAX_HELD_BLOCKS: usize = 1 << 20;

#[derive(Debug)]
struct Prediction {
    deadline: Instant,
    key: WorkerKey,
    blocks: Box<[SeqHash]>,
}

/// The live routing decisions, oldest first.
#[derive(Debug)]
pub struct RecentRoutes {
    ttl: Duration,
    queue: VecDeque<Prediction>,
    held: usize,
    /// The latest deadline given (invariant 1).
    last: Option<Instant>,
}

impl RecentRoutes {
    /// An empty memory whose decisions live `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            queue: VecDeque::new(),
            held: 0,
            last: None,
        }
    }

    /// Records that `key` was chosen at `now` for a request of `blocks`.
    pub fn insert(&mut self, now: Instant, key: WorkerKey, blocks: &[SeqHash]) {
        if blocks.is_empty() {
            return;
        }
        let deadline = now.checked_add(self.ttl).unwrap_or(now);
        let deadline = self.last.map_or(deadline, |l| l.max(deadline));
        self.last = Some(deadline);
        self.held += blocks.len();
        self.queue.push_back(Prediction {
            deadline,
            key,
            blocks: blocks.into(),
        });
        while self.held > MAX_HELD_BLOCKS {
            let Some(old) = self.queue.pop_front() else {
                break;
            };
            self.held -= old.blocks.len();
        }
    }

    /// Forgets every decision whose deadline is at or before `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut gone = 0;
        while self.queue.front().is_some_and(|d| d.deadline <= now) {
            if let Some(d) = self.queue.pop_front() {
                self.held -= d.blocks.len();
                gone += 1;
            }
        }
        gone
    }

    /// Forgets every decision for a rank of `worker`; returns how many.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let before = self.queue.len();
        let held = &mut self.held;
        self.queue.retain(|d| {
            let keep = d.key.worker != worker;
            if !keep {
                *held -= d.blocks.len();
            }
            keep
        });
        before - self.queue.len()
    }

    /// Per key, the longest prefix of `seqs` one of its live decisions routed (invariant 3).
    /// Decisions past their deadline count until [`RecentRoutes::expire`] drops them.
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        let Some(first) = seqs.first() else {
            return Matches::default();
        };
        let mut best: Vec<(WorkerKey, u32)> = Vec::new();
        for d in &self.queue {
            if d.blocks.first() != Some(first) {
                continue;
            }
            let common = d
                .blocks
                .iter()
                .zip(seqs)
                .take_while(|(a, b)| a == b)
                .count();
            let common = u32::try_from(common).unwrap_or(u32::MAX);
            match best.iter_mut().find(|(k, _)| *k == d.key) {
                Some(b) => b.1 = b.1.max(common),
                None => best.push((d.key, common)),
            }
        }
        Matches::from_overlaps(best)
    }

    /// Live decisions held (expired ones count until [`RecentRoutes::expire`]).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Blocks held over every decision.
    pub fn held_blocks(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(w: u64) -> WorkerKey {
        WorkerKey::new(w, 0)
    }

    fn seqs(v: &[u64]) -> Vec<SeqHash> {
        v.iter().map(|&x| SeqHash(x)).collect()
    }

    /// The reference: every live decision, compared block by block.
    fn reference(live: &[(WorkerKey, Vec<SeqHash>)], q: &[SeqHash]) -> Matches {
        let mut per: Vec<(WorkerKey, u32)> = Vec::new();
        for (key, b) in live {
            let mut n = 0;
            while n < b.len() && n < q.len() && b[n] == q[n] {
                n += 1;
            }
            match per.iter_mut().find(|(k2, _)| k2 == key) {
                Some(p) => p.1 = p.1.max(n as u32),
                None => per.push((*key, n as u32)),
            }
        }
        Matches::from_overlaps(per)
    }

    #[test]
    fn overlaps_are_the_longest_routed_prefix_per_key_and_lapse_with_the_ttl() {
        let t0 = Instant::now();
        let ttl = Duration::from_millis(300);
        let mut r = RecentRoutes::new(ttl);
        r.insert(t0, k(1), &seqs(&[1, 2, 3, 4]));
        r.insert(t0, k(1), &seqs(&[1, 2, 9]));
        r.insert(t0 + Duration::from_millis(100), k(2), &seqs(&[1, 2, 3]));
        r.insert(t0, k(3), &seqs(&[7, 2, 3]));
        let m = r.find_matches(&seqs(&[1, 2, 3, 5]));
        assert_eq!(m.overlaps, vec![(k(1), 3), (k(2), 3)]);
        assert_eq!(r.expire(t0 + ttl - Duration::from_millis(1)), 0);
        // The first three deadlines (t0 + ttl; the fourth's is lifted to the third's).
        assert_eq!(r.expire(t0 + ttl), 2);
        assert_eq!(
            r.find_matches(&seqs(&[1, 2, 3, 5])).overlaps,
            vec![(k(2), 3)]
        );
        assert_eq!(r.expire(t0 + ttl + Duration::from_millis(100)), 2);
        assert!(r.is_empty());
        assert_eq!(r.held_blocks(), 0);
    }

    #[test]
    fn a_removed_worker_takes_its_decisions_with_it() {
        let t0 = Instant::now();
        let mut r = RecentRoutes::new(Duration::from_secs(1));
        r.insert(t0, WorkerKey::new(1, 0), &seqs(&[1, 2]));
        r.insert(t0, WorkerKey::new(1, 1), &seqs(&[1, 2, 3]));
        r.insert(t0, k(2), &seqs(&[1]));
        assert_eq!(r.remove_worker(WorkerId(1)), 2);
        assert_eq!(r.find_matches(&seqs(&[1, 2, 3])).overlaps, vec![(k(2), 1)]);
        assert_eq!(r.held_blocks(), 1);
    }

    #[test]
    fn the_held_blocks_stay_under_the_cap_oldest_first() {
        let t0 = Instant::now();
        let mut r = RecentRoutes::new(Duration::from_secs(60));
        let big: Vec<SeqHash> = (0..(MAX_HELD_BLOCKS as u64 / 2 + 1)).map(SeqHash).collect();
        r.insert(t0, k(1), &big);
        r.insert(t0, k(2), &big);
        // Two would exceed the cap: the first went.
        assert_eq!(r.len(), 1);
        assert_eq!(r.find_matches(&big[..3]).overlaps, vec![(k(2), 3)]);
        assert!(r.held_blocks() <= MAX_HELD_BLOCKS);
    }

    #[test]
    fn random_decisions_match_the_reference() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(7);
        let t0 = Instant::now();
        let ttl = Duration::from_millis(50);
        let mut r = RecentRoutes::new(ttl);
        let mut live: Vec<(Instant, WorkerKey, Vec<SeqHash>)> = Vec::new();
        let mut now = t0;
        for _ in 0..2_000 {
            now += Duration::from_millis(rng.random_range(0..5));
            let len = rng.random_range(1..8);
            // Few distinct values, so prefixes are often shared.
            let s: Vec<SeqHash> = (0..len).map(|_| SeqHash(rng.random_range(0..3))).collect();
            match rng.random_range(0..10) {
                0..=3 => {
                    let key = k(rng.random_range(0..4));
                    r.insert(now, key, &s);
                    live.push((now + ttl, key, s));
                }
                4 => {
                    r.expire(now);
                    live.retain(|(d, _, _)| *d > now);
                }
                5 => {
                    let w = WorkerId(rng.random_range(0..4));
                    r.remove_worker(w);
                    live.retain(|(_, key, _)| key.worker != w);
                }
                _ => {
                    let view: Vec<(WorkerKey, Vec<SeqHash>)> =
                        live.iter().map(|(_, key, b)| (*key, b.clone())).collect();
                    assert_eq!(r.find_matches(&s), reference(&view, &s));
                }
            }
        }
    }
}
