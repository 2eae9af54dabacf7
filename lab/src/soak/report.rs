//! The soak's figures (JSON) and the arithmetic behind them: latency percentiles per window
//! kind, RSS growth, the time series the plot draws, and counters summed over the router's
//! lives.
//!
//! # Invariants
//! 1. Every number written is finite (NaN and infinities become 0 or are left out), so
//!    the JSON is valid for any run.
//! 2. Percentiles are nearest-rank over the samples they name; an empty set gives 0 with
//!    `requests: 0`, never a made-up figure.

use super::faults::FaultKind;
use super::traffic::{Sample, SampleKind};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// One checkpoint's comparison of the index with the workers' caches.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Checkpoint {
    /// Its number (0-based).
    pub index: usize,
    /// Seconds from the run's start when it ended.
    pub t_s: f64,
    /// Distinct chains asked about (every cached leaf chain, plus removed ones).
    pub chains_probed: usize,
    /// Of those, chains of blocks removed since the last checkpoint.
    pub removed_chains_probed: usize,
    /// Blocks the workers' engines cache (the reference).
    pub reference_blocks: u64,
    /// The router's `kvengine_directory_entries` after the comparison.
    pub router_directory_entries: f64,
    /// Stale entries (the router says a worker holds a block it does not).
    pub stale: u64,
    /// Acknowledged lost entries (a worker holds a block the router cannot match, and its
    /// chain came from batches the router received).
    pub lost: u64,
    /// Lost entries whose chain came from a batch the router never received (published
    /// by a restarted worker before the router's subscription reconnected).
    pub lost_unreceived: u64,
    /// Stale entries found by the probes, per worker.
    pub stale_by_worker: BTreeMap<u64, u64>,
    /// Acknowledged lost entries, per worker.
    pub lost_by_worker: BTreeMap<u64, u64>,
    /// Per worker, the first batch number of its current process the router received.
    pub first_received: BTreeMap<u64, u64>,
    /// `/v1/overlap` calls without a usable answer.
    pub probe_errors: u64,
    /// `1 - (stale + lost + lost_unreceived) / reference_blocks`.
    pub accuracy: f64,
    /// Pausing the traffic until everything was idle and healthy.
    pub drain_ms: u64,
    /// Heartbeats until the router's directories held the reference's count.
    pub converged_ms: u64,
    /// Comparison rounds (a mismatch is probed again before it counts).
    pub attempts: u32,
    /// Whether the router had every worker healthy and subscribed when it compared.
    pub all_workers_healthy: bool,
    /// Harness self-check failures (model vs engine).
    pub model_mismatches: u64,
    /// The whole checkpoint.
    pub took_ms: u64,
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    /// Its kind.
    pub kind: FaultKind,
    /// The worker it hit (`None`: the router).
    pub worker: Option<u64>,
    /// Seconds from the run's start.
    pub start_s: f64,
    /// End of its window (recovery plus the settle time).
    pub end_s: f64,
    /// What happened.
    pub detail: String,
}

/// Latency of one set of requests.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencySummary {
    /// Requests sent.
    pub requests: u64,
    /// Of those, failed (any non-2xx, transport error or timeout).
    pub errors: u64,
    /// Percentiles of the successful ones, in ms.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// One point of the time series.
#[derive(Clone, Debug, Serialize)]
pub struct SeriesPoint {
    /// End of the interval, seconds from the start.
    pub t_s: f64,
    /// The router's resident set at the sample nearest `t_s` (MB).
    pub rss_mb: Option<f64>,
    /// p99 of the route probes sent in the interval (ms).
    pub route_p99_ms: Option<f64>,
    /// Route probes sent in the interval.
    pub route_requests: u64,
    /// Of those, failed.
    pub route_errors: u64,
    /// Whether a fault window overlaps the interval.
    pub fault: bool,
}

/// The router's resident set over one life.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LifeRss {
    /// The life (0: first start).
    pub life: u32,
    /// First and last sample times (s).
    pub from_s: f64,
    /// Last sample.
    pub to_s: f64,
    /// First sample (MB).
    pub first_mb: f64,
    /// Last sample (MB).
    pub last_mb: f64,
    /// Largest sample (MB).
    pub max_mb: f64,
}

