//! What every handler of the HTTP edge shares, below the handlers and the router that
//! routes to them: the edge's configuration ([`HttpConfig`] and its defaults), the state
//! axum hands each handler (`AppState`: the hub, the configuration, the `POST /v1/events`
//! streams), request bodies read under the edge's bounds ([`read_body`]; `RawBody` for the
//! JSON endpoints), the peer's address (`Peer`) and the counting of malformed bodies
//! (`malformed`, `decode`). The OpenAI front door reads its bodies here too.
//!
//! # Invariants
//! 1. A body is read whole only within its limit and deadline: a larger `Content-Length`
//!    is refused before anything is read, a body that grows past the limit or does not
//!    arrive in time is refused as it happens; each refusal is counted on the hub's
//!    metrics.
//! 2. No lock here is held across an await; a poisoned lock is taken over (`lock`), never
//!    a panic.

use super::api_error::ApiError;
use crate::error::{DropReason, TransportError};
use crate::hub::Hub;
use crate::stream::EventStream;
use axum::extract::{FromRequest, Request};
use bytes::Bytes;
use engine::{WorkerId, WorkerKey};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};

/// Default [`HttpConfig::max_prompt_tokens`] (and the front door's, for a model whose
/// tokenizer does not say its maximum length): 1,048,576 tokens, above every served model's
/// context window today.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 1 << 20;

/// The body limit that fits `max_prompt_tokens`: every id as its longest JSON number and a
/// separator (11 bytes), plus 1 MiB for the rest, and never below 16 MiB (chat requests
/// carry more than their tokens: images as data URLs, tool schemas).
pub fn body_limit_for(max_prompt_tokens: usize) -> usize {
    max_prompt_tokens
        .saturating_mul(11)
        .saturating_add(1 << 20)
        .max(16 << 20)
}

/// Default [`HttpConfig::max_body_bytes`]: the limit that fits the default prompt cap
/// (12 MiB of ids; so 16 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// How long a body refused from its declared length is still read (and dropped).
const BODY_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// Default [`HttpConfig::body_timeout`]: 30 s to send a body (64 MiB at 17 Mbit/s).
pub const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How the HTTP edge is set up.
#[derive(Clone)]
pub struct HttpConfig {
    /// Bodies over this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// The workers' event sources ([`crate::sources`]): a worker registered over
    /// `POST /v1/workers` gets its sources started, one removed has them stopped first.
    /// `None`: registrations start no source (the caller feeds events itself).
    pub sources: Option<Arc<crate::sources::Sources>>,
    /// The bearer token control calls (`POST`/`DELETE /v1/workers`, `/v1/events`,
    /// `/v1/load`) must carry; `None`: control calls only from this host (see `admin`).
    pub admin_token: Option<String>,
    /// The bearer token routing calls (`/v1/route`, `/v1/overlap`, `/v1/requests/...`)
    /// must carry (the admin token passes too); `None`: the routing API is open.
    pub routing_token: Option<String>,
    /// Prompts of more tokens are refused (400 `prompt_too_long`) as they are scanned.
    pub max_prompt_tokens: usize,
    /// How long a client may take to send a request body once its headers arrived;
    /// slower ones get 408 `body_timeout`.
    pub body_timeout: std::time::Duration,
    /// The hosts `POST /v1/workers` may name in `url`, `zmq` and `replay`: exact names or
    /// addresses, or `*.suffix`; empty: any host.
    pub worker_hosts: Vec<String>,
    /// The cores' runtimes: a worker is removed on its home core, after its streams stop,
    /// so none of its batches lands after the removal ([`crate::cores::on_home`]).
    pub homes: Option<crate::cores::Homes>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            sources: None,
            admin_token: None,
            routing_token: None,
            max_prompt_tokens: DEFAULT_MAX_PROMPT_TOKENS,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            worker_hosts: Vec::new(),
            homes: None,
        }
    }
}

impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("max_body_bytes", &self.max_body_bytes)
            .field("sources", &self.sources.is_some())
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .field(
                "routing_token",
                &self.routing_token.as_ref().map(|_| "<set>"),
            )
            .field("body_timeout", &self.body_timeout)
            .field("max_prompt_tokens", &self.max_prompt_tokens)
            .field("worker_hosts", &self.worker_hosts)
            .finish()
    }
}

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub hub: Arc<Hub>,
    pub cfg: HttpConfig,
    /// Event streams of `POST /v1/events` batches that carry a `seq`, per worker rank.
    fences: Mutex<HashMap<WorkerKey, Arc<tokio::sync::Mutex<EventStream>>>>,
}

