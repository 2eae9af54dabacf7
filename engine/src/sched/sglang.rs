//! `sglang` mode: the SGLang router's cache-aware policy, measured beside ours.
//!
//! SGLang's router keeps an approximate radix tree per worker of the text it sent there;
//! here the overlaps are the index's exact ones, so this mode measures SGLang's *decision
//! rule*, not its cache estimate:
//!
//! 1. Load is each key's in-flight requests (the router's own count, as SGLang's). If the
//!    load is imbalanced, `max - min > BALANCE_ABS` and `max > min * BALANCE_REL`, the
//!    least-loaded key.
//! 2. Else, if the best overlap covers more than `CACHE_THRESHOLD` of the request's blocks,
//!    the best-overlap key.
//! 3. Else the key caching the fewest blocks (SGLang: the smallest tree, most free room).
//!
//! Ties go to the lower load, then uniformly at random. The thresholds are the shipped
//! defaults of sglang-router 0.3.2 and SMG 1.13 (`--cache-threshold 0.3`,
//! `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`, as their `launch --help`
//! prints them). It is an approximation of those routers, not a stand-in: it leaves out
//! their text radix trees, SMG's spill-margin cap and KV-usage gates, and their own load
//! counting. `kvengine bench peers` runs the real ones.
//!
//! # Invariants
//! 1. Returns a candidate's key (policy invariant 1); randomness only on ties.

use rand::Rng;
use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::cost::CandidateScore;
use crate::sched::policy::{Policy, SelectionInput};

/// Share of the request's blocks the best overlap must exceed to decide.
pub const CACHE_THRESHOLD: f64 = 0.3;
/// Load difference (requests) above which the load counts as imbalanced...
pub const BALANCE_ABS: u64 = 64;
/// ...if the busiest key also carries more than this many times the idlest's.
pub const BALANCE_REL: f64 = 1.5;

/// The `sglang` policy.
#[derive(Clone, Copy, Debug)]
pub struct CacheAware {
    /// See [`CACHE_THRESHOLD`].
    pub cache_threshold: f64,
    /// See [`BALANCE_ABS`].
    pub balance_abs: u64,
    /// See [`BALANCE_REL`].
    pub balance_rel: f64,
}

impl Default for CacheAware {
    fn default() -> Self {
        Self {
            cache_threshold: CACHE_THRESHOLD,
            balance_abs: BALANCE_ABS,
            balance_rel: BALANCE_REL,
        }
    }
}

impl Policy for CacheAware {
    fn mode(&self) -> RouteMode {
        RouteMode::Sglang
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        let c = input.candidates;
        let load = |s: &CandidateScore| (input.load)(s.key).active.active_requests;
        let min = c.iter().map(load).min().ok_or(EngineError::NoWorkers)?;
        let max = c.iter().map(load).max().unwrap_or(min);
        if max - min > self.balance_abs && max as f64 > min as f64 * self.balance_rel {
            return pick(c, rng, |s| (0, load(s)));
        }
        let best = c.iter().map(|s| s.overlap_blocks).max().unwrap_or(0);
        let rate = if input.request_blocks == 0 {
            0.0
        } else {
            f64::from(best) / input.request_blocks as f64
        };
        if rate > self.cache_threshold {
            pick(c, rng, |s| (u64::from(best - s.overlap_blocks), load(s)))
        } else {
            pick(c, rng, |s| ((input.cached_blocks)(s.key), load(s)))
        }
    }
}

/// A candidate with the smallest `rank`, uniformly among equals.
pub(crate) fn pick<R: Ord + Copy>(
    c: &[CandidateScore],
    rng: &mut SmallRng,
    rank: impl Fn(&CandidateScore) -> R,
) -> Result<WorkerKey> {
    let best = c.iter().map(&rank).min().ok_or(EngineError::NoWorkers)?;
    let tied = c.iter().filter(|s| rank(s) == best).count();
    let n = if tied > 1 {
        rng.random_range(0..tied)
    } else {
        0
    };
    c.iter()
        .filter(|s| rank(s) == best)
        .nth(n)
        .map(|s| s.key)
        .ok_or(EngineError::NoWorkers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::active::ActiveLoad;
    use crate::sched::policy::KeyLoad;
    use crate::sched::policy::test_candidate;
    use rand::SeedableRng;

    fn cand(worker: u64, overlap: u32) -> CandidateScore {
        test_candidate(worker, overlap, 0.0)
    }

    fn choose(c: &[CandidateScore], blocks: u64, loads: [u64; 3], cached: [u64; 3]) -> u64 {
        let load = move |k: WorkerKey| KeyLoad {
            active: ActiveLoad {
                active_requests: loads[k.worker.0 as usize - 1],
                ..Default::default()
            },
            reported: None,
        };
        let cached_blocks = move |k: WorkerKey| cached[k.worker.0 as usize - 1];
        let input = SelectionInput {
            candidates: c,
            temperature: 0.0,
            request_blocks: blocks,
            cached_blocks: &cached_blocks,
            load: &load,
        };
        let mut rng = SmallRng::seed_from_u64(1);
        CacheAware::default()
            .select(&input, &mut rng)
            .unwrap()
            .worker
            .0
    }

    #[test]
    fn follows_the_three_rules_in_order() {
        let c = [cand(1, 8), cand(2, 2), cand(3, 0)];
        // Balanced, 8 of 10 blocks cached on worker 1: the cache decides.
        assert_eq!(choose(&c, 10, [5, 0, 0], [100, 50, 10]), 1);
        // 8 of 20 (40%) is over the 30% threshold; 8 of 30 (27%) is not: the key caching
        // least.
        assert_eq!(choose(&c, 20, [5, 0, 0], [100, 50, 10]), 1);
        assert_eq!(choose(&c, 30, [5, 0, 0], [100, 50, 10]), 3);
        // Imbalanced (80 against 2: more than 64 apart and over 1.5x): the least loaded,
        // whatever the cache.
        assert_eq!(choose(&c, 10, [80, 2, 3], [100, 50, 10]), 2);
        // 40 against 10 is over 1.5x but not 64 apart: still the cache.
        assert_eq!(choose(&c, 10, [40, 10, 10], [100, 50, 10]), 1);
        // 140 against 100 is not 1.5x: the cache.
        assert_eq!(choose(&c, 10, [140, 100, 100], [100, 50, 10]), 1);
    }
}
