//! `kvengine bench indexer`: the indexer benchmark (workloads, phases and report live in
//! the `kvengine-benches` crate; this is wiring).

use anyhow::Result;
use clap::{Args, Subcommand};
use kvengine_benches::args::{Baseline, IndexerArgs};
use kvengine_benches::harness::run;
use kvengine_benches::workload::Plan;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Indexer throughput and latency on Dynamo-comparable workloads or a Mooncake trace;
    /// prints a JSON report (and writes it with --json).
    Indexer(IndexerBench),
}

/// `kvengine bench indexer` flags.
#[derive(Debug, Args)]
pub struct IndexerBench {
    #[command(flatten)]
    args: IndexerArgs,
    /// What to measure: the threaded runtime (default), or a single-threaded baseline.
    #[arg(long, value_enum, default_value_t = Baseline::Runtime, env = "KVENGINE_BENCH_INDEXER")]
    indexer: Baseline,
}

pub fn run_bench(cmd: &BenchCommand) -> Result<()> {
    let BenchCommand::Indexer(b) = cmd;
    let opts = b.args.run_options()?;
    let plan = Plan::generate(&b.args.spec())?;
    let mut ix = b.indexer.build(&b.args)?;
    let report = run(ix.as_mut(), &plan, &opts)?;
    drop(ix);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &b.args.json {
        kvengine_benches::write_json(&report, path)?;
    }
    let problems = report.checks.problems();
    if !problems.is_empty() {
        anyhow::bail!("self-checks failed: {}", problems.join("; "));
    }
    Ok(())
}
