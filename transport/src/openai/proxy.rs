//! The OpenAI-compatible proxy: `POST /v1/chat/completions`, `POST /v1/completions` and
//! `GET /v1/models`, routed by KV-cache overlap.
//!
//! A request is tokenized as the engine will tokenize it ([`super::request_prompt`]),
//! routed by the hub (it becomes active on the chosen worker), and its body forwarded
//! unchanged to that worker's URL; the answer streams back chunk by chunk, with headers
//! naming the request (`x-kvengine-request-id`) and the worker that served it
//! (`x-kvengine-worker-id`, `x-kvengine-dp-rank`).
//!
//! # Invariants
//! 1. Every routed request is freed exactly once: when its answer ends, fails, or the client
//!    goes away (the response body's drop), or when forwarding fails. It is marked prefilled
//!    at the first chunk of the answer.
//! 2. A worker that fails before answering (connection refused, a 5xx) is retried once, on
//!    the next-best worker of the same decision; after that, or once anything was streamed,
//!    the client gets a clear error (an OpenAI error body, or an SSE error event
//!    mid-stream).
//! 3. Malformed requests get OpenAI-style 400 errors and are never forwarded.

use super::disagg::{self, DisaggConfig};
use super::headers::{Forwarded, X_REQUEST_ID};
use super::openai_error::{OpenAiError, openai_error};
use super::relay::{Active, Relay};
use super::request_prompt::{OpenAiPrompt, PromptSource, parse_request_capped};
use super::tokenize::PromptTokenizer;
use super::usage::UsagePatch;
use crate::hub::{Hub, RouteCall, Routed};
use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use engine::WorkerKey;
use engine::sched::{Pool, RouteMode, RouteOverrides};
use http_body_util::Full;
use hyper::body::Incoming;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::outbound::body::BodyKind;
use crate::outbound::{Outbound, WorkerClient, WorkerUrl};

/// How the proxy is set up.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The tokenizer of models without one of their own (`--tokenizer`); without it the
    /// built-in stand-in ([`super::fallback`]) is used.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    /// Per served model, its tokenizer (`[[models]] tokenizer`).
    pub model_tokenizers: std::collections::HashMap<String, Arc<PromptTokenizer>>,
    /// Bodies over this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// Longest wait for a worker's response headers.
    pub upstream_timeout: Duration,
    /// Disaggregated serving: used when both prefill and decode workers are registered.
    pub disagg: DisaggConfig,
    /// How long a client may take to send a request body once its headers arrived (408).
    pub body_timeout: Duration,
    /// Prompts of more tokens are refused (400 `context_length_exceeded`); `None`: each
    /// model's tokenizer's `model_max_length`, else
    /// [`crate::http::DEFAULT_MAX_PROMPT_TOKENS`].
    pub max_prompt_tokens: Option<usize>,
    /// How workers are reached (TLS trust for `https://` workers: [`crate::outbound`]).
    pub outbound: Outbound,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            model_tokenizers: std::collections::HashMap::new(),
            max_body_bytes: 64 << 20,
            upstream_timeout: Duration::from_secs(600),
            disagg: DisaggConfig::default(),
            max_prompt_tokens: None,
            body_timeout: crate::http::DEFAULT_BODY_TIMEOUT,
            outbound: Outbound::default(),
        }
    }
}

impl ProxyConfig {
    /// The tokenizer of `model`'s prompts: its own, else the router's.
    pub fn tokenizer_for(&self, model: &str) -> Option<&PromptTokenizer> {
        self.tokenizer_arc_for(model).map(|t| &**t)
    }

    fn tokenizer_arc_for(&self, model: &str) -> Option<&Arc<PromptTokenizer>> {
        self.model_tokenizers.get(model).or(self.tokenizer.as_ref())
    }

    /// The most prompt tokens a request for `model` may carry.
    pub fn prompt_cap(&self, model: &str) -> usize {
        self.max_prompt_tokens.unwrap_or_else(|| {
            self.tokenizer_for(model)
                .and_then(PromptTokenizer::max_length)
                .unwrap_or(crate::http::DEFAULT_MAX_PROMPT_TOKENS)
        })
    }

    /// The cap applied while a body is read, before its model is known: the largest any
    /// model allows.
    fn scan_cap(&self) -> usize {
        self.max_prompt_tokens.unwrap_or_else(|| {
            self.model_tokenizers
                .values()
                .chain(self.tokenizer.as_ref())
                .filter_map(|t| t.max_length())
                .fold(crate::http::DEFAULT_MAX_PROMPT_TOKENS, usize::max)
        })
    }
}

