//! What the end-to-end ingest benchmarks share (`kvengine bench ingest`): the workload
//! shape, the engine and runtime they start, and the report.
//!
//! Workload: each of `workers` publishers sends `batches` batches; batch `i` stores
//! `stores_per_batch` new sequences of `blocks_per_event` blocks (distinct pseudo-random
//! hashes, no shared prefixes) and removes the sequences batch `i - window` stored, so the
//! index stays bounded. The transports differ in what a batch carries (token ids over ZMQ,
//! hashed blocks over QUIC): see [`crate::ingest_zmq`] and [`crate::ingest_quic`].

use anyhow::{Context, Result};
use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::choice::Sharding;
use serde::Serialize;
use std::sync::Arc;
use transport::hub::{Hub, HubConfig, start_engine};

/// The workload and the machine setup, common to every transport.
#[derive(Clone, Debug)]
pub struct IngestConfig {
    /// Engine cores (shard threads).
    pub cores: usize,
    /// Pin the engine's core threads.
    pub pin_cores: bool,
    /// Sharding: `Some(d)` replicates the first `d` blocks everywhere; `None` (the router's
    /// default) lets the trunk adapt, promoting at `junction_fanout` children.
    pub replicate_depth: Option<u32>,
    /// Children at which the adaptive trunk promotes a block.
    pub junction_fanout: u32,
    /// Tokio worker threads (the transport and the publishers share the runtime).
    pub tokio_threads: usize,
    /// Publishers, one worker id each (1..=workers).
    pub workers: usize,
    /// Batches per publisher.
    pub batches: usize,
    /// New sequences stored per batch (and as many removed).
    pub stores_per_batch: usize,
    /// Blocks per stored sequence.
    pub blocks_per_event: usize,
    /// A batch removes what the batch this many before it stored.
    pub window: usize,
    /// Engine ring capacity (messages).
    pub ring_capacity: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            cores: 2,
            pin_cores: false,
            replicate_depth: None,
            junction_fanout: Adaptive::DEFAULT_JUNCTION_FANOUT,
            tokio_threads: 2,
            workers: 4,
            batches: 1000,
            stores_per_batch: 16,
            blocks_per_event: 16,
            window: 8,
            ring_capacity: 1024,
        }
    }
}

impl IngestConfig {
    /// Refuses empty workloads.
    pub fn check(&self) -> Result<()> {
        anyhow::ensure!(
            self.workers > 0
                && self.batches > 0
                && self.stores_per_batch > 0
                && self.blocks_per_event > 0,
            "workers, batches, stores per batch and blocks per event must be > 0"
        );
        Ok(())
    }

    /// Sequence ids stored by batch `i` and, from batch `window` on, removed by it.
    pub fn sequences(&self, i: usize) -> (std::ops::Range<u64>, Option<std::ops::Range<u64>>) {
        let per = self.stores_per_batch as u64;
        let stored = i as u64 * per..(i as u64 + 1) * per;
        let removed = (i >= self.window).then(|| {
            let j = (i - self.window) as u64;
            j * per..(j + 1) * per
        });
        (stored, removed)
    }

    /// Engine hash of block `j` of sequence `s` of `worker`.
    pub fn engine_hash(worker: u64, s: u64, j: usize) -> u64 {
        crate::workload::mix64((worker << 48) ^ (s << 8) ^ j as u64)
    }

    /// Starts the engine (a hub over it) and a tokio runtime for the transport.
    pub fn start(&self) -> Result<(Arc<Hub>, Runtime, tokio::runtime::Runtime)> {
        self.check()?;
        let engine_cfg = RuntimeConfig {
            ring_capacity: self.ring_capacity,
            pin_cores: self.pin_cores,
            ingest_handles: self.cores.max(1),
            query_handles: 1,
            ..RuntimeConfig::default()
        };
        let (hub, runtime) = start_engine(
            HubConfig {
                scheduler: SchedulerConfig::default(),
            },
            Sharding::configured(self.cores, self.replicate_depth, self.junction_fanout)?,
            engine_cfg,
        )
        .context("starting the engine")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.tokio_threads.max(1))
            .enable_all()
            .build()
            .context("tokio runtime")?;
        Ok((Arc::new(hub), runtime, rt))
    }

    /// Checks that the engine refused nothing, and fills the report.
    pub fn report(
        &self,
        transport: &str,
        hub: &Hub,
        events: u64,
        block_events: u64,
        seconds: f64,
    ) -> Result<IngestReport> {
        let stats = hub.core_stats()?;
        let rejects: u64 = stats.iter().map(|s| s.rejects.total()).sum();
        anyhow::ensure!(rejects == 0, "the engine refused {rejects} events");
        Ok(IngestReport {
            transport: transport.into(),
            cores: self.cores,
            workers: self.workers,
            batches: (self.workers * self.batches) as u64,
            events,
            block_events,
            seconds,
            block_events_per_s: crate::report::rate(block_events, seconds),
            index_entries_after: stats.iter().map(|s| s.directory_entries as u64).sum(),
        })
    }
}

/// Stops the engine once every other holder of the hub is gone.
pub fn stop(hub: Arc<Hub>, runtime: Runtime) -> Result<()> {
    match Arc::try_unwrap(hub) {
        Ok(hub) => {
            drop(hub);
            runtime.join().context("joining the engine")?;
            Ok(())
        }
        Err(_) => anyhow::bail!("the hub is still shared; the engine was not joined"),
    }
}

/// The figures of one run.
#[derive(Clone, Debug, Serialize)]
pub struct IngestReport {
    /// `"zmq"` or `"quic"`.
    pub transport: String,
    /// Engine cores.
    pub cores: usize,
    /// Publishers.
    pub workers: usize,
    /// Batches sent (all publishers).
    pub batches: u64,
    /// KV events sent (stores and removes).
    pub events: u64,
    /// Blocks stored plus blocks removed.
    pub block_events: u64,
    /// Timed seconds.
    pub seconds: f64,
    /// `block_events / seconds`.
    pub block_events_per_s: f64,
    /// Live `(block, worker)` entries afterwards (directory entries over all workers).
    pub index_entries_after: u64,
}
