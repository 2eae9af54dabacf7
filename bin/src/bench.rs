//! `kvengine bench indexer`, `kvengine bench ingest`, `kvengine bench replay` and
//! `kvengine bench snapshot`: the indexer benchmark, the end-to-end ingest benchmarks over
//! ZMQ and QUIC, routing quality on simulated workers, and warm restarts (workloads,
//! phases and reports live in the `kvengine-lab` crate; this is wiring).

use crate::workload_args::{load_workload, non_negative, positive};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use lab::anchor;
use lab::args::{Baseline, IndexerArgs};
use lab::harness::run;
use lab::replay::disagg::{self, DisaggSpec};
use lab::replay::{self, ReplayConfig, RunMode, plot, report};
use lab::workload::Plan;
use lab::workload::anchor::AnchorPlan;
use sim::engine::EngineConfig;
use std::path::PathBuf;
use transport::openai::disagg::Protocol;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Indexer throughput and latency on Dynamo-comparable workloads, Dynamo's anchor
    /// workloads exactly (--workload dynamo-w1 .. dynamo-w4, with --repeat), or a Mooncake
    /// trace; prints a JSON report (and writes it with --json).
    Indexer(IndexerBench),
    /// KV events end to end over loopback (a Rust publisher -> ZMQ or QUIC -> decode ->
    /// engine); prints a JSON report (and writes it with --json).
    Ingest(IngestBench),
    /// Routing quality: replay a Mooncake trace (or the built-in chat workload) open loop
    /// through the router onto simulated vLLM workers, per routing mode (with --disagg P:D,
    /// on prefill and decode workers against aggregated kv; with --replicas N, through N
    /// router replicas sharing their load over NATS); prints a table and writes the figures
    /// as JSON (--json) and an SVG (--plot).
    Replay(ReplayBench),
    /// Warm restart: build an index of --entries (block, worker) entries, then per repeat
    /// time the snapshot cut, encode, file write, and the restart to serving (read, decode,
    /// rebuild, first query); checks the restored engine; prints a JSON report (and writes
    /// it with --json).
    Snapshot(SnapshotBench),
    /// Soak and chaos: the router as a child process under front-door traffic while
    /// faults are injected (worker restarts, dropped batches, bursts, HTTP failures,
    /// router SIGKILL + restart); the index is checked against the workers' caches at
    /// checkpoints. Prints the headline figures; writes the report (--json) and an SVG of
    /// RSS and route p99 over time (--plot).
    Soak(lab::soak::args::SoakArgs),
    /// kvengine side by side with the real peer routers (SMG, sglang-router, vllm-router,
    /// from PyPI at pinned versions; --install-peers installs them): each in front of
    /// fresh simulated vLLM workers, the same workload replayed open loop through its
    /// OpenAI endpoint, interleaved runs; prints TTFT, end-to-end latency, the workers'
    /// hit rate, errors, router CPU and proxy overhead, median [min-max].
    Peers(crate::bench_peers::PeersBench),
    /// The machine's memory latency now (dependent random loads over 1, 4, 16 and 128 MB,
    /// ns per load), as JSON: recorded beside every figure, since it swings from day to day
    /// on a shared machine.
    Memlat,
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
    use lab::{ingest, ingest_quic, ingest_zmq};
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
        lab::write_json(&reports, path)?;
    }
    Ok(())
}

/// `kvengine bench snapshot` flags.
#[derive(Debug, Args)]
pub struct SnapshotBench {
    /// Index entries ((block, worker) pairs) to build.
    #[arg(long, default_value_t = 10_000_000, env = "KVENGINE_BENCH_ENTRIES",
          value_parser = clap::value_parser!(u64).range(1..))]
    entries: u64,
    /// Engine cores.
    #[arg(long, default_value_t = 2, env = "KVENGINE_BENCH_CORES",
          value_parser = clap::value_parser!(u16).range(1..))]
    cores: u16,
    /// Workers (one dp rank each).
    #[arg(long, default_value_t = 64, env = "KVENGINE_BENCH_WORKERS",
          value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Timed repeats (min / median / max over them).
    #[arg(long, default_value_t = 5, env = "KVENGINE_BENCH_REPEAT",
          value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Directory for the snapshot file (deleted afterwards) [default: a temporary one].
    #[arg(long, env = "KVENGINE_BENCH_DIR")]
    dir: Option<PathBuf>,
    /// Also write the report here.
    #[arg(long, env = "KVENGINE_BENCH_JSON")]
    json: Option<PathBuf>,
}

