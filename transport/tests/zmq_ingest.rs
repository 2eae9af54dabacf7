//! vLLM-style ZMQ ingest end to end: a real PUB/ROUTER publisher, the subscriber task, the
//! hub and a two-core engine. Gaps, replays, restarts, bad payloads and foreign block sizes.

mod common;

use bytes::Bytes;
use engine::runtime::Runtime;
use engine::{DpRank, WorkerId, WorkerKey};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use transport::DropReason;
use transport::hub::{Hub, Registration};
use transport::kv_events::{ConvertConfig, WireBatch, WireEvent, convert, decode_batch};
use transport::zmq::{SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

const BS: usize = 16;

/// A store of `blocks` blocks for prompt `p`, engine hashes `p * 1000 + i`.
fn store(p: u32, blocks: usize) -> WireEvent {
    WireEvent::Stored {
        block_hashes: (0..blocks as u64)
            .map(|i| u64::from(p) * 1000 + i)
            .collect(),
        parent: None,
        token_ids: (0..(blocks * BS) as u32).map(|t| p * 100_000 + t).collect(),
        block_size: Some(BS as u32),
        lora_id: None,
        lora_name: None,
        medium: Some("GPU".into()),
    }
}

fn prompt(p: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| p * 100_000 + t).collect()
}

fn batch(dp_rank: u32, events: Vec<WireEvent>) -> WireBatch {
    WireBatch {
        ts: Some(0.0),
        dp_rank: Some(dp_rank),
        events,
        unknown_events: 0,
    }
}

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
    let (hub, runtime) = common::hub(2);
    let replay_ep = replay.then_some("tcp://127.0.0.1:0");
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", replay_ep, 64)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_repaired_from_the_replay_socket() {
    let (rig, mut publisher) = setup(4, true).await;
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
