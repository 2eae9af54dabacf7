//! The adaptive trunk against a plain model: random stores, removals, clears and worker
//! removals on 1, 2, 3 and 8 shards with a junction threshold of 2 or 3, so that blocks are
//! promoted (and their continuations pinned) all the time; after every operation every
//! query, per-key block counts, per-shard entry counts and shard consistency are checked,
//! and at the end everything is removed and the footprint is back to empty.
//!
//! Queries are chains (a request's seq_hashes, extended past what is stored): a query goes
//! to one shard, which holds its path, so that is what a sharded index answers exactly.
//! (`index_model.rs` also asks non-chain sequences, which only the single-shard index can
//! answer by construction.)

use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::kv_index::Applied;
use engine::runtime::{IngestHandle, QueryHandle, Runtime, RuntimeConfig};
use engine::sharding::ShardPolicy;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::sharded::ShardedIndex;
use engine::sharding::trunk::Trunk;
use engine::{EngineError, EngineHash, Matches, SeqHash, TokensHash, WorkerId, WorkerKey};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
enum Op {
    /// `parent`: None = starts a sequence, Some(i) = the i-th (mod n) block this key holds.
    Store {
        w: u64,
        dp: u32,
        parent: Option<usize>,
        tokens: Vec<u64>,
    },
    Remove {
        w: u64,
        dp: u32,
        picks: Vec<usize>,
    },
    Clear {
        w: u64,
        dp: u32,
    },
    RemoveWorker {
        w: u64,
    },
    Query {
        pick: usize,
        extra: Vec<u64>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..6u64;
    let dp = 0..2u32;
    prop_oneof![
        8 => (w.clone(), dp.clone(), proptest::option::weighted(0.7, 0..64usize),
              proptest::collection::vec(0..4u64, 1..6))
            .prop_map(|(w, dp, parent, tokens)| Op::Store { w, dp, parent, tokens }),
        3 => (w.clone(), dp.clone(), proptest::collection::vec(0..64usize, 1..6))
            .prop_map(|(w, dp, picks)| Op::Remove { w, dp, picks }),
        1 => (w.clone(), dp).prop_map(|(w, dp)| Op::Clear { w, dp }),
        1 => w.prop_map(|w| Op::RemoveWorker { w }),
        4 => (0..256usize, proptest::collection::vec(0..4u64, 0..3))
            .prop_map(|(pick, extra)| Op::Query { pick, extra }),
    ]
}

/// Per worker key, the seq_hashes it holds (with copies); engine hash = seq ^ 0x5555.
#[derive(Default)]
struct Model {
    held: BTreeMap<WorkerKey, BTreeMap<u64, u32>>,
    parents: HashMap<u64, Option<u64>>,
}

impl Model {
    fn matches(&self, q: &[SeqHash]) -> Matches {
        Matches::from_overlaps(self.held.iter().map(|(&k, seqs)| {
            let o = q.iter().take_while(|s| seqs.contains_key(&s.0)).count();
            (k, o as u32)
        }))
    }

