//! `kvengine bench soak`: the soak and chaos harness (issue 12 part 6).
//!
//! The router runs as a child process (`kvengine serve --state-dir DIR
//! --snapshot-interval-s 2`), in front of simulated vLLM workers run in this process
//! ([`worker`]: the same [`crate::workers`] `kvengine sim` runs, a `sim` engine with a small
//! paged KV cache that evicts, vLLM-format ZMQ events with a replay socket, an OpenAI HTTP
//! server, broken through the workers' fault hooks), registered with `--worker
//! id=N,url=...,zmq=...,replay=...`. Open-loop traffic ([`traffic`]) goes through the front
//! door (`/v1/completions`, which churns the workers' caches) and probes `/v1/route`, while
//! faults ([`faults`]) are injected one at a time: worker processes restarted, batches
//! dropped on the live stream, bursts that outpace the router's subscriber, workers' HTTP
//! failing, the router killed with SIGKILL and restarted from its snapshot. After every
//! cycle of faults, and at the end, a checkpoint ([`check`]) compares the router's index
//! with every worker's actual cache. The router's resident set is read from its
//! `/metrics` every few seconds. Figures: [`report::SoakReport`] (JSON) and [`plot`] (SVG).
//!
//! # Definitions
//! * **Acknowledged**: a batch of the worker's live process that the router took: it
//!   received it, on the live stream or by a replay (a withheld batch, i.e. dropped on the
//!   live stream, is taken by the replay of its gap; batches published while the router
//!   was down, by the replay after its snapshot). Every batch stays in the publisher's
//!   replay buffer (16,384 batches, far more than any fault here outruns), so under
//!   vLLM's protocol the router can always take it. Batches of a worker process that died
//!   do not count (the worker's cache died with them).
//! * **Acknowledged lost** (`acknowledged_lost`): at a converged checkpoint, a block a
//!   worker's engine caches that the router cannot match for that worker, when every
//!   block of its chain came from acknowledged batches. Summed over checkpoints.
//! * **Unacknowledged lost** (`unacknowledged_lost`): the same, for a block whose chain
//!   came from a batch the router never received: after a worker restart, the batches its
//!   new process published before the router's subscription reconnected (the router
//!   detects the restart at the first number it sees, clears the worker, and does not
//!   replay the earlier ones, though the replay buffer holds them; see [`check`]).
//! * **Stale** (`stale_entries`): at a converged checkpoint, a block the router says a
//!   worker holds that the worker's engine does not cache. Summed over checkpoints.
//! * **Quiet / fault windows**: a fault's window runs from its injection until the router
//!   has recovered (the worker is back and healthy, the restarted router serves) plus a
//!   settle time; latency samples sent in one count as `faults`, the rest after the
//!   warm-up as `quiet`.
//! * **RSS growth** (`rss_growth_ratio`): the median of the last tenth of the resident-set
//!   samples after the warm-up over the median of the first tenth; samples of every life of
//!   the router count (a restarted router is compared with the one it replaced), each
//!   restarted life's from 20 s after its start (it first grows back to its working set).
//!
//! # Invariants
//! 1. Faults never overlap, and none runs during a checkpoint; checkpoints pause the
//!    traffic and compare only once nothing can change.
//! 2. Everything started is stopped when the run ends, however it ends: the router child
//!    is killed (its `Drop`), the workers' tasks aborted, the work directory removed
//!    unless kept (`--keep-work-dir`) or the run found lost or stale entries.
//! 3. The report is written whatever the figures are; [`args::cli`] fails after writing
//!    it when entries were lost or stale.
//!
//! # Concurrency
//! One tokio runtime (2 threads) runs the workers, the traffic, the `/metrics` sampler and
//! the sequential fault/checkpoint loop; the router is another process.

pub mod args;
pub mod check;
pub mod faults;
pub mod model;
pub mod plot;
pub mod report;
pub mod router;
pub mod traffic;
pub mod worker;

