//! [`Router::shadow`]: a shadow decision ([`crate::sched::ShadowSpec`]) for a request
//! about to be routed, taken on the same state as its real decision.
//!
//! # Invariants
//! 1. Records nothing: no request id is interned or consumed, and the scheduler changes
//!    only the shadow's own policy state (the scheduler's shadow invariant 1). Requests
//!    past their timeout are expired first, as the routing call that follows would do, so
//!    both see the same load.

use super::{RouteCall, RouteError, Router};
use crate::ids::{RequestId, SeqHash};
use crate::matches::Matches;
use crate::sched::{RouteRequest, ShadowDecision, ShadowSpec};
use std::time::Instant;

impl Router {
    /// What `spec`'s policy would choose for `call` (whose full blocks are `seqs` and
    /// overlaps `matches`) now; call it before routing `call`, so both see the same load.
    pub fn shadow(
        &mut self,
        now: Instant,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
        spec: &ShadowSpec,
    ) -> Result<ShadowDecision, RouteError> {
        self.expire(now);
        let request = RouteRequest {
            // Not recorded: any id does.
            id: RequestId(self.next_id),
            blocks: seqs,
            input_tokens: call.tokens.len() as u64,
            overrides: call.overrides,
        };
        let cached = &self.cached;
        self.scheduler
            .shadow(
                now,
                &request,
                matches,
                &|k| cached.get(&k).copied().unwrap_or(0),
                spec,
            )
            .map_err(RouteError::Engine)
    }
}