/// Resident memory figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RssSummary {
    /// Median of the first tenth of the samples after the warm-up (a restarted router's
    /// from [`LIFE_SETTLE_S`] into its life) (MB).
    pub early_mb: f64,
    /// Median of the last tenth (MB).
    pub late_mb: f64,
    /// Largest sample (MB).
    pub max_mb: f64,
    /// Samples after the warm-up.
    pub samples: usize,
    /// Per life of the router process.
    pub lives: Vec<LifeRss>,
}

/// Pass/fail against the soak's goals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Goals {
    /// `acknowledged_lost == 0`.
    pub no_acknowledged_loss: bool,
    /// `stale_entries == 0`.
    pub no_stale_entries: bool,
    /// Every requested fault kind injected at least once.
    pub every_fault_injected: bool,
    /// `rss_growth_ratio <= 1.05`.
    pub rss_flat: bool,
    /// `route_p99_ms_faults <= 2 * route_p99_ms_quiet`.
    pub route_p99_within_2x: bool,
}

/// Counters of one router life, from its last `/metrics` scrape.
#[derive(Clone, Debug, Default)]
pub struct LifeCounters {
    /// `kvengine_events_applied_total`.
    pub events_applied: f64,
    /// `kvengine_replayed_batches_total`.
    pub replayed: f64,
    /// `kvengine_resyncs_total`.
    pub resyncs: f64,
    /// `kvengine_publisher_restarts_total`.
    pub publisher_restarts: f64,
    /// `kvengine_snapshots_total`.
    pub snapshots: f64,
    /// `kvengine_frontdoor_retries_total`.
    pub frontdoor_retries: f64,
    /// `kvengine_frontdoor_upstream_errors_total`.
    pub upstream_errors: f64,
    /// `kvengine_restored_workers`.
    pub restored_workers: f64,
    /// `kvengine_restore_cleared_workers`.
    pub restore_cleared_workers: f64,
    /// `kvengine_events_rejected_total` by reason.
    pub rejected: BTreeMap<String, f64>,
}

impl LifeCounters {
    /// Reads a `/metrics` page.
    pub fn parse(page: &str) -> Self {
        let m = |n| super::router::metric_sum(page, n).unwrap_or(0.0);
        let mut rejected = BTreeMap::new();
        for line in page.lines() {
            let Some(rest) = line.strip_prefix("kvengine_events_rejected_total{") else {
                continue;
            };
            let reason = rest
                .split("reason=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("?");
            let v = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            *rejected.entry(reason.to_owned()).or_insert(0.0) += v;
        }
        Self {
            events_applied: m("kvengine_events_applied_total"),
            replayed: m("kvengine_replayed_batches_total"),
            resyncs: m("kvengine_resyncs_total"),
            publisher_restarts: m("kvengine_publisher_restarts_total"),
            snapshots: m("kvengine_snapshots_total"),
            frontdoor_retries: m("kvengine_frontdoor_retries_total"),
            upstream_errors: m("kvengine_frontdoor_upstream_errors_total"),
            restored_workers: m("kvengine_restored_workers"),
            restore_cleared_workers: m("kvengine_restore_cleared_workers"),
            rejected,
        }
    }
}

/// Router counters summed over its lives.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RouterTotals {
    /// KV events applied.
    pub events_applied: u64,
    /// Batches replayed (gap repair and catch-up after a restart).
    pub batches_replayed: u64,
    /// Streams cleared because they could not be repaired.
    pub resyncs: u64,
    /// Publisher restarts detected.
    pub publisher_restarts_detected: u64,
    /// Snapshots written.
    pub snapshots: u64,
    /// Front-door retries on the next-best worker.
    pub frontdoor_retries: u64,
    /// Workers that failed the front door.
    pub frontdoor_upstream_errors: u64,
    /// Refused input by reason.
    pub events_rejected: BTreeMap<String, u64>,
}

