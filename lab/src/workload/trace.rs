//! The `trace` workload: a Mooncake-format JSONL trace replayed onto simulated workers.
//!
//! One JSON object per line: `{"timestamp", "input_length", "output_length", "hash_ids"}`
//! (kvcache-ai/Mooncake, FAST'25 traces). Each hash id names a 512-token block; ids are
//! tree-consistent (equal ids at position `i` mean equal first `(i + 1) * 512` tokens).
//! Traces carry no text, so each id is expanded into 512 synthetic token ids that depend
//! on the id alone, cut into `512 / block_size` engine blocks and hashed for real. A
//! request is the chain of all its ids' blocks (the last id's partial block is expanded in
//! full, so an id always names the same blocks), truncated to a worker's capacity.
//!
//! Requests go to `W` simulated workers (round-robin, or by a hash of the first id). Each
//! worker has a cache of `capacity` blocks with LRU eviction, like vLLM's prefix cache: a
//! request touches its cached blocks, evicts the least recently used blocks it needs room
//! for (one `Removed` event), and stores each run of missing blocks with a parent link
//! (one `Stored` event per run). A request's blocks are touched last-to-first, so a
//! sequence's tail is evicted before its head.
//!
//! The requests are split in thirds: build, store, and mixed (whose own requests are the
//! mixed phase's queries). The remove phase evicts everything still cached, oldest first.
//!
//! # Invariants
//! 1. A worker's live entries are exactly its cache: each (worker, block) pair is stored
//!    at most once while live, and every eviction removes a stored block, so removals are
//!    real and the remove phase empties the index.
//! 2. A store's parent is cached when the event is emitted: blocks of the current request
//!    are touched before anything is evicted, and a request never exceeds the capacity.
//! 3. A block's tokens depend only on its hash id and position: prefix sharing in the
//!    trace survives expansion exactly, at any block size dividing 512.

use super::phase::PhaseBuilder;
use super::plan::{MixedPhases, Plan, PlanShape};
use super::query::{CheckedQuery, Query, deal_queries, random_continuation};
use super::rng::{Rng, engine_hash_of, mix_all, mix64};
use super::spec::{TraceAssign, WorkloadSpec};
use anyhow::{Context, Result, bail};
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, seq_hash, tokens_hashes};
use engine::{EngineHash, SeqHash, TokensHash, WorkerKey};
use serde::Deserialize;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;

/// Tokens per trace block (Mooncake's hash-id granularity).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Blocks per `Removed` event when the remove phase empties a cache.
const TEARDOWN_CHUNK: usize = 128;

/// Distinct prefix-only queries generated (sampled with repetition up to `--queries`).
const PREFIX_QUERY_POOL: usize = 4096;

/// Mixed into token generation so trace tokens differ from synthetic ones.
const TRACE_TAG: u64 = 0x6d6f_6f6e_6361_6b65;

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    timestamp: u64,
    #[serde(default)]
    input_length: u64,
    #[serde(default)]
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival, in milliseconds since the trace started.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Answer tokens.
    pub output_length: u64,
    /// The prompt's 512-token blocks, by id.
    pub hash_ids: Vec<u64>,
}

/// Parses JSONL trace text; blank lines are skipped, unknown fields ignored. Errors name
/// the line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(raw)
            .with_context(|| format!("trace line {}: not a Mooncake record", i + 1))?;
        out.push(TraceRecord {
            timestamp_ms: l.timestamp,
            input_length: l.input_length,
            output_length: l.output_length,
            hash_ids: l.hash_ids,
        });
    }
    Ok(out)
}

/// Loads the JSONL trace at `path`.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading trace {}", path.display()))?;
    parse_trace(&text).with_context(|| format!("parsing trace {}", path.display()))
}

/// Expands hash ids into engine blocks (invariant 3), memoising each id's tokens hashes.
struct Expander {
    block_size: usize,
    per_id: usize,
    memo: HashMap<u64, Box<[TokensHash]>>,
    tokens: Vec<u32>,
}

/// One engine block of a request.
#[derive(Clone, Copy)]
struct ReqBlock {
    stored: StoredBlock,
    seq: SeqHash,
}

impl Expander {
    fn new(block_size: usize) -> Self {
        Self {
            block_size,
            per_id: TRACE_BLOCK_TOKENS / block_size,
            memo: HashMap::new(),
            tokens: Vec::with_capacity(TRACE_BLOCK_TOKENS),
        }
    }

