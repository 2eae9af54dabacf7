//! The Mooncake trace replay ([`super::trace`]) as an anchor plan, so the anchor harness,
//! the exported format and the released indexers' adapters can run it like W1-W4:
//! `kvengine bench indexer --workload trace --trace FILE --export DIR` writes `DIR/trace`.
//!
//! * Phases: `base` is the trace plan's build and store phases, `extra` its mixed rounds
//!   (stores and evictions), `remove` its teardown; each one stream, the producer streams
//!   concatenated (they share no worker, so this is a valid order).
//! * Engine hashes become seq_hashes: each stored block's engine hash is replaced by its
//!   seq_hash (chained from its parent's, per worker), and each removal's by the seq_hash
//!   its worker stored it under. The anchor adapters that key Dynamo's trees by seq_hash
//!   need this (`anchors/src/dynamo.rs`, "Mapping"); any indexer keyed by engine hash sees
//!   the same events under other names.
//! * Hit queries: the trace plan's (requests fully cached after its build phase) that some
//!   worker still holds after `base`, with their tokens hashes from the stored blocks. Prefix-only queries: the first half of a
//!   hit query's blocks plus as many fresh blocks (random tokens hashes), which nobody
//!   holds.
//! * Answers: what the single-threaded exact index (`KvIndex`) returns for each query after
//!   `base`, and `entries_after_base` its live entries then.
//!
//! # Invariants
//! 1. Applied in order (base, extra, remove) to an empty index, no event is refused and the
//!    index ends empty (the trace plan's invariant 1, unchanged by the renaming, which is
//!    one to one per worker).
//! 2. The plan is a pure function of the spec and the trace file.

use super::Plan;
use super::anchor::{AnchorPlan, AnchorShape, AnchorSpec, AnswerTable};
use super::phase::{Phase, PhaseBuilder};
use super::query::Query;
use super::rng::Rng;
use super::spec::{WorkloadKind, WorkloadSpec};
use anyhow::{Result, bail};
use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::kv_index::KvIndex;
use engine::{EngineHash, SeqHash, TokensHash, WorkerKey};
use std::collections::HashMap;
use std::sync::Arc;

/// Renames a trace's engine hashes to seq_hashes, worker by worker.
#[derive(Default)]
struct Renamer {
    /// (worker key, engine hash) -> seq_hash, while stored.
    live: HashMap<(WorkerKey, EngineHash), SeqHash>,
    /// Every stored block's tokens hash, by seq_hash.
    tokens: HashMap<SeqHash, TokensHash>,
}

impl Renamer {
    fn event(&mut self, key: WorkerKey, ev: &KvEvent) -> Result<KvEvent> {
        Ok(match ev {
            KvEvent::Stored { parent, blocks } => {
                let parent_seq = match parent {
                    None => None,
                    Some(p) => match self.live.get(&(key, *p)) {
                        Some(&s) => Some(s),
                        None => bail!("trace: a store's parent is not stored on its worker"),
                    },
                };
                let mut prev = parent_seq;
                let mut out = Vec::with_capacity(blocks.len());
                for b in blocks {
                    let s = seq_hash(prev, b.tokens_hash);
                    self.live.insert((key, b.engine_hash), s);
                    self.tokens.insert(s, b.tokens_hash);
                    out.push(StoredBlock {
                        engine_hash: EngineHash(s.0),
                        tokens_hash: b.tokens_hash,
                    });
                    prev = Some(s);
                }
                KvEvent::Stored {
                    parent: parent_seq.map(|s| EngineHash(s.0)),
                    blocks: out,
                }
            }
            KvEvent::Removed { blocks } => {
                let mut out = Vec::with_capacity(blocks.len());
                for b in blocks {
                    match self.live.remove(&(key, *b)) {
                        Some(s) => out.push(EngineHash(s.0)),
                        None => bail!("trace: a removal names a block its worker does not hold"),
                    }
                }
                KvEvent::Removed { blocks: out }
            }
            KvEvent::Cleared => {
                self.live.retain(|(k, _), _| *k != key);
                KvEvent::Cleared
            }
        })
    }

    /// `phases`, renamed, as one stream.
    fn phase<'a>(&mut self, phases: impl IntoIterator<Item = &'a Phase>) -> Result<Phase> {
        let mut b = PhaseBuilder::new(1);
        for p in phases {
            for (key, ev) in p.iter() {
                b.push(*key, self.event(*key, ev)?);
            }
        }
        Ok(b.finish())
    }
}

