//! `power-of-two` mode: two candidates drawn at random, the one with the lower predicted
//! time to first token ([`crate::sched::ttft`]).
//!
//! The classic power-of-two-choices balancer, on the same prediction `kv` mode's TTFT cost
//! uses: it needs no global view at decision time and avoids herding, at the price of
//! missing the best cache half the time with many workers.
//!
//! # Invariants
//! 1. Returns a candidate's key (policy invariant 1); a single candidate is returned
//!    without drawing.
//! 2. The two draws are distinct candidates; ties go to the first drawn.

use rand::Rng;
use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::policy::{Policy, SelectionInput};

/// The `power-of-two` policy.
#[derive(Clone, Copy, Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn mode(&self) -> RouteMode {
        RouteMode::PowerOfTwo
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        let c = input.candidates;
        match c.len() {
            0 => Err(EngineError::NoWorkers),
            1 => c.first().map(|s| s.key).ok_or(EngineError::NoWorkers),
            n => {
                let i = rng.random_range(0..n);
                // A draw from the other n - 1, shifted past `i`: distinct by construction.
                let j = (i + 1 + rng.random_range(0..n - 1)) % n;
                let (a, b) = (c.get(i), c.get(j));
                match (a, b) {
                    (Some(a), Some(b)) if b.predicted_ttft_ms < a.predicted_ttft_ms => Ok(b.key),
                    (Some(a), _) => Ok(a.key),
                    _ => Err(EngineError::NoWorkers),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::cost::CandidateScore;
    use crate::sched::policy::KeyLoad;
    use crate::sched::policy::test_candidate;
    use rand::SeedableRng;

    fn cand(worker: u64, ttft: f64) -> CandidateScore {
        test_candidate(worker, 0, ttft)
    }

    #[test]
    fn the_worst_is_never_chosen_and_the_rest_by_rank() {
        // Against a reference: P(pick rank r of n) = 2 (n - r) / (n (n - 1)) for r = 1..n
        // (rank 1 the best): rank r wins against every later-ranked partner.
        let c = [cand(1, 40.0), cand(2, 10.0), cand(3, 30.0), cand(4, 20.0)];
        let input = SelectionInput {
            candidates: &c,
            temperature: 0.0,
            request_blocks: 0,
            cached_blocks: &|_| 0,
            load: &|_| KeyLoad::default(),
        };
        let mut rng = SmallRng::seed_from_u64(7);
        let mut counts = [0u32; 5];
        let draws = 60_000;
        for _ in 0..draws {
            counts[PowerOfTwo.select(&input, &mut rng).unwrap().worker.0 as usize] += 1;
        }
        assert_eq!(counts[1], 0, "the slowest of four can never win a pair");
        // Ranks: worker 2 (1st), 4 (2nd), 3 (3rd): expected shares 1/2, 1/3, 1/6.
        for (worker, share) in [(2, 0.5), (4, 1.0 / 3.0), (3, 1.0 / 6.0)] {
            let got = f64::from(counts[worker]) / f64::from(draws);
            assert!((got - share).abs() < 0.01, "worker {worker}: {got}");
        }
    }
}
