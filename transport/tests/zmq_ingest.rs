//! vLLM-style ZMQ ingest end to end: a real PUB/ROUTER publisher, the subscriber task, the
//! hub and a two-core engine. Gaps, replays (vLLM's and SGLang's reply shapes, and a
//! conversation recorded from vLLM 0.32), restarts, reconnections and their continuity
//! check, resumes from a snapshot, bad payloads and foreign block sizes.

mod common;

use bytes::Bytes;
use engine::runtime::Runtime;
use engine::{DpRank, WorkerId, WorkerKey};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use transport::DropReason;
use transport::hub::StreamState;
use transport::hub::{Hub, Registration};
use transport::kv_events::{ConvertConfig, WireEvent, convert, decode_batch};
use transport::zmq::{ReplayShape, SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

const BS: usize = common::WIRE_BS;

use common::wire_store as store;

fn prompt(p: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| p * 100_000 + t).collect()
}

use common::wire_batch as batch;

fn overlap(hub: &Hub, p: u32, blocks: usize) -> Vec<(WorkerKey, u32)> {
    hub.sync().unwrap();
    hub.overlap(None, &prompt(p, blocks), None)
        .unwrap()
        .2
        .overlaps
}

fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(r),
    }
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Publishes harmless clears until the subscriber has seen one (PUB/SUB drops messages sent
/// before the subscription is up).
async fn connect(hub: &Hub, publisher: &mut VllmPublisher) {
    let start = Instant::now();
    while hub.metrics().events_forwarded.load(Relaxed) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "subscriber never connected"
        );
        publisher
            .publish(&batch(0, vec![WireEvent::Cleared]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Rig {
    hub: Arc<Hub>,
    runtime: Runtime,
    task: tokio::task::JoinHandle<()>,
}

impl Rig {
    /// Stops the subscription and the engine (the task holds the hub).
    async fn stop(self, publisher: VllmPublisher) {
        self.task.abort();
        let _ = self.task.await;
        drop(publisher);
        drop(self.hub);
        self.runtime.join().unwrap();
    }
}

async fn setup(worker: u64, replay: bool) -> (Rig, VllmPublisher) {
    setup_shaped(worker, replay, ReplayShape::Vllm).await
}

async fn setup_shaped(worker: u64, replay: bool, shape: ReplayShape) -> (Rig, VllmPublisher) {
    let (hub, runtime) = common::hub(2);
    let replay_ep = replay.then_some("tcp://127.0.0.1:0");
    let mut publisher = VllmPublisher::bind_shaped("tcp://127.0.0.1:0", replay_ep, 64, shape)
        .await
        .unwrap();
    let source = ZmqSource::new(
        WorkerId(worker),
        publisher.endpoint(),
        publisher.replay_endpoint(),
    )
    .unwrap();
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(worker))
    })
    .unwrap();
    let task = spawn_subscriber(
        hub.clone(),
        source,
        SubscriberConfig {
            replay_timeout: Duration::from_secs(2),
            ..SubscriberConfig::default()
        },
    );
    connect(&hub, &mut publisher).await;
    (Rig { hub, runtime, task }, publisher)
}

