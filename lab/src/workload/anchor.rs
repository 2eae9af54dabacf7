//! The anchor-exact workloads `dynamo-w1` .. `dynamo-w4`: Dynamo's indexer benchmark as its
//! issue defines it, block ids and all, so figures can be compared with the anchor's.
//!
//! W workers, D blocks per sequence, S (worker, block) pairs, prefix ratio r, G groups,
//! seed 42 ([`AnchorSpec::of`] holds the four parameter sets). There are `N = S / D` base
//! sequences and `E = floor(N / 4)` extra ones; `P = round(r D)` blocks of each sequence
//! are its group's prefix, the other `T = D - P` its own tail.
//!
//! * Sequence `k` (base if `k < N`, extra otherwise) belongs to worker `k mod W`, dp rank
//!   0, and draws its group uniformly from `0..G` ([`Rng`] seeded with the seed, one draw
//!   per sequence in `k` order).
//! * Prefix block `i` of group `g` has id [`prefix_block_id`]`(g, i)`; tail blocks take ids
//!   from a counter starting at 1, in `k` order then block order, so sequence `k`'s tail
//!   block `j` is `1 + k T + j`.
//! * A block's tokens hash is `xxh3_64_with_seed(id.to_le_bytes(), 1337)`
//!   ([`block_tokens_hash`]); seq_hashes chain as DESIGN.md's `seq_hash`; a block's engine
//!   hash is its seq_hash.
//! * A worker stores each group's prefix once: its first sequence of group `g` is one
//!   `Stored { parent: None }` of all D blocks, later ones a tail-only store whose parent
//!   is the prefix's last engine hash. Extra sequences follow the same rule.
//!
//! Phases: `base` stores sequences `0..N` and `extra` stores `N..N+E` (both in `k` order,
//! which is round-robin over workers); `remove` removes every tail (one event per sequence,
//! in `k` order), then every (worker, group) prefix once, in the order they were stored.
//! Hit queries are random base sequences at full depth; prefix-only queries are the prefix
//! of a random base sequence's group followed by `T` fresh blocks (ids continuing the
//! counter after the last sequence), which nobody holds.
//!
//! # Invariants
//! 1. The plan is a pure function of the spec. Draws from the one [`Rng`], in order: the
//!    groups of sequences `0..N+E`, then the hit queries' sequences, then the prefix-only
//!    queries' sequences (each `below(N)`).
//! 2. Block ids never repeat (prefix ids carry the `0xD00D` tag above any counter value),
//!    so no worker holds a prefix-only query's fresh blocks.
//! 3. Applied in order (base, extra, remove) to an empty index, no event is refused and
//!    the index ends empty; after `base` it holds `N T + base_pairs P` entries, where
//!    `base_pairs` counts distinct (worker, group) pairs among base sequences.
//! 4. Everything is generated here, before any indexer exists (the harness measures
//!    memory from the indexer's creation on).

use super::phase::{Phase, PhaseBuilder};
use super::query::Query;
use super::rng::Rng;
use super::spec::{MAX_SIZE, WorkloadKind};
use anyhow::{Result, bail};
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, seq_hash};
use engine::{EngineHash, SeqHash, TokensHash, WorkerKey};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The anchor's seed.
pub const ANCHOR_SEED: u64 = 42;

/// Queries per query phase (hit, prefix-only) in the anchor.
pub const ANCHOR_QUERIES: usize = 20_000;

/// The tag of prefix block ids.
pub const PREFIX_ID_TAG: u64 = 0xD00D_0000_0000_0000;

/// Id of prefix block `i` of group `g`: `0xD00D_0000_0000_0000 | g << 32 | i`.
#[inline]
pub fn prefix_block_id(group: u64, i: u64) -> u64 {
    PREFIX_ID_TAG | group << 32 | i
}

/// A block's tokens hash: XXH3-64, seed 1337, over its id's 8 little-endian bytes.
#[inline]
pub fn block_tokens_hash(id: u64) -> TokensHash {
    TokensHash(xxh3_64_with_seed(&id.to_le_bytes(), BASE_SEED))
}

