//! `kvengine [serve]`: start the thread-per-core engine and stay up.
//!
//! Starts one core thread per core (`--cores`, default: the CPUs this process may use),
//! pinned where a CPU exists; each owns a shard and ingests the events of the workers homed
//! on it. Waits for SIGINT or SIGTERM; then closes every handle, lets each core drain what
//! it was sent, joins them and prints their figures. The transports that feed it (ZMQ,
//! QUIC, HTTP) attach here in later issues.

use anyhow::{Context, Result};
use clap::Args;
use engine::runtime::{RuntimeConfig, start};
use engine::sharding::fixed_depth::FixedDepth;
use std::sync::mpsc;

/// Engine settings.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Core threads, each owning a shard (default: the CPUs available to this process).
    #[arg(long, env = "KVENGINE_CORES",
          value_parser = clap::value_parser!(u16).range(1..=32768))]
    pub cores: Option<u16>,
    /// Blocks at depth below this are held by every shard; deeper blocks are sharded by the
    /// block at this depth (raise it above your longest shared system prompt, in blocks).
    #[arg(long, env = "KVENGINE_REPLICATE_DEPTH", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(0..=(1 << 30)))]
    pub replicate_depth: u32,
    /// Messages each client-to-shard ring holds.
    #[arg(long, env = "KVENGINE_RING_CAPACITY", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 24)))]
    pub ring_capacity: u32,
    /// Do not pin shard threads to cores.
    #[arg(long, env = "KVENGINE_NO_PIN")]
    pub no_pin: bool,
}

pub fn run(args: &ServeArgs) -> Result<()> {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = args.cores.map_or(available, usize::from);
    let policy = FixedDepth::new(cores, args.replicate_depth).context("--cores")?;
    let config = RuntimeConfig {
        ring_capacity: args.ring_capacity as usize,
        pin_cores: !args.no_pin,
        ingest_handles: 1,
        query_handles: 1,
    };
    let (tx, rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the SIGINT/SIGTERM handler")?;

    let started = start(policy, config).context("cannot start the shards")?;
    let pinned = started.runtime.pinned();
    let pinned_count = pinned.iter().flatten().count();
    println!(
        "kvengine: {cores} core thread(s) up ({available} CPU(s) available); \
         replicate depth {} blocks",
        args.replicate_depth
    );
    if args.no_pin {
        println!("kvengine: pinning disabled (--no-pin)");
    } else if pinned_count < cores {
        println!(
            "kvengine: pinned {pinned_count} of {cores} core threads; the other {} share CPUs \
             (more core threads than CPUs)",
            cores - pinned_count
        );
    } else {
        println!("kvengine: every core thread pinned to its own CPU");
    }
    println!("kvengine: no transport attached yet (ZMQ, QUIC and HTTP come next); Ctrl-C stops");

    // Until a signal. A closed channel (handler gone) also stops.
    let _ = rx.recv();
    println!("kvengine: stopping: draining the cores");
    drop(started.ingest);
    drop(started.query);
    let summaries = started.runtime.join().context("a shard thread failed")?;
    for s in &summaries {
        println!(
            "kvengine: {} applied {} block ops, answered {} queries, {} entries live",
            s.shard, s.applied, s.queries, s.index.entries
        );
    }
    println!("kvengine: stopped");
    Ok(())
}
