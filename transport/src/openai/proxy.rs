//! The OpenAI-compatible proxy: `POST /v1/chat/completions`, `POST /v1/completions` and
//! `GET /v1/models`, routed by KV-cache overlap.
//!
//! A request is tokenized as the engine will tokenize it ([`super::prompt`]), routed by the
//! hub (it becomes active on the chosen worker), and its body forwarded unchanged to that
//! worker's URL; the answer streams back chunk by chunk, with headers naming the request
//! (`x-kvengine-request-id`) and the worker that served it (`x-kvengine-worker-id`,
//! `x-kvengine-dp-rank`).
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

use super::errors::{OpenAiError, openai_error};
use super::prompt::{PromptSource, prompt_token_ids};
use super::tokenize::PromptTokenizer;
use crate::hub::{Hub, RouteCall, Routed};
use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use engine::WorkerKey;
use engine::sched::RouteOverrides;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How the proxy is set up.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The model's tokenizer (`--tokenizer`); without it the built-in stand-in
    /// ([`super::fallback`]) is used.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    /// Bodies over this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// Longest wait for a worker's response headers.
    pub upstream_timeout: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            max_body_bytes: 64 << 20,
            upstream_timeout: Duration::from_secs(600),
        }
    }
}

#[derive(Debug)]
struct Proxy {
    hub: Arc<Hub>,
    cfg: ProxyConfig,
    client: HttpClient,
}

/// The proxy's routes, to merge into the HTTP edge's router.
pub fn openai_router(hub: Arc<Hub>, cfg: ProxyConfig) -> Router {
    let limit = cfg.max_body_bytes;
    let client = Client::builder(TokioExecutor::new()).build_http();
    let state = Arc::new(Proxy { hub, cfg, client });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn chat(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    forward(p, "/v1/chat/completions", PromptSource::Chat, body).await
}

async fn completions(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    forward(p, "/v1/completions", PromptSource::Completion, body).await
}

/// The models of the first healthy worker that answers (they serve the same model).
async fn models(State(p): State<Arc<Proxy>>) -> Response {
    for w in p.hub.workers() {
        let Some(url) = w.registration.url.as_deref().filter(|_| w.healthy) else {
            continue;
        };
        let Ok(req) = hyper::Request::get(format!("{}/v1/models", url.trim_end_matches('/')))
            .body(Full::new(Bytes::new()))
        else {
            continue;
        };
        let Ok(Ok(resp)) =
            tokio::time::timeout(Duration::from_secs(5), p.client.request(req)).await
        else {
            continue;
        };
        if !resp.status().is_success() {
            continue;
        }
        if let Ok(body) = resp.into_body().collect().await {
            return (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                body.to_bytes(),
            )
                .into_response();
        }
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"object":"list","data":[]}"#,
    )
        .into_response()
}

/// Frees a routed request when dropped, unless already freed.
#[derive(Debug)]
struct Active {
    hub: Arc<Hub>,
    id: Option<String>,
    prefilled: bool,
}

impl Active {
    fn prefilled(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            if let Some(id) = &self.id {
                let _ = self.hub.prefilled(id);
            }
        }
    }

    fn finish(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.hub.finish(&id);
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.finish();
    }
}

fn route(hub: &Hub, tokens: &[u32], overrides: RouteOverrides) -> Result<Routed, OpenAiError> {
    let call = RouteCall {
        request_id: None,
        tokens,
        lora_name: None,
        overrides,
    };
    hub.route(&call, Instant::now())
        .map_err(OpenAiError::from_routing)
}

/// The next-best candidate of `decision` other than `failed`, by cost.
fn runner_up(routed: &Routed, failed: WorkerKey) -> Option<WorkerKey> {
    routed
        .decision
        .candidates
        .iter()
        .filter(|c| c.key.worker != failed.worker)
        .min_by(|a, b| a.logit.total_cmp(&b.logit))
        .map(|c| c.key)
}

