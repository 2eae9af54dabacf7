//! End-to-end native (QUIC + rkyv) ingest benchmark; prints the JSON report.
//!
//! ```text
//! cargo run --release -p kvengine-benches --example ingest_quic -- --workers 4 --batches 2000
//! ```

use anyhow::Result;
use clap::Parser;
use kvengine_benches::ingest_quic::{QuicBenchConfig, run};
use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// Native QUIC ingest benchmark.
#[derive(Parser, Debug)]
#[command(name = "ingest_quic", about)]
struct Cli {
    /// Engine cores.
    #[arg(long, default_value_t = 2)]
    cores: usize,
    /// Pin the engine's core threads.
    #[arg(long)]
    pin: bool,
    /// Blocks shallower than this are replicated in every shard.
    #[arg(long, default_value_t = 32)]
    replicate_depth: u32,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    tokio_threads: usize,
    /// Publisher connections.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Batches per publisher.
    #[arg(long, default_value_t = 2000)]
    batches: usize,
    /// Sequences stored (and removed) per batch.
    #[arg(long, default_value_t = 16)]
    stores_per_batch: usize,
    /// Blocks per sequence.
    #[arg(long, default_value_t = 64)]
    blocks_per_event: usize,
    /// Repeat the run this many times (one report each).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let cfg = QuicBenchConfig {
        cores: cli.cores,
        pin_cores: cli.pin,
        replicate_depth: cli.replicate_depth,
        tokio_threads: cli.tokio_threads,
        workers: cli.workers,
        batches: cli.batches,
        stores_per_batch: cli.stores_per_batch,
        blocks_per_event: cli.blocks_per_event,
        ..QuicBenchConfig::default()
    };
    for _ in 0..cli.repeat {
        let report = run(&cfg)?;
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
