//! Sending a routed request to its worker, shared by the proxy's aggregated path (`proxy`)
//! and the disaggregated flow (`disagg`): the proxy's state ([`Proxy`]), routing in a
//! resolved namespace ([`route`], [`runner_up`]), posting to a worker ([`send`]), the one
//! retry elsewhere ([`send_or_retry`], [`retry_elsewhere`]) and the client's response
//! ([`respond`]). Below both users: it calls neither.
//!
//! # Invariants
//! 1. A request routed here is tracked by its [`Active`], which frees it exactly once:
//!    when its answer ends, fails or is dropped, or when forwarding it failed
//!    ([`send_or_retry`] frees it before the retry routes again).
//! 2. A worker that fails before answering (connection refused, no headers in time, a
//!    5xx) is retried once, on the next-best worker of the same decision; a second failure
//!    is the client's 502.

use super::attribution::MissProbe;
use super::config::ProxyConfig;
use super::headers::Forwarded;
use super::openai_error::{OpenAiError, openai_error};
use super::relay::{Active, Relay};
use super::usage::UsagePatch;
use crate::hub::{Hub, RouteCall, Routed};
use crate::outbound::WorkerUrl;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use engine::WorkerKey;
use engine::sched::{Pool, RouteMode, RouteOverrides};
use http_body_util::Full;
use hyper::body::Incoming;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// The proxy's state: what its handlers and the disaggregated flow share.
#[derive(Debug)]
pub(crate) struct Proxy {
    pub(crate) hub: Arc<Hub>,
    pub(crate) cfg: ProxyConfig,
    pub(crate) client: crate::outbound::ThreadClients,
    /// When the proxy started (Unix seconds): the `created` of the models it lists.
    pub(crate) started: u64,
}

/// Routes in `model`'s namespace, resolved already (with its `block_size`): the model is
/// resolved once per request.
pub(crate) async fn route(
    hub: &Hub,
    model: &str,
    block_size: u32,
    tokens: &[u32],
    cache_salt: Option<&str>,
    overrides: RouteOverrides,
) -> Result<Routed, OpenAiError> {
    route_beside(
        hub,
        (model, block_size),
        tokens,
        cache_salt,
        overrides,
        None,
    )
    .await
}

/// [`route`] for a request whose `x-kvengine-shadow-worker` header named `beside`
/// ([`crate::hub::Shadow::Header`]).
pub(crate) async fn route_beside(
    hub: &Hub,
    (model, block_size): (&str, u32),
    tokens: &[u32],
    cache_salt: Option<&str>,
    overrides: RouteOverrides,
    beside: Option<engine::WorkerId>,
) -> Result<Routed, OpenAiError> {
    let call = RouteCall {
        request_id: None,
        tokens,
        lora_name: None,
        cache_salt,
        overrides,
        session: None,
    };
    hub.route_resolved_beside_async(model, block_size, &call, Instant::now(), beside)
        .await
        .map_err(OpenAiError::from_routing)
}

/// The next-best candidate of `decision` other than `failed`, by cost.
pub(crate) fn runner_up(routed: &Routed, failed: WorkerKey) -> Option<WorkerKey> {
    routed
        .decision
        .candidates
        .iter()
        .filter(|c| c.key.worker != failed.worker)
        .min_by(|a, b| a.logit.total_cmp(&b.logit))
        .map(|c| c.key)
}

/// Posts `body` to `key`'s worker at `path`; a connection failure, a timeout before the
/// response headers or a 5xx is an error (worth a retry elsewhere).
pub(crate) async fn send(
    p: &Proxy,
    key: WorkerKey,
    path: &str,
    body: &Bytes,
    fwd: &Forwarded,
) -> Result<hyper::Response<Incoming>, String> {
    let url = p
        .hub
        .registry()
        .url(key.worker)
        .ok_or_else(|| format!("worker {} has no url", key.worker))?;
    let uri = WorkerUrl::parse(&url)
        .and_then(|u| u.join(path))
        .map_err(|e| e.to_string())?;
    let mut req = hyper::Request::post(uri)
        .body(Full::new(body.clone()))
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = fwd.for_worker(p.hub.registry().api_key(key.worker).as_deref());
    let resp = tokio::time::timeout(p.cfg.upstream_timeout, p.client.get().request(req))
        .await
        .map_err(|_| "no response in time".to_owned())?
        .map_err(|e| crate::error::chain(&e))?;
    if resp.status().is_server_error() {
        return Err(format!("status {}", resp.status()));
    }
    Ok(resp)
}

