//! The approximate index: expiry, refresh, pruning order, worker removal, memory, and a
//! randomised comparison against a naive model.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use engine::approx::{ApproxConfig, ApproxIndex, ApproxStats};
use engine::{Matches, SeqHash, WorkerId, WorkerKey};
use proptest::prelude::*;

fn hs(v: &[u64]) -> Vec<SeqHash> {
    v.iter().copied().map(SeqHash).collect()
}

fn index(ttl_secs: u64, cap: usize) -> ApproxIndex {
    ApproxIndex::new(ApproxConfig {
        ttl: Duration::from_secs(ttl_secs),
        max_blocks_per_worker: cap,
    })
    .unwrap()
}

fn secs(t0: Instant, s: u64) -> Instant {
    t0 + Duration::from_secs(s)
}

fn held(ix: &ApproxIndex, key: WorkerKey, universe: std::ops::Range<u64>) -> Vec<u64> {
    universe.filter(|&h| ix.holds(key, SeqHash(h))).collect()
}

#[test]
fn predictions_expire_at_their_deadline() {
    let t0 = Instant::now();
    let mut ix = index(10, 100);
    let k = WorkerKey::new(1, 0);
    ix.insert(t0, k, &hs(&[1, 2, 3]));
    assert_eq!(ix.find_matches(&hs(&[1, 2, 3, 4])).overlaps, [(k, 3)]);
    assert_eq!(ix.expire(secs(t0, 9)), 0);
    assert_eq!(ix.expire(secs(t0, 10)), 3);
    assert_eq!(ix.find_matches(&hs(&[1, 2, 3])), Matches::default());
    assert!(ix.is_empty());
}

#[test]
fn reinserting_refreshes_the_expiry() {
    let t0 = Instant::now();
    let mut ix = index(10, 100);
    let k = WorkerKey::new(1, 0);
    ix.insert(t0, k, &hs(&[1, 2]));
    ix.insert(secs(t0, 5), k, &hs(&[1]));
    assert_eq!(ix.expire(secs(t0, 10)), 1);
    assert_eq!(held(&ix, k, 0..5), [1]);
    // An out-of-order `now` never shortens a prediction.
    ix.insert(secs(t0, 1), k, &hs(&[1]));
    assert_eq!(ix.expire(secs(t0, 14)), 0);
    assert_eq!(ix.expire(secs(t0, 15)), 1);
}

#[test]
fn the_cap_prunes_earliest_deadline_first_and_the_tail_before_the_prefix() {
    let t0 = Instant::now();
    let mut ix = index(100, 3);
    let k = WorkerKey::new(1, 0);
    ix.insert(t0, k, &hs(&[1, 2, 3]));
    ix.insert(secs(t0, 1), k, &hs(&[4]));
    // 1, 2, 3 share a deadline; the deepest (3) goes first.
    assert_eq!(held(&ix, k, 0..10), [1, 2, 4]);
    ix.insert(secs(t0, 2), k, &hs(&[5]));
    assert_eq!(held(&ix, k, 0..10), [1, 4, 5]);
    ix.insert(secs(t0, 3), k, &hs(&[1]));
    ix.insert(secs(t0, 4), k, &hs(&[6]));
    // 1 was refreshed at t0+3, so 4 (t0+1) is now the oldest.
    assert_eq!(held(&ix, k, 0..10), [1, 5, 6]);

    // One insert longer than the cap keeps its first blocks.
    let k2 = WorkerKey::new(2, 0);
    ix.insert(t0, k2, &hs(&[10, 11, 12, 13, 14, 15]));
    assert_eq!(held(&ix, k2, 10..16), [10, 11, 12]);
    assert_eq!(ix.worker_blocks(k2), 3);
    assert_eq!(ix.len(), 6);
}

#[test]
fn removing_a_worker_drops_all_its_ranks() {
    let t0 = Instant::now();
    let mut ix = index(100, 100);
    let (a0, a1, b) = (
        WorkerKey::new(1, 0),
        WorkerKey::new(1, 1),
        WorkerKey::new(2, 0),
    );
    ix.insert(t0, a0, &hs(&[1, 2]));
    ix.insert(t0, a1, &hs(&[1, 2, 3]));
    ix.insert(t0, b, &hs(&[1]));
    assert_eq!(ix.remove_worker(WorkerId(1)), 5);
    let m = ix.find_matches(&hs(&[1, 2, 3]));
    assert_eq!(m.overlaps, [(b, 1)]);
    assert_eq!(m.depth_counts, [1]);
    assert_eq!(ix.worker_blocks(a1), 0);
    assert_eq!(ix.remove_worker(WorkerId(1)), 0);
    assert_eq!(
        ix.stats(),
        ApproxStats {
            workers: 1,
            entries: 1,
            blocks: 1,
            queued: 1
        }
    );
}

#[test]
fn overlap_stops_at_the_first_missing_block() {
    let t0 = Instant::now();
    let mut ix = index(100, 100);
    let (a, b, c) = (
        WorkerKey::new(1, 0),
        WorkerKey::new(2, 0),
        WorkerKey::new(3, 0),
    );
    ix.insert(t0, a, &hs(&[1, 3, 4]));
    ix.insert(t0, b, &hs(&[1, 2, 3]));
    ix.insert(t0, c, &hs(&[1, 2]));
    let m = ix.find_matches(&hs(&[1, 2, 3, 4]));
    assert_eq!(m.overlaps, [(b, 3), (c, 2), (a, 1)]);
    assert_eq!(m.depth_counts, [3, 2, 1]);
    assert_eq!(m.best(), 3);
    assert_eq!(ix.find_matches(&hs(&[5, 1])), Matches::default());
    assert_eq!(ix.find_matches(&[]), Matches::default());
}

