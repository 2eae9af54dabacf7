//! `kvengine bench snapshot`: how long a warm restart takes (issue 12's goal: restart to
//! serving in at most 1 s per 10 M index entries, an entry being a `(block, worker key)`
//! pair).
//!
//! # What runs
//! 1. Build (not timed): the threaded runtime (adaptive trunk) takes `KvEvent::Stored`
//!    batches until its directories hold `entries` entries. Workload: groups of
//!    [`SEQS_PER_GROUP`] sequences share a system prompt of [`PREFIX_BLOCKS`] blocks; each
//!    sequence adds a tail of [`TAIL_BLOCKS`] blocks; each group lives on
//!    [`GROUP_WORKERS`] of the workers, and each sequence on [`HOLDERS`] of those. A worker
//!    stores a group's prompt once, then each of its sequences' tails under it (as a
//!    worker with prefix caching reports them), so each prompt's last block has dozens of
//!    children, promotes, and is replicated into every shard; tree nodes have several
//!    holders. Engine hashes are content hashes (equal across workers), as vLLM's are.
//! 2. Per repeat, timed phase by phase: the cut (`IngestHandle::snapshot`: how long
//!    ingest pauses), `snapshot::encode`, `file::write_atomic`, then the restart exactly as
//!    `bin/src/warm.rs` does it: `file::read`, `snapshot::decode` (checksum and bytecheck
//!    validation), `runtime::start_from` with the image (rayon rebuild) and the first query
//!    answered. `restart_to_serving_s` is the sum of the last four.
//! 3. Per repeat, after the timed window: a split of the restore for profiling (the
//!    checksum alone; each core's tree and directories rebuilt alone, one after another,
//!    on this thread), and the self-checks.
//!
//! # Invariants
//! 1. Nothing is generated inside a timed window: the image, the file bytes and every
//!    query are made before the window that uses them.
//! 2. A run checks itself: the build refused nothing and the directories hold exactly the
//!    entries the generator made; each restored engine has the original's entries and
//!    blocks per shard and answers [`SAMPLE_QUERIES`] sampled queries (and the first
//!    query) exactly as the original did. [`SnapshotReport::problems`] lists failures.
//! 3. The snapshot file is the run's own (`snapshot.kvs` in `dir`, or in a temporary
//!    directory removed at the end) and is deleted at the end.

use crate::anchor::report::{Range, min_median_max};
use crate::calibrate::{MemLatency, mem_latency, rss_bytes};
use crate::report::Machine;
use crate::workload::{Rng, mix64};
use anyhow::{Context, Result};
use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::runtime::{CoreSummary, QueryHandle, RuntimeConfig, Started, start_from};
use engine::sharding::ShardId;
use engine::sharding::ShardPolicy;
use engine::sharding::choice::Sharding;
use engine::sharding::ingest::Ingest;
use engine::sharding::shard::Shard;
use engine::snapshot;
use engine::{DpRank, EngineHash, Matches, SeqHash, TokensHash, WorkerId, WorkerKey};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use transport::state::file;

/// Blocks of a group's shared system prompt.
pub const PREFIX_BLOCKS: usize = 32;
/// Blocks of a sequence's own tail (inclusive range).
pub const TAIL_BLOCKS: (usize, usize) = (32, 128);
/// Sequences per group (the prompt's last block gets up to this many children).
pub const SEQS_PER_GROUP: usize = 64;
/// Workers a group lives on.
pub const GROUP_WORKERS: usize = 8;
/// Workers holding one sequence (inclusive range, at most the group's workers).
pub const HOLDERS: (usize, usize) = (1, 4);
/// Queries compared between the original and every restored engine.
pub const SAMPLE_QUERIES: usize = 1_000;
/// Events per `IngestHandle::send` during the build.
const SEND_EVENTS: usize = 256;
/// The goal: seconds of restart to serving per 10 M entries.
pub const GOAL_S_PER_10M: f64 = 1.0;

