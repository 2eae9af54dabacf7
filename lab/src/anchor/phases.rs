//! One run of the anchor's five phases on a fresh indexer, and its figures.
//!
//! # Invariants
//! 1. `rss_before` is read after everything the run allocates outside the indexer exists
//!    (the plan, the phase-4 query list) and just before the indexer is created. Resident
//!    memory counts pages the allocator keeps after a free, so a later run can reuse an
//!    earlier run's pages (its `bytes_per_block` reads low): `runs[0]` is the run with a
//!    clean start.
//! 2. Timed windows contain only indexer calls (and, for queries, recording each answer's
//!    two-word summary); answers are checked after the window ([`super::checks`]).
//! 3. The indexer starts empty (checked) and the phases run in the plan's order (base,
//!    queries, extra, remove), so every expectation of [`super::checks`] is exact.
//!
//! # Concurrency
//! Called from one thread; the indexer runs its own threads inside a call (phase 3's
//! callers, a runtime's producer and query threads) and is quiescent when it returns.

use super::checks::{non_empty, verify};
use super::report::{AnchorChecks, Figures, RunDetails, RunReport};
use crate::calibrate::rss_bytes;
use crate::driver::{CallersOutcome, IndexerUnderTest, MixedMode, MixedPlan};
use crate::driver::{latency_histogram, shard_balance};
use crate::report::{Latency, rate};
use crate::workload::Query;
use crate::workload::anchor::AnchorPlan;
use anyhow::{Context, Result, bail};
use std::time::Instant;

/// Concurrent callers of phase 3.
pub const PHASE_3_CALLERS: usize = 2;

/// What one run produced, and what the indexer said about itself.
#[derive(Debug)]
pub struct RunOutcome {
    /// The run's figures, details and checks.
    pub report: RunReport,
    /// The indexer's name.
    pub indexer: String,
    /// Its cores.
    pub cores: usize,
    /// How its mixed phase ran.
    pub mixed_mode: MixedMode,
}

/// Latency, wall time and rate of a query phase.
struct Timed {
    lat: Latency,
    seconds: f64,
    qps: f64,
}

fn timed(out: &CallersOutcome) -> Result<Timed> {
    let mut all = latency_histogram();
    for h in &out.latencies_ns {
        all.add(h).context("merging latencies")?;
    }
    let seconds = out.elapsed.as_secs_f64();
    Ok(Timed {
        lat: Latency::from_ns(&all),
        seconds,
        qps: rate(out.queries(), seconds),
    })
}

/// `(a - b) / d` for byte counts, 0 when `d` is not positive.
fn ratio(a: u64, b: u64, d: f64) -> f64 {
    if d > 0.0 {
        (a as f64 - b as f64) / d
    } else {
        0.0
    }
}

