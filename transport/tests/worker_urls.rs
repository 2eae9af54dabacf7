//! Worker addresses over a real socket: `POST /v1/workers` with `--worker-hosts` set refuses
//! every URL or ZMQ endpoint whose host is not a bare allowed one (userinfo, fragments,
//! queries, escapes, numeric hosts, foreign schemes: 400; hosts outside the list: 403), and
//! still takes the legitimate ones, stored in their canonical form.

mod common;

use serde_json::{Value, json};
use transport::http::HttpConfig;

const ALLOWED: [&str; 3] = ["gpu-1", "*.pool.internal", "127.0.0.1"];

async fn router() -> (String, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    let cfg = HttpConfig {
        worker_hosts: ALLOWED.iter().map(|h| h.to_string()).collect(),
        ..HttpConfig::default()
    };
    common::http_server(hub, cfg).await
}

async fn register(base: &str, body: &Value) -> (u16, Value) {
    let ct = "Content-Type: application/json\r\n";
    let (status, _, text) =
        common::raw_request(base, "POST", "/v1/workers", ct, &body.to_string()).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// URLs that must never be registered, with the status expected (400: not a bare base URL;
/// 403: a bare URL whose host is not allowed).
const BAD_URLS: &[(&str, u16)] = &[
    // The issue's own: `http::Uri` ends the authority at '#', the old check took the text
    // after the last '@'.
    ("http://169.254.169.254#@gpu-1", 400),
    ("http://169.254.169.254/#@gpu-1", 400),
    ("https://169.254.169.254#@gpu-1", 400),
    ("http://169.254.169.254:80#@gpu-1:8000", 400),
    ("http://gpu-1@169.254.169.254", 400),
    ("http://gpu-1:8000@169.254.169.254", 400),
    ("http://evil?@gpu-1", 400),
    ("http://evil/?@gpu-1", 400),
    ("http://gpu-1?x=1", 400),
    ("http://gpu-1:8000/v1?x=1", 400),
    ("http://gpu-1#frag", 400),
    ("http://gpu-1%40169.254.169.254", 400),
    ("http://169.254.169.254%23@gpu-1", 400),
    ("http://gpu-1\\@169.254.169.254", 400),
    ("http://gpu-1:8000/../latest/meta-data", 400),
    ("http://2852039166", 400),
    ("http://0xa9fea9fe", 400),
    ("http://0251.0376.0251.0376", 400),
    ("http://[::ffff:169.254.169.254]", 403),
    ("http://[::ffff:a9fe:a9fe]:80", 403),
    ("http://[fd00:ec2::254]", 403),
    ("http://169.254.169.254", 403),
    ("http://gpu-1.evil.com", 403),
    ("http://gpu-1.evil.com:8000", 403),
    ("http://evilpool.internal", 403),
    ("http://pool.internal", 403),
    ("http://a.pool.internal.evil.com", 403),
    ("http://127.0.0.2:8000", 403),
    ("ftp://gpu-1", 400),
    ("file:///etc/passwd", 400),
    ("gopher://gpu-1:70/_x", 400),
    ("gpu-1:8000", 400),
    ("http://gpu-1:0", 400),
];

/// ZMQ publisher / replay endpoints that must never be subscribed to.
const BAD_ENDPOINTS: &[(&str, u16)] = &[
    ("tcp://169.254.169.254:5557#@gpu-1", 400),
    ("tcp://gpu-1@169.254.169.254:5557", 400),
    ("tcp://evil?@gpu-1:5557", 400),
    ("tcp://gpu-1:5557/x", 400),
    ("tcp://gpu-1:5557?x", 400),
    ("tcp://gpu-1:5557#x", 400),
    ("tcp://*:5557", 400),
    ("tcp://gpu-1", 400),
    ("tcp://2852039166:5557", 400),
    ("ipc:///tmp/kv.sock", 400),
    ("inproc://kv", 400),
    ("udp://gpu-1:5557", 400),
    ("tcp://169.254.169.254:5557", 403),
    ("tcp://[::ffff:169.254.169.254]:5557", 403),
    ("tcp://gpu-1.evil.com:5557", 403),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssrf_urls_and_endpoints_are_refused_and_legitimate_ones_kept() {
    let (base, _stop) = router().await;
    let mut id = 100;
    let mut refused = |field: &str, value: &str| {
        id += 1;
        json!({"worker_id": id, field: value})
    };
    for &(url, status) in BAD_URLS {
        let (got, v) = register(&base, &refused("url", url)).await;
        assert_eq!(got, status, "url {url:?} answered {got}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("url"), "{url:?}: the field is named: {v}");
        // Also as a TensorRT-LLM worker (its events are polled from the same URL).
        let body = json!({"worker_id": 1, "url": url, "events": "trtllm"});
        let (got, v) = register(&base, &body).await;
        assert!(matches!(got, 400 | 403), "trtllm url {url:?}: {got} {v}");
    }
    for &(endpoint, status) in BAD_ENDPOINTS {
        for field in ["zmq", "replay"] {
            let (got, v) = register(&base, &refused(field, endpoint)).await;
            assert_eq!(got, status, "{field} {endpoint:?} answered {got}: {v}");
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(field), "{field} is named: {v}");
        }
    }
    // Nothing refused was registered.
    let (status, _, text) = common::raw_request(&base, "GET", "/v1/workers", "", "").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["workers"], json!([]), "{v}");

    // The legitimate forms are still taken, in canonical form.
    for (body, url, zmq) in [
        (
            json!({"worker_id": 1, "url": "http://gpu-1:8000/", "zmq": "tcp://GPU-1:5557"}),
            json!("http://gpu-1:8000"),
            json!("tcp://gpu-1:5557"),
        ),
        (
            json!({"worker_id": 2, "url": "https://a.pool.internal:8443/v1",
                   "replay": "tcp://b.pool.internal:5558"}),
            json!("https://a.pool.internal:8443/v1"),
            Value::Null,
        ),
        (
            json!({"worker_id": 3, "url": "http://127.0.0.1:9", "events": "trtllm"}),
            json!("http://127.0.0.1:9"),
            Value::Null,
        ),
    ] {
        let (status, v) = register(&base, &body).await;
        assert_eq!(status, 201, "{body}: {v}");
        assert_eq!((&v["url"], &v["zmq"]), (&url, &zmq), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_worker_hosts_the_url_shape_is_still_enforced() {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    let (base, _stop) = common::http_server(hub, HttpConfig::default()).await;
    for url in [
        "http://169.254.169.254#@gpu-1",
        "http://gpu-1@169.254.169.254",
        "http://evil?@gpu-1",
        "file:///etc/passwd",
    ] {
        let (status, v) = register(&base, &json!({"worker_id": 1, "url": url})).await;
        assert_eq!(status, 400, "{url}: {v}");
    }
    let (status, v) = register(
        &base,
        &json!({"worker_id": 1, "url": "http://169.254.169.254"}),
    )
    .await;
    assert_eq!(status, 201, "any bare host without --worker-hosts: {v}");
}
