//! Removing a worker while its events stream in leaves nothing of it behind (issue 12: "worker
//! removal fences that worker's ingest first"): a vLLM-format publisher keeps publishing
//! stores as fast as it can while the worker is deleted over HTTP (the request lands on any
//! core); after the removal no block of the worker may be indexed, however its last batches
//! raced the removal. Repeated, re-registering the worker each time.

mod common;

use common::Router;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::VllmPublisher;

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
            extra_keys: None,
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
    let r = Router::start(&["--tokenizer", "stand-in"]);
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