pub(crate) type AppState = Arc<Shared>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// The state of an edge over `hub` set up by `cfg`, no event stream yet.
    pub(crate) fn new(hub: Arc<Hub>, cfg: HttpConfig) -> Self {
        Self {
            hub,
            cfg,
            fences: Mutex::new(HashMap::new()),
        }
    }

    /// The event stream of `key` (created on first use).
    pub fn event_stream(&self, key: WorkerKey) -> Arc<tokio::sync::Mutex<EventStream>> {
        lock(&self.fences).entry(key).or_default().clone()
    }

    /// Forgets the fences of `worker`'s ranks.
    pub fn forget_fences(&self, worker: WorkerId) {
        lock(&self.fences).retain(|k, _| k.worker != worker);
    }
}

/// A request body, buffered up to the configured limit.
#[derive(Debug)]
pub(crate) struct RawBody(pub Bytes);

impl FromRequest<AppState> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let (limit, deadline) = (state.cfg.max_body_bytes, state.cfg.body_timeout);
        match read_body(req, limit, deadline, &state.hub).await {
            Ok(b) => Ok(RawBody(b)),
            Err(e @ BodyError::TooLarge { .. }) => Err(ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                e.to_string(),
            )),
            Err(e @ BodyError::Timeout { .. }) => Err(ApiError::new(
                axum::http::StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                e.to_string(),
            )),
            Err(e @ BodyError::Unreadable(_)) => Err(ApiError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "bad_body",
                e.to_string(),
            )),
        }
    }
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Past the limit (declared or sent).
    #[error("request body exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Not all of it arrived in time.
    #[error("the request body did not arrive within {} s", .deadline.as_secs_f64())]
    Timeout {
        /// The deadline.
        deadline: std::time::Duration,
    },
    /// The connection failed or the framing was bad.
    #[error("cannot read the request body: {0}")]
    Unreadable(String),
}

/// Reads `req`'s whole body: at most `limit` bytes (a larger `Content-Length` is refused
/// before anything is read), all of it within `deadline` of the headers. Refusals are
/// counted on `hub`'s metrics (oversized drops, body timeouts). Every edge endpoint that
/// takes a body reads it here: the routing and control APIs (`RawBody`) and the OpenAI
/// front door.
pub async fn read_body(
    req: Request,
    limit: usize,
    deadline: std::time::Duration,
    hub: &Hub,
) -> Result<Bytes, BodyError> {
    use http_body_util::BodyExt;
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let too_large = |got: u64| {
        let e = TransportError::Oversized {
            what: "request body",
            got: usize::try_from(got).unwrap_or(usize::MAX),
            limit,
        };
        hub.metrics().drop_input(DropReason::Oversized, 1, &e);
        BodyError::TooLarge { limit }
    };
    if let Some(n) = declared
        && n > limit as u64
    {
        // Refused from its declared length, without buffering any of it. What the client
        // already sent is read and dropped for a moment (at most 1 MiB past the limit, 1 s):
        // closing with it unread would reset the connection and could destroy the 413 on
        // its way (a lingering close, as nginx does).
        let linger = u64::try_from(limit)
            .unwrap_or(u64::MAX)
            .saturating_add(1 << 20);
        let mut body = req.into_body().into_data_stream();
        let drain = async {
            use futures_util::StreamExt;
            let mut seen = 0u64;
            while seen < n.min(linger) {
                match body.next().await {
                    Some(Ok(chunk)) => seen += chunk.len() as u64,
                    _ => break,
                }
            }
        };
        let _ = tokio::time::timeout(BODY_LINGER, drain).await;
        return Err(too_large(n));
    }
    let body = http_body_util::Limited::new(req.into_body(), limit);
    match tokio::time::timeout(deadline, body.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(too_large(limit as u64 + 1))
        }
        Ok(Err(e)) => Err(BodyError::Unreadable(e.to_string())),
        Err(_) => {
            hub.metrics().edge.body_timeouts.fetch_add(1, Relaxed);
            Err(BodyError::Timeout { deadline })
        }
    }
}

/// The peer's address, if the server supplied it ([`super::serve_http`] and
/// [`super::edge_tls::serve_https`] always do).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub Option<std::net::SocketAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Peer(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0),
        ))
    }
}

/// Counts a malformed JSON body and turns the error into a response.
pub(crate) fn malformed(hub: &Hub, e: TransportError) -> ApiError {
    hub.metrics().drop_input(e.reason(), 1, &e);
    ApiError::from(e)
}

/// Decodes a small JSON body with serde, counting failures as malformed JSON.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    hub: &Hub,
    body: &[u8],
) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| malformed(hub, TransportError::MalformedJson(e.to_string())))
}
