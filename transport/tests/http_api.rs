//! The HTTP edge end to end: every endpoint over a real socket, against a real two-core
//! engine (block size 16).

mod common;

use bytes::Bytes;
use engine::WorkerId;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use transport::http::{HttpConfig, health::health_loop};
use transport::hub::Hub;
use transport::sources::{Sources, SourcesConfig};

struct Server {
    base: String,
    hub: Arc<Hub>,
    client: Client<HttpConnector, Full<Bytes>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start(cfg: HttpConfig) -> Server {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    serve(hub, cfg).await
}

/// A server whose registrations start event sources ([`Sources`]).
async fn start_with_sources() -> (Server, Arc<Sources>) {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    let sources = Sources::on_current(hub.clone(), SourcesConfig::default());
    let cfg = HttpConfig {
        sources: Some(sources.clone()),
        ..HttpConfig::default()
    };
    (serve(hub, cfg).await, sources)
}

async fn serve(hub: Arc<Hub>, cfg: HttpConfig) -> Server {
    let (base, stop) = common::http_server(hub.clone(), cfg).await;
    Server {
        base,
        hub,
        client: Client::builder(TokioExecutor::new()).build_http(),
        stop: Some(stop),
    }
}

impl Server {
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let (status, text) = self.raw(method, path, body.into_bytes()).await;
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&text)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&text).into_owned()))
        };
        (status, v)
    }

    async fn raw(&self, method: Method, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, bytes.to_vec())
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    async fn delete(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::DELETE, path, None).await
    }

    async fn metrics(&self) -> String {
        let (s, text) = self.raw(Method::GET, "/metrics", Vec::new()).await;
        assert_eq!(s, StatusCode::OK);
        String::from_utf8(text).unwrap()
    }

    async fn register(&self, worker: u64) {
        let (s, _) = self.post("/v1/workers", json!({"worker_id": worker})).await;
        assert!(s.is_success(), "{s}");
    }

    /// Stores `blocks` 16-token blocks of `prompt` for `worker` (engine hashes from `base`).
    async fn store(&self, worker: u64, prompt: &[u32], blocks: usize, base: u64) -> Value {
        let blocks: Vec<Value> = prompt
            .chunks(16)
            .take(blocks)
            .enumerate()
            .map(|(i, c)| json!({"block_hash": base + i as u64, "token_ids": c}))
            .collect();
        let (s, v) = self
            .post(
                "/v1/events",
                json!({"worker_id": worker, "events": [{"type": "stored", "parent_hash": null, "blocks": blocks}]}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }

    async fn overlaps(&self, prompt: &[u32]) -> Vec<(u64, u64)> {
        let (s, v) = self.post("/v1/overlap", json!({"token_ids": prompt})).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["worker_id"].as_u64().unwrap(),
                    s["overlap_blocks"].as_u64().unwrap(),
                )
            })
            .collect()
    }
}

