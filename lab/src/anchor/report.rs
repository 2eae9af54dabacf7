//! The JSON report of the anchor workloads: per run, the anchor's figures, details and
//! self-checks; over `--repeat` runs, min / median / max of every figure.
//!
//! Top level: `workload`, `indexer`, `cores`, `mixed_mode`, `repeat`, then the median of
//! every figure under the anchor's key (`store_blocks_per_s`, `hit_p99_us`, ...), then
//! `range` (`{key: [min, median, max]}`), `checks_passed` and `problems`, `params`
//! (W, D, S, r, G, N, E, P, ...), `mem_latency_ns`, `runs` (every run in full), and where
//! and when it ran.
//!
//! # Invariants
//! 1. [`Figures::KEYS`] lists every figure field in declaration order (one macro defines
//!    both), so `range` and the medians cover every figure.
//! 2. Every figure is finite: a rate or ratio with nothing to divide by is 0.
//! 3. The median of an even number of runs is the mean of the middle two.

use crate::calibrate::MemLatency;
use crate::driver::MixedMode;
use crate::report::Machine;
use crate::workload::WorkloadKind;
use crate::workload::anchor::{AnchorShape, AnchorSpec};
use serde::ser::{Serialize, SerializeMap, Serializer};

macro_rules! figures {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// One run's figures, under the anchor's keys (all `f64`, for min / median / max).
        #[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
        pub struct Figures {
            $($(#[$doc])* pub $name: f64,)*
        }

        impl Figures {
            /// Every figure's key, in declaration order (invariant 1).
            pub const KEYS: &[&str] = &[$(stringify!($name)),*];

            /// Every figure, in [`Figures::KEYS`] order.
            pub fn values(&self) -> Vec<f64> {
                vec![$(self.$name),*]
            }

            /// The figures from values in [`Figures::KEYS`] order (missing ones are 0).
            pub fn from_values(values: &[f64]) -> Self {
                let mut it = values.iter().copied();
                Self { $($name: it.next().unwrap_or(0.0),)* }
            }
        }
    };
}

figures! {
    /// Phase 1: base blocks stored per second, from empty until all are visible.
    store_blocks_per_s,
    /// Phase 5: blocks removed per second, until all removals are visible.
    remove_blocks_per_s,
    /// Phase 2: hit-query latency, median, microseconds.
    hit_p50_us,
    /// 99th percentile.
    hit_p99_us,
    /// Phase 2: prefix-only-query latency, median, microseconds.
    prefix_p50_us,
    /// 99th percentile.
    prefix_p99_us,
    /// Phase 2: hit queries per second, one caller.
    hit_qps_1,
    /// Phase 3: hit queries per second, two concurrent callers.
    hit_qps_2,
    /// Phase 4: extra blocks stored per second while one caller queries.
    mixed_store_blocks_per_s,
    /// Phase 4: latency of those queries, median, microseconds.
    mixed_query_p50_us,
    /// 99th percentile.
    mixed_query_p99_us,
    /// 99.9th percentile (the tail a p99 hides: table growth, preemption).
    mixed_query_p999_us,
    /// Slowest.
    mixed_query_max_us,
    /// Resident memory after phase 1 minus before the indexer existed, per base block.
    bytes_per_block,
    /// The indexer's own heap bytes after phase 1 per live entry.
    bytes_per_block_entry,
    /// Busiest shard's share of the run's block operations over `1 / shards`.
    shard_balance,
    /// Resident memory just before the indexer was created.
    rss_before_bytes,
    /// Resident memory after phase 1.
    rss_built_bytes,
    /// Resident memory after phase 5.
    rss_after_remove_bytes,
    /// `(after_remove - before) / (built - before)` (0 when built did not grow).
    residual_after_remove,
}

/// Self-checks of one run; a correct run has every mismatch at 0 and equal entry counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AnchorChecks {
    /// Live entries the generator expects after phase 1.
    pub expected_entries_after_base: u64,
    /// Live entries the indexer reported after phase 1.
    pub entries_after_base: u64,
    /// Phase 2 hit answers other than "D on the owner, P on every other prefix holder".
    pub hit_mismatches: u64,
    /// Phase 2 prefix-only answers other than "P on every prefix holder".
    pub prefix_mismatches: u64,
    /// Phase 3 hit answers (two callers) that were wrong the same way.
    pub hit_2_mismatches: u64,
    /// Hit queries re-run after phase 5 that still matched anything.
    pub matches_after_remove: u64,
    /// Live entries after phase 5.
    pub final_live_entries: u64,
    /// Refused events, unheld removals and shard inconsistencies over the run.
    pub anomalies: u64,
}

