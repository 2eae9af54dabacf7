//! Who may change the router: the control-plane endpoints (registering and removing workers,
//! KV events, load reports) re-point prompts and rewrite the index, so anyone able to reach
//! port 8000 must not be able to call them.
//!
//! * With an admin token (`--admin-token`), a control call must carry
//!   `Authorization: Bearer <token>`; otherwise 401 `unauthorized`.
//! * Without one, only clients on this host (a loopback peer address) may make control
//!   calls; others get 403 `admin_forbidden`, which names the flag. The read and routing
//!   endpoints (`/v1/route`, `/v1/overlap`, `/v1/requests/...`, `GET /v1/workers`,
//!   `/metrics`, health) stay open: front ends call them per request.
//! * The routing API (`/v1/route`, `/v1/overlap`, `/v1/requests/...`) takes its own token,
//!   `--routing-token`, separate from the admin token (front ends hold it; they need not
//!   hold the power to re-point workers). With it set, a routing call must present it or
//!   the admin token; without it, the routing API is open (each client's reservations are
//!   still its own and capped: `crate::reservations`).
//!
//! # Invariants
//! 1. A control call from a peer whose address is unknown (a router served without
//!    [`axum::extract::ConnectInfo`]) is refused unless it carries the token: the gate fails
//!    closed. [`super::serve_http`] and [`super::edge_tls::serve_https`] always supply the
//!    peer address.
//! 2. Tokens are compared by digest, in constant time (no timing hint); refusals are counted
//!    ([`crate::DropReason::Unauthorized`]) and logged without the presented secret.

use super::api_error::ApiError;
use super::shared::AppState;
use crate::error::{DropReason, TransportError};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;

/// Middleware on every control endpoint (see the module docs).
pub(crate) async fn require_admin(
    State(st): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    match check(st.cfg.admin_token.as_deref(), req.headers(), peer) {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            let e = TransportError::Unauthorized(refusal.reason());
            st.hub.metrics().drop_input(
                DropReason::Unauthorized,
                1,
                &format!("{e} (peer {peer:?})"),
            );
            refusal.into_response()
        }
    }
}

/// Why a control call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A token is configured and the call did not present it.
    BadToken,
    /// No token is configured and the peer is not on this host.
    NotLocal,
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Refusal::BadToken => "control call without the admin token",
            Refusal::NotLocal => "control call from another host and no admin token set",
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::BadToken => {
                let mut r = ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "this endpoint changes the router: send Authorization: Bearer <admin token>",
                )
                .into_response();
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer"),
                );
                r
            }
            Refusal::NotLocal => ApiError::new(
                StatusCode::FORBIDDEN,
                "admin_forbidden",
                "this endpoint changes the router and is open to this host only; start \
                 kvengine with --admin-token (KVENGINE_ADMIN_TOKEN) to manage it from others",
            )
            .into_response(),
        }
    }
}

/// The decision, on its own for tests: `token` configured, the request's headers, its peer.
pub(crate) fn check(
    token: Option<&str>,
    headers: &HeaderMap,
    peer: Option<SocketAddr>,
) -> Result<(), Refusal> {
    match token {
        Some(token) => match bearer(headers) {
            Some(p) if same_secret(p, token) => Ok(()),
            _ => Err(Refusal::BadToken),
        },
        None => match peer {
            Some(addr) if addr.ip().to_canonical().is_loopback() => Ok(()),
            _ => Err(Refusal::NotLocal),
        },
    }
}

/// Compares SHA-256 digests rather than the strings, and those in constant time: how long
/// the comparison takes says nothing about the token, not even its length.
pub(crate) fn same_secret(presented: &str, token: &str) -> bool {
    use ring::digest::{SHA256, digest};
    let (a, b) = (
        digest(&SHA256, presented.as_bytes()),
        digest(&SHA256, token.as_bytes()),
    );
    let diff = a
        .as_ref()
        .iter()
        .zip(b.as_ref())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The bearer token a request presents, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Middleware on the routing API (`/v1/route`, `/v1/overlap`, `/v1/requests/...`): with
/// `--routing-token`, a call must present it (or the admin token); without one, the
/// routing API is open.
pub(crate) async fn require_routing(
    State(st): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = st.cfg.routing_token.as_deref() else {
        return next.run(req).await;
    };
    let ok = bearer(req.headers()).is_some_and(|p| {
        same_secret(p, token)
            || st
                .cfg
                .admin_token
                .as_deref()
                .is_some_and(|admin| same_secret(p, admin))
    });
    if ok {
        return next.run(req).await;
    }
    let e = TransportError::Unauthorized("routing call without the routing token");
    st.hub.metrics().drop_input(DropReason::Unauthorized, 1, &e);
    let mut r = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "the routing API needs a token: send Authorization: Bearer <routing token>",
    )
    .into_response();
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, value.parse().unwrap());
        h
    }

    #[test]
    fn without_a_token_only_loopback_peers_pass() {
        let none = HeaderMap::new();
        for ok in ["127.0.0.1:9", "[::1]:9", "[::ffff:127.0.0.1]:9"] {
            assert_eq!(
                check(None, &none, Some(ok.parse().unwrap())),
                Ok(()),
                "{ok}"
            );
        }
        for bad in ["10.0.0.5:9", "[2001:db8::1]:9", "0.0.0.0:9"] {
            assert_eq!(
                check(None, &none, Some(bad.parse().unwrap())),
                Err(Refusal::NotLocal),
                "{bad}"
            );
        }
        assert_eq!(
            check(None, &none, None),
            Err(Refusal::NotLocal),
            "unknown peer"
        );
        // A token presented where none is configured does not open the door.
        assert_eq!(
            check(None, &auth("Bearer x"), Some("10.0.0.5:9".parse().unwrap())),
            Err(Refusal::NotLocal)
        );
    }

    #[test]
    fn secrets_match_exactly() {
        assert!(same_secret("s3cret", "s3cret"));
        for other in ["", "s3cre", "s3cret ", "S3cret", "s3cret2"] {
            assert!(!same_secret(other, "s3cret"), "{other:?}");
        }
    }

    #[test]
    fn with_a_token_every_peer_must_present_it() {
        let local = Some("127.0.0.1:9".parse().unwrap());
        let remote = Some("10.0.0.5:9".parse().unwrap());
        assert_eq!(
            check(Some("s3cret"), &auth("Bearer s3cret"), remote),
            Ok(())
        );
        assert_eq!(check(Some("s3cret"), &auth("Bearer s3cret"), None), Ok(()));
        for bad in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Basic s3cret",
            "s3cret",
            "Bearer ",
        ] {
            assert_eq!(
                check(Some("s3cret"), &auth(bad), remote),
                Err(Refusal::BadToken),
                "{bad}"
            );
        }
        // Loopback is no exemption once a token is set.
        assert_eq!(
            check(Some("s3cret"), &HeaderMap::new(), local),
            Err(Refusal::BadToken)
        );
    }
}