fn run_snapshot(b: &SnapshotBench) -> Result<()> {
    use lab::snapshot::{self, SnapshotConfig};
    let report = snapshot::run(&SnapshotConfig {
        entries: b.entries,
        cores: usize::from(b.cores),
        workers: b.workers as usize,
        repeat: b.repeat as usize,
        dir: b.dir.clone(),
        release_memory: Some(crate::memory::release_allocator_memory),
        progress: true,
        ..SnapshotConfig::default()
    })?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &b.json {
        lab::write_json(&report, path)?;
    }
    if !report.problems().is_empty() {
        anyhow::bail!("self-checks failed: {}", report.problems().join("; "));
    }
    Ok(())
}

/// `kvengine bench indexer` flags.
#[derive(Debug, Args)]
pub struct IndexerBench {
    #[command(flatten)]
    args: IndexerArgs,
    /// What to measure: the threaded runtime (default), the runtime with its cores hosted on
    /// the benchmark's threads (hosted-runtime), or a single-threaded baseline.
    #[arg(long, value_enum, default_value_t = Baseline::Runtime, env = "KVENGINE_BENCH_INDEXER")]
    indexer: Baseline,
}

pub fn run_bench(cmd: &BenchCommand) -> Result<()> {
    let b = match cmd {
        BenchCommand::Indexer(b) => b,
        BenchCommand::Ingest(b) => return run_ingest(b),
        BenchCommand::Replay(b) => return run_replay(b),
        BenchCommand::Snapshot(b) => return run_snapshot(b),
        BenchCommand::Soak(b) => {
            let exe = std::env::current_exe().context("locating the kvengine binary")?;
            return lab::soak::args::cli(b, exe);
        }
        BenchCommand::Peers(b) => return crate::bench_peers::run(b),
        BenchCommand::Memlat => {
            let m = lab::calibrate::mem_latency();
            println!("{}", serde_json::to_string(&m)?);
            return Ok(());
        }
    };
    if let Some(dir) = &b.args.export {
        return export_anchors(&b.args, dir);
    }
    if let Some(dir) = &b.args.import {
        b.args.check_import()?;
        let plan = lab::workload::export::import(dir)?;
        return run_anchor(b, plan);
    }
    if let Some(spec) = b.args.anchor_spec()? {
        return run_anchor(b, AnchorPlan::generate(&spec)?);
    }
    let opts = b.args.run_options()?;
    let plan = Plan::generate(&b.args.spec())?;
    let mut ix = b.indexer.build(&b.args)?;
    let report = run(ix.as_mut(), &plan, &opts)?;
    drop(ix);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &b.args.json {
        lab::write_json(&report, path)?;
    }
    let problems = report.checks.problems();
    if !problems.is_empty() {
        anyhow::bail!("self-checks failed: {}", problems.join("; "));
    }
    Ok(())
}

/// `kvengine bench indexer --export DIR`: each anchor workload into `DIR/<name>`.
fn export_anchors(args: &lab::args::IndexerArgs, dir: &std::path::Path) -> Result<()> {
    let plans: Vec<Result<AnchorPlan>> = if args.workload == lab::workload::WorkloadKind::Trace {
        vec![lab::workload::trace_anchor::anchor_plan(&args.spec())]
    } else {
        args.export_specs()?
            .iter()
            .map(AnchorPlan::generate)
            .collect()
    };
    for plan in plans {
        let plan = plan?;
        let spec = &plan.spec;
        let to = dir.join(spec.kind.name());
        let bytes = lab::workload::export::export(&plan, &to)?;
        println!(
            "{}: {} + {} + {} events, {} + {} queries, {} answers, {:.1} MB in {}",
            spec.kind.name(),
            plan.base.events,
            plan.extra.events,
            plan.remove.events,
            plan.hit_queries.len(),
            plan.prefix_queries.len(),
            plan.answers.len(),
            bytes as f64 / 1e6,
            to.display()
        );
    }
    Ok(())
}

/// `kvengine bench indexer --workload dynamo-wN` (or `--import DIR`): the anchor-exact
/// harness.
fn run_anchor(b: &IndexerBench, plan: AnchorPlan) -> Result<()> {
    let (indexer, args) = (b.indexer, &b.args);
    let opts = anchor::AnchorOptions {
        release_memory: Some(crate::memory::release_allocator_memory),
        ..args.anchor_options()
    };
    let report = anchor::run(&mut || indexer.build_anchor(args), &plan, &opts)?;
    drop(plan);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &args.json {
        lab::write_json(&report, path)?;
    }
    if !report.checks_passed {
        anyhow::bail!("self-checks failed: {}", report.problems.join("; "));
    }
    Ok(())
}

