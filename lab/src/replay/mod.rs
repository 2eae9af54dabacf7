//! Routing quality end to end: `kvengine bench replay` and `kvengine demo`.
//!
//! A workload (a Mooncake trace, or the built-in chat generator) is replayed open loop
//! against the real router (engine, hub, HTTP edge and OpenAI proxy) in front of simulated
//! vLLM workers ([`crate::workers`]) that publish real KV events over ZMQ, all in one process.
//! Each routing mode gets a fresh cluster; each request's TTFT, inter-token latencies,
//! end-to-end latency, cached prompt tokens and serving worker are measured by the client,
//! and summarised per mode ([`report::ModeReport`]).
//!
//! * [`trace`]: workloads and their infinite-cache bound.
//! * [`cluster`]: the in-process router(s) plus workers, started and stopped per mode.
//! * [`router`]: one in-process router (engine, hub, subscriptions, HTTP edge and proxy).
//! * [`replicas`]: router replicas (`--replicas N`): N routers in front of the same workers,
//!   sharing their load over a NATS server of their own, and what the sync cost.
//! * [`client`]: the open-loop streaming client (round robin over the replicas).
//! * [`report`]: the per-mode figures (JSON) and the table.
//! * [`plot`]: an SVG comparing modes.
//! * [`disagg`]: disaggregated runs (`--disagg P:D`): prefill and decode workers, compared
//!   with aggregated `kv` on as many workers.
//!
//! # Time
//! The workers run `speedup` times faster than real time, so arrivals are compressed by
//! the same factor and every latency is reported in simulated time (wall time times
//! `speedup`). The router's own work is not simulated: at high speedups its real cost, and
//! the client's, weigh `speedup` times more in the figures.
//!
//! # Replicas
//! With `replicas` N > 1 every mode runs N routers, each with its own engine, hub and
//! front door, all subscribed to the same workers and linked over NATS; request `i` goes
//! to replica `i % N`. The figures a single router has keep their meaning (the router's
//! own ones are summed over the replicas), so a run with replicas compares line for line
//! with one without; the sync's cost is reported beside them ([`report::SyncFigures`]).
//! In `kv-no-events` each replica predicts the caches from its own routes and its peers'
//! (a peer's routed request is a prediction too).
//!
//! # Invariants
//! 1. Every request is accounted for: it completes or is counted in `errors`.
//! 2. Each mode starts from empty caches and an empty index, and everything it started is
//!    stopped before the next mode starts.
//! 3. With `replicas` 1 nothing of the replicas runs: no NATS server, no link, the same
//!    figures as before replicas existed.

pub mod client;
pub mod cluster;
pub mod disagg;
pub mod index_check;
pub mod plot;
pub mod replicas;
pub mod report;
pub mod router;
pub mod trace;

use anyhow::{Context, Result, bail};
use disagg::{DisaggSpec, Run};
use engine::sched::{RouteMode, RouterCost};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use report::{ModeReport, RunInfo};
use sim::engine::EngineConfig;
use sim::workload::chat::ChatConfig;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayRequest {
    /// Arrival, in simulated milliseconds since the workload started (non-decreasing).
    pub arrival_ms: f64,
    /// The prompt's token ids (not empty).
    pub tokens: Arc<[u32]>,
    /// Tokens to generate (`max_tokens`, at least 1).
    pub output_tokens: u32,
}

/// A workload to replay.
#[derive(Clone, Debug)]
pub struct Workload {
    /// What it is, for reports.
    pub name: String,
    /// The requests, by arrival.
    pub requests: Vec<ReplayRequest>,
    /// Its infinite-cache bound at the engines' block size.
    pub bound: trace::Bound,
}

impl Workload {
    /// A workload over `requests`, its bound computed with blocks of `block_size` tokens.
    pub fn new(name: String, requests: Vec<ReplayRequest>, block_size: u32) -> Self {
        let bound = trace::hit_rate_bound(&requests, block_size);
        Self {
            name,
            requests,
            bound,
        }
    }

    /// The longest request's KV footprint, in blocks (prompt plus output).
    pub fn max_blocks(&self, block_size: u32) -> u64 {
        let bs = u64::from(block_size.max(1));
        self.requests
            .iter()
            .map(|r| (r.tokens.len() as u64 + u64::from(r.output_tokens)).div_ceil(bs))
            .max()
            .unwrap_or(0)
    }

    /// Simulated seconds from the first arrival to the last.
    pub fn span_s(&self) -> f64 {
        self.requests.last().map_or(0.0, |r| r.arrival_ms / 1000.0)
    }
}

