//! The cost of serving one request on one worker key (DESIGN.md "Choosing a worker").
//!
//! ```text
//! prefill_blocks(w) = (active_prefill_tokens(w) + input_tokens - overlap(w) * block_size) / block_size
//! decode_blocks(w)  = active_blocks(w) + blocks of this request not already active on w
//! ```
//!
//! and the logit (lower is better) is, with `--router-cost`
//!
//! ```text
//! dynamo:  overlap_weight * (prefill_blocks(w) + recompute_weight * recompute_blocks(w))
//!            + decode_blocks(w)
//! ttft:    predicted_ttft_ms(w) + stall_weight * own_ms(w) * active_requests(w)
//!            + recompute_weight * recompute_ms(w)
//!   recompute_blocks(w)  = best_overlap - overlap(w), best_overlap the most any candidate
//!                          of the decision caches
//!   recompute_ms(w)      = own_ms(w) minus w's fitted time for the same request cached as
//!                          far as best_overlap
//!   own_ms(w)            = w's fitted model (crate::sched::ttft) of the time to prefill
//!                          this request's uncached tokens after its cached prefix, at
//!                          w's batch with it added
//!   predicted_ttft_ms(w) = wait_ms(w) + base(w) + own_ms(w), wait_ms(w) the time until
//!                          w's queued prefills are done (crate::sched::drain)
//!   stall:                 with chunked prefill, each running request on w waits own_ms
//!                          longer for its next tokens
//! ```
//!
//! Every candidate's `predicted_ttft_ms` is reported under both costs (power-of-two mode
//! compares it directly).
//!
//! Under both costs the scheduler then adds the footprint term to each candidate's logit,
//! `footprint_weight * (cached(w) - min over the candidates of cached(w))`, `cached(w)` the
//! blocks the index last counted on `w` plus what was routed to it since (see
//! [`crate::router::Router::cached_blocks`]).
//!
//! # Why a footprint term
//! A worker's cache evicts its least recently used blocks once it is full; a worker that
//! has taken more new prefixes than the others fills first and evicts prefixes that would
//! have been hit later, while the others still have room. Load alone does not see this: on
//! the Mooncake trace at 131,072 blocks per worker, a cache no router can beat (one LRU of
//! the cluster's size) hits 16.91% of the prompt tokens, and where the load put each new
//! prefix decided whether a long prefix outlived its worker's LRU (one run in ten fell to
//! 16.46%; with the term none of fifteen fell below 16.86%). The term sends new prefixes to
//! the emptier caches, as SGLang's router does with its smallest tree. It vanishes when
//! every cache is full (their footprints are equal), and for a prefix some worker holds the
//! recompute term outweighs it.
//!
//! # Why a recompute term
//! The first two terms price the request alone: a worker whose prefill queue is a little
//! shorter wins even if it must recompute a long prefix another worker holds. That
//! recompute is compute the cluster spends twice, and every later request waits behind it
//! somewhere; measured against the real peers (docs/benchmarks.md, "Issue 31"), most of
//! the hit rate they had over kvengine was such moves. `recompute_weight` charges them, in
//! the unit of the cost's own prefill term; unlike a larger `overlap_weight`, it does not
//! also scale the queue term, so it buys stickiness without ignoring queues.
//!
//! # Invariants
//! 1. `input_tokens - overlap * block_size` floors at 0, exactly as the active-request
//!    accounting does, so a score predicts the load the request will add.
//! 2. With a finite non-negative weight every field is finite and non-negative (u64 counts
//!    are far below f64's range), so logits never compare as NaN.
//! 3. The recompute term is 0 for every candidate caching as much as the best one, and
//!    never negative.

use crate::ids::WorkerKey;
use crate::sched::active::ActiveLoad;
use crate::sched::config::RouterCost;
use crate::sched::ttft::{Prefill, TtftFit};

/// One candidate's cost, as the decision that considered it reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CandidateScore {
    /// The worker key.
    pub key: WorkerKey,
    /// Leading blocks of the request the key already caches.
    pub overlap_blocks: u32,
    /// Blocks the key would have to prefill, its queue included.
    pub prefill_blocks: f64,
    /// Blocks the key would hold in active requests with this one added.
    pub decode_blocks: u64,
    /// The key's fitted prediction of this request's time to first token, in ms.
    pub predicted_ttft_ms: f64,
    /// The cost the mode minimised (see the module docs); lower is better.
    pub logit: f64,
}

