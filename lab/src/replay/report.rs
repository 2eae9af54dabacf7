//! The figures of one mode's replay, and the table comparing modes.
//!
//! Definitions (all times in simulated milliseconds, over the requests that completed):
//! * `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms`, `e2e_p50_ms`: nearest-rank percentiles
//!   of the per-request values;
//! * `itl_p50_ms`, `itl_p99_ms`: percentiles of every inter-token gap of every request,
//!   pooled;
//! * `output_tok_per_s`, `requests_per_s`: tokens received, requests completed, over the
//!   simulated time from the first request sent to the last answer finished;
//! * `cache_hit_rate`: the usage chunks' `cached_tokens` summed over their `prompt_tokens`;
//! * `hit_rate_bound`: the workload's infinite-cache bound ([`super::trace`]);
//! * `capacity_hit_bound`: what one LRU cache of the cluster's `workers x kv_blocks`
//!   blocks would hit ([`super::trace`]), and `capacity_share` the hit rate over it;
//! * `overlap_regret`: `router_best_overlap_rate - router_chosen_overlap_rate`, the prompt
//!   share cached on some worker at routing time that the chosen worker did not have;
//! * `router_cost`: what kv modes minimised (`ttft` or `dynamo`), recorded in every run;
//! * `load_spread`: with `prefill(w)` the prompt tokens worker `w` computed
//!   (`prompt_tokens - cached_tokens` of the requests it served, or prefilled for a decode
//!   worker), the busiest worker's share `max prefill / sum prefill` divided by `1 / N`,
//!   minus 1: 0 when perfectly even, `N - 1` when one worker did everything;
//! * `router_chosen_overlap_rate`, `router_best_overlap_rate`: in disaggregated runs both
//!   halves of a request are routed (decode and prefill pools), and both count;
//! * `disagg` (disaggregated runs only, [`DisaggFigures`]): the router's split decisions
//!   (its `disagg_remote`, `disagg_local` and `disagg_fallbacks` counters) and the KV the
//!   decode workers received (their `transferred_tokens`, summed);
//! * with router replicas (`--replicas N`, N > 1; [`SyncFigures`], absent otherwise) the
//!   client spreads requests round robin over the replicas, and the router-side figures
//!   (`router_*_overlap_rate`, `router_active_after`, the disaggregated split) are summed
//!   over them. The sync figures count from the replay's first request until every
//!   replica is idle ([`super::replicas`]): `sync_frames_per_request` and
//!   `sync_bytes_per_request` are the frames and bytes all replicas published (load
//!   events, states, heartbeats) per routed request (one that got a serving worker);
//!   `sync_cpu_us_per_request` the links' busy time (encode, decode, apply) summed over the
//!   replicas, and `nats_cpu_us_per_request` the NATS server's user + system CPU time, per
//!   routed request. `sync_events_dropped` and `sync_gaps` are 0 in a healthy run.
//!
//! # Invariants
//! 1. Every figure is finite; an empty input gives 0.

use super::client::RequestResult;
use super::replicas::SyncTotals;
use super::spec::RunMode;
use crate::report::{Machine, utc_now};
use engine::WorkerId;
use serde::Serialize;

/// The nearest-rank `p`-th percentile (`0..=100`) of ascending `sorted` (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let p = if p.is_finite() {
        p.clamp(0.0, 100.0)
    } else {
        50.0
    };
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.saturating_sub(1).min(sorted.len() - 1))
        .copied()
        .unwrap_or(0.0)
}

/// `values` sorted ascending (NaNs dropped).
pub fn sorted(values: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The busiest worker's share of `work` divided by `1 / N`, minus 1 (0 when all is 0).
pub fn load_spread(work: &[u64]) -> f64 {
    let total: u64 = work.iter().sum();
    let max = work.iter().copied().max().unwrap_or(0);
    if total == 0 {
        return 0.0;
    }
    work.len() as f64 * max as f64 / total as f64 - 1.0
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 && a.is_finite() { a / b } else { 0.0 }
}

/// What a mode's run knows besides the per-request results.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The mode.
    pub mode: RunMode,
    /// The workload's description.
    pub workload: String,
    /// The workers' ids, in worker order.
    pub workers: Vec<WorkerId>,
    /// The speedup.
    pub speedup: f64,
    /// KV blocks per worker.
    pub kv_blocks: u32,
    /// The workload's rate scale.
    pub rate_scale: f64,
    /// The workload's infinite-cache bound.
    pub hit_rate_bound: f64,
    /// The workload's capacity-aware bound at the cluster's capacity.
    pub capacity_hit_bound: f64,
    /// What kv modes minimised.
    pub router_cost: engine::sched::RouterCost,
    /// Wall time of the replay.
    pub wall_s: f64,
    /// Requests the router still counted as active after the replay.
    pub router_active_after: usize,
    /// Preemptions over all workers.
    pub preemptions: u64,
    /// Sum over routed requests of the chosen worker's overlap, in blocks (router's view).
    pub chosen_overlap_blocks: f64,
    /// Sum over routed requests of the best overlap any worker had, in blocks.
    pub best_overlap_blocks: f64,
    /// The router's block size.
    pub block_size: u32,
    /// With router replicas: what their sync did over the replay.
    pub sync: Option<SyncTotals>,
}