#[test]
fn memory_is_reclaimed_when_everything_expires() {
    let t0 = Instant::now();
    let mut ix = index(10, 1000);
    for w in 0..50u64 {
        for round in 0..20u64 {
            let blocks: Vec<SeqHash> = (0..64)
                .map(|i| SeqHash(w * 10_000 + round * 7 + i))
                .collect();
            ix.insert(secs(t0, round / 4), WorkerKey::new(w, 0), &blocks);
        }
    }
    assert!(ix.len() > 50 * 64);
    ix.expire(secs(t0, 1000));
    assert_eq!(ix.stats(), ApproxStats::default());
}

/// The reference: per key, `block -> (deadline, insertion number)`, pruned by brute force.
#[derive(Default)]
struct Model {
    seq: u64,
    workers: BTreeMap<WorkerKey, BTreeMap<SeqHash, (Instant, u64)>>,
}

impl Model {
    fn insert(
        &mut self,
        now: Instant,
        ttl: Duration,
        cap: usize,
        key: WorkerKey,
        blocks: &[SeqHash],
    ) {
        if blocks.is_empty() {
            return;
        }
        let d = now + ttl;
        let w = self.workers.entry(key).or_default();
        for &h in blocks.iter().rev() {
            self.seq += 1;
            let e = w.entry(h).or_insert((d, self.seq));
            *e = (e.0.max(d), self.seq);
        }
        while w.len() > cap {
            let victim = *w.iter().min_by_key(|(_, v)| **v).unwrap().0;
            w.remove(&victim);
        }
    }

    fn expire(&mut self, now: Instant) {
        for w in self.workers.values_mut() {
            w.retain(|_, (d, _)| *d > now);
        }
        self.workers.retain(|_, w| !w.is_empty());
    }

    fn find_matches(&self, blocks: &[SeqHash]) -> Matches {
        let mut overlaps: Vec<(WorkerKey, u32)> = self
            .workers
            .iter()
            .map(|(k, w)| {
                (
                    *k,
                    blocks.iter().take_while(|h| w.contains_key(h)).count() as u32,
                )
            })
            .filter(|&(_, o)| o > 0)
            .collect();
        overlaps.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let best = overlaps.first().map_or(0, |&(_, o)| o);
        let depth_counts = (1..=best)
            .map(|d| overlaps.iter().filter(|&&(_, o)| o >= d).count() as u32)
            .collect();
        Matches {
            overlaps,
            depth_counts,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert {
        t: u64,
        key: usize,
        blocks: Vec<u64>,
    },
    Expire {
        t: u64,
    },
    RemoveWorker {
        worker: u64,
    },
}

const KEYS: [WorkerKey; 6] = [
    WorkerKey::new(0, 0),
    WorkerKey::new(0, 1),
    WorkerKey::new(1, 0),
    WorkerKey::new(1, 1),
    WorkerKey::new(2, 0),
    WorkerKey::new(2, 1),
];
const ALPHABET: u64 = 10;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..60u64, 0..KEYS.len(), prop::collection::vec(0..ALPHABET, 0..7))
            .prop_map(|(t, key, blocks)| Op::Insert { t, key, blocks }),
        2 => (0..60u64).prop_map(|t| Op::Expire { t }),
        1 => (0..3u64).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

proptest! {
    // No regression files: a failure prints its minimal input, which becomes a named test.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn matches_a_naive_model(
        ops in prop::collection::vec(op(), 1..120),
        probes in prop::collection::vec(prop::collection::vec(0..ALPHABET, 0..6), 1..6),
        cap in 1..6usize,
    ) {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut ix = ApproxIndex::new(ApproxConfig { ttl, max_blocks_per_worker: cap }).unwrap();
        let mut model = Model::default();
        for op in &ops {
            let last_blocks = match op {
                Op::Insert { t, key, blocks } => {
                    let blocks = hs(blocks);
                    ix.insert(secs(t0, *t), KEYS[*key], &blocks);
                    model.insert(secs(t0, *t), ttl, cap, KEYS[*key], &blocks);
                    blocks
                }
                Op::Expire { t } => {
                    ix.expire(secs(t0, *t));
                    model.expire(secs(t0, *t));
                    vec![]
                }
                Op::RemoveWorker { worker } => {
                    ix.remove_worker(WorkerId(*worker));
                    model.workers.retain(|k, _| k.worker != WorkerId(*worker));
                    vec![]
                }
            };
            for &k in &KEYS {
                let want: Vec<u64> = model
                    .workers
                    .get(&k)
                    .map(|w| w.keys().map(|h| h.0).collect())
                    .unwrap_or_default();
                prop_assert_eq!(held(&ix, k, 0..ALPHABET), want, "key {}", k);
            }
            let entries: usize = model.workers.values().map(|w| w.len()).sum();
            prop_assert_eq!(ix.len(), entries);
            let stats = ix.stats();
            prop_assert_eq!(stats.workers, model.workers.len());
            prop_assert!(stats.queued <= 2 * stats.entries + 64 * stats.workers);
            prop_assert_eq!(ix.find_matches(&last_blocks), model.find_matches(&last_blocks));
            for p in &probes {
                let p = hs(p);
                prop_assert_eq!(ix.find_matches(&p), model.find_matches(&p));
            }
        }
    }
}
