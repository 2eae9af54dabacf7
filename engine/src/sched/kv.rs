//! `kv` mode: send the request where it is cheapest to serve.
//!
//! Temperature 0 picks the minimum logit. Ties go to the key with fewer cached blocks (it has
//! the most free room, and hot prefixes spread over more workers), then uniformly at random.
//! Temperature `T > 0` samples `softmax(-logit / (range * T))`, `range = max - min` over this
//! decision's logits, so `T` is relative to the spread: at `T = 1` the worst candidate is
//! `e^-1` times as likely as the best, whatever the scale of the costs.
//!
//! # Invariants
//! 1. Logits within a relative `TIE_EPSILON` of the minimum tie: equal costs computed along
//!    different float paths (e.g. `0.1 * 2 + 1` and `0.1 * 12 + 0`) must tie.
//! 2. If every logit is equal (`range == 0`) sampling is uniform; if `range * T` underflows
//!    to 0 the choice is the temperature-0 one, which is its limit.
//! 3. No allocation: two passes over the candidates, whatever the number of ties.

use rand::Rng;
use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::cost::CandidateScore;
use crate::sched::policy::{Policy, SelectionInput};

/// Relative distance from the minimum logit under which two logits tie.
pub const TIE_EPSILON: f64 = 1e-9;

/// The `kv` policy. Stateless: all its state is the scheduler's load and RNG.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvPolicy;

impl Policy for KvPolicy {
    fn mode(&self) -> RouteMode {
        RouteMode::Kv
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        select_by_cost(input, rng)
    }
}

/// The `kv` choice among `input.candidates` (also used by `direct` among one worker's ranks).
pub fn select_by_cost(input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
    let c = input.candidates;
    let (min, max) = c
        .iter()
        .fold(None, |acc: Option<(f64, f64)>, s| match acc {
            None => Some((s.logit, s.logit)),
            Some((lo, hi)) => Some((lo.min(s.logit), hi.max(s.logit))),
        })
        .ok_or(EngineError::NoWorkers)?;
    if input.temperature > 0.0 {
        let range = max - min;
        if range == 0.0 {
            return uniform(c, rng);
        }
        let scale = range * input.temperature;
        if scale.is_finite() && scale > 0.0 {
            return sample_softmax(c, min, scale, rng);
        }
    }
    argmin(c, min, input.cached_blocks, rng)
}

/// A uniformly random candidate.
pub(crate) fn uniform(c: &[CandidateScore], rng: &mut SmallRng) -> Result<WorkerKey> {
    if c.is_empty() {
        return Err(EngineError::NoWorkers);
    }
    c.get(rng.random_range(0..c.len()))
        .map(|s| s.key)
        .ok_or(EngineError::NoWorkers)
}

fn argmin(
    c: &[CandidateScore],
    min: f64,
    cached_blocks: &dyn Fn(WorkerKey) -> u64,
    rng: &mut SmallRng,
) -> Result<WorkerKey> {
    let tolerance = TIE_EPSILON * min.abs().max(1.0);
    let tied = || c.iter().filter(move |s| s.logit - min <= tolerance);
    let mut fewest: Option<(u64, usize)> = None;
    for s in tied() {
        let b = cached_blocks(s.key);
        fewest = match fewest {
            Some((best, n)) if b == best => Some((best, n + 1)),
            Some((best, n)) if b > best => Some((best, n)),
            _ => Some((b, 1)),
        };
    }
    let (best, n) = fewest.ok_or(EngineError::NoWorkers)?;
    // Draw only on a real tie, so a clear winner does not advance the RNG.
    let pick = if n > 1 { rng.random_range(0..n) } else { 0 };
    tied()
        .filter(|s| cached_blocks(s.key) == best)
        .nth(pick)
        .map(|s| s.key)
        .ok_or(EngineError::NoWorkers)
}

