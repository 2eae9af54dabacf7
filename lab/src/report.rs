//! The JSON figures of one harness run.
//!
//! Top-level keys are what `docs/benchmarks.md` and issue 3 quote (`store_blocks_per_s`,
//! `query_p99_us`, `shard_balance`, ...), then the workload parameters (flattened), the
//! per-phase details under `phases`, the correctness checks, and where and when it ran.
//!
//! # Invariants
//! 1. Every rate is finite: a phase that moved nothing, or took no measurable time,
//!    reports 0.
//! 2. Latencies are in microseconds, read from nanosecond histograms (3 significant
//!    digits).
//! 3. The version string needs no git: it is the crate's version.

use crate::workload::{Plan, TraceAssign, WorkloadKind};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `count / seconds`, or 0 when either is 0 (invariant 1).
pub fn rate(count: u64, seconds: f64) -> f64 {
    let s = seconds;
    if count == 0 || s <= 0.0 || !s.is_finite() {
        0.0
    } else {
        count as f64 / s
    }
}

/// Latency percentiles of one query phase, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Slowest.
    pub max_us: f64,
}

impl Latency {
    /// Percentiles of a nanosecond histogram (all 0 when it is empty).
    pub fn from_ns(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let us = |ns: u64| ns as f64 / 1_000.0;
        Self {
            p50_us: us(h.value_at_quantile(0.50)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            mean_us: h.mean() / 1_000.0,
            max_us: us(h.max()),
        }
    }
}

/// One phase that applies events.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EventPhaseReport {
    /// Events applied.
    pub events: u64,
    /// Blocks stored.
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
    /// Wall time.
    pub seconds: f64,
    /// Stored plus removed blocks per second.
    pub block_ops_per_s: f64,
}

impl EventPhaseReport {
    /// The figures of a phase that applied `events`, `stored` and `removed` blocks in
    /// `elapsed`.
    pub fn new(events: u64, stored: u64, removed: u64, elapsed: Duration) -> Self {
        Self {
            events,
            stored_blocks: stored,
            removed_blocks: removed,
            seconds: elapsed.as_secs_f64(),
            block_ops_per_s: rate(stored + removed, elapsed.as_secs_f64()),
        }
    }
}

/// A phase of queries on a quiet index.
#[derive(Clone, Debug, Default, Serialize)]
pub struct QueryPhaseReport {
    /// Queries answered.
    pub queries: u64,
    /// Wall time of the whole loop.
    pub seconds: f64,
    /// Queries per second (one thread).
    pub queries_per_s: f64,
    /// Per-query latency.
    #[serde(flatten)]
    pub latency: Latency,
    /// Mean best overlap, in blocks.
    pub mean_best_overlap: f64,
    /// Answers whose best overlap differed from the workload's expectation.
    pub mismatches: u64,
}

/// The mixed phase: events while queries run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MixedPhaseReport {
    /// Rounds run (the workload's mixed streams, repeated in pairs for `--duration-s`).
    pub rounds: u64,
    /// Events, stored and removed blocks, time and rate, over all rounds.
    #[serde(flatten)]
    pub events: EventPhaseReport,
    /// Queries answered while events were applied.
    pub queries: u64,
    /// Those queries per second of phase time.
    pub queries_per_s: f64,
    /// Their latency.
    #[serde(flatten)]
    pub latency: Latency,
}

/// Every phase's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phases {
    /// From empty to the built index.
    pub build: EventPhaseReport,
    /// Queries of stored sequences, quiet index.
    pub hit: QueryPhaseReport,
    /// Queries matching only a common prefix, quiet index.
    pub prefix_only: QueryPhaseReport,
    /// More stores on the built index.
    pub store: EventPhaseReport,
    /// Stores and removes while queries run.
    pub mixed: MixedPhaseReport,
    /// Removing everything.
    pub remove: EventPhaseReport,
}

/// The workload's parameters, as run.
#[derive(Clone, Debug, Serialize)]
pub struct Params {
    /// (worker, block) pairs the sequences describe.
    pub size: u64,
    /// Blocks per sequence.
    pub depth: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Share of a sequence that is a common prompt.
    pub prefix_ratio: f64,
    /// Distinct common prompts.
    pub prefix_groups: u64,
    /// Common-prompt blocks per sequence.
    pub prefix_blocks: u64,
    /// Sequences (synthetic) or requests (trace).
    pub sequences: u64,
    /// Seed.
    pub seed: u64,
    /// Producer streams per phase.
    pub producers: u64,
    /// Query threads (lists) in the mixed phase.
    pub query_threads: u64,
    /// Queries per query phase and per mixed query thread.
    pub queries: u64,
    /// Minimum mixed-phase duration asked for.
    pub duration_s: f64,
    /// Events between two queries for single-threaded indexers in the mixed phase.
    pub events_per_query: u64,
    /// Trace file, if a trace.
    pub trace: Option<String>,
    /// Trace worker assignment, if a trace.
    pub trace_assign: Option<TraceAssign>,
    /// Blocks cached per simulated worker, if a trace.
    pub trace_capacity: Option<u64>,
}

