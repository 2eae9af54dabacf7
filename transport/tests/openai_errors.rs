//! Every error of the process comes in OpenAI's shape (`{"error": {"message", "type",
//! "param", "code"}}`), on the OpenAI paths and the edge's own: unknown paths (404), wrong
//! methods (405), bodies over the limit (413), bad JSON (400).

mod common;

use serde_json::Value;
use transport::http::{HttpConfig, router};
use transport::openai::proxy::{ProxyConfig, openai_router};

const LIMIT: usize = 1024;

async fn front_door() -> (String, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    let http = HttpConfig {
        max_body_bytes: LIMIT,
        ..HttpConfig::default()
    };
    let proxy = ProxyConfig {
        max_body_bytes: LIMIT,
        ..ProxyConfig::default()
    };
    let app = router(hub.clone(), http).merge(openai_router(hub, proxy));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    (addr.to_string(), stop)
}

/// A raw request; returns (status, parsed body).
async fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let ct = "Content-Type: application/json\r\n";
    let (status, _, body) = common::raw_request(addr, method, path, ct, body).await;
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    (status, v)
}

fn assert_openai_shape(v: &Value, kind: &str) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert!(e.get("param").is_some(), "no param in {v}");
    assert!(e.get("code").is_some(), "no code in {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped_everywhere() {
    let (addr, _stop) = front_door().await;
    let (s, v) = request(&addr, "GET", "/v1/no-such-path", "").await;
    assert_eq!(s, 404);
    assert_openai_shape(&v, "not_found_error");
    assert_eq!(v["error"]["code"], "not_found");

    for path in ["/v1/chat/completions", "/v1/completions"] {
        let (s, v) = request(&addr, "GET", path, "").await;
        assert_eq!(s, 405, "{path}: {v}");
        assert_openai_shape(&v, "invalid_request_error");

        let big = format!(r#"{{"model": "m", "prompt": "{}"}}"#, "x".repeat(2 * LIMIT));
        let (s, v) = request(&addr, "POST", path, &big).await;
        assert_eq!(s, 413, "{path}: {v}");
        assert_openai_shape(&v, "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&LIMIT.to_string()),
            "{v}"
        );
    }
    let (s, v) = request(&addr, "GET", "/v1/models", "").await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = request(&addr, "DELETE", "/v1/models", "").await;
    assert_eq!(s, 405, "{v}");
    assert_openai_shape(&v, "invalid_request_error");

    // The edge's own endpoints: the same shape, with their stable codes.
    let (s, v) = request(&addr, "POST", "/v1/route", "{not json").await;
    assert_eq!(s, 400);
    assert_openai_shape(&v, "invalid_request_error");
    assert_eq!(v["error"]["code"], "malformed_json");
    let (s, v) = request(&addr, "GET", "/v1/route", "").await;
    assert_eq!(s, 405);
    assert_openai_shape(&v, "invalid_request_error");
    let (s, v) = request(&addr, "POST", "/v1/route", r#"{"token_ids": [1]}"#).await;
    assert_eq!(s, 503, "no workers: {v}");
    assert_openai_shape(&v, "service_unavailable");
    let big = format!(r#"{{"token_ids": [{}]}}"#, "1,".repeat(LIMIT) + "1");
    let (s, v) = request(&addr, "POST", "/v1/route", &big).await;
    assert_eq!(s, 413, "{v}");
    assert_openai_shape(&v, "invalid_request_error");
}

/// With every worker at its active-request limit, routing answers 429 with Retry-After, on
/// the edge's `/v1/route` and on the OpenAI paths alike; freeing a request makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_workers_answer_429_with_retry_after() {
    use engine::runtime::RuntimeConfig;
    use engine::sched::SchedulerConfig;
    use engine::sharding::choice::Sharding;
    use std::sync::Arc;
    use transport::hub::{HubConfig, Registration, start_engine};

    let config = HubConfig {
        scheduler: SchedulerConfig {
            max_active_per_key: Some(1),
            ..SchedulerConfig::default()
        },
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(config, Sharding::adaptive(1).unwrap(), engine).unwrap();
    std::mem::forget(runtime);
    let hub = Arc::new(hub);
    hub.register(Registration::new(engine::WorkerId(1)))
        .unwrap();
    let app = router(hub.clone(), HttpConfig::default())
        .merge(openai_router(hub.clone(), ProxyConfig::default()));
    let (addr, _stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    let addr = addr.to_string();

    let (s, v) = request(
        &addr,
        "POST",
        "/v1/route",
        r#"{"token_ids": [1], "request_id": "a"}"#,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let head = raw_head(&addr, "POST", "/v1/route", r#"{"token_ids": [1]}"#).await;
    assert!(head.starts_with("http/1.1 429"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let (s, v) = request(&addr, "POST", "/v1/route", r#"{"token_ids": [1]}"#).await;
    assert_eq!(s, 429);
    assert_openai_shape(&v, "rate_limit_error");
    assert_eq!(v["error"]["code"], "at_capacity");
    let (s, v) = request(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"model": "m", "prompt": [1, 2], "max_tokens": 1}"#,
    )
    .await;
    assert_eq!(s, 429, "{v}");
    assert_openai_shape(&v, "rate_limit_error");
    assert_eq!(
        hub.routing().active_requests(),
        1,
        "refusals record nothing"
    );
    let (s, _) = request(&addr, "DELETE", "/v1/requests/a", "").await;
    assert_eq!(s, 200);
    let (s, v) = request(&addr, "POST", "/v1/route", r#"{"token_ids": [1]}"#).await;
    assert_eq!(s, 200, "{v}");
}

/// A raw request; returns the lowercased response head.
async fn raw_head(addr: &str, method: &str, path: &str, body: &str) -> String {
    common::raw_request(addr, method, path, "", body).await.1
}