/// The parameters of one anchor workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AnchorSpec {
    /// Which anchor.
    #[serde(skip)]
    pub kind: WorkloadKind,
    /// W: workers (dp rank 0 each).
    #[serde(rename = "W")]
    pub workers: u64,
    /// D: blocks per sequence.
    #[serde(rename = "D")]
    pub depth: usize,
    /// S: (worker, block) pairs of the base sequences.
    #[serde(rename = "S")]
    pub size: usize,
    /// r: share of a sequence that is its group's prefix.
    #[serde(rename = "r")]
    pub prefix_ratio: f64,
    /// G: prefix groups.
    #[serde(rename = "G")]
    pub groups: u64,
    /// Seed of the group and query draws.
    pub seed: u64,
    /// Queries per query phase.
    pub queries: usize,
}

impl AnchorSpec {
    /// The anchor's parameters for `kind`; `None` for the other workloads.
    pub fn of(kind: WorkloadKind) -> Option<Self> {
        let w1 = Self {
            kind,
            workers: 128,
            depth: 128,
            size: 1 << 20,
            prefix_ratio: 0.25,
            groups: 4,
            seed: ANCHOR_SEED,
            queries: ANCHOR_QUERIES,
        };
        match kind {
            WorkloadKind::DynamoW1 => Some(w1),
            WorkloadKind::DynamoW2 => Some(Self { groups: 1, ..w1 }),
            WorkloadKind::DynamoW3 => Some(Self {
                workers: 64,
                depth: 512,
                size: 1 << 21,
                ..w1
            }),
            WorkloadKind::DynamoW4 => Some(Self {
                prefix_ratio: 0.75,
                groups: 1,
                ..w1
            }),
            _ => None,
        }
    }

    /// N: base sequences.
    pub fn base_sequences(&self) -> usize {
        self.size / self.depth.max(1)
    }

    /// E: extra sequences, `floor(0.25 N)`.
    pub fn extra_sequences(&self) -> usize {
        self.base_sequences() / 4
    }

    /// P: prefix blocks per sequence, `round(r D)`.
    pub fn prefix_blocks(&self) -> usize {
        ((self.depth as f64 * self.prefix_ratio).round() as usize).min(self.depth)
    }

    /// T: tail blocks per sequence.
    pub fn tail_blocks(&self) -> usize {
        self.depth - self.prefix_blocks()
    }

    /// Refuses parameters the definition cannot run, naming the flag that sets them.
    pub fn validate(&self) -> Result<()> {
        if self.size < self.depth || self.size > MAX_SIZE {
            bail!(
                "--anchor-size must be within {}..={MAX_SIZE} for {} (got {})",
                self.depth,
                self.kind.name(),
                self.size
            );
        }
        if self.queries == 0 || self.queries > 1 << 26 {
            bail!(
                "--anchor-queries must be within 1..={} (got {})",
                1 << 26,
                self.queries
            );
        }
        let p = self.prefix_blocks();
        if self.workers == 0 || self.groups == 0 || p == 0 || p >= self.depth {
            bail!("{}: W, G, P and D - P must be positive", self.kind.name());
        }
        Ok(())
    }
}

/// Sizes of a generated anchor workload.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnchorShape {
    /// N.
    #[serde(rename = "N")]
    pub base_sequences: u64,
    /// E.
    #[serde(rename = "E")]
    pub extra_sequences: u64,
    /// P.
    #[serde(rename = "P")]
    pub prefix_blocks: u64,
    /// Distinct (worker, group) pairs among base sequences.
    pub base_pairs: u64,
    /// Distinct (worker, group) pairs among all sequences.
    pub all_pairs: u64,
    /// Live (block, worker) entries after the base phase (invariant 3).
    pub entries_after_base: u64,
}

