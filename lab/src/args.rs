//! The flags of `kvengine bench indexer`, for the CLI to flatten into its subcommand.
//!
//! Every flag can also be set from a `KVENGINE_BENCH_*` environment variable (the flag's
//! name, upper-cased, dashes as underscores); a flag on the command line wins.
//!
//! # Invariants
//! 1. The defaults are issue 3's (NVIDIA Dynamo's indexer benchmark): size 1,048,576,
//!    depth 128, 128 workers, block size 16, prefix ratio 0.25, 4 prefix groups.
//! 2. [`IndexerArgs::spec`] and [`IndexerArgs::run_options`] only copy and convert; every
//!    range check lives in [`WorkloadSpec::validate`] (and [`AnchorSpec::validate`]) so the
//!    library refuses the same inputs whoever builds the spec.
//! 3. The anchor workloads (`dynamo-w1` .. `dynamo-w4`) fix every workload flag: one set
//!    away from its default is refused, not ignored. They scale only through
//!    `--anchor-size` and `--anchor-queries`, which (like `--repeat`) other workloads
//!    refuse.

use crate::anchor::AnchorOptions;
use crate::driver::{IndexerUnderTest, MixedPlan};
use crate::harness::RunOptions;
use crate::workload::anchor::AnchorSpec;
use crate::workload::{TraceAssign, TraceSpec, WorkloadKind, WorkloadSpec};
use anyhow::{Result, bail};
use engine::sharding::adaptive::Adaptive;
use engine::sharding::choice::Sharding;
use std::path::PathBuf;
use std::time::Duration;

