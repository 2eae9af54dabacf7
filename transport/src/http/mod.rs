//! The HTTP edge: JSON endpoints over the [`Hub`] (routing, overlap queries, KV events,
//! worker registry, load reports), Prometheus metrics and worker health checks. The
//! contract is documented in `docs/api.md`.
//! [`serve_http`] serves it over plain TCP, [`edge_tls::serve_https`] over TLS.
//!
//! # Concurrency
//! Handlers never hold a hub lock across an await: every hub call is synchronous and made
//! after the body is read. Event batches (one engine round trip per event) run on the
//! blocking pool so they never stall the routing path.
//!
//! # Invariants
//! 1. No input reaches a panic; every refusal is a JSON error (see [`api_error`]).
//! 2. Bodies larger than [`HttpConfig::max_body_bytes`] are refused with 413 before being
//!    buffered past the limit.

mod admin;
pub mod api_error;
pub mod conn;
pub mod edge_tls;
mod events;
pub mod health;
pub mod metrics_text;
mod misses;
pub mod placement;
pub mod process;
pub mod route_body;
mod routing;
pub mod scrape;
mod shared;
pub mod turns;
mod workers;

pub use shared::{
    BodyError, DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_TOKENS, HttpConfig,
    body_limit_for, read_body,
};

use crate::error::TransportError;
use crate::hub::Hub;
use api_error::ApiError;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use shared::{AppState, Shared};
use std::future::Future;
use std::sync::Arc;

/// The edge's routes over `hub` (see `docs/api.md`).
pub fn router(hub: Arc<Hub>, cfg: HttpConfig) -> Router {
    let limit = cfg.max_body_bytes;
    let state: AppState = Arc::new(Shared::new(hub, cfg));
    let admin = axum::middleware::from_fn_with_state(state.clone(), admin::require_admin);
    let routing = axum::middleware::from_fn_with_state(state.clone(), admin::require_routing);
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/live", get(health::healthz))
        .route("/ready", get(health::ready))
        .route("/health", get(health::health))
        .route("/metrics", get(metrics_text::metrics))
        // The routing API: its own optional token (module `admin`).
        .route(
            "/v1/overlap",
            post(routing::overlap).route_layer(routing.clone()),
        )
        .route(
            "/v1/route",
            post(routing::route).route_layer(routing.clone()),
        )
        .route(
            "/v1/requests/{id}/prefilled",
            post(routing::prefilled).route_layer(routing.clone()),
        )
        .route(
            "/v1/requests/{id}",
            delete(routing::finish).route_layer(routing),
        )
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
        .route("/v1/misses", get(misses::recent))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves `router` on `listener` over plain HTTP (TCP_NODELAY on every connection) with
/// the default connection bounds ([`conn`]) until `shutdown` resolves, then finishes the
/// requests in flight. `kvengine` itself calls [`conn::serve`] with its flags.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), TransportError> {
    let edge = conn::Edge {
        router,
        tls: None,
        limits: conn::ConnLimits::default(),
        counters: Arc::default(),
        placement: None,
    };
    conn::serve(listener, edge, shutdown).await
}