fn prompt(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn error_code(v: &Value) -> &str {
    assert!(v["error"]["message"].is_string(), "{v}");
    v["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_unknown_paths() {
    let s = start(HttpConfig::default()).await;
    assert_eq!(
        s.get("/healthz").await,
        (StatusCode::OK, json!({"status": "ok", "workers": 0}))
    );
    s.register(1).await;
    assert_eq!(s.get("/healthz").await.1["workers"], 1);
    let (st, v) = s.get("/nope").await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "not_found");
    let (st, v) = s.get("/v1/route").await;
    assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(error_code(&v), "method_not_allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_is_sorted_and_omits_zero_overlaps() {
    let s = start(HttpConfig::default()).await;
    for w in [1, 2, 3, 4] {
        s.register(w).await;
    }
    let p = prompt(1000, 64 + 5);
    s.store(2, &p, 4, 100).await;
    s.store(1, &p, 2, 200).await;
    s.store(3, &prompt(5000, 64), 4, 300).await;
    s.hub.sync().unwrap();
    let (st, v) = s.post("/v1/overlap", json!({"token_ids": p})).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        v,
        json!({"block_size": 16, "blocks": 4, "scores": [
            {"worker_id": 2, "dp_rank": 0, "overlap_blocks": 4},
            {"worker_id": 1, "dp_rank": 0, "overlap_blocks": 2},
        ]})
    );
    // Shorter than a block, or empty: no scores.
    for short in [vec![], prompt(1000, 15)] {
        let (st, v) = s.post("/v1/overlap", json!({"token_ids": short})).await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(v["blocks"], 0);
        assert_eq!(v["scores"], json!([]));
    }
    // A LoRA adapter hashes differently: nothing matches.
    let (_, v) = s
        .post(
            "/v1/overlap",
            json!({"token_ids": p, "lora_name": "adapter"}),
        )
        .await;
    assert_eq!(v["scores"], json!([]));
    // No state changed.
    assert_eq!(s.hub.routing().active_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_explains_candidates_and_the_request_stays_active_until_deleted() {
    let s = start(HttpConfig::default()).await;
    let p = prompt(1, 64);
    // No workers yet.
    let (st, v) = s.post("/v1/route", json!({"token_ids": p})).await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_code(&v), "no_workers");

    for w in [1, 2, 3] {
        s.register(w).await;
    }
    s.store(2, &p, 4, 10).await;
    s.store(3, &p, 1, 20).await;
    s.hub.sync().unwrap();

    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "request_id": "r1"}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["request_id"], "r1");
    assert_eq!(v["worker_id"], 2);
    assert_eq!(v["dp_rank"], 0);
    assert_eq!(v["mode"], "kv");
    assert_eq!(v["overlap_blocks"], 4);
    assert_eq!(v["best_available_overlap_blocks"], 4);
    let cands = v["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 3);
    for c in cands {
        for f in [
            "worker_id",
            "dp_rank",
            "overlap_blocks",
            "prefill_blocks",
            "decode_blocks",
            "logit",
        ] {
            assert!(c[f].is_number(), "{f} in {c}");
        }
    }
    let c2 = cands.iter().find(|c| c["worker_id"] == 2).unwrap();
    assert_eq!(c2["overlap_blocks"], 4);
    assert_eq!(c2["prefill_blocks"], 0.0);
    let c1 = cands.iter().find(|c| c["worker_id"] == 1).unwrap();
    assert_eq!(c1["prefill_blocks"], 4.0);
    assert_eq!(s.hub.routing().active_requests(), 1);

    // The request shows in the worker's load until it is deleted.
    let (_, w) = s.get("/v1/workers").await;
    let w2 = w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == 2)
        .unwrap()
        .clone();
    assert_eq!(w2["loads"][0]["active_requests"], 1);
    assert_eq!(w2["loads"][0]["active_prefill_tokens"], 0);

    // A duplicate id is refused.
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "request_id": "r1"}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(error_code(&v), "duplicate_request");

    let (st, v) = s.post("/v1/requests/r1/prefilled", json!({})).await;
    assert_eq!((st, v), (StatusCode::OK, json!({})));
    let (st, _) = s.delete("/v1/requests/r1").await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(s.hub.routing().active_requests(), 0);
    let (st, v) = s.delete("/v1/requests/r1").await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_request");
    let (st, v) = s.post("/v1/requests/nope/prefilled", json!({})).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_request");

    // Generated ids, other modes, overrides.
    let (st, v) = s.post("/v1/route", json!({"token_ids": p})).await;
    assert_eq!(st, StatusCode::OK);
    let generated = v["request_id"].as_str().unwrap().to_owned();
    assert!(!generated.is_empty());
    let (st, _) = s.delete(&format!("/v1/requests/{generated}")).await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s
        .post(
            "/v1/route",
            json!({"token_ids": p, "mode": "direct", "worker_id": 3}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["worker_id"].clone(), v["mode"].clone()),
        (json!(3), json!("direct"))
    );
    assert_eq!(v["overlap_blocks"], 1);
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "mode": "round-robin", "temperature": 0.5, "overlap_weight": 2.0}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["mode"], "round-robin");
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "mode": "random"}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "mode": "fastest"}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&v), "invalid_argument");
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "mode": "direct"}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "temperature": -1.0}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "worker_id": 99}))
        .await;
    assert!(
        st.is_client_error() || st == StatusCode::SERVICE_UNAVAILABLE,
        "{st} {v}"
    );
    assert_eq!(
        s.hub.routing().active_requests(),
        3,
        "direct, round-robin and random"
    );
    // Ids with reserved characters travel percent-encoded.
    let (st, _) = s
        .post("/v1/route", json!({"token_ids": p, "request_id": "a b/c"}))
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s.delete("/v1/requests/a%20b%2Fc").await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_report_applied_and_rejected() {
    let s = start(HttpConfig::default()).await;
    s.register(1).await;
    let p = prompt(0, 48);
    let block = |i: usize, h: u64| json!({"block_hash": h, "token_ids": &p[i * 16..(i + 1) * 16]});
    let (st, v) = s
        .post(
            "/v1/events",
            json!({"worker_id": 1, "events": [
                {"type": "stored", "parent_hash": null, "blocks": [block(0, 10)]},
                {"type": "stored", "parent_hash": 10, "blocks": [block(1, 11)]},
                {"type": "stored", "parent_hash": 11, "blocks": [{"block_hash": 12, "token_ids": [1, 2, 3]}]},
                {"type": "stored", "parent_hash": 999, "blocks": [block(2, 13)]},
                {"type": "removed", "block_hashes": [11]},
                {"type": "stored", "parent_hash": 10, "lora_name": null, "blocks": [block(1, 11)]},
            ]}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["applied"], 4);
    assert_eq!(v["rejected"], 2);
    let reasons: Vec<(u64, &str)> = v["rejected_reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["index"].as_u64().unwrap(), r["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        reasons,
        vec![(2, "token_count_mismatch"), (3, "unknown_parent")]
    );
    assert_eq!(s.overlaps(&p).await, vec![(1, 2)]);

    // Nothing applied: 400 with the reasons.
    let (st, v) = s
        .post(
            "/v1/events",
            json!({"worker_id": 1, "events": [{"type": "stored", "parent_hash": 77, "blocks": [block(2, 14)]}]}),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&v), "nothing_applied");
    assert_eq!(
        v["error"]["rejected_reasons"][0]["reason"],
        "unknown_parent"
    );

    // Unknown worker.
    let (st, v) = s
        .post(
            "/v1/events",
            json!({"worker_id": 9, "events": [{"type": "cleared"}]}),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_worker");

    // An empty batch and a clear.
    let (st, v) = s
        .post("/v1/events", json!({"worker_id": 1, "events": []}))
        .await;
    assert_eq!(
        (st, v),
        (StatusCode::OK, json!({"applied": 0, "rejected": 0}))
    );
    let (st, v) = s
        .post(
            "/v1/events",
            json!({"worker_id": 1, "dp_rank": 0, "events": [{"type": "cleared"}]}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(s.overlaps(&p).await.is_empty());

    // A new dp rank registers itself.
    s.store(1, &p, 1, 50).await;
    let (_, v) = s
        .post(
            "/v1/events",
            json!({"worker_id": 1, "dp_rank": 3, "events": [{"type": "stored", "blocks": [block(0, 60)]}]}),
        )
        .await;
    assert_eq!(v["applied"], 1);
    let (_, w) = s.get("/v1/workers").await;
    assert_eq!(w["workers"][0]["dp_ranks"], json!([0, 3]));
    assert_eq!(s.overlaps(&p).await, vec![(1, 1), (1, 1)]);

    let m = s.metrics().await;
    assert!(
        m.contains(r#"kvengine_events_rejected_total{reason="unknown_parent"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvengine_events_rejected_total{reason="token_count_mismatch"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvengine_events_rejected_total{reason="unknown_worker"} 1"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_fencing_skips_duplicates_resyncs_gaps_and_clears_on_restart() {
    let s = start(HttpConfig::default()).await;
    s.register(1).await;
    let p = prompt(0, 64);
    let batch = |seq: u64, from: usize, to: usize, parent: Option<u64>| {
        let blocks: Vec<Value> = (from..to)
            .map(|i| json!({"block_hash": 100 + i as u64, "token_ids": &p[i * 16..(i + 1) * 16]}))
            .collect();
        json!({"worker_id": 1, "seq": seq, "events": [{"type": "stored", "parent_hash": parent, "blocks": blocks}]})
    };
    let (st, v) = s.post("/v1/events", batch(0, 0, 1, None)).await;
    assert_eq!(
        (st, v["fence"].clone()),
        (StatusCode::OK, json!("in_order"))
    );
    let (_, v) = s.post("/v1/events", batch(1, 1, 2, Some(100))).await;
    assert_eq!(
        (v["applied"].clone(), v["fence"].clone()),
        (json!(1), json!("in_order"))
    );
    assert_eq!(s.overlaps(&p).await, vec![(1, 2)]);

    // A retry of batch 1: skipped.
    let (st, v) = s.post("/v1/events", batch(1, 1, 2, Some(100))).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        v,
        json!({"applied": 0, "rejected": 0, "skipped": 1, "fence": "duplicate"})
    );
    assert!(
        s.metrics()
            .await
            .contains(r#"kvengine_events_rejected_total{reason="duplicate_seq"} 1"#)
    );

    // A gap (2..4 missing): the rank is cleared, then the batch applies.
    let (st, v) = s.post("/v1/events", batch(5, 0, 3, None)).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["fence"], "gap");
    s.hub.sync().unwrap();
    assert_eq!(s.overlaps(&p).await, vec![(1, 3)]);
    assert!(s.metrics().await.contains("kvengine_resyncs_total 1"));
    // An unknown parent still fails; the batch consumes its number (6).
    let (st, v) = s.post("/v1/events", batch(6, 2, 3, Some(999))).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");

    // Seq 0 while 7 is expected: the publisher restarted; the rank is cleared first.
    let (st, v) = s.post("/v1/events", batch(0, 0, 1, None)).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["fence"], "restart");
    assert_eq!(s.overlaps(&p).await, vec![(1, 1)]);
    assert!(
        s.metrics()
            .await
            .contains("kvengine_publisher_restarts_total 1")
    );
    let (_, v) = s.post("/v1/events", batch(1, 1, 4, Some(100))).await;
    assert_eq!(v["fence"], "in_order");
    assert_eq!(s.overlaps(&p).await, vec![(1, 4)]);

    // A lower number that is not a retry of the last batch (a publisher that restarted and
    // is already past 0): cleared too, as ZMQ and QUIC do.
    let (_, v) = s.post("/v1/events", batch(2, 2, 3, Some(101))).await;
    assert_eq!(v["fence"], "in_order");
    assert_eq!(s.overlaps(&p).await, vec![(1, 4)]);
    let (st, v) = s.post("/v1/events", batch(1, 0, 2, None)).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["fence"], "restart");
    assert_eq!(s.overlaps(&p).await, vec![(1, 2)]);
    // The last batch again, byte for byte: a retry, skipped; the next number applies.
    let (_, v) = s.post("/v1/events", batch(1, 0, 2, None)).await;
    assert_eq!(v["fence"], "duplicate");
    let (_, v) = s.post("/v1/events", batch(2, 2, 3, Some(101))).await;
    assert_eq!(v["fence"], "in_order");
    assert_eq!(s.overlaps(&p).await, vec![(1, 3)]);
    assert!(
        s.metrics()
            .await
            .contains("kvengine_publisher_restarts_total 2")
    );

    // Ranks are fenced separately.
    let mut b = batch(40, 0, 1, None);
    b["dp_rank"] = json!(1);
    let (_, v) = s.post("/v1/events", b).await;
    assert_eq!(v["fence"], "in_order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_list_and_delete() {
    let (s, sources) = start_with_sources().await;
    let (st, v) = s
        .post(
            "/v1/workers",
            json!({"worker_id": 5, "url": "http://127.0.0.1:1/", "zmq": "tcp://127.0.0.1:5557", "dp_ranks": [0, 1]}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["worker_id"], 5);
    assert_eq!(v["dp_ranks"], json!([0, 1]));
    assert_eq!(v["url"], "http://127.0.0.1:1");
    assert_eq!(v["healthy"], true);
    assert_eq!(v["config_error"], Value::Null);
    assert_eq!(v["loads"].as_array().unwrap().len(), 2);
    let (st, v) = s
        .post(
            "/v1/workers",
            json!({"worker_id": 5, "replay": "tcp://127.0.0.1:5558", "dp_ranks": [2]}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["dp_ranks"], json!([0, 1, 2]));
    assert_eq!(v["zmq"], "tcp://127.0.0.1:5557");
    assert_eq!(v["replay"], "tcp://127.0.0.1:5558");
    // Its subscription started once and was kept through the re-registration.
    assert_eq!(sources.workers(), vec![WorkerId(5)]);

    let (st, v) = s
        .post("/v1/workers", json!({"worker_id": 6, "url": "ftp://x"}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&v), "invalid_argument");

    let (st, v) = s.get("/v1/workers").await;
    assert_eq!(st, StatusCode::OK);
    let w = &v["workers"][0];
    for f in [
        "worker_id",
        "dp_ranks",
        "url",
        "zmq",
        "replay",
        "healthy",
        "resyncing",
        "config_error",
        "events",
        "loads",
    ] {
        assert!(w.get(f).is_some(), "{f} missing from {w}");
    }
    for f in [
        "dp_rank",
        "active_blocks",
        "active_prefill_tokens",
        "active_requests",
        "num_requests_waiting",
        "kv_usage",
    ] {
        assert!(w["loads"][0].get(f).is_some(), "{f} missing from {w}");
    }

    let p = prompt(0, 32);
    s.store(5, &p, 2, 1).await;
    s.hub.sync().unwrap();
    assert_eq!(s.overlaps(&p).await, vec![(5, 2)]);
    let (st, _) = s
        .post("/v1/route", json!({"token_ids": p, "request_id": "x"}))
        .await;
    assert_eq!(st, StatusCode::OK);

    let (st, v) = s.delete("/v1/workers/5").await;
    assert_eq!((st, v), (StatusCode::OK, json!({"removed": true})));
    assert_eq!(sources.workers(), vec![], "its subscription stopped");
    s.hub.sync().unwrap();
    assert!(s.overlaps(&p).await.is_empty(), "blocks gone");
    assert_eq!(s.hub.routing().active_requests(), 0, "requests gone");
    let (st, v) = s.delete("/v1/workers/5").await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_worker");
    let (st, v) = s.delete("/v1/workers/abc").await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&v), "invalid_argument");
    assert_eq!(s.get("/v1/workers").await.1, json!({"workers": []}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensorrt_llm_workers_register_with_their_poll_interval() {
    let (s, sources) = start_with_sources().await;
    let (st, v) = s
        .post(
            "/v1/workers",
            json!({"worker_id": 8, "url": "http://127.0.0.1:1", "events": "trtllm", "poll_ms": 40}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["event_source"], "trtllm");
    assert_eq!(v["poll_ms"], 40);
    assert_eq!(v["zmq"], Value::Null);
    // A re-registration without the fields keeps them; the default interval is 100 ms.
    let (st, v) = s
        .post("/v1/workers", json!({"worker_id": 8, "dp_ranks": [1]}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["poll_ms"], 40);
    let (st, v) = s
        .post(
            "/v1/workers",
            json!({"worker_id": 9, "url": "http://127.0.0.1:2", "events": "trtllm"}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["poll_ms"], 100);
    let ms = |n| Some(std::time::Duration::from_millis(n));
    for (w, poll) in [(8, ms(40)), (9, ms(100))] {
        let reg = s.hub.registry().registration(WorkerId(w)).unwrap();
        assert_eq!(reg.trtllm_poll, poll, "worker {w}");
    }
    assert_eq!(sources.workers(), vec![WorkerId(8), WorkerId(9)], "polled");
    // A ZMQ worker shows no event source.
    let (st, v) = s
        .post(
            "/v1/workers",
            json!({"worker_id": 10, "zmq": "tcp://127.0.0.1:5557"}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert!(v.get("event_source").is_none(), "{v}");
    let reg = s.hub.registry().registration(WorkerId(10)).unwrap();
    assert_eq!(reg.trtllm_poll, None);
    assert_eq!(
        sources.workers(),
        vec![WorkerId(8), WorkerId(9), WorkerId(10)],
        "subscribed"
    );
    for bad in [
        json!({"worker_id": 11, "events": "trtllm"}),
        json!({"worker_id": 11, "url": "http://127.0.0.1:1", "events": "trtllm",
               "zmq": "tcp://127.0.0.1:5557"}),
        json!({"worker_id": 11, "url": "http://127.0.0.1:1", "events": "trtllm", "poll_ms": 0}),
        json!({"worker_id": 11, "url": "http://127.0.0.1:1", "poll_ms": 10}),
        json!({"worker_id": 11, "url": "http://127.0.0.1:1", "events": "nats"}),
        json!({"worker_id": 11, "url": "http://127.0.0.1:1/v1", "events": "trtllm"}),
    ] {
        let (st, v) = s.post("/v1/workers", bad.clone()).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_eq!(error_code(&v), "invalid_argument", "{bad}");
    }
    assert_eq!(
        sources.workers(),
        vec![WorkerId(8), WorkerId(9), WorkerId(10)],
        "refused registrations start no source"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_are_validated_and_shown() {
    let s = start(HttpConfig::default()).await;
    s.register(1).await;
    let (st, v) = s
        .post(
            "/v1/load",
            json!({"worker_id": 1, "num_requests_waiting": 3, "kv_usage": 0.25}),
        )
        .await;
    assert_eq!((st, v), (StatusCode::OK, json!({})));
    // A load report never creates a rank; registering one does.
    let rank2 = json!({"worker_id": 1, "dp_rank": 2, "num_requests_waiting": 0, "kv_usage": 1.0});
    let (st, v) = s.post("/v1/load", rank2.clone()).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_rank");
    let (st, _) = s
        .post("/v1/workers", json!({"worker_id": 1, "dp_ranks": [0, 2]}))
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) = s.post("/v1/load", rank2).await;
    assert_eq!(st, StatusCode::OK);
    let (_, w) = s.get("/v1/workers").await;
    let loads = &w["workers"][0]["loads"];
    assert_eq!(loads[0]["num_requests_waiting"], 3);
    assert_eq!(loads[0]["kv_usage"], 0.25);
    assert_eq!(loads[1]["dp_rank"], 2);
    for bad in [1.5, -0.1] {
        let (st, v) = s
            .post(
                "/v1/load",
                json!({"worker_id": 1, "num_requests_waiting": 0, "kv_usage": bad}),
            )
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert_eq!(error_code(&v), "invalid_argument");
    }
    let (st, v) = s
        .post(
            "/v1/load",
            json!({"worker_id": 2, "num_requests_waiting": 0, "kv_usage": 0.5}),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&v), "unknown_worker");
    let m = s.metrics().await;
    assert!(
        m.contains(r#"kvengine_worker_requests_waiting{worker_id="1",dp_rank="0"} 3"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvengine_worker_kv_usage{worker_id="1",dp_rank="0"} 0.25"#),
        "{m}"
    );
}

const METRICS: [&str; 33] = [
    "kvengine_events_applied_total",
    "kvengine_events_rejected_total",
    "kvengine_block_events_total",
    "kvengine_index_entries",
    "kvengine_ring_backlog",
    "kvengine_directory_entries",
    "kvengine_queries_total",
    "kvengine_decisions_total",
    "kvengine_route_overlap_blocks_bucket",
    "kvengine_route_best_overlap_blocks_bucket",
    "kvengine_ingest_lag_seconds_bucket",
    "kvengine_replayed_batches_total",
    "kvengine_resyncs_total",
    "kvengine_publisher_restarts_total",
    "kvengine_active_requests",
    "kvengine_worker_active_blocks",
    "kvengine_worker_active_prefill_tokens",
    "kvengine_worker_active_requests",
    "kvengine_worker_requests_waiting",
    "kvengine_worker_kv_usage",
    "kvengine_worker_healthy",
    "kvengine_events_rejected_total{reason=\"malformed_json\"}",
    "kvengine_decision_reasons_total",
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_start_time_seconds",
    "kvengine_index_heap_bytes",
    "kvengine_index_budget_bytes",
    "kvengine_index_full",
    "kvengine_stores_refused_total{reason=\"index_full\"}",
    "kvengine_workers_degraded{reason=\"worker_full\"}",
    "kvengine_routes_overloaded_total",
];

fn value_of(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{series} not in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_list_every_series_and_move() {
    let s = start(HttpConfig::default()).await;
    s.register(1).await;
    let p = prompt(0, 64);
    s.store(1, &p, 4, 1).await;
    s.post(
        "/v1/load",
        json!({"worker_id": 1, "num_requests_waiting": 0, "kv_usage": 0.5}),
    )
    .await;
    let (st, _) = s.post("/v1/route", json!({"token_ids": p})).await;
    assert_eq!(st, StatusCode::OK);
    let m = s.metrics().await;
    for name in METRICS {
        assert!(m.contains(name), "{name} missing:\n{m}");
    }
    assert_eq!(value_of(&m, "kvengine_events_applied_total"), 1.0);
    assert_eq!(
        value_of(&m, r#"kvengine_block_events_total{kind="stored"}"#),
        4.0
    );
    assert_eq!(value_of(&m, r#"kvengine_decisions_total{mode="kv"}"#), 1.0);
    // The only worker cached the prompt: the best overlap won.
    assert_eq!(
        value_of(
            &m,
            r#"kvengine_decision_reasons_total{reason="best_overlap"}"#
        ),
        1.0
    );
    assert_eq!(
        value_of(
            &m,
            r#"kvengine_decision_reasons_total{reason="traded_for_load"}"#
        ),
        0.0
    );
    assert!(value_of(&m, "process_resident_memory_bytes") > 1e6);
    assert_eq!(value_of(&m, "kvengine_route_overlap_blocks_count"), 1.0);
    assert_eq!(value_of(&m, "kvengine_route_overlap_blocks_sum"), 4.0);
    assert_eq!(value_of(&m, "kvengine_active_requests"), 1.0);
    assert_eq!(value_of(&m, "kvengine_directory_entries"), 4.0);
    assert_eq!(
        value_of(
            &m,
            r#"kvengine_worker_active_requests{worker_id="1",dp_rank="0"}"#
        ),
        1.0
    );
    assert_eq!(
        value_of(&m, r#"kvengine_worker_healthy{worker_id="1",dp_rank="0"}"#),
        1.0
    );
    let malformed = r#"kvengine_events_rejected_total{reason="malformed_json"}"#;
    assert_eq!(value_of(&m, malformed), 0.0);

    let (st, _) = s.raw(Method::POST, "/v1/route", b"{nope".to_vec()).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = s.raw(Method::POST, "/v1/events", b"[1,".to_vec()).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let m = s.metrics().await;
    assert_eq!(value_of(&m, malformed), 2.0);
}

/// A stand-in worker whose `/health` answers 200 or 500.
async fn fake_worker(up: Arc<AtomicBool>) -> String {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/health",
        get(move || {
            let up = up.clone();
            async move {
                if up.load(Ordering::SeqCst) {
                    StatusCode::OK
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_take_failing_workers_out_of_routing_and_back() {
    let s = start(HttpConfig::default()).await;
    let up = Arc::new(AtomicBool::new(true));
    let url = fake_worker(up.clone()).await;
    s.post("/v1/workers", json!({"worker_id": 1, "url": url}))
        .await;
    // A worker without a URL is never checked; one whose URL refuses connections fails.
    s.register(2).await;
    s.post(
        "/v1/workers",
        json!({"worker_id": 3, "url": "http://127.0.0.1:1"}),
    )
    .await;
    let hub = s.hub.clone();
    let task = tokio::spawn(health_loop(
        hub.clone(),
        Duration::from_millis(20),
        Duration::from_millis(500),
        2,
        Default::default(),
    ));
    let healthy = |id: u64| {
        hub.workers()
            .iter()
            .find(|w| w.registration.worker.0 == id)
            .map(|w| w.healthy)
            .unwrap()
    };
    wait_for("worker 3 down", || !healthy(3)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(healthy(1) && healthy(2));

    up.store(false, Ordering::SeqCst);
    wait_for("worker 1 down", || !healthy(1)).await;
    // Out of routing: only worker 2 is left.
    let p = prompt(0, 32);
    for _ in 0..4 {
        let (st, v) = s
            .post("/v1/route", json!({"token_ids": p, "mode": "round-robin"}))
            .await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(v["worker_id"], 2);
    }
    let m = s.metrics().await;
    assert!(
        m.contains(r#"kvengine_worker_healthy{worker_id="1",dp_rank="0"} 0"#),
        "{m}"
    );

    up.store(true, Ordering::SeqCst);
    wait_for("worker 1 back", || healthy(1)).await;
    assert!(!healthy(3));
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_split_route_calls_into_pools() {
    let s = start(HttpConfig::default()).await;
    let p = prompt(7, 64);
    for (w, role) in [(1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode")] {
        let (st, v) = s
            .post(
                "/v1/workers",
                json!({"worker_id": w, "role": role, "bootstrap_port": 8998}),
            )
            .await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        assert_eq!(v["role"], role);
    }
    assert!(
        s.hub.routing().disaggregating(""),
        "prefill and decode workers: the front door splits"
    );
    // Prefill worker 2 holds the prompt: a prefill call goes there, among prefill workers only.
    s.store(2, &p, 4, 10).await;
    s.hub.sync().unwrap();
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "pool": "prefill"}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["worker_id"].clone(), v["pool"].clone()),
        (json!(2), json!("prefill"))
    );
    let ids: Vec<&Value> = v["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["worker_id"])
        .collect();
    assert_eq!(ids, [&json!(1), &json!(2)]);
    // Decode and whole calls choose among decode workers (no aggregated worker exists).
    for pool in ["decode", "whole"] {
        let (_, v) = s
            .post("/v1/route", json!({"token_ids": p, "pool": pool}))
            .await;
        let w = v["worker_id"].as_u64().unwrap();
        assert!(w == 3 || w == 4, "{pool}: {v}");
    }
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "pool": "gpu"}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown pool"),
        "{v}"
    );
    let (st, v) = s
        .post("/v1/workers", json!({"worker_id": 5, "role": "gpu"}))
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    // Turning the prefill workers into decode workers empties the prefill pool.
    for w in [1, 2] {
        s.post("/v1/workers", json!({"worker_id": w, "role": "decode"}))
            .await;
    }
    assert!(
        !s.hub.routing().disaggregating(""),
        "no prefill worker left"
    );
    let (st, v) = s
        .post("/v1/route", json!({"token_ids": p, "pool": "prefill"}))
        .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no prefill worker"),
        "{v}"
    );
}