/// Flags of the indexer benchmark.
#[derive(clap::Args, Clone, Debug)]
pub struct IndexerArgs {
    /// Named workload: uniform (prefix ratio 0), dynamo (the defaults), shared-prefix
    /// (one prefix group), trace (a Mooncake JSONL file, see --trace), or dynamo-w1 ..
    /// dynamo-w4 (Dynamo's anchor workloads exactly, with their own phases and report;
    /// they fix every workload flag, see --anchor-size and --repeat).
    #[arg(long, value_enum, default_value_t = WorkloadKind::Dynamo, env = "KVENGINE_BENCH_WORKLOAD")]
    pub workload: WorkloadKind,
    /// Mooncake-format JSONL trace, for --workload trace.
    #[arg(long, env = "KVENGINE_BENCH_TRACE")]
    pub trace: Option<PathBuf>,
    /// (worker, block) pairs the sequences describe: size / depth sequences. For traces,
    /// size / workers is each simulated worker's cache capacity in blocks.
    #[arg(long, default_value_t = 1 << 20, env = "KVENGINE_BENCH_SIZE")]
    pub size: usize,
    /// Blocks per sequence.
    #[arg(long, default_value_t = 128, env = "KVENGINE_BENCH_DEPTH")]
    pub depth: usize,
    /// Simulated workers.
    #[arg(long, default_value_t = 128, env = "KVENGINE_BENCH_WORKERS")]
    pub workers: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = engine::hash::DEFAULT_BLOCK_SIZE, env = "KVENGINE_BENCH_BLOCK_SIZE")]
    pub block_size: usize,
    /// Share of each sequence that is a common prompt (uniform forces 0).
    #[arg(long, default_value_t = 0.25, env = "KVENGINE_BENCH_PREFIX_RATIO")]
    pub prefix_ratio: f64,
    /// Distinct common prompts (shared-prefix forces 1).
    #[arg(long, default_value_t = 4, env = "KVENGINE_BENCH_PREFIX_GROUPS")]
    pub prefix_groups: u64,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 42, env = "KVENGINE_BENCH_SEED")]
    pub seed: u64,
    /// Queries per query phase, and per mixed-phase query thread.
    #[arg(long, default_value_t = 100_000, env = "KVENGINE_BENCH_QUERIES")]
    pub queries: usize,
    /// Producer threads (event streams; workers are split among them).
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_PRODUCERS")]
    pub producers: usize,
    /// Query threads in the mixed phase.
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_QUERY_THREADS")]
    pub query_threads: usize,
    /// Shards / cores of the indexer under test.
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_CORES")]
    pub cores: usize,
    /// Sharded indexers: replicate the first N blocks of every sequence in every shard
    /// instead of the default adaptive trunk.
    #[arg(long, env = "KVENGINE_BENCH_REPLICATE_DEPTH")]
    pub replicate_depth: Option<u32>,
    /// Sharded indexers, adaptive trunk: a block joins the trunk at this many children.
    #[arg(long, alias = "hub-fanout", default_value_t = Adaptive::DEFAULT_JUNCTION_FANOUT,
          env = "KVENGINE_BENCH_JUNCTION_FANOUT")]
    pub junction_fanout: u32,
    /// Repeat the mixed phase (in round pairs) until this many seconds have passed; 0 runs
    /// one pair.
    #[arg(long, default_value_t = 0.0, env = "KVENGINE_BENCH_DURATION_S")]
    pub duration_s: f64,
    /// Single-threaded indexers: events between two queries in the mixed phase.
    #[arg(long, default_value_t = 2, env = "KVENGINE_BENCH_EVENTS_PER_QUERY")]
    pub events_per_query: usize,
    /// Trace replay: how requests are assigned to workers.
    #[arg(long, value_enum, default_value_t = TraceAssign::RoundRobin, env = "KVENGINE_BENCH_TRACE_ASSIGN")]
    pub trace_assign: TraceAssign,
    /// Trace replay: blocks each worker caches before it evicts (default size / workers).
    #[arg(long, env = "KVENGINE_BENCH_TRACE_CAPACITY")]
    pub trace_capacity: Option<usize>,
    /// dynamo-w1 .. dynamo-w4 only: S, the (worker, block) pairs of the base sequences,
    /// in place of the anchor's (scales a run down; W, D, r and G stay).
    #[arg(long, env = "KVENGINE_BENCH_ANCHOR_SIZE")]
    pub anchor_size: Option<usize>,
    /// dynamo-w1 .. dynamo-w4 only: queries per query phase in place of the anchor's
    /// 20,000.
    #[arg(long, env = "KVENGINE_BENCH_ANCHOR_QUERIES")]
    pub anchor_queries: Option<usize>,
    /// dynamo-w1 .. dynamo-w4 only: runs in this invocation, each on a fresh indexer; the
    /// report gives every figure's median, and its min / median / max under `range`.
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_REPEAT")]
    pub repeat: usize,
    /// dynamo-w1 .. dynamo-w4 only: untimed runs before the timed ones (the first run in a
    /// process pays for every page the allocator gets from the OS); reported apart.
    #[arg(long, default_value_t = 1, env = "KVENGINE_BENCH_WARMUP")]
    pub warmup: usize,
    /// Write the anchor workloads in the neutral file format (events, queries, expected
    /// answers; docs/benchmarks.md, "The exported workload format"), one directory each
    /// under DIR, and time nothing: the workload --workload names if it is dynamo-w1 ..
    /// dynamo-w4 or trace (the trace replay, with --trace and its flags), otherwise all
    /// four anchors (scaled by --anchor-size and --anchor-queries).
    #[arg(
        long,
        value_name = "DIR",
        env = "KVENGINE_BENCH_EXPORT",
        conflicts_with = "import"
    )]
    pub export: Option<PathBuf>,
    /// Time the indexer on a workload directory in the neutral file format (written by
    /// --export, or by anyone) instead of generating one; the anchor harness's phases and
    /// checks, with the files' answers.
    #[arg(long, value_name = "DIR", env = "KVENGINE_BENCH_IMPORT")]
    pub import: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long, env = "KVENGINE_BENCH_JSON")]
    pub json: Option<PathBuf>,
    /// No per-phase progress lines on stderr.
    #[arg(long, env = "KVENGINE_BENCH_QUIET")]
    pub quiet: bool,
}

