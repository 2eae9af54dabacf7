//! Pre-generated indexer workloads: every event and query of a run, built before timing.
//!
//! A [`Plan`] is what the harness drives: per phase, one [`EventStream`] per producer
//! thread, plus the query lists. Two generators fill it:
//!
//! * [`synthetic`]: NVIDIA Dynamo's indexer-benchmark shape (`uniform`, `dynamo`,
//!   `shared-prefix`): `size / depth` sequences of `depth` blocks, sequence `k` on worker
//!   `k mod W` in prefix group `k mod G`.
//! * [`trace`]: a Mooncake JSONL trace replayed onto simulated workers whose caches are
//!   bounded and evict LRU, so removals are real.
//!
//! The anchor-exact workloads (`dynamo-w1` .. `dynamo-w4`) have their own plan and phases:
//! [`anchor::AnchorPlan`], run by [`crate::anchor`]; [`Plan::generate`] refuses them.
//!
//! # Invariants
//! 1. Everything is generated before the first timed phase; the timed part only moves
//!    pre-built [`KvEvent`]s (engine hashes and precomputed tokens hashes: no token
//!    hashing) and pre-hashed queries.
//! 2. All events of one worker key go to the same producer stream (producer
//!    `worker mod producers`), in the order the worker emitted them; streams share no
//!    worker, so any interleaving of streams is a valid global order.
//! 3. Applied in phase order (build, store, mixed rounds in pairs, remove) to an empty
//!    index, no event is refused, and the remove phase leaves the index empty.
//! 4. The same spec and seed give the same plan (a fixed mixing function, no versioned
//!    RNG).
//! 5. Every checked query's `expect_best` is the best overlap an exact index returns on the
//!    live set the phase runs against (after build, before store).

pub mod anchor;
pub mod synthetic;
pub mod trace;

use anyhow::{Result, bail};
use engine::event::KvEvent;
use engine::{SeqHash, WorkerKey};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

/// Everything one producer thread sends in one phase, in order. Shared, so a phase can be
/// replayed (mixed rounds) or handed to long-lived threads without copying.
pub type EventStream = Arc<[(WorkerKey, KvEvent)]>;

/// One query: a request's seq_hashes, hashed before timing.
pub type Query = Arc<[SeqHash]>;

/// The named workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// No common prompt: prefix ratio 0.
    Uniform,
    /// Dynamo's defaults: a quarter of each sequence is one of 4 common prompts.
    Dynamo,
    /// One common prompt shared by every sequence (breaks naive first-block sharding).
    SharedPrefix,
    /// A Mooncake-format JSONL trace replayed onto capacity-bounded simulated workers.
    Trace,
    /// Anchor W1: 128 workers, depth 128, 2^20 pairs, prefix ratio 0.25, 4 groups.
    #[value(name = "dynamo-w1")]
    #[serde(rename = "dynamo-w1")]
    DynamoW1,
    /// Anchor W2: W1 with one group.
    #[value(name = "dynamo-w2")]
    #[serde(rename = "dynamo-w2")]
    DynamoW2,
    /// Anchor W3: 64 workers, depth 512, 2^21 pairs, prefix ratio 0.25, 4 groups.
    #[value(name = "dynamo-w3")]
    #[serde(rename = "dynamo-w3")]
    DynamoW3,
    /// Anchor W4: W1 with prefix ratio 0.75 and one group.
    #[value(name = "dynamo-w4")]
    #[serde(rename = "dynamo-w4")]
    DynamoW4,
}

impl WorkloadKind {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Uniform => "uniform",
            Self::Dynamo => "dynamo",
            Self::SharedPrefix => "shared-prefix",
            Self::Trace => "trace",
            Self::DynamoW1 => "dynamo-w1",
            Self::DynamoW2 => "dynamo-w2",
            Self::DynamoW3 => "dynamo-w3",
            Self::DynamoW4 => "dynamo-w4",
        }
    }

    /// An anchor-exact workload (run by [`crate::anchor`], not by [`crate::harness`]).
    pub fn is_anchor(self) -> bool {
        matches!(
            self,
            Self::DynamoW1 | Self::DynamoW2 | Self::DynamoW3 | Self::DynamoW4
        )
    }
}

/// How trace requests are assigned to simulated workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TraceAssign {
    /// Request `i` goes to worker `i mod W`.
    RoundRobin,
    /// By a hash of the request's first hash id (requests sharing a first block share a
    /// worker, as a prefix-aware router would place them).
    FirstId,
}