impl RouterTotals {
    /// The sum of `lives`.
    pub fn of(lives: &BTreeMap<u32, LifeCounters>) -> Self {
        let mut t = Self::default();
        for c in lives.values() {
            t.events_applied += c.events_applied as u64;
            t.batches_replayed += c.replayed as u64;
            t.resyncs += c.resyncs as u64;
            t.publisher_restarts_detected += c.publisher_restarts as u64;
            t.snapshots += c.snapshots as u64;
            t.frontdoor_retries += c.frontdoor_retries as u64;
            t.frontdoor_upstream_errors += c.upstream_errors as u64;
            for (r, v) in &c.rejected {
                *t.events_rejected.entry(r.clone()).or_insert(0) += *v as u64;
            }
        }
        t
    }
}

/// The whole report. The first keys are the ones the soak's goals name.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakReport {
    /// Lost entries summed over the checkpoints: a block a worker caches, from a batch its
    /// publisher sent or kept for replay, that the router could not match once converged.
    pub acknowledged_lost: u64,
    /// Stale entries summed over the checkpoints.
    pub stale_entries: u64,
    /// Lost entries whose chain came from batches the router never received (a restarted
    /// worker's first batches, published before the subscription reconnected), summed over
    /// the checkpoints. Not acknowledged, but recoverable from the replay buffer.
    pub unacknowledged_lost: u64,
    /// Faults injected, by kind.
    pub faults_injected: BTreeMap<String, u64>,
    /// Late over early resident set after the warm-up ([`RssSummary`]).
    pub rss_growth_ratio: f64,
    /// p99 of route probes outside fault windows (after the warm-up), ms.
    pub route_p99_ms_quiet: f64,
    /// p99 of route probes inside fault windows, ms.
    pub route_p99_ms_faults: f64,
    /// `route_p99_ms_faults / route_p99_ms_quiet`.
    pub route_p99_ratio: f64,
    /// The goals.
    pub goals: Goals,
    /// Wall seconds of the run.
    pub duration_s: f64,
    /// Warm-up excluded from the latency and RSS figures.
    pub warmup_s: f64,
    /// Simulated workers.
    pub workers: usize,
    /// The router's cores.
    pub cores: u16,
    /// The workload's seed.
    pub seed: u64,
    /// Router counters over its lives.
    pub router: RouterTotals,
    /// Engine batches the workers sent.
    pub batches_published: u64,
    /// Engine batches withheld (dropped on the live stream, kept for replay).
    pub batches_withheld: u64,
    /// Synthetic burst batches sent.
    pub synthetic_batches: u64,
    /// Empty batches sent at checkpoints.
    pub heartbeats: u64,
    /// Worker processes restarted (compare `router.publisher_restarts_detected`).
    pub worker_restarts: u64,
    /// Router lives after the first.
    pub router_restarts: u32,
    /// Each restart's spawn-to-serving time (s) and what it said about the snapshot.
    pub router_restore: Vec<String>,
    /// Route probes outside fault windows.
    pub route_quiet: LatencySummary,
    /// Route probes inside fault windows.
    pub route_faults: LatencySummary,
    /// Route probes by the kind of fault in progress.
    pub route_by_fault: BTreeMap<String, LatencySummary>,
    /// Completions outside fault windows (end to end through a worker).
    pub completions_quiet: LatencySummary,
    /// Completions inside fault windows.
    pub completions_faults: LatencySummary,
    /// Ticks a generator skipped at its in-flight cap.
    pub traffic_shed: u64,
    /// The checkpoints.
    pub checkpoints: Vec<Checkpoint>,
    /// The faults, in order.
    pub faults: Vec<FaultRecord>,
    /// Resident memory.
    pub rss: RssSummary,
    /// Over time, for the plot.
    pub series: Vec<SeriesPoint>,
    /// Definitions and caveats.
    pub notes: Vec<String>,
}

fn finite(x: f64) -> f64 {
    if x.is_finite() { x } else { 0.0 }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile `q` (0..=1) of ascending `sorted`; 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.clamp(1, sorted.len()) - 1)
        .copied()
        .unwrap_or(0.0)
}