    fn drop_copies(&mut self, key: WorkerKey, seqs: &[u64]) {
        if let Some(h) = self.held.get_mut(&key) {
            for s in seqs {
                if let Some(c) = h.get_mut(s) {
                    *c -= 1;
                    if *c == 0 {
                        h.remove(s);
                    }
                }
            }
            if h.is_empty() {
                self.held.remove(&key);
            }
        }
    }
}

fn real_tokens_hash(t: u64) -> TokensHash {
    engine::hash::tokens_hash(&[t as u32], engine::hash::BASE_SEED)
}

fn engine(s: u64) -> EngineHash {
    EngineHash(s ^ 0x5555)
}

/// What the test drives: the single-threaded sharded index or the threaded runtime.
trait Target {
    fn shards(&self) -> u64;
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError>;
    fn remove_worker(&mut self, w: WorkerId);
    fn find_matches(&mut self, q: &[SeqHash]) -> Matches;
    fn cached_blocks(&mut self, key: WorkerKey) -> u64;
    /// (entries over all shards, inconsistencies over all shards)
    fn sizes(&mut self) -> (u64, u64);
    fn trunk(&mut self) -> Trunk;
    fn back_to_empty(&mut self) -> bool;
}

impl Target for ShardedIndex<Adaptive> {
    fn shards(&self) -> u64 {
        ShardedIndex::shards(self).len() as u64
    }
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError> {
        ShardedIndex::apply(self, key, ev)
    }
    fn remove_worker(&mut self, w: WorkerId) {
        ShardedIndex::remove_worker(self, w);
    }
    fn find_matches(&mut self, q: &[SeqHash]) -> Matches {
        ShardedIndex::find_matches(self, q)
    }
    fn cached_blocks(&mut self, key: WorkerKey) -> u64 {
        ShardedIndex::cached_blocks(self, key)
    }
    fn sizes(&mut self) -> (u64, u64) {
        let bad = self.shards().iter().map(|s| s.inconsistencies()).sum();
        (self.stats().entries, bad)
    }
    fn trunk(&mut self) -> Trunk {
        self.policy().trunk().clone()
    }
    fn back_to_empty(&mut self) -> bool {
        let fresh = ShardedIndex::new(Adaptive::new(self.shards().len(), 2).unwrap());
        self.stats() == fresh.stats()
    }
}

/// The runtime: core threads behind one ingest and one query handle; every change is
/// synced before the next operation, so the model applies at once.
struct Threaded {
    runtime: Option<Runtime>,
    ingest: Option<IngestHandle>,
    query: Option<QueryHandle<Adaptive>>,
    policy: Adaptive,
}

impl Threaded {
    fn start(shards: usize, fanout: u32) -> Self {
        let policy = Adaptive::new(shards, fanout).unwrap();
        let config = RuntimeConfig {
            ring_capacity: 2,
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 1,
            ..RuntimeConfig::default()
        };
        let mut st = engine::runtime::start(policy.clone(), config).unwrap();
        Self {
            runtime: Some(st.runtime),
            ingest: st.ingest.pop(),
            query: st.query.pop(),
            policy,
        }
    }
    fn ingest(&mut self) -> &mut IngestHandle {
        self.ingest.as_mut().unwrap()
    }
}

impl Drop for Threaded {
    fn drop(&mut self) {
        self.ingest.take();
        self.query.take();
        if let Some(rt) = self.runtime.take() {
            let summaries = rt.join().unwrap();
            if !std::thread::panicking() {
                assert!(summaries.iter().all(|s| s.inconsistencies == 0));
            }
        }
    }
}

impl Target for Threaded {
    fn shards(&self) -> u64 {
        ShardPolicy::shards(&self.policy) as u64
    }
    fn apply(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<Applied, EngineError> {
        let r = self.ingest().apply(key, ev);
        self.ingest().settle().unwrap();
        r
    }
    fn remove_worker(&mut self, w: WorkerId) {
        self.ingest().remove_worker(w).unwrap();
        self.ingest().settle().unwrap();
    }
    fn find_matches(&mut self, q: &[SeqHash]) -> Matches {
        self.query.as_mut().unwrap().find_matches(q).unwrap()
    }
    fn cached_blocks(&mut self, key: WorkerKey) -> u64 {
        self.ingest().cached_blocks(key).unwrap()
    }
    fn sizes(&mut self) -> (u64, u64) {
        let cores = self.ingest().core_stats().unwrap();
        (
            cores.iter().map(|c| c.index.entries).sum(),
            cores.iter().map(|c| c.inconsistencies).sum(),
        )
    }
    fn trunk(&mut self) -> Trunk {
        self.policy.refresh();
        self.policy.trunk().clone()
    }
    fn back_to_empty(&mut self) -> bool {
        let cores = self.ingest().core_stats().unwrap();
        cores
            .iter()
            .all(|c| c.index.entries == 0 && c.directory_entries == 0)
    }
}

fn run(mut ix: impl Target, ops: Vec<Op>) {
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Store {
                w,
                dp,
                parent,
                tokens,
            } => {
                let key = WorkerKey::new(w, dp);
                let parent = parent.and_then(|i| {
                    let h = m.held.get(&key)?;
                    h.keys().nth(i % h.len()).copied()
                });
                let mut prev = parent.map(SeqHash);
                let mut blocks = Vec::new();
                let mut seqs = Vec::new();
                for &t in &tokens {
                    // Real XXH3 token hashes, so first blocks land on every shard.
                    let t = real_tokens_hash(t).0;
                    let s = seq_hash(prev, TokensHash(t));
                    m.parents.entry(s.0).or_insert(prev.map(|p| p.0));
                    blocks.push(StoredBlock {
                        engine_hash: engine(s.0),
                        tokens_hash: TokensHash(t),
                    });
                    seqs.push(s.0);
                    prev = Some(s);
                }
                // A chain from the root that is held already is a report, not a store
                // (vLLM's `kv_cache_report_mode: "full"`): no copy added.
                let report = parent.is_none()
                    && m.held
                        .get(&key)
                        .is_some_and(|h| seqs.iter().all(|s| h.contains_key(s)));
                if !report {
                    for &s in &seqs {
                        *m.held.entry(key).or_default().entry(s).or_default() += 1;
                    }
                }
                let ev = KvEvent::Stored {
                    parent: parent.map(engine),
                    blocks,
                };
                let added = if report { 0 } else { tokens.len() };
                assert_eq!(ix.apply(key, &ev).unwrap().blocks, added);
            }
            Op::Remove { w, dp, picks } => {
                let key = WorkerKey::new(w, dp);
                let held: Vec<u64> = m
                    .held
                    .get(&key)
                    .map(|h| h.keys().copied().collect())
                    .unwrap_or_default();
                if held.is_empty() {
                    continue;
                }
                let mut gone: Vec<u64> = picks.iter().map(|i| held[i % held.len()]).collect();
                gone.sort();
                gone.dedup();
                m.drop_copies(key, &gone);
                let ev = KvEvent::Removed {
                    blocks: gone.iter().map(|&s| engine(s)).collect(),
                };
                assert_eq!(ix.apply(key, &ev).unwrap().unknown, 0);
            }
            Op::Clear { w, dp } => {
                let key = WorkerKey::new(w, dp);
                m.held.remove(&key);
                ix.apply(key, &KvEvent::Cleared).unwrap();
            }
            Op::RemoveWorker { w } => {
                m.held.retain(|k, _| k.worker != WorkerId(w));
                ix.remove_worker(WorkerId(w));
            }
            Op::Query { pick, extra } => {
                let mut known: Vec<u64> = m.parents.keys().copied().collect();
                known.sort();
                let mut q = Vec::new();
                if !known.is_empty() {
                    let mut s = Some(known[pick % known.len()]);
                    while let Some(x) = s {
                        q.push(SeqHash(x));
                        s = m.parents[&x];
                    }
                    q.reverse();
                }
                for t in extra {
                    q.push(seq_hash(q.last().copied(), real_tokens_hash(t)));
                }
                assert_eq!(ix.find_matches(&q), m.matches(&q), "query {q:?}");
            }
        }
        let trunk = ix.trunk();
        let shards = ix.shards();
        let want: u64 = m
            .held
            .values()
            .flat_map(|h| h.keys())
            .map(|&s| {
                if trunk.contains(SeqHash(s)) {
                    shards
                } else {
                    1
                }
            })
            .sum();
        assert_eq!(ix.sizes(), (want, 0));
        for (k, h) in &m.held {
            assert_eq!(ix.cached_blocks(*k), h.len() as u64);
        }
    }
    let keys: Vec<WorkerKey> = m.held.keys().copied().collect();
    for k in keys {
        ix.apply(k, &KvEvent::Cleared).unwrap();
    }
    assert!(ix.back_to_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn adaptive_sharded_index_equals_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        fanout in 2u32..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(ShardedIndex::new(Adaptive::new(shards, fanout).unwrap()), ops);
    }
}