async fn forwarded_at_least(hub: &Hub, n: u64) {
    wait_for("events forwarded", || {
        hub.metrics().events_forwarded.load(Relaxed) >= n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_apply_in_order_for_each_rank() {
    let (rig, mut publisher) = setup(3, true).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    publisher
        .publish(&batch(0, vec![store(1, 4)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(1, vec![store(1, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(
            0,
            vec![WireEvent::Removed {
                block_hashes: vec![1003],
                medium: Some("GPU".into()),
            }],
        ))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 3).await;
    assert_eq!(overlap(&hub, 1, 4), vec![(key(3, 0), 3), (key(3, 1), 2)]);
    assert_eq!(hub.metrics().resyncs.load(Relaxed), 0);
    drop(hub);
    rig.stop(publisher).await;
}

/// Both replay reply shapes: vLLM's `["", topic, seq, batch]` and SGLang's `["", seq, batch]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_repaired_from_the_replay_socket() {
    gap_repaired(ReplayShape::Vllm).await;
    gap_repaired(ReplayShape::Sglang).await;
}

async fn gap_repaired(shape: ReplayShape) {
    let (rig, mut publisher) = setup_shaped(4, true, shape).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    // Lost on the live stream, kept for replay.
    publisher.withhold(&batch(0, vec![store(2, 3)]));
    publisher.withhold(&batch(0, vec![store(3, 1)]));
    publisher
        .publish(&batch(0, vec![store(4, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(5, 2)]))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 5).await;
    assert_eq!(overlap(&hub, 1, 2), vec![(key(4, 0), 2)]);
    assert_eq!(overlap(&hub, 2, 3), vec![(key(4, 0), 3)]);
    assert_eq!(overlap(&hub, 3, 1), vec![(key(4, 0), 1)]);
    assert_eq!(overlap(&hub, 4, 2), vec![(key(4, 0), 2)]);
    assert_eq!(overlap(&hub, 5, 2), vec![(key(4, 0), 2)]);
    let m = hub.metrics();
    assert!(m.replayed_batches.load(Relaxed) >= 2);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    // Exactly five stores plus the connection probes: nothing was applied twice.
    assert_eq!(m.blocks_stored.load(Relaxed), 2 + 3 + 1 + 2 + 2);
    drop(hub);
    rig.stop(publisher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_replay_clears_the_worker_and_marks_it_resyncing() {
    let (rig, mut publisher) = setup(5, false).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 1).await;
    assert_eq!(overlap(&hub, 1, 2), vec![(key(5, 0), 2)]);
    publisher.withhold(&batch(0, vec![store(2, 2)]));
    // Rank 1's batch arrives after the gap: rank 0 (seen before) is cleared.
    publisher
        .publish(&batch(1, vec![store(3, 2)]))
        .await
        .unwrap();
    wait_for("resync", || hub.metrics().resyncs.load(Relaxed) == 1).await;
    forwarded_at_least(&hub, base + 2).await;
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    assert_eq!(overlap(&hub, 3, 2), vec![(key(5, 1), 2)]);
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(0)]);
    // The next batch for rank 0 ends its resync.
    publisher
        .publish(&batch(0, vec![store(4, 1)]))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 3).await;
    assert!(hub.workers()[0].resyncing.is_empty());
    drop(hub);
    rig.stop(publisher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_clears_the_worker_first() {
    let (rig, mut publisher) = setup(6, true).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(2, 2)]))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 2).await;
    publisher.set_next_seq(0);
    publisher
        .publish(&batch(0, vec![store(3, 2)]))
        .await
        .unwrap();
    wait_for("restart", || hub.metrics().restarts.load(Relaxed) == 1).await;
    forwarded_at_least(&hub, base + 3).await;
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    assert_eq!(overlap(&hub, 2, 2), vec![]);
    assert_eq!(overlap(&hub, 3, 2), vec![(key(6, 0), 2)]);
    drop(hub);
    rig.stop(publisher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_payloads_are_counted_consume_their_seq_and_resync_the_worker() {
    let (rig, mut publisher) = setup(7, false).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    publisher
        .publish_payload(Bytes::from_static(b"\x93\xcb\x41"))
        .await
        .unwrap();
    publisher
        .publish_payload(Bytes::from_static(b"not msgpack at all"))
        .await
        .unwrap();
    let mut foreign = store(9, 1);
    if let WireEvent::Stored { block_size, .. } = &mut foreign {
        *block_size = Some(32);
    }
    publisher.publish(&batch(0, vec![foreign])).await.unwrap();
    let mut offloaded = store(8, 1);
    if let WireEvent::Stored { medium, .. } = &mut offloaded {
        *medium = Some("CPU".into());
    }
    publisher.publish(&batch(0, vec![offloaded])).await.unwrap();
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    forwarded_at_least(&hub, base + 1).await;
    assert_eq!(overlap(&hub, 1, 2), vec![(key(7, 0), 2)]);
    let m = hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedMsgpack), 2);
    assert_eq!(m.dropped(DropReason::BlockSizeMismatch), 1);
    assert_eq!(m.dropped(DropReason::NonGpuMedium), 1);
    // Not a gap (the next batch applies in order), but without a replay socket to read
    // them again, each unreadable batch clears the worker: what it changed is unknown.
    assert_eq!(m.resyncs.load(Relaxed), 2);
    assert_eq!(overlap(&hub, 9, 1), vec![]);
    assert_eq!(overlap(&hub, 8, 1), vec![]);
    let error = hub.workers()[0].config_error.clone().unwrap();
    assert!(error.contains("32"), "{error}");
    drop(hub);
    rig.stop(publisher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_and_sglang_payloads_apply_through_the_live_path() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/kv_events");
    if !std::path::Path::new(dir).exists() {
        eprintln!("note: {dir} absent; fixture payloads not replayed");
        return;
    }
    let (rig, mut publisher) = setup(8, true).await;
    let hub = rig.hub.clone();
    let base = hub.metrics().events_forwarded.load(Relaxed);
    // The reference: the same payloads decoded and applied to the single-threaded index.
    let mut reference = engine::kv_index::KvIndex::new();
    let mut prompts = Vec::new();
    let mut expected = 0;
    for f in [
        "vllm_v0_9_array.msgpack",
        "vllm_array_full.msgpack",
        "vllm_map_current.msgpack",
        "vllm_map_bytes_hashes.msgpack",
        "sglang_array.msgpack",
    ] {
        let bytes = std::fs::read(format!("{dir}/{f}")).unwrap();
        let decoded = decode_batch(&bytes).unwrap();
        for e in &decoded.events {
            if let WireEvent::Stored { token_ids, .. } = e {
                prompts.push(token_ids.clone());
            }
        }
        let converted = convert(decoded, &ConvertConfig { block_size: 16 });
        assert!(converted.drops.is_empty(), "{f}: {:?}", converted.drops);
        for e in &converted.events {
            let _ = reference.apply(key(8, converted.dp_rank.0), e);
        }
        expected += converted.events.len() as u64;
        publisher.publish_payload(Bytes::from(bytes)).await.unwrap();
    }
    forwarded_at_least(&hub, base + expected).await;
    let m = hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedMsgpack), 0);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    hub.sync().unwrap();
    for p in &prompts {
        let seqs = hub.hash_prompt(p, None);
        assert_eq!(
            hub.overlap(None, p, None).unwrap().2,
            reference.find_matches(&seqs),
            "prompt {p:?}"
        );
    }
    drop(hub);
    rig.stop(publisher).await;
}

/// vLLM's `topic`: a subscriber takes only its topic's messages (the publisher sends under
/// `kv-events`), and every message with the empty topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_subscribed_topic_is_taken() {
    let (hub, runtime) = common::hub(2);
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", None, 64)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for (worker, topic) in [(1, "kv-events"), (2, "other-model"), (3, "kv")] {
        let source = ZmqSource::new(WorkerId(worker), publisher.endpoint(), None)
            .unwrap()
            .with_topic(topic);
        hub.register(Registration::new(WorkerId(worker))).unwrap();
        tasks.push(spawn_subscriber(
            hub.clone(),
            source,
            SubscriberConfig::default(),
        ));
    }
    // Until workers 1 (its exact topic) and 3 (a prefix of it) have the blocks; then a few
    // more batches, which worker 2 would have had too were it not filtered out.
    let start = Instant::now();
    while overlap(&hub, 5, 2).len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "subscribers never got the store"
        );
        publisher
            .publish(&batch(0, vec![store(5, 2)]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..5 {
        publisher
            .publish(&batch(0, vec![store(5, 2)]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(overlap(&hub, 5, 2), vec![(key(1, 0), 2), (key(3, 0), 2)]);
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    drop(publisher);
    drop(hub);
    runtime.join().unwrap();
}

/// `/ready` waits for a worker's event stream: while its publisher is not up the router
/// cannot see its cache, so it is not ready; once subscribed it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_waits_for_the_event_stream() {
    let (hub, runtime) = common::hub(2);
    // A port with nothing listening on it yet.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = format!("tcp://127.0.0.1:{port}");
    hub.register(Registration {
        zmq: Some(endpoint.clone()),
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    let task = spawn_subscriber(
        hub.clone(),
        ZmqSource::new(WorkerId(1), &endpoint, None).unwrap(),
        SubscriberConfig::default(),
    );
    let (base, stop) = common::http_server(hub.clone(), Default::default()).await;
    let ready = || common::raw_request(&base, "GET", "/ready", "", "");
    let start = Instant::now();
    loop {
        let (status, _, body) = ready().await;
        assert_ne!(status, 200, "ready without the event stream: {body}");
        if body.contains("no healthy worker has its KV event stream subscribed") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, _, workers) = common::raw_request(&base, "GET", "/v1/workers", "", "").await;
    assert!(workers.contains(r#""stream":"connecting""#), "{workers}");

    let publisher = VllmPublisher::bind(&endpoint, None, 64).await.unwrap();
    let start = Instant::now();
    loop {
        let (status, _, body) = ready().await;
        if status == 200 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, _, workers) = common::raw_request(&base, "GET", "/v1/workers", "", "").await;
    assert!(workers.contains(r#""stream":"subscribed""#), "{workers}");
    task.abort();
    let _ = task.await;
    drop(stop);
    drop(publisher);
    drop(hub);
    let _ = runtime;
}

/// Publishes a store of prompt 1, a damaged store of prompt 2, and a store of prompt 3;
/// returns once prompt 3 is indexed (the damaged batch was handled before it).
async fn publish_around_a_damaged_batch(hub: &Hub, publisher: &mut VllmPublisher) {
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    wait_for("the first store", || !overlap(hub, 1, 2).is_empty()).await;
    publisher
        .publish_damaged(&batch(0, vec![store(2, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(3, 1)]))
        .await
        .unwrap();
    wait_for("the batch after the damaged one", || {
        !overlap(hub, 3, 1).is_empty()
    })
    .await;
}

/// A live batch that does not decode is read again from the publisher's replay buffer (the
/// live copy may be what was damaged); without a readable copy the worker's ranks are
/// cleared and resynced, since what the batch changed is unknown. Never a silent skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_batch_is_replayed_or_resynced() {
    let (rig, mut publisher) = setup(11, true).await;
    let hub = rig.hub.clone();
    publish_around_a_damaged_batch(&hub, &mut publisher).await;
    assert_eq!(overlap(&hub, 2, 2), vec![(key(11, 0), 2)], "recovered");
    assert_eq!(overlap(&hub, 1, 2), vec![(key(11, 0), 2)], "kept");
    let m = hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedMsgpack), 1);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    assert!(m.replayed_batches.load(Relaxed) >= 1);
    drop(hub);
    rig.stop(publisher).await;

    // No replay socket: the blocks the worker had may be stale now.
    let (rig, mut publisher) = setup(12, false).await;
    let hub = rig.hub.clone();
    publish_around_a_damaged_batch(&hub, &mut publisher).await;
    assert_eq!(overlap(&hub, 1, 2), vec![], "cleared: possibly stale");
    assert_eq!(overlap(&hub, 2, 2), vec![]);
    assert_eq!(hub.metrics().resyncs.load(Relaxed), 1);
    drop(hub);
    rig.stop(publisher).await;
}

/// POSTs `body` to the HTTP edge at `base` + `path`; the status and the JSON answer.
async fn post_json(base: &str, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = hyper::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// `/v1/overlap` over HTTP for `tokens` with `cache_salt` (left out when `None`): the
/// `(worker_id, overlap_blocks)` of every worker with a positive overlap.
async fn http_overlap(base: &str, tokens: &[u32], cache_salt: Option<&str>) -> Vec<(u64, u64)> {
    let mut body = serde_json::json!({ "token_ids": tokens });
    if let Some(s) = cache_salt {
        body["cache_salt"] = s.into();
    }
    let (status, v) = post_json(base, "/v1/overlap", body).await;
    assert_eq!(status, 200, "{v}");
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

/// vLLM's `cache_salt` end to end: a store whose `extra_keys` carry a salt on block 0
/// (published over ZMQ as vLLM 0.32 does) is matched over HTTP, by `/v1/overlap` and
/// `/v1/route`, only by requests with the same salt; the unsalted store of the same tokens
/// only by unsalted ones (an empty salt is no salt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_blocks_match_only_requests_with_the_same_salt() {
    use transport::kv_events::{WireExtraItem, WireExtraKeys};
    let (rig, mut publisher) = setup(9, false).await;
    let hub = rig.hub.clone();
    let (url, stop) =
        common::http_server(hub.clone(), transport::http::HttpConfig::default()).await;
    let base = hub.metrics().events_forwarded.load(Relaxed);
    let mut salted = store(7, 3);
    if let WireEvent::Stored { extra_keys, .. } = &mut salted {
        *extra_keys = Some(WireExtraKeys::Blocks(vec![
            Some(vec![WireExtraItem::Str("tenant-a".into())]),
            None,
            None,
        ]));
    }
    publisher.publish(&batch(0, vec![salted])).await.unwrap();
    forwarded_at_least(&hub, base + 1).await;
    hub.sync().unwrap();
    let p = prompt(7, 3);
    assert_eq!(http_overlap(&url, &p, None).await, vec![]);
    assert_eq!(http_overlap(&url, &p, Some("")).await, vec![]);
    assert_eq!(http_overlap(&url, &p, Some("tenant-b")).await, vec![]);
    assert_eq!(http_overlap(&url, &p, Some("tenant-a")).await, vec![(9, 3)]);
    assert_eq!(
        http_overlap(&url, &p[..2 * BS], Some("tenant-a")).await,
        vec![(9, 2)]
    );

    // The same tokens stored without a salt (other engine hashes): a second chain.
    let mut plain = store(7, 3);
    if let WireEvent::Stored { block_hashes, .. } = &mut plain {
        for h in block_hashes.iter_mut() {
            *h += 100;
        }
    }
    publisher.publish(&batch(0, vec![plain])).await.unwrap();
    forwarded_at_least(&hub, base + 2).await;
    hub.sync().unwrap();
    assert_eq!(http_overlap(&url, &p, None).await, vec![(9, 3)]);
    assert_eq!(http_overlap(&url, &p, Some("")).await, vec![(9, 3)]);
    assert_eq!(http_overlap(&url, &p, Some("tenant-b")).await, vec![]);
    assert_eq!(http_overlap(&url, &p, Some("tenant-a")).await, vec![(9, 3)]);

    // `/v1/route` keys the request the same way.
    for (salt, want) in [("tenant-a", 3), ("tenant-b", 0)] {
        let (status, v) = post_json(
            &url,
            "/v1/route",
            serde_json::json!({ "token_ids": p, "cache_salt": salt }),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["overlap_blocks"], want, "{salt}: {v}");
    }
    let m = hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedMsgpack), 0);
    drop(stop);
    drop(hub);
    rig.stop(publisher).await;
}

fn unhex(s: &str) -> Bytes {
    let bytes: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect();
    Bytes::from(bytes)
}

fn frames_of(v: &serde_json::Value) -> Vec<Bytes> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|f| unhex(f.as_str().unwrap()))
        .collect()
}

/// vLLM 0.32's own publisher, recorded (tests/data/vllm-0.32.0): its live frames and its
/// replay conversation, served from real ZMQ sockets. A subscription that joins at the
/// last batch catches up through vLLM's 4-frame replay replies and its end marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_subscription_catches_up_through_vllms_recorded_replay() {
    use transport::zmq::zmtp::server::Handler;
    use transport::zmq::zmtp::{PubSocket, Refusals, RouterSocket};
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("data/vllm-0.32.0/kv_events_replay.json")).unwrap();
    let live: Vec<Vec<Bytes>> = fixture["live"]
        .as_array()
        .unwrap()
        .iter()
        .map(frames_of)
        .collect();
    let replays: Vec<(Vec<Bytes>, Vec<Vec<Bytes>>)> = fixture["replays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let replies = r["replies"].as_array().unwrap().iter().map(frames_of);
            (frames_of(&r["request"]), replies.collect())
        })
        .collect();
    // vLLM's replies: ["", topic, seq, batch] and ["", "", END, ""].
    assert!(replays.iter().flat_map(|r| &r.1).all(|f| f.len() == 4));

    let (hub, runtime) = common::hub(2);
    let refusals = Arc::new(Refusals::default());
    let live_socket = PubSocket::bind("tcp://127.0.0.1:0", refusals.clone())
        .await
        .unwrap();
    let publish_ep = live_socket.endpoint().to_owned();
    let unknown_requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let unknown = unknown_requests.clone();
    // Each request is answered on its own connection (a ROUTER's identity frame is not on
    // the wire), with the replies vLLM gave it.
    let handler: Handler = Arc::new(move |body: Vec<Bytes>| {
        match replays.iter().find(|(req, _)| req[..] == body[..]) {
            Some((_, replies)) => replies.clone(),
            None => {
                unknown.fetch_add(1, Relaxed);
                Vec::new()
            }
        }
    });
    let router = RouterSocket::bind("tcp://127.0.0.1:0", handler, refusals.clone())
        .await
        .unwrap();
    let replay_ep = router.endpoint().to_owned();
    let source = ZmqSource::new(WorkerId(21), &publish_ep, Some(&replay_ep))
        .unwrap()
        .with_topic(fixture["topic"].as_str().unwrap());
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(21))
    })
    .unwrap();
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    // The last batch live, resent until seen (PUB drops what goes out before the
    // subscription is up; a resent copy is a retry).
    let last = live.last().unwrap().clone();
    let start = Instant::now();
    while hub.metrics().replayed_batches.load(Relaxed) < 4 {
        assert!(start.elapsed() < Duration::from_secs(20), "no catch-up");
        live_socket.send(last.clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Batches 0..=3: stores of prompts 1 and 2 (2 blocks each), 2001 removed, prompt 3.
    wait_for("the recorded batches", || {
        overlap(&hub, 3, 1) == vec![(key(21, 0), 1)]
    })
    .await;
    assert_eq!(overlap(&hub, 1, 2), vec![(key(21, 0), 2)]);
    assert_eq!(overlap(&hub, 2, 2), vec![(key(21, 0), 1)]);
    let m = hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedMsgpack), 0);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    assert_eq!(
        m.blocks_stored.load(Relaxed),
        2 + 2 + 1,
        "nothing applied twice"
    );
    assert_eq!(unknown_requests.load(Relaxed), 0, "asked from seq 0");
    assert_eq!(refusals.count(), 0);
    task.abort();
    let _ = task.await;
    drop(router);
    drop(hub);
    let _ = runtime;
}

