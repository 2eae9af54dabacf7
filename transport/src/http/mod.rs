//! The HTTP edge: JSON endpoints over the [`Hub`] (routing, overlap queries, KV events,
//! worker registry, load reports), Prometheus metrics and worker health checks. The
//! contract is documented in `docs/api.md`.
//! [`serve_http`] serves it over plain TCP, [`tls::serve_https`] over TLS.
//!
//! # Concurrency
//! Handlers never hold a hub lock across an await: every hub call is synchronous and made
//! after the body is read. Event batches (one engine round trip per event) run on the
//! blocking pool so they never stall the routing path.
//!
//! # Invariants
//! 1. No input reaches a panic; every refusal is a JSON error (see [`errors`]).
//! 2. Bodies larger than [`HttpConfig::max_body_bytes`] are refused with 413 before being
//!    buffered past the limit.

mod admin;
pub mod errors;
mod events;
pub mod health;
pub mod metrics_text;
pub mod process;
pub mod prompt;
mod routing;
pub mod scrape;
pub mod tls;
mod workers;

use crate::error::{DropReason, TransportError};
use crate::hub::{Hub, Registration};
use crate::stream::EventStream;
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, Request};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use engine::{WorkerId, WorkerKey};
use errors::ApiError;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

/// Default [`HttpConfig::max_body_bytes`]: 64 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;

/// Whether the addresses of `reg` (`url`, `zmq`, `replay`) are all allowed by `allowed`
/// (`--worker-hosts`), checked as `POST /v1/workers` checks them; the reason if not. For
/// registrations that come from elsewhere than the API (a snapshot's).
pub(crate) fn check_registration_hosts(
    allowed: &[String],
    reg: &Registration,
) -> Result<(), String> {
    for (what, addr) in [
        ("url", &reg.url),
        ("zmq", &reg.zmq),
        ("replay", &reg.replay),
    ] {
        if let Some(a) = addr {
            workers::check_host(allowed, what, a).map_err(|e| e.message)?;
        }
    }
    Ok(())
}

/// Called after a worker registers (with its merged registration).
pub type RegisterHook = Arc<dyn Fn(&Registration) + Send + Sync>;
/// Called after a worker is removed.
pub type RemoveHook = Arc<dyn Fn(WorkerId) + Send + Sync>;

/// How the HTTP edge is set up.
#[derive(Clone)]
pub struct HttpConfig {
    /// Bodies over this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// Called after every successful `POST /v1/workers` (e.g. to subscribe to its ZMQ
    /// publisher). Runs on the async runtime: it must not block.
    pub on_register: Option<RegisterHook>,
    /// Called after every successful `DELETE /v1/workers/{id}`. Must not block.
    pub on_remove: Option<RemoveHook>,
    /// The bearer token control calls (`POST`/`DELETE /v1/workers`, `/v1/events`,
    /// `/v1/load`) must carry; `None`: control calls only from this host (see `admin`).
    pub admin_token: Option<String>,
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
            on_register: None,
            on_remove: None,
            admin_token: None,
            worker_hosts: Vec::new(),
            homes: None,
        }
    }
}

impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("max_body_bytes", &self.max_body_bytes)
            .field("on_register", &self.on_register.is_some())
            .field("on_remove", &self.on_remove.is_some())
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
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
        match Bytes::from_request(req, state).await {
            Ok(b) => Ok(RawBody(b)),
            Err(rejection) if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                let limit = state.cfg.max_body_bytes;
                let e = TransportError::Oversized {
                    what: "request body",
                    got: limit.saturating_add(1),
                    limit,
                };
                state.hub.metrics().drop_input(DropReason::Oversized, 1, &e);
                Err(ApiError::new(
                    axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("request body exceeds the limit of {limit} bytes"),
                ))
            }
            Err(rejection) => Err(ApiError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "bad_body",
                rejection.body_text(),
            )),
        }
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

/// The edge's routes over `hub` (see `docs/api.md`).
pub fn router(hub: Arc<Hub>, cfg: HttpConfig) -> Router {
    let limit = cfg.max_body_bytes;
    let state: AppState = Arc::new(Shared {
        hub,
        cfg,
        fences: Mutex::new(HashMap::new()),
    });
    let admin = axum::middleware::from_fn_with_state(state.clone(), admin::require_admin);
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/live", get(health::healthz))
        .route("/ready", get(health::ready))
        .route("/health", get(health::health))
        .route("/metrics", get(metrics_text::metrics))
        .route("/v1/overlap", post(routing::overlap))
        .route("/v1/route", post(routing::route))
        .route("/v1/requests/{id}/prefilled", post(routing::prefilled))
        .route("/v1/requests/{id}", delete(routing::finish))
        // Control calls: the admin gate first (module `admin`).
        .route(
            "/v1/events",
            post(events::post_events).route_layer(admin.clone()),
        )
        .route(
            "/v1/workers",
            get(workers::list).merge(post(workers::register).route_layer(admin.clone())),
        )
        .route(
            "/v1/workers/{id}",
            delete(workers::remove).route_layer(admin.clone()),
        )
        .route("/v1/load", post(workers::load).route_layer(admin))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves `router` on `listener` (TCP_NODELAY on every connection) until `shutdown`
/// resolves, then finishes the requests in flight.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), TransportError> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("could not set TCP_NODELAY: {e}");
        }
    });
    // The peer address feeds the admin gate (control calls from this host only, without a
    // token).
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
    .map_err(|source| TransportError::Io {
        context: "serving HTTP".into(),
        source,
    })
}