/// `kvengine bench replay` flags.
#[derive(Debug, Args)]
pub struct ReplayBench {
    /// Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids` of 512-token blocks); without it, the built-in chat workload.
    #[arg(long, env = "KVENGINE_BENCH_TRACE")]
    trace: Option<PathBuf>,
    /// Simulated workers [default: 4; with --disagg P:D, P + D].
    #[arg(long, env = "KVENGINE_BENCH_WORKERS",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    workers: Option<u32>,
    /// Routing mode(s), comma separated: kv, round-robin, random, kv-no-events, sglang,
    /// llm-d, power-of-two, or all
    /// [default: all; with --disagg: kv,round-robin].
    #[arg(long, env = "KVENGINE_BENCH_MODE", value_parser = parse_modes)]
    mode: Option<ModeList>,
    /// Disaggregated serving: run each mode on P prefill and D decode simulated workers
    /// (e.g. 2:2; the mode chooses in both pools), plus one aggregated kv run on P + D
    /// workers for comparison; reports label the runs `disagg-<mode>` and kv.
    #[arg(long, value_name = "P:D", env = "KVENGINE_BENCH_DISAGG",
          value_parser = disagg::parse_split)]
    disagg: Option<(usize, usize)>,
    /// Router replicas: run N routers (each its own engine, hub and front door) in front of
    /// the same workers, sharing their load over a NATS server started for each mode (needs
    /// `nats-server`: on PATH or in KVENGINE_NATS_SERVER); requests go round robin over
    /// them. The figures keep their meaning, for comparison with --replicas 1; a second
    /// table (and the JSON's replicas, sync_* and nats_cpu_us_per_request) gives what the
    /// sync cost per routed request.
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_REPLICAS",
          value_parser = clap::value_parser!(u16).range(1..=replay::MAX_REPLICAS as i64))]
    replicas: u16,
    /// With --replicas N: the replicas do not share their load (N independent routers, no
    /// NATS), the control that shows what sharing buys.
    #[arg(long, env = "KVENGINE_BENCH_UNSHARED_REPLICAS")]
    unshared_replicas: bool,
    /// The hand-off protocol of --disagg runs: vllm, sglang or trtllm.
    #[arg(long, default_value = "vllm", env = "KVENGINE_BENCH_DISAGG_PROTOCOL",
          value_parser = parse_protocol, requires = "disagg")]
    disagg_protocol: Protocol,
    /// With --disagg, a prefill goes to a prefill worker only when at least this many of
    /// the prompt's tokens are not cached on the decode worker (the router's
    /// --disagg-min-prefill-tokens).
    #[arg(
        long,
        default_value_t = 512,
        env = "KVENGINE_BENCH_DISAGG_MIN_PREFILL_TOKENS",
        requires = "disagg"
    )]
    disagg_min_prefill_tokens: u64,
    /// The simulated workers run this many times faster than real time (arrivals are
    /// compressed by as much; figures are in simulated time).
    #[arg(long, default_value_t = 10.0, env = "KVENGINE_BENCH_SPEEDUP", value_parser = positive)]
    speedup: f64,
    /// Replay only the first K requests (the chat workload generates K; default 400).
    #[arg(long, env = "KVENGINE_BENCH_MAX_REQUESTS",
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    max_requests: Option<u64>,
    /// Multiply the workload's request rate by this (above 1: more load).
    #[arg(long, default_value_t = 1.0, env = "KVENGINE_BENCH_RATE_SCALE", value_parser = positive)]
    rate_scale: f64,
    /// KV cache blocks per worker (the default is an 8B model on one H100: 28,000 blocks
    /// of 16 tokens, or as many tokens in blocks of --block-size); smaller caches evict
    /// more.
    #[arg(long, env = "KVENGINE_BENCH_KV_BLOCKS",
          value_parser = clap::value_parser!(u32).range(1..u32::MAX as i64))]
    kv_blocks: Option<u32>,
    /// Tokens per KV block (workers' and router's; default 16, 32 with --engine trtllm).
    #[arg(long, env = "KVENGINE_BENCH_BLOCK_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    block_size: Option<u32>,
    /// The engine the simulated workers imitate: vllm (KV events over ZMQ) or trtllm
    /// (TensorRT-LLM: the router polls each worker's POST /kv_cache_events).
    #[arg(long, default_value = "vllm", env = "KVENGINE_BENCH_ENGINE",
          value_parser = replay::parse_engine)]
    engine: lab::workers::EventFormat,
    /// The router's engine cores (1 or 2).
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_CORES",
          value_parser = clap::value_parser!(u8).range(1..=2))]
    cores: u8,
    /// Seed of the chat workload and of the router's scheduler.
    #[arg(long, default_value_t = 0, env = "KVENGINE_BENCH_SEED")]
    seed: u64,
    /// The router's weight of prefill blocks against decode blocks in kv modes (the
    /// router's --kv-overlap-score-weight).
    #[arg(long, default_value_t = 1.0, env = "KVENGINE_BENCH_OVERLAP_WEIGHT",
          value_parser = non_negative)]
    overlap_weight: f64,
    /// What kv modes minimise: `dynamo` (Dynamo's formula with --overlap-weight, the
    /// router's default) or `ttft` (predicted time to first token); the router's
    /// --router-cost.
    #[arg(long, default_value = "dynamo", env = "KVENGINE_BENCH_ROUTER_COST",
          value_parser = parse_router_cost)]
    router_cost: engine::sched::RouterCost,
    /// With --router-cost ttft: the weight of the prefill stall a request causes each of
    /// a worker's running requests (the router's --router-stall-weight).
    #[arg(long, default_value_t = engine::sched::config::DEFAULT_STALL_WEIGHT,
          env = "KVENGINE_BENCH_ROUTER_STALL_WEIGHT", value_parser = non_negative)]
    router_stall_weight: f64,
    /// Write the figures here as JSON (an object for one mode, an array for several).
    #[arg(long, env = "KVENGINE_BENCH_JSON")]
    json: Option<PathBuf>,
    /// Write an SVG comparing the modes here.
    #[arg(long, env = "KVENGINE_BENCH_PLOT")]
    plot: Option<PathBuf>,
}