/// How the router routes in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunMode {
    /// KV-aware routing on the workers' KV events, minimising `--router-cost`.
    Kv,
    /// Round robin.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// KV-aware routing without KV events: the router predicts the caches from its own
    /// decisions (`--no-kv-events`).
    KvNoEvents,
    /// SGLang router's cache-aware policy ([`engine::sched::sglang`]).
    Sglang,
    /// llm-d's weighted prefix-cache and queue scorers ([`engine::sched::llmd`]).
    LlmD,
    /// Power of two choices on predicted TTFT ([`engine::sched::power_of_two`]).
    PowerOfTwo,
}

impl RunMode {
    /// Every mode, in the order `all` runs them.
    pub const ALL: [RunMode; 7] = [
        RunMode::Kv,
        RunMode::RoundRobin,
        RunMode::Random,
        RunMode::KvNoEvents,
        RunMode::Sglang,
        RunMode::LlmD,
        RunMode::PowerOfTwo,
    ];

    /// Its name on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            RunMode::Kv => "kv",
            RunMode::RoundRobin => "round-robin",
            RunMode::Random => "random",
            RunMode::KvNoEvents => "kv-no-events",
            RunMode::Sglang => "sglang",
            RunMode::LlmD => "llm-d",
            RunMode::PowerOfTwo => "power-of-two",
        }
    }

    /// The scheduler's mode.
    pub fn route_mode(self) -> RouteMode {
        match self {
            RunMode::Kv | RunMode::KvNoEvents => RouteMode::Kv,
            RunMode::RoundRobin => RouteMode::RoundRobin,
            RunMode::Random => RouteMode::Random,
            RunMode::Sglang => RouteMode::Sglang,
            RunMode::LlmD => RouteMode::LlmD,
            RunMode::PowerOfTwo => RouteMode::PowerOfTwo,
        }
    }

    /// Whether the router subscribes to the workers' KV events.
    pub fn kv_events(self) -> bool {
        self != RunMode::KvNoEvents
    }

    /// Parses a comma-separated list; `all` stands for every mode.
    pub fn parse_list(s: &str) -> Result<Vec<RunMode>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "all" {
                out.extend(RunMode::ALL);
            } else {
                out.push(part.parse()?);
            }
        }
        if out.is_empty() {
            return Err("no mode given".into());
        }
        Ok(out)
    }
}

impl fmt::Display for RunMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RunMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        RunMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown mode {s:?}: expected kv, round-robin, random, kv-no-events, \
                     sglang, llm-d, power-of-two or all"
                )
            })
    }
}

/// How a replay runs (the same for every mode).
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// Each worker's engine (KV cache size, block size, limits, timing). Its `block_size`
    /// is also the router's.
    pub engine: EngineConfig,
    /// Engine (shard) cores of the router: 1 or 2.
    pub cores: usize,
    /// Tokio worker threads (router, workers and client share them).
    pub tokio_threads: usize,
    /// Seed of the router's scheduler (random mode, tie-breaking).
    pub seed: u64,
    /// The scheduler's weight of prefill blocks against decode blocks (kv modes with
    /// `router_cost` Dynamo).
    pub overlap_weight: f64,
    /// What kv modes minimise.
    pub router_cost: RouterCost,
    /// With the TTFT cost: the weight of the prefill stall on running requests.
    pub stall_weight: f64,
    /// Longest wall time one request may take before it is counted as an error.
    pub request_timeout: Duration,
    /// The rate scale the workload was built with (reported only).
    pub rate_scale: f64,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// Disaggregated runs: each mode on `P` prefill and `D` decode workers, plus one
    /// aggregated `kv` run ([`disagg::plan`]); `workers` must then be `P + D`.
    pub disagg: Option<DisaggSpec>,
    /// Router replicas per run (1..=[`MAX_REPLICAS`]); above 1 they share their load over
    /// a NATS server, which needs a `nats-server` binary ([`crate::nats`]).
    pub replicas: usize,
    /// Whether replicas share their load (false: independent routers, the control that
    /// shows what sharing buys; no NATS).
    pub share_load: bool,
    /// How the simulated workers hand out their KV events: vLLM's ZMQ stream, or
    /// TensorRT-LLM's `/kv_cache_events`, which the router polls.
    pub events: crate::workers::EventFormat,
}

