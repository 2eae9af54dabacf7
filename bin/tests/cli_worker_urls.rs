//! The `kvengine` binary and its workers' addresses: with `--worker-hosts`, `POST
//! /v1/workers` refuses the SSRF forms of a URL (400) and foreign hosts (403); a `--worker`
//! flag with such a URL stops the router at start; `--worker-ca` makes it health-check and
//! proxy to an `https://` worker whose certificate that CA issued.

mod common;

use common::Router;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn worker_hosts_refuse_ssrf_urls_and_keep_legitimate_ones() {
    let r = Router::start(&["--worker-hosts", "gpu-1,*.pool.internal"]);
    for (url, status) in [
        ("http://169.254.169.254#@gpu-1", 400),
        ("http://gpu-1@169.254.169.254", 400),
        ("http://evil?@gpu-1", 400),
        ("http://gpu-1.evil.com", 403),
        ("http://[::ffff:169.254.169.254]", 403),
        ("http://gpu-1:8000/v1?x=1", 400),
        ("file:///etc/passwd", 400),
    ] {
        let body = format!(r#"{{"worker_id": 7, "url": "{url}"}}"#);
        let (got, text) = r.call("POST", "/v1/workers", &body);
        assert_eq!(got, status, "{url}: {text}");
    }
    for (endpoint, status) in [
        ("tcp://169.254.169.254:5557#@gpu-1", 400),
        ("tcp://gpu-1@169.254.169.254:5557", 400),
        ("tcp://evil?@gpu-1:5557", 400),
        ("ipc:///tmp/kv.sock", 400),
        ("tcp://gpu-1.evil.com:5557", 403),
    ] {
        let body = format!(r#"{{"worker_id": 7, "zmq": "{endpoint}"}}"#);
        let (got, text) = r.call("POST", "/v1/workers", &body);
        assert_eq!(got, status, "{endpoint}: {text}");
    }
    let (_, text) = r.call("GET", "/v1/workers", "");
    assert_eq!(text, r#"{"workers":[]}"#);
    let (got, text) = r.call(
        "POST",
        "/v1/workers",
        r#"{"worker_id": 7, "url": "https://a.pool.internal:8443/"}"#,
    );
    assert_eq!(got, 201, "{text}");
    assert!(
        text.contains(r#""url":"https://a.pool.internal:8443""#),
        "{text}"
    );
}

#[test]
fn a_worker_flag_with_an_ssrf_url_stops_the_router_at_start() {
    for spec in [
        "id=1,url=http://169.254.169.254#@gpu-1",
        "id=1,url=http://gpu-1@169.254.169.254",
        "id=1,zmq=tcp://gpu-1@169.254.169.254:5557",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["--no-pin", "--http-port", "0", "--worker", spec])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{spec} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--worker") && err.contains("@"),
            "{spec}: {err}"
        );
    }
}

/// A worker serving HTTPS with a fresh self-signed certificate for `localhost` on its own
/// thread; returns its port, the certificate's PEM file, and the stop signal.
fn tls_worker(dir: &std::path::Path) -> (u16, std::path::PathBuf, std::sync::mpsc::Sender<()>) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.join("worker.pem"), dir.join("worker.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (c, k) = (cert.clone(), key);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use axum::routing::{get, post};
            let app = axum::Router::new()
                .route("/health", get(|| async { "ok" }))
                .route(
                    "/v1/chat/completions",
                    post(|| async {
                        axum::Json(serde_json::json!({"object": "chat.completion",
                            "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "tls ok"}}]}))
                    }),
                );
            let tls = transport::http::edge_tls::server_config(&c, &k).unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            port_tx.send(listener.local_addr().unwrap().port()).unwrap();
            let stop = async move {
                let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
            };
            transport::http::edge_tls::serve_https(listener, app, tls, stop)
                .await
                .unwrap();
        });
    });
    (port_rx.recv().unwrap(), cert, stop_tx)
}

#[test]
fn an_https_worker_trusted_with_worker_ca_is_checked_and_proxied_to() {
    let dir = std::env::temp_dir().join(format!("kvengine-cli-worker-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, cert, _stop) = tls_worker(&dir);
    let worker = format!("id=1,url=https://localhost:{port},api_key=sk-w");
    let ca = cert.to_string_lossy().into_owned();
    let r = Router::start(&[
        "--worker-ca",
        &ca,
        "--worker",
        &worker,
        "--health-interval-secs",
        "0.2",
        "--health-failures",
        "1",
    ]);
    assert!(
        r.out.contains("verified against the CA bundle"),
        "{}",
        r.out
    );
    // A few health rounds: still healthy, no error.
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, workers) = r.call("GET", "/v1/workers", "");
    assert!(
        workers.contains(r#""healthy":true,"health_error":null"#),
        "{workers}"
    );
    let (status, text) = r.call(
        "POST",
        "/v1/chat/completions",
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
    );
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("tls ok"), "{text}");
    drop(r);

    // Without the CA the same worker is not trusted, and /ready says why.
    let r = Router::start(&[
        "--worker",
        &worker,
        "--health-interval-secs",
        "0.2",
        "--health-failures",
        "1",
    ]);
    let began = Instant::now();
    loop {
        let (status, ready) = r.call("GET", "/ready", "");
        if status == 503 && ready.contains("UnknownIssuer") {
            assert!(ready.contains("worker 1: health check failing"), "{ready}");
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{status}: {ready}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_dir_all(dir);
}
