//! A closed-loop simulated cluster: kvengine's exact index and scheduler routing a workload
//! onto [`SimWorker`]s, the way the edge and the ingest path drive them in production.
//!
//! Per request: hash the prompt once ([`engine::hash::seq_hashes`]), ask the index for
//! overlaps ([`KvIndex::find_matches`]), let the [`Scheduler`] choose a worker key, have that
//! worker serve the request, and feed the events it publishes back into the index. The
//! cluster keeps `concurrency` requests active: before routing a new one it finishes the
//! oldest, on its worker (releasing its blocks) and in the scheduler (freeing its load).
//! Serving is instantaneous, so a request is marked prefilled as soon as it is served.
//!
//! # Invariants
//! 1. One worker per worker key `(w, r)`, `w < workers`, `r < dp_ranks`, each registered with
//!    the scheduler; `workers` is sorted by key.
//! 2. At most `concurrency` requests are active, on the workers and in the scheduler alike.
//! 3. Every event a worker publishes is applied to the index before the next request is
//!    routed, so the index equals the workers' caches at every decision; a refused event is
//!    a bug of the simulator or the engine, and is counted in the report.
//! 4. Deterministic: the same configuration and requests give the same decisions and
//!    counters (only the measured routing time varies).
//!
//! # Concurrency
//! None: a cluster is owned by one thread.

pub mod report;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use engine::hash::{lora_seed, seq_hashes};
use engine::kv_index::KvIndex;
use engine::sched::{RouteMode, RouteOverrides, RouteRequest, Scheduler, SchedulerConfig};
use engine::{RequestId, WorkerKey};

use crate::error::{Result, SimError};
use crate::worker::{Served, SimWorker, WorkerConfig};
use crate::workload::SimRequest;
pub use report::ModeReport;

/// At most this many worker keys (workers times data-parallel ranks).
pub const MAX_WORKER_KEYS: u32 = 4096;

/// At most this many KV blocks over the whole cluster (about 32 bytes each).
pub const MAX_CLUSTER_BLOCKS: u64 = 1 << 25;

/// Everything a simulated cluster is configured with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClusterConfig {
    /// Workers (at least 1).
    pub workers: u32,
    /// Data-parallel ranks per worker (at least 1); each rank is its own engine and cache.
    pub dp_ranks: u32,
    /// The KV cache of each rank.
    pub worker: WorkerConfig,
    /// Requests kept active before the oldest is finished (at least 1).
    pub concurrency: usize,
    /// The routing mode: `kv`, `round-robin` or `random` (`direct` needs a target).
    pub mode: RouteMode,
    /// The scheduler's overlap weight.
    pub overlap_weight: f64,
    /// The scheduler's softmax temperature.
    pub temperature: f64,
    /// Seed of the scheduler's RNG.
    pub seed: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        let sched = SchedulerConfig::default();
        Self {
            workers: 8,
            dp_ranks: 1,
            worker: WorkerConfig {
                kv_blocks: 4096,
                block_size: sched.block_size,
            },
            concurrency: 64,
            mode: RouteMode::Kv,
            overlap_weight: sched.overlap_weight,
            temperature: sched.temperature,
            seed: 0,
        }
    }
}

impl ClusterConfig {
    /// Rejects values outside their documented ranges (the scheduler's own are checked by
    /// [`Scheduler::new`]).
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason| Err(SimError::InvalidConfig { name, reason });
        self.worker.validate()?;
        if self.workers == 0 {
            return bad("workers", "must be positive");
        }
        if self.dp_ranks == 0 {
            return bad("dp_ranks", "must be positive");
        }
        let keys = u64::from(self.workers) * u64::from(self.dp_ranks);
        if keys > u64::from(MAX_WORKER_KEYS) {
            return bad("workers", "workers x dp_ranks must be at most 4096");
        }
        if keys * u64::from(self.worker.kv_blocks) > MAX_CLUSTER_BLOCKS {
            return bad(
                "kv_blocks",
                "workers x dp_ranks x kv_blocks must be at most 2^25",
            );
        }
        if self.concurrency == 0 {
            return bad("concurrency", "must be positive");
        }
        if self.mode == RouteMode::Direct {
            return bad(
                "mode",
                "the simulator routes with kv, round-robin or random",
            );
        }
        Ok(())
    }

    fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.worker.block_size,
            mode: self.mode,
            overlap_weight: self.overlap_weight,
            temperature: self.temperature,
            seed: self.seed,
            ..SchedulerConfig::default()
        }
    }
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The id the cluster gave it.
    pub id: RequestId,
    /// Where it went.
    pub worker: WorkerKey,
    /// The overlap the index predicted on that worker, in blocks.
    pub predicted_blocks: u32,
    /// What the worker really did.
    pub served: Served,
}

/// Counters accumulated over a run.
#[derive(Clone, Debug, Default)]
struct Tally {
    requests: u64,
    prompt_tokens: u64,
    hit_tokens: u64,
    predicted_hit_tokens: u64,
    agreed: u64,
    per_key: Vec<u64>,
    routing: Duration,
    events_applied: u64,
    events_rejected: u64,
    stored_blocks: u64,
    evicted_blocks: u64,
    uncached_blocks: u64,
}

/// The simulated cluster. See the module docs.
#[derive(Debug)]
pub struct Cluster {
    config: ClusterConfig,
    index: KvIndex,
    scheduler: Scheduler,
    workers: Vec<SimWorker>,
    active: VecDeque<(RequestId, usize)>,
    next_id: u64,
    epoch: Instant,
    tally: Tally,
}

