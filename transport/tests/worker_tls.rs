//! HTTPS to workers, over real TLS sockets: a worker serving a self-signed certificate
//! (rcgen) that the router trusts through its CA setting (`--worker-ca`) is health-checked
//! and receives a proxied OpenAI request, worker API key included; a worker whose
//! certificate the router does not trust, or whose certificate does not name the host the
//! router dials, is never sent a request, is taken out of routing, and the reason shows in
//! `GET /v1/workers` and `/ready`.

mod common;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use transport::http::health::health_loop;
use transport::http::{HttpConfig, router};
use transport::hub::Hub;
use transport::openai::proxy::{ProxyConfig, openai_router};
use transport::outbound::Outbound;

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kvengine-worker-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A self-signed certificate for `localhost`: (cert.pem, key.pem) in `dir`.
fn certificate(dir: &std::path::Path, name: &str) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

struct TlsWorker {
    port: u16,
    /// Requests it answered (any path).
    requests: Arc<AtomicUsize>,
    /// The Authorization header of each completion request.
    auth: Arc<std::sync::Mutex<Vec<String>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A worker serving HTTPS with `cert`/`key`: `/health`, and a chat completion that says
/// hello.
async fn tls_worker(cert: &std::path::Path, key: &std::path::Path) -> TlsWorker {
    let requests = Arc::new(AtomicUsize::new(0));
    let auth: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let (r1, r2, seen) = (requests.clone(), requests.clone(), auth.clone());
    let app = Router::new()
        .route(
            "/health",
            get(move || {
                r1.fetch_add(1, Relaxed);
                async { "ok" }
            }),
        )
        .route(
            "/v1/chat/completions",
            post(move |headers: HeaderMap| {
                r2.fetch_add(1, Relaxed);
                let a = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                seen.lock().unwrap().push(a);
                async {
                    axum::Json(json!({"object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "hello over tls"},
                         "finish_reason": "stop"}]}))
                }
            }),
        );
    let tls = transport::http::edge_tls::server_config(cert, key).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = transport::http::edge_tls::serve_https(listener, app, tls, async {
            let _ = rx.await;
        })
        .await;
    });
    TlsWorker {
        port,
        requests,
        auth,
        _stop: tx,
    }
}

/// A router (HTTP edge, OpenAI front door, health checks every 100 ms) reaching workers
/// through `outbound`.
async fn router_with(outbound: Outbound) -> (Arc<Hub>, String, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    let proxy = ProxyConfig {
        outbound: outbound.clone(),
        ..ProxyConfig::default()
    };
    let app = router(hub.clone(), HttpConfig::default()).merge(openai_router(hub.clone(), proxy));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    tokio::spawn(health_loop(
        hub.clone(),
        Duration::from_millis(100),
        Duration::from_secs(2),
        1,
        outbound,
    ));
    (hub, format!("http://{addr}"), stop)
}

async fn call(base: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let ct = "Content-Type: application/json\r\n";
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let (status, _, text) = common::raw_request(base, method, path, ct, &body).await;
    // A relayed answer comes chunked: its JSON is between the first '{' and the last '}'.
    let json = match (text.find('{'), text.rfind('}')) {
        (Some(a), Some(b)) if a < b => serde_json::from_str(&text[a..=b]).ok(),
        _ => None,
    };
    (status, json.unwrap_or(Value::String(text)))
}

/// `worker`'s entry in `GET /v1/workers`.
async fn shown(base: &str, worker: u64) -> Value {
    let (_, v) = call(base, "GET", "/v1/workers", &Value::Null).await;
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker)
        .cloned()
        .unwrap()
}

/// Waits until `ok` holds for `worker`'s entry (10 s at most).
async fn until(base: &str, worker: u64, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let began = Instant::now();
    loop {
        let w = shown(base, worker).await;
        if ok(&w) {
            return w;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "{what}: {w}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_trusted_through_the_ca_is_checked_and_served_over_https() {
    let dir = scratch("trusted");
    let (cert, key) = certificate(&dir, "worker");
    let w = tls_worker(&cert, &key).await;
    let (hub, base, _stop) = router_with(Outbound::new(Some(&cert)).unwrap()).await;
    let url = format!("https://localhost:{}", w.port);
    let (status, v) = call(
        &base,
        "POST",
        "/v1/workers",
        &json!({"worker_id": 1, "url": url, "api_key": "sk-worker"}),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["url"], json!(url));
    // Health checks reach it (over TLS: it serves nothing else) and pass.
    let began = Instant::now();
    while w.requests.load(Relaxed) < 2 {
        assert!(began.elapsed() < Duration::from_secs(10), "no health check");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let info = shown(&base, 1).await;
    assert_eq!(
        (&info["healthy"], &info["health_error"]),
        (&json!(true), &Value::Null)
    );
    // An OpenAI request is proxied to it, with its API key.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let (status, v) = call(&base, "POST", "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "hello over tls");
    assert_eq!(*w.auth.lock().unwrap(), ["Bearer sk-worker"]);
    let (status, v) = call(&base, "GET", "/ready", &Value::Null).await;
    assert_eq!(status, 200, "{v}");
    drop(hub);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_or_misnamed_certificates_keep_a_worker_out_and_say_why() {
    let dir = scratch("untrusted");
    let (cert, key) = certificate(&dir, "worker");
    let (other_ca, _) = certificate(&dir, "other");
    let w = tls_worker(&cert, &key).await;
    // Router A trusts another CA; router B trusts the public roots only; router C trusts
    // the worker's certificate but dials it by an address the certificate does not name.
    let (_a, base_a, _sa) = router_with(Outbound::new(Some(&other_ca)).unwrap()).await;
    let (_b, base_b, _sb) = router_with(Outbound::default()).await;
    let (_c, base_c, _sc) = router_with(Outbound::new(Some(&cert)).unwrap()).await;
    let by_name = format!("https://localhost:{}", w.port);
    let by_ip = format!("https://127.0.0.1:{}", w.port);
    for (base, url) in [(&base_a, &by_name), (&base_b, &by_name), (&base_c, &by_ip)] {
        let (status, v) = call(
            base,
            "POST",
            "/v1/workers",
            &json!({"worker_id": 2, "url": url, "api_key": "sk-secret"}),
        )
        .await;
        assert_eq!(status, 201, "{v}");
    }
    for (base, why) in [
        // Another self-signed certificate of the same subject: its signature does not verify.
        (&base_a, "invalid peer certificate"),
        (&base_b, "UnknownIssuer"),
        (&base_c, "not valid for name"),
    ] {
        let info = until(base, 2, "not taken out of routing", |w| {
            w["healthy"] == json!(false)
        })
        .await;
        let error = info["health_error"].as_str().unwrap_or_default();
        assert!(
            error.contains("certificate") && error.contains(why),
            "{base}: {error}"
        );
        let (status, ready) = call(base, "GET", "/ready", &Value::Null).await;
        assert_eq!(status, 503, "{ready}");
        let problems = ready["problems"].to_string();
        assert!(
            problems.contains("worker 2: health check failing") && problems.contains(why),
            "{ready}"
        );
        // The front door does not send the request (nor the key) to it either.
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let (status, v) = call(base, "POST", "/v1/chat/completions", &chat).await;
        assert_ne!(status, 200, "{v}");
    }
    assert_eq!(
        w.requests.load(Relaxed),
        0,
        "no request crossed a handshake that failed"
    );
    assert!(w.auth.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}