use anyhow::{Context, Result, bail};
use faults::FaultKind;
use hyper::Method;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use report::{
    Checkpoint, FaultRecord, Goals, LifeCounters, RouterTotals, RssPoint, SoakReport, rss_summary,
    series, split_latency,
};
use router::{Http, RouterProcess, RouterSpec, metric_sum};
use sim::engine::EngineConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};
use traffic::{SampleKind, Traffic};
use worker::{HttpMode, SoakWorker, WorkerConfig};

/// The router's snapshot interval.
pub const SNAPSHOT_INTERVAL_S: u64 = 2;
/// A restarted worker stays down this long.
const WORKER_DOWN: Duration = Duration::from_secs(1);
/// A worker's HTTP fails this long.
const HTTP_FAILURE: Duration = Duration::from_secs(3);
/// Longest wait for a recovery the harness waits for.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(15);

/// How a soak runs.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// The `kvengine` binary the router runs as.
    pub router_exe: PathBuf,
    /// Wall time of the whole run (warm-up, faults and checkpoints).
    pub duration: Duration,
    /// Simulated workers.
    pub workers: usize,
    /// The router's `--cores`.
    pub cores: u16,
    /// Seed of the workload and the fault choices.
    pub seed: u64,
    /// Completions per second through the front door.
    pub rate: f64,
    /// Route probes per second.
    pub route_rate: f64,
    /// Each worker's engine.
    pub engine: EngineConfig,
    /// The workers' simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// The fault kinds to inject, cycled in [`FaultKind::ALL`]'s order.
    pub faults: Vec<FaultKind>,
    /// Quiet time before each fault (default: a 25th of the duration, 2-20 s).
    pub quiet: Option<Duration>,
    /// Warm-up, excluded from the latency and RSS figures (default: 15% of the duration,
    /// 5-120 s).
    pub warmup: Option<Duration>,
    /// Batches of a `slow_consumer` burst.
    pub burst_batches: u32,
    /// Batches each publisher keeps for replay.
    pub replay_buffer: usize,
    /// Where the router's state and logs go (default: a new directory under the temp dir).
    pub work_dir: Option<PathBuf>,
    /// Keep the work directory.
    pub keep_work_dir: bool,
    /// Print progress to stderr.
    pub progress: bool,
}

impl Default for SoakConfig {
    fn default() -> Self {
        Self {
            router_exe: PathBuf::from("kvengine"),
            duration: Duration::from_secs(60),
            workers: 4,
            cores: 2,
            seed: 0,
            rate: 20.0,
            route_rate: 50.0,
            engine: EngineConfig {
                kv_blocks: 1024,
                ..EngineConfig::default()
            },
            speedup: 20.0,
            faults: FaultKind::ALL.to_vec(),
            quiet: None,
            warmup: None,
            burst_batches: 5000,
            replay_buffer: 16_384,
            work_dir: None,
            keep_work_dir: false,
            progress: true,
        }
    }
}