/// The anchor plan of the trace workload `spec` (module docs).
pub fn anchor_plan(spec: &WorkloadSpec) -> Result<AnchorPlan> {
    let spec = WorkloadSpec {
        kind: WorkloadKind::Trace,
        ..spec.clone()
    };
    let plan = Plan::generate(&spec)?;
    let mut r = Renamer::default();
    let base = r.phase([&plan.build, &plan.store])?;
    let extra = r.phase(std::iter::once(&plan.mixed.out).chain(plan.mixed.back.as_ref()))?;
    let remove = r.phase([&plan.remove])?;
    if !r.live.is_empty() {
        bail!("trace: {} blocks left after the teardown", r.live.len());
    }

    let tokens_of = |q: &[SeqHash]| -> Option<Arc<[TokensHash]>> {
        q.iter().map(|s| r.tokens.get(s).copied()).collect()
    };
    let (mut hit_queries, mut hit_tokens) = (Vec::new(), Vec::new());
    for q in &plan.hit_queries {
        if let Some(t) = tokens_of(&q.seqs) {
            hit_queries.push(Arc::clone(&q.seqs));
            hit_tokens.push(t);
        }
    }
    if hit_queries.is_empty() {
        bail!("trace: no request stays fully cached through the build phase; raise --size");
    }
    let mut rng = Rng::new(spec.seed ^ 0x7072_6566_6978_6573);
    let (mut prefix_queries, mut prefix_tokens) = (Vec::new(), Vec::new());
    for _ in 0..spec.queries {
        let i = rng.below(hit_tokens.len());
        let (Some(seqs), Some(toks)) = (hit_queries.get(i), hit_tokens.get(i)) else {
            continue;
        };
        let keep = seqs.len().div_ceil(2);
        let mut s: Vec<SeqHash> = seqs.iter().take(keep).copied().collect();
        let mut t: Vec<TokensHash> = toks.iter().take(keep).copied().collect();
        for _ in keep..seqs.len().max(keep + 1) {
            let fresh = TokensHash(rng.next_u64());
            s.push(seq_hash(s.last().copied(), fresh));
            t.push(fresh);
        }
        prefix_queries.push(Query::from(s));
        prefix_tokens.push(Arc::from(t));
    }

    // The answers: the exact single-threaded index after `base`.
    let mut ix = KvIndex::new();
    for (key, ev) in base.iter() {
        if ix.apply(*key, ev).is_err() {
            bail!("trace: the exact index refused a base event");
        }
    }
    let entries_after_base = ix.stats().index.entries;
    let mut table = AnswerTable::default();
    let mut answer = |q: &[SeqHash]| -> u64 {
        let mut a = ix.find_matches(q).overlaps;
        a.sort_unstable_by_key(|p| p.0);
        table.id(a)
    };
    let hit_answers: Vec<u64> = hit_queries.iter().map(|q| answer(q)).collect();
    let prefix_answers = prefix_queries.iter().map(|q| answer(q)).collect();
    let answers = table.answers;
    // A hit query whose request the store phase evicted everywhere is no hit: dropped.
    let empty = answers.iter().position(Vec::is_empty).map(|i| i as u64);
    let keep: Vec<bool> = hit_answers.iter().map(|&a| Some(a) != empty).collect();
    let (hit_queries, hit_tokens, hit_answers) = (
        kept(hit_queries, &keep),
        kept(hit_tokens, &keep),
        kept(hit_answers, &keep),
    );
    if hit_queries.is_empty() {
        bail!("trace: no request stays cached through the base phase; raise --size");
    }

    let depth = hit_queries.iter().map(|q| q.len()).max().unwrap_or(0);
    Ok(AnchorPlan {
        spec: AnchorSpec {
            kind: WorkloadKind::Trace,
            workers: spec.workers,
            depth,
            size: spec.size,
            prefix_ratio: 0.0,
            groups: 0,
            seed: spec.seed,
            queries: spec.queries,
        },
        shape: AnchorShape {
            base_sequences: plan.shape.trace_requests.unwrap_or(0),
            extra_sequences: 0,
            prefix_blocks: 0,
            base_pairs: 0,
            all_pairs: 0,
            entries_after_base,
        },
        groups: Vec::new(),
        base,
        extra,
        remove,
        hit_queries,
        hit_sequences: Vec::new(),
        prefix_queries,
        prefix_groups: Vec::new(),
        holders: Vec::new(),
        hit_tokens,
        prefix_tokens,
        answers,
        hit_answers,
        prefix_answers,
    })
}

/// The items of `v` whose `keep` is true.
fn kept<T>(v: Vec<T>, keep: &[bool]) -> Vec<T> {
    v.into_iter()
        .zip(keep)
        .filter_map(|(x, &k)| k.then_some(x))
        .collect()
}