/// Where a trace comes from and how it is replayed.
#[derive(Clone, Debug)]
pub struct TraceSpec {
    /// The JSONL file.
    pub path: PathBuf,
    /// Worker assignment.
    pub assign: TraceAssign,
    /// Blocks each simulated worker caches before it evicts (`None`: `size / workers`).
    pub capacity: Option<usize>,
}

/// The parameters of a workload (flags of `kvengine bench indexer`).
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    /// Which workload.
    pub kind: WorkloadKind,
    /// (worker, block) pairs the sequences describe; `size / depth` sequences.
    pub size: usize,
    /// Blocks per sequence.
    pub depth: usize,
    /// Simulated workers (one dp rank each).
    pub workers: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// Share of each sequence that is a common prompt.
    pub prefix_ratio: f64,
    /// Distinct common prompts.
    pub prefix_groups: u64,
    /// Seed of every random choice.
    pub seed: u64,
    /// Queries per query phase (hit, prefix-only) and per mixed query thread.
    pub queries: usize,
    /// Producer threads (event streams per phase).
    pub producers: usize,
    /// Query threads in the mixed phase.
    pub query_threads: usize,
    /// The trace, for [`WorkloadKind::Trace`].
    pub trace: Option<TraceSpec>,
}

impl Default for WorkloadSpec {
    /// Dynamo's defaults (issue 3).
    fn default() -> Self {
        Self {
            kind: WorkloadKind::Dynamo,
            size: 1 << 20,
            depth: 128,
            workers: 128,
            block_size: engine::hash::DEFAULT_BLOCK_SIZE,
            prefix_ratio: 0.25,
            prefix_groups: 4,
            seed: 42,
            queries: 100_000,
            producers: 1,
            query_threads: 1,
            trace: None,
        }
    }
}

/// Largest accepted `size` (about 3 GB of pre-generated events at depth 128).
pub const MAX_SIZE: usize = 1 << 27;

impl WorkloadSpec {
    /// The spec with the named workload's overrides applied (`uniform`: prefix ratio 0;
    /// `shared-prefix`: one prefix group).
    pub fn effective(&self) -> Self {
        let mut s = self.clone();
        match s.kind {
            WorkloadKind::Uniform => s.prefix_ratio = 0.0,
            WorkloadKind::SharedPrefix => s.prefix_groups = 1,
            _ => {}
        }
        s
    }

    /// Blocks of each sequence that are its group's common prompt (`round(depth * ratio)`,
    /// as Dynamo rounds it).
    pub fn prefix_blocks(&self) -> usize {
        ((self.depth as f64 * self.prefix_ratio).round() as usize).min(self.depth)
    }

    /// Refuses absurd or inconsistent parameters with a message naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.depth == 0 || self.depth > 1 << 20 {
            bail!("--depth must be within 1..=1048576 (got {})", self.depth);
        }
        if self.size > MAX_SIZE {
            bail!("--size must be at most {MAX_SIZE} (got {})", self.size);
        }
        if self.kind != WorkloadKind::Trace && self.size < self.depth {
            bail!(
                "--size ({}) must be at least --depth ({}): no sequence fits",
                self.size,
                self.depth
            );
        }
        if self.workers == 0 || self.workers > 1 << 20 {
            bail!(
                "--workers must be within 1..=1048576 (got {})",
                self.workers
            );
        }
        if self.block_size == 0 || self.block_size > 4096 {
            bail!(
                "--block-size must be within 1..=4096 (got {})",
                self.block_size
            );
        }
        if !(0.0..=1.0).contains(&self.prefix_ratio) {
            bail!(
                "--prefix-ratio must be within 0..=1 (got {})",
                self.prefix_ratio
            );
        }
        if self.prefix_groups == 0 || self.prefix_groups > 1 << 20 {
            bail!(
                "--prefix-groups must be within 1..=1048576 (got {})",
                self.prefix_groups
            );
        }
        if self.queries > 1 << 26 {
            bail!(
                "--queries must be at most {} (got {})",
                1 << 26,
                self.queries
            );
        }
        if self.producers == 0 || self.producers > 1024 {
            bail!(
                "--producers must be within 1..=1024 (got {})",
                self.producers
            );
        }
        if self.query_threads > 1024 {
            bail!(
                "--query-threads must be at most 1024 (got {})",
                self.query_threads
            );
        }
        if self.kind == WorkloadKind::Trace && self.trace.is_none() {
            bail!("--workload trace needs --trace FILE");
        }
        Ok(())
    }
}

/// One phase's events, split into producer streams.
#[derive(Clone, Debug, Default)]
pub struct Phase {
    /// `streams[p]`: everything producer `p` sends, in order.
    pub streams: Vec<EventStream>,
    /// Events over all streams.
    pub events: u64,
    /// Blocks stored over all streams.
    pub stored_blocks: u64,
    /// Blocks removed over all streams.
    pub removed_blocks: u64,
}