/// Parsed `--mode`.
#[derive(Clone, Debug)]
pub struct ModeList(Vec<RunMode>);

fn parse_modes(s: &str) -> Result<ModeList, String> {
    RunMode::parse_list(s).map(ModeList)
}

fn parse_router_cost(s: &str) -> Result<engine::sched::RouterCost, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

fn parse_protocol(s: &str) -> Result<Protocol, String> {
    s.parse()
}

fn run_replay(b: &ReplayBench) -> Result<()> {
    let spec = b
        .disagg
        .map(|split| DisaggSpec::new(split, b.disagg_protocol, b.disagg_min_prefill_tokens))
        .transpose()
        .map_err(anyhow::Error::msg)
        .context("--disagg")?;
    let workers = match (&spec, b.workers) {
        (None, w) => w.unwrap_or(4) as usize,
        (Some(d), None) => d.workers(),
        (Some(d), Some(w)) if w as usize == d.workers() => d.workers(),
        (Some(d), Some(w)) => anyhow::bail!(
            "--workers {w} conflicts with --disagg {d}: the comparison runs P + D = {} workers",
            d.workers()
        ),
    };
    let modes = match (&b.mode, &spec) {
        (Some(m), _) => m.0.clone(),
        (None, Some(_)) => disagg::DEFAULT_MODES.to_vec(),
        (None, None) => RunMode::ALL.to_vec(),
    };
    // Reject a mode --disagg cannot run before loading the workload.
    disagg::plan(&modes, spec.as_ref())
        .map_err(anyhow::Error::msg)
        .context("--mode")?;
    // Fail before loading the workload: replicas cannot run without a NATS server.
    if b.replicas > 1 && !b.unshared_replicas && lab::nats::find_binary().is_none() {
        anyhow::bail!(
            "--replicas {}: no nats-server found: {}",
            b.replicas,
            lab::nats::INSTALL_HINT
        );
    }
    let max = b
        .max_requests
        .map(usize::try_from)
        .transpose()
        .context("--max-requests is too large")?;
    let block_size = b
        .block_size
        .unwrap_or_else(|| replay::default_block_size(b.engine));
    let kv_blocks = b
        .kv_blocks
        .unwrap_or_else(|| replay::default_kv_blocks(28_000, block_size));
    let workload = load_workload(b.trace.as_deref(), max, b.rate_scale, b.seed, block_size)?;
    let cfg = ReplayConfig {
        workers,
        speedup: b.speedup,
        engine: EngineConfig {
            kv_blocks,
            block_size,
            ..EngineConfig::default()
        },
        cores: usize::from(b.cores),
        seed: b.seed,
        overlap_weight: b.overlap_weight,
        router_cost: b.router_cost,
        stall_weight: b.router_stall_weight,
        rate_scale: b.rate_scale,
        progress: true,
        disagg: spec,
        replicas: usize::from(b.replicas),
        share_load: !b.unshared_replicas,
        events: b.engine,
        ..ReplayConfig::default()
    };
    eprintln!("{}", replay::describe(&workload, &cfg));
    let reports = replay::run(&workload, &modes, &cfg)?;
    if cfg.disagg.is_some() {
        print!("{}", report::disagg_table(&reports));
    } else {
        print!("{}", report::table(&reports));
        print!("{}", report::legend(&reports));
    }
    print!("{}", report::sync_table(&reports));
    print!("{}", report::index_summary(&reports));
    if let Some(path) = &b.json {
        match reports.as_slice() {
            [one] => lab::write_json(one, path)?,
            many => lab::write_json(&many, path)?,
        }
    }
    if let Some(path) = &b.plot {
        plot::write_svg(&reports, &workload.name, path)?;
    }
    Ok(())
}