impl AnchorChecks {
    /// Human-readable failures, empty when the run was correct.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.entries_after_base != self.expected_entries_after_base {
            p.push(format!(
                "{} live entries after phase 1, expected {}",
                self.entries_after_base, self.expected_entries_after_base
            ));
        }
        for (n, what) in [
            (self.hit_mismatches, "hit answers wrong (one caller)"),
            (self.prefix_mismatches, "prefix-only answers wrong"),
            (self.hit_2_mismatches, "hit answers wrong (two callers)"),
            (
                self.matches_after_remove,
                "hit queries still matched after removal",
            ),
            (self.final_live_entries, "live entries left after removal"),
            (self.anomalies, "anomalies (refused or unheld events)"),
        ] {
            if n != 0 {
                p.push(format!("{n} {what}"));
            }
        }
        p
    }
}

/// Counts and times of one run, beside its figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RunDetails {
    /// Phase 1 wall time.
    pub store_seconds: f64,
    /// Blocks stored in phase 1.
    pub store_blocks: u64,
    /// Phase 2 hit loop wall time.
    pub hit_seconds: f64,
    /// Phase 2 prefix-only loop wall time.
    pub prefix_seconds: f64,
    /// Phase 3 wall time (first caller's start to last caller's end).
    pub hit_2_seconds: f64,
    /// Phase 3 latency over both callers, median, microseconds.
    pub hit_2_p50_us: f64,
    /// 99th percentile.
    pub hit_2_p99_us: f64,
    /// Phase 4 wall time (until every extra store was visible).
    pub mixed_seconds: f64,
    /// Blocks stored in phase 4.
    pub mixed_store_blocks: u64,
    /// Queries answered in phase 4.
    pub mixed_queries: u64,
    /// Phase 5 wall time.
    pub remove_seconds: f64,
    /// Blocks removed in phase 5.
    pub remove_blocks: u64,
    /// The indexer's heap bytes after phase 1.
    pub index_bytes_after_base: u64,
    /// The indexer's heap bytes after phase 5 (what it still holds when nobody holds
    /// anything; resident memory adds what the allocator keeps).
    pub index_bytes_after_remove: u64,
    /// Block operations per shard over the run.
    pub shard_ops: Vec<u64>,
}

/// One run in full.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunReport {
    /// The figures.
    #[serde(flatten)]
    pub figures: Figures,
    /// Counts and times.
    pub details: RunDetails,
    /// Self-checks.
    pub checks: AnchorChecks,
    /// The machine's memory latency measured right after this run: a run that is slow
    /// beside its siblings usually shows it here, in the 4-16 MB band.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_latency_ns: Option<MemLatency>,
}

impl Figures {
    /// Takes the resident-memory figures of `cold` (the first run in the process).
    pub fn take_memory_from(&mut self, cold: &Figures) {
        self.bytes_per_block = cold.bytes_per_block;
        self.rss_before_bytes = cold.rss_before_bytes;
        self.rss_built_bytes = cold.rss_built_bytes;
        self.rss_after_remove_bytes = cold.rss_after_remove_bytes;
        self.residual_after_remove = cold.residual_after_remove;
    }
}

/// `{key: [min, median, max]}` over runs, in [`Figures::KEYS`] order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Range(pub Vec<(&'static str, [f64; 3])>);

