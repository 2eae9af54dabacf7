//! Probes for orchestrators (`GET /live`, `/ready`, `/health`; `/healthz` is `/live`'s older
//! name), and the loop that health-checks registered workers.
//!
//! * `/live`: the process serves HTTP (nothing else is checked: restarting a live router
//!   that has no workers would not give it any).
//! * `/ready`: 200 when the router can route: its engine answers, at least one worker is
//!   usable (healthy, and its ZMQ event stream subscribed if it has one), and so is one of
//!   every served model's ([`engine::router::namespaces`]); 503 otherwise, with the reasons. Readiness gates traffic, so a router whose
//!   workers are all down is taken out of its Service instead of answering 503s.
//! * `/health`: the same assessment with its details, always 200 (for people and dashboards).
//!
//! [`health_loop`] GETs `{url}/health` of every worker registered with a `url`, all at once,
//! once per interval, with a client from [`crate::outbound`] (so `https://` workers are
//! verified as everywhere else). `failures_to_down` consecutive failures (a non-2xx status,
//! a refused connection or failed TLS handshake, no whole answer within the timeout, an
//! answer over 1 MiB) take the worker out of routing
//! ([`Hub::set_healthy`]`(false)`: its active requests are freed, its blocks stay indexed);
//! the first success after that puts it back. Why the last check failed is shown in
//! `/v1/workers` (`health_error`) and in `/ready`'s problems. A healthy worker's
//! `{url}/metrics` page (at most 4 MiB, within the same timeout) is read in the same round
//! and its ranks' load recorded ([`super::scrape`]), as if the worker had called
//! `POST /v1/load`. Each round also refreshes the cached-block totals the
//! scheduler breaks ties with, and reads the cores' figures, which checks the index against
//! its memory budget ([`crate::bounds`]).

use super::api_error::json;
use super::shared::AppState;
use crate::error::WorkerCallError;
use crate::hub::{Hub, StreamState, WorkerInfo};
use crate::metrics::Metrics;
use crate::outbound::body::BodyKind;
use crate::outbound::{Outbound, WorkerClient, WorkerUrl, fetch};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use engine::sched::WorkerLoad;
use engine::{DpRank, WorkerId};
use http_body_util::Full;
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
            if let Some(e) = &w.health_error {
                return Some(format!("worker {id}: health check failing: {e}"));
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
        .routing()
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
        replicas: hub.routing().replicas().map(|r| r.status()),
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

/// `GET {url}{path}`, its answer read whole within `timeout` and under `kind`'s cap.
async fn get(
    client: &WorkerClient,
    url: &WorkerUrl,
    path: &str,
    kind: BodyKind,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<Bytes, String> {
    let uri = url.join(path).map_err(|e| e.to_string())?;
    let req = hyper::Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    match fetch(client, req, kind, timeout, &metrics.worker_answers).await {
        Ok((status, body)) if status.is_success() => Ok(body),
        Ok((status, _)) => Err(format!("status {status}")),
        Err(e @ WorkerCallError::TooSlow { .. }) => Err(format!("no answer: {e}")),
        Err(e) => Err(e.to_string()),
    }
}

/// One check: whether `{url}/health` answered 2xx within `timeout`.
async fn check(
    client: &WorkerClient,
    url: &WorkerUrl,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<(), String> {
    get(client, url, "/health", BodyKind::Health, timeout, metrics)
        .await
        .map(drop)
}

/// Each rank's load from `{url}/metrics` (see [`super::scrape`]).
async fn scrape(
    client: &WorkerClient,
    url: &WorkerUrl,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<Vec<(DpRank, WorkerLoad)>, String> {
    let page = get(client, url, "/metrics", BodyKind::Metrics, timeout, metrics).await?;
    Ok(super::scrape::parse_loads(&String::from_utf8_lossy(&page)))
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

/// Health-checks every worker with a `url` each `interval` (see the module docs), over
/// clients of `outbound`. Runs until the task is aborted or dropped.
pub async fn health_loop(
    hub: Arc<Hub>,
    interval: Duration,
    timeout: Duration,
    failures_to_down: u32,
    outbound: Outbound,
) {
    let failures_to_down = failures_to_down.max(1);
    let client = outbound.client(interval.saturating_mul(4).max(Duration::from_secs(1)));
    let mut failures: HashMap<WorkerId, u32> = HashMap::new();
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let workers = hub.workers();
        let mut checks = JoinSet::new();
        for w in &workers {
            if let Some(text) = &w.registration.url {
                let id = w.registration.worker;
                // Registrations hold parsed URLs only (Hub::register); one that does not
                // parse is a failed check, never a request.
                let url = WorkerUrl::parse(text);
                let (client, hub) = (client.clone(), hub.clone());
                checks.spawn(async move {
                    let url = match url {
                        Ok(u) => u,
                        Err(e) => return (id, Err(e.to_string()), None),
                    };
                    let metrics = hub.metrics();
                    let health = check(&client, &url, timeout, metrics).await;
                    // A healthy worker's own metrics page says how loaded it is.
                    let loads = match health {
                        Ok(()) => Some(scrape(&client, &url, timeout, metrics).await),
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
            hub.registry()
                .note_health(id, result.as_ref().err().cloned());
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