impl SoakConfig {
    /// Rejects values outside their ranges.
    pub fn validate(&self) -> Result<()> {
        if self.workers < 2 {
            bail!("the soak needs at least 2 workers (the front door retries on another)");
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            bail!("speedup must be a finite number above 0");
        }
        for (name, r) in [("rate", self.rate), ("route rate", self.route_rate)] {
            if !(r.is_finite() && r > 0.0) {
                bail!("{name} must be a finite number above 0");
            }
        }
        if self.duration < Duration::from_secs(10) {
            bail!("the duration must be at least 10 s");
        }
        if (self.replay_buffer as u64) < u64::from(self.burst_batches) * 2 {
            bail!("the replay buffer must hold at least two bursts");
        }
        self.engine.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    fn warmup(&self) -> Duration {
        self.warmup.unwrap_or_else(|| {
            self.duration
                .mul_f64(0.15)
                .clamp(Duration::from_secs(5), Duration::from_secs(120))
        })
    }

    fn quiet(&self) -> Duration {
        self.quiet.unwrap_or_else(|| {
            (self.duration / 25).clamp(Duration::from_secs(2), Duration::from_secs(20))
        })
    }

    fn sample_every(&self) -> Duration {
        (self.duration / 300).clamp(Duration::from_secs(1), Duration::from_secs(10))
    }
}

/// Runs a soak on a runtime of its own. See the module docs.
pub fn run(cfg: &SoakConfig) -> Result<SoakReport> {
    cfg.validate()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvengine-soak")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let work = match &cfg.work_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "kvengine-soak-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis())
        )),
    };
    let (state, logs) = (work.join("state"), work.join("logs"));
    // A reused work directory must not hand the first router an old snapshot, nor the
    // checkpoints old logs.
    for d in [&state, &logs] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("clearing {}", d.display()))?;
        }
    }
    std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let result = rt.block_on(run_async(cfg, state, logs));
    drop(rt);
    let keep = cfg.keep_work_dir
        || match &result {
            Ok(r) => r.acknowledged_lost > 0 || r.stale_entries > 0,
            Err(_) => true,
        };
    match keep {
        true => eprintln!(
            "kvengine soak: router state and logs kept in {}",
            work.display()
        ),
        false => {
            let _ = std::fs::remove_dir_all(&work);
        }
    }
    let mut report = result?;
    if keep {
        report
            .notes
            .push(format!("router state and logs kept in {}", work.display()));
    }
    Ok(report)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the `/metrics` sampler reads: the router's address and life.
type Current = Arc<RwLock<(String, u32)>>;

struct Harness<'a> {
    cfg: &'a SoakConfig,
    start: Instant,
    workers: Vec<SoakWorker>,
    spec: RouterSpec,
    router: RouterProcess,
    http: Http,
    traffic: Arc<Traffic>,
    current: Current,
    lives: Arc<Mutex<BTreeMap<u32, LifeCounters>>>,
    rss: Arc<Mutex<Vec<RssPoint>>>,
    faults: Vec<FaultRecord>,
    counts: BTreeMap<FaultKind, u64>,
    checkpoints: Vec<Checkpoint>,
    restore: Vec<String>,
    rng: SmallRng,
}

async fn scrape(
    http: &Http,
    current: &Current,
    start: Instant,
    lives: &Mutex<BTreeMap<u32, LifeCounters>>,
    rss: &Mutex<Vec<RssPoint>>,
) -> Option<String> {
    let (addr, life) = current
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let url = format!("http://{addr}/metrics");
    let Ok((200, body)) = http
        .call(Method::GET, &url, None, Duration::from_secs(3))
        .await
    else {
        return None;
    };
    let page = String::from_utf8_lossy(&body).into_owned();
    if let Some(bytes) = metric_sum(&page, "process_resident_memory_bytes") {
        lock(rss).push(RssPoint {
            t_s: start.elapsed().as_secs_f64(),
            mb: bytes / 1e6,
            life,
        });
    }
    lock(lives).insert(life, LifeCounters::parse(&page));
    Some(page)
}

