//! `kvengine bench indexer` and `kvengine bench ingest`: the indexer benchmark and the
//! end-to-end ingest benchmarks over ZMQ and QUIC (workloads, phases and reports live in the
//! `kvengine-benches` crate; this is wiring).

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
    /// KV events end to end over loopback (a Rust publisher -> ZMQ or QUIC -> decode ->
    /// engine); prints a JSON report (and writes it with --json).
    Ingest(IngestBench),
}

/// Which transport `kvengine bench ingest` drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IngestTransport {
    /// vLLM-format msgpack batches with token ids over ZMQ PUB/SUB.
    Zmq,
    /// The native protocol: rkyv batches of hashed blocks over QUIC.
    Quic,
}

/// `kvengine bench ingest` flags.
#[derive(Debug, Args)]
pub struct IngestBench {
    /// The transport.
    #[arg(long, value_enum, default_value_t = IngestTransport::Zmq, env = "KVENGINE_BENCH_TRANSPORT")]
    transport: IngestTransport,
    /// Engine cores.
    #[arg(long, default_value_t = 2, env = "KVENGINE_BENCH_CORES")]
    cores: usize,
    /// Pin the engine's core threads.
    #[arg(long, env = "KVENGINE_BENCH_PIN")]
    pin: bool,
    /// Publishers (one worker each).
    #[arg(long, default_value_t = 4, env = "KVENGINE_BENCH_WORKERS")]
    workers: usize,
    /// Batches per publisher.
    #[arg(long, default_value_t = 1000, env = "KVENGINE_BENCH_BATCHES")]
    batches: usize,
    /// Sequences stored (and later removed) per batch.
    #[arg(long, default_value_t = 16, env = "KVENGINE_BENCH_STORES_PER_BATCH")]
    stores_per_batch: usize,
    /// Blocks per stored sequence (default: 16 for zmq, 64 for quic).
    #[arg(long, env = "KVENGINE_BENCH_BLOCKS_PER_EVENT")]
    blocks_per_event: Option<usize>,
    /// Runs (one report each).
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_REPEAT")]
    repeat: usize,
    /// Also write the reports (a JSON array) here.
    #[arg(long, env = "KVENGINE_BENCH_JSON")]
    json: Option<std::path::PathBuf>,
}

fn run_ingest(b: &IngestBench) -> Result<()> {
    use kvengine_benches::{ingest, ingest_quic, ingest_zmq};
    let mut reports = Vec::with_capacity(b.repeat);
    for _ in 0..b.repeat.max(1) {
        let load = ingest::IngestConfig {
            cores: b.cores,
            pin_cores: b.pin,
            workers: b.workers,
            batches: b.batches,
            stores_per_batch: b.stores_per_batch,
            blocks_per_event: b.blocks_per_event.unwrap_or(match b.transport {
                IngestTransport::Zmq => 16,
                IngestTransport::Quic => 64,
            }),
            ..ingest::IngestConfig::default()
        };
        let report = match b.transport {
            IngestTransport::Zmq => ingest_zmq::run(&ingest_zmq::ZmqBenchConfig {
                load,
                ..ingest_zmq::ZmqBenchConfig::default()
            })?,
            IngestTransport::Quic => ingest_quic::run(&load)?,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        reports.push(report);
    }
    if let Some(path) = &b.json {
        kvengine_benches::write_json(&reports, path)?;
    }
    Ok(())
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
    let b = match cmd {
        BenchCommand::Indexer(b) => b,
        BenchCommand::Ingest(b) => return run_ingest(b),
    };
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
