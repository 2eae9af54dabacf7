//! A stuck core: `/v1/route` answers 503 within the engine's deadline instead of hanging,
//! and routes again once the core is back.

mod common;

use bytes::Bytes;
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use engine::{DpRank, WorkerId};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::http::HttpConfig;
use transport::hub::{Hub, HubConfig, Registration};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_core_gets_route_calls_a_503_in_time_and_then_routes_again() {
    let engine = RuntimeConfig {
        pin_cores: false,
        query_handles: 2,
        call_timeout: Duration::from_millis(200),
        ..RuntimeConfig::default()
    };
    let mut started = engine::runtime::start(Sharding::adaptive(1).unwrap(), engine).unwrap();
    // One query handle stays with the test, to stall the core with.
    let mut staller = started.query.remove(0);
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let hub = Arc::new(Hub::new(config, started.ingest, started.query).unwrap());
    hub.register(Registration {
        dp_ranks: vec![DpRank(0)],
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    let (base, _stop) = common::http_server(hub.clone(), HttpConfig::default()).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let route = |id: &str| {
        let body = json!({"request_id": id, "token_ids": (0..64).collect::<Vec<u32>>()});
        Request::builder()
            .method(Method::POST)
            .uri(format!("{base}/v1/route"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap()
    };

    let stall = tokio::task::spawn_blocking(move || {
        let r = staller.stall_core(0, Duration::from_millis(3_000));
        (staller, r)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = Instant::now();
    let resp = client.request(route("stuck")).await.unwrap();
    let waited = t0.elapsed();
    let status = resp.status();
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "engine_timeout", "{body}");
    assert!(
        waited < Duration::from_millis(1_000),
        "answered after {waited:?}"
    );
    // The watchdog's view: /ready says why it is not ready, and /metrics still answers
    // (everything but the shards' figures) with the engine marked unresponsive.
    let get = |path: &str| {
        Request::builder()
            .uri(format!("{base}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let resp = client.request(get("/ready")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let ready: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(ready["engine"]["responsive"], false, "{ready}");
    let resp = client.request(get("/metrics")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let page = resp.into_body().collect().await.unwrap().to_bytes();
    let page = String::from_utf8_lossy(&page);
    assert!(page.contains("kvengine_engine_responsive 0"), "{page}");
    assert!(!page.contains("kvengine_index_entries{"), "{page}");
    let stalls: u64 = page
        .lines()
        .find_map(|l| l.strip_prefix("kvengine_engine_unresponsive_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(stalls >= 2, "{page}");

    let (_staller, stalled) = stall.await.unwrap();
    assert!(stalled.is_err(), "the stall itself outlasts the deadline");
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let resp = client.request(route("back")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = client.request(get("/metrics")).await.unwrap();
    let page = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&page).contains("kvengine_engine_responsive 1"));
    assert_eq!(
        hub.routing().active_requests(),
        1,
        "the failed call left nothing active"
    );
}
