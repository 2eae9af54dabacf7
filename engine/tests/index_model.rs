//! Randomised test: the index against DESIGN.md's reference model, a plain `HashMap` model.
//!
//! Random interleavings of stores (with and without parents, duplicates, conflicting engine
//! hashes, unknown parents), removals (including mid-chain and unknown blocks), clears,
//! worker removals and dp ranks; after every operation every query, every per-worker block
//! count, the entry count and the refusal counters are compared. The same operations run
//! against the single-shard `KvIndex` and against the sharded engine (`ShardedIndex`) with
//! 1, 2, 3 and 8 shards and several replication depths; the `capped` variants cap each
//! worker key's directory (`--max-blocks-per-worker`) low enough that stores are refused.

use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::index::ShardIndex;
use engine::kv_index::{Applied, KvIndex};
use engine::runtime::{CoreSummary, IngestHandle, QueryHandle, Runtime, RuntimeConfig};
use engine::sharding::fixed_depth::FixedDepth;
use engine::sharding::sharded::ShardedIndex;
use engine::{
    EngineError, EngineHash, Matches, RejectCounts, RejectReason, SeqHash, TokensHash, WorkerId,
    WorkerKey,
};
use proptest::prelude::*;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

/// One worker key in the model: engine hash -> (seq, copies), seq -> copies.
#[derive(Default, Clone)]
struct WorkerModel {
    dir: HashMap<u64, (u64, u32)>,
    seqs: HashMap<u64, u32>,
}

#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerKey, WorkerModel>,
    unknown_parent: u64,
    unknown_block: u64,
    conflicts: u64,
    /// The most engine hashes a worker key may hold: a store whose blocks would take the
    /// directory's entries past it is refused as a whole (counted blocks, not new entries).
    cap: Option<usize>,
    worker_full: u64,
}

impl Model {
    fn store(&mut self, key: WorkerKey, parent: Option<u64>, blocks: &[(u64, u64)]) -> bool {
        let mut w = self.workers.get(&key).cloned().unwrap_or_default();
        let mut prev = match parent {
            None => None,
            Some(p) => match w.dir.get(&p) {
                Some(&(s, _)) => Some(SeqHash(s)),
                None => {
                    self.unknown_parent += 1;
                    return false;
                }
            },
        };
        // A chain from the root whose every block is held at the same place already is a
        // report of held blocks (vLLM's `kv_cache_report_mode: "full"`): nothing changes.
        if parent.is_none() {
            let mut at = None;
            let held = blocks.iter().all(|&(e, t)| {
                let s = seq_hash(at, TokensHash(t));
                at = Some(s);
                w.dir.get(&e).is_some_and(|&(have, _)| have == s.0)
            });
            if held {
                return true;
            }
        }
        if self.cap.is_some_and(|cap| w.dir.len() + blocks.len() > cap) {
            self.worker_full += 1;
            return false;
        }
        for &(e, t) in blocks {
            let s = seq_hash(prev, TokensHash(t));
            match w.dir.get_mut(&e) {
                Some((have, _)) if *have != s.0 => {
                    self.conflicts += 1;
                    return false;
                }
                Some((_, c)) => *c += 1,
                None => {
                    w.dir.insert(e, (s.0, 1));
                }
            }
            *w.seqs.entry(s.0).or_default() += 1;
            prev = Some(s);
        }
        if !w.dir.is_empty() {
            self.workers.insert(key, w);
        }
        true
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[u64]) -> (usize, usize) {
        let (mut applied, mut unknown) = (0, 0);
        let Some(w) = self.workers.get_mut(&key) else {
            self.unknown_block += blocks.len() as u64;
            return (0, blocks.len());
        };
        for e in blocks {
            match w.dir.get_mut(e) {
                Some((s, c)) => {
                    let s = *s;
                    *c -= 1;
                    if *c == 0 {
                        w.dir.remove(e);
                    }
                    let n = w.seqs.get_mut(&s).unwrap();
                    *n -= 1;
                    if *n == 0 {
                        w.seqs.remove(&s);
                    }
                    applied += 1;
                }
                None => unknown += 1,
            }
        }
        if w.dir.is_empty() {
            self.workers.remove(&key);
        }
        self.unknown_block += unknown as u64;
        (applied, unknown)
    }

