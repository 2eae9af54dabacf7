//! `--shadow`: beside every routing decision, what another policy (or another router's
//! worker, named per request) would have chosen, counted in `/metrics` without changing
//! the route ([`engine::sched::ShadowSpec`], [`crate::misses`]).
//!
//! # Invariants
//! 1. A shadow decision is taken under the routing lock, in the same critical section and
//!    on the same state as the real one, before it; it reserves nothing and records
//!    nothing but counters ([`engine::router::Router::shadow`]).
//! 2. In [`Shadow::Header`] mode a request without a (valid) `x-kvengine-shadow-worker`
//!    header is not shadowed; no header is honoured in any other mode, so clients cannot
//!    move the counters unless the operator asked for it.

use super::Hub;
use crate::misses::Shadow;
use engine::WorkerId;
use engine::router::Routed;
use engine::router::misses::cacheable_blocks;
use engine::sched::ShadowSpec;

impl Hub {
    /// Takes a shadow decision beside every routing decision from now on (`--shadow`).
    pub fn with_shadow(mut self, shadow: Option<Shadow>) -> Self {
        self.shadow = shadow;
        self
    }

    /// What the shadow decisions follow, if anything.
    pub fn shadow(&self) -> Option<Shadow> {
        self.shadow
    }

    /// The shadow policy of one request; `beside`: the worker its
    /// [`SHADOW_WORKER_HEADER`] named (invariant 2).
    pub(super) fn shadow_spec(&self, beside: Option<WorkerId>) -> Option<ShadowSpec> {
        match self.shadow? {
            Shadow::Policy(spec) => Some(spec),
            Shadow::Header => beside.map(ShadowSpec::worker),
        }
    }

    /// Counts `routed`'s shadow decision (a failure if it was asked for and is missing).
    pub(super) fn count_shadow(&self, routed: &Routed, asked: bool, prompt_tokens: u64) {
        let misses = &self.metrics.misses;
        let Some(s) = routed.shadow else {
            if asked {
                misses.shadow_failed();
            }
            return;
        };
        let bs = self.routing.block_size_in(&routed.model);
        let tokens = |blocks: u32| {
            u64::from(blocks)
                .min(cacheable_blocks(prompt_tokens, bs))
                .saturating_mul(u64::from(bs))
        };
        let d = &routed.decision;
        misses.shadowed(
            &routed.model,
            s.worker == d.worker,
            tokens(d.overlap_blocks),
            tokens(s.overlap_blocks),
        );
    }
}

/// The shadow's predicted overlap tokens for `routed` (capped at the cacheable ones), if
/// it was shadowed.
pub fn shadow_tokens(routed: &Routed, block_size: u32, prompt_tokens: u64) -> Option<u64> {
    let s = routed.shadow?;
    Some(
        u64::from(s.overlap_blocks)
            .min(cacheable_blocks(prompt_tokens, block_size))
            .saturating_mul(u64::from(block_size)),
    )
}
