//! The Rust cost of the two calls the Python package's speed goals name, driven exactly as
//! `python/src` drives them (one core thread of its own, unpinned; the `Hub`), so that
//! `python/bench/bench_python.py` on the same workload shows what Python adds:
//!
//! * `find_matches_8000`: hash an 8,000-token prompt and ask the index which workers hold
//!   how much of it (4 workers hold 500, 400, 300 and 200 of its 500 blocks).
//! * `apply_msgpack`: decode a vLLM msgpack batch (32 stored chains of 32 blocks), convert,
//!   ingest, wait until applied; then the same for the batch removing them.
//!
//! Prints one JSON line per figure: the mean of each of 5 runs, as min / median / max.
//! `cargo bench -p kvengine-transport --bench hub_calls`

use engine::hash::{lora_seed, seq_hashes};
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use engine::{WorkerId, WorkerKey};
use mimalloc::MiMalloc;
use std::hint::black_box;
use std::time::Instant;
use transport::hub::{Hub, HubConfig, Registration, start_engine};
use transport::kv_events::{ConvertConfig, WireBatch, WireEvent, convert, decode_batch};
use transport::zmq::publisher::encode_batch;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

const BS: usize = 16;
const RUNS: usize = 5;
const CHAINS: u64 = 32;
const CHAIN_BLOCKS: u64 = 32;

fn hub() -> (Hub, engine::runtime::Runtime) {
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 1,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let sharding = Sharding::configured(1, None, 8).expect("sharding");
    start_engine(config, sharding, engine).expect("engine")
}

/// Token ids of the benchmark prompt (the Python script builds the same list).
fn prompt() -> Vec<u32> {
    (0..8000u32).map(|i| (i * 7919) % 151_000).collect()
}

fn stored(tokens: &[u32], first_hash: u64) -> WireBatch {
    WireBatch {
        ts: Some(1.0),
        dp_rank: Some(0),
        events: vec![WireEvent::Stored {
            block_hashes: (0..(tokens.len() / BS) as u64)
                .map(|i| first_hash + i)
                .collect(),
            parent: None,
            token_ids: tokens.to_vec(),
            block_size: Some(BS as u32),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: None,
        }],
        unknown_events: 0,
    }
}

fn apply(hub: &Hub, worker: u64, bytes: &[u8]) -> usize {
    let converted = convert(
        decode_batch(bytes).expect("decodes"),
        &ConvertConfig {
            block_size: BS as u32,
        },
    );
    let key = WorkerKey {
        worker: WorkerId(worker),
        dp_rank: converted.dp_rank,
    };
    let blocks = converted.events.iter().map(|e| e.blocks()).sum();
    hub.ingest(key, converted.events).expect("ingest");
    hub.sync().expect("sync");
    blocks
}

fn report(name: &str, unit: &str, mut runs: Vec<f64>) {
    runs.sort_by(f64::total_cmp);
    println!(
        "{{\"figure\": \"{name}\", \"unit\": \"{unit}\", \"min\": {:.3}, \"median\": {:.3}, \"max\": {:.3}, \"runs\": {runs:?}}}",
        runs[0],
        runs[runs.len() / 2],
        runs[runs.len() - 1]
    );
}

fn find_matches(hub: &Hub) {
    let p = prompt();
    for (w, blocks) in [(1u64, 500usize), (2, 400), (3, 300), (4, 200)] {
        hub.register(Registration::new(WorkerId(w)))
            .expect("register");
        apply(hub, w, &encode_batch(&stored(&p[..blocks * BS], w << 32)));
    }
    let seed = lora_seed(None);
    let iters = 20_000;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        for _ in 0..iters {
            let seqs = seq_hashes(black_box(&p), BS, seed);
            let m = hub.find_matches_for(&seqs).expect("query");
            assert_eq!(m.overlaps.len(), 4);
            black_box(m);
        }
        runs.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(iters));
    }
    report("find_matches_8000_tokens", "us/call", runs);
}

/// `CHAINS` chains of `CHAIN_BLOCKS` blocks, hashes from `base`, and the batch removing them.
fn batches(base: u64) -> (Vec<u8>, Vec<u8>) {
    let mut store = WireBatch {
        ts: Some(1.0),
        dp_rank: Some(0),
        ..WireBatch::default()
    };
    let mut remove = store.clone();
    for c in 0..CHAINS {
        let first = base + c * CHAIN_BLOCKS;
        let hashes: Vec<u64> = (first..first + CHAIN_BLOCKS).collect();
        let tokens: Vec<u32> = (0..CHAIN_BLOCKS as u32 * BS as u32)
            .map(|t| (first as u32).wrapping_mul(31).wrapping_add(t))
            .collect();
        store.events.push(WireEvent::Stored {
            block_hashes: hashes.clone(),
            parent: None,
            token_ids: tokens,
            block_size: Some(BS as u32),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: None,
        });
        remove.events.push(WireEvent::Removed {
            block_hashes: hashes,
            medium: Some("GPU".into()),
        });
    }
    (encode_batch(&store), encode_batch(&remove))
}

fn apply_msgpack(hub: &Hub) {
    hub.register(Registration::new(WorkerId(9)))
        .expect("register");
    let pairs: Vec<_> = (0..64u64)
        .map(|i| batches(i * CHAINS * CHAIN_BLOCKS))
        .collect();
    let (mut stores, mut removes) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let (mut st, mut rm, mut blocks) = (0.0, 0.0, 0usize);
        for _ in 0..8 {
            for (s, r) in &pairs {
                let t = Instant::now();
                blocks += apply(hub, 9, s);
                st += t.elapsed().as_secs_f64();
                let t = Instant::now();
                apply(hub, 9, r);
                rm += t.elapsed().as_secs_f64();
            }
        }
        stores.push(blocks as f64 / st / 1e6);
        removes.push(blocks as f64 / rm / 1e6);
    }
    report("apply_msgpack_stored", "M blocks/s", stores);
    report("apply_msgpack_removed", "M blocks/s", removes);
}

fn main() {
    // `cargo bench --no-run` builds this; `cargo test --benches` would run it with --bench
    // absent: measure only when asked to benchmark.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let (hub, runtime) = hub();
    find_matches(&hub);
    apply_msgpack(&hub);
    drop(hub);
    let _ = runtime.join();
}