/// The most router replicas a replay starts (each is an engine, a hub and an HTTP edge in
/// this process).
pub const MAX_REPLICAS: usize = 16;

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            workers: 4,
            speedup: 10.0,
            engine: EngineConfig::default(),
            cores: 1,
            tokio_threads: 2,
            seed: 0,
            overlap_weight: 1.0,
            router_cost: RouterCost::default(),
            stall_weight: engine::sched::config::DEFAULT_STALL_WEIGHT,
            request_timeout: Duration::from_secs(300),
            rate_scale: 1.0,
            progress: false,
            disagg: None,
            replicas: 1,
            share_load: true,
            events: crate::workers::EventFormat::Vllm,
        }
    }
}

/// `--engine`: which inference engine the simulated workers imitate, as the format of their
/// KV events: `vllm` (ZMQ) or `trtllm` (TensorRT-LLM's polled `/kv_cache_events`).
pub fn parse_engine(s: &str) -> Result<crate::workers::EventFormat, String> {
    match s {
        "vllm" => Ok(crate::workers::EventFormat::Vllm),
        "trtllm" | "tensorrt-llm" => Ok(crate::workers::EventFormat::trtllm()),
        _ => Err(format!("{s:?}: expected vllm or trtllm")),
    }
}

/// The engine's default tokens per block: vLLM's 16, TensorRT-LLM's 32.
pub fn default_block_size(events: crate::workers::EventFormat) -> u32 {
    if events.is_trtllm() {
        transport::trtllm::DEFAULT_BLOCK_SIZE
    } else {
        engine::hash::DEFAULT_BLOCK_SIZE as u32
    }
}

/// KV blocks per worker when not given: `blocks_of_16` 16-token blocks' worth of tokens at
/// `block_size` (the same GPU memory whatever the page size), at least 1.
pub fn default_kv_blocks(blocks_of_16: u32, block_size: u32) -> u32 {
    let tokens = u64::from(blocks_of_16) * 16;
    u32::try_from(tokens / u64::from(block_size.max(1)))
        .unwrap_or(u32::MAX)
        .max(1)
}

impl ReplayConfig {
    /// Rejects values outside their ranges.
    pub fn validate(&self) -> Result<()> {
        if self.events.is_trtllm() && self.replicas > 1 {
            bail!(
                "TensorRT-LLM workers hand each event out once (POST /kv_cache_events drains \
                 it): several routers polling one worker would each miss the others' events"
            );
        }
        if self.workers == 0 || self.workers > 256 {
            bail!("workers must be within 1..=256, not {}", self.workers);
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            bail!(
                "speedup must be a finite number above 0, not {}",
                self.speedup
            );
        }
        if !(1..=2).contains(&self.cores) {
            bail!("cores must be 1 or 2, not {}", self.cores);
        }
        if !(self.overlap_weight.is_finite() && self.overlap_weight >= 0.0) {
            bail!("the overlap weight must be finite and not negative");
        }
        if self.tokio_threads == 0 {
            bail!("tokio threads must be at least 1");
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            bail!(
                "replicas must be within 1..={MAX_REPLICAS}, not {}",
                self.replicas
            );
        }
        if self.replicas > 1 && self.share_load && crate::nats::find_binary().is_none() {
            bail!(
                "{} router replicas share their load over NATS, and no nats-server was \
                 found: {}",
                self.replicas,
                crate::nats::INSTALL_HINT
            );
        }
        self.engine
            .validate()
            .map_err(|e| anyhow::anyhow!("worker engine: {e}"))?;
        if let Some(d) = &self.disagg {
            d.validate()
                .map_err(|e| anyhow::anyhow!("disaggregation {d}: {e}"))?;
            if d.workers() != self.workers {
                bail!(
                    "disaggregation {d} needs {} workers in all, not {}",
                    d.workers(),
                    self.workers
                );
            }
        }
        Ok(())
    }
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix:>13} [{bar:32}] {pos}/{len} requests {elapsed_precise} {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Replays `workload` once per run, each on a fresh cluster, and returns one report per
/// run: one per mode, or with `cfg.disagg` one per mode disaggregated plus an aggregated
/// `kv` run ([`disagg::plan`]). Builds (and drops) its own tokio runtime: call it from
/// synchronous code.
pub fn run(workload: &Workload, modes: &[RunMode], cfg: &ReplayConfig) -> Result<Vec<ModeReport>> {
    cfg.validate()?;
    if workload.requests.is_empty() {
        bail!("the workload has no request");
    }
    let runs = disagg::plan(modes, cfg.disagg.as_ref()).map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.tokio_threads)
        .thread_name("kvengine-replay")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let per_mode = workload.requests.len() as u64;
    let bar = progress_bar(per_mode * runs.len() as u64, cfg.progress);
    let mut reports = Vec::with_capacity(runs.len());
    // One LRU pass over the trace, the same for every mode.
    let bound = capacity_bound(workload, cfg);
    for &r in &runs {
        bar.set_prefix(r.label());
        let report = runtime
            .block_on(replay_one(workload, r, cfg, &bar, bound))
            .with_context(|| format!("mode {r}"))?;
        reports.push(report);
    }
    bar.finish_and_clear();
    drop(runtime);
    Ok(reports)
}

