//! The admin gate on the HTTP edge's control calls (`transport/src/http/admin.rs`), over real
//! sockets: with a token every control call must present it; without one, only peers on
//! this host may make them. Read and routing calls stay open either way, and a refused
//! call changes nothing.

mod common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::net::IpAddr;
use transport::http::{HttpConfig, router};

/// Serves the edge on `bind` (port 0); returns its port and the stop sender.
async fn serve(cfg: HttpConfig, bind: IpAddr) -> (u16, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    let (addr, stop) = common::serve_app(router(hub, cfg), bind).await;
    (addr.port(), stop)
}

async fn call(
    base: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
    bearer: Option<&str>,
) -> (StatusCode, Value, Option<String>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::builder()
        .method(method)
        .uri(format!("{base}{path}"))
        .header("content-type", "application/json");
    if let Some(t) = bearer {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let resp = client
        .request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v, challenge)
}

fn stored(worker: u64) -> Value {
    json!({"worker_id": worker, "events": [{"type": "stored", "blocks": [
        {"block_hash": 1, "token_ids": (0..16).collect::<Vec<u32>>()}]}]})
}

/// Every control call, as (method, path, body).
fn control_calls() -> Vec<(Method, &'static str, Option<Value>)> {
    vec![
        (Method::POST, "/v1/workers", Some(json!({"worker_id": 7}))),
        (Method::POST, "/v1/events", Some(stored(7))),
        (
            Method::POST,
            "/v1/load",
            Some(json!({"worker_id": 7, "num_requests_waiting": 1, "kv_usage": 0.5})),
        ),
        (Method::DELETE, "/v1/workers/7", None),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_control_calls_need_it_and_refusals_change_nothing() {
    let cfg = HttpConfig {
        admin_token: Some("s3cret".into()),
        ..HttpConfig::default()
    };
    let (port, _stop) = serve(cfg, "127.0.0.1".parse().unwrap()).await;
    let base = format!("http://127.0.0.1:{port}");

    for (method, path, body) in control_calls() {
        for bearer in [None, Some("wrong"), Some("s3cre")] {
            let (s, v, challenge) = call(&base, method.clone(), path, body.clone(), bearer).await;
            assert_eq!(
                s,
                StatusCode::UNAUTHORIZED,
                "{method} {path} {bearer:?}: {v}"
            );
            assert_eq!(v["error"]["code"], "unauthorized");
            assert_eq!(challenge.as_deref(), Some("Bearer"));
        }
    }
    // Nothing of that reached the router.
    let (s, v, _) = call(&base, Method::GET, "/v1/workers", None, None).await;
    assert_eq!(
        (s, v["workers"].as_array().unwrap().len()),
        (StatusCode::OK, 0)
    );

    // With the token, each works (in order: register, events, load, remove).
    for (method, path, body) in control_calls() {
        let (s, v, _) = call(&base, method.clone(), path, body, Some("s3cret")).await;
        assert!(s.is_success(), "{method} {path}: {s} {v}");
        if path == "/v1/events" {
            assert_eq!(v["applied"], 1, "{v}");
        }
    }
    // Read and routing calls need no token.
    let (s, _, _) = call(&base, Method::GET, "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = call(&base, Method::GET, "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    call(
        &base,
        Method::POST,
        "/v1/workers",
        Some(json!({"worker_id": 8})),
        Some("s3cret"),
    )
    .await;
    let (s, v, _) = call(
        &base,
        Method::POST,
        "/v1/route",
        Some(json!({"token_ids": [1, 2, 3], "request_id": "r"})),
        None,
    )
    .await;
    assert_eq!(
        (s, v["worker_id"].as_u64()),
        (StatusCode::OK, Some(8)),
        "{v}"
    );
    let (s, _, _) = call(&base, Method::DELETE, "/v1/requests/r", None, None).await;
    assert_eq!(s, StatusCode::OK);
    // The refusals are counted.
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .get(format!("{base}/metrics").parse().unwrap())
        .await
        .unwrap();
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    let line = text
        .lines()
        .find(|l| l.contains("unauthorized") && !l.starts_with('#'))
        .unwrap_or_else(|| panic!("no unauthorized counter in\n{text}"));
    assert!(line.ends_with(" 12"), "{line}");
}

/// This host's address on a non-loopback interface, if it has one (a UDP `connect` picks
/// the route without sending anything).
fn non_loopback_ip() -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_control_calls_come_from_this_host_only() {
    let (port, _stop) = serve(HttpConfig::default(), "0.0.0.0".parse().unwrap()).await;
    let local = format!("http://127.0.0.1:{port}");
    let Some(ip) = non_loopback_ip() else {
        eprintln!("note: no non-loopback interface here; only the loopback half runs");
        for (method, path, body) in control_calls() {
            let (s, v, _) = call(&local, method.clone(), path, body, None).await;
            assert!(s.is_success(), "{method} {path}: {s} {v}");
        }
        return;
    };
    // The same calls over a non-loopback address: the peer is not loopback.
    let remote = format!("http://{ip}:{port}");
    for (method, path, body) in control_calls() {
        let (s, v, _) = call(&remote, method.clone(), path, body.clone(), None).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{method} {path}: {v}");
        assert_eq!(v["error"]["code"], "admin_forbidden");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--admin-token"),
            "{v}"
        );
        // A bearer token does not help when none is configured.
        let (s, _, _) = call(&remote, method.clone(), path, body, Some("x")).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    let (s, v, _) = call(&remote, Method::GET, "/v1/workers", None, None).await;
    assert_eq!(
        (s, v["workers"].as_array().unwrap().len()),
        (StatusCode::OK, 0)
    );
    // From this host the same calls are accepted.
    for (method, path, body) in control_calls() {
        let (s, v, _) = call(&local, method.clone(), path, body, None).await;
        assert!(s.is_success(), "{method} {path}: {s} {v}");
    }
}

/// The routing API's own token: with `--routing-token`, `/v1/route`, `/v1/overlap` and
/// `/v1/requests/...` need it (or the admin token); control calls still need the admin
/// token, which the routing token does not replace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_routing_token_the_routing_api_needs_it() {
    let cfg = HttpConfig {
        admin_token: Some("admin".into()),
        routing_token: Some("route".into()),
        ..HttpConfig::default()
    };
    let (port, _stop) = serve(cfg, "127.0.0.1".parse().unwrap()).await;
    let base = format!("http://127.0.0.1:{port}");
    call(
        &base,
        Method::POST,
        "/v1/workers",
        Some(json!({"worker_id": 8})),
        Some("admin"),
    )
    .await;
    let route = json!({"token_ids": [1, 2, 3], "request_id": "r"});
    for bearer in [None, Some("wrong"), Some("rout")] {
        for (method, path) in [
            (Method::POST, "/v1/route"),
            (Method::POST, "/v1/overlap"),
            (Method::POST, "/v1/requests/r/prefilled"),
            (Method::DELETE, "/v1/requests/r"),
        ] {
            let (s, v, challenge) =
                call(&base, method.clone(), path, Some(route.clone()), bearer).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED, "{path} {bearer:?}: {v}");
            assert_eq!(challenge.as_deref(), Some("Bearer"));
        }
    }
    let (s, v, _) = call(
        &base,
        Method::POST,
        "/v1/route",
        Some(route.clone()),
        Some("route"),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _, _) = call(&base, Method::DELETE, "/v1/requests/r", None, Some("admin")).await;
    assert_eq!(
        s,
        StatusCode::OK,
        "the admin token passes the routing gate too"
    );
    // The routing token opens no control call.
    let (s, _, _) = call(&base, Method::DELETE, "/v1/workers/8", None, Some("route")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Health, metrics and the worker list stay open.
    let (s, _, _) = call(&base, Method::GET, "/v1/workers", None, None).await;
    assert_eq!(s, StatusCode::OK);
}

/// Requests the router routes for itself (the OpenAI front door's) are no caller's
/// reservation: `DELETE /v1/requests/{id}` and `/prefilled` answer 404 for them, from any
/// peer, and they stay active until the router frees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_requests_cannot_be_freed_through_the_routing_api() {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    hub.register(transport::hub::Registration::new(engine::WorkerId(8)))
        .unwrap();
    let (addr, _stop) = common::serve_app(
        router(hub.clone(), HttpConfig::default()),
        "127.0.0.1".parse().unwrap(),
    )
    .await;
    let base = format!("http://127.0.0.1:{}", addr.port());
    let call_ = transport::hub::RouteCall {
        request_id: None,
        tokens: &[1; 64],
        ..Default::default()
    };
    let routed = hub
        .route_async(None, &call_, std::time::Instant::now())
        .await
        .unwrap();
    let id = routed.request_id;
    assert!(id.starts_with("kvr-") && id.len() == 36, "{id}");
    for (method, path) in [
        (Method::POST, format!("/v1/requests/{id}/prefilled")),
        (Method::DELETE, format!("/v1/requests/{id}")),
    ] {
        let (s, v, _) = call(&base, method, &path, None, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path}: {v}");
        assert_eq!(v["error"]["code"], "unknown_request");
    }
    assert_eq!(hub.routing().active_requests(), 1);
    hub.finish(&id).unwrap();
    assert_eq!(hub.routing().active_requests(), 0);
}
