//! `GET /healthz`, and the loop that health-checks registered workers.
//!
//! [`health_loop`] GETs `{url}/health` of every worker registered with a `url`, all at once,
//! once per interval. `failures_to_down` consecutive failures (a non-2xx status, a refused
//! connection or no answer within the timeout) take the worker out of routing
//! ([`Hub::set_healthy`]`(false)`: its active requests are freed, its blocks stay indexed);
//! the first success after that puts it back. Each round also refreshes the cached-block
//! totals the scheduler breaks ties with.

use super::AppState;
use super::errors::json;
use crate::hub::Hub;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use engine::WorkerId;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

#[derive(Serialize)]
struct Healthz {
    status: &'static str,
    workers: usize,
}

pub(super) async fn healthz(State(st): State<AppState>) -> Response {
    json(
        StatusCode::OK,
        &Healthz {
            status: "ok",
            workers: st.hub.workers().len(),
        },
    )
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
                checks.spawn(async move { (id, check(client, url, timeout).await) });
            }
        }
        let healthy: HashMap<WorkerId, bool> = workers
            .iter()
            .map(|w| (w.registration.worker, w.healthy))
            .collect();
        failures.retain(|id, _| healthy.contains_key(id));
        while let Some(done) = checks.join_next().await {
            let Ok((id, result)) = done else { continue };
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
    }
}