/// Replays `workload` in `mode` on a fresh aggregated cluster (on the current tokio
/// runtime), ticking `bar` once per finished request.
pub async fn run_mode(
    workload: &Workload,
    mode: RunMode,
    cfg: &ReplayConfig,
    bar: &ProgressBar,
) -> Result<ModeReport> {
    run_one(workload, Run::aggregated(mode), cfg, bar).await
}

/// Replays `workload` as `run` on a fresh cluster (on the current tokio runtime), ticking
/// `bar` once per finished request. A disaggregated run needs `cfg.disagg`.
pub async fn run_one(
    workload: &Workload,
    run: Run,
    cfg: &ReplayConfig,
    bar: &ProgressBar,
) -> Result<ModeReport> {
    replay_one(workload, run, cfg, bar, capacity_bound(workload, cfg)).await
}

/// `workload`'s capacity-aware hit-rate bound on `cfg`'s cluster (`trace::capacity_hit_bound`).
fn capacity_bound(workload: &Workload, cfg: &ReplayConfig) -> f64 {
    trace::capacity_hit_bound(
        &workload.requests,
        cfg.engine.block_size,
        cfg.workers as u64 * u64::from(cfg.engine.kv_blocks),
    )
}

/// [`run_one`] with the workload's capacity bound already computed.
async fn replay_one(
    workload: &Workload,
    run: Run,
    cfg: &ReplayConfig,
    bar: &ProgressBar,
    capacity_hit_bound: f64,
) -> Result<ModeReport> {
    let mode = run.mode;
    let cluster_cfg = match (run.disagg, &cfg.disagg) {
        (false, _) => cluster::ClusterConfig::of(cfg, mode),
        (true, Some(spec)) => cluster::ClusterConfig::disaggregated(cfg, mode, *spec),
        (true, None) => bail!("a disaggregated run needs the replay's P:D split"),
    };
    let mut cluster = cluster::Cluster::start(&cluster_cfg).await?;
    cluster.mark_sync();
    let started = Instant::now();
    let tick = {
        let bar = bar.clone();
        Arc::new(move || bar.inc(1))
    };
    let results = client::replay_over(
        &cluster.urls(),
        &workload.requests,
        &client::ClientConfig {
            speedup: cfg.speedup,
            request_timeout: cfg.request_timeout,
        },
        tick,
    )
    .await;
    let wall = started.elapsed();
    let active_after = cluster.wait_idle(Duration::from_secs(2)).await;
    // One router over aggregated workers with KV events: its index must equal the caches.
    let index_check = if mode.kv_events() && cfg.replicas == 1 && cluster_cfg.disagg.is_none() {
        Some(
            index_check::check(&cluster, &workload.requests)
                .await
                .unwrap_or_else(|e| index_check::IndexCheck {
                    mismatches: 1,
                    first: Some(format!("the check failed: {e:#}")),
                    ..index_check::IndexCheck::default()
                }),
        )
    } else {
        None
    };
    let sync = cluster.sync_totals();
    let snapshots = cluster.snapshots();
    // The routers' own figures, summed over the replicas (one router without).
    let metrics: Vec<&transport::metrics::Metrics> =
        cluster.hubs().into_iter().map(|h| h.metrics()).collect();
    let chosen_overlap_blocks = metrics.iter().map(|m| m.chosen_overlap.snapshot().2).sum();
    let best_overlap_blocks = metrics.iter().map(|m| m.best_overlap.snapshot().2).sum();
    let disagg = cluster_cfg.disagg.map(|spec| {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let count = |f: fn(&transport::metrics::Metrics) -> &AtomicU64| -> u64 {
            metrics.iter().map(|m| f(m).load(Relaxed)).sum()
        };
        report::DisaggFigures {
            protocol: spec.config.protocol.as_str().to_owned(),
            prefill_workers: spec.prefill,
            decode_workers: spec.decode,
            min_prefill_tokens: spec.config.split.min_prefill_tokens,
            remote_prefills: count(|m| &m.disagg_remote),
            local_prefills: count(|m| &m.disagg_local),
            fallbacks: count(|m| &m.disagg_fallbacks),
            transferred_tokens: snapshots.iter().map(|s| s.stats.transferred_tokens).sum(),
            worker_remote_prefills: snapshots.iter().map(|s| s.stats.remote_prefills).sum(),
        }
    });
    let info = RunInfo {
        mode,
        workload: workload.name.clone(),
        workers: cluster.worker_ids(),
        speedup: cfg.speedup,
        kv_blocks: cfg.engine.kv_blocks,
        rate_scale: cfg.rate_scale,
        hit_rate_bound: workload.bound.hit_rate(),
        capacity_hit_bound,
        router_cost: cfg.router_cost,
        wall_s: wall.as_secs_f64(),
        router_active_after: active_after,
        preemptions: snapshots.iter().map(|s| s.stats.preemptions).sum(),
        chosen_overlap_blocks,
        best_overlap_blocks,
        block_size: cfg.engine.block_size,
        sync,
    };
    cluster.shutdown().await?;
    let mut report = report::summarize(&info, &results);
    report.mode = run.label();
    report.disagg = disagg;
    report.index_check = index_check;
    Ok(report)
}

