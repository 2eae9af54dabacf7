//! Helpers shared by the simulated-worker integration tests: raw HTTP/1.1 exchanges and a
//! kvengine hub subscribed to one worker's KV events over ZMQ.
//!
//! Each test binary compiles this module on its own, so a helper one of them does not use
//! is marked `#[allow(dead_code)]`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use engine::{DpRank, WorkerId, WorkerKey};
use lab::workers::SimWorkerHandle;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use transport::hub::{Hub, HubConfig, Registration, start_engine};
use transport::zmq::{SubscriberConfig, ZmqSource, spawn_subscriber};

/// The bytes of one HTTP/1.1 request with a JSON body and `Connection: close`.
#[allow(dead_code)]
pub fn request_bytes(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    request_bytes_with(method, path, &[], body)
}

/// [`request_bytes`] with extra `(name, value)` headers.
fn request_bytes_with(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

/// Decodes a chunked transfer-encoded body.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n").unwrap();
        let size_text = std::str::from_utf8(&raw[..line_end]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        raw = &raw[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// One HTTP/1.1 exchange: the status, the content type and the (de-chunked) body.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String, String) {
    call_with(addr, method, path, &[], body).await
}

/// [`call`] with extra `(name, value)` headers.
pub async fn call_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&request_bytes_with(method, path, headers, body))
        .await
        .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .expect("response timed out")
        .unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or("")
        .to_owned();
    let rest = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    (status, content_type, String::from_utf8(body).unwrap())
}

/// POSTs a JSON body: the status and the answer as JSON (a JSON string if it is not JSON).
pub async fn post_json(w: &SimWorkerHandle, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, text) = call(w.http_addr(), "POST", path, body.to_string().as_bytes()).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// GETs a JSON answer, asserting a 200.
#[allow(dead_code)]
pub async fn get_json(w: &SimWorkerHandle, path: &str) -> Value {
    let (status, _, text) = call(w.http_addr(), "GET", path, b"").await;
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// `n` consecutive token ids from `base`.
pub fn ids(base: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| base + i).collect()
}

/// A kvengine engine runtime and [`Hub`] with one simulated worker registered and its
/// ZMQ KV events subscribed to (and known to be flowing).
pub struct SubscribedHub {
    hub: Arc<Hub>,
    runtime: Runtime,
    task: JoinHandle<()>,
    worker: WorkerId,
}

impl SubscribedHub {
    /// Starts the engine, registers `w` as `worker` and subscribes to its events, probing
    /// `w` with small completions until the first event has been forwarded.
    pub async fn start(w: &SimWorkerHandle, worker: u64) -> Self {
        let runtime_cfg = RuntimeConfig {
            pin_cores: false,
            ingest_handles: 2,
            query_handles: 2,
            ..RuntimeConfig::default()
        };
        let hub_cfg = HubConfig {
            scheduler: SchedulerConfig::default(),
        };
        let (hub, runtime) =
            start_engine(hub_cfg, Sharding::adaptive(2).unwrap(), runtime_cfg).unwrap();
        let hub = Arc::new(hub);
        let source: ZmqSource = w.zmq_worker_flag(worker).parse().unwrap();
        assert_eq!(source.replay.as_deref(), Some(w.replay_endpoint()));
        hub.register(Registration {
            zmq: Some(source.publisher.clone()),
            replay: source.replay.clone(),
            ..Registration::new(WorkerId(worker))
        })
        .unwrap();
        let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());

        // PUB/SUB drops what is published before the subscription is up: probe until it is.
        let start = Instant::now();
        let mut probe = 0;
        while hub.metrics().events_forwarded.load(Relaxed) == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "never subscribed"
            );
            let body = json!({"prompt": ids(100_000 + probe * 100, 32), "max_tokens": 1});
            assert_eq!(post_json(w, "/v1/completions", &body).await.0, 200);
            probe += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            hub,
            runtime,
            task,
            worker: WorkerId(worker),
        }
    }

    /// The registered worker's key (data-parallel rank 0).
    pub fn key(&self) -> WorkerKey {
        WorkerKey {
            worker: self.worker,
            dp_rank: DpRank(0),
        }
    }

    /// Waits (up to 10 s) until the index's overlap for `prompt` is `expected`; `what`
    /// describes the wait in the failure message.
    pub async fn wait_overlap(&self, prompt: &[u32], expected: Vec<(WorkerKey, u32)>, what: &str) {
        let start = Instant::now();
        loop {
            self.hub.sync().unwrap();
            let overlaps = self.hub.overlap(None, prompt, None).unwrap().2.overlaps;
            if overlaps == expected {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{what}: index overlap {overlaps:?}, expected {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Asserts nothing had to be resynced, then stops the subscriber, the hub and the
    /// engine runtime.
    pub async fn stop(self) {
        assert_eq!(self.hub.metrics().resyncs.load(Relaxed), 0);
        self.task.abort();
        let _ = self.task.await;
        drop(self.hub);
        self.runtime.join().unwrap();
    }
}