/// Runs the five phases on a fresh indexer from `make`.
pub fn run_once(
    make: &mut dyn FnMut() -> Result<Box<dyn IndexerUnderTest>>,
    plan: &AnchorPlan,
    progress: bool,
    release_memory: Option<fn()>,
) -> Result<RunOutcome> {
    let rss = || {
        if let Some(release) = release_memory {
            release();
        }
        rss_bytes().unwrap_or(0)
    };
    let note = |line: String| {
        if progress {
            eprintln!("{line}");
        }
    };
    let expect = |id| plan.answer(id);
    let mixed_list = vec![plan.hit_queries.clone()];
    let rss_before = rss();
    let mut ix = make()?;
    let before = ix.stats()?;
    if before.live_entries != 0 {
        bail!(
            "the indexer must start empty ({} live entries)",
            before.live_entries
        );
    }
    if ix.max_callers() < PHASE_3_CALLERS {
        bail!(
            "{} serves {} concurrent callers; phase 3 needs {PHASE_3_CALLERS}",
            ix.name(),
            ix.max_callers()
        );
    }

    let t = Instant::now();
    ix.apply_all(&plan.base.streams)?;
    let store_s = t.elapsed().as_secs_f64();
    let rss_built = rss();
    let built = ix.stats()?;
    let base_blocks = plan.base.stored_blocks;
    note(format!(
        "  1 store: {} events, {base_blocks} blocks in {store_s:.3} s, {} live entries",
        plan.base.events, built.live_entries
    ));

    let hits: &[&[Query]] = &[&plan.hit_queries];
    let out = ix.query_callers(hits, false)?;
    let hit = timed(&out)?;
    let hit_bad = verify(ix.as_mut(), hits, &[&plan.hit_answers], &out, &expect)?;
    let prefixes: &[&[Query]] = &[&plan.prefix_queries];
    let out = ix.query_callers(prefixes, false)?;
    let prefix = timed(&out)?;
    let asked: &[&[u64]] = &[&plan.prefix_answers];
    let prefix_bad = verify(ix.as_mut(), prefixes, asked, &out, &expect)?;
    note(format!(
        "  2 query: {} hits in {:.3} s (p50 {:.2} us), {} prefix-only in {:.3} s (p50 {:.2} us)",
        plan.hit_queries.len(),
        hit.seconds,
        hit.lat.p50_us,
        plan.prefix_queries.len(),
        prefix.seconds,
        prefix.lat.p50_us
    ));

    let half = plan.hit_queries.len() / 2;
    let (qa, qb) = plan.hit_queries.split_at(half);
    let (sa, sb) = plan.hit_answers.split_at(half);
    let out = ix.query_callers(&[qa, qb], false)?;
    let two = timed(&out)?;
    let hit_2_bad = verify(ix.as_mut(), &[qa, qb], &[sa, sb], &out, &expect)?;
    note(format!(
        "  3 query x{PHASE_3_CALLERS}: {} hits in {:.3} s (p50 {:.2} us)",
        plan.hit_queries.len(),
        two.seconds,
        two.lat.p50_us
    ));

    let mixed = ix.mixed(
        &plan.extra.streams,
        &mixed_list,
        &MixedPlan::with_events_per_query(1),
    )?;
    let mixed_s = mixed.elapsed.as_secs_f64();
    let mixed_lat = Latency::from_ns(&mixed.latencies_ns);
    note(format!(
        "  4 mixed ({:?}): {} events, {} blocks in {mixed_s:.3} s, {} queries (p50 {:.2} us)",
        ix.mixed_mode(),
        plan.extra.events,
        plan.extra.stored_blocks,
        mixed.latencies_ns.len(),
        mixed_lat.p50_us
    ));

    let t = Instant::now();
    ix.apply_all(&plan.remove.streams)?;
    let remove_s = t.elapsed().as_secs_f64();
    let rss_after = rss();
    note(format!(
        "  5 remove: {} events, {} blocks in {remove_s:.3} s",
        plan.remove.events, plan.remove.removed_blocks
    ));

    let matches_after_remove = non_empty(&ix.query_callers(hits, false)?);
    let end = ix.stats()?;
    let (indexer, cores, mixed_mode) = (ix.name(), ix.cores(), ix.mixed_mode());
    drop(ix);

    let shard_ops = end.shard_ops_since(&before);
    let grown = rss_built as f64 - rss_before as f64;
    let figures = Figures {
        store_blocks_per_s: rate(base_blocks, store_s),
        remove_blocks_per_s: rate(plan.remove.removed_blocks, remove_s),
        hit_p50_us: hit.lat.p50_us,
        hit_p99_us: hit.lat.p99_us,
        prefix_p50_us: prefix.lat.p50_us,
        prefix_p99_us: prefix.lat.p99_us,
        hit_qps_1: hit.qps,
        hit_qps_2: two.qps,
        mixed_store_blocks_per_s: rate(plan.extra.stored_blocks, mixed_s),
        mixed_query_p50_us: mixed_lat.p50_us,
        mixed_query_p99_us: mixed_lat.p99_us,
        mixed_query_p999_us: mixed_lat.p999_us,
        mixed_query_max_us: mixed_lat.max_us,
        bytes_per_block: ratio(rss_built, rss_before, base_blocks as f64),
        bytes_per_block_entry: ratio(built.bytes as u64, 0, built.live_entries as f64),
        shard_balance: shard_balance(&shard_ops),
        rss_before_bytes: rss_before as f64,
        rss_built_bytes: rss_built as f64,
        rss_after_remove_bytes: rss_after as f64,
        residual_after_remove: ratio(rss_after, rss_before, grown),
    };
    let details = RunDetails {
        store_seconds: store_s,
        store_blocks: base_blocks,
        hit_seconds: hit.seconds,
        prefix_seconds: prefix.seconds,
        hit_2_seconds: two.seconds,
        hit_2_p50_us: two.lat.p50_us,
        hit_2_p99_us: two.lat.p99_us,
        mixed_seconds: mixed_s,
        mixed_store_blocks: plan.extra.stored_blocks,
        mixed_queries: mixed.latencies_ns.len(),
        remove_seconds: remove_s,
        remove_blocks: plan.remove.removed_blocks,
        index_bytes_after_base: built.bytes as u64,
        index_bytes_after_remove: end.bytes as u64,
        shard_ops,
    };
    let checks = AnchorChecks {
        expected_entries_after_base: plan.shape.entries_after_base,
        entries_after_base: built.live_entries,
        hit_mismatches: hit_bad,
        prefix_mismatches: prefix_bad,
        hit_2_mismatches: hit_2_bad,
        matches_after_remove,
        final_live_entries: end.live_entries,
        anomalies: end.anomalies.saturating_sub(before.anomalies),
    };
    Ok(RunOutcome {
        report: RunReport {
            figures,
            details,
            checks,
            mem_latency_ns: None,
        },
        indexer,
        cores,
        mixed_mode,
    })
}
