//! The OpenAI-compatible proxy: `POST /v1/chat/completions`, `POST /v1/completions` and
//! `GET /v1/models`, routed by KV-cache overlap.
//!
//! A request is tokenized as the engine will tokenize it ([`super::request_prompt`]),
//! routed by the hub (it becomes active on the chosen worker), and its body forwarded
//! unchanged to that worker's URL; the answer streams back chunk by chunk, with headers
//! naming the request (`x-kvengine-request-id`) and the worker that served it
//! (`x-kvengine-worker-id`, `x-kvengine-dp-rank`). This module holds the routes, reads and
//! tokenizes requests and picks the path (aggregated, or [`super::disagg`]); the sending,
//! the retry and the response are `openai::forward`'s, which both paths share.
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

pub use super::config::ProxyConfig;

use super::attribution::MissProbe;
use super::disagg;
use super::forward::{Outgoing, Proxy, send_or_retry};
use super::headers::{Forwarded, Steering, SteeringError, X_REQUEST_ID};
use super::openai_error::{OpenAiError, openai_error};
use super::relay::Active;
use super::request_prompt::{OpenAiPrompt, PromptSource, parse_request_capped};
use crate::http::turns::ConnTurns;
use crate::hub::Hub;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use engine::router::RouteCall;
use engine::sched::{Pool, RouteOverrides};
use http_body_util::Full;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::outbound::WorkerUrl;
use crate::outbound::body::BodyKind;

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

/// The proxy's routes, to merge into the HTTP edge's router.
pub fn openai_router(hub: Arc<Hub>, cfg: ProxyConfig) -> Router {
    let limit = cfg.max_body_bytes;
    // Idle connections are dropped before the workers drop them: vLLM's server (uvicorn)
    // closes a keep-alive connection after 5 s idle, and a request sent on one it is closing
    // fails before reaching the worker, so it was retried on another worker (found with real
    // vLLM workers: the first request after an idle spell went elsewhere than predicted).
    let client = crate::outbound::ThreadClients::new(cfg.outbound.clone(), UPSTREAM_IDLE);
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
    let turns = req.extensions().get::<ConnTurns>().cloned();
    match body_of(&p, req).await {
        Ok(body) => {
            let fwd = Forwarded::from_client(&headers).on_connection(turns);
            forward(
                p,
                "/v1/chat/completions",
                PromptSource::Chat,
                &headers,
                fwd,
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
    let turns = req.extensions().get::<ConnTurns>().cloned();
    match body_of(&p, req).await {
        Ok(body) => {
            let fwd = Forwarded::from_client(&headers).on_connection(turns);
            forward(
                p,
                "/v1/completions",
                PromptSource::Completion,
                &headers,
                fwd,
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
            &p.client.get(),
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

async fn forward(
    p: Arc<Proxy>,
    path: &str,
    source: PromptSource,
    client: &HeaderMap,
    fwd: Forwarded,
    body: Bytes,
) -> Response {
    let mut model = None;
    // Read only in `--shadow header` mode (the hub's shadow invariant 2); a bad value is
    // no shadow worker.
    let beside = client
        .get(crate::hub::SHADOW_WORKER_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(engine::WorkerId);
    let req = (path, source, beside);
    let mut resp = match super::headers::steering(client) {
        Ok(steer) => forward_with(p.clone(), req, &fwd, body, steer, &mut model).await,
        Err((what, e)) => {
            let m = p.hub.metrics();
            let c = match what {
                SteeringError::Session => &m.sessions.refused,
                SteeringError::Priority => &m.admission.bad_priority,
            };
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    };
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
    (path, source, beside): (&str, PromptSource, Option<engine::WorkerId>),
    fwd: &Forwarded,
    body: Bytes,
    steer: Steering,
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
    // Every worker busy: wait in the model's admission queue (held until routed).
    let admission = match p.hub.admit_request(&model, steer.priority).await {
        Ok(a) => a,
        Err(e) => return OpenAiError::from_routing(e).into_response(),
    };
    let call = RouteCall {
        request_id: None,
        tokens: &tokens,
        lora_name: None,
        cache_salt: salt,
        overrides: RouteOverrides::default(),
        session: steer.session,
    };
    let routed = p
        .hub
        .route_resolved_beside_async(&model, block_size, &call, Instant::now(), beside)
        .await;
    drop(admission);
    let routed = match routed {
        Ok(r) => r,
        Err(e) => return OpenAiError::from_routing(e).into_response(),
    };
    let probe = MissProbe::of(&routed, block_size, tokens.len());
    let active = Active::new(p.hub.clone(), routed.ticket()).probing(probe);
    let out = Outgoing {
        path,
        body: &body,
        fwd,
        model: &model,
        block_size,
        cache_salt: salt,
    };
    let mut resp = send_or_retry(&p, out, &tokens, &routed, active, Pool::Whole).await;
    if let Some(how) = routed.session {
        resp.headers_mut().insert(
            super::headers::ROUTE_HEADER,
            axum::http::HeaderValue::from_static(how.as_str()),
        );
    }
    resp
}