impl Harness<'_> {
    fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn say(&self, what: &str) {
        if self.cfg.progress {
            eprintln!("kvengine soak: {:7.1} s  {what}", self.now_s());
        }
    }

    async fn scrape(&self) -> Option<String> {
        scrape(
            &self.http,
            &self.current,
            self.start,
            &self.lives,
            &self.rss,
        )
        .await
    }

    /// `GET /v1/workers` as JSON.
    async fn router_workers(&self) -> Option<Vec<serde_json::Value>> {
        let url = format!("http://{}/v1/workers", self.router.addr);
        let (status, body) = self
            .http
            .call(Method::GET, &url, None, Duration::from_secs(3))
            .await
            .ok()?;
        if status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        v["workers"].as_array().cloned()
    }

    /// Waits until the router has worker `id` (every worker: `None`) healthy and
    /// subscribed; how long it took, or `None` past the timeout.
    async fn wait_back(&self, id: Option<u64>) -> Option<Duration> {
        let began = Instant::now();
        while began.elapsed() < RECOVERY_TIMEOUT {
            if let Some(ws) = self.router_workers().await {
                let back =
                    |w: &serde_json::Value| w["healthy"] == true && w["stream"] == "subscribed";
                let ok = match id {
                    Some(id) => ws
                        .iter()
                        .any(|w| w["worker_id"].as_u64() == Some(id) && back(w)),
                    None => ws.len() == self.workers.len() && ws.iter().all(back),
                };
                if ok {
                    return Some(began.elapsed());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    fn target(&self, kind: FaultKind, occurrence: u64) -> usize {
        ((occurrence + kind as u64) % self.workers.len() as u64) as usize
    }

    async fn inject(&mut self, kind: FaultKind) -> Result<()> {
        let occurrence = *self.counts.entry(kind).or_default();
        let start_s = self.now_s();
        let i = self.target(kind, occurrence);
        let (worker, detail, settle) = match kind {
            FaultKind::PublisherRestart => self.restart_worker(i).await?,
            FaultKind::DroppedBatches => self.drop_batches(i).await?,
            FaultKind::SlowConsumer => self.burst(i).await?,
            FaultKind::WorkerHttpFailure => self.http_failure(i, occurrence).await?,
            FaultKind::RouterRestart => self.restart_router().await?,
        };
        tokio::time::sleep(settle).await;
        *self.counts.entry(kind).or_default() += 1;
        self.say(&format!("{kind}: {detail}"));
        self.faults.push(FaultRecord {
            kind,
            worker,
            start_s,
            end_s: self.now_s(),
            detail,
        });
        Ok(())
    }

    async fn restart_worker(&self, i: usize) -> Result<(Option<u64>, String, Duration)> {
        let w = &self.workers[i];
        w.restart(WORKER_DOWN).await?;
        let back = self.wait_back(Some(w.id())).await;
        let detail = format!(
            "worker process down {:.1} s, back on the same ports with an empty cache, \
             numbering from 0; router had it healthy and subscribed again {}",
            WORKER_DOWN.as_secs_f64(),
            back.map_or("never (timeout)".into(), |d| format!(
                "{:.2} s later",
                d.as_secs_f64()
            ))
        );
        Ok((Some(w.id()), detail, Duration::from_secs(1)))
    }

    async fn drop_batches(&mut self, i: usize) -> Result<(Option<u64>, String, Duration)> {
        let n = self.rng.random_range(1..=8u64);
        let w = &self.workers[i];
        let c = w.counters();
        let before = c.withheld.load(Relaxed);
        w.withhold(n).await?;
        let began = Instant::now();
        while c.withheld.load(Relaxed) < before + n && began.elapsed() < RECOVERY_TIMEOUT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let withheld = c.withheld.load(Relaxed) - before;
        // The gap shows at the next batch sent live.
        let sent = c.published.load(Relaxed);
        while c.published.load(Relaxed) == sent && began.elapsed() < RECOVERY_TIMEOUT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let detail = format!(
            "{withheld} of {n} engine batches numbered and kept for replay but not sent \
             (a seq gap, as a ZMQ high-water-mark overflow drops them)"
        );
        Ok((Some(w.id()), detail, Duration::from_secs(1)))
    }

    async fn burst(&self, i: usize) -> Result<(Option<u64>, String, Duration)> {
        let w = &self.workers[i];
        let took = w.burst(self.cfg.burst_batches).await?;
        let detail = format!(
            "{} synthetic batches (an 8-block chain stored and the previous one removed in \
             each) published in {:.0} ms",
            self.cfg.burst_batches + 1,
            took.as_secs_f64() * 1000.0
        );
        Ok((Some(w.id()), detail, Duration::from_millis(1500)))
    }

    async fn http_failure(
        &self,
        i: usize,
        occurrence: u64,
    ) -> Result<(Option<u64>, String, Duration)> {
        let w = &self.workers[i];
        let mode = match occurrence % 2 {
            0 => HttpMode::Fail500,
            _ => HttpMode::Refuse,
        };
        let failed_before = w.counters().failed.load(Relaxed);
        w.set_http(mode);
        tokio::time::sleep(HTTP_FAILURE).await;
        w.set_http(HttpMode::Serve);
        let back = self.wait_back(Some(w.id())).await;
        let what = match mode {
            HttpMode::Fail500 => "answered 500 to completions and health checks",
            _ => "refused connections (listener and connections closed)",
        };
        let detail = format!(
            "{what} for {:.0} s ({} completions failed there); healthy again {}",
            HTTP_FAILURE.as_secs_f64(),
            w.counters().failed.load(Relaxed) - failed_before,
            back.map_or("never (timeout)".into(), |d| format!(
                "{:.2} s after it recovered",
                d.as_secs_f64()
            ))
        );
        Ok((Some(w.id()), detail, Duration::from_secs(1)))
    }

    async fn restart_router(&mut self) -> Result<(Option<u64>, String, Duration)> {
        // The dying life's counters, as late as possible.
        self.scrape().await;
        let killed = Instant::now();
        self.router.kill9();
        let life = self.router.generation + 1;
        let spec = self.spec.clone();
        let next = tokio::task::spawn_blocking(move || RouterProcess::spawn(&spec, life))
            .await
            .context("the router's start task")??;
        self.traffic.set_addr(next.addr.clone());
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (next.addr.clone(), life);
        self.router = next;
        let serving = killed.elapsed();
        let back = self.wait_back(None).await;
        let page = self.scrape().await.unwrap_or_default();
        let restored = metric_sum(&page, "kvengine_restored_workers").unwrap_or(0.0);
        let cleared = metric_sum(&page, "kvengine_restore_cleared_workers").unwrap_or(0.0);
        let line = self
            .router
            .restore_line()
            .unwrap_or("(no restore line)")
            .trim()
            .to_owned();
        self.restore.push(format!(
            "life {life}: serving {:.2} s after SIGKILL; {line}",
            serving.as_secs_f64()
        ));
        let detail = format!(
            "SIGKILL; serving again {:.2} s later, every worker subscribed {}; restored \
             workers {restored}, cleared {cleared}",
            serving.as_secs_f64(),
            back.map_or("never (timeout)".into(), |d| format!(
                "{:.2} s after that",
                d.as_secs_f64()
            ))
        );
        Ok((None, detail, Duration::from_secs(2)))
    }

    async fn checkpoint(&mut self) -> Result<()> {
        let ctx = check::Ctx {
            workers: &self.workers,
            http: &self.http,
            addr: &self.router.addr,
            block_size: self.cfg.engine.block_size,
            traffic: &self.traffic,
            start: self.start,
            log_dir: &self.spec.log_dir,
        };
        let c = check::checkpoint(&ctx, self.checkpoints.len()).await?;
        self.say(&format!(
            "checkpoint {}: {} blocks cached, router directories {}, {} chains probed; \
             stale {}, lost {} (+{} never received) ({} ms)",
            c.index,
            c.reference_blocks,
            c.router_directory_entries,
            c.chains_probed,
            c.stale,
            c.lost,
            c.lost_unreceived,
            c.took_ms
        ));
        self.checkpoints.push(c);
        Ok(())
    }
}

async fn run_async(cfg: &SoakConfig, state: PathBuf, logs: PathBuf) -> Result<SoakReport> {
    let start = Instant::now();
    let mut workers = Vec::with_capacity(cfg.workers);
    for i in 0..cfg.workers {
        workers.push(
            SoakWorker::start(WorkerConfig {
                id: i as u64 + 1,
                engine: cfg.engine.clone(),
                speedup: cfg.speedup,
                replay_buffer: cfg.replay_buffer,
                removed_sample: 64,
                seed: cfg.seed.wrapping_add(i as u64),
            })
            .await?,
        );
    }
    let spec = RouterSpec {
        exe: cfg.router_exe.clone(),
        state_dir: state,
        log_dir: logs,
        cores: cfg.cores,
        snapshot_interval_s: SNAPSHOT_INTERVAL_S,
        health_interval_s: 0.5,
        health_failures: 2,
        workers: workers.iter().map(SoakWorker::worker_flag).collect(),
        start_timeout: Duration::from_secs(60),
    };
    let first = {
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || RouterProcess::spawn(&spec, 0))
            .await
            .context("the router's start task")??
    };
    let http = Http::new();
    let traffic = Arc::new(Traffic::new(
        start,
        first.addr.clone(),
        traffic::chat_config(cfg.seed),
    )?);
    let current: Current = Arc::new(RwLock::new((first.addr.clone(), 0)));
    let mut h = Harness {
        cfg,
        start,
        workers,
        spec,
        router: first,
        http,
        traffic,
        current,
        lives: Arc::new(Mutex::new(BTreeMap::new())),
        rss: Arc::new(Mutex::new(Vec::new())),
        faults: Vec::new(),
        counts: BTreeMap::new(),
        checkpoints: Vec::new(),
        restore: Vec::new(),
        rng: SmallRng::seed_from_u64(cfg.seed ^ 0xfa17),
    };
    if h.wait_back(None).await.is_none() {
        bail!("the router never had every worker subscribed and healthy");
    }
    h.say(&format!(
        "router up at {} (pid {}), {} workers subscribed",
        h.router.addr,
        h.router.pid(),
        h.workers.len()
    ));
    let generators = [
        tokio::spawn(traffic::generate(
            h.traffic.clone(),
            h.http.clone(),
            SampleKind::Completion,
            cfg.rate,
        )),
        tokio::spawn(traffic::generate(
            h.traffic.clone(),
            h.http.clone(),
            SampleKind::Route,
            cfg.route_rate,
        )),
    ];
    let sampler = {
        let (http, current, lives, rss) = (
            h.http.clone(),
            h.current.clone(),
            h.lives.clone(),
            h.rss.clone(),
        );
        let every = cfg.sample_every();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                scrape(&http, &current, start, &lives, &rss).await;
            }
        })
    };

    let warmup = cfg.warmup();
    let quiet = cfg.quiet();
    let deadline = start + cfg.duration;
    tokio::time::sleep_until((start + warmup).into()).await;
    h.say("warm-up over");
    let kinds: Vec<FaultKind> = FaultKind::ALL
        .into_iter()
        .filter(|k| cfg.faults.contains(k))
        .collect();
    // A checkpoint after every cycle of faults (after every 5 quiet spells without any).
    let cycle = if kinds.is_empty() { 5 } else { kinds.len() };
    // A fault and its recovery take a few seconds; a checkpoint a few more.
    let budget = Duration::from_secs(8);
    let mut step = 0usize;
    let mut checked_last = false;
    while Instant::now() + quiet + budget < deadline {
        tokio::time::sleep(quiet).await;
        if let Some(&kind) = kinds.get(step % cycle) {
            h.inject(kind).await?;
        }
        step += 1;
        checked_last = false;
        if step.is_multiple_of(cycle) && Instant::now() + budget < deadline {
            h.checkpoint().await?;
            checked_last = true;
        }
    }
    // Quiet traffic up to about the deadline, then the last checkpoint.
    let last = deadline
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(deadline);
    if !checked_last || last > Instant::now() {
        tokio::time::sleep_until(last.into()).await;
        h.checkpoint().await?;
    }

    // Wind down: no new requests, the last ones answered, a last scrape.
    h.traffic.stop();
    for g in generators {
        let _ = g.await;
    }
    let began = Instant::now();
    while h.traffic.in_flight() > 0 && began.elapsed() < Duration::from_secs(35) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sampler.abort();
    h.scrape().await;
    let end_s = h.now_s();
    h.router.kill9();
    for w in &h.workers {
        w.stop();
    }
    Ok(build_report(&h, warmup.as_secs_f64(), end_s))
}

