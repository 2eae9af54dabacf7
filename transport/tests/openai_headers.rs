//! The front door forwards end-to-end headers to the worker and drops hop-by-hop ones
//! (`transport/src/openai/headers.rs`); a worker registered with an API key gets its own
//! key; every answer carries the request id the worker saw.

mod common;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use engine::WorkerId;
use serde_json::json;
use std::sync::{Arc, Mutex};
use transport::http::{HttpConfig, router};
use transport::hub::Registration;
use transport::openai::proxy::{ProxyConfig, openai_router};

/// A worker that records the headers of each request and answers a completion.
async fn recording_worker() -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let app = Router::new().route(
        "/v1/completions",
        post(move |headers: HeaderMap| {
            let s = s.clone();
            async move {
                s.lock().unwrap().push(headers);
                axum::Json(json!({"object": "text_completion", "choices": [{"text": "ok"}]}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, seen)
}

/// The router in front of one worker (`api_key`: the worker's own key).
async fn front_door(
    url: &str,
    api_key: Option<&str>,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    hub.register(Registration {
        url: Some(url.to_owned()),
        api_key: api_key.map(str::to_owned),
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    let app = router(hub.clone(), HttpConfig::default())
        .merge(openai_router(hub, ProxyConfig::default()));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    (addr.to_string(), stop)
}

/// A raw completion request with `extra` header lines; returns (status, lowercased head).
async fn complete(addr: &str, extra: &str) -> (u16, String) {
    let body = json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let extra = format!("Content-Type: application/json\r\n{extra}");
    let (status, head, _) =
        common::raw_request(addr, "POST", "/v1/completions", &extra, &body).await;
    (status, head)
}

fn header_line<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_headers_reach_the_worker_and_hop_by_hop_ones_do_not() {
    let (url, seen) = recording_worker().await;
    let (addr, _stop) = front_door(&url, None).await;
    let (status, head) = complete(
        &addr,
        "Authorization: Bearer client-key\r\n\
         X-Request-Id: req-77\r\n\
         traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n\
         X-Custom: yes\r\n\
         Keep-Alive: timeout=5\r\n\
         Proxy-Authorization: Basic eA==\r\n\
         X-Hop: secret\r\n\
         Connection: x-hop\r\n",
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert_eq!(header_line(&head, "x-request-id"), Some("req-77"), "{head}");
    let seen = seen.lock().unwrap();
    let h = &seen[0];
    assert_eq!(h["authorization"], "Bearer client-key");
    assert_eq!(h["x-request-id"], "req-77");
    assert_eq!(
        h["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(h["x-custom"], "yes");
    assert_eq!(h["content-type"], "application/json");
    for gone in ["keep-alive", "proxy-authorization", "x-hop"] {
        assert!(!h.contains_key(gone), "{gone} reached the worker: {h:?}");
    }
    assert_ne!(h.get("host").map(|v| v.to_str().unwrap()), Some("router"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_made_when_absent_and_a_workers_own_key_is_used() {
    let (url, seen) = recording_worker().await;
    let (addr, _stop) = front_door(&url, Some("worker-secret")).await;
    let (status, head) = complete(&addr, "Authorization: Bearer client-key\r\n").await;
    assert_eq!(status, 200, "{head}");
    let id = header_line(&head, "x-request-id")
        .expect("an x-request-id")
        .to_owned();
    assert_eq!(id.len(), 32, "{id}");
    let (_, head2) = complete(&addr, "").await;
    assert_ne!(header_line(&head2, "x-request-id"), Some(id.as_str()));
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0]["x-request-id"], id.as_str());
    assert_eq!(seen[0]["authorization"], "Bearer worker-secret");
    assert_eq!(seen[1]["authorization"], "Bearer worker-secret");
}