/// A whole anchor run's events and queries, generated before any indexer exists.
#[derive(Debug)]
pub struct AnchorPlan {
    /// The spec.
    pub spec: AnchorSpec,
    /// Sizes.
    pub shape: AnchorShape,
    /// Group of every sequence `0..N+E`.
    pub groups: Vec<u64>,
    /// Phase 1: the base sequences' stores (one stream).
    pub base: Phase,
    /// Phase 4: the extra sequences' stores (one stream).
    pub extra: Phase,
    /// Phase 5: every tail, then every prefix once (one stream).
    pub remove: Phase,
    /// Hit queries: full-depth seq_hashes of base sequences.
    pub hit_queries: Vec<Query>,
    /// The base sequence each hit query asks for.
    pub hit_sequences: Vec<u64>,
    /// Prefix-only queries: a group's prefix plus `T` fresh blocks.
    pub prefix_queries: Vec<Query>,
    /// The group each prefix-only query asks for.
    pub prefix_groups: Vec<u64>,
    /// Per group, the worker keys holding its prefix after the base phase, sorted.
    pub holders: Vec<Vec<WorkerKey>>,
    /// The tokens hashes of each hit query's blocks (`hit_queries[i]` chains them from
    /// the root), for indexers keyed by them and for the exported format.
    pub hit_tokens: Vec<Arc<[TokensHash]>>,
    /// The tokens hashes of each prefix-only query's blocks.
    pub prefix_tokens: Vec<Arc<[TokensHash]>>,
    /// The distinct answers the queries must get on the built index.
    pub answers: Vec<Expected>,
    /// Hit query `i` must get `answers[hit_answers[i]]`.
    pub hit_answers: Vec<u64>,
    /// Prefix-only query `i` must get `answers[prefix_answers[i]]`.
    pub prefix_answers: Vec<u64>,
}

/// An answer as the checks compare it: (worker key, overlap), sorted by key.
pub type Expected = Vec<(WorkerKey, u32)>;

/// Prefix chains, one per group.
struct Prefixes {
    blocks: Vec<Vec<StoredBlock>>,
    seqs: Vec<Vec<SeqHash>>,
}

/// The tokens hashes of blocks.
fn tokens_of(blocks: &[StoredBlock]) -> impl Iterator<Item = TokensHash> + '_ {
    blocks.iter().map(|b| b.tokens_hash)
}

impl Prefixes {
    fn new(groups: u64, p: usize) -> Self {
        let (mut blocks, mut seqs) = (Vec::new(), Vec::new());
        for g in 0..groups {
            let (b, s) = chain(None, (0..p as u64).map(|i| prefix_block_id(g, i)));
            blocks.push(b);
            seqs.push(s);
        }
        Self { blocks, seqs }
    }

    fn last(&self, g: u64) -> Option<SeqHash> {
        self.seqs.get(g as usize).and_then(|s| s.last().copied())
    }
}

/// Blocks of `ids` chained after `parent`, and their seq_hashes.
fn chain(
    parent: Option<SeqHash>,
    ids: impl Iterator<Item = u64>,
) -> (Vec<StoredBlock>, Vec<SeqHash>) {
    let (mut blocks, mut seqs) = (Vec::new(), Vec::new());
    let mut prev = parent;
    for id in ids {
        let tokens_hash = block_tokens_hash(id);
        let s = seq_hash(prev, tokens_hash);
        blocks.push(StoredBlock {
            engine_hash: EngineHash(s.0),
            tokens_hash,
        });
        seqs.push(s);
        prev = Some(s);
    }
    (blocks, seqs)
}

/// The events of every sequence, built in `k` order.
struct Events {
    base: PhaseBuilder,
    extra: PhaseBuilder,
    remove: PhaseBuilder,
    /// (worker, group) pairs whose prefix is stored, and in which order.
    stored: HashSet<(WorkerKey, u64)>,
    order: Vec<(WorkerKey, u64)>,
    /// Per group, the keys holding its prefix after the base phase.
    holders: Vec<Vec<WorkerKey>>,
    /// Base sequences some hit query asks for.
    wanted: Vec<bool>,
    /// Full seq_hashes and tokens hashes of the wanted base sequences, once generated.
    full: Vec<Option<(Query, Arc<[TokensHash]>)>>,
}

impl Events {
    fn new(groups: u64, hit_sequences: &[u64], n: usize) -> Self {
        let mut wanted = vec![false; n];
        for &k in hit_sequences {
            if let Some(w) = wanted.get_mut(k as usize) {
                *w = true;
            }
        }
        Self {
            base: PhaseBuilder::new(1),
            extra: PhaseBuilder::new(1),
            remove: PhaseBuilder::new(1),
            stored: HashSet::new(),
            order: Vec::new(),
            holders: vec![Vec::new(); groups as usize],
            wanted,
            full: vec![None; n],
        }
    }