/// What a disaggregated run did besides serving (see the module's definitions).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DisaggFigures {
    /// The hand-off protocol: `vllm`, `sglang` or `trtllm`.
    pub protocol: String,
    /// Prefill workers.
    pub prefill_workers: usize,
    /// Decode workers.
    pub decode_workers: usize,
    /// Uncached prompt tokens from which a prefill is sent to a prefill worker.
    pub min_prefill_tokens: u64,
    /// Requests whose prefill the router sent to a prefill worker.
    pub remote_prefills: u64,
    /// Requests the router had prefilled on their decode worker (too little to compute).
    pub local_prefills: u64,
    /// Failed halves retried elsewhere.
    pub fallbacks: u64,
    /// Prompt tokens the decode workers received instead of computing.
    pub transferred_tokens: u64,
    /// Requests the decode workers admitted with a remote prefill.
    pub worker_remote_prefills: u64,
}

impl DisaggFigures {
    /// Remote prefills over the requests the router split.
    pub fn remote_share(&self) -> f64 {
        ratio(
            self.remote_prefills as f64,
            (self.remote_prefills + self.local_prefills) as f64,
        )
    }
}

/// What the router replicas' sync cost (see the module's definitions); flattened into
/// [`ModeReport`], so its fields sit beside the others in the JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SyncFigures {
    /// Router replicas the requests were spread over.
    pub replicas: usize,
    /// Frames the replicas published, per routed request.
    pub sync_frames_per_request: f64,
    /// Bytes the replicas published, per routed request.
    pub sync_bytes_per_request: f64,
    /// The replica links' busy time, microseconds per routed request.
    pub sync_cpu_us_per_request: f64,
    /// The NATS server's CPU time, microseconds per routed request (absent where `/proc`
    /// cannot tell).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_cpu_us_per_request: Option<f64>,
    /// Load events the replicas published.
    pub sync_events_sent: u64,
    /// Peers' load events the replicas applied (about `N - 1` times those sent).
    pub sync_events_applied: u64,
    /// Load events lost (link down or queue full): 0 in a healthy run.
    pub sync_events_dropped: u64,
    /// Gaps the replicas found in their peers' frames: 0 in a healthy run.
    pub sync_gaps: u64,
}

impl SyncFigures {
    /// The figures of `t` over `routed` requests.
    pub fn of(t: &SyncTotals, routed: u64) -> Self {
        let per = |x: f64| ratio(x, routed as f64);
        Self {
            replicas: t.replicas,
            sync_frames_per_request: per(t.frames_sent as f64),
            sync_bytes_per_request: per(t.bytes_sent as f64),
            sync_cpu_us_per_request: per(t.busy_ns as f64 / 1000.0),
            nats_cpu_us_per_request: t.nats_cpu_ns.map(|ns| per(ns as f64 / 1000.0)),
            sync_events_sent: t.events_sent,
            sync_events_applied: t.events_applied,
            sync_events_dropped: t.events_dropped,
            sync_gaps: t.gaps,
        }
    }
}

