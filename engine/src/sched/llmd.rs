//! `llm-d` mode: llm-d's inference scheduler (its endpoint picker), measured beside ours.
//!
//! Each candidate gets a weighted sum of scorers, each in `0..=1`, and the highest total
//! wins (ties uniformly at random, as llm-d's max-score picker). The scorers and weights
//! are llm-d's default profile:
//!
//! * prefix-cache scorer, weight [`PREFIX_WEIGHT`]: the share of the request's blocks the
//!   key caches (here the index's exact overlap; llm-d may estimate it);
//! * queue scorer, weight [`QUEUE_WEIGHT`]: `(max_q - q) / (max_q - min_q)` over the
//!   candidates (1 for all when equal), `q` the key's waiting requests as it last reported
//!   them, or the router's in-flight count for a key that never reported.
//!
//! # Invariants
//! 1. Returns a candidate's key (policy invariant 1); randomness only on ties.

use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::policy::{Policy, SelectionInput};

/// Weight of the prefix-cache scorer.
pub const PREFIX_WEIGHT: f64 = 3.0;
/// Weight of the queue scorer.
pub const QUEUE_WEIGHT: f64 = 2.0;

/// Scores compared for ties in millionths, so float noise does not break them.
const TIE_SCALE: f64 = 1e6;

/// The `llm-d` policy.
#[derive(Clone, Copy, Debug)]
pub struct Scorers {
    /// See [`PREFIX_WEIGHT`].
    pub prefix_weight: f64,
    /// See [`QUEUE_WEIGHT`].
    pub queue_weight: f64,
}

impl Default for Scorers {
    fn default() -> Self {
        Self {
            prefix_weight: PREFIX_WEIGHT,
            queue_weight: QUEUE_WEIGHT,
        }
    }
}

impl Policy for Scorers {
    fn mode(&self) -> RouteMode {
        RouteMode::LlmD
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        let c = input.candidates;
        let queue = |k: WorkerKey| {
            let l = (input.load)(k);
            l.reported
                .map_or(l.active.active_requests, |r| r.num_requests_waiting)
        };
        let min_q = c
            .iter()
            .map(|s| queue(s.key))
            .min()
            .ok_or(EngineError::NoWorkers)?;
        let max_q = c.iter().map(|s| queue(s.key)).max().unwrap_or(min_q);
        let blocks = input.request_blocks.max(1) as f64;
        let total = |s: &crate::sched::cost::CandidateScore| {
            let prefix = (f64::from(s.overlap_blocks) / blocks).min(1.0);
            let q = if max_q == min_q {
                1.0
            } else {
                (max_q - queue(s.key)) as f64 / (max_q - min_q) as f64
            };
            self.prefix_weight * prefix + self.queue_weight * q
        };
        // Highest total first: rank by its negation, rounded for ties.
        crate::sched::sglang::pick(c, rng, |s| -(total(s) * TIE_SCALE).round() as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::active::ActiveLoad;
    use crate::sched::config::WorkerLoad;
    use crate::sched::cost::CandidateScore;
    use crate::sched::policy::KeyLoad;
    use crate::sched::policy::test_candidate;
    use rand::SeedableRng;

    fn cand(worker: u64, overlap: u32) -> CandidateScore {
        test_candidate(worker, overlap, 0.0)
    }

    fn choose(c: &[CandidateScore], queues: [u64; 2], reported: bool) -> u64 {
        let load = move |k: WorkerKey| {
            let q = queues[k.worker.0 as usize - 1];
            KeyLoad {
                active: ActiveLoad {
                    active_requests: if reported { 0 } else { q },
                    ..Default::default()
                },
                reported: reported.then_some(WorkerLoad {
                    num_requests_waiting: q,
                    kv_usage: 0.0,
                }),
            }
        };
        let input = SelectionInput {
            candidates: c,
            temperature: 0.0,
            request_blocks: 10,
            cached_blocks: &|_| 0,
            load: &load,
        };
        let mut rng = SmallRng::seed_from_u64(1);
        Scorers::default()
            .select(&input, &mut rng)
            .unwrap()
            .worker
            .0
    }

    #[test]
    fn weighs_prefix_against_queue() {
        // Worker 1 caches 8/10 (3 * 0.8 = 2.4) but has the longest queue (0); worker 2
        // caches nothing but is idle (2 * 1 = 2): the prefix wins.
        let c = [cand(1, 8), cand(2, 0)];
        assert_eq!(choose(&c, [5, 1], true), 1);
        // At 6/10 (1.8 < 2) the queue wins, from reports or from the router's count.
        let c = [cand(1, 6), cand(2, 0)];
        assert_eq!(choose(&c, [5, 1], true), 2);
        assert_eq!(choose(&c, [5, 1], false), 2);
        // Equal queues: every key scores 2 on the queue, so the prefix decides.
        assert_eq!(choose(&c, [3, 3], true), 1);
    }
}