/// A TCP relay between the subscriber and a publisher's socket: its connections can be
/// cut, new ones refused, and its target changed (a restarted worker on the same address).
struct Relay {
    addr: String,
    target: Arc<std::sync::Mutex<std::net::SocketAddr>>,
    open: Arc<std::sync::atomic::AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn to(endpoint: &str) -> Self {
        let target: std::net::SocketAddr = endpoint.trim_start_matches("tcp://").parse().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let target = Arc::new(std::sync::Mutex::new(target));
        let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let (t, o) = (target.clone(), open.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !o.load(Relaxed) {
                    continue; // dropped: refused
                }
                let to = *t.lock().unwrap();
                let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await else {
                    continue;
                };
                let mut cuts = cuts.clone();
                cuts.borrow_and_update();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            target,
            open,
            cut,
            task,
        }
    }

    /// Cuts every connection and refuses new ones until [`Relay::reopen`].
    fn cut_off(&self) {
        self.open.store(false, Relaxed);
        self.cut.send_modify(|n| *n += 1);
    }

    fn reopen(&self, endpoint: &str) {
        *self.target.lock().unwrap() = endpoint.trim_start_matches("tcp://").parse().unwrap();
        self.open.store(true, Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|n| *n += 1);
    }
}

/// A subscription to `publisher` through relays for both of its sockets.
async fn setup_relayed(worker: u64, publisher: &mut VllmPublisher) -> (Rig, Relay, Relay) {
    let (hub, runtime) = common::hub(2);
    let live = Relay::to(publisher.endpoint()).await;
    let replay = Relay::to(publisher.replay_endpoint().unwrap()).await;
    let source = ZmqSource::new(WorkerId(worker), &live.addr, Some(&replay.addr)).unwrap();
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(worker))
    })
    .unwrap();
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    connect(&hub, publisher).await;
    (Rig { hub, runtime, task }, live, replay)
}