    /// Sequence `k` of group `g`: its store (in full on its worker's first sequence of
    /// `g`) and its tail's removal.
    fn sequence(&mut self, spec: &AnchorSpec, prefixes: &Prefixes, k: usize, g: u64) {
        let (n, t) = (spec.base_sequences(), spec.tail_blocks() as u64);
        let key = WorkerKey::new(k as u64 % spec.workers, 0);
        let parent = prefixes.last(g);
        let first_id = 1 + k as u64 * t;
        let (tail, tail_seqs) = chain(parent, first_id..first_id + t);
        let blocks = tail.iter().map(|b| b.engine_hash).collect();
        self.remove.push(key, KvEvent::Removed { blocks });
        let pre = prefixes.seqs.get(g as usize).map_or(&[][..], Vec::as_slice);
        if let (Some(true), Some(slot)) = (self.wanted.get(k), self.full.get_mut(k)) {
            let pre_blocks = prefixes
                .blocks
                .get(g as usize)
                .map_or(&[][..], Vec::as_slice);
            let tokens: Arc<[TokensHash]> = tokens_of(pre_blocks).chain(tokens_of(&tail)).collect();
            *slot = Some((Arc::from([pre, &tail_seqs].concat()), tokens));
        }
        let event = if self.stored.insert((key, g)) {
            self.order.push((key, g));
            if k < n
                && let Some(h) = self.holders.get_mut(g as usize)
            {
                h.push(key);
            }
            let mut blocks = prefixes.blocks.get(g as usize).cloned().unwrap_or_default();
            blocks.extend(tail);
            KvEvent::Stored {
                parent: None,
                blocks,
            }
        } else {
            KvEvent::Stored {
                parent: parent.map(|s| EngineHash(s.0)),
                blocks: tail,
            }
        };
        if k < n {
            &mut self.base
        } else {
            &mut self.extra
        }
        .push(key, event);
    }

    /// Every (worker, group) prefix's removal, in the order they were stored.
    fn remove_prefixes(&mut self, prefixes: &Prefixes) {
        for &(key, g) in &self.order {
            let blocks = prefixes
                .blocks
                .get(g as usize)
                .map_or_else(Vec::new, |b| b.iter().map(|b| b.engine_hash).collect());
            self.remove.push(key, KvEvent::Removed { blocks });
        }
    }
}

/// Prefix-only queries: for each pick, its group's prefix plus `T` fresh blocks, with ids
/// from `fresh` on; returns the queries, their tokens hashes and their groups.
fn prefix_only(
    spec: &AnchorSpec,
    prefixes: &Prefixes,
    groups: &[u64],
    picks: &[usize],
    mut fresh: u64,
) -> (Vec<Query>, Vec<Arc<[TokensHash]>>, Vec<u64>) {
    let t = spec.tail_blocks() as u64;
    let (mut queries, mut tokens, mut asked) = (Vec::new(), Vec::new(), Vec::new());
    for &k in picks {
        let g = groups.get(k).copied().unwrap_or(0);
        let mut seqs = prefixes.seqs.get(g as usize).cloned().unwrap_or_default();
        let pre_blocks = prefixes
            .blocks
            .get(g as usize)
            .map_or(&[][..], Vec::as_slice);
        let (more_blocks, more) = chain(prefixes.last(g), fresh..fresh + t);
        fresh += t;
        seqs.extend(more);
        queries.push(Arc::from(seqs));
        tokens.push(
            tokens_of(pre_blocks)
                .chain(tokens_of(&more_blocks))
                .collect(),
        );
        asked.push(g);
    }
    (queries, tokens, asked)
}

/// Numbers each distinct answer once, in the order first asked for (the plan's `answers`).
#[derive(Default)]
pub(crate) struct AnswerTable {
    pub(crate) answers: Vec<Expected>,
    ids: std::collections::HashMap<Expected, u64>,
}

impl AnswerTable {
    /// The id of `answer`, numbering it if it is new.
    pub(crate) fn id(&mut self, answer: Expected) -> u64 {
        if let Some(&id) = self.ids.get(&answer) {
            return id;
        }
        let id = self.answers.len() as u64;
        self.answers.push(answer.clone());
        self.ids.insert(answer, id);
        id
    }
}

