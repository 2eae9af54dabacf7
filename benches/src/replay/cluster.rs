//! The router and its simulated workers in one process, on the current tokio runtime.
//!
//! [`Cluster::start`] starts the engine and hub ([`start_engine`], unpinned), the HTTP
//! edge merged with the OpenAI proxy on `127.0.0.1:0`, and `workers` simulated vLLM
//! workers ([`spawn_mixed_cluster`]); each worker is registered with the hub under id
//! `i + 1` with its HTTP URL, ZMQ publisher and replay endpoints, and subscribed to
//! ([`spawn_subscriber`]). In [`RunMode::KvNoEvents`] the hub predicts the caches from its
//! own decisions ([`Hub::without_kv_events`]) and nothing is subscribed.
//!
//! A disaggregated cluster ([`ClusterConfig::disaggregated`]) starts `P` prefill workers
//! (ids `1..=P`) then `D` decode workers, each registered with its role (and, for SGLang's
//! bootstrap, its HTTP port); the OpenAI proxy disaggregates with the spec's protocol and
//! split, and the mode applies to the choice in both pools.
//!
//! # Invariants
//! 1. [`Cluster::shutdown`] stops everything it started, in order: the HTTP edge (open
//!    connections finish), the subscriptions, the workers, the cached-blocks refresher;
//!    then the last hub reference is dropped and the engine's threads are joined.
//! 2. A failed start stops what it had started.

use super::disagg::DisaggSpec;
use super::{ReplayConfig, RunMode};
use anyhow::{Context, Result, anyhow, bail};
use engine::WorkerId;
use engine::approx::ApproxConfig;
use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use sim::engine::EngineConfig;
use sim::server::driver::Snapshot;
use sim::server::{SimRole, SimWorkerConfig, SimWorkerHandle, spawn_mixed_cluster};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use transport::http::{HttpConfig, router, serve_http};
use transport::hub::{Hub, HubConfig, start_engine};
use transport::openai::proxy::{ProxyConfig, openai_router};
use transport::zmq::{SubscriberConfig, ZmqSource, spawn_subscriber};

/// How often the hub's per-worker cached-block totals (its tie-breaker) are refreshed.
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// What one cluster is started with.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Simulated workers.
    pub workers: usize,
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
    /// Prefill and decode workers instead of `workers` aggregated ones (`workers` is then
    /// `P + D`).
    pub disagg: Option<DisaggSpec>,
}

