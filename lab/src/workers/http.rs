//! A worker's OpenAI-compatible HTTP server (axum): `/health`, `/v1/models`, `/load`,
//! `/v1/completions` and `/v1/chat/completions`, answered whole or streamed as server-sent
//! events, one chunk per token as the driver produces it; SGLang's simulated bootstrap,
//! `GET /sim/bootstrap/{room}` ([`super::bootstrap`]); and, on a worker serving
//! TensorRT-LLM's events only, `POST /kv_cache_events` ([`super::trtllm`]: every event
//! buffered since the last call, as a JSON array, emptying the buffer).
//!
//! Like vLLM's server, a worker with an API key answers 401 `{"error": "Unauthorized"}` to
//! any request under `/v1` (unknown paths included) without `Authorization: Bearer KEY`,
//! and a completion whose `model` is not the served one gets vLLM's 404
//! ([`super::openai::model_not_found`]).
//!
//! A disaggregated request ([`super::disagg`]) goes through [`super::handoff`]: a decode
//! side first receives its prompt's KV, a prefill side generates one token and its answer
//! carries what the decode side needs.
//!
//! With [`super::SimWorkerConfig::vllm_metrics`], `GET /metrics` serves vLLM's load gauges
//! (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, labelled with the engine's
//! data-parallel rank), from the driver's last snapshot. Outermost, the fault layer
//! ([`super::faults`]) answers 500 to completions and health checks while the worker is
//! made sick ([`super::HttpMode::Fail500`]) and counts completions answered 200.
//!
//! # Invariants
//! 1. Every malformed request gets a 4xx OpenAI error (a 404 for an unknown model, in vLLM's
//!    shape; a 401 for a missing key, vLLM's bare body); only a worker that is shutting down
//!    answers 503, only a decode side whose prefill cannot be reached answers 502 (before
//!    any token), and only a worker made sick answers 500.
//! 2. A request whose client goes away (its response future or stream dropped) is aborted in
//!    the engine: its output channel closes and an abort command is sent.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use engine::RequestId;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};

use super::bootstrap::{self, RoomGuard};
use super::command::{Command, Delivery, Snapshot};
use super::disagg::{Disagg, Side};
use super::faults::{Faults, HttpMode};
use super::handoff::{self, Handoff};
use super::openai::{Api, Envelope, OpenAiError, Usage, model_not_found, parse};
use super::role::SimRole;
use super::tokens::{Prompter, token_text};
use super::trtllm::TrtllmEvents;
use sim::SimError;

/// What every handler shares.
#[derive(Debug)]
pub(super) struct AppState {
    pub(super) commands: mpsc::Sender<Command>,
    /// TensorRT-LLM's event buffer (`POST /kv_cache_events`), on a worker serving that
    /// format.
    pub(super) trtllm: Option<Arc<TrtllmEvents>>,
    pub(super) snapshot: watch::Receiver<Snapshot>,
    pub(super) model: String,
    /// Required on `/v1` requests when set (vLLM's `--api-key`); never logged.
    pub(super) api_key: Option<String>,
    pub(super) prompter: Prompter,
    pub(super) role: SimRole,
    pub(super) handoff: Handoff,
    /// The fault state (the mode the fault layer reads, the counters it adds to).
    pub(super) faults: Arc<Faults>,
    /// The engine's data-parallel rank (the `engine` label of `/metrics`).
    pub(super) dp_rank: u32,
}

