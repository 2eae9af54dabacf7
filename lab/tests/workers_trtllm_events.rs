//! Simulated TensorRT-LLM workers ([`lab::workers::EventFormat::Trtllm`]): their KV events
//! drained over HTTP (`POST /kv_cache_events`) as `trtllm-serve` answers them: `created`
//! first, then the prompts' `stored` chains, consecutive ids, a destructive drain, a bounded
//! buffer that drops the oldest; and a vLLM worker, which has no such route.

// Not every helper is used here.
#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::{call, ids, post_json};
use lab::workers::trtllm::{WINDOW_SIZE, convert_batch};
use lab::workers::{EventFormat, SimWorkerConfig, SimWorkerHandle, spawn_worker};
use serde_json::json;
use sim::engine::EngineConfig;
use wire::kv_events::{WireBatch, WireEvent};
use wire::trtllm::{PageEntry, TrtData, TrtEvent, TrtToken, WireHash, decode_page};

async fn trtllm_worker(buffer: usize, engine: EngineConfig) -> SimWorkerHandle {
    let cfg = SimWorkerConfig {
        engine,
        speedup: 1000.0,
        events: EventFormat::Trtllm { buffer },
        ..SimWorkerConfig::default()
    };
    spawn_worker(cfg, None).await.unwrap()
}

/// One `POST /kv_cache_events`: the events, decoded as the router decodes them.
async fn poll(w: &SimWorkerHandle) -> Vec<TrtEvent> {
    let (status, content_type, body) = call(w.http_addr(), "POST", "/kv_cache_events", b"").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(content_type, "application/json");
    decode_page(body.as_bytes())
        .unwrap()
        .into_iter()
        .map(|entry| match entry {
            PageEntry::Event { event, .. } => event,
            PageEntry::Unreadable { error, .. } => panic!("unreadable event: {error}: {body}"),
        })
        .collect()
}

