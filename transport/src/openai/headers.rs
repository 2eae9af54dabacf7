//! Which of a client's headers travel to the worker, and the request id both sides see.
//!
//! A reverse proxy forwards end-to-end headers and drops hop-by-hop ones (RFC 9110 §7.6.1):
//! `Authorization` (vLLM's `--api-key`), `X-Request-Id`, W3C `traceparent`/`tracestate`
//! and anything else the client sent reach the worker; `Connection` and the headers it
//! names, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding` and `Upgrade` do
//! not. `Host` and `Content-Length` describe the worker's request and are set by the
//! client library; `Content-Type` is always JSON; `Accept-Encoding` is dropped because the
//! proxy reads and patches the worker's (uncompressed) answer.
//!
//! A worker registered with an API key gets `Authorization: Bearer <its key>` instead of
//! the client's. The request id is the client's `X-Request-Id` when it sent a usable one
//! (visible ASCII, at most 256 bytes), otherwise a fresh random one; the worker gets it and
//! the client's answer carries it.

use super::openai_error::OpenAiError;
use crate::http::turns::ConnTurns;
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use engine::SessionId;

/// The longest client `X-Request-Id` forwarded as is.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// `X-Request-Id`.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The headers naming a client's session, in the order they are looked for (the first
/// present wins): kvengine's own, Dynamo's, SGLang Model Gateway's and SGLang router's.
pub const SESSION_HEADERS: [&str; 4] = [
    "x-kvengine-session",
    "x-dynamo-session-id",
    "x-smg-routing-key",
    "x-sgl-routing-key",
];

/// The header giving a request's admission priority (an integer, higher first; default 0).
pub const PRIORITY_HEADER: &str = "x-kvengine-priority";

/// The response header saying how a session's request was routed
/// ([`engine::router::SessionRoute::as_str`]).
pub const ROUTE_HEADER: &str = "x-kvengine-route";

/// What a client's headers say about routing its request: its session and its priority.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Steering {
    /// The session (`None`: the header is absent or empty).
    pub session: Option<SessionId>,
    /// The admission priority.
    pub priority: i64,
}

/// Which of a client's headers refused [`steering`], for the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SteeringError {
    /// A session header over [`crate::bounds::MAX_SESSION_KEY_BYTES`] or not visible ASCII.
    Session,
    /// A priority that is not an integer of 64 bits.
    Priority,
}

/// The session and priority of a request (see [`SESSION_HEADERS`], [`PRIORITY_HEADER`]).
/// An empty session header is no session; a session value longer than
/// [`crate::bounds::MAX_SESSION_KEY_BYTES`] or holding anything but visible ASCII and
/// spaces, and a priority that is not a decimal `i64`, are refused (400).
pub fn steering(client: &HeaderMap) -> Result<Steering, (SteeringError, OpenAiError)> {
    let mut out = Steering::default();
    if let Some((name, v)) = SESSION_HEADERS
        .iter()
        .find_map(|n| client.get(*n).map(|v| (*n, v)))
    {
        let b = v.as_bytes();
        let max = crate::bounds::MAX_SESSION_KEY_BYTES;
        if b.len() > max || !b.iter().all(|&c| c == b' ' || c.is_ascii_graphic()) {
            let e = OpenAiError::invalid(
                None,
                format!(
                    "header {name}: a session key is at most {max} bytes of visible ASCII \
                     ({} bytes sent)",
                    b.len()
                ),
            );
            return Err((SteeringError::Session, e));
        }
        out.session = (!b.is_empty()).then(|| SessionId::of(b));
    }
    if let Some(v) = client.get(PRIORITY_HEADER) {
        let parsed = v.to_str().ok().and_then(|t| t.trim().parse::<i64>().ok());
        match parsed {
            Some(p) => out.priority = p,
            None => {
                let e = OpenAiError::invalid(
                    None,
                    format!("header {PRIORITY_HEADER}: must be an integer (higher first)"),
                );
                return Err((SteeringError::Priority, e));
            }
        }
    }
    Ok(out)
}

/// Headers that end at this hop, besides those the `Connection` header names.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Set by the proxy for the worker's request, never copied from the client's.
const REPLACED: [HeaderName; 4] = [
    header::HOST,
    header::CONTENT_LENGTH,
    header::CONTENT_TYPE,
    header::ACCEPT_ENCODING,
];

/// What one client request carries to its worker(s).
#[derive(Clone, Debug)]
pub struct Forwarded {
    headers: HeaderMap,
    request_id: HeaderValue,
    /// When the front door received the request (latencies are measured from it).
    received: std::time::Instant,
    /// The client connection's turns, when served by [`crate::http::conn::serve`]: the
    /// answer's relay writes what arrived together in one write with them.
    turns: Option<ConnTurns>,
}

impl Forwarded {
    /// From the client's request headers (see the module docs).
    pub fn from_client(client: &HeaderMap) -> Self {
        let named_by_connection: Vec<HeaderName> = client
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        let mut headers = HeaderMap::new();
        for (name, value) in client {
            let dropped = HOP_BY_HOP.contains(name)
                || REPLACED.contains(name)
                || named_by_connection.contains(name);
            if !dropped {
                headers.append(name.clone(), value.clone());
            }
        }
        let request_id = match client.get(&X_REQUEST_ID) {
            Some(v) if usable_id(v) => v.clone(),
            _ => fresh_id(),
        };
        headers.insert(X_REQUEST_ID.clone(), request_id.clone());
        Self {
            headers,
            request_id,
            received: std::time::Instant::now(),
            turns: None,
        }
    }

