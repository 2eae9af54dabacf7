//! Pre-generated indexer workloads: every event and query of a run, built before timing.
//!
//! A [`Plan`] is what the harness drives: per phase, one [`EventStream`] per producer
//! thread, plus the query lists. Two generators fill it:
//!
//! * [`synthetic`]: NVIDIA Dynamo's indexer-benchmark shape (`uniform`, `dynamo`,
//!   `shared-prefix`): `size / depth` sequences of `depth` blocks, sequence `k` on worker
//!   `k mod W` in prefix group `k mod G`.
//! * [`trace`]: a Mooncake JSONL trace replayed onto simulated workers whose caches are
//!   bounded and evict LRU, so removals are real.
//!
//! The anchor-exact workloads (`dynamo-w1` .. `dynamo-w4`) have their own plan and phases:
//! [`anchor::AnchorPlan`], run by [`crate::anchor`]; [`Plan::generate`] refuses them.
//!
//! The types the generators share live in private leaf modules and are re-exported here:
//! `spec.rs` ([`WorkloadSpec`], [`WorkloadKind`], [`TraceSpec`]), `phase.rs` ([`Phase`],
//! [`PhaseBuilder`], [`EventStream`]), `query.rs` ([`Query`], [`CheckedQuery`]), `plan.rs`
//! ([`Plan`], [`PlanShape`], [`MixedPhases`]) and `rng.rs` ([`Rng`], [`mix64`]). The
//! generators build on them; this module only picks one ([`Plan::generate`]).
//!
//! # Invariants
//! 1. Everything is generated before the first timed phase; the timed part only moves
//!    pre-built [`KvEvent`]s (engine hashes and precomputed tokens hashes: no token
//!    hashing) and pre-hashed queries.
//! 2. All events of one worker key go to the same producer stream (producer
//!    `worker mod producers`), in the order the worker emitted them; streams share no
//!    worker, so any interleaving of streams is a valid global order.
//! 3. Applied in phase order (build, store, mixed rounds in pairs, remove) to an empty
//!    index, no event is refused, and the remove phase leaves the index empty.
//! 4. The same spec and seed give the same plan (a fixed mixing function, no versioned
//!    RNG).
//! 5. Every checked query's `expect_best` is the best overlap an exact index returns on the
//!    live set the phase runs against (after build, before store).
//!
//! [`KvEvent`]: engine::event::KvEvent

pub mod anchor;
pub mod export;
mod phase;
mod plan;
mod query;
mod rng;
mod spec;
pub mod synthetic;
pub mod trace;
pub mod trace_anchor;

pub use phase::{EventStream, Phase, PhaseBuilder};
pub use plan::{MixedPhases, Plan, PlanShape};
pub use query::{CheckedQuery, Query};
pub use rng::{Rng, mix64};
pub use spec::{MAX_SIZE, TraceAssign, TraceSpec, WorkloadKind, WorkloadSpec};

use anyhow::{Result, bail};

// Generated here, where the generators are: `Plan` itself (plan.rs) is what they fill and
// knows none of them.
impl Plan {
    /// Generates the plan of `spec` (after its named overrides).
    pub fn generate(spec: &WorkloadSpec) -> Result<Self> {
        let spec = spec.effective();
        if spec.kind.is_anchor() {
            bail!(
                "{} is an anchor workload: generate it with workload::anchor::AnchorPlan",
                spec.kind.name()
            );
        }
        spec.validate()?;
        match spec.kind {
            WorkloadKind::Trace => trace::plan(spec),
            _ => Ok(synthetic::plan(spec)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_overrides_and_validation() {
        let s = WorkloadSpec {
            kind: WorkloadKind::Uniform,
            ..WorkloadSpec::default()
        };
        assert_eq!(s.effective().prefix_ratio, 0.0);
        let s = WorkloadSpec {
            kind: WorkloadKind::SharedPrefix,
            ..WorkloadSpec::default()
        };
        assert_eq!(s.effective().prefix_groups, 1);
        assert_eq!(WorkloadSpec::default().prefix_blocks(), 32);
        for bad in [
            WorkloadSpec {
                depth: 0,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                size: 10,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                size: usize::MAX,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                prefix_ratio: 1.5,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                kind: WorkloadKind::Trace,
                ..WorkloadSpec::default()
            },
        ] {
            assert!(Plan::generate(&bad).is_err(), "{bad:?}");
        }
    }
}
