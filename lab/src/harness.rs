//! Runs a [`Plan`]'s phases on an [`IndexerUnderTest`] and measures them.
//!
//! Phases, in order: build (empty to built), hit queries and prefix-only queries on the
//! quiet built index, store (more stores on it), mixed (stores and removes while queries
//! run, repeated in round pairs until `duration` has passed), remove (everything). Only
//! indexer calls are inside the timed windows; answers are checked outside them.
//!
//! # Invariants
//! 1. The indexer starts empty (checked) and the plan's phases are applied in the order
//!    the workload requires (workload invariant 3), so every check in
//!    [`crate::report::Checks`] is exact.
//! 2. Mixed rounds run in pairs (out, back) when the workload has a way back, so the live
//!    set after the mixed phase is the one the remove phase expects.

use crate::driver::{IndexerUnderTest, MixedPlan, latency_histogram, shard_balance};
use crate::report::{
    Checks, EventPhaseReport, Latency, Machine, MixedPhaseReport, Params, Phases, QueryPhaseReport,
    Report, VERSION, rate, utc_now,
};
use crate::workload::{CheckedQuery, Phase, Plan};
use anyhow::{Result, bail};
use std::time::{Duration, Instant};

/// How to run a plan.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// Keep repeating mixed round pairs until this much time has passed (at least one
    /// pair; zero: exactly one).
    pub duration: Duration,
    /// Knobs of the mixed phase.
    pub mixed: MixedPlan,
    /// Print one line per phase to stderr.
    pub progress: bool,
}

fn note(opts: &RunOptions, line: impl FnOnce() -> String) {
    if opts.progress {
        eprintln!("{}", line());
    }
}

fn event_phase(ix: &mut dyn IndexerUnderTest, phase: &Phase) -> Result<EventPhaseReport> {
    let start = Instant::now();
    ix.apply_all(&phase.streams)?;
    let elapsed = start.elapsed();
    Ok(EventPhaseReport::new(
        phase.events,
        phase.stored_blocks,
        phase.removed_blocks,
        elapsed,
    ))
}

fn query_phase(
    ix: &mut dyn IndexerUnderTest,
    queries: &[CheckedQuery],
) -> Result<QueryPhaseReport> {
    let mut hist = latency_histogram();
    let mut best_sum = 0u64;
    let mut mismatches = 0u64;
    let start = Instant::now();
    for q in queries {
        let t = Instant::now();
        let m = ix.query(&q.seqs)?;
        hist.saturating_record(t.elapsed().as_nanos() as u64);
        best_sum += u64::from(m.best());
        mismatches += u64::from(m.best() != q.expect_best);
    }
    let elapsed = start.elapsed();
    let n = queries.len() as u64;
    Ok(QueryPhaseReport {
        queries: n,
        seconds: elapsed.as_secs_f64(),
        queries_per_s: rate(n, elapsed.as_secs_f64()),
        latency: Latency::from_ns(&hist),
        mean_best_overlap: if n == 0 {
            0.0
        } else {
            best_sum as f64 / n as f64
        },
        mismatches,
    })
}

fn mixed_phase(
    ix: &mut dyn IndexerUnderTest,
    plan: &Plan,
    opts: &RunOptions,
) -> Result<MixedPhaseReport> {
    let mut hist = latency_histogram();
    let (mut elapsed, mut rounds) = (Duration::ZERO, 0u64);
    let (mut events, mut stored, mut removed) = (0u64, 0u64, 0u64);
    let mut round = |ix: &mut dyn IndexerUnderTest, phase: &Phase| -> Result<()> {
        let out = ix.mixed(&phase.streams, &plan.mixed_queries, &opts.mixed)?;
        elapsed += out.elapsed;
        hist.add(&out.latencies_ns)?;
        rounds += 1;
        events += phase.events;
        stored += phase.stored_blocks;
        removed += phase.removed_blocks;
        Ok(())
    };
    let wall = Instant::now();
    loop {
        round(ix, &plan.mixed.out)?;
        match &plan.mixed.back {
            Some(back) => round(ix, back)?,
            None => break,
        }
        if wall.elapsed() >= opts.duration {
            break;
        }
    }
    let queries = hist.len();
    Ok(MixedPhaseReport {
        rounds,
        events: EventPhaseReport::new(events, stored, removed, elapsed),
        queries,
        queries_per_s: rate(queries, elapsed.as_secs_f64()),
        latency: Latency::from_ns(&hist),
    })
}