impl AnchorPlan {
    /// Generates the plan of `spec` (validated first).
    pub fn generate(spec: &AnchorSpec) -> Result<Self> {
        spec.validate()?;
        let (n, e) = (spec.base_sequences(), spec.extra_sequences());
        let (p, t) = (spec.prefix_blocks() as u64, spec.tail_blocks() as u64);
        let mut rng = Rng::new(spec.seed);
        let groups: Vec<u64> = (0..n + e)
            .map(|_| rng.below(spec.groups as usize) as u64)
            .collect();
        let hit_sequences: Vec<u64> = (0..spec.queries).map(|_| rng.below(n) as u64).collect();
        let prefix_picks: Vec<usize> = (0..spec.queries).map(|_| rng.below(n)).collect();

        let prefixes = Prefixes::new(spec.groups, p as usize);
        let mut ev = Events::new(spec.groups, &hit_sequences, n);
        for (k, &g) in groups.iter().enumerate() {
            ev.sequence(spec, &prefixes, k, g);
        }
        ev.remove_prefixes(&prefixes);
        for h in &mut ev.holders {
            h.sort_unstable();
        }
        let Some((hit_queries, hit_tokens)) = hit_sequences
            .iter()
            .map(|&k| ev.full.get(k as usize).cloned().flatten())
            .collect::<Option<(Vec<Query>, Vec<Arc<[TokensHash]>>)>>()
        else {
            bail!("a hit query's sequence was not generated");
        };
        let fresh = 1 + (n + e) as u64 * t;
        let (prefix_queries, prefix_tokens, prefix_groups) =
            prefix_only(spec, &prefixes, &groups, &prefix_picks, fresh);
        let base_pairs = ev.holders.iter().map(|h| h.len() as u64).sum::<u64>();
        let shape = AnchorShape {
            base_sequences: n as u64,
            extra_sequences: e as u64,
            prefix_blocks: p,
            base_pairs,
            all_pairs: ev.order.len() as u64,
            entries_after_base: n as u64 * t + base_pairs * p,
        };
        let mut plan = Self {
            spec: spec.clone(),
            shape,
            groups,
            base: ev.base.finish(),
            extra: ev.extra.finish(),
            remove: ev.remove.finish(),
            hit_queries,
            hit_sequences,
            prefix_queries,
            prefix_groups,
            holders: ev.holders,
            hit_tokens,
            prefix_tokens,
            answers: Vec::new(),
            hit_answers: Vec::new(),
            prefix_answers: Vec::new(),
        };
        let mut table = AnswerTable::default();
        plan.hit_answers = plan
            .hit_sequences
            .iter()
            .map(|&k| table.id(plan.expected_hit(k)))
            .collect();
        plan.prefix_answers = plan
            .prefix_groups
            .iter()
            .map(|&g| table.id(plan.expected_prefix(g)))
            .collect();
        plan.answers = table.answers;
        Ok(plan)
    }

    /// The answer `answers[id]` (none for an id out of range, which no query has).
    pub fn answer(&self, id: u64) -> Expected {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.answers.get(i))
            .cloned()
            .unwrap_or_default()
    }

    /// The worker key sequence `k` belongs to.
    pub fn owner(&self, k: u64) -> WorkerKey {
        WorkerKey::new(k % self.spec.workers, 0)
    }

    /// What a hit query for base sequence `k` must return on the built index, sorted by
    /// key: D on its owner, P on every other holder of its group's prefix.
    pub fn expected_hit(&self, k: u64) -> Vec<(WorkerKey, u32)> {
        let owner = self.owner(k);
        let g = self.groups.get(k as usize).copied().unwrap_or(0);
        let (d, p) = (self.spec.depth as u32, self.shape.prefix_blocks as u32);
        self.holders_of(g)
            .iter()
            .map(|&w| (w, if w == owner { d } else { p }))
            .collect()
    }

    /// What a prefix-only query for group `g` must return on the built index, sorted by
    /// key: P on every holder of the prefix.
    pub fn expected_prefix(&self, g: u64) -> Vec<(WorkerKey, u32)> {
        let p = self.shape.prefix_blocks as u32;
        self.holders_of(g).iter().map(|&w| (w, p)).collect()
    }

    fn holders_of(&self, g: u64) -> &[WorkerKey] {
        self.holders.get(g as usize).map_or(&[], Vec::as_slice)
    }
}
