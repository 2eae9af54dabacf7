//! `kvengine bench indexer` before the CLI wires it: runs one workload on one of the
//! single-threaded indexers and prints (and optionally writes) the JSON report.
//!
//! ```text
//! cargo run --release -p kvengine-lab --example indexer -- --workload dynamo --json /tmp/x.json
//! cargo run --release -p kvengine-lab --example indexer -- --workload shared-prefix --indexer sharded --cores 2
//! cargo run --release -p kvengine-lab --example indexer -- --workload dynamo-w1 --repeat 3
//! ```
//!
//! Exits with status 1 when the run's self-checks fail (the report is still written).

use anyhow::Result;
use clap::Parser;
use lab::anchor;
use lab::args::{Baseline, IndexerArgs};
use lab::harness::run;
use lab::workload::Plan;
use lab::workload::anchor::AnchorPlan;
use mimalloc::MiMalloc;
use std::time::Instant;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// Indexer benchmark on the single-threaded indexers.
#[derive(Parser, Debug)]
#[command(name = "indexer", about)]
struct Cli {
    #[command(flatten)]
    args: IndexerArgs,
    /// Which indexer to drive.
    #[arg(long, value_enum, default_value_t = Baseline::KvIndex, env = "KVENGINE_BENCH_INDEXER")]
    indexer: Baseline,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let args = &cli.args;
    if let Some(spec) = args.anchor_spec()? {
        let plan = AnchorPlan::generate(&spec)?;
        let indexer = cli.indexer;
        let report = anchor::run(
            &mut || indexer.build_anchor(args),
            &plan,
            &args.anchor_options(),
        )?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        if let Some(path) = &args.json {
            lab::write_json(&report, path)?;
        }
        for p in &report.problems {
            eprintln!("check failed: {p}");
        }
        if !report.checks_passed {
            std::process::exit(1);
        }
        return Ok(());
    }
    let opts = args.run_options()?;
    let mut ix = cli.indexer.build(args)?;
    let t = Instant::now();
    let plan = Plan::generate(&args.spec())?;
    if opts.progress {
        eprintln!("generated in {:.2} s", t.elapsed().as_secs_f64());
    }
    let report = run(ix.as_mut(), &plan, &opts)?;
    drop(plan);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &args.json {
        lab::write_json(&report, path)?;
    }
    let problems = report.checks.problems();
    for p in &problems {
        eprintln!("check failed: {p}");
    }
    if !problems.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