fn build_report(h: &Harness<'_>, warmup: f64, end_s: f64) -> SoakReport {
    let cfg = h.cfg;
    let samples = h.traffic.samples();
    let (route_quiet, route_faults, route_by_fault) =
        split_latency(&samples, SampleKind::Route, warmup, &h.faults);
    let (completions_quiet, completions_faults, _) =
        split_latency(&samples, SampleKind::Completion, warmup, &h.faults);
    let rss_points = lock(&h.rss).clone();
    let (rss, rss_growth_ratio) = rss_summary(&rss_points, warmup);
    let acknowledged_lost = h.checkpoints.iter().map(|c| c.lost).sum();
    let stale_entries = h.checkpoints.iter().map(|c| c.stale).sum();
    let unacknowledged_lost = h.checkpoints.iter().map(|c| c.lost_unreceived).sum();
    let faults_injected: BTreeMap<String, u64> = cfg
        .faults
        .iter()
        .map(|k| (k.as_str().to_owned(), h.counts.get(k).copied().unwrap_or(0)))
        .collect();
    let ratio = if route_quiet.p99_ms > 0.0 {
        route_faults.p99_ms / route_quiet.p99_ms
    } else {
        0.0
    };
    let sum = |f: fn(&worker::Counters) -> u64| -> u64 {
        h.workers.iter().map(|w| f(w.counters())).sum()
    };
    let goals = Goals {
        no_acknowledged_loss: acknowledged_lost == 0,
        no_stale_entries: stale_entries == 0,
        every_fault_injected: faults_injected.values().all(|&n| n > 0),
        rss_flat: rss_growth_ratio > 0.0 && rss_growth_ratio <= 1.05,
        route_p99_within_2x: route_faults.requests == 0 || ratio <= 2.0,
    };
    let series = series(
        &samples,
        &rss_points,
        &h.faults,
        cfg.sample_every().as_secs_f64(),
        end_s,
    );
    let mut notes = vec![
        "acknowledged_lost / stale_entries: blocks summed over checkpoints, each taken \
         after traffic paused, workers idle and heartbeats published (lab/src/soak/mod.rs)"
            .to_owned(),
        "dropped_batches stands in for ZMQ high-water-mark overflow (batches numbered and \
         buffered for replay, never sent); slow_consumer is a burst that outpaces the \
         router's subscriber, the router is never paused"
            .to_owned(),
        "route latency: client-side POST /v1/route; the harness (workers, clients) shares \
         the machine with the router"
            .to_owned(),
    ];
    if h.checkpoints.iter().any(|c| c.model_mismatches > 0) {
        notes.push("harness self-check failed: a worker's model differs from its engine".into());
    }
    SoakReport {
        acknowledged_lost,
        stale_entries,
        unacknowledged_lost,
        faults_injected,
        rss_growth_ratio,
        route_p99_ms_quiet: route_quiet.p99_ms,
        route_p99_ms_faults: route_faults.p99_ms,
        route_p99_ratio: ratio,
        goals,
        duration_s: end_s,
        warmup_s: warmup,
        workers: cfg.workers,
        cores: cfg.cores,
        seed: cfg.seed,
        router: RouterTotals::of(&lock(&h.lives)),
        batches_published: sum(|c| c.published.load(Relaxed)),
        batches_withheld: sum(|c| c.withheld.load(Relaxed)),
        synthetic_batches: sum(|c| c.extra.load(Relaxed)),
        heartbeats: sum(|c| c.heartbeats.load(Relaxed)),
        worker_restarts: sum(|c| c.restarts.load(Relaxed)),
        router_restarts: h.router.generation,
        router_restore: h.restore.clone(),
        route_quiet,
        route_faults,
        route_by_fault,
        completions_quiet,
        completions_faults,
        traffic_shed: h.traffic.shed.load(Relaxed),
        checkpoints: h.checkpoints.clone(),
        faults: h.faults.clone(),
        rss,
        series,
        notes,
    }
}