/// Bodies above this many bytes are tokenized on the blocking pool, not on the core's event
/// loop (a 16 MiB text takes the tokenizer seconds).
const TOKENIZE_INLINE_BYTES: usize = 64 << 10;

/// Large prompts tokenized at once, at most (the rest wait their turn without holding a
/// thread).
const LARGE_TOKENIZATIONS: usize = 2;

static LARGE_TOKENIZING: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(LARGE_TOKENIZATIONS);

/// `prompt`'s token ids for `model`, at most its cap: inline when the body is small, else
/// on the blocking pool, [`LARGE_TOKENIZATIONS`] at a time.
async fn tokenize(
    cfg: &ProxyConfig,
    model: &str,
    prompt: OpenAiPrompt,
    body_len: usize,
) -> Result<Vec<u32>, OpenAiError> {
    let cap = cfg.prompt_cap(model);
    let ids = if body_len <= TOKENIZE_INLINE_BYTES {
        prompt.token_ids(cfg.tokenizer_for(model))?
    } else {
        let Ok(_permit) = LARGE_TOKENIZING.acquire().await else {
            return Err(OpenAiError::unavailable("the tokenizer pool is closed"));
        };
        let tokenizer = cfg.tokenizer_arc_for(model).cloned();
        tokio::task::spawn_blocking(move || prompt.token_ids(tokenizer.as_deref()))
            .await
            .map_err(|e| OpenAiError::unavailable(format!("tokenizing failed: {e}")))??
    };
    if ids.len() > cap {
        return Err(super::request_prompt::too_long("prompt", cap));
    }
    Ok(ids)
}

/// How long an idle connection to a worker is kept for reuse: under vLLM's (uvicorn's)
/// default keep-alive of 5 s.
const UPSTREAM_IDLE: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) struct Proxy {
    pub(crate) hub: Arc<Hub>,
    pub(crate) cfg: ProxyConfig,
    pub(crate) client: WorkerClient,
    /// When the proxy started (Unix seconds): the `created` of the models it lists.
    pub(crate) started: u64,
}