/// Publishes stores of prompt `p` until the router has it (right after a reconnection the
/// subscription may not have reached the publisher yet, and PUB drops what it sends before).
async fn publish_until_seen(hub: &Hub, publisher: &mut VllmPublisher, p: u32, blocks: usize) {
    let start = Instant::now();
    while overlap(hub, p, blocks).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "prompt {p} never applied"
        );
        publisher
            .publish(&batch(0, vec![store(p, blocks)]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stream_of(hub: &Hub) -> Option<StreamState> {
    hub.workers()[0].stream
}

/// The connection drops; the publisher (the same process) goes on meanwhile. While cut off
/// the worker shows `connecting` and resyncing and is routed as uncached (its blocks may be
/// stale); once back, the replay's first batch is the last one applied, so the missed
/// batches are caught up and the old blocks trusted again: nothing lost, nothing cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_process_reconnection_loses_and_clears_nothing() {
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap();
    let (rig, live, _replay) = setup_relayed(31, &mut publisher).await;
    let hub = rig.hub.clone();
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    wait_for("prompt 1", || !overlap(&hub, 1, 2).is_empty()).await;
    assert_eq!(stream_of(&hub), Some(StreamState::Subscribed));

    live.cut_off();
    wait_for("connecting", || {
        stream_of(&hub) == Some(StreamState::Connecting)
    })
    .await;
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "not routed on while unverified"
    );
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(0)]);
    // Published while the router is cut off: lost on the live stream, kept for replay.
    publisher
        .publish(&batch(0, vec![store(2, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(3, 1)]))
        .await
        .unwrap();
    live.reopen(publisher.endpoint());
    wait_for("caught up", || !overlap(&hub, 3, 1).is_empty()).await;
    assert_eq!(stream_of(&hub), Some(StreamState::Subscribed));
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![(key(31, 0), 2)],
        "kept and trusted"
    );
    assert_eq!(overlap(&hub, 2, 2), vec![(key(31, 0), 2)]);
    assert!(hub.workers()[0].resyncing.is_empty());
    let m = hub.metrics();
    assert_eq!(m.restarts.load(Relaxed), 0);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    assert!(m.replayed_batches.load(Relaxed) >= 2);
    // The stream goes on live.
    publish_until_seen(&hub, &mut publisher, 4, 1).await;
    drop(hub);
    rig.stop(publisher).await;
}