proptest! {
    // Every case starts and joins real core threads: fewer cases, same operations.
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn adaptive_runtime_equals_model(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        fanout in 2u32..4,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(Threaded::start(shards, fanout), ops);
    }
}

/// A hot prompt (every sequence shares its first 96 blocks, W4's shape) is promoted once it
/// branches, after which its continuations spread over the shards.
#[test]
fn a_long_shared_prompt_is_promoted_and_the_load_spreads() {
    let shards = 2;
    let mut ix =
        ShardedIndex::new(Adaptive::new(shards, Adaptive::DEFAULT_JUNCTION_FANOUT).unwrap());
    let prompt: Vec<TokensHash> = (0..96).map(|i| TokensHash(1_000 + i)).collect();
    for seq in 0..1_000u64 {
        let key = WorkerKey::new(seq % 64, 0);
        let mut prev = None;
        let blocks: Vec<StoredBlock> = prompt
            .iter()
            .copied()
            .chain((0..32).map(|i| TokensHash(seq * 100 + i)))
            .map(|t| {
                let s = seq_hash(prev, t);
                prev = Some(s);
                StoredBlock {
                    engine_hash: EngineHash(s.0 ^ seq),
                    tokens_hash: t,
                }
            })
            .collect();
        ix.apply(
            key,
            &KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
    }
    assert_eq!(
        ix.policy().trunk().len(),
        96,
        "the prompt, and nothing else"
    );
    let ops: Vec<u64> = ix.shards().iter().map(|s| s.applied()).collect();
    let max = *ops.iter().max().unwrap() as f64;
    let balance = max * shards as f64 / ops.iter().sum::<u64>() as f64;
    assert!(balance < 1.1, "balance {balance} over {ops:?}");
    assert!(ix.shards().iter().all(|s| s.inconsistencies() == 0));
    assert_eq!(ShardPolicy::shards(ix.policy()), shards);
}

proptest! {
    // The same with many more cases; `#[ignore]`d, run by CI explicitly.
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    #[ignore = "stress: run with --ignored (CI does)"]
    fn adaptive_runtime_equals_model_stress(
        shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(8)],
        fanout in 2u32..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(Threaded::start(shards, fanout), ops);
    }
}