    fn matches(&self, q: &[SeqHash]) -> Matches {
        let mut overlaps: Vec<(WorkerKey, u32)> = self
            .workers
            .iter()
            .map(|(k, w)| {
                (
                    *k,
                    q.iter().take_while(|s| w.seqs.contains_key(&s.0)).count() as u32,
                )
            })
            .filter(|(_, o)| *o > 0)
            .collect();
        overlaps.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let best = overlaps.first().map_or(0, |o| o.1);
        let depth_counts = (0..best)
            .map(|d| overlaps.iter().filter(|(_, o)| *o > d).count() as u32)
            .collect();
        Matches {
            overlaps,
            depth_counts,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// `parent`: None = starts a chain; Some(i) = the i-th (mod n) engine hash the model
    /// knows for this key, or an unknown one when it knows none. `blocks`: (token id,
    /// engine-hash style) with style 0 = prefix-derived, 1..=4 = a small fixed id (duplicates
    /// and conflicts).
    Store {
        w: u64,
        dp: u32,
        parent: Option<usize>,
        blocks: Vec<(u64, u8)>,
    },
    /// Removes the picked (mod n) engine hashes; `unknown` adds one the key never had.
    Remove {
        w: u64,
        dp: u32,
        picks: Vec<usize>,
        unknown: bool,
    },
    Clear {
        w: u64,
        dp: u32,
    },
    RemoveWorker {
        w: u64,
    },
    /// Query: the full chain up to the picked known seq, plus extra random blocks.
    Query {
        pick: usize,
        extra: Vec<u64>,
        mutate: Option<usize>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..5u64;
    let dp = 0..2u32;
    prop_oneof![
        6 => (w.clone(), dp.clone(), proptest::option::weighted(0.6, 0..64usize),
              proptest::collection::vec((0..4u64, prop_oneof![8 => Just(0u8), 1 => 1..=4u8]), 1..6))
            .prop_map(|(w, dp, parent, blocks)| Op::Store { w, dp, parent, blocks }),
        3 => (w.clone(), dp.clone(), proptest::collection::vec(0..64usize, 1..5), proptest::bool::weighted(0.1))
            .prop_map(|(w, dp, picks, unknown)| Op::Remove { w, dp, picks, unknown }),
        1 => (w.clone(), dp.clone()).prop_map(|(w, dp)| Op::Clear { w, dp }),
        1 => w.prop_map(|w| Op::RemoveWorker { w }),
        4 => (0..256usize, proptest::collection::vec(0..4u64, 0..3), proptest::option::weighted(0.2, 0..8usize))
            .prop_map(|(pick, extra, mutate)| Op::Query { pick, extra, mutate }),
    ]
}

/// seq -> parent seq, for every seq ever stored (a seq names its whole prefix).
type Parents = HashMap<u64, Option<u64>>;

/// What the randomised test drives: the single-shard index or the sharded engine.
trait Indexer {
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError>;
    fn clear(&mut self, key: WorkerKey) -> usize;
    fn remove_worker(&mut self, w: WorkerId) -> usize;
    fn find_matches(&self, q: &[SeqHash]) -> Matches;
    fn rejects(&self) -> RejectCounts;
    /// Checks this implementation's size invariants against the model.
    fn check_sizes(&self, model: &Model, parents: &Parents);
    /// Is the footprint back to that of a new, empty index?
    fn is_back_to_empty(&self) -> bool;
}

impl Indexer for KvIndex {
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError> {
        KvIndex::apply(self, key, ev)
    }
    fn clear(&mut self, key: WorkerKey) -> usize {
        KvIndex::clear(self, key)
    }
    fn remove_worker(&mut self, w: WorkerId) -> usize {
        KvIndex::remove_worker(self, w)
    }
    fn find_matches(&self, q: &[SeqHash]) -> Matches {
        KvIndex::find_matches(self, q)
    }
    fn rejects(&self) -> RejectCounts {
        KvIndex::rejects(self).clone()
    }
    fn check_sizes(&self, model: &Model, _: &Parents) {
        let stats = self.stats();
        let entries: usize = model.workers.values().map(|w| w.seqs.len()).sum();
        assert_eq!(stats.index.entries, entries as u64);
        let distinct: HashSet<u64> = model
            .workers
            .values()
            .flat_map(|w| w.seqs.keys().copied())
            .collect();
        assert_eq!(stats.index.blocks, distinct.len());
        assert_eq!(stats.index.worker_keys, model.workers.len());
        for (k, w) in &model.workers {
            assert_eq!(self.cached_blocks(*k), w.seqs.len() as u64);
        }
    }
    fn is_back_to_empty(&self) -> bool {
        self.stats() == KvIndex::new().stats()
    }
}

struct Sharded {
    ix: ShardedIndex<FixedDepth>,
    policy: FixedDepth,
}

impl Indexer for Sharded {
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError> {
        self.ix.apply(key, ev)
    }
    fn clear(&mut self, key: WorkerKey) -> usize {
        self.ix.clear(key)
    }
    fn remove_worker(&mut self, w: WorkerId) -> usize {
        self.ix.remove_worker(w)
    }
    fn find_matches(&self, q: &[SeqHash]) -> Matches {
        self.ix.find_matches(q)
    }
    fn rejects(&self) -> RejectCounts {
        self.ix.rejects().clone()
    }
    fn check_sizes(&self, model: &Model, parents: &Parents) {
        let depth = |mut s: u64| {
            let mut d = 0u32;
            while let Some(Some(p)) = parents.get(&s) {
                s = *p;
                d += 1;
            }
            d
        };
        let shards = self.ix.shards().len() as u64;
        // Blocks shallower than the replication depth live in every shard.
        let want: u64 = model
            .workers
            .values()
            .flat_map(|w| w.seqs.keys())
            .map(|&s| {
                if depth(s) < self.policy.depth() {
                    shards
                } else {
                    1
                }
            })
            .sum();
        assert_eq!(self.ix.stats().entries, want);
        for (k, w) in &model.workers {
            assert_eq!(self.ix.cached_blocks(*k), w.dir.len() as u64);
        }
        assert!(self.ix.shards().iter().all(|s| s.inconsistencies() == 0));
    }
    fn is_back_to_empty(&self) -> bool {
        let fresh = ShardedIndex::new(self.policy);
        self.ix.stats() == fresh.stats()
    }
}

/// The threaded runtime: core threads behind one ingest and one query handle.
struct Threaded {
    runtime: Option<Runtime>,
    ingest: RefCell<Option<IngestHandle>>,
    query: RefCell<Option<QueryHandle<FixedDepth>>>,
}

impl Threaded {
    fn start(policy: FixedDepth, cap: Option<usize>) -> Self {
        let config = RuntimeConfig {
            ring_capacity: 2,
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 1,
            max_blocks_per_key: cap,
            ..RuntimeConfig::default()
        };
        let mut st = engine::runtime::start(policy, config).unwrap();
        Self {
            runtime: Some(st.runtime),
            ingest: RefCell::new(st.ingest.pop()),
            query: RefCell::new(st.query.pop()),
        }
    }

    fn with_ingest<T>(&self, f: impl FnOnce(&mut IngestHandle) -> T) -> T {
        f(self.ingest.borrow_mut().as_mut().unwrap())
    }

    fn core_stats(&self) -> Vec<CoreSummary> {
        self.query
            .borrow_mut()
            .as_mut()
            .unwrap()
            .core_stats()
            .unwrap()
    }
}

impl Drop for Threaded {
    fn drop(&mut self) {
        self.ingest.borrow_mut().take();
        self.query.borrow_mut().take();
        if let Some(rt) = self.runtime.take() {
            let summaries = rt.join().unwrap();
            if !std::thread::panicking() {
                assert!(summaries.iter().all(|s| s.inconsistencies == 0));
            }
        }
    }
}

impl Indexer for Threaded {
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError> {
        self.with_ingest(|h| {
            let r = h.apply(key, ev);
            h.sync().unwrap();
            r
        })
    }
    fn clear(&mut self, key: WorkerKey) -> usize {
        self.with_ingest(|h| {
            let n = h.clear(key).unwrap();
            h.sync().unwrap();
            n
        })
    }
    fn remove_worker(&mut self, w: WorkerId) -> usize {
        self.with_ingest(|h| {
            let n = h.remove_worker(w).unwrap();
            h.sync().unwrap();
            n
        })
    }
    fn find_matches(&self, q: &[SeqHash]) -> Matches {
        self.query
            .borrow_mut()
            .as_mut()
            .unwrap()
            .find_matches(q)
            .unwrap()
    }
    fn rejects(&self) -> RejectCounts {
        self.with_ingest(|h| h.rejects().unwrap())
    }
    fn check_sizes(&self, model: &Model, _: &Parents) {
        for (k, w) in &model.workers {
            let got = self.with_ingest(|h| h.cached_blocks(*k).unwrap());
            assert_eq!(got, w.dir.len() as u64);
        }
        let stats = self.core_stats();
        assert!(stats.iter().all(|s| s.inconsistencies == 0));
        let dir_entries: usize = stats.iter().map(|s| s.directory_entries).sum();
        let want: usize = model.workers.values().map(|w| w.dir.len()).sum();
        assert_eq!(dir_entries, want);
    }
    fn is_back_to_empty(&self) -> bool {
        let empty = ShardIndex::new().stats();
        self.core_stats()
            .iter()
            .all(|s| s.index == empty && s.directory_entries == 0 && s.directory_bytes == 0)
    }
}

fn check(ix: &dyn Indexer, model: &Model, q: &[SeqHash]) {
    assert_eq!(ix.find_matches(q), model.matches(q), "query {q:?}");
}

fn run(mut ix: Box<dyn Indexer>, ops: Vec<Op>, cap: Option<usize>) {
    let mut model = Model {
        cap,
        ..Model::default()
    };
    // seq -> parent seq, for every seq ever stored (a seq names its whole prefix).
    let mut parents: HashMap<u64, Option<u64>> = HashMap::new();
    let mut known: Vec<u64> = Vec::new();
    for op in ops {
        match op {
            Op::Store {
                w,
                dp,
                parent,
                blocks,
            } => {
                let key = WorkerKey::new(w, dp);
                let engines: Vec<u64> = model
                    .workers
                    .get(&key)
                    .map(|m| {
                        let mut v: Vec<u64> = m.dir.keys().copied().collect();
                        v.sort();
                        v
                    })
                    .unwrap_or_default();
                let parent = parent.map(|i| {
                    if engines.is_empty() {
                        0xdead_0000 + i as u64
                    } else {
                        engines[i % engines.len()]
                    }
                });
                let mut prev =
                    parent.and_then(|p| model.workers.get(&key)?.dir.get(&p).map(|x| SeqHash(x.0)));
                let mut ev = vec![];
                let mut chain = vec![];
                for (t, style) in &blocks {
                    let s = seq_hash(prev, TokensHash(*t));
                    let e = if *style == 0 {
                        s.0 ^ 0x5555
                    } else {
                        u64::from(*style)
                    };
                    ev.push(StoredBlock {
                        engine_hash: EngineHash(e),
                        tokens_hash: TokensHash(*t),
                    });
                    chain.push((e, *t));
                    chain_parent(&mut parents, &mut known, prev, s);
                    prev = Some(s);
                }
                let ok_model = model.store(key, parent, &chain);
                let got = ix.apply(
                    key,
                    &KvEvent::Stored {
                        parent: parent.map(EngineHash),
                        blocks: ev,
                    },
                );
                assert_eq!(
                    got.is_ok(),
                    ok_model,
                    "store {key:?} {parent:?} {blocks:?}: {got:?}"
                );
            }
            Op::Remove {
                w,
                dp,
                picks,
                unknown,
            } => {
                let key = WorkerKey::new(w, dp);
                let mut engines: Vec<u64> = model
                    .workers
                    .get(&key)
                    .map(|m| m.dir.keys().copied().collect())
                    .unwrap_or_default();
                engines.sort();
                let mut hashes: Vec<u64> = if engines.is_empty() {
                    vec![]
                } else {
                    picks.iter().map(|i| engines[i % engines.len()]).collect()
                };
                if unknown {
                    hashes.push(0xbeef);
                }
                let (applied, unk) = model.remove(key, &hashes);
                let got = ix
                    .apply(
                        key,
                        &KvEvent::Removed {
                            blocks: hashes.iter().copied().map(EngineHash).collect(),
                        },
                    )
                    .unwrap();
                assert_eq!((got.blocks, got.unknown), (applied, unk));
            }
            Op::Clear { w, dp } => {
                let key = WorkerKey::new(w, dp);
                let copies: u32 = model
                    .workers
                    .remove(&key)
                    .map_or(0, |m| m.dir.values().map(|x| x.1).sum());
                assert_eq!(
                    ix.apply(key, &KvEvent::Cleared).unwrap().blocks,
                    copies as usize
                );
            }
            Op::RemoveWorker { w } => {
                let before = model.workers.len();
                model.workers.retain(|k, _| k.worker != WorkerId(w));
                assert_eq!(ix.remove_worker(WorkerId(w)), before - model.workers.len());
            }
            Op::Query {
                pick,
                extra,
                mutate,
            } => {
                let mut q = vec![];
                if !known.is_empty() {
                    let mut s = Some(known[pick % known.len()]);
                    while let Some(x) = s {
                        q.push(SeqHash(x));
                        s = parents[&x];
                    }
                    q.reverse();
                }
                for t in extra {
                    q.push(seq_hash(q.last().copied(), TokensHash(t)));
                }
                if let Some(i) = mutate
                    && !q.is_empty()
                {
                    let i = i % q.len();
                    q[i] = SeqHash(q[i].0 ^ 1);
                }
                check(ix.as_ref(), &model, &q);
            }
        }
        // Invariants after every operation.
        ix.check_sizes(&model, &parents);
        assert_eq!(
            ix.rejects().get(RejectReason::UnknownParent),
            model.unknown_parent
        );
        assert_eq!(
            ix.rejects().get(RejectReason::UnknownBlock),
            model.unknown_block
        );
        assert_eq!(
            ix.rejects().get(RejectReason::EngineHashConflict),
            model.conflicts
        );
        assert_eq!(
            ix.rejects().get(RejectReason::WorkerFull),
            model.worker_full
        );
    }
    // Everyone removes everything: back to the empty footprint.
    for k in model.workers.keys() {
        ix.clear(*k);
    }
    assert!(ix.is_back_to_empty());
}

fn chain_parent(
    parents: &mut HashMap<u64, Option<u64>>,
    known: &mut Vec<u64>,
    prev: Option<SeqHash>,
    s: SeqHash,
) {
    if parents.insert(s.0, prev.map(|p| p.0)).is_none() {
        known.push(s.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn index_equals_reference_model(ops in proptest::collection::vec(op(), 1..120)) {
        run(Box::new(KvIndex::new()), ops, None);
    }

    #[test]
    fn capped_index_equals_reference_model(
        cap in 1usize..16,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(Box::new(KvIndex::new().with_max_blocks_per_key(Some(cap))), ops, Some(cap));
    }

    #[test]
    fn capped_sharded_index_equals_reference_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3)],
        depth in 0u32..3,
        cap in 1usize..16,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let policy = FixedDepth::new(shards, depth).unwrap();
        let ix = ShardedIndex::new(policy).with_max_blocks_per_key(Some(cap));
        run(Box::new(Sharded { ix, policy }), ops, Some(cap));
    }

    #[test]
    fn sharded_index_equals_reference_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        depth in 0u32..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let policy = FixedDepth::new(shards, depth).unwrap();
        run(Box::new(Sharded { ix: ShardedIndex::new(policy), policy }), ops, None);
    }
}

proptest! {
    // Every case starts and joins real shard threads: fewer cases, same operations.
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn threaded_runtime_equals_reference_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        depth in 0u32..3,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let policy = FixedDepth::new(shards, depth).unwrap();
        run(Box::new(Threaded::start(policy, None)), ops, None);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn capped_threaded_runtime_equals_reference_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3)],
        cap in 1usize..16,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let policy = FixedDepth::new(shards, 1).unwrap();
        run(Box::new(Threaded::start(policy, Some(cap))), ops, Some(cap));
    }
}

proptest! {
    // The same with many more cases; `#[ignore]`d (about a minute), run by CI explicitly.
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    #[ignore = "stress: run with --ignored (CI does)"]
    fn threaded_runtime_equals_reference_model_stress(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        depth in 0u32..3,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let policy = FixedDepth::new(shards, depth).unwrap();
        run(Box::new(Threaded::start(policy, None)), ops, None);
    }
}