impl ClusterConfig {
    /// The cluster of `mode` in a replay configured by `cfg`.
    pub fn of(cfg: &ReplayConfig, mode: RunMode) -> Self {
        Self {
            workers: cfg.workers,
            mode,
            engine: cfg.engine.clone(),
            speedup: cfg.speedup,
            cores: cfg.cores,
            seed: cfg.seed,
            overlap_weight: cfg.overlap_weight,
            disagg: None,
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

/// A running cluster. Stop it with [`Cluster::shutdown`].
#[derive(Debug)]
pub struct Cluster {
    hub: Arc<Hub>,
    engine: Runtime,
    addr: SocketAddr,
    workers: Vec<SimWorkerHandle>,
    ids: Vec<WorkerId>,
    subscribers: Vec<JoinHandle<()>>,
    refresher: JoinHandle<()>,
    stop_http: oneshot::Sender<()>,
    http: JoinHandle<Result<(), transport::TransportError>>,
}

impl Cluster {
    /// Starts a cluster on the current tokio runtime.
    pub async fn start(cfg: &ClusterConfig) -> Result<Self> {
        if cfg.workers == 0 {
            bail!("a cluster needs at least one worker");
        }
        if let Some(d) = &cfg.disagg {
            d.validate()
                .map_err(|e| anyhow!("disaggregation {d}: {e}"))?;
            if d.workers() != cfg.workers {
                bail!(
                    "disaggregation {d} needs {} workers, not {}",
                    d.workers(),
                    cfg.workers
                );
            }
        }
        let scheduler = SchedulerConfig {
            block_size: cfg.engine.block_size,
            mode: cfg.mode.route_mode(),
            seed: cfg.seed,
            overlap_weight: cfg.overlap_weight,
            ..SchedulerConfig::default()
        };
        let runtime_config = RuntimeConfig {
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 2,
            ..RuntimeConfig::default()
        };
        let (hub, engine) = start_engine(
            HubConfig { scheduler },
            Sharding::adaptive(cfg.cores)?,
            runtime_config,
        )
        .context("cannot start the router's engine")?;
        let hub = if cfg.mode.kv_events() {
            Ok(hub)
        } else {
            hub.without_kv_events(ApproxConfig::default())
        };
        let hub = match hub {
            Ok(h) => Arc::new(h),
            Err(e) => {
                join_engine(engine).await;
                return Err(e).context("cannot set up the hub without KV events");
            }
        };
        match Self::start_rest(cfg, hub.clone()).await {
            Ok((addr, workers, ids, subscribers, stop_http, http)) => {
                let refresher = tokio::spawn(refresh_loop(hub.clone()));
                Ok(Self {
                    hub,
                    engine,
                    addr,
                    workers,
                    ids,
                    subscribers,
                    refresher,
                    stop_http,
                    http,
                })
            }
            Err(e) => {
                drop(hub);
                join_engine(engine).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    async fn start_rest(
        cfg: &ClusterConfig,
        hub: Arc<Hub>,
    ) -> Result<(
        SocketAddr,
        Vec<SimWorkerHandle>,
        Vec<WorkerId>,
        Vec<JoinHandle<()>>,
        oneshot::Sender<()>,
        JoinHandle<Result<(), transport::TransportError>>,
    )> {
        let base = SimWorkerConfig {
            engine: cfg.engine.clone(),
            speedup: cfg.speedup,
            ..SimWorkerConfig::default()
        };
        let workers = spawn_mixed_cluster(&cfg.roles(), base, None)
            .await
            .context("cannot start the simulated workers")?;
        let mut ids = Vec::with_capacity(workers.len());
        let mut subscribers = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let id = WorkerId(i as u64 + 1);
            ids.push(id);
            let registered = hub.register(w.registration(id));
            if let Err(e) = registered {
                stop(workers, subscribers).await;
                return Err(e).context("cannot register a worker");
            }
            if cfg.mode.kv_events() {
                match ZmqSource::new(id, w.zmq_endpoint(), Some(w.replay_endpoint())) {
                    Ok(source) => subscribers.push(spawn_subscriber(
                        hub.clone(),
                        source,
                        SubscriberConfig::default(),
                    )),
                    Err(e) => {
                        stop(workers, subscribers).await;
                        return Err(e).context("a worker's ZMQ endpoints");
                    }
                }
            }
        }
        let proxy = ProxyConfig {
            disagg: cfg.disagg.map(|d| d.config).unwrap_or_default(),
            ..ProxyConfig::default()
        };
        let app =
            router(hub.clone(), HttpConfig::default()).merge(openai_router(hub.clone(), proxy));
        let listener = match tokio::net::TcpListener::bind(("127.0.0.1", 0)).await {
            Ok(l) => l,
            Err(e) => {
                stop(workers, subscribers).await;
                return Err(e).context("cannot bind the router's HTTP listener");
            }
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => {
                stop(workers, subscribers).await;
                return Err(e).context("the router's HTTP address");
            }
        };
        let (stop_http, stopped) = oneshot::channel::<()>();
        let http = tokio::spawn(serve_http(listener, app, async move {
            let _ = stopped.await;
        }));
        Ok((addr, workers, ids, subscribers, stop_http, http))
    }

    /// The router's base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The router's HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The hub.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The workers' ids, in worker order.
    pub fn worker_ids(&self) -> Vec<WorkerId> {
        self.ids.clone()
    }

    /// The workers.
    pub fn workers(&self) -> &[SimWorkerHandle] {
        &self.workers
    }

    /// Every worker's current load and counters, in worker order.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.workers.iter().map(SimWorkerHandle::snapshot).collect()
    }

    /// Waits (at most `limit`) until the router has no active request; returns how many
    /// are still active.
    pub async fn wait_idle(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let n = self.hub.active_requests();
            if n == 0 || Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops everything (see invariant 1).
    pub async fn shutdown(self) -> Result<()> {
        let Self {
            hub,
            engine,
            workers,
            subscribers,
            refresher,
            stop_http,
            http,
            ..
        } = self;
        let _ = stop_http.send(());
        let served = match tokio::time::timeout(Duration::from_secs(10), http).await {
            Ok(Ok(r)) => r.map_err(|e| anyhow!("the router's HTTP edge: {e}")),
            Ok(Err(e)) => Err(anyhow!("the router's HTTP edge panicked: {e}")),
            Err(_) => Err(anyhow!("the router's HTTP edge did not stop within 10 s")),
        };
        stop(workers, subscribers).await;
        refresher.abort();
        let _ = refresher.await;
        // Connections the edge is still closing may hold the hub for a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut hub = hub;
        loop {
            match Arc::try_unwrap(hub) {
                Ok(h) => {
                    drop(h);
                    break;
                }
                Err(shared) if Instant::now() < deadline => {
                    hub = shared;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_) => {
                    // The engine threads stop once the last reference goes; do not wait.
                    return served.and(Err(anyhow!("the hub is still shared after shutdown")));
                }
            }
        }
        join_engine(engine).await;
        served
    }
}

/// Aborts the subscriptions and stops the workers, waiting for both.
async fn stop(workers: Vec<SimWorkerHandle>, subscribers: Vec<JoinHandle<()>>) {
    for s in &subscribers {
        s.abort();
    }
    for s in subscribers {
        let _ = s.await;
    }
    for w in workers {
        w.shutdown().await;
    }
}

async fn join_engine(engine: Runtime) {
    let joined = tokio::task::spawn_blocking(move || engine.join()).await;
    if !matches!(joined, Ok(Ok(_))) {
        tracing_warn("an engine core thread failed");
    }
}

fn tracing_warn(msg: &str) {
    eprintln!("kvengine replay: warning: {msg}");
}

async fn refresh_loop(hub: Arc<Hub>) {
    loop {
        tokio::time::sleep(REFRESH_EVERY).await;
        let h = hub.clone();
        if tokio::task::spawn_blocking(move || h.refresh_cached_blocks())
            .await
            .is_err()
        {
            return;
        }
    }
}