/// The request-wide inputs of the cost function.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CostInputs {
    pub block_size: u32,
    pub cost: RouterCost,
    pub overlap_weight: f64,
    pub stall_weight: f64,
    pub recompute_weight: f64,
    /// Blocks in the request.
    pub request_blocks: u64,
    /// Tokens in the request, the trailing partial block included.
    pub input_tokens: u64,
}

impl CostInputs {
    /// The score of `key`, which caches `overlap_blocks` of the request (the best candidate
    /// caches `best_overlap`), carries `active`, already holds `held_blocks` of the
    /// request's blocks in its active requests, whose prefill speed is `fit` and whose
    /// queued prefills end in `wait_ms`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn score(
        &self,
        key: WorkerKey,
        overlap_blocks: u32,
        best_overlap: u32,
        active: ActiveLoad,
        held_blocks: u32,
        fit: &TtftFit,
        wait_ms: f64,
    ) -> CandidateScore {
        let bs = u64::from(self.block_size.max(1));
        let new_prefill = self
            .input_tokens
            .saturating_sub(u64::from(overlap_blocks).saturating_mul(bs));
        let prefill_blocks =
            active.active_prefill_tokens.saturating_add(new_prefill) as f64 / bs as f64;
        let added = self.request_blocks.saturating_sub(u64::from(held_blocks));
        let decode_blocks = active.active_blocks.saturating_add(added);
        let prefill = Prefill {
            tokens: new_prefill,
            cached: self.input_tokens - new_prefill,
            batch_blocks: decode_blocks,
        };
        let own_ms = fit.prefill_ms(&prefill);
        let predicted_ttft_ms = wait_ms + fit.predict_ms(&prefill);
        // Invariant 3: what this key would recompute of what the best-cached one holds.
        let recompute_blocks = best_overlap.saturating_sub(overlap_blocks);
        let logit = match self.cost {
            RouterCost::Dynamo => {
                self.overlap_weight
                    * (prefill_blocks + self.recompute_weight * f64::from(recompute_blocks))
                    + decode_blocks as f64
            }
            RouterCost::Ttft => {
                let recompute_ms = if recompute_blocks == 0 {
                    0.0
                } else {
                    let best_new = self
                        .input_tokens
                        .saturating_sub(u64::from(best_overlap).saturating_mul(bs));
                    let at_best = Prefill {
                        tokens: best_new,
                        cached: self.input_tokens - best_new,
                        batch_blocks: decode_blocks,
                    };
                    (own_ms - fit.prefill_ms(&at_best)).max(0.0)
                };
                predicted_ttft_ms
                    + self.stall_weight * own_ms * active.active_requests as f64
                    + self.recompute_weight * recompute_ms
            }
        };
        CandidateScore {
            key,
            overlap_blocks,
            prefill_blocks,
            decode_blocks,
            predicted_ttft_ms,
            logit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_example() {
        // block_size 16; the request has 6 full blocks and 100 tokens.
        let inputs = CostInputs {
            block_size: 16,
            cost: RouterCost::Dynamo,
            stall_weight: 0.0,
            recompute_weight: 0.0,
            overlap_weight: 2.0,
            request_blocks: 6,
            input_tokens: 100,
        };
        let active = ActiveLoad {
            active_blocks: 10,
            active_prefill_tokens: 32,
            active_requests: 2,
        };
        // Overlap 4: 100 - 64 = 36 new tokens; (32 + 36) / 16 = 4.25 prefill blocks.
        // Two of the request's blocks are already active: 10 + (6 - 2) = 14 decode blocks.
        let s = inputs.score(
            WorkerKey::new(1, 0),
            4,
            4,
            active,
            2,
            &TtftFit::default(),
            0.0,
        );
        assert_eq!(s.prefill_blocks, 4.25);
        assert_eq!(s.decode_blocks, 14);
        assert_eq!(s.logit, 2.0 * 4.25 + 14.0);

        // An idle worker with no overlap: 100 / 16 = 6.25 prefill, 6 decode.
        let s = inputs.score(
            WorkerKey::new(2, 0),
            0,
            0,
            ActiveLoad::default(),
            0,
            &TtftFit::default(),
            0.0,
        );
        assert_eq!(
            (s.prefill_blocks, s.decode_blocks, s.logit),
            (6.25, 6, 18.5)
        );
    }

    #[test]
    fn overlap_beyond_input_floors_at_zero() {
        let inputs = CostInputs {
            block_size: 4,
            cost: RouterCost::Dynamo,
            stall_weight: 0.0,
            recompute_weight: 0.0,
            overlap_weight: 1.0,
            request_blocks: 2,
            input_tokens: 8,
        };
        let s = inputs.score(
            WorkerKey::new(1, 0),
            5,
            5,
            ActiveLoad::default(),
            9,
            &TtftFit::default(),
            0.0,
        );
        assert_eq!((s.prefill_blocks, s.decode_blocks, s.logit), (0.0, 0, 0.0));
    }

    #[test]
    fn recompute_charges_what_the_best_cached_candidate_holds() {
        // block_size 16, 10 blocks, 160 tokens; the best candidate caches 8 blocks.
        let dynamo = CostInputs {
            block_size: 16,
            cost: RouterCost::Dynamo,
            stall_weight: 0.0,
            recompute_weight: 3.0,
            overlap_weight: 2.0,
            request_blocks: 10,
            input_tokens: 160,
        };
        let idle = ActiveLoad::default();
        let fit = TtftFit::default();
        let key = WorkerKey::new(1, 0);
        // Caching 2 of the best one's 8: 10 - 2 = 8 prefill blocks, 6 recomputed.
        let s = dynamo.score(key, 2, 8, idle, 0, &fit, 0.0);
        assert_eq!(s.logit, 2.0 * (8.0 + 3.0 * 6.0) + 10.0);
        // The best-cached candidate pays no recompute.
        let best = dynamo.score(key, 8, 8, idle, 0, &fit, 0.0);
        assert_eq!(best.logit, 2.0 * 2.0 + 10.0);
        // At weight 0 the term is gone: the logit is Dynamo's formula.
        let plain = CostInputs {
            recompute_weight: 0.0,
            ..dynamo
        };
        assert_eq!(
            plain.score(key, 2, 8, idle, 0, &fit, 0.0).logit,
            2.0 * 8.0 + 10.0
        );

        // ttft: the recompute is priced at the candidate's own fitted prefill time.
        let ttft = CostInputs {
            cost: RouterCost::Ttft,
            ..dynamo
        };
        let off = CostInputs {
            recompute_weight: 0.0,
            ..ttft
        };
        let at_best = Prefill {
            tokens: 32,
            cached: 128,
            batch_blocks: 10,
        };
        let own = Prefill {
            tokens: 128,
            cached: 32,
            batch_blocks: 10,
        };
        let extra = fit.prefill_ms(&own) - fit.prefill_ms(&at_best);
        assert!(extra > 0.0);
        let with = ttft.score(key, 2, 8, idle, 0, &fit, 0.0).logit;
        let without = off.score(key, 2, 8, idle, 0, &fit, 0.0).logit;
        assert!(
            (with - without - 3.0 * extra).abs() < 1e-9,
            "{with} {without}"
        );
        assert_eq!(
            ttft.score(key, 8, 8, idle, 0, &fit, 0.0).logit,
            off.score(key, 8, 8, idle, 0, &fit, 0.0).logit
        );
    }

    #[test]
    fn ttft_cost_is_the_prediction_plus_the_weighted_stall() {
        let inputs = CostInputs {
            block_size: 16,
            cost: RouterCost::Ttft,
            stall_weight: 0.5,
            recompute_weight: 0.0,
            overlap_weight: 1.0,
            request_blocks: 125,
            input_tokens: 2000,
        };
        let active = ActiveLoad {
            active_blocks: 875,
            active_prefill_tokens: 1000,
            active_requests: 4,
        };
        let fit = TtftFit::default();
        // No overlap: 2,000 new tokens 30 ms behind the queue; 875 + 125 = 1,000 blocks.
        // Prior: own 2 * 40 + 2 * 1 * 1.5 + 2 * 1 * 5 = 93 ms; TTFT 30 + (5 + 2) + 93 =
        // 130 ms; the stall, 93 ms, on each of 4 requests.
        let s = inputs.score(WorkerKey::new(1, 0), 0, 0, active, 0, &fit, 30.0);
        assert!((s.predicted_ttft_ms - 130.0).abs() < 1e-9, "{s:?}");
        assert!((s.logit - (130.0 + 0.5 * 93.0 * 4.0)).abs() < 1e-9, "{s:?}");
        // Caching 100 blocks (1,600 tokens) saves their prefill and their stall.
        let cached = inputs.score(WorkerKey::new(1, 0), 100, 100, active, 0, &fit, 30.0);
        assert!(cached.logit < s.logit && cached.predicted_ttft_ms < s.predicted_ttft_ms);
    }
}