/// A publisher with a replay socket, on free ports.
async fn publisher_with_replay() -> VllmPublisher {
    VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap()
}

/// Kills `publisher` (SIGKILL) behind its relays, cut off, and waits until the router's
/// stream shows it connecting.
async fn kill_behind_relays(hub: &Hub, publisher: VllmPublisher, live: &Relay, replay: &Relay) {
    live.cut_off();
    replay.cut_off();
    drop(publisher);
    wait_for("connecting", || {
        stream_of(hub) == Some(StreamState::Connecting)
    })
    .await;
}

/// A worker killed and restarted while the router is cut off: the new process numbers from
/// 0 again. On reconnection its replay does not hold the last batch applied, so the old
/// blocks are cleared (a restart) before anything of the new process is trusted, and the
/// new process's whole history (from 0) is replayed: the index is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_while_disconnected_is_cleared_before_its_new_blocks() {
    let mut publisher = publisher_with_replay().await;
    let (rig, live, replay) = setup_relayed(32, &mut publisher).await;
    let hub = rig.hub.clone();
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(2, 2)]))
        .await
        .unwrap();
    wait_for("prompt 2", || !overlap(&hub, 2, 2).is_empty()).await;

    kill_behind_relays(&hub, publisher, &live, &replay).await;
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "not routed on while unverified"
    );
    let mut restarted = publisher_with_replay().await;
    // Its first batches go out before the router is back.
    restarted
        .publish(&batch(0, vec![store(3, 1)]))
        .await
        .unwrap();
    restarted
        .publish(&batch(0, vec![store(4, 2)]))
        .await
        .unwrap();
    replay.reopen(restarted.replay_endpoint().unwrap());
    live.reopen(restarted.endpoint());
    wait_for("the new process's history", || {
        !overlap(&hub, 4, 2).is_empty() && !overlap(&hub, 3, 1).is_empty()
    })
    .await;
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "the old process's blocks are gone"
    );
    assert_eq!(overlap(&hub, 2, 2), vec![]);
    let m = hub.metrics();
    assert_eq!(m.restarts.load(Relaxed), 1);
    assert_eq!(m.resyncs.load(Relaxed), 0, "its history from 0 is exact");
    assert!(hub.workers()[0].resyncing.is_empty());
    publish_until_seen(&hub, &mut restarted, 5, 1).await;
    assert_eq!(m.restarts.load(Relaxed), 1);
    drop(hub);
    rig.stop(restarted).await;
}

