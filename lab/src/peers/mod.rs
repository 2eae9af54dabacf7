//! kvengine side by side with the real peer routers (`kvengine bench peers`).
//!
//! Each run starts fresh simulated vLLM workers ([`crate::workers`], ZMQ KV events, vLLM's
//! load gauges on `/metrics`) and one router as a child process in front of them: this
//! binary, or a peer installed from PyPI ([`venv`]: SMG, sglang-router, vllm-router, at
//! pinned versions). The same workload is replayed open loop through the router's OpenAI
//! endpoint ([`crate::replay::client`]), prompts written as text (one word per token id,
//! [`PromptForm::Words`]) because the peers' cache-aware policies route on text; the
//! workers and kvengine (`--tokenizer stand-in`) turn each word into one token, so every
//! router sees the same prefixes. Then, optionally, the router's overhead as a proxy is
//! measured on the same cluster ([`overhead`]).
//!
//! Runs are interleaved (run 1 of every router, then run 2 of every router, ...), and the
//! table gives each figure's median with its min and max over the runs.
//!
//! Figures, per run (latencies in simulated milliseconds, as in `bench replay`):
//! * TTFT p50 / p99 and end-to-end p50 over the requests that completed;
//! * the workers' cache hit rate: prompt tokens served from cache over prompt tokens, as
//!   the workers' engines counted them (not as any router reports);
//! * errors: requests that did not complete;
//! * the router process's CPU seconds during the replay, and per request;
//! * load spread: the busiest worker's share of requests over a fair share, minus 1.
//!
//! # Invariants
//! 1. Every router of a run meets the same workload on workers started afresh for it, and
//!    everything a run started (workers, the router process) is stopped before the next.
//! 2. A router that cannot start fails its run (recorded, with its log's end) rather than
//!    the whole comparison; a peer that is not installed is skipped with its reason printed.

pub mod contender;
pub mod misses;
pub mod overhead;
pub mod process;
pub mod venv;

pub use contender::Contender;

use crate::replay::Workload;
use crate::replay::client::{self, ClientConfig, PromptForm, RequestResult};
use crate::replay::report::{load_spread, percentile, sorted};
use crate::workers::{SimWorkerConfig, SimWorkerHandle, spawn_cluster};
use anyhow::{Context, Result};
use contender::WorkerAddrs;
use overhead::Overhead;
use process::{RouterChild, free_port};
use serde::Serialize;
use sim::engine::EngineConfig;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use venv::PeerInstalls;

/// A peers comparison.
#[derive(Clone, Debug)]
pub struct PeersConfig {
    /// The routers, in table order.
    pub contenders: Vec<Contender>,
    /// Simulated workers per run.
    pub workers: usize,
    /// The workers' engine (cache size, block size, timing).
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// Runs of every router (interleaved).
    pub runs: usize,
    /// How long each overhead measurement runs (zero: none).
    pub overhead: Duration,
    /// The overhead measurement's connection counts.
    pub overhead_connections: Vec<usize>,
    /// The `kvengine` executable.
    pub kvengine: PathBuf,
    /// The installed peers.
    pub installs: PeerInstalls,
    /// Where the routers' logs go.
    pub workdir: PathBuf,
    /// Longest wall time one request may take.
    pub request_timeout: Duration,
    /// Longest wall time a router may take to start routing.
    pub start_timeout: Duration,
}

/// One router's figures in one run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunFigures {
    /// The router.
    pub router: String,
    /// Which run (from 1).
    pub run: usize,
    /// Why the run failed, if it did (then the figures are empty).
    pub failed: Option<String>,
    /// Requests sent.
    pub requests: u64,
    /// Requests that did not complete.
    pub errors: u64,
    /// The first error, as an example.
    pub first_error: Option<String>,
    /// TTFT median, simulated ms.
    pub ttft_p50_ms: f64,
    /// TTFT 99th percentile.
    pub ttft_p99_ms: f64,
    /// End-to-end median.
    pub e2e_p50_ms: f64,
    /// The workers' hit rate (cached prompt tokens / prompt tokens), as they counted.
    pub worker_hit_rate: f64,
    /// The router's CPU seconds during the replay.
    pub router_cpu_s: f64,
    /// Of those, per request sent, microseconds.
    pub router_cpu_us_per_request: f64,
    /// The busiest worker's share of requests over a fair share, minus 1.
    pub load_spread: f64,
    /// The replay's wall time, seconds.
    pub wall_s: f64,
    /// The overhead measurements.
    pub overhead: Vec<Overhead>,
    /// kvengine's own attribution of the workers' hits and misses (kvengine rows only).
    pub misses: Option<misses::MissFigures>,
}

