//! Dynamo's indexer-benchmark workloads: `uniform`, `dynamo` and `shared-prefix`.
//!
//! `S = size / depth` base sequences of `depth` blocks. Sequence `k` belongs to worker
//! `k mod W` and prefix group `k mod G`; its first `P = round(depth * prefix_ratio)` blocks
//! are its group's common prompt, the other `T = depth - P` its own tail. Tokens are
//! synthetic (a function of the seed, the group or sequence, and the block) and hashed
//! with the real `tokens_hash` while generating, so events carry precomputed hashes.
//!
//! A worker stores each common prompt once (`Stored { parent: None }`), the first time one
//! of its sequences needs it; every sequence then sends only its tail, linked to the
//! prompt's last engine hash. Events go round-robin across workers because sequences are
//! emitted in `k` order.
//!
//! Besides the `S` base sequences (B) there are `X = S / 2` churn sequences C (`k` in
//! `S..S+X`) and X more, D (`k` in `S+X..S+2X`):
//!
//! | phase | events | live afterwards |
//! |---|---|---|
//! | build | store B (prompts on first use) | B |
//! | store | store C's tails; store the prompts C and D need that B lacks | B ∪ C |
//! | mixed, out | per j: store D\[j\]'s tail, remove C\[j\]'s tail | B ∪ D |
//! | mixed, back | per j: store C\[j\]'s tail, remove D\[j\]'s tail | B ∪ C |
//! | remove | remove every live tail, then every live prompt once | nothing |
//!
//! Hit queries ask for random base sequences (all `depth` blocks live, during the mixed
//! phase too); prefix-only queries ask for a group's prompt followed by a random
//! continuation nobody stores.
//!
//! # Invariants
//! 1. Live (block, worker) entries after build are `S * T + pairs * P`, where `pairs` is
//!    the number of distinct (worker, group) pairs among the base sequences; the sequences
//!    describe `S * depth` pairs, `size` rounded down to a multiple of `depth`.
//! 2. Every (worker, group) prompt is stored exactly once and removed exactly once.
//! 3. Mixed rounds run in pairs (out, back), which leave the live set as they found it.

use super::phase::PhaseBuilder;
use super::plan::{MixedPhases, Plan, PlanShape};
use super::query::{CheckedQuery, Query, deal_queries, random_continuation};
use super::rng::{Rng, block_tokens, engine_hash_of};
use super::spec::WorkloadSpec;
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, seq_hash, tokens_hash};
use engine::{EngineHash, SeqHash, WorkerKey};
use std::collections::HashSet;
use std::sync::Arc;

/// Distinct prefix-only queries generated (sampled with repetition up to `--queries`).
const PREFIX_QUERY_POOL: usize = 4096;

/// Domain tags, so prompt and tail tokens never coincide.
const PROMPT_TAG: u64 = 1;
const TAIL_TAG: u64 = 2;

/// One group's common prompt.
struct Prompt {
    blocks: Vec<StoredBlock>,
    seqs: Vec<SeqHash>,
}

/// One sequence's private part.
struct Sequence {
    key: WorkerKey,
    group: u64,
    tail: Vec<StoredBlock>,
}

struct Gen {
    spec: WorkloadSpec,
    prefix: usize,
    prompts: Vec<Prompt>,
    tokens: Vec<u32>,
}

impl Gen {
    fn block(&mut self, words: &[u64], parent: Option<SeqHash>) -> (StoredBlock, SeqHash) {
        block_tokens(&mut self.tokens, self.spec.block_size, words);
        let th = tokens_hash(&self.tokens, BASE_SEED);
        let seq = seq_hash(parent, th);
        (
            StoredBlock {
                engine_hash: engine_hash_of(seq),
                tokens_hash: th,
            },
            seq,
        )
    }

