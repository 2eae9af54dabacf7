//! `kvengine-anchors`: kvengine's hosted runtime and Dynamo's / SMG's released indexers
//! through the same anchor harness (`lab::anchor`, what `kvengine bench indexer --workload
//! dynamo-wN` runs), in one process, runs interleaved, printed side by side.
//!
//! ```sh
//! cargo run --release --manifest-path anchors/Cargo.toml -- --workload dynamo-w1 \
//!     --against dynamo-crtc,smg --runs 5
//! ```
//!
//! Each round runs every indexer once (warm-up rounds first, reported apart), on a fresh
//! indexer, the starting indexer rotating from round to round; each indexer's runs are then
//! summarized as `kvengine bench indexer` summarizes `--repeat` runs (median, min / median /
//! max; resident memory from the first run in the process). kvengine is the hosted runtime
//! on `--cores` cores (`--indexer hosted-runtime`, the product's layout). The process uses
//! mimalloc with transparent huge pages off, as the `kvengine` binary does, and releases
//! the allocator's free memory before each resident-memory reading.

use anchors::{ANCHORS, Prepared, build, dynamo::DEFAULT_EVENT_THREADS};
use anyhow::{Result, bail};
use clap::Parser;
use lab::anchor::report::{AnchorReport, Figures, summarize};
use lab::anchor::{self, AnchorOptions};
use lab::args::{Baseline, IndexerArgs};
use lab::driver::IndexerUnderTest;
use lab::workload::WorkloadKind;
use lab::workload::anchor::AnchorPlan;
use serde::Serialize;
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvengine's indexer and the anchors, side by side on an anchor workload.
#[derive(Parser, Debug)]
#[command(name = "kvengine-anchors", version)]
struct Cli {
    /// The anchor workload: dynamo-w1 .. dynamo-w4.
    #[arg(long, value_enum, default_value_t = WorkloadKind::DynamoW1)]
    workload: WorkloadKind,
    /// Anchors to run beside kvengine, comma-separated: dynamo-crtc, dynamo-positional,
    /// dynamo-radix-tree, dynamo-branch-sharded, smg.
    #[arg(long, value_delimiter = ',', default_value = "dynamo-crtc,smg")]
    against: Vec<String>,
    /// Timed runs per indexer.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Untimed warm-up rounds first (every indexer once per round).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// kvengine's cores (hosted runtime).
    #[arg(long, default_value_t = 2)]
    cores: usize,
    /// Event threads of Dynamo's thread pool.
    #[arg(long, default_value_t = DEFAULT_EVENT_THREADS)]
    event_threads: usize,
    /// Overrides S, the (worker, block) pairs (smaller runs for tests).
    #[arg(long)]
    anchor_size: Option<usize>,
    /// Overrides the queries per query phase.
    #[arg(long)]
    anchor_queries: Option<usize>,
    /// Time every indexer on this workload directory in the neutral file format
    /// (`kvengine bench indexer --export`) instead of generating --workload.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["anchor_size", "anchor_queries"])]
    import: Option<PathBuf>,
    /// Writes every indexer's full report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No per-phase progress on stderr.
    #[arg(long)]
    quiet: bool,
}

/// `kvengine bench indexer`'s flags, parsed from nothing and then set (only their
/// defaults are wanted; the fields are the lab crate's).
#[derive(Parser, Debug)]
struct Defaults {
    #[command(flatten)]
    args: IndexerArgs,
}

