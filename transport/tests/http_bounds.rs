//! The router's bounds over HTTP (`transport::bounds`): a rank's block cap, the index's
//! memory budget, the active-request cap and request-id rules, against a real two-core
//! engine (block size 16).

mod common;

use common::raw_request;
use engine::event::KvEvent;
use engine::runtime::{CoreSummary, Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use engine::{EngineHash, WorkerId, WorkerKey};
use serde_json::{Value, json};
use std::sync::Arc;
use transport::bounds::{Degraded, Limits};
use transport::http::HttpConfig;
use transport::hub::{Hub, HubConfig, Registration, start_engine};

struct Edge {
    base: String,
    hub: Arc<Hub>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// An engine whose ranks hold at most `cap` blocks, a hub with `limits` (the budget
/// computed by `budget` from the empty index's heap bytes), and the HTTP edge.
async fn edge(cap: Option<usize>, limits: Limits, budget: impl Fn(u64) -> Option<u64>) -> Edge {
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        max_blocks_per_key: cap,
        ..RuntimeConfig::default()
    };
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let (hub, runtime): (Hub, Runtime) =
        start_engine(config, Sharding::adaptive(2).unwrap(), engine).unwrap();
    std::mem::forget(runtime);
    let empty = heap_bytes(&hub.core_stats().unwrap());
    let hub = Arc::new(hub.with_limits(Limits {
        max_index_bytes: budget(empty),
        max_blocks_per_key: cap,
        ..limits
    }));
    let (base, stop) = common::http_server(hub.clone(), HttpConfig::default()).await;
    Edge {
        base,
        hub,
        _stop: stop,
    }
}

fn heap_bytes(cores: &[CoreSummary]) -> u64 {
    cores
        .iter()
        .map(|c| (c.index.bytes + c.directory_bytes) as u64)
        .sum()
}

impl Edge {
    async fn call(&self, method: &str, path: &str, body: &str) -> (u16, String, Value) {
        let (status, head, body) = raw_request(&self.base, method, path, "", body).await;
        let v = serde_json::from_str(&body).unwrap_or(Value::Null);
        (status, head, v)
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (s, _, v) = self.call("POST", path, &body.to_string()).await;
        (s, v)
    }

    async fn metric(&self, series: &str) -> f64 {
        let (status, _, body) = raw_request(&self.base, "GET", "/metrics", "", "").await;
        assert_eq!(status, 200);
        body.lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{series} not in\n{body}"))
    }

    /// `GET /v1/workers`: `worker`'s degraded ranks as `(rank, reason)`.
    async fn degraded(&self, worker: u64) -> Vec<(u64, String)> {
        let (status, _, v) = self.call("GET", "/v1/workers", "").await;
        assert_eq!(status, 200);
        let w = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == worker)
            .cloned()
            .unwrap();
        w["degraded"]
            .as_array()
            .map(|d| {
                d.iter()
                    .map(|x| {
                        let reason = x["reason"].as_str().unwrap().to_owned();
                        (x["dp_rank"].as_u64().unwrap(), reason)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A stored event of `n` blocks under `parent` (engine hashes `first..`; tokens from
/// `first * 16`).
fn stored(parent: Option<u64>, first: u64, n: u64) -> Value {
    let blocks: Vec<Value> = (first..first + n)
        .map(|h| {
            let t = (h * 16) as u32;
            json!({"block_hash": h, "token_ids": (t..t + 16).collect::<Vec<u32>>()})
        })
        .collect();
    json!({"type": "stored", "parent_hash": parent, "blocks": blocks})
}

fn events(worker: u64, events: Vec<Value>) -> Value {
    json!({"worker_id": worker, "events": events})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_at_its_block_cap_has_stores_refused_and_is_degraded() {
    let e = edge(Some(8), Limits::default(), |_| None).await;
    e.hub.register(Registration::new(WorkerId(1))).unwrap();
    e.hub.register(Registration::new(WorkerId(2))).unwrap();
    let (s, v) = e
        .post("/v1/events", events(1, vec![stored(None, 1, 6)]))
        .await;
    assert_eq!((s, &v["applied"]), (200, &json!(1)), "{v}");
    // 6 + 3 > 8: refused whole, counted, reported.
    let (s, v) = e
        .post("/v1/events", events(1, vec![stored(Some(6), 7, 3)]))
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "nothing_applied");
    assert_eq!(v["error"]["rejected_reasons"][0]["reason"], "worker_full");
    assert_eq!(e.degraded(1).await, [(0, "worker_full".to_owned())]);
    assert_eq!(
        e.hub.routing().cached_blocks(WorkerKey::new(1, 0)),
        0,
        "not refreshed yet"
    );
    e.hub.refresh_cached_blocks().unwrap();
    assert_eq!(
        e.hub.routing().cached_blocks(WorkerKey::new(1, 0)),
        6,
        "nothing was added"
    );
    // Another worker has its own cap.
    let (s, _) = e
        .post("/v1/events", events(2, vec![stored(None, 1, 8)]))
        .await;
    assert_eq!(s, 200);
    let rejected = r#"kvengine_events_rejected_total{reason="worker_full"}"#;
    assert_eq!(e.metric(rejected).await, 1.0);
    let refused = r#"kvengine_stores_refused_total{reason="worker_full"}"#;
    assert_eq!(e.metric(refused).await, 1.0);
    // A refresh marks every rank at its cap (worker 2 holds 8 of 8) and clears the others.
    e.hub.refresh_cached_blocks().unwrap();
    assert_eq!(e.degraded(1).await, []);
    assert_eq!(e.degraded(2).await, [(0, "worker_full".to_owned())]);
    let gauge = r#"kvengine_workers_degraded{reason="worker_full"}"#;
    assert_eq!(e.metric(gauge).await, 1.0);
    // Removals make room.
    let removed = json!({"type": "removed", "block_hashes": [7, 8]});
    let (s, _) = e.post("/v1/events", events(2, vec![removed])).await;
    assert_eq!(s, 200);
    e.hub.refresh_cached_blocks().unwrap();
    assert_eq!(e.degraded(2).await, []);
    let (s, v) = e
        .post("/v1/events", events(2, vec![stored(Some(6), 20, 2)]))
        .await;
    assert_eq!((s, &v["applied"]), (200, &json!(1)), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_memory_budget_the_index_refuses_stores_and_still_applies_removals() {
    // The budget is the empty index's bytes (plus one: 0 means none): any block puts it over.
    let e = edge(None, Limits::default(), |empty| Some(empty + 1)).await;
    e.hub.register(Registration::new(WorkerId(1))).unwrap();
    let prompt: Vec<u32> = (16..16 * 5).collect();
    // Accepted: no reading has seen the index over budget yet.
    let (s, v) = e
        .post("/v1/events", events(1, vec![stored(None, 1, 4)]))
        .await;
    assert_eq!((s, &v["applied"]), (200, &json!(1)), "{v}");
    assert_eq!(
        e.metric("kvengine_index_full").await,
        1.0,
        "the scrape read it"
    );
    assert!(
        e.metric("kvengine_index_heap_bytes").await > e.metric("kvengine_index_budget_bytes").await
    );
    let (_, _, ready) = e.call("GET", "/ready", "").await;
    assert_eq!(ready["engine"]["index_full"], true, "{ready}");
    assert!(ready["engine"]["index_bytes"].as_u64().unwrap() > 0);

    // A store is refused (counted, the rank degraded); the removal in the batch applies.
    let batch = events(
        1,
        vec![
            stored(Some(4), 5, 2),
            json!({"type": "removed", "block_hashes": [4]}),
        ],
    );
    let (s, v) = e.post("/v1/events", batch).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (&v["applied"], &v["rejected"]),
        (&json!(1), &json!(1)),
        "{v}"
    );
    assert_eq!(v["rejected_reasons"][0]["reason"], "index_full");
    assert_eq!(e.degraded(1).await, [(0, "index_full".to_owned())]);
    let (_, v) = e.post("/v1/overlap", json!({"token_ids": prompt})).await;
    assert_eq!(v["scores"][0]["overlap_blocks"], 3, "{v}");
    // The other transports' path (ZMQ, QUIC) refuses the same way.
    let key = WorkerKey::new(1, 0);
    let zmq_like = vec![
        common::stored(&(500..532).collect::<Vec<u32>>(), 16, 900),
        KvEvent::Removed {
            blocks: vec![EngineHash(3)],
        },
    ];
    e.hub.ingest(key, zmq_like).unwrap();
    e.hub.sync().unwrap();
    let (_, v) = e.post("/v1/overlap", json!({"token_ids": prompt})).await;
    assert_eq!(v["scores"][0]["overlap_blocks"], 2, "{v}");
    let (_, v) = e
        .post(
            "/v1/overlap",
            json!({"token_ids": (500..532).collect::<Vec<u32>>()}),
        )
        .await;
    assert_eq!(v["scores"], json!([]), "the refused store is not indexed");
    for series in [
        r#"kvengine_stores_refused_total{reason="index_full"}"#,
        r#"kvengine_events_rejected_total{reason="index_full"}"#,
    ] {
        assert_eq!(e.metric(series).await, 2.0, "{series}");
    }
    assert_eq!(
        e.metric(r#"kvengine_workers_degraded{reason="index_full"}"#)
            .await,
        1.0
    );
    // Emptied, the index is within budget again at the next reading; stores are accepted
    // and the mark goes.
    let (s, _) = e
        .post("/v1/events", events(1, vec![json!({"type": "cleared"})]))
        .await;
    assert_eq!(s, 200);
    assert_eq!(e.metric("kvengine_index_full").await, 0.0);
    let (s, v) = e
        .post("/v1/events", events(1, vec![stored(None, 1, 4)]))
        .await;
    assert_eq!((s, &v["applied"]), (200, &json!(1)), "{v}");
    assert_eq!(e.degraded(1).await, []);
    assert!(e.hub.workers()[0].degraded.is_empty());
    assert_eq!(Degraded::IndexFull.as_str(), "index_full");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_active_requests_routes_are_refused_with_503() {
    let limits = Limits {
        max_active_requests: Some(2),
        ..Limits::default()
    };
    let e = edge(None, limits, |_| None).await;
    e.hub.register(Registration::new(WorkerId(1))).unwrap();
    let route = |id: &str| json!({"token_ids": [1, 2, 3], "request_id": id});
    for id in ["a", "b"] {
        let (s, v) = e.post("/v1/route", route(id)).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, head, v) = e.call("POST", "/v1/route", &route("c").to_string()).await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "overloaded");
    assert_eq!(v["error"]["type"], "service_unavailable");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert_eq!(e.hub.routing().active_requests(), 2, "nothing recorded");
    assert_eq!(e.metric("kvengine_routes_overloaded_total").await, 1.0);
    // Freeing one makes room.
    let (s, _, _) = e.call("DELETE", "/v1/requests/a", "").await;
    assert_eq!(s, 200);
    let (s, v) = e.post("/v1/route", route("c")).await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_with_control_characters_or_over_256_bytes_are_refused() {
    let e = edge(None, Limits::default(), |_| None).await;
    e.hub.register(Registration::new(WorkerId(1))).unwrap();
    let long = "x".repeat(257);
    for bad in [
        "line\nbreak",
        "bell\u{7}",
        "del\u{7f}",
        "c1\u{85}",
        long.as_str(),
    ] {
        let (s, v) = e
            .post("/v1/route", json!({"token_ids": [1], "request_id": bad}))
            .await;
        assert_eq!(s, 400, "{bad:?}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_argument");
    }
    assert_eq!(e.hub.routing().active_requests(), 0);
    for path in [
        "/v1/requests/a%0Ab".to_owned(),
        "/v1/requests/%1B%5B31m".to_owned(),
        format!("/v1/requests/{long}"),
    ] {
        let (s, _, v) = e.call("DELETE", &path, "").await;
        assert_eq!(s, 400, "{path}: {v}");
        let (s, _, v) = e.call("POST", &format!("{path}/prefilled"), "").await;
        assert_eq!(s, 400, "{path}: {v}");
        assert_eq!(v["error"]["code"], "invalid_argument");
    }
    // A well-formed id that is not active is still 404; printable Unicode is fine.
    let (s, _, _) = e.call("DELETE", "/v1/requests/nope", "").await;
    assert_eq!(s, 404);
    let (s, v) = e
        .post(
            "/v1/route",
            json!({"token_ids": [1], "request_id": "r\u{e9}q-1 \u{1f600}"}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_requests_make_room_before_a_route_is_refused() {
    let limits = Limits {
        max_active_requests: Some(1),
        ..Limits::default()
    };
    let e = edge(None, limits, |_| None).await;
    e.hub.register(Registration::new(WorkerId(1))).unwrap();
    let call = |id: &str| engine::router::RouteCall {
        request_id: Some(id.to_owned()),
        tokens: &[1, 2, 3],
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    e.hub.route(None, &call("a"), t0).unwrap();
    let refused = e.hub.route(None, &call("b"), t0).unwrap_err();
    assert!(
        matches!(refused, transport::TransportError::Overloaded { limit: 1 }),
        "{refused}"
    );
    // Past the request timeout (300 s by default), "a" has expired: "b" takes its place.
    let later = t0 + std::time::Duration::from_secs(301);
    e.hub.route(None, &call("b"), later).unwrap();
    assert_eq!(e.hub.routing().active_requests(), 1);
}