impl IndexerArgs {
    /// The workload these flags describe (named overrides are applied by the plan).
    pub fn spec(&self) -> WorkloadSpec {
        WorkloadSpec {
            kind: self.workload,
            size: self.size,
            depth: self.depth,
            workers: self.workers,
            block_size: self.block_size,
            prefix_ratio: self.prefix_ratio,
            prefix_groups: self.prefix_groups,
            seed: self.seed,
            queries: self.queries,
            producers: self.producers,
            query_threads: self.query_threads,
            trace: self.trace.clone().map(|path| TraceSpec {
                path,
                assign: self.trace_assign,
                capacity: self.trace_capacity,
            }),
        }
    }

    /// The anchor workload these flags select, with `--anchor-size` and `--anchor-queries`
    /// applied; `None` for the other workloads (invariant 3).
    pub fn anchor_spec(&self) -> Result<Option<AnchorSpec>> {
        if AnchorSpec::of(self.workload).is_none() {
            if self.anchor_size.is_some() || self.anchor_queries.is_some() || self.repeat != 1 {
                bail!(
                    "--anchor-size, --anchor-queries and --repeat apply to --workload \
                     dynamo-w1 .. dynamo-w4 only"
                );
            }
            return Ok(None);
        }
        self.scaled_anchor(self.workload).map(Some)
    }

    /// The anchor workloads `--export` writes (see its help): scaled, checked as
    /// [`IndexerArgs::anchor_spec`] checks one.
    pub fn export_specs(&self) -> Result<Vec<AnchorSpec>> {
        if self.workload.is_anchor() {
            return Ok(vec![self.scaled_anchor(self.workload)?]);
        }
        <WorkloadKind as clap::ValueEnum>::value_variants()
            .iter()
            .filter(|k| k.is_anchor())
            .map(|&k| self.scaled_anchor(k))
            .collect()
    }

    /// `--import` takes its workload from the files: no workload flag may be set.
    pub fn check_import(&self) -> Result<()> {
        let mut set = self.fixed_by_anchor();
        if self.workload != WorkloadKind::default() {
            set.push("--workload");
        }
        if self.anchor_size.is_some() {
            set.push("--anchor-size");
        }
        if self.anchor_queries.is_some() {
            set.push("--anchor-queries");
        }
        if !set.is_empty() {
            bail!(
                "--import takes the workload from its files: drop {}",
                set.join(", ")
            );
        }
        Ok(())
    }

    /// Anchor `kind` with `--anchor-size` and `--anchor-queries` applied, refusing the
    /// workload flags it fixes.
    fn scaled_anchor(&self, kind: WorkloadKind) -> Result<AnchorSpec> {
        let Some(mut spec) = AnchorSpec::of(kind) else {
            bail!("{} is not an anchor workload", kind.name());
        };
        let fixed = self.fixed_by_anchor();
        if !fixed.is_empty() {
            bail!(
                "--workload {} fixes its workload: drop {} (scale it with --anchor-size and \
                 --anchor-queries)",
                kind.name(),
                fixed.join(", ")
            );
        }
        if let Some(size) = self.anchor_size {
            spec.size = size;
        }
        if let Some(queries) = self.anchor_queries {
            spec.queries = queries;
        }
        spec.validate()?;
        Ok(spec)
    }

    /// Workload flags set away from their defaults, which an anchor workload fixes.
    fn fixed_by_anchor(&self) -> Vec<&'static str> {
        let (s, d) = (self.spec(), WorkloadSpec::default());
        [
            ("--size", s.size != d.size),
            ("--depth", s.depth != d.depth),
            ("--workers", s.workers != d.workers),
            ("--block-size", s.block_size != d.block_size),
            ("--prefix-ratio", s.prefix_ratio != d.prefix_ratio),
            ("--prefix-groups", s.prefix_groups != d.prefix_groups),
            ("--seed", s.seed != d.seed),
            ("--queries", s.queries != d.queries),
            ("--producers", s.producers != d.producers),
            ("--query-threads", s.query_threads != d.query_threads),
            ("--trace", self.trace.is_some()),
            ("--trace-capacity", self.trace_capacity.is_some()),
            ("--duration-s", self.duration_s != 0.0),
            (
                "--events-per-query",
                self.events_per_query != MixedPlan::default().events_per_query,
            ),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect()
    }