/// The latency summary of `samples`.
pub fn summarize<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> LatencySummary {
    let mut lat = Vec::new();
    let (mut requests, mut errors) = (0, 0);
    for s in samples {
        requests += 1;
        if s.ok() {
            lat.push(ms(s.latency));
        } else {
            errors += 1;
        }
    }
    lat.sort_by(f64::total_cmp);
    LatencySummary {
        requests,
        errors,
        p50_ms: percentile(&lat, 0.5),
        p99_ms: percentile(&lat, 0.99),
        p999_ms: percentile(&lat, 0.999),
        max_ms: lat.last().copied().unwrap_or(0.0),
    }
}

/// The fault whose window holds `t` (seconds), if any.
pub fn fault_at(t: f64, faults: &[FaultRecord]) -> Option<FaultKind> {
    faults
        .iter()
        .find(|f| f.start_s <= t && t <= f.end_s)
        .map(|f| f.kind)
}

/// Latency figures: quiet, faults, by fault kind, for samples of `kind` sent after `warmup`.
pub fn split_latency(
    samples: &[Sample],
    kind: SampleKind,
    warmup: f64,
    faults: &[FaultRecord],
) -> (
    LatencySummary,
    LatencySummary,
    BTreeMap<String, LatencySummary>,
) {
    let (mut quiet, mut during) = (Vec::new(), Vec::new());
    let mut by: BTreeMap<FaultKind, Vec<Sample>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.kind == kind) {
        let t = s.at.as_secs_f64();
        if t < warmup {
            continue;
        }
        match fault_at(t, faults) {
            Some(k) => {
                during.push(*s);
                by.entry(k).or_default().push(*s);
            }
            None => quiet.push(*s),
        }
    }
    let by = by
        .into_iter()
        .map(|(k, v)| (k.as_str().to_owned(), summarize(&v)))
        .collect();
    (summarize(&quiet), summarize(&during), by)
}