/// What to run.
#[derive(Clone, Debug)]
pub struct SnapshotConfig {
    /// Index entries ((block, worker key) pairs) to build; the build stops at the first
    /// sequence that reaches it.
    pub entries: u64,
    /// Engine cores (shards).
    pub cores: usize,
    /// Workers (one dp rank each).
    pub workers: usize,
    /// Timed repeats.
    pub repeat: usize,
    /// Where the snapshot file goes (`None`: a temporary directory).
    pub dir: Option<PathBuf>,
    /// Workload seed.
    pub seed: u64,
    /// Returns the allocator's free memory to the OS before resident-memory readings.
    pub release_memory: Option<fn()>,
    /// Progress lines on stderr.
    pub progress: bool,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        Self {
            entries: 10_000_000,
            cores: 2,
            workers: 64,
            repeat: 5,
            dir: None,
            seed: 12,
            release_memory: None,
            progress: false,
        }
    }
}

/// One repeat's timings (seconds) and sizes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Phases {
    /// `IngestHandle::snapshot_buffers`: the image buffers sized and touched, on the
    /// snapshot's own thread (ingest goes on).
    pub buffers_s: f64,
    /// `IngestHandle::snapshot_into`: the consistent cut, from the request to the image
    /// (ingest pauses for at most this long).
    pub cut_s: f64,
    /// `snapshot::encode` (rkyv archive, checksum).
    pub encode_s: f64,
    /// `file::write_atomic` (write, fsync, rename, fsync of the directory).
    pub write_s: f64,
    /// `file::read` into an aligned buffer.
    pub read_s: f64,
    /// `snapshot::decode`: checksum and bytecheck validation.
    pub decode_s: f64,
    /// `start_from` with the image: trunk, every core's shard and directories (rayon), and
    /// the core threads started.
    pub rebuild_s: f64,
    /// The first query answered by the restored engine.
    pub first_query_s: f64,
    /// `read_s + decode_s + rebuild_s + first_query_s`.
    pub restart_to_serving_s: f64,
    /// `restart_to_serving_s` scaled to 10 M entries.
    pub restart_s_per_10m_entries: f64,
    /// Split (after the timed window): XXH3 of the file body alone.
    pub split_checksum_s: f64,
    /// Split: `decode_s - split_checksum_s` (the bytecheck validation and the header).
    pub split_validate_s: f64,
    /// Split: every core's tree rebuilt alone on one thread, summed over cores.
    pub split_trees_s: f64,
    /// Split: every core's directories rebuilt alone on one thread, summed over cores.
    pub split_directories_s: f64,
    /// Resident memory the restored engine added (its process grew by this much from
    /// before the read to after the first query, the file buffer freed).
    pub restored_rss_bytes: f64,
    /// The restored engine's own heap bytes (trees and directories, all cores).
    pub restored_heap_bytes: f64,
}

impl Phases {
    /// `(key, value)` in declaration order.
    pub fn pairs(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("buffers_s", self.buffers_s),
            ("cut_s", self.cut_s),
            ("encode_s", self.encode_s),
            ("write_s", self.write_s),
            ("read_s", self.read_s),
            ("decode_s", self.decode_s),
            ("rebuild_s", self.rebuild_s),
            ("first_query_s", self.first_query_s),
            ("restart_to_serving_s", self.restart_to_serving_s),
            ("restart_s_per_10m_entries", self.restart_s_per_10m_entries),
            ("split_checksum_s", self.split_checksum_s),
            ("split_validate_s", self.split_validate_s),
            ("split_trees_s", self.split_trees_s),
            ("split_directories_s", self.split_directories_s),
            ("restored_rss_bytes", self.restored_rss_bytes),
            ("restored_heap_bytes", self.restored_heap_bytes),
        ]
    }
}

/// One repeat in full.
#[derive(Clone, Debug, Serialize)]
pub struct RepeatReport {
    /// Timings and sizes.
    #[serde(flatten)]
    pub phases: Phases,
    /// Split: per core, its tree rebuilt alone (seconds).
    pub split_tree_per_core_s: Vec<f64>,
    /// Split: per core, its directories rebuilt alone (seconds).
    pub split_directories_per_core_s: Vec<f64>,
    /// Bytes of the file.
    pub file_bytes: u64,
    /// The write's I/O path (`io_uring` or `std`).
    pub write_backend: &'static str,
    /// The read's I/O path.
    pub read_backend: &'static str,
    /// Sampled queries (plus the first) answered differently from the original.
    pub query_mismatches: u64,
    /// Per-shard entries or blocks that differ from the original's (0 when equal).
    pub shard_mismatches: u64,
}

