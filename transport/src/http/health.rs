//! Probes for orchestrators (`GET /live`, `/ready`, `/health`; `/healthz` is `/live`'s older
//! name), and the loop that health-checks registered workers.
//!
//! * `/live`: the process serves HTTP (nothing else is checked: restarting a live router
//!   that has no workers would not give it any).
//! * `/ready`: 200 when the router can route: its engine answers, at least one worker is
//!   usable (healthy, and its ZMQ event stream subscribed if it has one), and so is one of
//!   every served model's ([`crate::models`]); 503 otherwise, with the reasons. Readiness gates traffic, so a router whose
//!   workers are all down is taken out of its Service instead of answering 503s.
//! * `/health`: the same assessment with its details, always 200 (for people and dashboards).
//!
//! [`health_loop`] GETs `{url}/health` of every worker registered with a `url`, all at once,
//! once per interval. `failures_to_down` consecutive failures (a non-2xx status, a refused
//! connection or no answer within the timeout) take the worker out of routing
//! ([`Hub::set_healthy`]`(false)`: its active requests are freed, its blocks stay indexed);
//! the first success after that puts it back. A healthy worker's `{url}/metrics` page is
//! read in the same round and its ranks' load recorded ([`super::scrape`]), as if the
//! worker had called `POST /v1/load`. Each round also refreshes the cached-block totals the
//! scheduler breaks ties with, and reads the cores' figures, which checks the index against
//! its memory budget ([`crate::bounds`]).

use super::AppState;
use super::errors::json;
use crate::hub::{Hub, StreamState, WorkerInfo};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use engine::sched::WorkerLoad;
use engine::{DpRank, WorkerId};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::task::JoinSet;

#[derive(Serialize)]
struct Healthz {
    status: &'static str,
    workers: usize,
}

/// `GET /healthz` and `GET /live`: the process serves.
pub(super) async fn healthz(State(st): State<AppState>) -> Response {
    json(
        StatusCode::OK,
        &Healthz {
            status: "ok",
            workers: st.hub.workers().len(),
        },
    )
}

/// What `/ready` and `/health` report.
#[derive(Debug, Serialize)]
pub(crate) struct Assessment {
    /// `ready` or `not_ready`.
    status: &'static str,
    ready: bool,
    /// Why not ready (empty when ready).
    reasons: Vec<String>,
    /// Workers the router cannot route by their caches, one line each naming the worker
    /// and the cause (a configuration error such as another block size, or a KV event
    /// stream that is not connected). Such a worker is not usable; while another one is,
    /// the router stays ready and says so here.
    problems: Vec<String>,
    /// Whether the router routes on KV events (false: approximate mode).
    kv_events: bool,
    engine: EngineHealth,
    workers: WorkersHealth,
    /// Per served model (none without named models): whether it has a healthy worker.
    models: Vec<ModelHealth>,
    /// Router replicas (`--replica-nats`): whether peers' load is shared or the replica
    /// routes on its own (NATS unreachable; not a reason to be unready).
    #[serde(skip_serializing_if = "Option::is_none")]
    replicas: Option<crate::replicas::ReplicaStatus>,
}

#[derive(Debug, Serialize)]
struct ModelHealth {
    name: String,
    ready: bool,
}

#[derive(Debug, Serialize)]
struct EngineHealth {
    /// Every core answered a stats query within the engine's deadline.
    responsive: bool,
    cores: usize,
    /// Heap bytes of the index and directories at the last reading.
    index_bytes: u64,
    /// The index is over `--max-index-bytes`: stores are refused (not a reason to be unready:
    /// routing works, with fewer cache hits).
    index_full: bool,
}

#[derive(Debug, Serialize)]
struct WorkersHealth {
    registered: usize,
    /// In routing (passing health checks).
    healthy: usize,
    /// With a rank whose event stream broke and was cleared, until its next batch.
    resyncing: usize,
    /// Whose events showed a configuration error (another block size).
    config_errors: usize,
    /// Whose ZMQ event stream is not connected yet (the router cannot see their caches).
    streams_connecting: usize,
    /// With a rank whose stores the bounds refused ([`crate::bounds::Degraded`]).
    degraded: usize,
}