/// One RSS sample.
#[derive(Clone, Copy, Debug)]
pub struct RssPoint {
    /// Seconds from the start.
    pub t_s: f64,
    /// Resident set (MB).
    pub mb: f64,
    /// The router's life.
    pub life: u32,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// A restarted router grows back to its working set in its first seconds; its samples
/// count for the growth ratio from this long after its start.
pub const LIFE_SETTLE_S: f64 = 20.0;

/// RSS figures over the samples after `warmup` (and, for a restarted router, at least
/// [`LIFE_SETTLE_S`] into its life); the growth ratio is the median of the last tenth over
/// the median of the first tenth (at least 3 samples each when there are).
pub fn rss_summary(points: &[RssPoint], warmup: f64) -> (RssSummary, f64) {
    let mut born: BTreeMap<u32, f64> = BTreeMap::new();
    for p in points {
        born.entry(p.life).or_insert(p.t_s);
    }
    let settled = |p: &RssPoint| {
        p.life == 0
            || born
                .get(&p.life)
                .is_some_and(|b| p.t_s - b >= LIFE_SETTLE_S)
    };
    let after: Vec<RssPoint> = points
        .iter()
        .copied()
        .filter(|p| p.t_s >= warmup && p.mb.is_finite() && p.mb > 0.0 && settled(p))
        .collect();
    let mut lives: BTreeMap<u32, LifeRss> = BTreeMap::new();
    for p in points.iter().filter(|p| p.mb.is_finite() && p.mb > 0.0) {
        let l = lives.entry(p.life).or_insert(LifeRss {
            life: p.life,
            from_s: p.t_s,
            to_s: p.t_s,
            first_mb: p.mb,
            last_mb: p.mb,
            max_mb: p.mb,
        });
        l.to_s = p.t_s;
        l.last_mb = p.mb;
        l.max_mb = l.max_mb.max(p.mb);
    }
    let k = (after.len() / 10).max(3).min(after.len());
    let early = median(after.iter().take(k).map(|p| p.mb).collect());
    let late = median(after.iter().rev().take(k).map(|p| p.mb).collect());
    let ratio = if early > 0.0 { late / early } else { 0.0 };
    let summary = RssSummary {
        early_mb: finite(early),
        late_mb: finite(late),
        max_mb: after.iter().map(|p| p.mb).fold(0.0, f64::max),
        samples: after.len(),
        lives: lives.into_values().collect(),
    };
    (summary, finite(ratio))
}

/// The time series: one point per `step` seconds up to `end`.
pub fn series(
    samples: &[Sample],
    rss: &[RssPoint],
    faults: &[FaultRecord],
    step: f64,
    end: f64,
) -> Vec<SeriesPoint> {
    let step = if step.is_finite() && step > 0.0 {
        step
    } else {
        1.0
    };
    let n = (end / step).ceil().max(1.0) as usize;
    let mut buckets: Vec<Vec<&Sample>> = vec![Vec::new(); n];
    for s in samples.iter().filter(|s| s.kind == SampleKind::Route) {
        let i = (s.at.as_secs_f64() / step) as usize;
        if let Some(b) = buckets.get_mut(i.min(n - 1)) {
            b.push(s);
        }
    }
    buckets
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let (from, to) = (i as f64 * step, (i + 1) as f64 * step);
            let sum = summarize(b.iter().copied());
            let near = rss
                .iter()
                .filter(|p| p.t_s > from - step && p.t_s <= to)
                .min_by(|a, b| (a.t_s - to).abs().total_cmp(&(b.t_s - to).abs()))
                .map(|p| p.mb);
            SeriesPoint {
                t_s: to,
                rss_mb: near,
                route_p99_ms: (sum.requests > sum.errors).then_some(sum.p99_ms),
                route_requests: sum.requests,
                route_errors: sum.errors,
                fault: faults.iter().any(|f| f.start_s < to && f.end_s > from),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: u64, lat_ms: u64, status: u16) -> Sample {
        Sample {
            at: Duration::from_millis(at_ms),
            latency: Duration::from_millis(lat_ms),
            kind: SampleKind::Route,
            status,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
        assert_eq!(percentile(&[7.0], 0.999), 7.0);
    }

    #[test]
    fn samples_split_by_fault_windows() {
        let faults = [FaultRecord {
            kind: FaultKind::RouterRestart,
            worker: None,
            start_s: 2.0,
            end_s: 3.0,
            detail: String::new(),
        }];
        let s = [
            sample(500, 50, 200), // warm-up
            sample(1500, 1, 200), // quiet
            sample(2500, 9, 200), // fault
            sample(2600, 1, 0),   // fault, failed
            sample(3500, 2, 200), // quiet
        ];
        let (quiet, during, by) = split_latency(&s, SampleKind::Route, 1.0, &faults);
        assert_eq!((quiet.requests, quiet.errors, quiet.max_ms), (2, 0, 2.0));
        assert_eq!((during.requests, during.errors, during.p99_ms), (2, 1, 9.0));
        assert_eq!(by["router_restart"].requests, 2);
        let points = series(&s, &[], &faults, 1.0, 4.0);
        assert_eq!(points.len(), 4);
        assert!(points[2].fault && !points[1].fault);
        assert_eq!(points[2].route_errors, 1);
    }

    #[test]
    fn rss_growth_compares_late_and_early_medians() {
        // Warm-up to 10 s; life 1 starts at 20 s and settles at 40 s.
        let mb = |i: u32| match i {
            0..10 => 10.0,
            10..20 => 100.0,
            20..40 => 50.0,
            _ => 104.0,
        };
        let pts: Vec<RssPoint> = (0..50)
            .map(|i| RssPoint {
                t_s: f64::from(i),
                mb: mb(i),
                life: u32::from(i >= 20),
            })
            .collect();
        let (s, ratio) = rss_summary(&pts, 10.0);
        assert_eq!(s.samples, 20);
        assert!((ratio - 1.04).abs() < 1e-9, "{ratio}");
        assert_eq!(s.lives.len(), 2);
        assert_eq!(rss_summary(&[], 0.0).1, 0.0);
    }
}
