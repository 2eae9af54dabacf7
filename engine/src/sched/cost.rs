//! The cost of serving one request on one worker key (DESIGN.md "Choosing a worker").
//!
//! ```text
//! prefill_blocks(w) = (active_prefill_tokens(w) + input_tokens - overlap(w) * block_size) / block_size
//! decode_blocks(w)  = active_blocks(w) + blocks of this request not already active on w
//! logit(w)          = overlap_weight * prefill_blocks(w) + decode_blocks(w)    (lower is better)
//! ```
//!
//! # Invariants
//! 1. `input_tokens - overlap * block_size` floors at 0, exactly as the active-request
//!    accounting does, so a score predicts the load the request will add.
//! 2. With a finite non-negative weight every field is finite and non-negative (u64 counts
//!    are far below f64's range), so logits never compare as NaN.

use crate::ids::WorkerKey;
use crate::sched::active::ActiveLoad;

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
    /// `overlap_weight * prefill_blocks + decode_blocks`; lower is better.
    pub logit: f64,
}

/// The request-wide inputs of the cost function.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CostInputs {
    pub block_size: u32,
    pub overlap_weight: f64,
    /// Blocks in the request.
    pub request_blocks: u64,
    /// Tokens in the request, the trailing partial block included.
    pub input_tokens: u64,
}

impl CostInputs {
    /// The score of `key`, which caches `overlap_blocks` of the request, carries `active`,
    /// and already holds `held_blocks` of the request's blocks in its active requests.
    #[inline]
    pub(crate) fn score(
        &self,
        key: WorkerKey,
        overlap_blocks: u32,
        active: ActiveLoad,
        held_blocks: u32,
    ) -> CandidateScore {
        let bs = u64::from(self.block_size.max(1));
        let new_prefill = self
            .input_tokens
            .saturating_sub(u64::from(overlap_blocks).saturating_mul(bs));
        let prefill_blocks =
            active.active_prefill_tokens.saturating_add(new_prefill) as f64 / bs as f64;
        let added = self.request_blocks.saturating_sub(u64::from(held_blocks));
        let decode_blocks = active.active_blocks.saturating_add(added);
        CandidateScore {
            key,
            overlap_blocks,
            prefill_blocks,
            decode_blocks,
            logit: self.overlap_weight * prefill_blocks + decode_blocks as f64,
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
        let s = inputs.score(WorkerKey::new(1, 0), 4, active, 2);
        assert_eq!(s.prefill_blocks, 4.25);
        assert_eq!(s.decode_blocks, 14);
        assert_eq!(s.logit, 2.0 * 4.25 + 14.0);

        // An idle worker with no overlap: 100 / 16 = 6.25 prefill, 6 decode.
        let s = inputs.score(WorkerKey::new(2, 0), 0, ActiveLoad::default(), 0);
        assert_eq!(
            (s.prefill_blocks, s.decode_blocks, s.logit),
            (6.25, 6, 18.5)
        );
    }

    #[test]
    fn overlap_beyond_input_floors_at_zero() {
        let inputs = CostInputs {
            block_size: 4,
            overlap_weight: 1.0,
            request_blocks: 2,
            input_tokens: 8,
        };
        let s = inputs.score(WorkerKey::new(1, 0), 5, ActiveLoad::default(), 9);
        assert_eq!((s.prefill_blocks, s.decode_blocks, s.logit), (0.0, 0, 0.0));
    }
}