    fn id_hashes(&mut self, id: u64) -> &[TokensHash] {
        let (bs, tokens) = (self.block_size, &mut self.tokens);
        self.memo.entry(id).or_insert_with(|| {
            tokens.clear();
            tokens.extend(
                (0..TRACE_BLOCK_TOKENS as u64)
                    .map(|p| (mix_all(&[TRACE_TAG, id, p]) % 32_000) as u32),
            );
            tokens_hashes(tokens, bs, BASE_SEED).into_boxed_slice()
        })
    }

    /// The request's blocks, at most `cap` of them.
    fn request(&mut self, ids: &[u64], cap: usize) -> Vec<ReqBlock> {
        let mut out = Vec::with_capacity((ids.len() * self.per_id).min(cap));
        let mut prev = None;
        'ids: for &id in ids {
            for &th in self.id_hashes(id) {
                if out.len() == cap {
                    break 'ids;
                }
                let seq = seq_hash(prev, th);
                out.push(ReqBlock {
                    stored: StoredBlock {
                        engine_hash: engine_hash_of(seq),
                        tokens_hash: th,
                    },
                    seq,
                });
                prev = Some(seq);
            }
        }
        out
    }
}

/// One simulated worker's cache: LRU over engine hashes, with lazily dropped stale ticks.
#[derive(Default)]
struct Lru {
    live: HashMap<EngineHash, u64>,
    order: VecDeque<(u64, EngineHash)>,
    tick: u64,
}

impl Lru {
    fn contains(&self, h: EngineHash) -> bool {
        self.live.contains_key(&h)
    }

    fn len(&self) -> usize {
        self.live.len()
    }

    fn touch(&mut self, h: EngineHash) {
        self.tick += 1;
        self.live.insert(h, self.tick);
        self.order.push_back((self.tick, h));
        if self.order.len() > 4 * self.live.len() + 1024 {
            let live = &self.live;
            self.order.retain(|(t, h)| live.get(h) == Some(t));
        }
    }

    fn pop_oldest(&mut self) -> Option<EngineHash> {
        while let Some((t, h)) = self.order.pop_front() {
            if self.live.get(&h) == Some(&t) {
                self.live.remove(&h);
                return Some(h);
            }
        }
        None
    }
}

/// Replays one request on `key`'s cache, emitting its events (invariants 1 and 2).
fn replay(key: WorkerKey, blocks: &[ReqBlock], lru: &mut Lru, cap: usize, out: &mut PhaseBuilder) {
    let cached: Vec<bool> = blocks
        .iter()
        .map(|b| lru.contains(b.stored.engine_hash))
        .collect();
    for (b, _) in blocks.iter().zip(&cached).rev().filter(|(_, c)| **c) {
        lru.touch(b.stored.engine_hash);
    }
    let new = cached.iter().filter(|c| !**c).count();
    let mut evicted = Vec::new();
    while lru.len() + new > cap {
        match lru.pop_oldest() {
            Some(h) => evicted.push(h),
            None => break,
        }
    }
    out.push(key, KvEvent::Removed { blocks: evicted });
    let mut i = 0;
    while i < blocks.len() {
        if cached.get(i).copied().unwrap_or(true) {
            i += 1;
            continue;
        }
        let start = i;
        while i < blocks.len() && !cached.get(i).copied().unwrap_or(true) {
            i += 1;
        }
        let parent = start
            .checked_sub(1)
            .and_then(|p| blocks.get(p))
            .map(|b| b.stored.engine_hash);
        let run = blocks.get(start..i).unwrap_or(&[]);
        out.push(
            key,
            KvEvent::Stored {
                parent,
                blocks: run.iter().map(|b| b.stored).collect(),
            },
        );
    }
    for b in blocks.iter().rev() {
        lru.touch(b.stored.engine_hash);
    }
}

/// The plan of a validated trace spec.
pub(crate) fn plan(spec: WorkloadSpec) -> Result<Plan> {
    let Some(ts) = spec.trace.clone() else {
        bail!("--workload trace needs --trace FILE");
    };
    let records = load_trace(&ts.path)?;
    plan_records(spec, &records)
}

