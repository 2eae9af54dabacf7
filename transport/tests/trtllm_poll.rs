//! The TensorRT-LLM poller end to end against a scripted `/kv_cache_events` server: pages
//! reach the index, `created` sets the capacity, lost and restarted streams are detected,
//! cleared and counted, an unreadable event clears, and a finished request's poke polls at
//! once.

mod common;

use axum::routing::post;
use engine::{DpRank, WorkerId};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transport::DropReason;
use transport::hub::{Hub, Registration};
use transport::trtllm::{TrtllmSource, spawn_poller};

const BS: usize = 16; // the test hub's block size

/// A server whose `/kv_cache_events` hands out the queued pages, one per call (`[]` when
/// none is queued), and counts the calls.
#[derive(Clone, Default)]
struct Script {
    pages: Arc<Mutex<VecDeque<Value>>>,
    calls: Arc<Mutex<u64>>,
}

impl Script {
    fn push(&self, page: Value) {
        self.pages.lock().unwrap().push_back(page);
    }
    fn calls(&self) -> u64 {
        *self.calls.lock().unwrap()
    }
    fn drained(&self) -> bool {
        self.pages.lock().unwrap().is_empty()
    }
}

async fn serve(script: Script) -> (String, tokio::sync::oneshot::Sender<()>) {
    let app = axum::Router::new().route(
        "/kv_cache_events",
        post(move || {
            let script = script.clone();
            async move {
                *script.calls.lock().unwrap() += 1;
                let page = script.pages.lock().unwrap().pop_front();
                axum::Json(page.unwrap_or_else(|| json!([])))
            }
        }),
    );
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    (format!("http://{addr}"), stop)
}

fn tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32)
        .map(|i| seed * 10_000 + i)
        .collect()
}

/// A `stored` event of `toks`' blocks, hashes `first..`, as trtllm-serve writes it.
fn stored(id: u64, parent: Option<u64>, toks: &[u32], first: u64) -> Value {
    let blocks: Vec<Value> = toks
        .chunks(BS)
        .enumerate()
        .map(|(i, c)| {
            json!({"type": "stored_block", "block_hash": first + i as u64,
                   "tokens": c.iter().map(|&t| json!({"type": "unique_token", "token_id": t,
                                                       "token_extra_id": 0}))
                              .collect::<Vec<_>>(),
                   "cache_level": 0, "priority": 35})
        })
        .collect();
    json!({"event_id": id, "window_size": 4096,
           "data": {"type": "stored", "parent_hash": parent, "blocks": blocks}})
}

fn overlap(hub: &Hub, toks: &[u32]) -> u32 {
    let (_, _, m) = hub.overlap(None, toks, None).unwrap();
    m.overlaps
        .iter()
        .find(|(k, _)| k.worker == WorkerId(1))
        .map_or(0, |&(_, n)| n)
}

