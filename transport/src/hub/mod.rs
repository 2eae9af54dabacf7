//! The state one kvengine process shares between its transports (ZMQ, QUIC, HTTP), as
//! parts with one owner per lock, and the facade that orchestrates them:
//!
//! | part | file | holds |
//! |---|---|---|
//! | [`Registry`] | `registry.rs` | workers, ranks, health, stream state |
//! | [`Routing`] | `routing.rs` | every model's namespace (sessions and admission queue included), request ids, reservations, the replica sink, finish wake-ups, the admission queue's waiters (`admission.rs`) |
//! | [`EngineAccess`] | `engine_link.rs` | the engine's handles (threads) or the hosted cores |
//! | [`IngestGate`] | `gate.rs` | the index budget, event counts, unverified keys |
//! | [`Persisted`] | `persisted.rs` | warm-restart resume points |
//!
//! The facade ([`Hub`]) does what needs several parts: registering and removing workers,
//! handing events over, routing a request.
//!
//! # Invariants
//! 1. Events reach the engine only for registered workers; a new dp rank of a registered
//!    worker registers itself (vLLM data-parallel ranks publish separately).
//! 2. One worker's events always travel through the same ingest path
//!    ([`engine_link`]), so the engine applies them in the order they were handed over.
//! 3. A request id is active in the scheduler iff it is in the id map (kept by the sans-IO
//!    [`Router`](engine::router::Router); the namespaces hold one per model).
//! 4. Each served model has its own router and block size ([`engine::router::namespaces`]);
//!    a worker's events are converted at its model's block size and its keys are routed
//!    only by its model's router.
//! 5. The bounds of [`crate::bounds`] hold: while the index is over its memory budget no
//!    store reaches the engine ([`IngestGate`]), and no route makes more of this router's
//!    own requests active than the cap ([`Routing`]).
//! 6. With a replica sink, each route, prefill and finish of this router's own requests is
//!    handed to it in the order it happened ([`Routing`]'s invariant 2).
//! 7. An *unverified* worker key ([`Hub::distrust`]: restored from a snapshot, or its
//!    stream reconnected, and its stream's continuity not proven yet) keeps its blocks but
//!    has overlap 0 in every answer (routing, `/v1/overlap`) and shows as resyncing, until
//!    [`Hub::trust`], a clear, or a batch of its applies; a ZMQ batch (one that carries a
//!    digest) does not end it: the subscriber trusts its ranks once a replay has been
//!    applied, since the replay's first batches are older than what the worker holds now.
//!    So a stale entry is never a hit.
//!
//! # Concurrency
//! Shared as `Arc<Hub>` by every task and thread. Lock order: registry, routing, the
//! unverified keys, an engine handle; checked in debug builds ([`lock_order`]). No hub lock
//! is held across an engine call made on a hosted core.

pub mod admission;
pub mod engine_link;
pub mod entropy;
pub mod events;
pub mod gate;
pub mod lock_order;
pub mod persisted;
pub mod registry;
pub mod replica_sink;
pub mod route;
pub mod routing;
pub mod shadow;
pub mod wakeups;

pub use crate::misses::{SHADOW_WORKER_HEADER, Shadow};
pub use engine_link::{Batch, EngineAccess, Hosted, Threads, start_engine, start_engine_from};
pub use entropy::SystemEntropy;
pub use gate::IngestGate;
pub use persisted::{Persisted, Resume};
pub use registry::{Feed, MAX_RANKS_PER_WORKER, Registration, Registry, StreamState, WorkerInfo};
pub use replica_sink::{LoadSink, ReplicaStats, ReplicaStatus};
pub use routing::{QueueTally, Routing};
pub use wakeups::FinishWakeups;

use crate::bounds::{IndexBudget, Limits};
use crate::error::{Result, TransportError};
use crate::metrics::Metrics;
use engine::approx::ApproxConfig;
use engine::router::ModelSpec;
use engine::router::ids::RequestIds;
use engine::runtime::{IngestHandle, QueryHandle};
use engine::sched::{SchedulerConfig, WorkerLoad};
use engine::sharding::choice::Sharding;
use engine::{DpRank, WorkerId, WorkerKey};
use registry::{RankCheck, WorkerEntry};
use std::collections::BTreeSet;

