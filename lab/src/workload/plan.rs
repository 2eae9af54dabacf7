//! A whole run's pre-generated events and queries ([`Plan`]), phase by phase, and its sizes
//! for the report ([`PlanShape`]). The generators fill it (`Plan::generate`, in the
//! workload module).

use super::phase::Phase;
use super::query::{CheckedQuery, Query};
use super::spec::WorkloadSpec;
use serde::Serialize;

/// Sizes of the generated workload, for the report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanShape {
    /// Sequences (synthetic) or trace requests.
    pub sequences: u64,
    /// Common-prompt blocks per sequence (synthetic; 0 for traces).
    pub prefix_blocks: u64,
    /// Live (block, worker) entries after the build phase.
    pub entries_after_build: u64,
    /// Trace requests replayed, if a trace.
    pub trace_requests: Option<u64>,
    /// Blocks cached per simulated worker, if a trace.
    pub trace_capacity: Option<u64>,
}

/// The mixed phase's rounds.
#[derive(Clone, Debug, Default)]
pub struct MixedPhases {
    /// The first round.
    pub out: Phase,
    /// A round that undoes `out`'s changes to the live set (if the workload has one), so
    /// rounds can repeat in pairs for as long as asked.
    pub back: Option<Phase>,
}

/// A whole run's events and queries, generated before timing.
#[derive(Debug)]
pub struct Plan {
    /// The effective spec (named overrides applied).
    pub spec: WorkloadSpec,
    /// Sizes, for the report.
    pub shape: PlanShape,
    /// From empty to the built index.
    pub build: Phase,
    /// More stores on the built index.
    pub store: Phase,
    /// Stores and removes while queries run.
    pub mixed: MixedPhases,
    /// Removes everything still live (tails first, then prefixes).
    pub remove: Phase,
    /// Queries that hit a stored sequence, run on the built index.
    pub hit_queries: Vec<CheckedQuery>,
    /// Queries that match only a common prefix, run on the built index.
    pub prefix_queries: Vec<CheckedQuery>,
    /// Per mixed query thread, the queries it issues (cyclically).
    pub mixed_queries: Vec<Vec<Query>>,
}

impl Plan {
    /// The phases in the order the harness runs them (mixed rounds once each).
    pub fn phases_in_order(&self) -> impl Iterator<Item = &Phase> {
        [&self.build, &self.store, &self.mixed.out]
            .into_iter()
            .chain(self.mixed.back.as_ref())
            .chain([&self.remove])
    }
}