/// The same restart, but the new process has published nothing when the router comes back:
/// its replay socket answers the history request with the end marker alone. That is an
/// empty history, replayed in full (no resync, no wait for a second end marker: that wait
/// timed out three times and resynced the worker in the soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_with_nothing_published_yet_replays_an_empty_history() {
    let mut publisher = publisher_with_replay().await;
    let (rig, live, replay) = setup_relayed(33, &mut publisher).await;
    let hub = rig.hub.clone();
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    wait_for("prompt 1", || !overlap(&hub, 1, 2).is_empty()).await;

    kill_behind_relays(&hub, publisher, &live, &replay).await;
    let mut restarted = publisher_with_replay().await;
    replay.reopen(restarted.replay_endpoint().unwrap());
    live.reopen(restarted.endpoint());
    let m = hub.metrics();
    wait_for("the restart", || m.restarts.load(Relaxed) == 1).await;
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "the old process's blocks are gone"
    );
    // Nothing is published until the (empty) history has been replayed and the worker
    // trusted again.
    wait_for("the empty history replayed", || {
        hub.workers()[0].resyncing.is_empty()
    })
    .await;
    publish_until_seen(&hub, &mut restarted, 2, 1).await;
    assert_eq!(m.resyncs.load(Relaxed), 0, "an empty history is exact");
    assert_eq!(m.restarts.load(Relaxed), 1);
    assert!(hub.workers()[0].resyncing.is_empty());
    drop(hub);
    rig.stop(restarted).await;
}