/// The proxy's routes, to merge into the HTTP edge's router.
pub fn openai_router(hub: Arc<Hub>, cfg: ProxyConfig) -> Router {
    let limit = cfg.max_body_bytes;
    // Idle connections are dropped before the workers drop them: vLLM's server (uvicorn)
    // closes a keep-alive connection after 5 s idle, and a request sent on one it is closing
    // fails before reaching the worker, so it was retried on another worker (found with real
    // vLLM workers: the first request after an idle spell went elsewhere than predicted).
    let client = cfg.outbound.client(UPSTREAM_IDLE);
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let state = Arc::new(Proxy {
        hub,
        cfg,
        client,
        started,
    });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .method_not_allowed_fallback(|| async {
            openai_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this endpoint does not take that method",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// The request's body, or the OpenAI error to answer with (413 past the limit, 408 when
/// it does not arrive in time: [`crate::http::read_body`]).
async fn body_of(p: &Proxy, req: axum::extract::Request) -> Result<Bytes, Response> {
    use crate::http::BodyError;
    let (limit, deadline) = (p.cfg.max_body_bytes, p.cfg.body_timeout);
    crate::http::read_body(req, limit, deadline, &p.hub)
        .await
        .map_err(|e| {
            let status = match e {
                BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                BodyError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
                BodyError::Unreadable(_) => StatusCode::BAD_REQUEST,
            };
            openai_error(status, "invalid_request_error", &e.to_string())
        })
}

async fn chat(
    State(p): State<Arc<Proxy>>,
    headers: HeaderMap,
    req: axum::extract::Request,
) -> Response {
    match body_of(&p, req).await {
        Ok(body) => {
            forward(
                p,
                "/v1/chat/completions",
                PromptSource::Chat,
                &headers,
                body,
            )
            .await
        }
        Err(refused) => refused,
    }
}

async fn completions(
    State(p): State<Arc<Proxy>>,
    headers: HeaderMap,
    req: axum::extract::Request,
) -> Response {
    match body_of(&p, req).await {
        Ok(body) => {
            forward(
                p,
                "/v1/completions",
                PromptSource::Completion,
                &headers,
                body,
            )
            .await
        }
        Err(refused) => refused,
    }
}

/// The longest a worker's model list may take, whole.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);

/// The served models ([`engine::router::namespaces`]); without named ones, those of the first healthy
/// worker that answers (its workers all serve the one model).
async fn models(State(p): State<Arc<Proxy>>) -> Response {
    let named = p.hub.routing().models();
    if !named.is_empty() {
        let data: Vec<serde_json::Value> = named
            .into_iter()
            .map(|(id, _)| {
                serde_json::json!({
                    "id": id, "object": "model", "created": p.started, "owned_by": "kvengine",
                })
            })
            .collect();
        return axum::Json(serde_json::json!({"object": "list", "data": data})).into_response();
    }
    for w in p.hub.workers() {
        let Some(url) = w.registration.url.as_deref().filter(|_| w.healthy) else {
            continue;
        };
        let Ok(uri) = WorkerUrl::parse(url).and_then(|u| u.join("/v1/models")) else {
            continue;
        };
        let Ok(req) = hyper::Request::get(uri).body(Full::new(Bytes::new())) else {
            continue;
        };
        let metrics = p.hub.metrics();
        let answer = crate::outbound::fetch(
            &p.client,
            req,
            BodyKind::Models,
            MODELS_TIMEOUT,
            &metrics.worker_answers,
        )
        .await;
        match answer {
            Ok((status, body)) if status.is_success() => {
                return (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/json")],
                    body,
                )
                    .into_response();
            }
            Ok((status, _)) => tracing::debug!(worker = %w.registration.worker,
                "GET /v1/models: status {status}"),
            Err(e) => tracing::debug!(worker = %w.registration.worker, "GET /v1/models: {e}"),
        }
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"object":"list","data":[]}"#,
    )
        .into_response()
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
    let call = RouteCall {
        request_id: None,
        tokens,
        lora_name: None,
        cache_salt,
        overrides,
    };
    hub.route_resolved_async(model, block_size, &call, Instant::now())
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
    let resp = tokio::time::timeout(p.cfg.upstream_timeout, p.client.request(req))
        .await
        .map_err(|_| "no response in time".to_owned())?
        .map_err(|e| crate::error::chain(&e))?;
    if resp.status().is_server_error() {
        return Err(format!("status {}", resp.status()));
    }
    Ok(resp)
}

async fn forward(
    p: Arc<Proxy>,
    path: &str,
    source: PromptSource,
    client: &HeaderMap,
    body: Bytes,
) -> Response {
    let fwd = Forwarded::from_client(client);
    let mut model = None;
    let mut resp = forward_with(p.clone(), path, source, &fwd, body, &mut model).await;
    // Every answer names the request, errors included.
    resp.headers_mut()
        .insert(X_REQUEST_ID.clone(), fwd.request_id().clone());
    p.hub.metrics().answered(
        model.as_deref().unwrap_or(crate::metrics::NO_MODEL),
        resp.status().as_u16(),
    );
    resp
}

async fn forward_with(
    p: Arc<Proxy>,
    path: &str,
    source: PromptSource,
    fwd: &Forwarded,
    body: Bytes,
    namespace: &mut Option<String>,
) -> Response {
    let bad = |e: OpenAiError| {
        let reason = match e.code {
            Some("context_length_exceeded") => crate::DropReason::Oversized,
            _ => crate::DropReason::MalformedJson,
        };
        p.hub.metrics().drop_input(reason, 1, &e.message);
        e.into_response()
    };
    let prompt = match parse_request_capped(&body, source, p.cfg.scan_cap()) {
        Ok(r) => r,
        Err(e) => return bad(e),
    };
    // The model picks the namespace: its pool, block size and tokenizer.
    let (model, block_size) = match p.hub.resolve_model(prompt.model.as_deref()) {
        Ok(resolved) => resolved,
        Err(e) => return OpenAiError::from_routing(e).into_response(),
    };
    *namespace = Some(model.clone());
    let salt_owned = prompt.cache_salt.clone();
    let tokens = match tokenize(&p.cfg, &model, prompt, body.len()).await {
        Ok(t) => t,
        Err(e) => return bad(e),
    };
    if disagg::applies(&p.hub, &model) {
        let salt = salt_owned.as_deref();
        return disagg::forward(&p, path, &body, &tokens, salt, fwd, (&model, block_size)).await;
    }
    let salt = salt_owned.as_deref();
    let routed = match route(
        &p.hub,
        &model,
        block_size,
        &tokens,
        salt,
        RouteOverrides::default(),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let active = Active::new(p.hub.clone(), routed.ticket());
    let out = Outgoing {
        path,
        body: &body,
        fwd,
        model: &model,
        block_size,
        cache_salt: salt,
    };
    send_or_retry(&p, out, &tokens, &routed, active, Pool::Whole).await
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
    let active = Active::new(p.hub.clone(), retry.ticket());
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
    let relay = Relay::new(incoming, active, sse, patch, fwd.received());
    let mut out = Response::new(Body::new(relay));
    *out.status_mut() = parts.status;
    *out.headers_mut() = headers;
    out
}