    fn prompt(&mut self, group: u64) -> Prompt {
        let mut prev = None;
        let mut blocks = Vec::with_capacity(self.prefix);
        let mut seqs = Vec::with_capacity(self.prefix);
        for j in 0..self.prefix as u64 {
            let (b, s) = self.block(&[self.spec.seed, PROMPT_TAG, group, j], prev);
            blocks.push(b);
            seqs.push(s);
            prev = Some(s);
        }
        Prompt { blocks, seqs }
    }

    /// Sequence `k`, and (if `keep_seqs`) all its seq_hashes.
    fn sequence(&mut self, k: u64, keep_seqs: bool) -> (Sequence, Option<Query>) {
        let w = self.spec.workers;
        let group = k % self.spec.prefix_groups;
        let g = group as usize;
        let mut seqs = Vec::with_capacity(if keep_seqs { self.spec.depth } else { 0 });
        let mut prev = None;
        if let Some(p) = self.prompts.get(g) {
            prev = p.seqs.last().copied();
            if keep_seqs {
                seqs.extend_from_slice(&p.seqs);
            }
        }
        let tail_len = self.spec.depth - self.prefix;
        let mut tail = Vec::with_capacity(tail_len);
        for j in 0..tail_len as u64 {
            let (b, s) = self.block(&[self.spec.seed, TAIL_TAG, k, j], prev);
            tail.push(b);
            if keep_seqs {
                seqs.push(s);
            }
            prev = Some(s);
        }
        let seq = Sequence {
            key: WorkerKey::new(k % w, 0),
            group,
            tail,
        };
        (seq, keep_seqs.then(|| Arc::from(seqs)))
    }

    fn prompt_parent(&self, group: u64) -> Option<EngineHash> {
        self.prompts
            .get(group as usize)
            .and_then(|p| p.blocks.last())
            .map(|b| b.engine_hash)
    }
}

/// Live prompts: (worker, group) pairs, in the order they were stored.
#[derive(Default)]
struct LivePrompts {
    set: HashSet<(WorkerKey, u64)>,
    order: Vec<(WorkerKey, u64)>,
}

impl LivePrompts {
    /// Emits the prompt store for `seq`'s pair if it is not live yet.
    fn ensure(&mut self, g: &Gen, seq: &Sequence, out: &mut PhaseBuilder) {
        if g.prefix == 0 || !self.set.insert((seq.key, seq.group)) {
            return;
        }
        self.order.push((seq.key, seq.group));
        if let Some(p) = g.prompts.get(seq.group as usize) {
            out.push(
                seq.key,
                KvEvent::Stored {
                    parent: None,
                    blocks: p.blocks.clone(),
                },
            );
        }
    }
}

fn store_tail(g: &Gen, seq: &Sequence, out: &mut PhaseBuilder) {
    out.push(
        seq.key,
        KvEvent::Stored {
            parent: g.prompt_parent(seq.group),
            blocks: seq.tail.clone(),
        },
    );
}

fn remove_tail(seq: &Sequence, out: &mut PhaseBuilder) {
    out.push(
        seq.key,
        KvEvent::Removed {
            blocks: seq.tail.iter().map(|b| b.engine_hash).collect(),
        },
    );
}