/// Sends a completion and waits for its answer.
async fn complete(w: &SimWorkerHandle, prompt: &[u32]) {
    let body = json!({"prompt": prompt, "max_tokens": 1});
    let (status, answer) = post_json(w, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
}

fn ids_of(events: &[TrtEvent]) -> Vec<u64> {
    events.iter().map(|e| e.event_id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn created_first_then_the_prompts_stored_chain_then_nothing() {
    let engine = EngineConfig {
        kv_blocks: 64,
        block_size: 32,
        ..EngineConfig::default()
    };
    let w = trtllm_worker(10_000, engine).await;
    assert!(w.is_trtllm());
    assert_eq!(w.event_format(), EventFormat::Trtllm { buffer: 10_000 });
    assert_eq!(w.kv_events_url(), format!("{}/kv_cache_events", w.url()));

    let first = poll(&w).await;
    assert_eq!(
        first,
        vec![TrtEvent {
            event_id: 0,
            data: TrtData::Created {
                num_blocks_per_cache_level: vec![64, 0],
            },
            window_size: Some(WINDOW_SIZE),
            attention_dp_rank: None,
            layer_group_id: None,
        }]
    );

    // Four full blocks of 32 and a partial one: only the full ones are stored.
    let prompt = ids(5000, 4 * 32 + 5);
    complete(&w, &prompt).await;
    let events = poll(&w).await;
    assert!(!events.is_empty());
    let expected_ids: Vec<u64> = (1..=events.len() as u64).collect();
    assert_eq!(ids_of(&events), expected_ids, "{events:?}");
    let mut parent = None;
    let mut tokens = Vec::new();
    let mut blocks = 0;
    for e in &events {
        assert_eq!(e.window_size, Some(WINDOW_SIZE));
        assert_eq!(e.attention_dp_rank, None);
        let TrtData::Stored {
            parent_hash,
            blocks: stored,
        } = &e.data
        else {
            panic!("not a store: {e:?}");
        };
        assert_eq!(*parent_hash, parent, "the stores chain: {events:?}");
        for b in stored {
            assert_eq!(b.kind.as_deref(), Some("stored_block"));
            assert_eq!(b.tokens.len(), 32);
            assert_eq!((b.cache_level, b.priority, b.lora_id), (0, Some(35), None));
            assert!(b.tokens.iter().all(|t| *t == TrtToken::text(t.token_id)));
            tokens.extend(b.tokens.iter().map(|t| t.token_id));
            parent = Some(b.block_hash);
            blocks += 1;
        }
    }
    assert_eq!(tokens, prompt[..4 * 32]);
    assert_eq!(blocks, 4);
    assert_eq!(w.cached_prefix_blocks(&prompt).await.unwrap(), blocks);

    // The drain emptied the buffer.
    let (status, content_type, body) = call(w.http_addr(), "POST", "/kv_cache_events", b"").await;
    assert_eq!((status, content_type.as_str()), (200, "application/json"));
    assert_eq!(body, "[]");
    assert_eq!(w.dropped_kv_events(), 0);

    // The same prompt again hits the cache: nothing new is stored.
    complete(&w, &prompt).await;
    assert_eq!(poll(&w).await, vec![]);
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_drops_the_oldest_events() {
    // 16 pages of 16 tokens: three-block prompts soon evict each other.
    let engine = EngineConfig {
        kv_blocks: 16,
        block_size: 16,
        dp_rank: 2,
        ..EngineConfig::default()
    };
    let w = trtllm_worker(2, engine).await;
    let first = poll(&w).await;
    assert_eq!(ids_of(&first), vec![0]);
    assert_eq!(first[0].attention_dp_rank, Some(2));
    for i in 0..12 {
        complete(&w, &ids(10_000 + i * 1000, 3 * 16 + 1)).await;
    }
    let events = poll(&w).await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].event_id > 1, "{events:?}");
    assert_eq!(events[1].event_id, events[0].event_id + 1);
    assert!(events.iter().all(|e| e.attention_dp_rank == Some(2)));
    // Everything after `created` was written, the last two kept.
    assert_eq!(w.dropped_kv_events(), events[0].event_id - 1);
    assert!(
        events
            .iter()
            .any(|e| matches!(e.data, TrtData::Stored { .. }))
    );

    // Numbering goes on after the drop.
    complete(&w, &ids(90_000, 2 * 16)).await;
    let next = poll(&w).await;
    assert!(!next.is_empty());
    assert_eq!(next[0].event_id, events[1].event_id + 1, "{next:?}");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_worker_has_no_kv_cache_events_route() {
    let w = spawn_worker(SimWorkerConfig::default(), None)
        .await
        .unwrap();
    assert!(!w.is_trtllm());
    assert!(w.zmq_endpoint().starts_with("tcp://"));
    let (status, _, _) = call(w.http_addr(), "POST", "/kv_cache_events", b"").await;
    assert_eq!(status, 404);
    assert_eq!(w.dropped_kv_events(), 0);
    let reg = w.registration(engine::WorkerId(1));
    assert!(reg.zmq.is_some() && reg.replay.is_some());
    // Its engine still answers lookups.
    let prompt = ids(3000, 40);
    complete(&w, &prompt).await;
    let cached = tokio::time::timeout(Duration::from_secs(10), w.cached_prefix_blocks(&prompt))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cached, 2);
    w.shutdown().await;
}

#[test]
fn an_engine_batch_converts_to_trtllm_events() {
    let batch = WireBatch {
        ts: None,
        dp_rank: Some(0),
        events: vec![
            WireEvent::Stored {
                block_hashes: vec![11, 12],
                parent: Some(10),
                token_ids: vec![1, 2, 3, 4],
                block_size: Some(2),
                lora_id: Some(5),
                lora_name: Some("adapter".into()),
                medium: Some("GPU".into()),
                extra_keys: None,
            },
            WireEvent::Cleared,
            WireEvent::Removed {
                block_hashes: vec![10],
                medium: Some("GPU".into()),
            },
        ],
        unknown_events: 0,
    };
    let data = convert_batch(&batch, 16);
    assert_eq!(data.len(), 2, "Cleared has no TensorRT-LLM event: {data:?}");
    let TrtData::Stored {
        parent_hash,
        blocks,
    } = &data[0]
    else {
        panic!("{data:?}");
    };
    assert_eq!(*parent_hash, Some(WireHash(10)));
    let got: Vec<(u64, Vec<u32>, Option<u64>)> = blocks
        .iter()
        .map(|b| {
            (
                b.block_hash.0,
                b.tokens.iter().map(|t| t.token_id).collect(),
                b.lora_id,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![(11, vec![1, 2], Some(5)), (12, vec![3, 4], Some(5))]
    );
    assert_eq!(
        data[1],
        TrtData::Removed {
            block_hashes: vec![WireHash(10)]
        }
    );
}