/// A worker without a replay socket: a reconnection cannot be verified, so its blocks are
/// cleared and counted as a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnection_without_replay_clears_the_worker() {
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", None, 64)
        .await
        .unwrap();
    let (hub, runtime) = common::hub(2);
    let live = Relay::to(publisher.endpoint()).await;
    let source = ZmqSource::new(WorkerId(33), &live.addr, None).unwrap();
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        ..Registration::new(WorkerId(33))
    })
    .unwrap();
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    connect(&hub, &mut publisher).await;
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    wait_for("prompt 1", || !overlap(&hub, 1, 2).is_empty()).await;
    live.cut_off();
    wait_for("connecting", || {
        stream_of(&hub) == Some(StreamState::Connecting)
    })
    .await;
    live.reopen(publisher.endpoint());
    wait_for("cleared", || hub.metrics().restarts.load(Relaxed) == 1).await;
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    wait_for("subscribed", || {
        stream_of(&hub) == Some(StreamState::Subscribed)
    })
    .await;
    publish_until_seen(&hub, &mut publisher, 2, 1).await;
    (Rig { hub, runtime, task }).stop(publisher).await;
}

/// The policy string the restart tests take snapshots under.
const POLICY: &str = "test-policy";

/// A snapshot of `hub` as `--state-dir` writes it.
async fn snapshot_of(hub: &Arc<Hub>) -> Vec<u8> {
    let hub = hub.clone();
    tokio::task::spawn_blocking(move || {
        hub.sync().unwrap();
        transport::state::encode_snapshot(&hub, POLICY)
            .unwrap()
            .to_vec()
    })
    .await
    .unwrap()
}

/// A router restarted from `snapshot`, `worker` registered (not subscribed yet) with
/// `publisher`'s endpoints (its replay socket only with `replay`).
fn restarted_router(
    snapshot: &[u8],
    worker: u64,
    publisher: &VllmPublisher,
    replay: bool,
) -> (Arc<Hub>, Runtime, ZmqSource) {
    let loaded = transport::state::Loaded::received(snapshot);
    let checked = loaded.image(2, POLICY).unwrap();
    let plan = checked.plan();
    let (hub, runtime) = common::hub_from(2, Some(checked.image));
    transport::state::begin_restore(&hub, &plan).unwrap();
    let replay_ep = if replay {
        publisher.replay_endpoint()
    } else {
        None
    };
    let source = ZmqSource::new(WorkerId(worker), publisher.endpoint(), replay_ep).unwrap();
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(worker))
    })
    .unwrap();
    (hub, runtime, source)
}

/// A router that served prompts 1 and 2 of `worker` and was then stopped (SIGKILL) right
/// after a snapshot: the snapshot, the publisher (still serving) and the mark's seq.
async fn router_killed_after_a_snapshot(worker: u64) -> (Vec<u8>, VllmPublisher, u64) {
    let (rig, mut publisher) = setup(worker, true).await;
    let hub = rig.hub.clone();
    publisher
        .publish(&batch(0, vec![store(1, 2)]))
        .await
        .unwrap();
    publisher
        .publish(&batch(0, vec![store(2, 2)]))
        .await
        .unwrap();
    wait_for("prompt 2", || !overlap(&hub, 2, 2).is_empty()).await;
    let mark = publisher.next_seq() - 1;
    let snapshot = snapshot_of(&hub).await;
    rig.task.abort();
    let _ = rig.task.await;
    drop(hub);
    drop(rig.hub);
    rig.runtime.join().unwrap();
    (snapshot, publisher, mark)
}