/// The built-in chat workload of `kvengine demo` (and `kvengine bench replay` without a
/// trace): `requests` turns of 32 interleaved conversations over 4 shared system prompts,
/// arriving often enough that 4 simulated H100s queue when routing ignores their caches.
pub fn demo_chat_config(seed: u64, requests: usize) -> ChatConfig {
    ChatConfig {
        seed,
        requests,
        live_sessions: 32,
        turns: 2..=12,
        mean_gap_ms: 25.0,
        adapter_share: 0.0,
        ..ChatConfig::default()
    }
}

/// A few lines describing a replay of `workload` with `cfg`.
pub fn describe(workload: &Workload, cfg: &ReplayConfig) -> String {
    let b = &workload.bound;
    let bs = cfg.engine.block_size;
    let capacity = cfg.workers as u64 * u64::from(cfg.engine.kv_blocks);
    let mut s = format!(
        "workload: {}\n  {} requests over {:.1} simulated s, {} prompt tokens in {} distinct \
         blocks of {bs} tokens; infinite-cache hit-rate bound {:.1}%\n  {} workers x {} KV \
         blocks ({:.0}% of the distinct blocks), speedup {}x",
        workload.name,
        workload.requests.len(),
        workload.span_s(),
        b.prompt_tokens,
        b.distinct_blocks,
        100.0 * b.hit_rate(),
        cfg.workers,
        cfg.engine.kv_blocks,
        100.0 * capacity as f64 / b.distinct_blocks.max(1) as f64,
        cfg.speedup,
    );
    if cfg.replicas > 1 {
        let how = match cfg.share_load {
            true => "sharing their load over NATS",
            false => "NOT sharing their load (independent routers)",
        };
        s.push_str(&format!(
            "\n  {} router replicas in front of the same workers, {how}; requests go round \
             robin over them",
            cfg.replicas
        ));
    }
    if let Some(d) = &cfg.disagg {
        s.push_str(&format!(
            "\n  disaggregated: {} prefill + {} decode workers ({} hand-off, prefill sent away \
             from {} uncached tokens), against {} aggregated workers",
            d.prefill,
            d.decode,
            d.config.protocol,
            d.config.split.min_prefill_tokens,
            d.workers(),
        ));
    }
    if u64::from(cfg.engine.kv_blocks) >= b.distinct_blocks {
        // Each worker can keep everything it is ever sent: after one miss per prompt every
        // mode hits, and the comparison shows only warm-up, not routing.
        s.push_str(&format!(
            "\n  warning: each worker's cache ({} blocks) holds the whole workload ({} distinct \
             blocks): nothing is ever evicted, so routing barely matters here (lower \
             --kv-blocks, or raise --requests)",
            cfg.engine.kv_blocks, b.distinct_blocks
        ));
    }
    let largest = workload.max_blocks(bs);
    if largest > u64::from(cfg.engine.kv_blocks) {
        s.push_str(&format!(
            "\n  warning: the largest request needs {largest} blocks, more than a worker's \
             cache: it will fail (raise --kv-blocks)"
        ));
    }
    s
}
