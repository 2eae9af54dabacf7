//! What a workload is: its kind ([`WorkloadKind`]), its parameters ([`WorkloadSpec`], the
//! flags of `kvengine bench indexer`) and, for the `trace` workload, its trace
//! ([`TraceSpec`]).

use anyhow::{Result, bail};
use serde::Serialize;
use std::path::PathBuf;

/// The named workloads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// No common prompt: prefix ratio 0.
    Uniform,
    /// Dynamo's defaults: a quarter of each sequence is one of 4 common prompts.
    #[default]
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

    /// The workload called `name` ([`WorkloadKind::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(name, false).ok()
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
