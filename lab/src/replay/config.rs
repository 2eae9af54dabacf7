//! How a replay is configured ([`ReplayConfig`], the same for every mode, and the
//! `--engine` defaults it is filled from), and what each of its clusters is started with
//! ([`ClusterConfig`]).

use super::disagg::DisaggSpec;
use super::spec::RunMode;
use crate::workers::SimRole;
use anyhow::{Result, bail};
use engine::sched::RouterCost;
use sim::engine::EngineConfig;
use std::time::Duration;

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
    /// aggregated `kv` run ([`disagg::plan`](super::disagg::plan)); `workers` must then be `P + D`.
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

/// What one cluster is started with.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Router replicas in front of them (1: a single router, no NATS).
    pub replicas: usize,
    /// Whether the replicas share their load over NATS (false: independent routers).
    pub share_load: bool,
    /// The routing mode.
    pub mode: RunMode,
    /// Each worker's engine; its block size is also the router's.
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// Engine (shard) cores: 1 or 2.
    pub cores: usize,
    /// Scheduler seed.
    pub seed: u64,
    /// The scheduler's weight of prefill blocks against decode blocks.
    pub overlap_weight: f64,
    /// What kv modes minimise.
    pub router_cost: engine::sched::RouterCost,
    /// With the TTFT cost: the weight of the prefill stall on running requests.
    pub stall_weight: f64,
    /// Prefill and decode workers instead of `workers` aggregated ones (`workers` is then
    /// `P + D`).
    pub disagg: Option<DisaggSpec>,
    /// How the workers hand out their KV events (vLLM's ZMQ, or TensorRT-LLM's HTTP drain).
    pub events: crate::workers::EventFormat,
}

impl ClusterConfig {
    /// The cluster of `mode` in a replay configured by `cfg`.
    pub fn of(cfg: &ReplayConfig, mode: RunMode) -> Self {
        Self {
            workers: cfg.workers,
            replicas: cfg.replicas,
            share_load: cfg.share_load,
            mode,
            engine: cfg.engine.clone(),
            speedup: cfg.speedup,
            cores: cfg.cores,
            seed: cfg.seed,
            overlap_weight: cfg.overlap_weight,
            router_cost: cfg.router_cost,
            stall_weight: cfg.stall_weight,
            disagg: None,
            events: cfg.events,
        }
    }

    /// The disaggregated cluster of `mode` in a replay configured by `cfg`: `spec.prefill`
    /// prefill and `spec.decode` decode workers.
    pub fn disaggregated(cfg: &ReplayConfig, mode: RunMode, spec: DisaggSpec) -> Self {
        Self {
            workers: spec.workers(),
            disagg: Some(spec),
            ..Self::of(cfg, mode)
        }
    }

    /// Each worker's role, in worker order.
    pub fn roles(&self) -> Vec<SimRole> {
        match &self.disagg {
            None => vec![SimRole::Aggregated; self.workers],
            Some(d) => std::iter::repeat_n(SimRole::Prefill, d.prefill)
                .chain(std::iter::repeat_n(SimRole::Decode, d.decode))
                .collect(),
        }
    }
}