    /// The same request, arrived on a connection counting `turns`.
    #[must_use]
    pub fn on_connection(mut self, turns: Option<ConnTurns>) -> Self {
        self.turns = turns;
        self
    }

    /// The client connection's turns, if known.
    pub fn turns(&self) -> Option<&ConnTurns> {
        self.turns.as_ref()
    }

    /// The headers for a worker's request; `api_key`: the worker's own key, if it has one.
    pub fn for_worker(&self, api_key: Option<&str>) -> HeaderMap {
        let mut h = self.headers.clone();
        if let Some(key) = api_key
            && let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}"))
        {
            h.insert(header::AUTHORIZATION, v);
        }
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h
    }

    /// When the front door received the request.
    pub fn received(&self) -> std::time::Instant {
        self.received
    }

    /// The request id (the client's, or generated).
    pub fn request_id(&self) -> &HeaderValue {
        &self.request_id
    }
}

fn usable_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_REQUEST_ID_BYTES && b.iter().all(|c| c.is_ascii_graphic())
}

/// 128 random bits as 32 hex digits.
fn fresh_id() -> HeaderValue {
    use ring::rand::{SecureRandom, SystemRandom};
    let mut bytes = [0u8; 16];
    // The system RNG failing is not an input condition; fall back to the clock's nanos so a
    // request still gets an id (uniqueness then rests on the clock).
    if SystemRandom::new().fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes = nanos.to_le_bytes();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    HeaderValue::from_str(&hex).unwrap_or(HeaderValue::from_static("0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_first_session_header_present_wins_and_bad_input_is_refused() {
        let s = |pairs: &[(&str, &str)]| steering(&map(pairs));
        assert_eq!(s(&[]).unwrap(), Steering::default());
        let dynamo = s(&[("X-Dynamo-Session-ID", "abc"), ("x-sgl-routing-key", "zzz")]);
        assert_eq!(dynamo.unwrap().session, Some(SessionId::of(b"abc")));
        let ours = s(&[("x-smg-routing-key", "zzz"), ("X-KVENGINE-SESSION", "abc")]);
        assert_eq!(ours.unwrap().session, Some(SessionId::of(b"abc")));
        assert_eq!(s(&[("x-kvengine-session", "")]).unwrap().session, None);
        let long = "k".repeat(crate::bounds::MAX_SESSION_KEY_BYTES + 1);
        let e = s(&[("x-sgl-routing-key", &long)]).unwrap_err();
        assert_eq!(e.0, SteeringError::Session);
        assert_eq!(e.1.status, axum::http::StatusCode::BAD_REQUEST);
        let at_max = "k".repeat(crate::bounds::MAX_SESSION_KEY_BYTES);
        assert!(s(&[("x-sgl-routing-key", &at_max)]).is_ok());
        assert_eq!(s(&[("x-kvengine-priority", " -7 ")]).unwrap().priority, -7);
        for bad in ["high", "1.5", "99999999999999999999", ""] {
            let e = s(&[("x-kvengine-priority", bad)]).unwrap_err();
            assert_eq!(e.0, SteeringError::Priority, "{bad:?}");
        }
    }

    #[test]
    fn end_to_end_headers_travel_and_hop_by_hop_ones_stop() {
        let client = map(&[
            ("authorization", "Bearer client-key"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("x-request-id", "req-42"),
            ("x-custom", "a"),
            ("x-custom", "b"),
            ("connection", "keep-alive, x-secret-hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic eA=="),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("host", "router:8000"),
            ("content-length", "12"),
            ("content-type", "text/plain"),
            ("accept-encoding", "gzip"),
        ]);
        let f = Forwarded::from_client(&client);
        let h = f.for_worker(None);
        assert_eq!(h["authorization"], "Bearer client-key");
        assert_eq!(
            h["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(h["tracestate"], "congo=t61rcWkgMzE");
        assert_eq!(h["x-request-id"], "req-42");
        assert_eq!(f.request_id(), "req-42");
        assert_eq!(h.get_all("x-custom").iter().count(), 2);
        assert_eq!(h["content-type"], "application/json");
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "proxy-authorization",
            "te",
            "transfer-encoding",
            "upgrade",
            "host",
            "content-length",
            "accept-encoding",
        ] {
            assert!(!h.contains_key(gone), "{gone} was forwarded");
        }
        // A worker's own key replaces the client's.
        let h = f.for_worker(Some("worker-key"));
        assert_eq!(h["authorization"], "Bearer worker-key");
    }

    #[test]
    fn a_request_id_is_generated_when_absent_or_unusable() {
        let a = Forwarded::from_client(&HeaderMap::new());
        let b = Forwarded::from_client(&HeaderMap::new());
        assert_eq!(a.request_id().len(), 32);
        assert_ne!(a.request_id(), b.request_id());
        assert_eq!(a.for_worker(None)["x-request-id"], *a.request_id());
        let long = "x".repeat(MAX_REQUEST_ID_BYTES + 1);
        for bad in ["", long.as_str(), "has space"] {
            let f = Forwarded::from_client(&map(&[("x-request-id", bad)]));
            assert_eq!(f.request_id().len(), 32, "{bad:?} was kept");
        }
    }
}