/// Assesses whether `hub` can route (see the module docs).
pub(crate) fn assess(hub: &Hub) -> Assessment {
    let mut reasons = Vec::new();
    let engine = match crate::cores::engine_call(|| hub.core_stats()) {
        Ok(cores) => EngineHealth {
            responsive: true,
            cores: cores.len(),
            index_bytes: hub.index_budget().bytes(),
            index_full: hub.index_budget().is_full(),
        },
        Err(e) => {
            hub.metrics().engine_unresponsive.fetch_add(1, Relaxed);
            reasons.push(format!("the engine did not answer: {e}"));
            EngineHealth {
                responsive: false,
                cores: 0,
                index_bytes: hub.index_budget().bytes(),
                index_full: hub.index_budget().is_full(),
            }
        }
    };
    let all = hub.workers();
    let workers = WorkersHealth {
        registered: all.len(),
        healthy: all.iter().filter(|w| w.healthy).count(),
        resyncing: all.iter().filter(|w| !w.resyncing.is_empty()).count(),
        config_errors: all.iter().filter(|w| w.config_error.is_some()).count(),
        streams_connecting: all
            .iter()
            .filter(|w| w.stream == Some(StreamState::Connecting))
            .count(),
        degraded: all.iter().filter(|w| !w.degraded.is_empty()).count(),
    };
    // A worker serves requests once it passes health checks and, if the router subscribes
    // to its KV events, once that stream is up and its events can be applied (before, or
    // with another block size, kv routing is blind to its cache).
    let usable = |w: &WorkerInfo| {
        w.healthy && w.stream != Some(StreamState::Connecting) && w.config_error.is_none()
    };
    let problems: Vec<String> = all
        .iter()
        .filter_map(|w| {
            let id = w.registration.worker;
            if let Some(e) = &w.config_error {
                return Some(format!("worker {id}: its KV events cannot be applied: {e}"));
            }
            (w.stream == Some(StreamState::Connecting)).then(|| {
                format!(
                    "worker {id}: KV event stream not connected{}",
                    match &w.registration.zmq {
                        Some(endpoint) => format!(
                            " to {endpoint} (is the worker's endpoint bound, tcp://*:PORT?)"
                        ),
                        None => String::new(),
                    }
                )
            })
        })
        .collect();
    if workers.healthy == 0 {
        reasons.push(format!(
            "no healthy worker ({} registered)",
            workers.registered
        ));
    } else if !all.iter().any(usable) {
        reasons.push(format!(
            "no healthy worker has its KV event stream subscribed and applicable \
             ({} connecting, {} with a configuration error)",
            workers.streams_connecting, workers.config_errors
        ));
    }
    let models: Vec<ModelHealth> = hub
        .models()
        .into_iter()
        .map(|(name, _)| {
            let ready = all
                .iter()
                .any(|w| usable(w) && w.registration.model.as_deref() == Some(name.as_str()));
            ModelHealth { name, ready }
        })
        .collect();
    for m in models.iter().filter(|m| !m.ready) {
        reasons.push(format!(
            "model {:?} has no healthy worker with its event stream subscribed",
            m.name
        ));
    }
    let ready = reasons.is_empty();
    Assessment {
        status: if ready { "ready" } else { "not_ready" },
        ready,
        reasons,
        problems,
        kv_events: hub.kv_events(),
        engine,
        workers,
        models,
        replicas: hub.replicas().map(|r| r.status()),
    }
}

