//! Routing quality end to end: `kvengine bench replay` and `kvengine demo`.
//!
//! A workload (a Mooncake trace, or the built-in chat generator) is replayed open loop
//! against the real router (engine, hub, HTTP edge and OpenAI proxy) in front of simulated
//! vLLM workers ([`crate::workers`]) that publish real KV events over ZMQ, all in one process.
//! Each routing mode gets a fresh cluster; each request's TTFT, inter-token latencies,
//! end-to-end latency, cached prompt tokens and serving worker are measured by the client,
//! and summarised per mode ([`report::ModeReport`]).
//!
//! * [`ReplayRequest`] and [`RunMode`] (`spec.rs`), [`ReplayConfig`] and the cluster's
//!   [`cluster::ClusterConfig`] (`config.rs`): what the other modules share, in leaf modules
//!   re-exported here.
//! * [`trace`]: workloads ([`Workload`]) and their infinite-cache bound.
//! * [`cluster`]: the in-process router(s) plus workers, started and stopped per mode.
//! * [`router`]: one in-process router (engine, hub, subscriptions, HTTP edge and proxy).
//! * [`replicas`]: router replicas (`--replicas N`): N routers in front of the same workers,
//!   sharing their load over a NATS server of their own, and what the sync cost.
//! * [`client`]: the open-loop streaming client (round robin over the replicas).
//! * [`report`]: the per-mode figures (JSON) and the table.
//! * [`plot`]: an SVG comparing modes.
//! * [`disagg`]: disaggregated runs (`--disagg P:D`): prefill and decode workers, compared
//!   with aggregated `kv` on as many workers.
//! * [`index_check`]: after a run, one router's index compared with the workers' caches.
//!
//! This module runs them ([`run`], [`run_one`]) and describes a replay ([`describe`]); none
//! of them uses it.
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

mod config;
mod spec;

pub use config::{MAX_REPLICAS, ReplayConfig, default_block_size, default_kv_blocks, parse_engine};
pub use spec::{ReplayRequest, RunMode};
pub use trace::Workload;

use anyhow::{Context, Result, bail};
use disagg::Run;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use report::{ModeReport, RunInfo};
use sim::workload::chat::ChatConfig;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
            prompt: client::PromptForm::TokenIds,
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
