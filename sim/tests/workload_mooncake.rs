//! The Mooncake loader on the shared synthetic trace, when it is present.
//!
//! `../shared/data` is not part of the product: each test returns early where the file is
//! absent (a user's checkout), and runs wherever the fixture exists.

use std::path::PathBuf;

use engine::sched::RouteMode;
use sim::cluster::{self, ClusterConfig};
use sim::worker::WorkerConfig;
use sim::workload::PrefixReuse;
use sim::workload::mooncake::{MOONCAKE_BLOCK_TOKENS, MooncakeTrace};

fn trace() -> Option<MooncakeTrace> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/mooncake/synthetic_trace.jsonl");
    if !path.exists() {
        eprintln!("skipped: {} is absent", path.display());
        return None;
    }
    Some(MooncakeTrace::load(&path).unwrap())
}

#[test]
fn shared_trace_loads_and_keeps_its_prefix_sharing() {
    let Some(t) = trace() else { return };
    assert_eq!(t.len(), 3993);
    for (r, req) in t.records().iter().zip(t.requests()).take(200) {
        assert_eq!(req.tokens.len(), r.input_length as usize);
        assert_eq!(
            r.hash_ids.len(),
            (r.input_length as usize).div_ceil(MOONCAKE_BLOCK_TOKENS)
        );
    }
    // STATS.txt: the token-level prefix hit of an infinite cache is 0.6512 at 512-token
    // granularity; finer blocks can only reuse as much or slightly more of a partial tail.
    let reuse = PrefixReuse::measure(t.requests(), 16);
    assert!(
        (0.645..0.67).contains(&reuse.hit_rate()),
        "{}",
        reuse.hit_rate()
    );
}

#[test]
fn kv_routing_beats_round_robin_on_the_trace() {
    let Some(t) = trace() else { return };
    let config = |mode| ClusterConfig {
        workers: 4,
        worker: WorkerConfig {
            kv_blocks: 16_384,
            block_size: 16,
        },
        concurrency: 8,
        mode,
        ..ClusterConfig::default()
    };
    let kv = cluster::run(config(RouteMode::Kv), t.requests().take(400)).unwrap();
    let rr = cluster::run(config(RouteMode::RoundRobin), t.requests().take(400)).unwrap();
    assert!(!kv.has_rejects() && !rr.has_rejects());
    assert_eq!(kv.prediction_agreement, 1.0);
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv {} rr {}",
        kv.hit_rate,
        rr.hit_rate
    );
}