/// `GET /ready`: 200 when the router can route, else 503; the assessment as the body.
pub(super) async fn ready(State(st): State<AppState>) -> Response {
    let a = assess(&st.hub);
    let status = match a.ready {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    json(status, &a)
}

/// `GET /health`: the assessment, always 200.
pub(super) async fn health(State(st): State<AppState>) -> Response {
    json(StatusCode::OK, &assess(&st.hub))
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// One check: whether `{url}/health` answered 2xx within `timeout`.
async fn check(client: HttpClient, url: String, timeout: Duration) -> Result<(), String> {
    let target = format!("{}/health", url.trim_end_matches('/'));
    let uri: hyper::Uri = target
        .parse()
        .map_err(|e| format!("bad health URL {target:?}: {e}"))?;
    let attempt = async {
        let resp = client.get(uri).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // Read the (small) body so the connection can be reused.
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// The largest metrics page read (vLLM's are tens of KiB).
const MAX_METRICS_PAGE: usize = 4 << 20;

/// Each rank's load from `{url}/metrics` (see [`super::scrape`]).
async fn scrape(
    client: HttpClient,
    url: String,
    timeout: Duration,
) -> Result<Vec<(DpRank, WorkerLoad)>, String> {
    let target = format!("{}/metrics", url.trim_end_matches('/'));
    let uri: hyper::Uri = target
        .parse()
        .map_err(|e| format!("bad metrics URL {target:?}: {e}"))?;
    let attempt = async {
        let resp = client.get(uri).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_PAGE)
            .collect()
            .await
            .map_err(|e| format!("reading the page: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("status {status}"));
        }
        Ok(super::scrape::parse_loads(&String::from_utf8_lossy(&body)))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Records the loads a worker's page showed, for the ranks it is known to have (a page
/// naming other ranks adds none: ranks come from registration and events).
fn record_loads(hub: &Hub, worker: WorkerId, known: &[DpRank], loads: Vec<(DpRank, WorkerLoad)>) {
    for (rank, load) in loads {
        if known.contains(&rank) || (known.is_empty() && rank == DpRank(0)) {
            let key = engine::WorkerKey {
                worker,
                dp_rank: rank,
            };
            if let Err(e) = hub.update_load(key, load) {
                tracing::debug!(worker = worker.0, "scraped load refused: {e}");
            }
        }
    }
}

/// Health-checks every worker with a `url` each `interval` (see the module docs). Runs
/// until the task is aborted or dropped.
pub async fn health_loop(
    hub: Arc<Hub>,
    interval: Duration,
    timeout: Duration,
    failures_to_down: u32,
) {
    let failures_to_down = failures_to_down.max(1);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(interval.saturating_mul(4).max(Duration::from_secs(1)))
        .build_http();
    let mut failures: HashMap<WorkerId, u32> = HashMap::new();
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let workers = hub.workers();
        let mut checks = JoinSet::new();
        for w in &workers {
            if let Some(url) = &w.registration.url {
                let (client, url, id) = (client.clone(), url.clone(), w.registration.worker);
                checks.spawn(async move {
                    let health = check(client.clone(), url.clone(), timeout).await;
                    // A healthy worker's own metrics page says how loaded it is.
                    let loads = match health {
                        Ok(()) => Some(scrape(client, url, timeout).await),
                        Err(_) => None,
                    };
                    (id, health, loads)
                });
            }
        }
        let healthy: HashMap<WorkerId, bool> = workers
            .iter()
            .map(|w| (w.registration.worker, w.healthy))
            .collect();
        failures.retain(|id, _| healthy.contains_key(id));
        let ranks: HashMap<WorkerId, Vec<DpRank>> = workers
            .iter()
            .map(|w| (w.registration.worker, w.registration.dp_ranks.clone()))
            .collect();
        while let Some(done) = checks.join_next().await {
            let Ok((id, result, loads)) = done else {
                continue;
            };
            match loads {
                Some(Ok(loads)) => {
                    hub.metrics().load_scrapes.fetch_add(1, Relaxed);
                    let known = ranks.get(&id).map(Vec::as_slice).unwrap_or_default();
                    record_loads(&hub, id, known, loads);
                }
                Some(Err(why)) => {
                    hub.metrics().load_scrape_failures.fetch_add(1, Relaxed);
                    tracing::debug!(worker = id.0, "metrics scrape failed: {why}");
                }
                None => {}
            }
            let was_healthy = healthy.get(&id).copied().unwrap_or(true);
            match result {
                Ok(()) => {
                    failures.remove(&id);
                    if !was_healthy {
                        match hub.set_healthy(id, true) {
                            Ok(true) => tracing::info!(
                                worker = id.0,
                                "worker healthy again; back in routing"
                            ),
                            Ok(false) => {}
                            Err(e) => tracing::debug!(worker = id.0, "health: {e}"),
                        }
                    }
                }
                Err(why) => {
                    let n = failures.entry(id).or_default();
                    *n = n.saturating_add(1);
                    tracing::debug!(worker = id.0, failures = *n, "health check failed: {why}");
                    if *n >= failures_to_down && was_healthy {
                        match hub.set_healthy(id, false) {
                            Ok(true) => tracing::warn!(
                                worker = id.0,
                                failures = *n,
                                "worker failed its health checks ({why}); out of routing"
                            ),
                            Ok(false) => {}
                            Err(e) => tracing::debug!(worker = id.0, "health: {e}"),
                        }
                    }
                }
            }
        }
        if let Err(e) = crate::cores::engine_call(|| hub.refresh_cached_blocks()) {
            tracing::debug!("refreshing cached blocks: {e}");
        }
        // The index against its memory budget (crate::bounds).
        if let Err(e) = crate::cores::engine_call(|| hub.core_stats()) {
            tracing::debug!("reading the cores' figures: {e}");
        }
    }
}