    /// How to run an anchor plan.
    pub fn anchor_options(&self) -> AnchorOptions {
        AnchorOptions {
            warmup: self.warmup,
            repeat: self.repeat,
            progress: !self.quiet,
            release_memory: None,
        }
    }

    /// The sharding of the sharded indexers.
    pub fn sharding(&self) -> Result<Sharding> {
        Ok(Sharding::configured(
            self.cores,
            self.replicate_depth,
            self.junction_fanout,
        )?)
    }

    /// How to run the plan.
    pub fn run_options(&self) -> Result<RunOptions> {
        let Ok(duration) = Duration::try_from_secs_f64(self.duration_s) else {
            bail!("--duration-s must be a non-negative number of seconds");
        };
        Ok(RunOptions {
            duration,
            mixed: MixedPlan::with_events_per_query(self.events_per_query),
            progress: !self.quiet,
        })
    }
}

/// The indexers this crate can drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Baseline {
    /// The threaded runtime: --cores pinned shard threads, --producers ingest threads,
    /// --query-threads query threads.
    Runtime,
    /// The runtime with its cores hosted on the benchmark's threads: each thread owns a
    /// core, applies its producer stream through it and issues queries through it, as
    /// kvengine's HTTP edge does (--cores threads; --producers streams and --query-threads
    /// query lists run on them).
    HostedRuntime,
    /// The one-shard `KvIndex` (requires --cores 1).
    KvIndex,
    /// `ShardedIndex` with the fixed-depth policy, --cores shards in one thread.
    Sharded,
}

impl Baseline {
    /// The indexer, sized by `args`.
    pub fn build(self, args: &IndexerArgs) -> Result<Box<dyn IndexerUnderTest>> {
        Ok(match self {
            Self::KvIndex if args.cores != 1 => {
                bail!("--indexer kv-index is one shard: use --cores 1, or --indexer sharded")
            }
            Self::KvIndex => Box::new(crate::driver::kv_index::KvIndexUnderTest::new()),
            Self::Sharded => Box::new(crate::driver::sharded::ShardedUnderTest::new(
                args.sharding()?,
            )),
            Self::Runtime => Box::new(crate::driver::runtime::RuntimeUnderTest::new(
                args.sharding()?,
                args.producers,
                args.query_threads,
                true,
            )?),
            Self::HostedRuntime => Box::new(crate::driver::hosted::HostedUnderTest::new(
                args.sharding()?,
                args.producers,
                args.query_threads,
                true,
            )?),
        })
    }

    /// The indexer for an anchor workload ([`crate::anchor`]): events come from one
    /// stream; the runtime gets one ingest handle and two query handles (phase 3's two
    /// callers use handles 0 and 1; phase 4's one query thread uses handle 1); the hosted
    /// runtime runs the stream and the query thread on core 0's thread (phase 3's callers
    /// on cores 0 and 1, or on core 0 and a thread of its own with one core).
    pub fn build_anchor(self, args: &IndexerArgs) -> Result<Box<dyn IndexerUnderTest>> {
        match self {
            Self::Runtime => Ok(Box::new(crate::driver::runtime::RuntimeUnderTest::new(
                args.sharding()?,
                1,
                1,
                true,
            )?)),
            Self::HostedRuntime => Ok(Box::new(crate::driver::hosted::HostedUnderTest::new(
                args.sharding()?,
                1,
                1,
                true,
            )?)),
            Self::KvIndex | Self::Sharded => self.build(args),
        }
    }
}