pub use engine::router::{RouteCall, Routed};
pub use route::Admission;

/// How a hub is set up.
#[derive(Clone, Copy, Debug)]
pub struct HubConfig {
    /// Scheduler settings; its `block_size` is the router's block size.
    pub scheduler: SchedulerConfig,
}

/// See the module docs.
#[derive(Debug)]
pub struct Hub {
    config: HubConfig,
    engine: Box<dyn EngineAccess>,
    registry: Registry,
    routing: Routing,
    gate: IngestGate,
    metrics: Metrics,
    /// Approximate mode (`--no-kv-events`): routing decisions predict the caches.
    approximate: bool,
    persisted: Persisted,
    limits: Limits,
    /// `--shadow`: what the shadow decisions follow ([`shadow`]).
    shadow: Option<Shadow>,
}

fn key(worker: WorkerId, dp_rank: DpRank) -> WorkerKey {
    WorkerKey { worker, dp_rank }
}

impl Hub {
    /// A hub over a started engine's handles (at least one of each).
    pub fn new(
        config: HubConfig,
        ingest: Vec<IngestHandle>,
        query: Vec<QueryHandle<Sharding>>,
    ) -> Result<Self> {
        Self::with_engine(config, Box::new(Threads::new(ingest, query)?))
    }

    /// A hub over cores hosted on the edge's threads ([`engine::runtime::start_hosted`]).
    pub fn hosted(
        config: HubConfig,
        ingest: IngestHandle,
        query: QueryHandle<Sharding>,
    ) -> Result<Self> {
        Self::with_engine(config, Box::new(Hosted::new(ingest, query)))
    }

    /// A hub over `engine`.
    pub fn with_engine(config: HubConfig, engine: Box<dyn EngineAccess>) -> Result<Self> {
        Ok(Self {
            config,
            engine,
            registry: Registry::default(),
            routing: Routing::new(config.scheduler, None, system_ids())?,
            gate: IngestGate::default(),
            metrics: Metrics::default(),
            approximate: false,
            persisted: Persisted::default(),
            limits: Limits::default(),
            shadow: None,
        })
    }

