//! The plain model of DESIGN.md's index that the engine's randomised runtime tests
//! compare against (`snapshot_restore.rs`, `leak_check.rs`), and the random events they
//! feed it: tokens from a small alphabet, so workers share prefixes and blocks branch
//! (junctions, promotions).

#![allow(dead_code)]

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, seq_hash, tokens_hash};
use engine::{DpRank, EngineHash, Matches, SeqHash, WorkerId, WorkerKey};
use rand::Rng;
use rand::rngs::SmallRng;
use std::collections::{BTreeMap, HashMap};

#[derive(Default, Clone)]
pub struct Model {
    pub dirs: BTreeMap<WorkerKey, BTreeMap<u64, (u64, u32)>>,
}

impl Model {
    pub fn apply(&mut self, key: WorkerKey, ev: &KvEvent) {
        match ev {
            KvEvent::Stored { parent, blocks } => {
                // A chain from the root whose every block is held at the same place already
                // is a report of held blocks (vLLM's `kv_cache_report_mode: "full"`).
                if parent.is_none()
                    && let Some(dir) = self.dirs.get(&key)
                {
                    let mut at = None;
                    let held = blocks.iter().all(|b| {
                        let s = seq_hash(at, b.tokens_hash);
                        at = Some(s);
                        dir.get(&b.engine_hash.0)
                            .is_some_and(|&(have, _)| have == s.0)
                    });
                    if held {
                        return;
                    }
                }
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

    pub fn holds(&self, key: WorkerKey, seq: u64) -> bool {
        self.dirs
            .get(&key)
            .is_some_and(|d| d.values().any(|&(s, _)| s == seq))
    }

    pub fn matches(&self, q: &[SeqHash]) -> Matches {
        Matches::from_overlaps(self.dirs.keys().map(|&k| {
            let o = q.iter().take_while(|s| self.holds(k, s.0)).count();
            (k, o as u32)
        }))
    }
}

/// Every chain ever stored, by its last block: queries are real chains.
#[derive(Default)]
pub struct Paths(pub HashMap<u64, Vec<SeqHash>>);

/// A random event for `key` given what it holds: tokens from a small alphabet, so workers
/// share prefixes and blocks branch (junctions, promotions).
pub fn event(rng: &mut SmallRng, model: &Model, paths: &mut Paths, key: WorkerKey) -> KvEvent {
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

/// Worker key `(w, r)`.
pub fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(r),
    }
}