impl Phase {
    /// Stored plus removed blocks.
    pub fn block_ops(&self) -> u64 {
        self.stored_blocks + self.removed_blocks
    }

    /// Every event of the phase, streams concatenated (one valid global order).
    pub fn iter(&self) -> impl Iterator<Item = &(WorkerKey, KvEvent)> {
        self.streams.iter().flat_map(|s| s.iter())
    }
}

/// Builds a [`Phase`], routing each worker's events to its producer (invariant 2).
#[derive(Debug)]
pub struct PhaseBuilder {
    streams: Vec<Vec<(WorkerKey, KvEvent)>>,
    events: u64,
    stored_blocks: u64,
    removed_blocks: u64,
}

impl PhaseBuilder {
    /// An empty phase for `producers` producers (at least one).
    pub fn new(producers: usize) -> Self {
        Self {
            streams: (0..producers.max(1)).map(|_| Vec::new()).collect(),
            events: 0,
            stored_blocks: 0,
            removed_blocks: 0,
        }
    }

    /// Appends `event` of `key` to its producer's stream; empty stores and removals are
    /// dropped.
    pub fn push(&mut self, key: WorkerKey, event: KvEvent) {
        match &event {
            KvEvent::Stored { blocks, .. } if blocks.is_empty() => return,
            KvEvent::Removed { blocks } if blocks.is_empty() => return,
            KvEvent::Stored { blocks, .. } => self.stored_blocks += blocks.len() as u64,
            KvEvent::Removed { blocks } => self.removed_blocks += blocks.len() as u64,
            KvEvent::Cleared => {}
        }
        self.events += 1;
        let n = self.streams.len() as u64;
        let p = (key.worker.0 % n) as usize;
        if let Some(s) = self.streams.get_mut(p) {
            s.push((key, event));
        }
    }

    /// The finished phase.
    pub fn finish(self) -> Phase {
        Phase {
            streams: self.streams.into_iter().map(Arc::from).collect(),
            events: self.events,
            stored_blocks: self.stored_blocks,
            removed_blocks: self.removed_blocks,
        }
    }
}

/// A query whose answer is known: the best overlap an exact index returns (invariant 5).
#[derive(Clone, Debug)]
pub struct CheckedQuery {
    /// The request's seq_hashes.
    pub seqs: Query,
    /// Expected [`engine::Matches::best`].
    pub expect_best: u32,
}

/// Sizes of the generated workload, for the report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanShape {
    /// Sequences (synthetic) or trace requests.
    pub sequences: u64,
    /// Common-prompt blocks per sequence (synthetic; 0 for traces).
    pub prefix_blocks: u64,
    /// Live (block, worker) entries after the build phase.
    pub entries_after_build: u64,
    /// Trace requests replayed, if a trace.
    pub trace_requests: Option<u64>,
    /// Blocks cached per simulated worker, if a trace.
    pub trace_capacity: Option<u64>,
}

/// The mixed phase's rounds.
#[derive(Clone, Debug, Default)]
pub struct MixedPhases {
    /// The first round.
    pub out: Phase,
    /// A round that undoes `out`'s changes to the live set (if the workload has one), so
    /// rounds can repeat in pairs for as long as asked.
    pub back: Option<Phase>,
}

/// A whole run's events and queries, generated before timing.
#[derive(Debug)]
pub struct Plan {
    /// The effective spec (named overrides applied).
    pub spec: WorkloadSpec,
    /// Sizes, for the report.
    pub shape: PlanShape,
    /// From empty to the built index.
    pub build: Phase,
    /// More stores on the built index.
    pub store: Phase,
    /// Stores and removes while queries run.
    pub mixed: MixedPhases,
    /// Removes everything still live (tails first, then prefixes).
    pub remove: Phase,
    /// Queries that hit a stored sequence, run on the built index.
    pub hit_queries: Vec<CheckedQuery>,
    /// Queries that match only a common prefix, run on the built index.
    pub prefix_queries: Vec<CheckedQuery>,
    /// Per mixed query thread, the queries it issues (cyclically).
    pub mixed_queries: Vec<Vec<Query>>,
}

impl Plan {
    /// Generates the plan of `spec` (after its named overrides).
    pub fn generate(spec: &WorkloadSpec) -> Result<Self> {
        let spec = spec.effective();
        if spec.kind.is_anchor() {
            bail!(
                "{} is an anchor workload: generate it with workload::anchor::AnchorPlan",
                spec.kind.name()
            );
        }
        spec.validate()?;
        match spec.kind {
            WorkloadKind::Trace => trace::plan(spec),
            _ => Ok(synthetic::plan(spec)),
        }
    }