    /// Applies `limits` ([`crate::bounds`]; none by default).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.gate = IngestGate::new(IndexBudget::new(limits.max_index_bytes));
        self.routing
            .cap_reservations(limits.max_reservations_per_client);
        self.routing.set_sessions(limits.sessions);
        self.routing.set_admission(limits.admission);
        self.limits = limits;
        self
    }

    /// Switches to approximate mode (`--no-kv-events`): workers publish no KV events, so
    /// each routing decision is taken as a prediction that the chosen worker now caches the
    /// request's blocks (see [`engine::approx`]). Events are then refused.
    pub fn without_kv_events(mut self, config: ApproxConfig) -> Result<Self> {
        self.routing = Routing::new(self.config.scheduler, Some(config), system_ids())?;
        self.routing
            .cap_reservations(self.limits.max_reservations_per_client);
        self.routing.set_sessions(self.limits.sessions);
        self.routing.set_admission(self.limits.admission);
        self.approximate = true;
        Ok(self)
    }

    // ----- the parts -----

    /// The worker registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The routing state.
    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    /// The ingest gate (budget, unverified keys).
    pub fn gate(&self) -> &IngestGate {
        &self.gate
    }

    /// The warm-restart state (`crate::state`).
    pub fn persisted(&self) -> &Persisted {
        &self.persisted
    }

    /// The transport counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// The bounds in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The index's memory budget and its last reading.
    pub fn index_budget(&self) -> &IndexBudget {
        &self.gate.budget
    }

    /// Whether the hub routes on KV events (false in approximate mode).
    pub fn kv_events(&self) -> bool {
        !self.approximate
    }

    /// The router's block size, in tokens (the default namespace's: `--kv-cache-block-size`).
    pub fn block_size(&self) -> u32 {
        self.config.scheduler.block_size
    }

    /// The block size `worker`'s events are converted at: its model's (the router's for an
    /// unregistered worker).
    pub fn block_size_of(&self, worker: WorkerId) -> u32 {
        self.registry.block_size_of(worker, self.block_size())
    }

    /// Whether `worker` is registered.
    pub fn is_registered(&self, worker: WorkerId) -> bool {
        self.registry.contains(worker)
    }

    /// Declares a served model (before its workers register): it gets its own pool, block
    /// size and router, and is listed by `/v1/models` even while it has no worker.
    pub fn declare_model(&self, spec: &ModelSpec) -> Result<()> {
        self.routing.declare_model(spec)
    }

    /// The namespace a request naming `requested` routes in, with its block size.
    pub fn resolve_model(&self, requested: Option<&str>) -> Result<(String, u32)> {
        self.routing.resolve_model(requested)
    }

    // ----- workers -----

    /// Registers a worker, or adds ranks and addresses to a registered one. Its ranks join
    /// routing. Returns whether it was new. An address that does not parse as a bare worker
    /// URL or `tcp://host:port` endpoint is [`TransportError::Invalid`], naming the field.
    pub fn register(&self, mut reg: Registration) -> Result<bool> {
        // Addresses are stored canonical, and only if they parse (crate::outbound::addr).
        reg.url = crate::outbound::canonical_url(reg.url)?;
        reg.zmq = crate::outbound::canonical_endpoint("zmq", reg.zmq)?;
        reg.replay = crate::outbound::canonical_endpoint("replay", reg.replay)?;
        let mut ranks: BTreeSet<DpRank> = reg.dp_ranks.iter().copied().collect();
        if ranks.is_empty() {
            ranks.insert(DpRank(0));
        }
        let mut registry = self.registry.write();
        let new = !registry.contains_key(&reg.worker);
        let entry = registry
            .entry(reg.worker)
            .or_insert_with(|| WorkerEntry::new(reg.worker, self.block_size()));
        let role = reg.role.unwrap_or(entry.registration.role());
        let model = reg
            .model
            .clone()
            .or_else(|| entry.registration.model.clone())
            .unwrap_or_default();
        let mut routing = self.routing.lock();
        let moved = routing.model_of(reg.worker) != model;
        let router = routing
            .place(reg.worker, &model)
            .map_err(routing::refused)?;
        // A changed role applies to every known rank, not only the ones named now; a worker
        // that changed model joins its new pool with every rank.
        let all: BTreeSet<DpRank> = ranks.union(&entry.ranks).copied().collect();
        let mut added = Ok(());
        for &r in &all {
            if entry.healthy && added.is_ok() {
                added = router.add_worker(key(reg.worker, r), role);
            }
            entry.ranks.insert(r);
        }
        entry.block_size = routing.block_size(&model);
        self.routing.note_pools(&routing);
        drop(routing);
        added?;
        let e = &mut entry.registration;
        e.model = (!model.is_empty()).then_some(model);
        e.role = Some(role);
        e.bootstrap_port = reg.bootstrap_port.or(e.bootstrap_port);
        e.url = reg.url.or(e.url.take());
        e.zmq = reg.zmq.or(e.zmq.take());
        e.replay = reg.replay.or(e.replay.take());
        e.api_key = reg.api_key.or(e.api_key.take());
        e.trtllm_poll = reg.trtllm_poll.or(e.trtllm_poll);
        e.dp_ranks = entry.ranks.iter().copied().collect();
        drop(registry);
        self.registry.bump();
        self.routing.pump();
        if moved && !new {
            // Blocks it cached for its old model are not its new model's.
            for &r in &all {
                self.clear(key(reg.worker, r))?;
            }
        }
        Ok(new)
    }

    /// Checks that `key`'s worker is registered, registering a new rank of it (up to
    /// [`MAX_RANKS_PER_WORKER`]). For events: a worker's ranks are learned from them.
    pub fn admit(&self, key: WorkerKey) -> Result<()> {
        match self.registry.check_rank(key)? {
            RankCheck::Known => Ok(()),
            RankCheck::NewRank => self
                .register(Registration {
                    dp_ranks: vec![key.dp_rank],
                    ..Registration::new(key.worker)
                })
                .map(|_| ()),
        }
    }

    /// Removes a worker: its blocks leave the index and its active requests are freed.
    /// Returns how many of its ranks held blocks, or `None` if it was not registered.
    pub fn remove_worker(&self, worker: WorkerId) -> Result<Option<usize>> {
        if self.registry.write().remove(&worker).is_none() {
            return Ok(None);
        }
        self.registry.bump();
        self.persisted.forget_worker(worker);
        self.gate.forget_worker(worker);
        {
            let mut routing = self.routing.lock();
            routing.unplace(worker);
            self.routing.note_pools(&routing);
        }
        self.routing.pump();
        Ok(Some(self.engine.remove_worker(worker)?))
    }

    /// Takes a worker out of routing (failed health checks) or puts it back. Taking it out
    /// frees its active requests; its blocks stay indexed. Returns whether anything changed.
    pub fn set_healthy(&self, worker: WorkerId, healthy: bool) -> Result<bool> {
        let mut registry = self.registry.write();
        let Some(entry) = registry.get_mut(&worker) else {
            return Err(TransportError::UnknownWorker(worker.0));
        };
        if entry.healthy == healthy {
            return Ok(false);
        }
        entry.healthy = healthy;
        let mut routing = self.routing.lock();
        let mut added = Ok(());
        if let Some(router) = routing.router_of(worker) {
            if healthy {
                let role = entry.registration.role();
                for &r in &entry.ranks {
                    if added.is_ok() {
                        added = router.add_worker(key(worker, r), role);
                    }
                }
            } else {
                router.remove_worker(worker, false);
            }
        }
        self.routing.note_pools(&routing);
        drop(routing);
        drop(registry);
        self.routing.pump();
        added?;
        Ok(true)
    }

    /// Every registered worker, by id.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let registry = self.registry.read();
        let routing = self.routing.lock();
        registry
            .values()
            .map(|e| WorkerInfo {
                registration: e.registration.clone(),
                healthy: e.healthy,
                resyncing: {
                    let mut r = e.resyncing.clone();
                    r.extend(self.gate.unverified_ranks(e.registration.worker));
                    r.into_iter().collect()
                },
                config_error: e.config_error.clone(),
                health_error: e.health_error.clone(),
                events: e.events,
                stream: e.stream,
                loads: e
                    .ranks
                    .iter()
                    .map(|&r| {
                        let k = key(e.registration.worker, r);
                        let router = routing.router_of_ref(k.worker);
                        (
                            r,
                            router.and_then(|x| x.active_load(k)),
                            router.and_then(|x| x.reported_load(k)),
                        )
                    })
                    .collect(),
                degraded: e.degraded.iter().copied().collect(),
                kv_capacity: e.kv_capacity.iter().map(|(&r, &b)| (r, b)).collect(),
            })
            .collect()
    }

    /// Records the load a worker rank reported. The rank must be known (registered, or
    /// seen in the worker's events): a load report never creates a routing candidate.
    pub fn update_load(&self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        load.validate()?;
        match self.registry.check_rank(key) {
            Ok(RankCheck::Known) => self.routing.update_load(key, load),
            // A rank the worker does not have is unknown, whether or not it could join.
            Ok(RankCheck::NewRank) | Err(TransportError::TooManyRanks { .. }) => {
                Err(TransportError::UnknownRank {
                    worker: key.worker.0,
                    dp_rank: key.dp_rank.0,
                })
            }
            Err(e) => Err(e),
        }
    }
}

/// Request ids drawn from the system's CSPRNG ([`SystemEntropy`]).
fn system_ids() -> RequestIds {
    RequestIds::new(Box::new(SystemEntropy::default()))
}
