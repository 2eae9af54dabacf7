//! One in-process router in front of a cluster's simulated workers: the engine and hub
//! ([`start_engine`], unpinned), every worker registered and (with KV events) subscribed
//! to, a cached-blocks refresher, and the HTTP edge merged with the OpenAI proxy on
//! `127.0.0.1:0`.
//!
//! Each worker is registered under id `i + 1` (its index in the cluster) with its HTTP
//! URL, ZMQ publisher and replay endpoints ([`SimWorkerHandle::registration`]), and
//! subscribed to ([`Sources`]); a simulated TensorRT-LLM worker is polled instead
//! (on its `/kv_cache_events`). In [`super::RunMode::KvNoEvents`] the hub predicts the
//! caches from its own decisions ([`Hub::without_kv_events`]) and nothing is subscribed.
//! Several routers may front the same workers (replicas, [`super::replicas`]): ZMQ PUB fans
//! each worker's events out to every subscriber, so each router keeps the whole index.
//!
//! # Invariants
//! 1. [`Router::shutdown`] stops everything it started, in order: the HTTP edge (open
//!    connections finish), the subscriptions, the refresher; then the last hub reference
//!    is dropped and the engine's threads are joined. Whatever else holds the hub (a
//!    replica link) must be stopped first.
//! 2. A failed start stops what it had started. The workers are not the router's: it
//!    never stops them.

use super::config::ClusterConfig;
use crate::workers::SimWorkerHandle;
use anyhow::{Context, Result, anyhow};
use engine::WorkerId;
use engine::approx::ApproxConfig;
use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use transport::http::{HttpConfig, router as http_router, serve_http};
use transport::hub::{Hub, HubConfig, start_engine};
use transport::openai::proxy::{ProxyConfig, openai_router};
use transport::sources::{Sources, SourcesConfig};
use transport::trtllm::TrtllmSource;
use transport::zmq::ZmqSource;

/// How often a TensorRT-LLM worker's events are polled (in real time; each request that
/// finishes on it also polls it at once).
const TRTLLM_POLL: Duration = Duration::from_millis(20);

/// How often the hub's per-worker cached-block totals (its tie-breaker) are refreshed.
const REFRESH_EVERY: Duration = Duration::from_millis(500);

type HttpTask = JoinHandle<Result<(), transport::TransportError>>;

/// A running router. Stop it with [`Router::shutdown`].
#[derive(Debug)]
pub struct Router {
    hub: Arc<Hub>,
    engine: Runtime,
    addr: SocketAddr,
    sources: Arc<Sources>,
    refresher: JoinHandle<()>,
    stop_http: oneshot::Sender<()>,
    http: HttpTask,
}

/// The worker ids a router gives `workers`, in worker order.
pub fn worker_ids(workers: &[SimWorkerHandle]) -> Vec<WorkerId> {
    (1..=workers.len() as u64).map(WorkerId).collect()
}

impl Router {
    /// Starts a router for `cfg` in front of `workers` on the current tokio runtime.
    pub async fn start(cfg: &ClusterConfig, workers: &[SimWorkerHandle]) -> Result<Self> {
        let scheduler = SchedulerConfig {
            block_size: cfg.engine.block_size,
            mode: cfg.mode.route_mode(),
            seed: cfg.seed,
            overlap_weight: cfg.overlap_weight,
            cost: cfg.router_cost,
            stall_weight: cfg.stall_weight,
            ..SchedulerConfig::default()
        };
        let runtime_config = RuntimeConfig {
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 2,
            // Several routers' engines in one process: each would count the machine's other
            // CPUs as its own and yield-spin when idle, taking them from the rest of the run.
            cpus_shared: cfg.replicas > 1,
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
        let sources = Sources::on_current(hub.clone(), SourcesConfig::default());
        match Self::start_rest(cfg, &hub, workers, &sources).await {
            Ok((addr, stop_http, http)) => {
                let refresher = tokio::spawn(refresh_loop(hub.clone()));
                Ok(Self {
                    hub,
                    engine,
                    addr,
                    sources,
                    refresher,
                    stop_http,
                    http,
                })
            }
            Err(e) => {
                sources.shutdown().await;
                drop(sources);
                drop(hub);
                join_engine(engine).await;
                Err(e)
            }
        }
    }

    /// Registers and subscribes to `workers` (their sources kept by `sources`, for the
    /// caller to stop on failure), then serves HTTP.
    async fn start_rest(
        cfg: &ClusterConfig,
        hub: &Arc<Hub>,
        workers: &[SimWorkerHandle],
        sources: &Sources,
    ) -> Result<(SocketAddr, oneshot::Sender<()>, HttpTask)> {
        for (w, id) in workers.iter().zip(worker_ids(workers)) {
            hub.register(w.registration(id))
                .context("cannot register a worker")?;
            if cfg.mode.kv_events() && w.is_trtllm() {
                let source = TrtllmSource::new(id, &w.url(), TRTLLM_POLL)
                    .context("a TensorRT-LLM worker's URL")?;
                sources.poll(source);
            } else if cfg.mode.kv_events() {
                let source = ZmqSource::new(id, w.zmq_endpoint(), Some(w.replay_endpoint()))
                    .context("a worker's ZMQ endpoints")?;
                sources.subscribe(source);
            }
        }
        let proxy = ProxyConfig {
            disagg: cfg.disagg.map(|d| d.config).unwrap_or_default(),
            ..ProxyConfig::default()
        };
        let app = http_router(hub.clone(), HttpConfig::default())
            .merge(openai_router(hub.clone(), proxy));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("cannot bind the router's HTTP listener")?;
        let addr = listener.local_addr().context("the router's HTTP address")?;
        let (stop_http, stopped) = oneshot::channel::<()>();
        let http = tokio::spawn(serve_http(listener, app, async move {
            let _ = stopped.await;
        }));
        Ok((addr, stop_http, http))
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

    /// Stops everything (see invariant 1).
    pub async fn shutdown(self) -> Result<()> {
        let Self {
            hub,
            engine,
            sources,
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
        sources.shutdown().await;
        drop(sources);
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

async fn join_engine(engine: Runtime) {
    let joined = tokio::task::spawn_blocking(move || engine.join()).await;
    if !matches!(joined, Ok(Ok(_))) {
        eprintln!("kvengine replay: warning: an engine core thread failed");
    }
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
