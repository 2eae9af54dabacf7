//! What a `KvIndexer` and a `KvRouter` share: the hub over a running engine (shard threads
//! of their own, unpinned: this is a guest in someone else's process), and, from the first
//! `subscribe_zmq`, a one-thread tokio runtime running the ZMQ subscriptions.
//!
//! # Invariants
//! 1. Every engine call from Python goes through the hub with the GIL released (callers use
//!    `Python::detach`), so Python threads run while the index works, and a thread holding
//!    the GIL never waits for a hub lock (see `router.rs` for why that matters).
//! 2. Dropping the last handle stops the subscriptions, then drops the hub, then joins the
//!    shard threads: nothing outlives the Python object but what the process exit reaps.

use crate::error::from_transport;
use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::choice::Sharding;
use engine::{WorkerId, WorkerKey};
use pyo3::PyResult;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use transport::hub::{Hub, HubConfig, Registration, start_engine};
use transport::sources::{Sources, SourcesConfig};
use transport::zmq::ZmqSource;

/// Engine settings a caller may choose.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EngineSettings {
    pub scheduler: SchedulerConfig,
    pub cores: usize,
    pub ring_capacity: usize,
    pub call_timeout: Duration,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Shared {
    hub: Option<Arc<Hub>>,
    runtime: Option<Runtime>,
    io: OnceLock<tokio::runtime::Runtime>,
    /// The workers' event sources ([`transport::sources`]), on `io`.
    sources: OnceLock<Arc<Sources>>,
    /// Workers seen with a data-parallel rank other than 0 (their matches are keyed by
    /// `(worker_id, dp_rank)`, as Dynamo keys them).
    ranked: Mutex<BTreeSet<WorkerId>>,
    cores: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Starts `settings.cores` shard threads and a hub over them.
    pub(crate) fn start(settings: EngineSettings) -> PyResult<Arc<Self>> {
        let cores = settings.cores.max(1);
        let sharding = Sharding::configured(cores, None, Adaptive::DEFAULT_JUNCTION_FANOUT)
            .map_err(crate::error::from_engine)?;
        let engine = RuntimeConfig {
            ring_capacity: settings.ring_capacity,
            pin_cores: false,
            ingest_handles: cores,
            query_handles: 2 * cores,
            call_timeout: settings.call_timeout,
            ..RuntimeConfig::default()
        };
        let config = HubConfig {
            scheduler: settings.scheduler,
        };
        let (hub, runtime) = start_engine(config, sharding, engine).map_err(from_transport)?;
        Ok(Arc::new(Self {
            hub: Some(Arc::new(hub)),
            runtime: Some(runtime),
            io: OnceLock::new(),
            sources: OnceLock::new(),
            ranked: Mutex::new(BTreeSet::new()),
            cores,
        }))
    }

    /// The hub.
    pub(crate) fn hub(&self) -> &Arc<Hub> {
        // Only `drop` takes it out.
        self.hub
            .as_ref()
            .unwrap_or_else(|| unreachable!("the hub lives until drop"))
    }

    /// Shard threads.
    pub(crate) fn cores(&self) -> usize {
        self.cores
    }

    /// Registers `worker` if it is not yet (its rank 0 then joins routing).
    pub(crate) fn ensure_worker(&self, worker: WorkerId) -> PyResult<()> {
        let hub = self.hub();
        if !hub.is_registered(worker) {
            hub.register(Registration::new(worker))
                .map_err(from_transport)?;
        }
        Ok(())
    }

    /// Notes that `key` exists (for the keys of match results).
    pub(crate) fn note_rank(&self, key: WorkerKey) {
        if key.dp_rank.0 != 0 {
            lock(&self.ranked).insert(key.worker);
        }
    }

    /// Notes the ranks of a query's matched keys and says, per key, whether its worker's
    /// matches are keyed with their rank (one lock for the whole answer).
    pub(crate) fn note_and_check_ranks(&self, overlaps: &[(WorkerKey, u32)]) -> Vec<bool> {
        let mut ranked = lock(&self.ranked);
        for &(key, _) in overlaps {
            if key.dp_rank.0 != 0 {
                ranked.insert(key.worker);
            }
        }
        overlaps
            .iter()
            .map(|(key, _)| ranked.contains(&key.worker))
            .collect()
    }

    /// Forgets a removed worker's rank note and subscription.
    pub(crate) fn forget(&self, worker: WorkerId) {
        lock(&self.ranked).remove(&worker);
        if let Some(sources) = self.sources.get() {
            sources.stop(worker);
        }
    }

    /// Subscribes to `source` (replacing an earlier subscription of the same worker).
    pub(crate) fn subscribe(&self, source: ZmqSource) -> PyResult<()> {
        let hub = self.hub();
        hub.register(Registration {
            zmq: Some(source.publisher.clone()),
            replay: source.replay.clone(),
            ..Registration::new(source.worker)
        })
        .map_err(from_transport)?;
        let io = match self.io.get() {
            Some(io) => io,
            None => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("kvengine-zmq")
                    .enable_all()
                    .build()
                    .map_err(|e| {
                        pyo3::exceptions::PyOSError::new_err(format!(
                            "cannot start the ZMQ runtime: {e}"
                        ))
                    })?;
                // Another thread may have won the race; its runtime is used and ours dropped.
                let _ = self.io.set(rt);
                self.io.get().ok_or_else(|| {
                    pyo3::exceptions::PyRuntimeError::new_err("the ZMQ runtime did not start")
                })?
            }
        };
        let sources = self.sources.get_or_init(|| {
            Sources::new(
                Arc::clone(hub),
                SourcesConfig::default(),
                io.handle().clone(),
            )
        });
        // A worker subscribes to one publisher: a new one replaces the old.
        sources.stop_except(source.worker, &source.publisher);
        sources.subscribe(source);
        Ok(())
    }

    /// Workers with a running subscription.
    pub(crate) fn subscribed(&self) -> Vec<WorkerId> {
        self.sources.get().map(|s| s.workers()).unwrap_or_default()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Aborts every subscription (and drops its hub handle).
        drop(self.sources.take());
        if let Some(io) = self.io.take() {
            // Drops the aborted tasks (and their hub handles) before returning.
            io.shutdown_timeout(Duration::from_secs(2));
        }
        let hub = self.hub.take();
        let last = hub.map(|h| Arc::strong_count(&h) == 1);
        if let (Some(true), Some(runtime)) = (last, self.runtime.take()) {
            // The hub (and its engine handles) is gone: the shard threads stop.
            let _ = runtime.join();
        }
    }
}
