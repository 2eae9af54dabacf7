//! Concurrent ingest with trunk promotions leaves no stale index entries.
//!
//! Two ingest handles post batches (`IngestHandle::send`, several events in flight) for
//! disjoint workers into the threaded runtime on 1, 2 and 3 cores, with the adaptive policy
//! at hub fanout 2, so promotion rounds run all the time and often take several hubs at
//! once. Afterwards the queries must equal a plain model of DESIGN.md (no worker shown
//! holding a block it removed), and once every worker is removed every shard must be back
//! to an empty tree with no inconsistency: no entry that no directory owns.
//!
//! Regression: a round that promoted two hubs of one shard whose paths shared blocks (one
//! below the other, or siblings under a common non-trunk block) exported the shared blocks
//! twice, and every other shard grafted their holders twice; removals, one per shard, left
//! the second copies behind (`sharding::promote` invariant 3).

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, seq_hash, tokens_hash};
use engine::runtime::{RuntimeConfig, start};
use engine::sharding::ShardId;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::shard::Shard;
use engine::{DpRank, EngineHash, Matches, SeqHash, WorkerId, WorkerKey};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Per worker key: engine hash -> (seq_hash, copies); the multiset follows from it.
#[derive(Default, Clone)]
struct Model {
    dirs: BTreeMap<WorkerKey, BTreeMap<u64, (u64, u32)>>,
}

impl Model {
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) {
        match ev {
            KvEvent::Stored { parent, blocks } => {
                let dir = self.dirs.entry(key).or_default();
                let mut prev = match parent {
                    None => None,
                    Some(p) => match dir.get(&p.0) {
                        Some(&(s, _)) => Some(SeqHash(s)),
                        None => {
                            if dir.is_empty() {
                                self.dirs.remove(&key);
                            }
                            return;
                        }
                    },
                };
                for b in blocks {
                    let s = seq_hash(prev, b.tokens_hash);
                    dir.entry(b.engine_hash.0).or_insert((s.0, 0)).1 += 1;
                    prev = Some(s);
                }
            }
            KvEvent::Removed { blocks } => {
                if let Some(dir) = self.dirs.get_mut(&key) {
                    for e in blocks {
                        if let Some(c) = dir.get_mut(&e.0) {
                            c.1 -= 1;
                            if c.1 == 0 {
                                dir.remove(&e.0);
                            }
                        }
                    }
                    if dir.is_empty() {
                        self.dirs.remove(&key);
                    }
                }
            }
            KvEvent::Cleared => {
                self.dirs.remove(&key);
            }
        }
    }

    fn holds(&self, key: WorkerKey, seq: u64) -> bool {
        self.dirs
            .get(&key)
            .is_some_and(|d| d.values().any(|&(s, _)| s == seq))
    }

    fn matches(&self, q: &[SeqHash]) -> Matches {
        Matches::from_overlaps(self.dirs.keys().map(|&k| {
            let o = q.iter().take_while(|s| self.holds(k, s.0)).count();
            (k, o as u32)
        }))
    }
}

/// Every chain ever stored, by its last block: queries are real chains.
#[derive(Default)]
struct Paths(HashMap<u64, Vec<SeqHash>>);

/// A random event for `key` given what it holds: tokens from a small alphabet, so workers
/// share prefixes and blocks branch (hubs, promotions).
fn event(rng: &mut SmallRng, model: &Model, paths: &mut Paths, key: WorkerKey) -> KvEvent {
    let held: Vec<(u64, u64)> = model
        .dirs
        .get(&key)
        .map(|d| d.iter().map(|(&e, &(s, _))| (e, s)).collect())
        .unwrap_or_default();
    let roll = rng.random_range(0..10);
    if roll < 7 || held.is_empty() {
        let parent = if held.is_empty() || rng.random_bool(0.3) {
            None
        } else {
            Some(held[rng.random_range(0..held.len())])
        };
        let mut prev = parent.map(|(_, s)| SeqHash(s));
        let mut path = prev
            .and_then(|p| paths.0.get(&p.0).cloned())
            .unwrap_or_default();
        let blocks = (0..rng.random_range(1..6))
            .map(|_| {
                let t = tokens_hash(&[rng.random_range(0..3u32)], BASE_SEED);
                let s = seq_hash(prev, t);
                path.push(s);
                paths.0.insert(s.0, path.clone());
                prev = Some(s);
                StoredBlock {
                    engine_hash: EngineHash(s.0 ^ 0x5555),
                    tokens_hash: t,
                }
            })
            .collect();
        KvEvent::Stored {
            parent: parent.map(|(e, _)| EngineHash(e)),
            blocks,
        }
    } else if roll < 9 {
        let n = rng.random_range(1..4);
        KvEvent::Removed {
            blocks: (0..n)
                .map(|_| EngineHash(held[rng.random_range(0..held.len())].0))
                .collect(),
        }
    } else {
        KvEvent::Cleared
    }
}

fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(r),
    }
}

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