/// The plan of a validated synthetic spec.
pub(crate) fn plan(spec: WorkloadSpec) -> Plan {
    let s = spec.size / spec.depth;
    let x = s / 2;
    let total = s + 2 * x;
    let producers = spec.producers;
    let mut g = Gen {
        prefix: spec.prefix_blocks(),
        prompts: Vec::new(),
        tokens: Vec::with_capacity(spec.block_size),
        spec,
    };
    if g.prefix > 0 {
        let used_groups = g.spec.prefix_groups.min(total as u64);
        g.prompts = (0..used_groups).map(|grp| g.prompt(grp)).collect();
    }

    let mut base = Vec::with_capacity(s);
    let mut base_seqs = Vec::with_capacity(s);
    for k in 0..s as u64 {
        let (seq, seqs) = g.sequence(k, true);
        base.push(seq);
        base_seqs.extend(seqs);
    }
    let churn_c: Vec<Sequence> = (s..s + x).map(|k| g.sequence(k as u64, false).0).collect();
    let churn_d: Vec<Sequence> = (s + x..total)
        .map(|k| g.sequence(k as u64, false).0)
        .collect();

    let mut live = LivePrompts::default();
    let mut build = PhaseBuilder::new(producers);
    for seq in &base {
        live.ensure(&g, seq, &mut build);
        store_tail(&g, seq, &mut build);
    }
    let pairs_after_build = live.order.len() as u64;
    let mut store = PhaseBuilder::new(producers);
    for seq in &churn_c {
        live.ensure(&g, seq, &mut store);
        store_tail(&g, seq, &mut store);
    }
    for seq in &churn_d {
        live.ensure(&g, seq, &mut store);
    }
    let mut out = PhaseBuilder::new(producers);
    let mut back = PhaseBuilder::new(producers);
    for (c, d) in churn_c.iter().zip(&churn_d) {
        store_tail(&g, d, &mut out);
        remove_tail(c, &mut out);
        store_tail(&g, c, &mut back);
        remove_tail(d, &mut back);
    }
    let mut remove = PhaseBuilder::new(producers);
    for seq in base.iter().chain(&churn_c) {
        remove_tail(seq, &mut remove);
    }
    for &(key, group) in &live.order {
        if let Some(p) = g.prompts.get(group as usize) {
            remove.push(
                key,
                KvEvent::Removed {
                    blocks: p.blocks.iter().map(|b| b.engine_hash).collect(),
                },
            );
        }
    }

    let mut rng = Rng::new(g.spec.seed ^ 0x7175_6572_6965_7321);
    let depth = g.spec.depth as u32;
    let hit_queries = if base_seqs.is_empty() {
        Vec::new()
    } else {
        (0..g.spec.queries)
            .map(|_| CheckedQuery {
                seqs: Arc::clone(&base_seqs[rng.below(base_seqs.len())]),
                expect_best: depth,
            })
            .collect()
    };
    let prefix_queries = prefix_queries(&g, &mut rng, s);
    let mixed_queries = deal_queries(&mut rng, &base_seqs, g.spec.query_threads, g.spec.queries);

    let tail_len = (g.spec.depth - g.prefix) as u64;
    let shape = PlanShape {
        sequences: s as u64,
        prefix_blocks: g.prefix as u64,
        entries_after_build: s as u64 * tail_len + pairs_after_build * g.prefix as u64,
        trace_requests: None,
        trace_capacity: None,
    };
    let back = back.finish();
    Plan {
        spec: g.spec,
        shape,
        build: build.finish(),
        store: store.finish(),
        mixed: MixedPhases {
            out: out.finish(),
            back: (back.events > 0).then_some(back),
        },
        remove: remove.finish(),
        hit_queries,
        prefix_queries,
        mixed_queries,
    }
}

/// A group's prompt (of a group the base sequences use) plus a random continuation to
/// `depth` blocks; the best overlap is the prompt's length.
fn prefix_queries(g: &Gen, rng: &mut Rng, base: usize) -> Vec<CheckedQuery> {
    let n = g.spec.queries;
    if n == 0 || base == 0 {
        return Vec::new();
    }
    let groups = (g.spec.prefix_groups as usize).min(base);
    let pool: Vec<Query> = (0..n.min(PREFIX_QUERY_POOL))
        .map(|_| {
            let mut seqs = Vec::with_capacity(g.spec.depth);
            if let Some(p) = g.prompts.get(rng.below(groups)) {
                seqs.extend_from_slice(&p.seqs);
            }
            let parent = seqs.last().copied();
            random_continuation(rng, parent, g.spec.depth - seqs.len(), &mut seqs);
            Arc::from(seqs)
        })
        .collect();
    (0..n)
        .map(|_| CheckedQuery {
            seqs: Arc::clone(&pool[rng.below(pool.len())]),
            expect_best: g.prefix as u32,
        })
        .collect()
}