impl Cluster {
    /// A cluster of idle workers with empty caches. Fails if `config` is out of range.
    pub fn new(config: ClusterConfig) -> Result<Self> {
        config.validate()?;
        let mut scheduler = Scheduler::new(config.scheduler())?;
        let mut workers = Vec::new();
        for w in 0..config.workers {
            for r in 0..config.dp_ranks {
                let key = WorkerKey::new(u64::from(w), r);
                scheduler.add_worker(key)?;
                workers.push(SimWorker::new(key, config.worker)?);
            }
        }
        workers.sort_by_key(SimWorker::key);
        let tally = Tally {
            per_key: vec![0; workers.len()],
            ..Tally::default()
        };
        Ok(Self {
            config,
            index: KvIndex::new(),
            scheduler,
            workers,
            active: VecDeque::new(),
            next_id: 0,
            epoch: Instant::now(),
            tally,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The index, as the events built it.
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// The workers, sorted by key.
    pub fn workers(&self) -> &[SimWorker] {
        &self.workers
    }

    /// Routes `request`, serves it on the chosen worker and applies the resulting events,
    /// after finishing the oldest requests so that at most `concurrency` are active.
    pub fn handle_request(&mut self, request: &SimRequest) -> Result<Outcome> {
        while self.active.len() >= self.config.concurrency {
            self.finish_oldest()?;
        }
        let id = RequestId(self.next_id);
        let block_size = self.config.worker.block_size;
        // Simulated time: the workload's arrival clock (an absurd one saturates).
        let now = self
            .epoch
            .checked_add(Duration::from_millis(request.arrival_ms))
            .unwrap_or(self.epoch);

        // The routing decision: everything the router does per request, timed.
        let started = Instant::now();
        let seqs = seq_hashes(
            &request.tokens,
            block_size as usize,
            lora_seed(request.lora()),
        );
        let matches = self.index.find_matches(&seqs);
        let index = &self.index;
        let decision = self.scheduler.route(
            now,
            &RouteRequest {
                id,
                blocks: &seqs,
                input_tokens: request.tokens.len() as u64,
                overrides: RouteOverrides::default(),
            },
            &matches,
            |k| index.cached_blocks(k),
        )?;
        self.tally.routing += started.elapsed();
        self.next_id += 1;

        let found = self
            .workers
            .binary_search_by_key(&decision.worker, SimWorker::key)
            .ok();
        let Some((w, worker)) = found.and_then(|w| self.workers.get_mut(w).map(|wk| (w, wk)))
        else {
            // The scheduler only knows the keys registered in `new` (invariant 1).
            self.scheduler.free(id)?;
            return Err(engine::EngineError::UnknownWorker {
                worker: decision.worker.worker,
            }
            .into());
        };
        let served = match worker.serve(id, &request.tokens, request.lora()) {
            Ok(s) => s,
            Err(e) => {
                self.scheduler.free(id)?;
                return Err(e);
            }
        };
        self.scheduler.prefilled(id)?;
        self.active.push_back((id, w));

        let key = worker.key();
        for event in worker.poll_events() {
            match self.index.apply(key, &event) {
                Ok(applied) if applied.unknown == 0 => self.tally.events_applied += 1,
                Ok(_) | Err(_) => self.tally.events_rejected += 1,
            }
        }

        let t = &mut self.tally;
        let bs = u64::from(block_size);
        t.requests += 1;
        t.prompt_tokens += served.prompt_tokens;
        t.hit_tokens += u64::from(served.hit_blocks) * bs;
        t.predicted_hit_tokens += u64::from(decision.overlap_blocks) * bs;
        t.agreed += u64::from(decision.overlap_blocks == served.hit_blocks);
        if let Some(n) = t.per_key.get_mut(w) {
            *n += 1;
        }
        t.stored_blocks += u64::from(served.stored_blocks);
        t.evicted_blocks += u64::from(served.evicted_blocks);
        t.uncached_blocks += u64::from(served.uncached_blocks);
        Ok(Outcome {
            id,
            worker: decision.worker,
            predicted_blocks: decision.overlap_blocks,
            served,
        })
    }

    /// Finishes the oldest active request; returns false if none is active.
    pub fn finish_oldest(&mut self) -> Result<bool> {
        let Some((id, w)) = self.active.pop_front() else {
            return Ok(false);
        };
        if let Some(worker) = self.workers.get_mut(w) {
            worker.finish(id)?;
        }
        self.scheduler.free(id)?;
        Ok(true)
    }

    /// Finishes every active request.
    pub fn finish_all(&mut self) -> Result<()> {
        while self.finish_oldest()? {}
        Ok(())
    }

    /// Requests active now.
    pub fn active_requests(&self) -> usize {
        self.active.len()
    }

    /// The run so far, summarised.
    pub fn report(&self) -> ModeReport {
        ModeReport::new(self)
    }
}

/// Runs `requests` through a fresh cluster configured by `config`, then finishes them all.
pub fn run(
    config: ClusterConfig,
    requests: impl IntoIterator<Item = SimRequest>,
) -> Result<ModeReport> {
    let mut cluster = Cluster::new(config)?;
    for r in requests {
        cluster.handle_request(&r)?;
    }
    cluster.finish_all()?;
    Ok(cluster.report())
}