/// `--state-dir` restart while the worker keeps serving: the restored blocks are routed as
/// uncached (shown resyncing) until the replay from the mark starts with the marked batch
/// itself (same digest); then what came after is caught up and the blocks count again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_worker_is_trusted_once_its_mark_is_verified() {
    let (snapshot, mut publisher, _) = router_killed_after_a_snapshot(41).await;
    // Published while the router is down.
    publisher
        .publish(&batch(0, vec![store(3, 1)]))
        .await
        .unwrap();
    let (hub, runtime, source) = restarted_router(&snapshot, 41, &publisher, true);
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "not trusted from the snapshot alone"
    );
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(0)]);
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    wait_for("caught up", || !overlap(&hub, 3, 1).is_empty()).await;
    wait_for("trusted", || hub.workers()[0].resyncing.is_empty()).await;
    assert_eq!(overlap(&hub, 1, 2), vec![(key(41, 0), 2)], "kept");
    assert_eq!(overlap(&hub, 2, 2), vec![(key(41, 0), 2)]);
    let m = hub.metrics();
    assert_eq!(m.restarts.load(Relaxed), 0);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    assert_eq!(
        m.blocks_stored.load(Relaxed),
        1,
        "only the batch after the mark"
    );
    (Rig { hub, runtime, task }).stop(publisher).await;
}

/// The worker restarted too, and its new process reached the mark's number with other
/// batches: the replay's batch at the mark has another digest, so the restored blocks are
/// cleared (a restart); its history does not start at 0 any more, so the worker is
/// resynced (counted), never served from the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_worker_whose_mark_does_not_match_is_cleared_and_resynced() {
    let (snapshot, publisher, mark) = router_killed_after_a_snapshot(42).await;
    drop(publisher);
    let mut restarted = VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap();
    restarted.set_next_seq(mark);
    restarted
        .publish(&batch(0, vec![store(5, 1)]))
        .await
        .unwrap();
    let (hub, runtime, source) = restarted_router(&snapshot, 42, &restarted, true);
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    wait_for("the new process's batch", || {
        !overlap(&hub, 5, 1).is_empty()
    })
    .await;
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "the snapshot's blocks are gone"
    );
    assert_eq!(overlap(&hub, 2, 2), vec![]);
    let m = hub.metrics();
    assert_eq!(m.restarts.load(Relaxed), 1);
    assert_eq!(m.resyncs.load(Relaxed), 1);
    (Rig { hub, runtime, task }).stop(restarted).await;
}

/// Without a replay socket a restored worker cannot be verified: cleared at once, shown
/// resyncing and counted, until its next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_worker_without_replay_is_cleared_and_resynced() {
    let (snapshot, mut publisher, _) = router_killed_after_a_snapshot(43).await;
    let (hub, runtime, source) = restarted_router(&snapshot, 43, &publisher, false);
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    wait_for("resynced", || hub.metrics().resyncs.load(Relaxed) == 1).await;
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(0)]);
    assert_eq!(hub.metrics().restarts.load(Relaxed), 0);
    wait_for("subscribed", || {
        stream_of(&hub) == Some(StreamState::Subscribed)
    })
    .await;
    publish_until_seen(&hub, &mut publisher, 6, 1).await;
    assert!(hub.workers()[0].resyncing.is_empty());
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    (Rig { hub, runtime, task }).stop(publisher).await;
}

/// A ZMQ batch (it carries a digest) does not end a key's distrust: the first batches of a
/// replay are older than what the worker holds now, and only the subscriber trusts the key
/// again, once the whole replay is applied. A numbered batch without a digest (TensorRT-LLM's
/// event ids) still proves its stream continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zmq_batch_keeps_a_distrusted_key_uncached_until_trusted() {
    let (hub, runtime) = common::hub(2);
    hub.register(Registration::new(WorkerId(5))).unwrap();
    let k = key(5, 0);
    let cfg = ConvertConfig {
        block_size: BS as u32,
    };
    let events = |p: u32| convert(batch(0, vec![store(p, 2)]), &cfg).events;
    hub.ingest_marked(k, events(1), 0, Some(11)).unwrap();
    assert_eq!(overlap(&hub, 1, 2), vec![(k, 2)]);
    hub.distrust(k);
    assert_eq!(
        overlap(&hub, 1, 2),
        vec![],
        "distrusted: routed as uncached"
    );
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(0)]);
    hub.ingest_marked(k, events(2), 1, Some(12)).unwrap();
    assert_eq!(
        overlap(&hub, 2, 2),
        vec![],
        "a replayed ZMQ batch keeps it so"
    );
    assert_eq!(overlap(&hub, 1, 2), vec![]);
    hub.trust(k);
    assert_eq!(overlap(&hub, 1, 2), vec![(k, 2)]);
    assert_eq!(overlap(&hub, 2, 2), vec![(k, 2)]);
    hub.distrust(k);
    hub.ingest_marked(k, events(3), 2, None).unwrap();
    assert_eq!(
        overlap(&hub, 3, 2),
        vec![(k, 2)],
        "no digest: the batch proves it"
    );
    assert!(hub.workers()[0].resyncing.is_empty());
    drop(hub);
    drop(runtime);
}