/// The JSON file: every indexer's report, kvengine's first.
#[derive(Serialize)]
struct Output<'a> {
    workload: &'static str,
    runs: usize,
    warmup: usize,
    /// `kvengine / anchor` of each figure's median, per anchor.
    ratios: Vec<(String, Vec<(&'static str, f64)>)>,
    reports: &'a [AnchorReport],
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    disable_huge_pages();
    let mut against = Vec::new();
    for a in cli
        .against
        .iter()
        .map(|a| a.trim())
        .filter(|a| !a.is_empty())
    {
        if !ANCHORS.contains(&a) {
            bail!("unknown anchor {a:?}; known: {}", ANCHORS.join(", "));
        }
        if !against.contains(&a) {
            against.push(a);
        }
    }
    if cli.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mut args = Defaults::try_parse_from(["kvengine-anchors"])?.args;
    args.workload = cli.workload;
    args.cores = cli.cores;
    args.anchor_size = cli.anchor_size;
    args.anchor_queries = cli.anchor_queries;
    args.quiet = cli.quiet;
    let plan = match &cli.import {
        Some(dir) => lab::workload::export::import(dir)?,
        None => {
            let Some(spec) = args.anchor_spec()? else {
                bail!(
                    "{} is not an anchor workload (dynamo-w1 .. dynamo-w4)",
                    cli.workload.name()
                );
            };
            AnchorPlan::generate(&spec)?
        }
    };
    let workload = plan.spec.kind.name();

    // Index 0 is kvengine, then the anchors in --against order.
    let names: Vec<&str> = std::iter::once("kvengine").chain(against).collect();
    let prepared = Prepared::new(&plan, names.iter().copied());
    let make = |i: usize| -> Result<Box<dyn IndexerUnderTest>> {
        match names.get(i).copied() {
            Some("kvengine") => Baseline::HostedRuntime.build_anchor(&args),
            Some(name) => build(name, cli.event_threads, &prepared),
            None => bail!("no indexer {i}"),
        }
    };
    let opts = AnchorOptions {
        warmup: 0,
        repeat: 1,
        progress: !cli.quiet,
        release_memory: Some(release_allocator_memory),
    };
    let mut reports: Vec<Option<AnchorReport>> = names.iter().map(|_| None).collect();
    let rounds = cli.warmup + cli.runs;
    for round in 0..rounds {
        for j in 0..names.len() {
            let i = (round + j) % names.len();
            if !cli.quiet {
                eprintln!(
                    "round {}/{rounds}{}: {}",
                    round + 1,
                    if round < cli.warmup { " (warm-up)" } else { "" },
                    names.get(i).copied().unwrap_or("?")
                );
            }
            let one = anchor::run(&mut || make(i), &plan, &opts)?;
            if let Some(slot) = reports.get_mut(i) {
                merge(slot, one, round < cli.warmup);
            }
        }
    }
    drop(prepared);
    drop(plan);
    let reports: Vec<AnchorReport> = reports.into_iter().flatten().map(finish).collect();

    let ratios = print_table(&names, &reports);
    if let Some(path) = &cli.json {
        let out = Output {
            workload,
            runs: cli.runs,
            warmup: cli.warmup,
            ratios,
            reports: &reports,
        };
        lab::write_json(&out, path)?;
    }
    let problems: Vec<String> = reports
        .iter()
        .flat_map(|r| {
            r.problems
                .iter()
                .map(move |p| format!("{}: {p}", r.indexer))
        })
        .collect();
    if !problems.is_empty() {
        bail!("self-checks failed: {}", problems.join("; "));
    }
    Ok(())
}

/// Adds one single-run report to an indexer's accumulated one (as a warm-up run or a
/// timed run).
fn merge(slot: &mut Option<AnchorReport>, mut one: AnchorReport, warmup: bool) {
    let runs = std::mem::take(&mut one.runs);
    let into = slot.get_or_insert_with(|| AnchorReport {
        runs: Vec::new(),
        warmup: Vec::new(),
        problems: Vec::new(),
        ..one.clone()
    });
    let offset = into.warmup.len() + into.runs.len();
    into.problems.extend(
        one.problems
            .iter()
            .map(|p| format!("round {}: {p}", offset + 1)),
    );
    if warmup {
        into.warmup.extend(runs);
    } else {
        into.runs.extend(runs);
    }
}

/// Medians, ranges and counts over the accumulated runs, as `lab::anchor::run` computes
/// them over its own.
fn finish(mut r: AnchorReport) -> AnchorReport {
    let (mut figures, range) = summarize(&r.runs);
    if let Some(cold) = r.warmup.first().or(r.runs.first()) {
        figures.take_memory_from(&cold.figures);
    }
    r.figures = figures;
    r.range = range;
    r.repeat = r.runs.len();
    r.warmup_runs = r.warmup.len();
    r.checks_passed = r.problems.is_empty();
    r
}

/// The rows of the table: (figure key, label, unit divisor, unit suffix).
const ROWS: &[(&str, &str, f64, &str)] = &[
    ("store_blocks_per_s", "store blocks/s", 1e6, "M"),
    ("remove_blocks_per_s", "remove blocks/s", 1e6, "M"),
    ("hit_p99_us", "quiet hit p99 us", 1.0, ""),
    ("hit_qps_1", "hit q/s, 1 caller", 1e3, "k"),
    ("hit_qps_2", "hit q/s, 2 callers", 1e3, "k"),
    ("mixed_query_p99_us", "hit p99 us, ingest running", 1.0, ""),
    ("bytes_per_block", "bytes/block (RSS)", 1.0, ""),
];

fn figure(f: &Figures, key: &str) -> f64 {
    Figures::KEYS
        .iter()
        .position(|k| *k == key)
        .and_then(|i| f.values().get(i).copied())
        .unwrap_or(0.0)
}

fn range_of(r: &AnchorReport, key: &str) -> [f64; 3] {
    r.range
        .0
        .iter()
        .find(|(k, _)| *k == key)
        .map_or([0.0; 3], |(_, v)| *v)
}

fn cell(r: &AnchorReport, key: &str, div: f64, unit: &str) -> String {
    let [lo, med, hi] = range_of(r, key).map(|v| v / div);
    let digits = if med >= 100.0 { 0 } else { 1 };
    let med = if key == "bytes_per_block" {
        figure(&r.figures, key) / div
    } else {
        med
    };
    if r.runs.len() > 1 && key != "bytes_per_block" {
        format!("{med:.digits$}{unit} ({lo:.digits$}-{hi:.digits$})")
    } else {
        format!("{med:.digits$}{unit}")
    }
}

/// Prints medians side by side (min-max in brackets) with `kvengine / anchor`, and
/// returns the ratios.
fn print_table(
    names: &[&str],
    reports: &[AnchorReport],
) -> Vec<(String, Vec<(&'static str, f64)>)> {
    let Some(kv) = reports.first() else {
        return Vec::new();
    };
    let mut header = format!("{:<28}", "");
    for (n, r) in names.iter().zip(reports) {
        let label = if *n == "kvengine" {
            format!("kvengine {}", short(&r.indexer))
        } else {
            (*n).to_owned()
        };
        header.push_str(&format!(" | {label:<26}"));
    }
    for n in names.iter().skip(1) {
        header.push_str(&format!(" | kvengine/{n:<11}"));
    }
    println!(
        "{} ({} timed runs each, interleaved; median (min-max))",
        kv.workload.name(),
        kv.runs.len()
    );
    println!("{header}");
    let mut ratios: Vec<(String, Vec<(&'static str, f64)>)> = names
        .iter()
        .skip(1)
        .map(|n| ((*n).to_owned(), Vec::new()))
        .collect();
    for &(key, label, div, unit) in ROWS {
        let mut line = format!("{label:<28}");
        for r in reports {
            line.push_str(&format!(" | {:<26}", cell(r, key, div, unit)));
        }
        let ours = figure(&kv.figures, key);
        for (r, (_, out)) in reports.iter().skip(1).zip(ratios.iter_mut()) {
            let theirs = figure(&r.figures, key);
            let ratio = if theirs > 0.0 { ours / theirs } else { 0.0 };
            out.push((key, ratio));
            line.push_str(&format!(" | {:<20}", format!("{ratio:.2}x")));
        }
        println!("{line}");
    }
    let checks: Vec<String> = reports
        .iter()
        .map(|r| {
            format!(
                "{}: {}",
                short(&r.indexer),
                if r.checks_passed { "pass" } else { "FAIL" }
            )
        })
        .collect();
    println!("checks: {}", checks.join(", "));
    println!("(rates: higher is better; latency and bytes: lower is better)");
    ratios
}

fn short(name: &str) -> &str {
    name.split('(').next().unwrap_or(name)
}

/// Returns the allocator's free pages to the OS before a resident-memory reading.
fn release_allocator_memory() {
    // SAFETY: `mi_collect` only walks mimalloc's own heaps; it may be called at any time
    // from any thread and touches no memory the program owns.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// Transparent huge pages off for this process, as the `kvengine` binary does by default
/// (resident memory per block would otherwise count whole 2 MiB pages).
fn disable_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integer arguments and changes only this
    // process's huge-page policy.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}
