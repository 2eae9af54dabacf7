//! Removing a worker while its events stream in leaves nothing of it behind (issue 12: "worker
//! removal fences that worker's ingest first"): a vLLM-format publisher keeps publishing
//! stores as fast as it can while the worker is deleted over HTTP (the request lands on any
//! core); after the removal no block of the worker may be indexed, however its last batches
//! raced the removal. Repeated, re-registering the worker each time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::VllmPublisher;

struct Router {
    child: Child,
    http: String,
}

impl Router {
    fn start() -> Router {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args([
                "--cores",
                "2",
                "--no-pin",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--tokenizer",
                "stand-in",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut out = String::new();
        loop {
            let mut line = String::new();
            assert!(reader.read_line(&mut line).unwrap() > 0, "exited: {out}");
            out.push_str(&line);
            if line.contains("Ctrl-C stops") {
                break;
            }
        }
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = reader.read_to_string(&mut sink);
        });
        let http = out
            .lines()
            .find_map(|l| l.split("HTTP on http://").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap()
            .to_owned();
        Router { child, http }
    }

    fn call(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(&self.http).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let status = resp[9..12].parse().unwrap();
        let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, body.to_owned())
    }

    /// Sum of every series of `name` on `/metrics`.
    fn metric_sum(&self, name: &str) -> f64 {
        let (_, text) = self.call("GET", "/metrics", "");
        text.lines()
            .filter(|l| {
                l.starts_with(name)
                    && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn store(n: u64) -> WireBatch {
    WireBatch {
        ts: None,
        dp_rank: Some(0),
        events: vec![WireEvent::Stored {
            block_hashes: vec![n],
            parent: None,
            token_ids: (0..16).map(|i| (n * 16 + i) as u32).collect(),
            block_size: Some(16),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
        }],
        unknown_events: 0,
    }
}

#[test]
fn a_removed_workers_racing_batches_leave_nothing_indexed() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let publisher = rt
        .block_on(VllmPublisher::bind("tcp://127.0.0.1:0", None, 16))
        .unwrap();
    let endpoint = publisher.endpoint().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let publishing = {
        let stop = stop.clone();
        let mut publisher = publisher;
        rt.spawn(async move {
            let mut n = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = publisher.publish(&store(n)).await;
                n += 1;
                if n.is_multiple_of(16) {
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    let r = Router::start();
    let body = format!(r#"{{"worker_id": 7, "zmq": "{endpoint}"}}"#);
    for round in 0..8 {
        let (status, _) = r.call("POST", "/v1/workers", &body);
        assert!(status == 200 || status == 201, "round {round}: {status}");
        // Let its events flow, then remove it mid-stream.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while r.metric_sum("kvengine_directory_entries") == 0.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: no events"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (status, body) = r.call("DELETE", "/v1/workers/7", "");
        assert_eq!(status, 200, "round {round}: {body}");
        // Batches published after the removal, and any that raced it, must not land.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            r.metric_sum("kvengine_directory_entries"),
            0.0,
            "round {round}: a removed worker's blocks are indexed"
        );
        assert_eq!(r.metric_sum("kvengine_index_entries"), 0.0, "round {round}");
    }
    stop.store(true, Ordering::Relaxed);
    rt.block_on(publishing).unwrap();
}