fn sample_softmax(
    c: &[CandidateScore],
    min: f64,
    scale: f64,
    rng: &mut SmallRng,
) -> Result<WorkerKey> {
    // Shifted by the minimum: weights lie in (0, 1] and the best has weight 1, so the total
    // is at least 1 and nothing overflows.
    let weight = |s: &CandidateScore| (-(s.logit - min) / scale).exp();
    let total: f64 = c.iter().map(weight).sum();
    let mut u = rng.random::<f64>() * total;
    let mut last = None;
    for s in c {
        let w = weight(s);
        if w > 0.0 {
            if u < w {
                return Ok(s.key);
            }
            u -= w;
            last = Some(s.key);
        }
    }
    // Rounding can leave `u` just past the last weight.
    last.ok_or(EngineError::NoWorkers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::policy::KeyLoad;
    use rand::SeedableRng;

    fn cand(worker: u64, logit: f64) -> CandidateScore {
        CandidateScore {
            key: WorkerKey::new(worker, 0),
            overlap_blocks: 0,
            prefill_blocks: 0.0,
            decode_blocks: 0,
            predicted_ttft_ms: 0.0,
            logit,
        }
    }

    fn input<'a>(
        c: &'a [CandidateScore],
        t: f64,
        cached: &'a dyn Fn(WorkerKey) -> u64,
    ) -> SelectionInput<'a> {
        SelectionInput {
            candidates: c,
            temperature: t,
            request_blocks: 0,
            cached_blocks: cached,
            load: &|_| KeyLoad::default(),
        }
    }

    #[test]
    fn float_path_differences_still_tie() {
        let c = [
            cand(1, 0.1 * 2.0 + 1.0),
            cand(2, 0.1 * 12.0 + 0.0),
            cand(3, 1.3),
        ];
        assert_ne!(
            c[0].logit, c[1].logit,
            "the two sums differ in the last bit"
        );
        let cached = |k: WorkerKey| if k.worker.0 == 2 { 0 } else { 5 };
        let mut rng = SmallRng::seed_from_u64(0);
        let got = select_by_cost(&input(&c, 0.0, &cached), &mut rng).unwrap();
        assert_eq!(got, WorkerKey::new(2, 0));
    }

    #[test]
    fn softmax_frequencies_follow_weights() {
        let c = [cand(1, 1.0), cand(2, 2.0), cand(3, 3.0)];
        let none = |_: WorkerKey| 0;
        let mut rng = SmallRng::seed_from_u64(42);
        let n = 30_000;
        let mut hits = [0u32; 3];
        for _ in 0..n {
            let k = select_by_cost(&input(&c, 1.0, &none), &mut rng).unwrap();
            hits[(k.worker.0 - 1) as usize] += 1;
        }
        // range 2, T 1: weights e^0, e^-0.5, e^-1.
        let w = [1.0f64, (-0.5f64).exp(), (-1.0f64).exp()];
        let total: f64 = w.iter().sum();
        for i in 0..3 {
            let p = w[i] / total;
            let f = f64::from(hits[i]) / f64::from(n);
            assert!((f - p).abs() < 0.015, "candidate {i}: {f} vs {p}");
        }
    }

    #[test]
    fn equal_logits_sample_uniformly_and_underflow_acts_as_zero() {
        let c = [cand(1, 5.0), cand(2, 5.0)];
        let none = |_: WorkerKey| 0;
        let mut rng = SmallRng::seed_from_u64(1);
        let ones = (0..2000)
            .filter(|_| {
                select_by_cost(&input(&c, 0.5, &none), &mut rng)
                    .unwrap()
                    .worker
                    .0
                    == 1
            })
            .count();
        assert!((800..1200).contains(&ones), "{ones}");

        let c = [cand(1, 5.0), cand(2, 4.0)];
        for _ in 0..100 {
            let k = select_by_cost(&input(&c, 1e-320, &none), &mut rng).unwrap();
            assert_eq!(k.worker.0, 2);
        }
    }

    #[test]
    fn empty_candidates_is_an_error_not_a_panic() {
        let none = |_: WorkerKey| 0;
        let mut rng = SmallRng::seed_from_u64(1);
        for t in [0.0, 1.0] {
            assert_eq!(
                select_by_cost(&input(&[], t, &none), &mut rng),
                Err(EngineError::NoWorkers)
            );
        }
    }
}