impl Params {
    /// The parameters of `plan` run with `duration` and `events_per_query`.
    pub fn of(plan: &Plan, duration: Duration, events_per_query: usize) -> Self {
        let s = &plan.spec;
        let trace = s.trace.as_ref();
        Self {
            size: s.size as u64,
            depth: s.depth as u64,
            block_size: s.block_size as u64,
            prefix_ratio: s.prefix_ratio,
            prefix_groups: s.prefix_groups,
            prefix_blocks: plan.shape.prefix_blocks,
            sequences: plan.shape.sequences,
            seed: s.seed,
            producers: s.producers as u64,
            query_threads: s.query_threads as u64,
            queries: s.queries as u64,
            duration_s: duration.as_secs_f64(),
            events_per_query: events_per_query as u64,
            trace: trace.map(|t| t.path.display().to_string()),
            trace_assign: trace.map(|t| t.assign),
            trace_capacity: plan.shape.trace_capacity,
        }
    }
}

/// Correctness checks of the run; all zero / equal in a correct run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Checks {
    /// Live entries the workload expects after build.
    pub expected_entries_after_build: u64,
    /// Live entries the indexer reported after build.
    pub entries_after_build: u64,
    /// Live entries after the remove phase (0 when removes undo stores exactly).
    pub final_live_entries: u64,
    /// The indexer's anomalies (refused events, unheld removals, shard inconsistencies).
    pub anomalies: u64,
    /// Quiet-index queries whose best overlap was not the expected one.
    pub query_mismatches: u64,
}

impl Checks {
    /// Human-readable failures, empty when the run was correct.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.entries_after_build != self.expected_entries_after_build {
            p.push(format!(
                "{} live entries after build, expected {}",
                self.entries_after_build, self.expected_entries_after_build
            ));
        }
        if self.final_live_entries != 0 {
            p.push(format!(
                "{} live entries left after removing everything",
                self.final_live_entries
            ));
        }
        if self.anomalies != 0 {
            p.push(format!(
                "{} anomalies (refused or unheld events)",
                self.anomalies
            ));
        }
        if self.query_mismatches != 0 {
            p.push(format!(
                "{} queries answered with an unexpected overlap",
                self.query_mismatches
            ));
        }
        p
    }
}

/// Where the run happened.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub nproc: usize,
    /// CPU model, from /proc/cpuinfo where there is one.
    pub cpu: Option<String>,
    /// Operating system.
    pub os: &'static str,
    /// CPU architecture.
    pub arch: &'static str,
}

impl Machine {
    /// This machine.
    pub fn detect() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        });
        Self {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
        }
    }
}

/// The report of one run. Serialises to the JSON `--json` writes.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Workload name (`uniform`, `dynamo`, `shared-prefix`, `trace`).
    pub workload: WorkloadKind,
    /// The indexer, as it describes itself.
    pub indexer: String,
    /// Shards / cores in use.
    pub cores: usize,
    /// Simulated workers.
    pub workers: u64,
    /// Blocks stored per second in the store phase (on the built index, no queries).
    pub store_blocks_per_s: f64,
    /// Blocks removed per second in the remove phase (emptying the index).
    pub remove_blocks_per_s: f64,
    /// Stores plus removes per second while queries run (mixed phase).
    pub block_ops_per_s: f64,
    /// Blocks stored per second building the index from empty.
    pub build_blocks_per_s: f64,
    /// Hit queries per second while events are applied (mixed phase; the quiet-index hit
    /// phase if the mixed phase ran no query, see `query_source`).
    pub queries_per_s: f64,
    /// Hit-query latency percentiles, same source as `queries_per_s`.
    pub query_p50_us: f64,
    /// 99th percentile.
    pub query_p99_us: f64,
    /// 99.9th percentile.
    pub query_p999_us: f64,
    /// `mixed` or `hit`: where the query figures above come from.
    pub query_source: &'static str,
    /// Live (block, worker) entries after build.
    pub live_block_entries: u64,
    /// Heap bytes (index + directories, all shards) per live entry after build.
    pub bytes_per_block_entry: f64,
    /// Busiest shard's share of all block operations of the run, divided by `1 / cores`.
    pub shard_balance: f64,
    /// Block operations per shard over the whole run.
    pub shard_ops: Vec<u64>,
    /// Workload parameters.
    #[serde(flatten)]
    pub params: Params,
    /// Per-phase figures.
    pub phases: Phases,
    /// Correctness checks.
    pub checks: Checks,
    /// Where it ran.
    pub machine: Machine,
    /// When it ran (UTC, RFC 3339).
    pub date: String,
    /// What ran it.
    pub version: &'static str,
}

/// The harness's version string (invariant 3).
pub const VERSION: &str = concat!(env!("CARGO_PKG_NAME"), " ", env!("CARGO_PKG_VERSION"));

/// Now, UTC, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_from_unix(secs)
}

/// `secs` since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (Howard Hinnant's
/// civil-from-days).
pub fn utc_from_unix(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_unix(1_767_225_599), "2025-12-31T23:59:59Z");
    }

    #[test]
    fn rates_are_finite() {
        assert_eq!(rate(10, 0.0), 0.0);
        assert_eq!(rate(0, 1.0), 0.0);
        assert_eq!(rate(10, 2.0), 5.0);
        assert_eq!(
            Latency::from_ns(&crate::driver::latency_histogram()),
            Latency::default()
        );
    }
}