/// Waits until `cond` holds (the poller runs on its own schedule).
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn setup(
    poll: Duration,
) -> (
    Arc<Hub>,
    engine::runtime::Runtime,
    Script,
    tokio::sync::oneshot::Sender<()>,
) {
    let (hub, rt) = common::hub(1);
    let script = Script::default();
    let (url, stop) = serve(script.clone()).await;
    hub.register(Registration {
        url: Some(url.clone()),
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    let source = TrtllmSource::new(WorkerId(1), &url, poll).unwrap();
    let task = spawn_poller(hub.clone(), source, &Default::default());
    // The task ends with the test's runtime.
    drop(task);
    (hub, rt, script, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_reach_the_index_and_broken_streams_are_counted() {
    let (hub, _rt, script, _stop) = setup(Duration::from_millis(5)).await;
    let a = tokens(1, 3);
    script.push(json!([
        {"event_id": 0, "window_size": 4096,
         "data": {"type": "created", "num_blocks_per_cache_level": [8192, 0]}},
        stored(1, None, &a[..2 * BS], 100),
        stored(2, Some(101), &a[2 * BS..], 102),
    ]));
    until("the chain", || {
        hub.sync().unwrap();
        overlap(&hub, &a) == 3
    })
    .await;
    let capacity = hub.workers()[0].kv_capacity.clone();
    assert_eq!(capacity, vec![(DpRank(0), 8192)]);

    // Events 3..=9 went to another client: the rank is cleared and resynced, then 10
    // applies.
    let b = tokens(2, 1);
    script.push(json!([stored(10, None, &b, 200)]));
    until("the resync", || {
        hub.sync().unwrap();
        hub.metrics().resyncs.load(Relaxed) == 1 && overlap(&hub, &b) == 1
    })
    .await;
    assert_eq!(
        overlap(&hub, &a),
        0,
        "a gap must clear what the lost events may have evicted"
    );

    // The server restarted: its ids start from 0 again.
    let c = tokens(3, 2);
    script.push(json!([
        {"event_id": 0, "window_size": 4096,
         "data": {"type": "created", "num_blocks_per_cache_level": [4096, 0]}},
        stored(1, None, &c, 300),
    ]));
    until("the restart", || {
        hub.sync().unwrap();
        hub.metrics().restarts.load(Relaxed) == 1 && overlap(&hub, &c) == 2
    })
    .await;
    assert_eq!(overlap(&hub, &b), 0);
    assert_eq!(hub.workers()[0].kv_capacity, vec![(DpRank(0), 4096)]);

    // An element that does not decode: its changes are unknown, so the rank is cleared.
    let before = hub.metrics().dropped(DropReason::MalformedJson);
    let d = tokens(4, 1);
    script.push(json!([
        {"event_id": 2, "window_size": 4096, "data": {"type": "stored", "blocks": 7}},
        stored(3, None, &d, 400),
    ]));
    until("the unreadable event", || {
        hub.sync().unwrap();
        hub.metrics().dropped(DropReason::MalformedJson) == before + 1 && overlap(&hub, &d) == 1
    })
    .await;
    assert_eq!(overlap(&hub, &c), 0);

    // Removal, and a smaller attention window's copy of the same blocks changes nothing.
    script.push(json!([
        {"event_id": 4, "window_size": 4096,
         "data": {"type": "removed", "block_hashes": [400]}},
        stored(5, None, &d, 400).as_object().map(|o| {
            let mut o = o.clone();
            o.insert("window_size".into(), json!(512));
            Value::Object(o)
        }).unwrap(),
    ]));
    until("the removal", || script.drained()).await;
    // Newer servers: one pool per layer group, each reporting the same blocks; only the
    // lowest group counts.
    let e = tokens(6, 1);
    script.push(json!([
        {"event_id": 6, "window_size": 4096, "layer_group_id": 0, "hash_algo": "v1",
         "data": {"type": "removed", "block_hashes": [999]}},
        stored(7, None, &e, 600).as_object().map(|o| {
            let mut o = o.clone();
            o.insert("layer_group_id".into(), json!(1));
            Value::Object(o)
        }).unwrap(),
    ]));
    until("the layer groups", || script.drained()).await;
    // Two polls after the page was taken, it has been applied.
    let calls = script.calls();
    until("two more polls", || script.calls() >= calls + 2).await;
    hub.sync().unwrap();
    assert_eq!(
        overlap(&hub, &d),
        0,
        "the 512-token window's store must not count"
    );
    assert_eq!(overlap(&hub, &e), 0, "layer group 1's store must not count");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_polls_before_the_interval() {
    // One poll at start, then an hour's wait unless poked.
    let (hub, _rt, script, _stop) = setup(Duration::from_secs(60)).await;
    until("the first poll", || script.calls() == 1).await;
    let a = tokens(5, 1);
    script.push(json!([stored(0, None, &a, 500)]));
    hub.routing().finish_wakeups().wake(WorkerId(1));
    until("the poked poll", || {
        hub.sync().unwrap();
        overlap(&hub, &a) == 1
    })
    .await;
    assert_eq!(script.calls(), 2);
}
