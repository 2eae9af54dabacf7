//! Concurrent ingest with trunk promotions leaves no stale index entries.
//!
//! Two ingest handles post batches (`IngestHandle::send`, several events in flight) for
//! disjoint workers into the threaded runtime on 1, 2 and 3 cores, with the adaptive policy
//! at junction fanout 2, so promotion rounds run all the time and often take several
//! junctions at once. Afterwards the queries must equal a plain model of DESIGN.md (no
//! worker shown holding a block it removed), and once every worker is removed every shard
//! must be back to an empty tree with no inconsistency: no entry that no directory owns.
//!
//! Regression: a round that promoted two junctions of one shard whose paths shared blocks
//! (one below the other, or siblings under a common non-trunk block) exported the shared
//! blocks twice, and every other shard grafted their holders twice; removals, one per
//! shard, left the second copies behind (`sharding::promote` invariant 3).

mod model;

use engine::event::KvEvent;
use engine::runtime::{RuntimeConfig, start};
use engine::sharding::ShardId;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::shard::Shard;
use engine::{WorkerId, WorkerKey};
use model::{Model, Paths, event, key};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Publishers, each with workers of its own (publisher `t` has workers `t`, `t + 2`,
/// `t + 4`).
const PUBLISHERS: u64 = 2;
/// Batches each publisher sends.
const BATCHES: usize = 400;

/// One publisher: random batches for its workers, sent without waiting; returns its model
/// and the chains it stored.
fn publish(mut h: engine::runtime::IngestHandle, seed: u64, t: u64) -> (Model, Paths) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = Model::default();
    let mut paths = Paths::default();
    for _ in 0..BATCHES {
        let k = key(
            t + PUBLISHERS * rng.random_range(0..3),
            rng.random_range(0..2),
        );
        let batch: Arc<[(WorkerKey, KvEvent)]> = (0..rng.random_range(1..4))
            .map(|_| {
                let ev = event(&mut rng, &model, &mut paths, k);
                model.apply(k, &ev);
                (k, ev)
            })
            .collect();
        h.send(&batch).unwrap();
    }
    h.sync().unwrap();
    (model, paths)
}

#[test]
fn concurrent_ingest_with_promotions_leaves_nothing_after_removal() {
    for seed in 0..6u64 {
        for cores in [1, 2, 3] {
            let cfg = RuntimeConfig {
                ingest_handles: PUBLISHERS as usize + 1,
                pin_cores: false,
                ring_capacity: 64,
                ..RuntimeConfig::default()
            };
            let mut started = start(Adaptive::new(cores, 2).unwrap(), cfg).unwrap();
            let mut query = started.query.pop().unwrap();
            let mut handles = std::mem::take(&mut started.ingest);
            let mut ingest = handles.pop().unwrap();
            let publishers: Vec<_> = handles
                .into_iter()
                .zip(0..)
                .map(|(h, t)| {
                    let seed = 1000 * seed + 100 * cores as u64 + t;
                    std::thread::spawn(move || publish(h, seed, t))
                })
                .collect();
            let mut model = Model::default();
            let mut paths = Paths::default();
            for p in publishers {
                let (m, ps) = p.join().unwrap();
                model.dirs.extend(m.dirs);
                paths.0.extend(ps.0);
            }
            ingest.settle().unwrap();
            let at = format!("seed {seed}, {cores} cores");
            for q in paths.0.values() {
                assert_eq!(
                    query.find_matches(q).unwrap(),
                    model.matches(q),
                    "{at}: {q:?}"
                );
            }
            for w in 0..3 * PUBLISHERS {
                ingest.remove_worker(WorkerId(w)).unwrap();
            }
            ingest.settle().unwrap();
            for c in ingest.core_stats().unwrap() {
                assert_eq!(c.inconsistencies, 0, "{at}: {c:?}");
                assert_eq!(c.index, Shard::new(ShardId(0)).stats(), "{at}: {c:?}");
                assert_eq!(c.directory_entries, 0, "{at}: {c:?}");
            }
            drop((ingest, query));
            started.runtime.join().unwrap();
        }
    }
}