/// Runs the comparison on a runtime of its own and returns every run's figures, in the
/// order they ran. `progress` gets one line per finished run.
pub fn run(
    workload: &Workload,
    cfg: &PeersConfig,
    progress: &dyn Fn(&RunFigures),
) -> Result<Vec<RunFigures>> {
    std::fs::create_dir_all(&cfg.workdir)
        .with_context(|| format!("cannot create {}", cfg.workdir.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("kvengine-peers")
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let mut out = Vec::new();
    for run in 1..=cfg.runs {
        for c in &cfg.contenders {
            let figures = rt
                .block_on(one(workload, cfg, c, run))
                .unwrap_or_else(|e| RunFigures {
                    router: c.to_string(),
                    run,
                    failed: Some(format!("{e:#}")),
                    ..RunFigures::default()
                });
            progress(&figures);
            out.push(figures);
        }
    }
    Ok(out)
}

/// One run of one router (invariant 1).
async fn one(
    workload: &Workload,
    cfg: &PeersConfig,
    c: &Contender,
    run: usize,
) -> Result<RunFigures> {
    let base = SimWorkerConfig {
        engine: cfg.engine.clone(),
        speedup: cfg.speedup,
        vllm_metrics: true,
        ..SimWorkerConfig::default()
    };
    let workers = spawn_cluster(cfg.workers, base, None)
        .await
        .context("cannot start the simulated workers")?;
    let result = with_workers(workload, cfg, c, run, &workers).await;
    for w in workers {
        w.shutdown().await;
    }
    result
}

async fn with_workers(
    workload: &Workload,
    cfg: &PeersConfig,
    c: &Contender,
    run: usize,
    workers: &[SimWorkerHandle],
) -> Result<RunFigures> {
    let addrs: Vec<WorkerAddrs> = workers
        .iter()
        .map(|w| WorkerAddrs {
            url: w.url(),
            zmq: w.zmq_endpoint().to_owned(),
            replay: w.replay_endpoint().to_owned(),
        })
        .collect();
    let port = free_port()?;
    let (exe, args) = c.command(
        &cfg.kvengine,
        &cfg.installs,
        port,
        &addrs,
        cfg.engine.block_size,
    )?;
    let slug: String = c
        .to_string()
        .chars()
        .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
        .collect();
    let log = cfg.workdir.join(format!("{slug}-run{run}.log"));
    let mut router = RouterChild::spawn(&exe, &args, &log, port)?;
    router
        .wait_ready(c.ready_path(), cfg.start_timeout)
        .await
        .with_context(|| format!("{c} (log: {})", log.display()))?;
    let before: Vec<_> = workers.iter().map(|w| w.snapshot().stats).collect();
    let cpu_before = router.cpu_seconds();
    let started = Instant::now();
    let results = client::replay_over(
        &[router.url()],
        &workload.requests,
        &ClientConfig {
            speedup: cfg.speedup,
            request_timeout: cfg.request_timeout,
            prompt: PromptForm::Words,
        },
        Arc::new(|| {}),
    )
    .await;
    let wall = started.elapsed();
    let cpu = router
        .cpu_seconds()
        .zip(cpu_before)
        .map_or(0.0, |(a, b)| a - b);
    let after: Vec<_> = workers.iter().map(|w| w.snapshot().stats).collect();
    let mut figures = summarise(c, run, &results, cpu, wall);
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut served = Vec::with_capacity(workers.len());
    for (b, a) in before.iter().zip(&after) {
        prompt += a.prompt_tokens.saturating_sub(b.prompt_tokens);
        cached += a.cached_tokens.saturating_sub(b.cached_tokens);
        served.push(a.requests.saturating_sub(b.requests));
    }
    figures.worker_hit_rate = if prompt > 0 {
        cached as f64 / prompt as f64
    } else {
        0.0
    };
    figures.load_spread = load_spread(&served);
    if matches!(c, Contender::Kvengine { .. }) {
        figures.misses = misses::scrape(&router.url()).await;
    }
    if !cfg.overhead.is_zero() {
        for &n in &cfg.overhead_connections {
            figures
                .overhead
                .push(overhead::measure(&router.url(), n, cfg.overhead).await);
        }
    }
    router.stop();
    Ok(figures)
}

/// The client-side figures of one run.
fn summarise(
    c: &Contender,
    run: usize,
    results: &[RequestResult],
    cpu_s: f64,
    wall: Duration,
) -> RunFigures {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok()).collect();
    let ttft = sorted(ok.iter().filter_map(|r| r.ttft_ms));
    let e2e = sorted(ok.iter().filter_map(|r| r.e2e_ms));
    let requests = results.len() as u64;
    RunFigures {
        router: c.to_string(),
        run,
        requests,
        errors: requests - ok.len() as u64,
        first_error: results.iter().find_map(|r| r.error.clone()),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        e2e_p50_ms: percentile(&e2e, 50.0),
        router_cpu_s: cpu_s,
        router_cpu_us_per_request: if requests > 0 {
            cpu_s * 1e6 / requests as f64
        } else {
            0.0
        },
        wall_s: wall.as_secs_f64(),
        ..RunFigures::default()
    }
}

/// `median [min-max]` of `values` (one value: just it).
fn spread(values: &[f64], digits: usize) -> String {
    let v = sorted(values.iter().copied());
    match v.as_slice() {
        [] => "-".into(),
        [one] => format!("{one:.digits$}"),
        _ => format!(
            "{:.digits$} [{:.digits$}-{:.digits$}]",
            percentile(&v, 50.0),
            v[0],
            v[v.len() - 1]
        ),
    }
}

/// The table: one row per router, each figure's median and [min-max] over its runs.
pub fn table(figures: &[RunFigures], connections: &[usize]) -> String {
    let mut routers: Vec<&str> = Vec::new();
    for f in figures {
        if !routers.contains(&f.router.as_str()) {
            routers.push(&f.router);
        }
    }
    let mut head = String::from(
        "| router | runs | TTFT p50 (sim ms) | TTFT p99 | E2E p50 | workers' hit | errors | \
         router CPU s | CPU us/req | load spread |",
    );
    let mut rule = String::from("|---|---|---|---|---|---|---|---|---|---|");
    for n in connections {
        let _ = write!(head, " tiny req/s @{n} | p99 ms @{n} |");
        rule.push_str("---|---|");
    }
    let mut s = format!("{head}\n{rule}\n");
    for r in routers {
        let runs: Vec<&RunFigures> = figures
            .iter()
            .filter(|f| f.router == r && f.failed.is_none())
            .collect();
        let failed = figures
            .iter()
            .filter(|f| f.router == r && f.failed.is_some())
            .count();
        let col = |g: &dyn Fn(&RunFigures) -> f64, d: usize| {
            spread(&runs.iter().map(|f| g(f)).collect::<Vec<_>>(), d)
        };
        let _ = write!(
            s,
            "| {r} | {}{} | {} | {} | {} | {} | {} | {} | {} | {} |",
            runs.len(),
            if failed > 0 {
                format!(" ({failed} failed)")
            } else {
                String::new()
            },
            col(&|f| f.ttft_p50_ms, 0),
            col(&|f| f.ttft_p99_ms, 0),
            col(&|f| f.e2e_p50_ms, 0),
            col(&|f| f.worker_hit_rate * 100.0, 1),
            col(&|f| f.errors as f64, 0),
            col(&|f| f.router_cpu_s, 2),
            col(&|f| f.router_cpu_us_per_request, 0),
            col(&|f| f.load_spread, 2),
        );
        for &n in connections {
            let pick = |f: &RunFigures| f.overhead.iter().find(|o| o.connections == n).copied();
            let _ = write!(
                s,
                " {} | {} |",
                col(&|f| pick(f).map_or(f64::NAN, |o| o.requests_per_s), 0),
                col(&|f| pick(f).map_or(f64::NAN, |o| o.p99_ms), 2),
            );
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(router: &str, run: usize, ttft: f64) -> RunFigures {
        RunFigures {
            router: router.into(),
            run,
            ttft_p50_ms: ttft,
            ..RunFigures::default()
        }
    }

    #[test]
    fn the_table_gives_median_and_range_per_router_in_first_seen_order() {
        let all = vec![
            figures("kvengine", 1, 30.0),
            figures("smg", 1, 5.0),
            figures("kvengine", 2, 10.0),
            figures("smg", 2, 7.0),
            figures("kvengine", 3, 20.0),
            RunFigures {
                failed: Some("no start".into()),
                ..figures("smg", 3, 0.0)
            },
        ];
        let t = table(&all, &[]);
        let rows: Vec<&str> = t.lines().skip(2).collect();
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0].starts_with("| kvengine | 3 | 20 [10-30] |"),
            "{}",
            rows[0]
        );
        // The failed run is counted apart, not averaged in.
        assert!(
            rows[1].starts_with("| smg | 2 (1 failed) | 5 [5-7] |"),
            "{}",
            rows[1]
        );
    }

    #[test]
    fn words_prompts_tokenize_back_to_one_token_per_id() {
        let r = crate::replay::ReplayRequest {
            arrival_ms: 0.0,
            tokens: Arc::from(vec![7u32, 4096, 7]),
            output_tokens: 3,
        };
        let body: serde_json::Value =
            serde_json::from_str(&client::body_as(&r, PromptForm::Words)).unwrap();
        let text = body["prompt"].as_str().unwrap();
        assert_eq!(text, "t7 t4096 t7");
        let ids = transport::openai::fallback::text_token_ids(text);
        assert_eq!(ids.len(), 3);
        assert_eq!(ids[0], ids[2]);
        assert_ne!(ids[0], ids[1]);
        let ids: serde_json::Value =
            serde_json::from_str(&client::body_as(&r, PromptForm::TokenIds)).unwrap();
        assert_eq!(ids["prompt"], serde_json::json!([7, 4096, 7]));
        assert_eq!(ids["max_tokens"], 3);
    }
}