/// One run's figures (the JSON `kvengine bench replay` writes).
#[derive(Clone, Debug, Serialize)]
pub struct ModeReport {
    /// `kv`, `round-robin`, `random` or `kv-no-events`; `disagg-` before it for a
    /// disaggregated run.
    pub mode: String,
    /// Requests sent.
    pub requests: u64,
    /// Time to first token, median.
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Inter-token latency, median.
    pub itl_p50_ms: f64,
    /// 99th percentile.
    pub itl_p99_ms: f64,
    /// End-to-end latency, median.
    pub e2e_p50_ms: f64,
    /// 99th percentile.
    pub e2e_p99_ms: f64,
    /// Output tokens per simulated second, over the whole run.
    pub output_tok_per_s: f64,
    /// Completed requests per simulated second, over the whole run.
    pub requests_per_s: f64,
    /// Prompt tokens served from the workers' caches / prompt tokens.
    pub cache_hit_rate: f64,
    /// The infinite-cache bound of the workload.
    pub hit_rate_bound: f64,
    /// What one LRU cache of the whole cluster's blocks would hit ([`super::trace`]).
    pub capacity_hit_bound: f64,
    /// `cache_hit_rate / capacity_hit_bound` (0 when the bound is 0).
    pub capacity_share: f64,
    /// `router_best_overlap_rate - router_chosen_overlap_rate`: prompt share the router
    /// could have found cached at routing time and did not take.
    pub overlap_regret: f64,
    /// What kv modes minimised (`--router-cost`: `ttft` or `dynamo`).
    pub router_cost: String,
    /// Busiest worker's share of prefill work, divided by `1 / N`, minus 1.
    pub load_spread: f64,
    /// Requests that did not complete.
    pub errors: u64,
    /// Workers.
    pub workers: usize,
    /// A disaggregated run's split figures (absent for aggregated runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disagg: Option<DisaggFigures>,
    /// After a run with KV events: the router's index against the workers' caches
    /// ([`super::index_check`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_check: Option<super::index_check::IndexCheck>,
    /// With router replicas, the sync's figures (their fields, flattened; absent with one
    /// router).
    #[serde(flatten)]
    pub sync: Option<SyncFigures>,
    /// Simulated time per real time.
    pub speedup: f64,
    /// Where it ran.
    pub machine: Machine,
    /// When it ran (UTC).
    pub date: String,
    /// The workload.
    pub workload: String,
    /// KV blocks per worker.
    pub kv_blocks: u32,
    /// The trace's request rate was multiplied by this.
    pub rate_scale: f64,
    /// Prompt tokens (usage chunks).
    pub prompt_tokens: u64,
    /// Of those, cached.
    pub cached_tokens: u64,
    /// Requests served, per worker.
    pub requests_per_worker: Vec<u64>,
    /// Prompt tokens computed (`prompt - cached`), per worker.
    pub prefill_tokens_per_worker: Vec<u64>,
    /// Preemptions over all workers.
    pub preemptions: u64,
    /// The router's view: overlap tokens of the workers it chose / prompt tokens.
    pub router_chosen_overlap_rate: f64,
    /// The router's view: overlap tokens of the best-overlap workers / prompt tokens (what
    /// routing purely on overlap would have got); below `cache_hit_rate` bound by eviction.
    pub router_best_overlap_rate: f64,
    /// How late requests were sent (client lag), 99th percentile, simulated ms.
    pub send_lag_p99_ms: f64,
    /// Requests still active in the router after the replay (should be 0).
    pub router_active_after: usize,
    /// Wall time of the replay.
    pub wall_s: f64,
    /// The first few errors.
    pub error_samples: Vec<String>,
}