    /// The phases in the order the harness runs them (mixed rounds once each).
    pub fn phases_in_order(&self) -> impl Iterator<Item = &Phase> {
        [&self.build, &self.store, &self.mixed.out]
            .into_iter()
            .chain(self.mixed.back.as_ref())
            .chain([&self.remove])
    }
}

/// A splitmix64 stream: stable across versions and platforms (invariant 4).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// A uniform value in `0..n` (`n > 0`; multiply-shift, bias below 2^-32 for our n).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// splitmix64's finaliser: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Mixes several words into one (order matters).
#[inline]
pub(crate) fn mix_all(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x243F_6A88_85A3_08D3, |h, &w| mix64(h ^ w))
}

/// Synthetic token ids of one block, named by `words` (vocabulary of 32k).
pub(crate) fn block_tokens(out: &mut Vec<u32>, block_size: usize, words: &[u64]) {
    let base = mix_all(words);
    out.clear();
    out.extend(
        (0..block_size as u64)
            .map(|i| (mix64(base ^ i.wrapping_mul(0xA24B_AED4_963E_E407)) % 32_000) as u32),
    );
}

/// The engine hash a simulated worker uses for the block with `seq`: a function of the
/// whole prefix (as vLLM's chained hashes are), independent of the seq_hash's bits.
#[inline]
pub(crate) fn engine_hash_of(seq: SeqHash) -> engine::EngineHash {
    engine::EngineHash(mix64(seq.0 ^ 0x656E_6769_6E65_2D68))
}

/// `count` seq_hashes chained onto `parent` from random tokens hashes: a continuation no
/// worker stores.
pub(crate) fn random_continuation(
    rng: &mut Rng,
    parent: Option<SeqHash>,
    count: usize,
    out: &mut Vec<SeqHash>,
) {
    let mut prev = parent;
    for _ in 0..count {
        let s = engine::hash::seq_hash(prev, engine::TokensHash(rng.next_u64()));
        out.push(s);
        prev = Some(s);
    }
}

/// Deals `pool` round-robin into `threads` lists of `per_thread` queries each, picking
/// randomly.
pub(crate) fn deal_queries(
    rng: &mut Rng,
    pool: &[Query],
    threads: usize,
    per_thread: usize,
) -> Vec<Vec<Query>> {
    if pool.is_empty() {
        return vec![Vec::new(); threads];
    }
    (0..threads)
        .map(|_| {
            (0..per_thread)
                .map(|_| Arc::clone(&pool[rng.below(pool.len())]))
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_stable_and_below_is_in_range() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            assert!(a.below(13) < 13);
            b.below(13);
        }
        // Pinned so a change of mixing function (which changes every workload) is noticed.
        assert_eq!(Rng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn builder_routes_workers_to_producers_and_drops_empty_events() {
        let mut b = PhaseBuilder::new(3);
        for w in 0..7u64 {
            b.push(
                WorkerKey::new(w, 0),
                KvEvent::Removed {
                    blocks: vec![engine::EngineHash(w)],
                },
            );
        }
        b.push(WorkerKey::new(1, 0), KvEvent::Removed { blocks: vec![] });
        let p = b.finish();
        assert_eq!(p.events, 7);
        assert_eq!(p.removed_blocks, 7);
        for (i, s) in p.streams.iter().enumerate() {
            assert!(s.iter().all(|(k, _)| k.worker.0 % 3 == i as u64));
        }
    }

    #[test]
    fn named_overrides_and_validation() {
        let s = WorkloadSpec {
            kind: WorkloadKind::Uniform,
            ..WorkloadSpec::default()
        };
        assert_eq!(s.effective().prefix_ratio, 0.0);
        let s = WorkloadSpec {
            kind: WorkloadKind::SharedPrefix,
            ..WorkloadSpec::default()
        };
        assert_eq!(s.effective().prefix_groups, 1);
        assert_eq!(WorkloadSpec::default().prefix_blocks(), 32);
        for bad in [
            WorkloadSpec {
                depth: 0,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                size: 10,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                size: usize::MAX,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                prefix_ratio: 1.5,
                ..WorkloadSpec::default()
            },
            WorkloadSpec {
                kind: WorkloadKind::Trace,
                ..WorkloadSpec::default()
            },
        ] {
            assert!(Plan::generate(&bad).is_err(), "{bad:?}");
        }
    }
}