/// Forwards `body` to the worker `routed` chose (its request tracked by `active`); if that
/// worker fails before answering, frees the request and tries [`retry_elsewhere`].
pub(crate) async fn send_or_retry(
    p: &Proxy,
    out: Outgoing<'_>,
    tokens: &[u32],
    routed: &Routed,
    mut active: Active,
    pool: Pool,
) -> Response {
    let first = routed.decision.worker;
    match send(p, first, out.path, out.body, out.fwd).await {
        Ok(resp) => respond(resp, active, first, None, None, out.fwd),
        Err(e) => {
            tracing::warn!(worker = %first.worker, "forwarding failed, retrying once: {e}");
            p.hub.metrics().upstream_errors.fetch_add(1, Relaxed);
            active.finish();
            retry_elsewhere(p, out, tokens, routed, pool, &e).await
        }
    }
}

/// What one client request sends to a worker: the path, the body and the headers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Outgoing<'a> {
    pub path: &'a str,
    pub body: &'a Bytes,
    pub fwd: &'a Forwarded,
    /// The namespace the request routes in ([`engine::router::namespaces`]) ...
    pub model: &'a str,
    /// ... and its block size.
    pub block_size: u32,
    /// The request's non-empty `cache_salt` (part of its block hashes).
    pub cache_salt: Option<&'a str>,
}

/// The whole request once more, on the next-best candidate (in `pool`) of `routed`'s
/// decision, after its chosen worker failed with `first_error`; a second failure is the
/// client's 502.
pub(crate) async fn retry_elsewhere(
    p: &Proxy,
    out: Outgoing<'_>,
    tokens: &[u32],
    routed: &Routed,
    pool: Pool,
    first_error: &str,
) -> Response {
    let failed = routed.decision.worker;
    let gateway = |msg: String| openai_error(StatusCode::BAD_GATEWAY, "upstream_error", &msg);
    let Some(next) = runner_up(routed, failed) else {
        return gateway(format!("worker {} failed: {first_error}", failed.worker));
    };
    let overrides = RouteOverrides {
        pool,
        mode: Some(RouteMode::Direct),
        worker: Some(next.worker),
        ..RouteOverrides::default()
    };
    let retry = match route(
        &p.hub,
        out.model,
        out.block_size,
        tokens,
        out.cache_salt,
        overrides,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let probe = MissProbe::of(&retry, out.block_size, tokens.len());
    let active = Active::new(p.hub.clone(), retry.ticket()).probing(probe);
    p.hub.metrics().retries.fetch_add(1, Relaxed);
    match send(p, next, out.path, out.body, out.fwd).await {
        Ok(resp) => respond(resp, active, next, None, None, out.fwd),
        Err(e) => gateway(format!(
            "workers {} and {} failed: {first_error}; {e}",
            failed.worker, next.worker
        )),
    }
}

/// The client's response: the worker's status and body (relayed by a [`Relay`]), its content
/// type, and headers naming the request and the workers that served it.
pub(crate) fn respond(
    resp: hyper::Response<Incoming>,
    active: Active,
    served_by: WorkerKey,
    prefilled_by: Option<WorkerKey>,
    cached_tokens: Option<u64>,
    fwd: &Forwarded,
) -> Response {
    let (parts, incoming) = resp.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut headers = HeaderMap::new();
    for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
        if let Some(v) = parts.headers.get(&name) {
            headers.insert(name, v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(active.id().unwrap_or_default()) {
        headers.insert("x-kvengine-request-id", v);
    }
    headers.insert(
        "x-kvengine-worker-id",
        HeaderValue::from(served_by.worker.0),
    );
    headers.insert("x-kvengine-dp-rank", HeaderValue::from(served_by.dp_rank.0));
    if let Some(p) = prefilled_by {
        headers.insert(
            "x-kvengine-prefill-worker-id",
            HeaderValue::from(p.worker.0),
        );
    }
    let patch = cached_tokens.map(|c| UsagePatch::new(c, sse));
    let mut active = active;
    // An error answer is no cache outcome: its tap is dropped, counted as failed.
    let tap = active.tap().filter(|_| parts.status.is_success());
    let relay = Relay::new(incoming, active, sse, (patch, tap), fwd.received())
        .coalescing(fwd.turns().cloned());
    let mut out = Response::new(Body::new(relay));
    *out.status_mut() = parts.status;
    *out.headers_mut() = headers;
    out
}