/// Runs every phase of `plan` on `ix` (which must be empty) and reports.
pub fn run(ix: &mut dyn IndexerUnderTest, plan: &Plan, opts: &RunOptions) -> Result<Report> {
    let before = ix.stats()?;
    if before.live_entries != 0 {
        bail!(
            "the indexer under test must start empty ({} live entries)",
            before.live_entries
        );
    }
    let name = ix.name();
    note(opts, || {
        format!(
            "{} on {name}: {} sequences, {} entries after build",
            plan.spec.kind.name(),
            plan.shape.sequences,
            plan.shape.entries_after_build
        )
    });

    let build = event_phase(ix, &plan.build)?;
    note(opts, || line("build", &build));
    let built = ix.stats()?;
    let (live, bytes) = (built.live_entries, built.bytes);

    let hit = query_phase(ix, &plan.hit_queries)?;
    note(opts, || qline("hit", &hit));
    let prefix_only = query_phase(ix, &plan.prefix_queries)?;
    note(opts, || qline("prefix-only", &prefix_only));

    let store = event_phase(ix, &plan.store)?;
    note(opts, || line("store", &store));

    let mixed = mixed_phase(ix, plan, opts)?;
    note(opts, || {
        format!(
            "{}; {} queries, {:.0}/s, p50 {:.2} us, p99 {:.2} us",
            line("mixed", &mixed.events),
            mixed.queries,
            mixed.queries_per_s,
            mixed.latency.p50_us,
            mixed.latency.p99_us
        )
    });

    let remove = event_phase(ix, &plan.remove)?;
    note(opts, || line("remove", &remove));

    let end = ix.stats()?;
    let shard_ops = end.shard_ops_since(&before);
    let checks = Checks {
        expected_entries_after_build: plan.shape.entries_after_build,
        entries_after_build: live,
        final_live_entries: end.live_entries,
        anomalies: end.anomalies.saturating_sub(before.anomalies),
        query_mismatches: hit.mismatches + prefix_only.mismatches,
    };
    let (query_source, qps, lat) = if mixed.queries > 0 {
        ("mixed", mixed.queries_per_s, mixed.latency)
    } else {
        ("hit", hit.queries_per_s, hit.latency)
    };
    Ok(Report {
        workload: plan.spec.kind,
        indexer: name,
        cores: ix.cores(),
        workers: plan.spec.workers,
        store_blocks_per_s: rate(store.stored_blocks, store.seconds),
        remove_blocks_per_s: rate(remove.removed_blocks, remove.seconds),
        block_ops_per_s: mixed.events.block_ops_per_s,
        build_blocks_per_s: rate(build.stored_blocks, build.seconds),
        queries_per_s: qps,
        query_p50_us: lat.p50_us,
        query_p99_us: lat.p99_us,
        query_p999_us: lat.p999_us,
        query_source,
        live_block_entries: live,
        bytes_per_block_entry: if live == 0 {
            0.0
        } else {
            bytes as f64 / live as f64
        },
        shard_balance: shard_balance(&shard_ops),
        shard_ops,
        params: Params::of(plan, opts.duration, opts.mixed.events_per_query),
        phases: Phases {
            build,
            hit,
            prefix_only,
            store,
            mixed,
            remove,
        },
        checks,
        machine: Machine::detect(),
        date: utc_now(),
        version: VERSION,
    })
}

fn line(name: &str, p: &EventPhaseReport) -> String {
    format!(
        "{name:>11}: {} events, {} stored + {} removed blocks in {:.3} s = {:.2} M block ops/s",
        p.events,
        p.stored_blocks,
        p.removed_blocks,
        p.seconds,
        p.block_ops_per_s / 1e6
    )
}

fn qline(name: &str, q: &QueryPhaseReport) -> String {
    format!(
        "{name:>11}: {} queries, {:.0}/s, p50 {:.2} us, p99 {:.2} us, p999 {:.2} us, mean best {:.1}",
        q.queries,
        q.queries_per_s,
        q.latency.p50_us,
        q.latency.p99_us,
        q.latency.p999_us,
        q.mean_best_overlap
    )
}