/// The worker's routes.
pub(super) fn router(state: Arc<AppState>, max_body_bytes: usize, vllm_metrics: bool) -> Router {
    let routes = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/load", get(load))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/sim/bootstrap/{room}", get(bootstrap_room));
    let routes = if vllm_metrics {
        routes.route("/metrics", get(metrics))
    } else {
        routes
    };
    // Only TensorRT-LLM serves its events over HTTP: elsewhere the path is unknown (404).
    let routes = if state.trtllm.is_some() {
        routes.route("/kv_cache_events", post(kv_cache_events))
    } else {
        routes
    };
    let routes = routes.layer(DefaultBodyLimit::max(max_body_bytes));
    // Layered last so that it also covers the fallback: vLLM refuses an unknown `/v1` path
    // without the key too (401 before 404).
    let routes = if state.api_key.is_some() {
        routes.layer(middleware::from_fn_with_state(state.clone(), require_key))
    } else {
        routes
    };
    // Outermost: a sick worker answers 500 before anything else looks at the request.
    let routes = routes.layer(middleware::from_fn_with_state(state.clone(), fault_layer));
    routes.with_state(state)
}

/// [`HttpMode::Fail500`]'s 500s, and the completion counters (see the module docs).
async fn fault_layer(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let completion = req.method() == Method::POST
        && (path == "/v1/completions" || path == "/v1/chat/completions");
    let health = req.method() == Method::GET && path == "/health";
    let counters = &s.faults.counters;
    if s.faults.mode() == HttpMode::Fail500 && (completion || health) {
        if completion {
            counters.failed.fetch_add(1, Relaxed);
        }
        let body = json!({"error": {"message": "injected failure", "type": "server_error",
                                    "code": 500}});
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
    }
    let response = next.run(req).await;
    if completion && response.status() == StatusCode::OK {
        counters.completions.fetch_add(1, Relaxed);
    }
    response
}

/// vLLM's `--api-key` check: a request under `/v1` (other than a CORS preflight, which
/// vLLM lets through) without the key is answered 401 `{"error": "Unauthorized"}`.
async fn require_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key
        && req.method() != Method::OPTIONS
        && req.uri().path().starts_with("/v1")
        && !bearer_matches(req.headers(), key)
    {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "Unauthorized"})),
        )
            .into_response();
    }
    next.run(req).await
}

/// Whether `Authorization` carries `key`, read as vLLM reads it: the scheme before the first
/// space, case-insensitively `bearer`, and everything after that space exactly the key.
fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return false;
    };
    let value = value.as_bytes();
    let Some(space) = value.iter().position(|&b| b == b' ') else {
        return false;
    };
    let (scheme, token) = (&value[..space], &value[space + 1..]);
    scheme.eq_ignore_ascii_case(b"bearer") && token == key.as_bytes()
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.model, "object": "model", "created": 0, "owned_by": "kvengine-sim",
    }]}))
}

async fn load(State(s): State<Arc<AppState>>) -> Json<Value> {
    let snap = *s.snapshot.borrow();
    let (l, st) = (snap.load, snap.stats);
    Json(json!({
        "num_requests_waiting": l.num_requests_waiting,
        "num_requests_running": l.num_requests_running,
        "kv_usage": l.kv_usage,
        "role": s.role.as_str(),
        "sim_time_secs": snap.sim_time.as_secs_f64(),
        "requests": st.requests,
        "finished": st.finished,
        "aborted": st.aborted,
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "prefill_tokens": st.prefill_tokens,
        "decode_tokens": st.decode_tokens,
        "remote_prefills": st.remote_prefills,
        "transferred_tokens": st.transferred_tokens,
        "output_tokens": st.output_tokens,
        "preemptions": st.preemptions,
        "cached_blocks": st.cached_blocks,
        "kv_blocks": st.kv_blocks,
        "stored_blocks": st.stored_blocks,
    }))
}

/// vLLM's load gauges, as its `/metrics` page names them (the router's load scrape reads
/// these two).
async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let load = s.snapshot.borrow().load;
    let page = format!(
        "vllm:num_requests_waiting{{engine=\"{rank}\"}} {}\n\
         vllm:kv_cache_usage_perc{{engine=\"{rank}\"}} {}\n",
        load.num_requests_waiting,
        load.kv_usage,
        rank = s.dp_rank
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], page).into_response()
}