impl Serialize for Range {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// `[min, median, max]` of `values` (invariant 3); zeros when empty.
pub fn min_median_max(values: &[f64]) -> [f64; 3] {
    let mut v = values.to_vec();
    v.sort_unstable_by(f64::total_cmp);
    let mid = v.len() / 2;
    let median = match (
        v.len() % 2,
        v.get(mid),
        mid.checked_sub(1).and_then(|i| v.get(i)),
    ) {
        (1, Some(&m), _) => m,
        (_, Some(&hi), Some(&lo)) => (lo + hi) / 2.0,
        _ => 0.0,
    };
    [
        v.first().copied().unwrap_or(0.0),
        median,
        v.last().copied().unwrap_or(0.0),
    ]
}

/// The medians and the range of every figure over `runs`.
pub fn summarize(runs: &[RunReport]) -> (Figures, Range) {
    let per_run: Vec<Vec<f64>> = runs.iter().map(|r| r.figures.values()).collect();
    let mut range = Vec::with_capacity(Figures::KEYS.len());
    for (i, &key) in Figures::KEYS.iter().enumerate() {
        let column: Vec<f64> = per_run.iter().filter_map(|v| v.get(i).copied()).collect();
        range.push((key, min_median_max(&column)));
    }
    let medians: Vec<f64> = range.iter().map(|(_, r)| r[1]).collect();
    (Figures::from_values(&medians), Range(range))
}

/// The workload as run: the spec's W, D, S, r, G, seed and queries with N, E, P.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AnchorParams {
    /// W, D, S, r, G, seed, queries.
    #[serde(flatten)]
    pub spec: AnchorSpec,
    /// N, E, P and the (worker, group) pair counts.
    #[serde(flatten)]
    pub shape: AnchorShape,
}

/// The report of `kvengine bench indexer --workload dynamo-wN`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AnchorReport {
    /// `dynamo-w1` .. `dynamo-w4`.
    pub workload: WorkloadKind,
    /// The indexer, as it describes itself.
    pub indexer: String,
    /// Shards / cores in use.
    pub cores: usize,
    /// How phase 4 ran: `interleaved` (one thread, a query after every store event) or
    /// `concurrent` (a streaming thread beside a querying one).
    pub mixed_mode: MixedMode,
    /// Untimed runs before the timed ones.
    pub warmup_runs: usize,
    /// Whether the allocator was asked to return free memory before each resident-memory
    /// reading (see [`super::AnchorOptions::release_memory`]).
    pub memory_released: bool,
    /// Timed runs.
    pub repeat: usize,
    /// Medians over the timed runs (resident-memory figures: the first run's, see
    /// [`super`]).
    #[serde(flatten)]
    pub figures: Figures,
    /// `[min, median, max]` of every figure.
    pub range: Range,
    /// Every run's self-checks passed.
    pub checks_passed: bool,
    /// Failed self-checks, prefixed by run number.
    pub problems: Vec<String>,
    /// The workload's parameters.
    pub params: AnchorParams,
    /// Random-access memory latency, ns per load, by buffer size.
    pub mem_latency_ns: MemLatency,
    /// The warm-up runs in full.
    pub warmup: Vec<RunReport>,
    /// Every timed run in full.
    pub runs: Vec<RunReport>,
    /// Where it ran.
    pub machine: Machine,
    /// When it ran (UTC, RFC 3339).
    pub date: String,
    /// What ran it.
    pub version: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_runs() {
        assert_eq!(min_median_max(&[3.0, 1.0, 2.0]), [1.0, 2.0, 3.0]);
        assert_eq!(min_median_max(&[4.0, 1.0]), [1.0, 2.5, 4.0]);
        assert_eq!(min_median_max(&[]), [0.0; 3]);
    }

    #[test]
    fn keys_match_the_serialized_figures() {
        let f = Figures::from_values(
            &(0..Figures::KEYS.len())
                .map(|i| i as f64)
                .collect::<Vec<_>>(),
        );
        let json = serde_json::to_value(&f).unwrap();
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, Figures::KEYS);
        assert_eq!(f.values()[3], 3.0);
        let run = |x: f64| RunReport {
            figures: Figures {
                hit_qps_1: x,
                ..Figures::default()
            },
            details: RunDetails::default(),
            checks: AnchorChecks::default(),
            mem_latency_ns: None,
        };
        let (med, range) = summarize(&[run(1.0), run(5.0), run(3.0)]);
        assert_eq!(med.hit_qps_1, 3.0);
        let hit = range.0.iter().find(|(k, _)| *k == "hit_qps_1").unwrap();
        assert_eq!(hit.1, [1.0, 3.0, 5.0]);
    }
}