/// The workload that was built.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Workload {
    /// Groups (system prompts).
    pub groups: u64,
    /// Sequences.
    pub sequences: u64,
    /// `KvEvent::Stored` events sent.
    pub events: u64,
    /// Distinct blocks made.
    pub distinct_blocks: u64,
    /// Distinct (block, worker key) entries made.
    pub distinct_entries: u64,
    /// Blocks per group prompt.
    pub prefix_blocks: usize,
    /// Tail blocks per sequence, min and max.
    pub tail_blocks: [usize; 2],
    /// Sequences per group.
    pub seqs_per_group: usize,
    /// Workers per group.
    pub group_workers: usize,
    /// Holders per sequence, min and max.
    pub holders: [usize; 2],
    /// Seconds the build took (sends and settle; not a figure of this benchmark).
    pub build_s: f64,
}

/// The report `kvengine bench snapshot` prints.
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotReport {
    /// `"snapshot"`.
    pub bench: &'static str,
    /// Entries asked for.
    pub entries_target: u64,
    /// Distinct (block, worker key) entries in the index (the directories' engine hashes;
    /// the goal's unit).
    pub entries: u64,
    /// Sum over shards of the trees' entries: trunk blocks count once per shard.
    pub shard_entries: u64,
    /// Sum over shards of the trees' blocks (trunk blocks once per shard).
    pub shard_blocks: u64,
    /// Blocks in the trunk at the first cut.
    pub trunk_blocks: u64,
    /// Engine cores.
    pub cores: usize,
    /// Workers.
    pub workers: usize,
    /// Timed repeats.
    pub repeat: usize,
    /// The sharding policy.
    pub policy: String,
    /// Median of `restart_to_serving_s`.
    pub restart_to_serving_s: f64,
    /// Median of `restart_s_per_10m_entries`.
    pub restart_s_per_10m_entries: f64,
    /// The goal, seconds per 10 M entries.
    pub goal_s_per_10m_entries: f64,
    /// The median meets the goal.
    pub goal_met: bool,
    /// File bytes (first repeat).
    pub file_bytes: u64,
    /// `file_bytes / entries`.
    pub file_bytes_per_entry: f64,
    /// The original engine's heap bytes (trees and directories, all cores).
    pub original_heap_bytes: u64,
    /// Where the file was written.
    pub dir: String,
    /// The filesystem type of `dir` (from `/proc/mounts`).
    pub fs: Option<String>,
    /// `{phase: [min, median, max]}` over repeats.
    pub range: Range,
    /// Every repeat.
    pub runs: Vec<RepeatReport>,
    /// The workload.
    pub workload: Workload,
    /// Self-check failures (empty: passed).
    pub problems: Vec<String>,
    /// Memory latency before the build.
    pub mem_latency_ns_before: MemLatency,
    /// Memory latency after the last repeat.
    pub mem_latency_ns_after: MemLatency,
    /// Where it ran.
    pub machine: Machine,
    /// When (UTC).
    pub date: String,
    /// What ran it.
    pub version: &'static str,
}

impl SnapshotReport {
    /// Self-check failures (invariant 2).
    pub fn problems(&self) -> &[String] {
        &self.problems
    }
}

/// The engine everything is compared with, and what it answered.
struct Original {
    started: Started<Sharding>,
    samples: Vec<Vec<SeqHash>>,
    answers: Vec<Matches>,
    stats: Vec<CoreSummary>,
}

fn runtime_config() -> RuntimeConfig {
    RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    }
}