/// Summarises `results` of the run described by `info`.
pub fn summarize(info: &RunInfo, results: &[RequestResult]) -> ModeReport {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok()).collect();
    let ttft = sorted(ok.iter().filter_map(|r| r.ttft_ms));
    let e2e = sorted(ok.iter().filter_map(|r| r.e2e_ms));
    let itl = sorted(ok.iter().flat_map(|r| r.itl_ms.iter().copied()));
    let lag = sorted(results.iter().map(|r| r.lag_ms));
    let n = info.workers.len();
    let mut requests_per_worker = vec![0u64; n];
    let mut prefill = vec![0u64; n];
    let (mut prompt, mut cached, mut tokens) = (0u64, 0u64, 0u64);
    for r in &ok {
        prompt += r.prompt_tokens;
        cached += r.cached_tokens;
        tokens += r.output_tokens;
        let slot = r
            .worker
            .and_then(|w| info.workers.iter().position(|id| id.0 == w));
        if let Some(i) = slot {
            requests_per_worker[i] += 1;
        }
        let prefilled_by = r
            .prefill_worker
            .or(r.worker)
            .and_then(|w| info.workers.iter().position(|id| id.0 == w));
        if let Some(i) = prefilled_by {
            prefill[i] += r.prompt_tokens.saturating_sub(r.cached_tokens);
        }
    }
    let first = ok.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let last = ok
        .iter()
        .filter_map(|r| r.e2e_ms.map(|e| r.sent_ms + e))
        .fold(0.0f64, f64::max);
    let span_s = if first.is_finite() && last > first {
        (last - first) / 1000.0
    } else {
        0.0
    };
    let errors: Vec<&RequestResult> = results.iter().filter(|r| !r.ok()).collect();
    ModeReport {
        mode: info.mode.as_str().to_owned(),
        requests: results.len() as u64,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p99_ms: percentile(&itl, 99.0),
        e2e_p50_ms: percentile(&e2e, 50.0),
        e2e_p99_ms: percentile(&e2e, 99.0),
        output_tok_per_s: ratio(tokens as f64, span_s),
        requests_per_s: ratio(ok.len() as f64, span_s),
        cache_hit_rate: ratio(cached as f64, prompt as f64),
        hit_rate_bound: info.hit_rate_bound,
        capacity_hit_bound: info.capacity_hit_bound,
        capacity_share: ratio(ratio(cached as f64, prompt as f64), info.capacity_hit_bound),
        overlap_regret: ratio(
            (info.best_overlap_blocks - info.chosen_overlap_blocks) * f64::from(info.block_size),
            prompt as f64,
        ),
        router_cost: info.router_cost.as_str().to_owned(),
        load_spread: load_spread(&prefill),
        errors: errors.len() as u64,
        workers: n,
        disagg: None,
        index_check: None,
        sync: info.sync.map(|t| {
            let routed = results.iter().filter(|r| r.worker.is_some()).count();
            SyncFigures::of(&t, routed as u64)
        }),
        speedup: info.speedup,
        machine: Machine::detect(),
        date: utc_now(),
        workload: info.workload.clone(),
        kv_blocks: info.kv_blocks,
        rate_scale: info.rate_scale,
        prompt_tokens: prompt,
        cached_tokens: cached,
        requests_per_worker,
        prefill_tokens_per_worker: prefill,
        preemptions: info.preemptions,
        router_chosen_overlap_rate: ratio(
            info.chosen_overlap_blocks * f64::from(info.block_size),
            prompt as f64,
        ),
        router_best_overlap_rate: ratio(
            info.best_overlap_blocks * f64::from(info.block_size),
            prompt as f64,
        ),
        send_lag_p99_ms: percentile(&lag, 99.0),
        router_active_after: info.router_active_after,
        wall_s: info.wall_s,
        error_samples: errors
            .iter()
            .take(5)
            .map(|r| format!("request {}: {}", r.index, r.error.as_deref().unwrap_or("")))
            .collect(),
    }
}

/// The comparison table: mode, TTFT p50, p90 and p99, throughput, cache hit rate, both
/// bounds, the overlap regret, load spread, errors. One row per report, each starting
/// with its mode's name ([`legend`] explains the columns).
pub fn table(reports: &[ModeReport]) -> String {
    let mut s = format!(
        "{:<13} {:>9} {:>9} {:>9} {:>8} {:>9} {:>8} {:>8} {:>7} {:>11} {:>6}\n",
        "mode",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "req/s",
        "cache hit",
        "cap bnd",
        "inf bnd",
        "regret",
        "load spread",
        "errors"
    );
    for r in reports {
        s.push_str(&format!(
            "{:<13} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.1}% {:>7.1}% {:>7.1}% {:>6.1}% {:>11.2} {:>6}\n",
            r.mode,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.requests_per_s,
            100.0 * r.cache_hit_rate,
            100.0 * r.capacity_hit_bound,
            100.0 * r.hit_rate_bound,
            100.0 * r.overlap_regret,
            r.load_spread,
            r.errors
        ));
    }
    s
}

/// What the table's columns mean, and the router cost kv modes ran with.
pub fn legend(reports: &[ModeReport]) -> String {
    let cost = reports.first().map_or("dynamo", |r| r.router_cost.as_str());
    format!(
        "TTFT in simulated ms; req/s: completed requests per simulated second; kv modes \
         minimise --router-cost {cost}; cache hit: prompt tokens the workers served from \
         their caches; cap bnd: what one LRU cache of the whole cluster's blocks would hit; \
         inf bnd: an infinite cache; regret: prompt share cached on some worker at routing \
         time that the chosen one lacked; load spread: the busiest worker's share of prefill \
         work over an even share, minus 1\n{}",
        if reports
            .iter()
            .any(|r| matches!(r.mode.as_str(), "sglang" | "llm-d"))
        {
            "sglang, llm-d: approximations of those routers' decision rules on kvengine's \
             exact overlaps, not the routers themselves (`kvengine bench peers` runs the real \
             SMG, sglang-router and vllm-router)\n"
        } else {
            ""
        }
    )
}