/// Streams `events` into a fresh runtime in bulk (many ingest messages queued while
/// promotions run), settles, and checks every query against `KvIndex` fed the same events.
fn bulk_equals_kv_index(
    cores: usize,
    fanout: u32,
    events: &[(WorkerKey, KvEvent)],
    queries: &[Vec<SeqHash>],
) {
    let mut kv = engine::kv_index::KvIndex::new();
    for (k, ev) in events {
        kv.apply(*k, ev).unwrap();
    }
    let config = RuntimeConfig {
        ring_capacity: 256,
        pin_cores: false,
        ingest_handles: 1,
        query_handles: 1,
        ..RuntimeConfig::default()
    };
    let mut st = engine::runtime::start(Adaptive::new(cores, fanout).unwrap(), config).unwrap();
    let (mut ing, mut q) = (st.ingest.remove(0), st.query.remove(0));
    ing.send(&std::sync::Arc::from(events.to_vec())).unwrap();
    ing.settle().unwrap();
    for query in queries {
        assert_eq!(
            q.find_matches(query).unwrap(),
            kv.find_matches(query),
            "{cores} cores"
        );
    }
    let cores_stats = ing.core_stats().unwrap();
    assert!(cores_stats.iter().all(|c| c.inconsistencies == 0));
    assert!(
        cores_stats.iter().any(|c| c.promotions > 0),
        "nothing was promoted"
    );
    drop((ing, q));
    st.runtime.join().unwrap();
}

/// The shape of the old `shared-prefix` workload: one 32-block prompt shared by 16 workers
/// (each stores it once), a private 96-block tail per sequence, everything streamed at
/// once. Streamed in bulk, several ingest messages wait at each core while the prompt's
/// promotion runs (this caught a core routing one more slice after it had frozen itself).
/// Token hashes are real XXH3 values, so the prompt lands on any shard, not only core 0.
#[test]
fn streamed_events_with_promotions_answer_like_the_one_shard_index() {
    let chain =
        |parent: Option<SeqHash>, tokens: std::ops::Range<u64>| -> Vec<(SeqHash, TokensHash)> {
            let mut prev = parent;
            tokens
                .map(|t| {
                    let th = engine::hash::tokens_hash(
                        &[t as u32, (t >> 32) as u32],
                        engine::hash::BASE_SEED,
                    );
                    let s = seq_hash(prev, th);
                    prev = Some(s);
                    (s, th)
                })
                .collect()
        };
    for (cores, seed) in [2usize, 3]
        .into_iter()
        .flat_map(|c| (0..8u64).map(move |s| (c, s)))
    {
        let base = seed * 1_000_000;
        let prompt = chain(None, base..base + 32);
        let last = prompt.last().map(|x| x.0);
        let blocks = |seqs: &[(SeqHash, TokensHash)], w: u64| -> Vec<StoredBlock> {
            seqs.iter()
                .map(|&(s, t)| StoredBlock {
                    engine_hash: EngineHash(s.0 ^ w),
                    tokens_hash: t,
                })
                .collect()
        };
        let (mut events, mut queries) = (Vec::new(), Vec::new());
        let mut stored = std::collections::HashSet::new();
        for k in 0..128u64 {
            let w = k % 16;
            let key = WorkerKey::new(w, 0);
            let tail = chain(last, base + 10_000 + k * 100..base + 10_000 + k * 100 + 96);
            if stored.insert(w) {
                events.push((
                    key,
                    KvEvent::Stored {
                        parent: None,
                        blocks: blocks(&prompt, w),
                    },
                ));
            }
            let parent = last.map(|s| EngineHash(s.0 ^ w));
            events.push((
                key,
                KvEvent::Stored {
                    parent,
                    blocks: blocks(&tail, w),
                },
            ));
            queries.push(prompt.iter().chain(&tail).map(|x| x.0).collect());
        }
        bulk_equals_kv_index(cores, Adaptive::DEFAULT_JUNCTION_FANOUT, &events, &queries);
    }
}