/// The plan of a trace already loaded (tests use inline traces).
pub fn plan_records(spec: WorkloadSpec, records: &[TraceRecord]) -> Result<Plan> {
    if !TRACE_BLOCK_TOKENS.is_multiple_of(spec.block_size) {
        bail!(
            "--block-size {} must divide the trace's {TRACE_BLOCK_TOKENS}-token blocks",
            spec.block_size
        );
    }
    let (assign, capacity) = spec
        .trace
        .as_ref()
        .map_or((TraceAssign::RoundRobin, None), |t| (t.assign, t.capacity));
    let cap = capacity.unwrap_or(spec.size / spec.workers as usize);
    if cap == 0 {
        bail!(
            "trace cache capacity is 0 blocks per worker: raise --size ({}) or --trace-capacity",
            spec.size
        );
    }
    let w = spec.workers;
    let mut ex = Expander::new(spec.block_size);
    let mut caches: Vec<Lru> = (0..w).map(|_| Lru::default()).collect();
    let n = records.len();
    let (a, b) = (n / 3, 2 * n / 3);
    let worker_of = |i: usize, r: &TraceRecord| -> u64 {
        match assign {
            TraceAssign::RoundRobin => i as u64 % w,
            TraceAssign::FirstId => r.hash_ids.first().map_or(0, |&id| mix64(id) % w),
        }
    };

    let mut phases = Vec::with_capacity(3);
    let mut build_pool: Vec<(u64, Query)> = Vec::new();
    let mut entries_after_build = 0;
    let mut mixed_pool: Vec<Query> = Vec::new();
    for (lo, hi) in [(0, a), (a, b), (b, n)] {
        let mut out = PhaseBuilder::new(spec.producers);
        for (i, r) in records.iter().enumerate().take(hi).skip(lo) {
            let worker = worker_of(i, r);
            let blocks = ex.request(&r.hash_ids, cap);
            let seqs: Query = blocks.iter().map(|b| b.seq).collect();
            if lo == 0 {
                build_pool.push((worker, seqs));
            } else if lo == b {
                mixed_pool.push(seqs);
            }
            if let Some(lru) = caches.get_mut(worker as usize) {
                replay(WorkerKey::new(worker, 0), &blocks, lru, cap, &mut out);
            }
        }
        phases.push(out.finish());
        if lo == 0 {
            entries_after_build = caches.iter().map(|c| c.len() as u64).sum();
            // Hit candidates: build requests still fully cached on their worker.
            build_pool.retain(|(worker, seqs)| {
                caches.get(*worker as usize).is_some_and(|c| {
                    !seqs.is_empty() && seqs.iter().all(|&s| c.contains(engine_hash_of(s)))
                })
            });
        }
    }

    let mut remove = PhaseBuilder::new(spec.producers);
    let mut drained: Vec<Vec<EngineHash>> = caches
        .iter_mut()
        .map(|c| std::iter::from_fn(|| c.pop_oldest()).collect())
        .collect();
    let mut offset = 0;
    while drained.iter().any(|d| offset < d.len()) {
        for (worker, d) in drained.iter_mut().enumerate() {
            let end = (offset + TEARDOWN_CHUNK).min(d.len());
            if offset < end {
                let blocks = d.get(offset..end).unwrap_or(&[]).to_vec();
                remove.push(
                    WorkerKey::new(worker as u64, 0),
                    KvEvent::Removed { blocks },
                );
            }
        }
        offset += TEARDOWN_CHUNK;
    }
    drained.clear();

    let mut rng = Rng::new(spec.seed ^ 0x7472_6163_6571_7321);
    let hit_queries: Vec<CheckedQuery> = if build_pool.is_empty() {
        Vec::new()
    } else {
        (0..spec.queries)
            .map(|_| {
                let (_, seqs) = &build_pool[rng.below(build_pool.len())];
                CheckedQuery {
                    seqs: Arc::clone(seqs),
                    expect_best: seqs.len() as u32,
                }
            })
            .collect()
    };
    let prefix_pool: Vec<CheckedQuery> = if build_pool.is_empty() {
        Vec::new()
    } else {
        (0..spec.queries.min(PREFIX_QUERY_POOL))
            .map(|_| {
                let (_, full) = &build_pool[rng.below(build_pool.len())];
                let keep = (full.len() / 2).max(1);
                let mut seqs = full.get(..keep).unwrap_or(&[]).to_vec();
                random_continuation(&mut rng, seqs.last().copied(), full.len() - keep, &mut seqs);
                CheckedQuery {
                    seqs: Arc::from(seqs),
                    expect_best: keep as u32,
                }
            })
            .collect()
    };
    let prefix_queries = if prefix_pool.is_empty() {
        Vec::new()
    } else {
        (0..spec.queries)
            .map(|_| prefix_pool[rng.below(prefix_pool.len())].clone())
            .collect()
    };
    let mixed_queries = deal_queries(&mut rng, &mixed_pool, spec.query_threads, spec.queries);

    let mut it = phases.into_iter();
    let (build, store, mixed) = (
        it.next().unwrap_or_default(),
        it.next().unwrap_or_default(),
        it.next().unwrap_or_default(),
    );
    let shape = PlanShape {
        sequences: n as u64,
        prefix_blocks: 0,
        entries_after_build,
        trace_requests: Some(n as u64),
        trace_capacity: Some(cap as u64),
    };
    Ok(Plan {
        spec,
        shape,
        build,
        store,
        mixed: MixedPhases {
            out: mixed,
            back: None,
        },
        remove: remove.finish(),
        hit_queries,
        prefix_queries,
        mixed_queries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::kv_index::KvIndex;

    const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [0, 1]}

{"timestamp": 40, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}
{"timestamp": 41, "input_length": 512, "output_length": 3, "hash_ids": [5], "extra": true}
{"timestamp": 42, "input_length": 700, "output_length": 3, "hash_ids": [0, 7]}
{"timestamp": 43, "input_length": 900, "output_length": 3, "hash_ids": [5, 6]}
{"timestamp": 44, "input_length": 900, "output_length": 3, "hash_ids": [0, 1, 2, 3]}"#;

    #[test]
    fn parses_records_skips_blank_lines_and_names_bad_lines() {
        let r = parse_trace(TRACE).unwrap();
        assert_eq!(r.len(), 6);
        assert_eq!(r[1].hash_ids, vec![0, 1, 2]);
        assert_eq!(r[2].timestamp_ms, 41);
        let err = parse_trace("{\"hash_ids\": [1]}\nnot json\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }

    #[test]
    fn expansion_shares_prefixes_and_is_block_size_independent_in_tokens() {
        let mut ex = Expander::new(16);
        let a = ex.request(&[0, 1], usize::MAX);
        let b = ex.request(&[0, 1, 2], usize::MAX);
        assert_eq!(a.len(), 64);
        assert_eq!(b.len(), 96);
        assert!(a.iter().zip(&b).all(|(x, y)| x.seq == y.seq));
        assert_eq!(ex.request(&[0, 1, 2], 40).len(), 40);
        // At block size 512 the one block's tokens are the same 512 tokens.
        let mut big = Expander::new(512);
        assert_eq!(big.request(&[0], usize::MAX).len(), 1);
    }

    fn spec(workers: u64, capacity: usize) -> WorkloadSpec {
        WorkloadSpec {
            kind: super::super::spec::WorkloadKind::Trace,
            workers,
            queries: 50,
            trace: Some(super::super::spec::TraceSpec {
                path: "inline".into(),
                assign: TraceAssign::RoundRobin,
                capacity: Some(capacity),
            }),
            ..WorkloadSpec::default()
        }
    }

    #[test]
    fn replay_evicts_for_real_and_remove_empties_the_index() {
        let records = parse_trace(TRACE).unwrap();
        // Two workers of 80 blocks: requests of 64..128 blocks force evictions.
        let plan = plan_records(spec(2, 80), &records).unwrap();
        let removed: u64 = [&plan.build, &plan.store, &plan.mixed.out]
            .iter()
            .map(|p| p.removed_blocks)
            .sum();
        assert!(removed > 0, "capacity-bounded caches must evict");
        let mut ix = KvIndex::new();
        for (i, phase) in plan.phases_in_order().enumerate() {
            for (key, ev) in phase.iter() {
                let a = ix.apply(*key, ev).unwrap();
                assert_eq!(a.unknown, 0, "phase {i}: a removal of an unheld block");
            }
            if i == 0 {
                assert_eq!(ix.stats().index.entries, plan.shape.entries_after_build);
                for q in plan.hit_queries.iter().chain(&plan.prefix_queries) {
                    assert_eq!(ix.find_matches(&q.seqs).best(), q.expect_best);
                }
            }
        }
        assert_eq!(ix.stats().index.entries, 0);
        assert_eq!(ix.rejects().total(), 0);
    }

    #[test]
    fn bad_block_size_and_zero_capacity_are_refused() {
        let records = parse_trace(TRACE).unwrap();
        let mut s = spec(2, 80);
        s.block_size = 24;
        assert!(plan_records(s, &records).is_err());
        assert!(plan_records(spec(2, 0), &records).is_err());
    }
}
