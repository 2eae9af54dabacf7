//! Orchestrator probes (`/live`, `/ready`, `/health`, `/healthz`) over a real engine and
//! socket: readiness follows the workers' health.

mod common;

use bytes::Bytes;
use engine::WorkerId;
use http_body_util::{BodyExt, Empty};
use hyper::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use transport::http::HttpConfig;
use transport::hub::Registration;

async fn get(base: &str, path: &str) -> (StatusCode, Value) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let resp = client
        .get(format!("{base}{path}").parse().unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_workers_health_and_liveness_does_not() {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    let (base, _stop) = common::http_server(hub.clone(), HttpConfig::default()).await;

    let live = |v: &Value| v["status"] == "ok";
    let (s, v) = get(&base, "/live").await;
    assert!(s == StatusCode::OK && live(&v), "{v}");
    let (s, v) = get(&base, "/ready").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["status"], "not_ready");
    assert_eq!(v["reasons"][0], "no healthy worker (0 registered)");
    assert_eq!(v["engine"]["responsive"], true);
    assert_eq!(v["engine"]["cores"], 2);
    let (s, h) = get(&base, "/health").await;
    assert_eq!((s, &h["ready"]), (StatusCode::OK, &Value::Bool(false)));

    hub.register(Registration::new(WorkerId(1))).unwrap();
    hub.register(Registration::new(WorkerId(2))).unwrap();
    let (s, v) = get(&base, "/ready").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "ready");
    assert_eq!(v["reasons"].as_array().unwrap().len(), 0);
    assert_eq!(v["workers"]["registered"], 2);
    assert_eq!(v["workers"]["healthy"], 2);
    assert_eq!(v["kv_events"], true);

    // One down: still ready; both down: not ready, though alive.
    hub.set_healthy(WorkerId(1), false).unwrap();
    let (s, v) = get(&base, "/ready").await;
    assert_eq!(
        (s, &v["workers"]["healthy"]),
        (StatusCode::OK, &Value::from(1))
    );
    hub.set_healthy(WorkerId(2), false).unwrap();
    let (s, v) = get(&base, "/ready").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["reasons"][0], "no healthy worker (2 registered)");
    let (s, v) = get(&base, "/live").await;
    assert!(s == StatusCode::OK && live(&v), "{v}");
    let (s, v) = get(&base, "/healthz").await;
    assert!(s == StatusCode::OK && live(&v), "{v}");
    let (s, h) = get(&base, "/health").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["workers"]["healthy"], 0);

    // Recovery puts it back.
    hub.set_healthy(WorkerId(2), true).unwrap();
    let (s, _) = get(&base, "/ready").await;
    assert_eq!(s, StatusCode::OK);
}