/// One line per run whose index was checked against the workers' caches
/// ([`super::index_check`]); empty when none was.
pub fn index_summary(reports: &[ModeReport]) -> String {
    let mut s = String::new();
    for r in reports {
        let Some(c) = &r.index_check else { continue };
        s.push_str(&format!(
            "index check ({}): {} prompts on every worker, {} mismatches, {} cached prompt \
             blocks compared{}\n",
            r.mode,
            c.prompts,
            c.mismatches,
            c.cached_blocks,
            c.first
                .as_deref()
                .map_or_else(String::new, |f| format!(" (first: {f})"))
        ));
    }
    s
}

/// The replica sync's table: per run with router replicas, the replicas, frames, bytes,
/// link CPU and NATS CPU per routed request, and the events dropped. Empty when no run had
/// replicas (the main table is then all there is); printed under the main table, which
/// stays as it is so runs with and without replicas compare line for line.
pub fn sync_table(reports: &[ModeReport]) -> String {
    let rows: Vec<(&str, &SyncFigures)> = reports
        .iter()
        .filter_map(|r| r.sync.as_ref().map(|s| (r.mode.as_str(), s)))
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "{:<18} {:>8} {:>10} {:>10} {:>13} {:>13} {:>8}\n",
        "replica sync",
        "replicas",
        "frames/req",
        "bytes/req",
        "link CPU us/r",
        "NATS CPU us/r",
        "dropped"
    );
    for (mode, f) in rows {
        let nats = f
            .nats_cpu_us_per_request
            .map_or_else(|| "-".to_owned(), |us| format!("{us:.1}"));
        s.push_str(&format!(
            "{:<18} {:>8} {:>10.2} {:>10.0} {:>13.1} {:>13} {:>8}\n",
            mode,
            f.replicas,
            f.sync_frames_per_request,
            f.sync_bytes_per_request,
            f.sync_cpu_us_per_request,
            nats,
            f.sync_events_dropped
        ));
    }
    s.push_str("(per routed request; link CPU: encode, decode and apply, all replicas summed)\n");
    s
}

/// The same table in Markdown (for `docs/benchmarks.md`).
pub fn markdown(reports: &[ModeReport]) -> String {
    let mut s = String::from(
        "| mode | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | e2e p50 ms | output tok/s | \
         cache hit | bound | load spread | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {:.1}% | {:.1}% | {:.2} | {} |\n",
            r.mode,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.e2e_p50_ms,
            r.output_tok_per_s,
            100.0 * r.cache_hit_rate,
            100.0 * r.hit_rate_bound,
            r.load_spread,
            r.errors
        ));
    }
    s
}

fn disagg_cells(r: &ModeReport) -> (String, String, String) {
    match &r.disagg {
        Some(d) => (
            d.remote_prefills.to_string(),
            d.local_prefills.to_string(),
            d.transferred_tokens.to_string(),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    }
}

/// The table of a disaggregated comparison ([`super::disagg`]): per run, TTFT p50 and p99,
/// inter-token latency p50 and p99, end to end p50, output tokens and requests per
/// simulated second, cache hit rate, remote and local prefills, tokens transferred and
/// errors (`-` where a run is aggregated). One row per report, each starting with its
/// run's name.
pub fn disagg_table(reports: &[ModeReport]) -> String {
    let mut s = format!(
        "{:<18} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>6} {:>7} {:>7} {:>6} {:>11} {:>6}\n",
        "run",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "e2e p50",
        "tok/s",
        "req/s",
        "cache",
        "remote",
        "local",
        "xfer tokens",
        "errors"
    );
    for r in reports {
        let (remote, local, xfer) = disagg_cells(r);
        s.push_str(&format!(
            "{:<18} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>8.0} {:>6.2} {:>6.1}% {:>7} {:>6} {:>11} {:>6}\n",
            r.mode,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms,
            r.e2e_p50_ms,
            r.output_tok_per_s,
            r.requests_per_s,
            100.0 * r.cache_hit_rate,
            remote,
            local,
            xfer,
            r.errors
        ));
    }
    s.push_str("(times in simulated ms; remote / local: prefills on a prefill worker / on the decode worker)\n");
    s
}