/// `trtllm-serve`'s `POST /kv_cache_events`: every buffered event, oldest first (`[]`
/// when none), the buffer emptied.
async fn kv_cache_events(State(s): State<Arc<AppState>>) -> Response {
    match &s.trtllm {
        Some(events) => Json(events.drain()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn bootstrap_room(State(s): State<Arc<AppState>>, Path(room): Path<String>) -> Response {
    bootstrap::serve(s.handoff.rooms.as_deref(), &room).await
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(&s, Api::Completions, &body).await
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(&s, Api::Chat, &body).await
}

/// The engine's refusal of a request, as a 400.
fn refusal(e: &SimError) -> OpenAiError {
    let mut err = OpenAiError::invalid(None, e.to_string());
    if matches!(e, SimError::RequestTooLarge { .. }) {
        err.message =
            format!("{e}: the prompt plus max_tokens does not fit in this worker's KV cache");
        err.code = Some("context_length_exceeded");
    }
    err
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sends an abort for its request when dropped before the request finished.
#[derive(Debug)]
struct AbortGuard {
    id: RequestId,
    commands: mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            // Best effort: the driver also notices the closed output channel.
            let _ = self.commands.try_send(Command::Abort(self.id));
        }
    }
}

async fn serve(s: &AppState, api: Api, body: &[u8]) -> Response {
    let parsed = match parse(api, body, &s.prompter) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // No model named means the served one, as in vLLM.
    if let Some(requested) = &parsed.model
        && *requested != s.model
    {
        let (status, body) = model_not_found(requested);
        return (status, Json(body)).into_response();
    }
    let side = parsed.disagg.side(s.role);
    // A decode side first receives the prompt's KV (502 if its prefill cannot be reached).
    let remote_prefill = match side {
        Side::Decode => match handoff::receive(&s.handoff, &s.commands, &parsed).await {
            Ok(r) => Some(r),
            Err(e) => return e.into_response(),
        },
        Side::Whole | Side::Prefill => None,
    };
    let max_tokens = match side {
        Side::Prefill => 1,
        Side::Whole | Side::Decode => parsed.max_tokens,
    };
    // Before the request is queued, so that any refusal fails the room.
    let room = match (&parsed.disagg, &s.handoff.rooms, side) {
        (Disagg::Sglang(b), Some(rooms), Side::Prefill) => {
            Some(RoomGuard::new(rooms.clone(), b.room))
        }
        _ => None,
    };
    let needs_prompt = matches!(parsed.disagg, Disagg::VllmPrefill);
    let prompt = needs_prompt.then(|| parsed.prompt.clone());
    let (out, rx) = mpsc::unbounded_channel();
    let (ack, acked) = oneshot::channel();
    let add = Command::Add {
        prompt: parsed.prompt,
        max_tokens,
        remote_prefill,
        out,
        ack,
    };
    if s.commands.send(add).await.is_err() {
        return OpenAiError::unavailable("the simulated worker is shutting down").into_response();
    }
    let id = match acked.await {
        Ok(Ok(id)) => id,
        Ok(Err(e)) => return refusal(&e).into_response(),
        Err(_) => {
            return OpenAiError::unavailable("the simulated worker is shutting down")
                .into_response();
        }
    };
    let guard = AbortGuard {
        id,
        commands: s.commands.clone(),
        armed: true,
    };
    let prefix = match api {
        Api::Completions => "cmpl",
        Api::Chat => "chatcmpl",
    };
    let env = Envelope {
        api,
        id: format!("{prefix}-{}", id.0),
        created: unix_now(),
        model: s.model.clone(),
    };
    if parsed.stream {
        return stream(env, rx, guard, parsed.include_usage, room);
    }
    let got = match whole(rx, guard, room).await {
        Ok(got) => got,
        Err(e) => return e.into_response(),
    };
    let mut answer = env.answer(got.text, &got.usage);
    let done = handoff::Prefilled {
        id,
        first_token: got.first_token,
        prompt,
    };
    if let Err(e) =
        handoff::annotate(&s.handoff, &s.commands, &parsed.disagg, done, &mut answer).await
    {
        return e.into_response();
    }
    Json(answer).into_response()
}

/// A whole answer's parts.
struct Collected {
    text: String,
    usage: Usage,
    /// The first generated token.
    first_token: u32,
}

/// Waits for the whole answer.
async fn whole(
    mut rx: mpsc::UnboundedReceiver<Delivery>,
    mut guard: AbortGuard,
    mut room: Option<RoomGuard>,
) -> Result<Collected, OpenAiError> {
    let mut got = Collected {
        text: String::new(),
        usage: Usage::default(),
        first_token: 0,
    };
    while let Some(d) = rx.recv().await {
        match d {
            Delivery::First {
                token,
                prompt_tokens,
                cached_tokens,
            } => {
                if let Some(room) = &mut room {
                    room.done(prompt_tokens);
                }
                got.usage.prompt_tokens = prompt_tokens;
                got.usage.cached_tokens = cached_tokens;
                got.first_token = token;
                got.text.push_str(&token_text(token));
            }
            Delivery::Token(token) => got.text.push_str(&token_text(token)),
            Delivery::Finished { output_tokens } => {
                guard.armed = false;
                got.usage.completion_tokens = output_tokens;
                return Ok(got);
            }
        }
    }
    Err(OpenAiError::unavailable(
        "the simulated worker is shutting down",
    ))
}

/// The state of one event stream.
struct Streaming {
    env: Envelope,
    rx: mpsc::UnboundedReceiver<Delivery>,
    guard: AbortGuard,
    include_usage: bool,
    usage: Usage,
    pending: VecDeque<Event>,
    done: bool,
    /// An SGLang prefill's room, marked done at the first token.
    room: Option<RoomGuard>,
}

fn event(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl Streaming {
    /// Queues the chunks of one delivery.
    fn push(&mut self, d: Delivery) {
        match d {
            Delivery::First {
                token,
                prompt_tokens,
                cached_tokens,
            } => {
                if let Some(room) = &mut self.room {
                    room.done(prompt_tokens);
                }
                self.usage.prompt_tokens = prompt_tokens;
                self.usage.cached_tokens = cached_tokens;
                if let Some(role) = self.env.role_chunk() {
                    self.pending.push_back(event(&role));
                }
                let chunk = self.env.token_chunk(token_text(token));
                self.pending.push_back(event(&chunk));
            }
            Delivery::Token(token) => {
                let chunk = self.env.token_chunk(token_text(token));
                self.pending.push_back(event(&chunk));
            }
            Delivery::Finished { output_tokens } => {
                self.guard.armed = false;
                self.usage.completion_tokens = output_tokens;
                self.pending.push_back(event(&self.env.finish_chunk()));
                if self.include_usage {
                    let chunk = self.env.usage_chunk(&self.usage);
                    self.pending.push_back(event(&chunk));
                }
                self.pending.push_back(Event::default().data("[DONE]"));
                self.done = true;
            }
        }
    }
}

/// Streams the answer as server-sent events, each chunk sent as soon as it is produced.
fn stream(
    env: Envelope,
    rx: mpsc::UnboundedReceiver<Delivery>,
    guard: AbortGuard,
    include_usage: bool,
    room: Option<RoomGuard>,
) -> Response {
    let state = Streaming {
        env,
        rx,
        guard,
        include_usage,
        usage: Usage::default(),
        pending: VecDeque::new(),
        done: false,
        room,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(ev), st));
            }
            if st.done {
                return None;
            }
            match st.rx.recv().await {
                Some(d) => st.push(d),
                None => {
                    // The worker stopped mid-request.
                    st.done = true;
                    st.pending.push_back(event(
                        &OpenAiError::unavailable("the simulated worker is shutting down").body(),
                    ));
                }
            }
        }
    });
    (StatusCode::OK, Sse::new(events)).into_response()
}
