//! The anchor-exact harness: `kvengine bench indexer --workload dynamo-w1` .. `dynamo-w4`.
//!
//! It runs [`AnchorPlan`] (see [`crate::workload::anchor`] for the workload) through any
//! [`IndexerUnderTest`], `repeat` times, each time on a fresh indexer, in five phases:
//!
//! 1. store the base sequences from empty, timed until every event is visible;
//! 2. on the quiet index, one caller: the hit queries (random base sequences at full
//!    depth), then the prefix-only queries (a group's prefix plus fresh blocks);
//! 3. the same hit queries split across two concurrent callers;
//! 4. one thread streams the extra sequences' stores while one caller queries back to back
//!    (hit queries, cyclically) until they are visible. A single-threaded indexer has no
//!    second thread: it interleaves one query after every store event, and the report
//!    says so (`mixed_mode: interleaved`);
//! 5. remove every tail, then every (worker, group) prefix, timed until visible.
//!
//! Before the runs it measures the machine's memory latency once ([`crate::calibrate`]);
//! each run reads resident memory before the indexer exists, after phase 1 and after
//! phase 5. `warmup` untimed runs come first (same phases, same checks, reported under
//! `warmup`): the first run in a process pays for every page the allocator gets from the
//! OS, which measured 3-4x slower than the runs after it, so speed figures are the
//! steady state. The report ([`report::AnchorReport`]) has each speed figure's median over
//! the timed runs at the top level, min / median / max under `range`, and every run under
//! `runs`; the resident-memory figures at the top level are the first run's (warm-up or
//! not), the only one whose memory comes fresh from the OS (later runs reuse pages the
//! allocator kept).
//!
//! # Invariants
//! 1. The plan is generated once, before the first indexer exists, and shared by the runs.
//! 2. Every answer of phases 2 and 3 is checked after its timed window: the timed pass
//!    keeps each answer's summary (best overlap, holders), and an untimed re-run on the
//!    same callers keeps whole answers ([`checks`]); the hit queries re-run after phase 5
//!    must match nobody. With the event and entry counts they make each run's
//!    [`report::AnchorChecks`].
//! 3. Runs are independent: each creates its indexer through `make` and drops it before
//!    the next one starts.

pub mod checks;
pub mod phases;
pub mod report;

use crate::calibrate::mem_latency;
use crate::driver::IndexerUnderTest;
use crate::report::{Machine, VERSION, utc_now};
use crate::workload::anchor::AnchorPlan;
use anyhow::{Result, bail};
use report::{AnchorParams, AnchorReport, summarize};

/// How to run an anchor plan.
#[derive(Clone, Copy, Debug)]
pub struct AnchorOptions {
    /// Untimed runs before the timed ones (their figures are reported apart).
    pub warmup: usize,
    /// Runs, each on a fresh indexer (at least 1).
    pub repeat: usize,
    /// Print one line per phase to stderr.
    pub progress: bool,
    /// Called before each resident-memory reading to have the allocator return free
    /// memory to the OS (the binary passes mimalloc's collect): otherwise a reading taken
    /// right after a phase counts pages the allocator holds on to for a while, such as the
    /// tables a growing index left behind.
    pub release_memory: Option<fn()>,
}

impl Default for AnchorOptions {
    fn default() -> Self {
        Self {
            warmup: 0,
            repeat: 1,
            progress: false,
            release_memory: None,
        }
    }
}

/// Runs `plan` `opts.repeat` times, each on a fresh indexer from `make`, and reports.
pub fn run(
    make: &mut dyn FnMut() -> Result<Box<dyn IndexerUnderTest>>,
    plan: &AnchorPlan,
    opts: &AnchorOptions,
) -> Result<AnchorReport> {
    if opts.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let mem = mem_latency();
    if opts.progress {
        eprintln!(
            "{}: N = {}, E = {}, P = {}; memory latency {:.1} / {:.1} / {:.1} / {:.1} ns (1 / 4 / 16 / 128 MB)",
            plan.spec.kind.name(),
            plan.shape.base_sequences,
            plan.shape.extra_sequences,
            plan.shape.prefix_blocks,
            mem.mb_1,
            mem.mb_4,
            mem.mb_16,
            mem.mb_128
        );
    }
    let mut warmup = Vec::with_capacity(opts.warmup);
    let mut runs = Vec::with_capacity(opts.repeat);
    let mut first = None;
    for i in 0..opts.warmup + opts.repeat {
        let mut out = phases::run_once(make, plan, opts.progress, opts.release_memory)?;
        out.report.mem_latency_ns = Some(mem_latency());
        if opts.progress {
            let kind = if i < opts.warmup {
                "warm-up run"
            } else {
                "run"
            };
            eprintln!("{kind} {} on {} done", i + 1, out.indexer);
        }
        first.get_or_insert((out.indexer, out.cores, out.mixed_mode));
        if i < opts.warmup {
            warmup.push(out.report);
        } else {
            runs.push(out.report);
        }
    }
    let Some((indexer, cores, mixed_mode)) = first else {
        bail!("no run completed");
    };
    let problems: Vec<String> = warmup
        .iter()
        .chain(&runs)
        .enumerate()
        .flat_map(|(i, r)| {
            r.checks
                .problems()
                .into_iter()
                .map(move |p| format!("run {}: {p}", i + 1))
        })
        .collect();
    let (mut figures, range) = summarize(&runs);
    if let Some(cold) = warmup.first().or(runs.first()) {
        figures.take_memory_from(&cold.figures);
    }
    Ok(AnchorReport {
        workload: plan.spec.kind,
        indexer,
        cores,
        mixed_mode,
        warmup_runs: opts.warmup,
        memory_released: opts.release_memory.is_some(),
        repeat: opts.repeat,
        figures,
        range,
        checks_passed: problems.is_empty(),
        problems,
        params: AnchorParams {
            spec: plan.spec.clone(),
            shape: plan.shape.clone(),
        },
        mem_latency_ns: mem,
        warmup,
        runs,
        machine: Machine::detect(),
        date: utc_now(),
        version: VERSION,
    })
}
