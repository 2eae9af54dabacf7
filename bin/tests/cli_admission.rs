//! The admission queue through the `kvengine` binary (issue 31): a stub worker in the test
//! holds each completion until the test lets it answer, so which requests are running,
//! waiting or refused is decided by the test, not by timing. `--busy-max-active 1` makes
//! the worker busy while it holds one request.
//!
//! The router is another process: that a request is waiting is read from its `/metrics`
//! (a bounded wait on a stated condition, as the other end-to-end tests do).

mod common;

use common::Router;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A completion the stub holds: its prompt, and the sender that lets it answer.
type Held = (String, mpsc::Sender<()>);

/// A worker on a free port: `/health` answers 200, every `POST` is held until released.
fn stub() -> (String, mpsc::Receiver<Held>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel::<Held>();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let tx = tx.clone();
            std::thread::spawn(move || serve(conn, tx));
        }
    });
    (url, rx)
}

fn serve(conn: TcpStream, tx: mpsc::Sender<Held>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let post = line.starts_with("POST");
        let mut length = 0;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let answer = if post {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let prompt = v["prompt"].as_str().unwrap_or_default().to_owned();
            let (go, wait) = mpsc::channel();
            if tx.send((prompt, go)).is_err() || wait.recv().is_err() {
                return;
            }
            r#"{"object":"text_completion","choices":[{"text":"ok"}]}"#
        } else if line.starts_with("GET /health") {
            "{}"
        } else {
            let _ = write!(conn, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
            continue;
        };
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
    }
}

/// Starts a completion of `prompt` at `r` on a thread; joins to (status, lowercased head).
fn complete(r: &Router, prompt: &str) -> std::thread::JoinHandle<(u16, String)> {
    let addr = r.http.clone();
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    std::thread::spawn(move || {
        common::post_head(&addr, "/v1/completions", "", &body, Duration::from_secs(60))
    })
}

/// Waits up to 20 s for `/metrics` series `name` to read `want`.
fn wait_metric(r: &Router, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.metric(name) != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{name} stayed at {:?}, not {want}",
            r.metric(name)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn router(url: &str, queue: &str, timeout_ms: &str) -> Router {
    let worker = format!("id=1,url={url}");
    Router::start(&[
        "--worker",
        &worker,
        "--tokenizer",
        "stand-in",
        "--busy-max-active",
        "1",
        "--admission-queue",
        queue,
        "--admission-timeout-ms",
        timeout_ms,
    ])
}

#[test]
fn a_busy_worker_queues_one_request_refuses_the_next_and_admits_on_finish() {
    let (url, held) = stub();
    let r = router(&url, "1", "60000");
    let first = complete(&r, "first");
    let (prompt, release_first) = held.recv().unwrap();
    assert_eq!(prompt, "first");
    let second = complete(&r, "second");
    wait_metric(&r, "kvengine_admission_queue_depth", 1.0);
    // --admission-queue 1: the third is refused at once.
    let (status, head) = complete(&r, "third").join().unwrap();
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    // The worker finishes the first: the second is admitted and sent.
    release_first.send(()).unwrap();
    assert_eq!(first.join().unwrap().0, 200);
    let (prompt, release) = held.recv().unwrap();
    assert_eq!(prompt, "second");
    release.send(()).unwrap();
    assert_eq!(second.join().unwrap().0, 200);
    assert_eq!(r.metric("kvengine_admission_admitted_total"), Some(1.0));
    assert_eq!(
        r.metric(r#"kvengine_admission_rejected_total{reason="full"}"#),
        Some(1.0)
    );
    assert_eq!(r.metric("kvengine_admission_queue_depth"), Some(0.0));
}

#[test]
fn a_request_waiting_past_the_timeout_is_answered_503() {
    let (url, held) = stub();
    let r = router(&url, "4", "200");
    let first = complete(&r, "first");
    let (_, release_first) = held.recv().unwrap();
    // Waits its 200 ms (the behaviour under test), then 503 with Retry-After.
    let (status, head) = complete(&r, "late").join().unwrap();
    assert_eq!(status, 503, "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert_eq!(
        r.metric(r#"kvengine_admission_rejected_total{reason="timeout"}"#),
        Some(1.0)
    );
    release_first.send(()).unwrap();
    assert_eq!(first.join().unwrap().0, 200);
    // The late one never reached the worker.
    assert!(held.try_recv().is_err());
}