async fn send(
    p: &Proxy,
    key: WorkerKey,
    path: &str,
    body: &Bytes,
) -> Result<hyper::Response<Incoming>, String> {
    let url = p
        .hub
        .worker_url(key.worker)
        .ok_or_else(|| format!("worker {} has no url", key.worker))?;
    let req = hyper::Request::post(format!("{}{path}", url.trim_end_matches('/')))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.clone()))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(p.cfg.upstream_timeout, p.client.request(req))
        .await
        .map_err(|_| "no response in time".to_owned())?
        .map_err(|e| e.to_string())?;
    if resp.status().is_server_error() {
        return Err(format!("status {}", resp.status()));
    }
    Ok(resp)
}

async fn forward(p: Arc<Proxy>, path: &str, source: PromptSource, body: Bytes) -> Response {
    let tokens = match prompt_token_ids(&body, source, p.cfg.tokenizer.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            p.hub
                .metrics()
                .drop_input(crate::DropReason::MalformedJson, 1, &e.message);
            return e.into_response();
        }
    };
    let routed = match route(&p.hub, &tokens, RouteOverrides::default()) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut active = Active {
        hub: p.hub.clone(),
        id: Some(routed.request_id.clone()),
        prefilled: false,
    };
    let first = routed.decision.worker;
    let mut served_by = first;
    let resp = match send(&p, first, path, &body).await {
        Ok(r) => r,
        Err(first_error) => {
            active.finish();
            tracing::warn!(worker = %first.worker, "forwarding failed, retrying once: {first_error}");
            let Some(next) = runner_up(&routed, first) else {
                return openai_error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    &format!("worker {} failed: {first_error}", first.worker),
                );
            };
            let overrides = RouteOverrides {
                mode: Some(engine::sched::RouteMode::Direct),
                worker: Some(next.worker),
                ..RouteOverrides::default()
            };
            let retry = match route(&p.hub, &tokens, overrides) {
                Ok(r) => r,
                Err(e) => return e.into_response(),
            };
            active.id = Some(retry.request_id.clone());
            served_by = retry.decision.worker;
            match send(&p, served_by, path, &body).await {
                Ok(r) => r,
                Err(e) => {
                    return openai_error(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        &format!(
                            "workers {} and {} failed: {first_error}; {e}",
                            first.worker, next.worker
                        ),
                    );
                }
            }
        }
    };
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
    if let Ok(v) = HeaderValue::from_str(active.id.as_deref().unwrap_or_default()) {
        headers.insert("x-kvengine-request-id", v);
    }
    headers.insert(
        "x-kvengine-worker-id",
        HeaderValue::from(served_by.worker.0),
    );
    headers.insert("x-kvengine-dp-rank", HeaderValue::from(served_by.dp_rank.0));
    let body = Body::new(Relay {
        inner: incoming,
        active,
        sse,
        done: false,
    });
    let mut out = Response::new(body);
    *out.status_mut() = parts.status;
    *out.headers_mut() = headers;
    out
}

/// The worker's answer on its way to the client: marks the request prefilled at the first
/// chunk, frees it at the end (or when dropped: the client went away), and turns a
/// mid-stream failure into an SSE error event.
struct Relay {
    inner: Incoming,
    active: Active,
    sse: bool,
    done: bool,
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data() {
                    self.active.prefilled();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.done = true;
                self.active.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                self.active.finish();
                tracing::warn!("worker failed mid-answer: {e}");
                if self.sse {
                    let error = OpenAiError {
                        status: StatusCode::BAD_GATEWAY,
                        kind: "upstream_error",
                        message: format!("the worker failed mid-stream: {e}"),
                        param: None,
                        code: None,
                    };
                    let event = format!("data: {}\n\n", error.body());
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
                } else {
                    Poll::Ready(Some(Err(std::io::Error::other(e))))
                }
            }
        }
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("active", &self.active)
            .field("sse", &self.sse)
            .finish_non_exhaustive()
    }
}