/// Runs the benchmark (see the module docs).
pub fn run(cfg: &SnapshotConfig) -> Result<SnapshotReport> {
    anyhow::ensure!(
        cfg.entries > 0 && cfg.cores > 0 && cfg.workers > 0,
        "--entries, --cores and --workers must be > 0"
    );
    let mem_before = mem_latency();
    let (dir, temp) = match &cfg.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            (d.clone(), false)
        }
        None => {
            let d = std::env::temp_dir()
                .join(format!("kvengine-bench-snapshot-{}", std::process::id()));
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
            (d, true)
        }
    };
    let path = dir.join("snapshot.kvs");
    let result = run_in(cfg, &path, mem_before);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(path.with_extension("tmp"));
    if temp {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn run_in(cfg: &SnapshotConfig, path: &Path, mem_before: MemLatency) -> Result<SnapshotReport> {
    let policy = Sharding::adaptive(cfg.cores)?;
    let describe = policy.describe();
    let started = start_from(policy, runtime_config(), None).context("starting the engine")?;
    let (mut original, workload, mut problems) = build(cfg, started)?;
    let stats = &original.stats;
    let entries: u64 = stats.iter().map(|s| s.directory_entries as u64).sum();
    let original_heap_bytes = heap_bytes(stats);
    if cfg.progress {
        eprintln!(
            "snapshot bench: built {entries} entries ({} blocks, {} sequences) in {:.1} s",
            workload.distinct_blocks, workload.sequences, workload.build_s
        );
    }
    let mut runs = Vec::with_capacity(cfg.repeat.max(1));
    let mut trunk_blocks = 0u64;
    for r in 0..cfg.repeat.max(1) {
        let (run, trunk) = repeat_once(cfg, &mut original, path, entries)?;
        trunk_blocks = trunk;
        if cfg.progress {
            eprintln!(
                "snapshot bench: repeat {}: restart to serving {:.3} s ({:.3} s per 10 M entries)",
                r + 1,
                run.phases.restart_to_serving_s,
                run.phases.restart_s_per_10m_entries
            );
        }
        if run.query_mismatches > 0 {
            problems.push(format!(
                "repeat {}: {} queries answered differently after the restore",
                r + 1,
                run.query_mismatches
            ));
        }
        if run.shard_mismatches > 0 {
            problems.push(format!(
                "repeat {}: {} per-shard entry or block counts differ after the restore",
                r + 1,
                run.shard_mismatches
            ));
        }
        runs.push(run);
    }
    let Original { started, stats, .. } = original;
    shutdown(started)?;
    let mem_after = mem_latency();
    let keys: Vec<&'static str> = Phases::default().pairs().iter().map(|p| p.0).collect();
    let range = Range(
        keys.iter()
            .enumerate()
            .map(|(i, &k)| {
                let v: Vec<f64> = runs
                    .iter()
                    .map(|r| r.phases.pairs().get(i).map_or(0.0, |p| p.1))
                    .collect();
                (k, min_median_max(&v))
            })
            .collect(),
    );
    let median = |key: &str| {
        range
            .0
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0.0, |(_, v)| v[1])
    };
    let per_10m = median("restart_s_per_10m_entries");
    let file_bytes = runs.first().map_or(0, |r| r.file_bytes);
    Ok(SnapshotReport {
        bench: "snapshot",
        entries_target: cfg.entries,
        entries,
        shard_entries: stats.iter().map(|s| s.index.entries).sum(),
        shard_blocks: stats.iter().map(|s| s.index.blocks as u64).sum(),
        trunk_blocks,
        cores: cfg.cores,
        workers: cfg.workers,
        repeat: runs.len(),
        policy: describe,
        restart_to_serving_s: median("restart_to_serving_s"),
        restart_s_per_10m_entries: per_10m,
        goal_s_per_10m_entries: GOAL_S_PER_10M,
        goal_met: per_10m <= GOAL_S_PER_10M,
        file_bytes,
        file_bytes_per_entry: ratio(file_bytes as f64, entries as f64),
        original_heap_bytes,
        dir: path
            .parent()
            .map_or_else(String::new, |d| d.display().to_string()),
        fs: path.parent().and_then(fs_type),
        range,
        runs,
        workload,
        problems,
        mem_latency_ns_before: mem_before,
        mem_latency_ns_after: mem_after,
        machine: Machine::detect(),
        date: crate::report::utc_now(),
        version: crate::report::VERSION,
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

fn heap_bytes(stats: &[CoreSummary]) -> u64 {
    stats
        .iter()
        .map(|s| (s.index.bytes + s.directory_bytes) as u64)
        .sum()
}

fn shutdown(started: Started<Sharding>) -> Result<()> {
    let Started {
        runtime,
        ingest,
        query,
    } = started;
    drop(ingest);
    drop(query);
    runtime.join().context("joining the engine")?;
    Ok(())
}

/// Builds the index (not timed), settles it, and asks it the sample queries.
fn build(
    cfg: &SnapshotConfig,
    mut started: Started<Sharding>,
) -> Result<(Original, Workload, Vec<String>)> {
    let began = Instant::now();
    let mut rng = Rng::new(cfg.seed ^ 0x736E_6170);
    let group_workers = GROUP_WORKERS.min(cfg.workers);
    let mut w = Workload {
        prefix_blocks: PREFIX_BLOCKS,
        tail_blocks: [TAIL_BLOCKS.0, TAIL_BLOCKS.1],
        seqs_per_group: SEQS_PER_GROUP,
        group_workers,
        holders: [HOLDERS.0, HOLDERS.1.min(group_workers)],
        ..Workload::default()
    };
    let ingest = started
        .ingest
        .first_mut()
        .context("the runtime has no ingest handle")?;
    let engine_of = |s: SeqHash| EngineHash(mix64(s.0 ^ 0x656E_6769_6E65));
    let key_of = |worker: u64| WorkerKey {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
    };
    let mut samples: Vec<Vec<SeqHash>> = Vec::with_capacity(SAMPLE_QUERIES);
    let mut batch: Vec<(WorkerKey, KvEvent)> = Vec::with_capacity(SEND_EVENTS);
    let mut all_workers: Vec<u64> = (1..=cfg.workers as u64).collect();
    'groups: while w.distinct_entries < cfg.entries {
        // The group's workers: a random subset.
        for i in 0..group_workers {
            let j = i + rng.below(all_workers.len() - i);
            all_workers.swap(i, j);
        }
        let members: Vec<u64> = all_workers.get(..group_workers).unwrap_or(&[]).to_vec();
        let mut has_prompt = vec![false; members.len()];
        let mut prev = None;
        let prompt: Vec<(SeqHash, StoredBlock)> = (0..PREFIX_BLOCKS)
            .map(|_| {
                let t = TokensHash(rng.next_u64());
                let s = seq_hash(prev, t);
                prev = Some(s);
                (
                    s,
                    StoredBlock {
                        engine_hash: engine_of(s),
                        tokens_hash: t,
                    },
                )
            })
            .collect();
        let prompt_end = prompt.last().map(|p| p.0);
        let prompt_engine = prompt.last().map(|p| p.1.engine_hash);
        w.groups += 1;
        w.distinct_blocks += PREFIX_BLOCKS as u64;
        for _ in 0..SEQS_PER_GROUP {
            let tail_len = TAIL_BLOCKS.0 + rng.below(TAIL_BLOCKS.1 - TAIL_BLOCKS.0 + 1);
            let mut prev = prompt_end;
            let mut chain: Vec<SeqHash> = prompt.iter().map(|p| p.0).collect();
            let tail: Vec<StoredBlock> = (0..tail_len)
                .map(|_| {
                    let t = TokensHash(rng.next_u64());
                    let s = seq_hash(prev, t);
                    prev = Some(s);
                    chain.push(s);
                    StoredBlock {
                        engine_hash: engine_of(s),
                        tokens_hash: t,
                    }
                })
                .collect();
            w.sequences += 1;
            w.distinct_blocks += tail_len as u64;
            // The holders: a random subset of the group's workers.
            let holders = w.holders[0] + rng.below(w.holders[1] - w.holders[0] + 1);
            let mut idx: Vec<usize> = (0..members.len()).collect();
            for i in 0..holders {
                let j = i + rng.below(idx.len() - i);
                idx.swap(i, j);
            }
            for &m in idx.get(..holders).unwrap_or(&[]) {
                let (Some(&worker), Some(has)) = (members.get(m), has_prompt.get_mut(m)) else {
                    continue;
                };
                if !*has {
                    *has = true;
                    batch.push((
                        key_of(worker),
                        KvEvent::Stored {
                            parent: None,
                            blocks: prompt.iter().map(|p| p.1).collect(),
                        },
                    ));
                    w.distinct_entries += PREFIX_BLOCKS as u64;
                }
                batch.push((
                    key_of(worker),
                    KvEvent::Stored {
                        parent: prompt_engine,
                        blocks: tail.clone(),
                    },
                ));
                w.distinct_entries += tail_len as u64;
                if batch.len() >= SEND_EVENTS {
                    w.events += batch.len() as u64;
                    ingest.send(&Arc::from(std::mem::take(&mut batch)))?;
                }
            }
            // Reservoir sample of the sequences, each query its chain plus 4 unknown
            // blocks (so holders match it whole, the group's other workers its prompt).
            for _ in 0..4 {
                let t = TokensHash(rng.next_u64());
                let s = seq_hash(prev, t);
                prev = Some(s);
                chain.push(s);
            }
            if samples.len() < SAMPLE_QUERIES {
                samples.push(chain);
            } else {
                let j = rng.below(w.sequences as usize);
                if let Some(slot) = samples.get_mut(j) {
                    *slot = chain;
                }
            }
            if w.distinct_entries >= cfg.entries {
                break 'groups;
            }
        }
    }
    if !batch.is_empty() {
        w.events += batch.len() as u64;
        ingest.send(&Arc::from(batch))?;
    }
    ingest.settle().context("settling the build")?;
    let stats = ingest.core_stats()?;
    w.build_s = began.elapsed().as_secs_f64();
    let mut problems = Vec::new();
    let rejects: u64 = stats.iter().map(|s| s.rejects.total()).sum();
    let inconsistencies: u64 = stats.iter().map(|s| s.inconsistencies).sum();
    if rejects + inconsistencies > 0 {
        problems.push(format!(
            "the build was refused {rejects} events and had {inconsistencies} inconsistencies"
        ));
    }
    let entries: u64 = stats.iter().map(|s| s.directory_entries as u64).sum();
    if entries != w.distinct_entries {
        problems.push(format!(
            "the directories hold {entries} entries, the generator made {}",
            w.distinct_entries
        ));
    }
    let query = started
        .query
        .first_mut()
        .context("the runtime has no query handle")?;
    let answers = samples
        .iter()
        .map(|q| query.find_matches(q))
        .collect::<engine::Result<Vec<_>>>()?;
    Ok((
        Original {
            started,
            samples,
            answers,
            stats,
        },
        w,
        problems,
    ))
}

/// One timed repeat: cut, encode, write, restart to serving; then the split and the
/// self-checks. Returns the repeat and the trunk's blocks.
fn repeat_once(
    cfg: &SnapshotConfig,
    original: &mut Original,
    path: &Path,
    entries: u64,
) -> Result<(RepeatReport, u64)> {
    let mut p = Phases::default();
    let ingest = original
        .started
        .ingest
        .first_mut()
        .context("the runtime has no ingest handle")?;

    let t = Instant::now();
    let buffers = ingest.snapshot_buffers().context("sizing the snapshot")?;
    p.buffers_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let image = ingest
        .snapshot_into(buffers)
        .context("taking the snapshot")?;
    p.cut_s = t.elapsed().as_secs_f64();
    let trunk_blocks = image.trunk.members.len() as u64;

    let t = Instant::now();
    let bytes = snapshot::encode(&image, b"")?;
    p.encode_s = t.elapsed().as_secs_f64();
    drop(image);
    let file_bytes = bytes.len() as u64;

    let t = Instant::now();
    let write_backend = file::write_atomic(path, bytes).context("writing the snapshot")?;
    p.write_s = t.elapsed().as_secs_f64();

    // Everything the restart uses is made before its window (invariant 1).
    let policy = Sharding::adaptive(cfg.cores)?;
    let first = original
        .samples
        .first()
        .context("no sequence to query")?
        .clone();
    if let Some(release) = cfg.release_memory {
        release();
    }
    let rss_before = rss_bytes();

    // The restart, as bin/src/warm.rs runs it.
    let t0 = Instant::now();
    let (buf, read_backend) = file::read(path).context("reading the snapshot")?;
    let t1 = Instant::now();
    let (img, _meta) = snapshot::decode(&buf)?;
    let t2 = Instant::now();
    let mut restored = start_from(policy, runtime_config(), Some(img))?;
    let t3 = Instant::now();
    let query: &mut QueryHandle<Sharding> = restored
        .query
        .first_mut()
        .context("the restored runtime has no query handle")?;
    let first_answer = query.find_matches(&first)?;
    let t4 = Instant::now();
    p.read_s = (t1 - t0).as_secs_f64();
    p.decode_s = (t2 - t1).as_secs_f64();
    p.rebuild_s = (t3 - t2).as_secs_f64();
    p.first_query_s = (t4 - t3).as_secs_f64();
    p.restart_to_serving_s = (t4 - t0).as_secs_f64();
    p.restart_s_per_10m_entries = ratio(p.restart_to_serving_s * 1e7, entries as f64);

    // The split, for profiling (after the window).
    let body = buf.get(snapshot::HEADER_LEN..).unwrap_or_default();
    let t = Instant::now();
    std::hint::black_box(xxhash_rust::xxh3::xxh3_64(body));
    p.split_checksum_s = t.elapsed().as_secs_f64();
    p.split_validate_s = (p.decode_s - p.split_checksum_s).max(0.0);
    let mut split_policy = Sharding::adaptive(cfg.cores)?;
    split_policy.restore_trunk(&img.trunk);
    let mut trees = Vec::with_capacity(cfg.cores);
    let mut dirs = Vec::with_capacity(cfg.cores);
    for (k, core) in img.cores.iter().enumerate() {
        let mut shard = Shard::new(ShardId(k as u16));
        let t = Instant::now();
        shard.restore_image(core)?;
        trees.push(t.elapsed().as_secs_f64());
        drop(shard);
        let mut ingest = Ingest::new(split_policy.clone());
        let t = Instant::now();
        ingest.restore(core)?;
        dirs.push(t.elapsed().as_secs_f64());
    }
    p.split_trees_s = trees.iter().sum();
    p.split_directories_s = dirs.iter().sum();
    drop(buf);

    // Self-checks.
    if let Some(release) = cfg.release_memory {
        release();
    }
    let rss_after = rss_bytes();
    p.restored_rss_bytes = match (rss_before, rss_after) {
        (Some(b), Some(a)) => a.saturating_sub(b) as f64,
        _ => 0.0,
    };
    let query: &mut QueryHandle<Sharding> = restored
        .query
        .first_mut()
        .context("the restored runtime has no query handle")?;
    let stats = query.core_stats()?;
    p.restored_heap_bytes = heap_bytes(&stats) as f64;
    let mut shard_mismatches = 0u64;
    for (a, b) in stats.iter().zip(&original.stats) {
        shard_mismatches += u64::from(a.index.entries != b.index.entries)
            + u64::from(a.index.blocks != b.index.blocks)
            + u64::from(a.directory_entries != b.directory_entries);
    }
    shard_mismatches += stats.len().abs_diff(original.stats.len()) as u64;
    let mut query_mismatches = u64::from(original.answers.first() != Some(&first_answer));
    for (q, want) in original.samples.iter().zip(&original.answers) {
        if query.find_matches(q)? != *want {
            query_mismatches += 1;
        }
    }
    shutdown(restored)?;
    Ok((
        RepeatReport {
            phases: p,
            split_tree_per_core_s: trees,
            split_directories_per_core_s: dirs,
            file_bytes,
            write_backend: write_backend.as_str(),
            read_backend: read_backend.as_str(),
            query_mismatches,
            shard_mismatches,
        },
        trunk_blocks,
    ))
}

/// The filesystem type of the mount holding `dir`, from `/proc/mounts`.
fn fs_type(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, fs) = (f.next()?, f.next()?, f.next()?);
            dir.starts_with(at).then(|| (at.len(), fs.to_owned()))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, fs)| fs)
}
