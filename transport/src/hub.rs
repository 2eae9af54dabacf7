//! The state one kvengine process shares between its transports (ZMQ, QUIC, HTTP): the
//! engine's handles, the scheduler, the worker registry, request ids and the counters.
//!
//! # Invariants
//! 1. Events reach the engine only for registered workers; a new dp rank of a registered
//!    worker registers itself (vLLM data-parallel ranks publish separately).
//! 2. One worker's events always travel through the same ingest handle (handle
//!    `home(worker) % n`), so the engine applies them in the order they were handed over.
//! 3. A request id is active in the scheduler iff it is in the id map (kept by the sans-IO
//!    [`Router`](engine::router::Router), which holds the scheduler, request ids, cached totals and approximate
//!    mode; the hub drives it under one mutex and feeds it the index's overlaps).
//! 4. Each served model has its own router and block size ([`crate::models`]); a worker's
//!    events are converted at its model's block size and its keys are routed only by its
//!    model's router.
//! 5. The bounds of [`crate::bounds`] hold: while the index is over its memory budget no
//!    store reaches the engine, and no route makes more of this router's own requests
//!    active than the cap (peer replicas' requests are theirs to bound).
//! 6. With a replica sink ([`crate::replicas`]), each route, prefill and finish of this
//!    router's own requests is handed to it under the routing lock, once the state changed,
//!    so the sink sees them in the order they happened.
//! 7. An *unverified* worker key ([`Hub::distrust`]: restored from a snapshot, or its
//!    stream reconnected, and its stream's continuity not proven yet) keeps its blocks but
//!    has overlap 0 in every answer (routing, `/v1/overlap`) and shows as resyncing, until
//!    [`Hub::trust`], a clear, or a batch of its applies; a ZMQ batch (one that carries a
//!    digest) does not end it: the subscriber trusts its ranks once a replay has been
//!    applied, since the replay's first batches are older than what the worker holds now.
//!    So a stale entry is never a hit.
//!
//! # Concurrency
//! Shared as `Arc<Hub>` by every task and thread. The engine is reached one of two ways:
//! * cores on threads of their own ([`start_engine`]): engine handles are `Send` but not
//!   `Sync`, so each sits behind its own mutex; queries take whichever query handle is free;
//! * cores hosted on the edge's threads ([`Hub::hosted`], [`crate::cores`]): a call made on
//!   a core thread goes through that thread's core (a query for its shard answered in place,
//!   anything else over its rings while it keeps stepping its core); a call from any other
//!   thread takes the shared fallback handles.
//!
//! Lock order: registry, then routing, then a handle; never the reverse. No hub lock is held
//! across an engine call (on a hosted core, a thread blocked on such a lock could be the
//! core the call waits for).

use crate::bounds::{Degraded, IndexBudget, Limits};
use crate::cores;
use crate::error::{DropReason, Result, TransportError};
use crate::metrics::Metrics;
use crate::models::{DEFAULT_MODEL, ModelError, ModelSpec, Namespaces};
use crate::replicas::LoadSink;
use crate::reservations::ClientId;
use engine::approx::ApproxConfig;
use engine::directories::Applied;
use engine::event::KvEvent;
use engine::hash::{lora_seed, seq_hashes, seq_hashes_salted};
use engine::router::{NameError, RouteError, check_request_id};
use engine::runtime::{CoreHost, CoreSummary, IngestHandle, QueryHandle, home_core};
use engine::sched::{ActiveLoad, Policy, SchedulerConfig, WorkerLoad, WorkerRole};
use engine::sharding::choice::Sharding;
use engine::snapshot::{EngineImage, StreamMark};
use engine::{DpRank, EngineError, Matches, SeqHash, WorkerId, WorkerKey};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Instant;

/// How a hub is set up.
#[derive(Clone, Copy, Debug)]
pub struct HubConfig {
    /// Scheduler settings; its `block_size` is the router's block size.
    pub scheduler: SchedulerConfig,
}

/// A worker as registered (over HTTP, `--zmq-worker`, or a QUIC hello).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel ranks (empty: rank 0).
    pub dp_ranks: Vec<DpRank>,
    /// Its HTTP base URL (health-checked and, for the OpenAI proxy, forwarded to). Stored
    /// as [`crate::outbound::WorkerUrl`]'s canonical text ([`Hub::register`] checks).
    pub url: Option<String>,
    /// Its ZMQ KV-event publisher (a canonical [`crate::outbound::ZmqEndpoint`]).
    pub zmq: Option<String>,
    /// Its ZMQ replay endpoint (a canonical [`crate::outbound::ZmqEndpoint`]).
    pub replay: Option<String>,
    /// Its role in a disaggregated deployment (`None`: keep the registered one, aggregated
    /// for a new worker).
    pub role: Option<WorkerRole>,
    /// SGLang prefill workers: the KV bootstrap port decode workers connect to
    /// (`--disaggregation-bootstrap-port`).
    pub bootstrap_port: Option<u16>,
    /// Its API key (vLLM `--api-key`): sent as `Authorization: Bearer` on the requests the
    /// front door forwards to it, instead of the client's. Never shown.
    pub api_key: Option<String>,
    /// The model it serves (`None`: keep the registered one; the default namespace for a
    /// new worker). See [`crate::models`].
    pub model: Option<String>,
    /// A TensorRT-LLM worker: its KV events are polled from `{url}/kv_cache_events` at this
    /// interval ([`crate::trtllm`]; `None`: keep the registered one, none for a new worker).
    pub trtllm_poll: Option<std::time::Duration>,
}

impl Registration {
    /// A worker with rank 0 and no addresses.
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            dp_ranks: Vec::new(),
            url: None,
            zmq: None,
            replay: None,
            role: None,
            bootstrap_port: None,
            api_key: None,
            model: None,
            trtllm_poll: None,
        }
    }

    /// The role this registration routes with.
    pub fn role(&self) -> WorkerRole {
        self.role.unwrap_or_default()
    }
}

/// The most data-parallel ranks one worker may have: ranks first seen in its events
/// register themselves (vLLM's ranks publish separately), and without a cap a stream of
/// made-up rank numbers would grow the router's tables without end.
pub const MAX_RANKS_PER_WORKER: usize = 256;

fn key(worker: WorkerId, dp_rank: DpRank) -> WorkerKey {
    WorkerKey { worker, dp_rank }
}

/// A registered worker, as `/v1/workers` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerInfo {
    /// Registration details (ranks as currently known).
    pub registration: Registration,
    /// Whether it takes part in routing (false after failed health checks).
    pub healthy: bool,
    /// Ranks routed as uncached: their event stream broke and was cleared (until a batch
    /// applies), or their blocks await proof of continuity (restored from a snapshot, or
    /// the stream reconnected: [`Hub::distrust`]).
    pub resyncing: Vec<DpRank>,
    /// The first configuration error seen in its events (a foreign block size).
    pub config_error: Option<String>,
    /// Why its last health check failed (`None`: it passed, or none ran yet).
    pub health_error: Option<String>,
    /// KV events handed to the engine for it.
    pub events: u64,
    /// Its ZMQ event stream, if the router subscribes to one.
    pub stream: Option<StreamState>,
    /// Per rank: active load from routed requests and the load it last reported.
    pub loads: Vec<(DpRank, Option<ActiveLoad>, Option<WorkerLoad>)>,
    /// Ranks whose stores the bounds refused, and why ([`crate::bounds`]).
    pub degraded: Vec<(DpRank, Degraded)>,
    /// Per rank: its GPU KV cache in blocks, where the worker reports it (TensorRT-LLM's
    /// `created` event).
    pub kv_capacity: Vec<(DpRank, u64)>,
}

/// Where the router's subscription to a worker's ZMQ event stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamState {
    /// Not connected yet (the publisher is not up, or not reachable): the router does not
    /// see what this worker caches.
    Connecting,
    /// Connected and subscribed.
    Subscribed,
}

impl StreamState {
    /// Its name in `/v1/workers` and `/ready`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Subscribed => "subscribed",
        }
    }
}

#[derive(Debug)]
struct WorkerEntry {
    registration: Registration,
    ranks: BTreeSet<DpRank>,
    healthy: bool,
    resyncing: BTreeSet<DpRank>,
    config_error: Option<String>,
    health_error: Option<String>,
    events: u64,
    stream: Option<StreamState>,
    /// Its model's block size (what its events are converted at).
    block_size: u32,
    /// Ranks whose stores the bounds refused, and why.
    degraded: BTreeSet<(DpRank, Degraded)>,
    /// GPU KV cache size in blocks per rank, where reported.
    kv_capacity: BTreeMap<DpRank, u64>,
}

pub use engine::router::{RouteCall, Routed};

/// See the module docs.
#[derive(Debug)]
pub struct Hub {
    config: HubConfig,
    engine: Engine,
    /// Per model: scheduler, request ids, cached totals, approximate mode. One lock, held
    /// for one decision.
    routing: Mutex<Namespaces>,
    registry: RwLock<BTreeMap<WorkerId, WorkerEntry>>,
    metrics: Metrics,
    /// Approximate mode (`--no-kv-events`): routing decisions predict the caches.
    approximate: bool,
    /// Whether some model has healthy prefill and decode workers both registered (the front
    /// door then disaggregates its requests): kept with the schedulers' pools, read without
    /// a lock per request.
    disaggregating: AtomicBool,
    /// What a warm restart needs: where each restored stream resumes, and which workers
    /// were registered over the API (the snapshot keeps those).
    persisted: crate::state::Persisted,
    /// Caps on memory and work ([`crate::bounds`]).
    limits: Limits,
    /// The index's memory budget and its last reading.
    budget: IndexBudget,
    /// Router replicas ([`crate::replicas`]): where this router's load events go.
    replicas: OnceLock<Arc<dyn LoadSink>>,
    /// TensorRT-LLM workers' pollers, woken when a request finishes on their worker.
    trtllm_pokes: crate::trtllm::Pokes,
    /// Worker keys whose blocks are not trusted yet (invariant 7).
    unverified: Unverified,
}

/// Worker keys routed as uncached until their stream proves continuity (invariant 7). One
/// atomic load per query while there are none.
#[derive(Debug, Default)]
struct Unverified {
    any: AtomicBool,
    keys: Mutex<BTreeSet<WorkerKey>>,
}

impl Unverified {
    fn insert(&self, key: WorkerKey) {
        let mut keys = lock(&self.keys);
        keys.insert(key);
        self.any.store(true, Relaxed);
    }

    fn remove(&self, key: WorkerKey) {
        if !self.any.load(Relaxed) {
            return;
        }
        let mut keys = lock(&self.keys);
        keys.remove(&key);
        self.any.store(!keys.is_empty(), Relaxed);
    }

    fn forget_worker(&self, worker: WorkerId) {
        if !self.any.load(Relaxed) {
            return;
        }
        let mut keys = lock(&self.keys);
        keys.retain(|k| k.worker != worker);
        self.any.store(!keys.is_empty(), Relaxed);
    }

    fn ranks_of(&self, worker: WorkerId) -> Vec<DpRank> {
        if !self.any.load(Relaxed) {
            return Vec::new();
        }
        lock(&self.keys)
            .iter()
            .filter(|k| k.worker == worker)
            .map(|k| k.dp_rank)
            .collect()
    }

    /// `matches` without the unverified keys' overlaps.
    fn filter(&self, matches: Matches) -> Matches {
        if !self.any.load(Relaxed) {
            return matches;
        }
        let keys = lock(&self.keys);
        if !matches.overlaps.iter().any(|(k, _)| keys.contains(k)) {
            return matches;
        }
        Matches::from_overlaps(
            matches
                .overlaps
                .into_iter()
                .filter(|(k, _)| !keys.contains(k)),
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a hub lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Hub {
    /// A hub over a started engine's handles (at least one of each).
    pub fn new(
        config: HubConfig,
        ingest: Vec<IngestHandle>,
        query: Vec<QueryHandle<Sharding>>,
    ) -> Result<Self> {
        let (Some(ingest), Some(query)) = (Handles::new(ingest), Handles::new(query)) else {
            return Err(TransportError::Invalid {
                name: "hub",
                reason: "needs at least one ingest and one query handle".into(),
            });
        };
        let engine = Engine::Threads {
            ingest,
            query,
            next_query: AtomicUsize::new(0),
        };
        Self::with_engine(config, engine)
    }

    /// A hub over cores hosted on the edge's threads ([`engine::runtime::start_hosted`]):
    /// calls made on a core thread go through its core ([`crate::cores`]); `ingest` and
    /// `query` serve calls from any other thread.
    pub fn hosted(
        config: HubConfig,
        ingest: IngestHandle,
        query: QueryHandle<Sharding>,
    ) -> Result<Self> {
        let engine = Engine::Hosted {
            ingest: Mutex::new(ingest),
            query: Mutex::new(query),
        };
        Self::with_engine(config, engine)
    }

    fn with_engine(config: HubConfig, engine: Engine) -> Result<Self> {
        Ok(Self {
            config,
            engine,
            routing: Mutex::new(Namespaces::new(config.scheduler, None)?),
            registry: RwLock::new(BTreeMap::new()),
            metrics: Metrics::default(),
            approximate: false,
            disaggregating: AtomicBool::new(false),
            persisted: crate::state::Persisted::default(),
            limits: Limits::default(),
            budget: IndexBudget::default(),
            replicas: OnceLock::new(),
            trtllm_pokes: crate::trtllm::Pokes::default(),
            unverified: Unverified::default(),
        })
    }

    /// Shares this router's load with peer replicas through `sink` from now on (once;
    /// false if a sink was set already).
    pub fn set_replicas(&self, sink: Arc<dyn LoadSink>) -> bool {
        self.replicas.set(sink).is_ok()
    }

    /// The replica sink, if this router is one of several replicas.
    pub fn replicas(&self) -> Option<&Arc<dyn LoadSink>> {
        self.replicas.get()
    }

    /// Runs `f` under the routing lock (the replica link applies peers' load with it).
    pub(crate) fn with_routing<R>(&self, f: impl FnOnce(&mut Namespaces) -> R) -> R {
        f(&mut lock(&self.routing))
    }

    /// Applies `limits` ([`crate::bounds`]; none by default).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.budget = IndexBudget::new(limits.max_index_bytes);
        lock(&self.routing).reservations =
            crate::reservations::Reservations::new(limits.max_reservations_per_client);
        self.limits = limits;
        self
    }

    /// The bounds in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The index's memory budget and its last reading.
    pub fn index_budget(&self) -> &IndexBudget {
        &self.budget
    }

    /// Switches to approximate mode (`--no-kv-events`): workers publish no KV events, so
    /// each routing decision is taken as a prediction that the chosen worker now caches the
    /// request's blocks (see [`engine::approx`]). Events are then refused.
    pub fn without_kv_events(mut self, config: ApproxConfig) -> Result<Self> {
        self.routing = Mutex::new(Namespaces::new(self.config.scheduler, Some(config))?);
        self.approximate = true;
        Ok(self)
    }

    /// Whether the hub routes on KV events (false in approximate mode).
    pub fn kv_events(&self) -> bool {
        !self.approximate
    }

    fn refuse_events_if_approximate(&self) -> Result<()> {
        match self.approximate {
            false => Ok(()),
            true => Err(TransportError::Invalid {
                name: "events",
                reason: "KV events are disabled on this router (--no-kv-events)".into(),
            }),
        }
    }

    /// The request's overlaps from the index, or from `model`'s predictions in approximate
    /// mode.
    fn find_matches(&self, model: &str, seqs: &[SeqHash], now: Instant) -> Result<Matches> {
        if self.approximate
            && let Some(m) = lock(&self.routing)
                .get_mut(model)
                .and_then(|ns| ns.router.predicted_matches(now, seqs))
        {
            return Ok(m);
        }
        let matches = self.on_query(&mut |q| q.find_matches(seqs))?;
        Ok(self.unverified.filter(matches))
    }

    /// The router's block size, in tokens (the default namespace's: `--kv-cache-block-size`).
    pub fn block_size(&self) -> u32 {
        self.config.scheduler.block_size
    }

    /// The block size `worker`'s events are converted at: its model's (the router's for an
    /// unregistered worker).
    pub fn block_size_of(&self, worker: WorkerId) -> u32 {
        self.registry_read()
            .get(&worker)
            .map_or(self.block_size(), |e| e.block_size)
    }

    /// The block size of `model`'s namespace (the router's for an unknown one).
    pub fn block_size_in(&self, model: &str) -> u32 {
        lock(&self.routing).block_size(model)
    }

    // ----- models -----

    /// Declares a served model (before its workers register): it gets its own pool, block
    /// size and router, and is listed by `/v1/models` even while it has no worker.
    pub fn declare_model(&self, spec: &ModelSpec) -> Result<()> {
        lock(&self.routing).declare(spec)
    }

    /// The namespace a request naming `requested` routes in, with its block size (see
    /// [`crate::models`] for the rules).
    pub fn resolve_model(&self, requested: Option<&str>) -> Result<(String, u32)> {
        let routing = lock(&self.routing);
        match routing.resolve(requested) {
            Ok(m) => Ok((m.to_owned(), routing.block_size(m))),
            Err(ModelError::NotFound(m)) => Err(TransportError::UnknownModel(m)),
            Err(ModelError::Required(all)) => Err(TransportError::Invalid {
                name: "model",
                reason: format!("this router serves several models ({all:?}); name one"),
            }),
        }
    }

    /// The served models by name (the default namespace excluded), each with whether it
    /// has a healthy worker.
    pub fn models(&self) -> Vec<(String, bool)> {
        let routing = lock(&self.routing);
        routing
            .iter()
            .filter(|(m, _)| *m != DEFAULT_MODEL)
            .map(|(m, ns)| (m.to_owned(), ns.router.routable_workers() > 0))
            .collect()
    }

    /// The model `worker` serves ([`DEFAULT_MODEL`] if it named none or is unknown).
    pub fn model_of(&self, worker: WorkerId) -> String {
        lock(&self.routing).model_of(worker).to_owned()
    }

    /// The configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// The transport counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn registry_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<WorkerId, WorkerEntry>> {
        self.registry
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn registry_write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<WorkerId, WorkerEntry>> {
        self.registry
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the engine for `worker`'s events: this thread's core where it is one,
    /// otherwise the worker's ingest handle (so one worker's events keep one path and their
    /// order).
    fn on_ingest<R>(&self, worker: WorkerId, f: &mut dyn FnMut(&mut dyn EngineOps) -> R) -> R {
        match &self.engine {
            Engine::Threads { ingest, .. } => f(&mut *lock(
                ingest.get(home_core(worker, ingest.len()).idx()),
            )),
            Engine::Hosted { ingest, .. } => match cores::with_core(|c| f(c)) {
                Some(r) => r,
                None => f(&mut *lock(ingest)),
            },
        }
    }

    /// Runs `f` on the engine for a query: this thread's core where it is one, otherwise
    /// whichever query handle is free.
    fn on_query<R>(&self, f: &mut dyn FnMut(&mut dyn QueryOps) -> R) -> R {
        match &self.engine {
            Engine::Threads {
                query, next_query, ..
            } => {
                let n = query.len();
                let start = next_query.fetch_add(1, Relaxed);
                for i in 0..n {
                    if let Ok(mut h) = query.get(start.wrapping_add(i) % n).try_lock() {
                        return f(&mut *h);
                    }
                }
                f(&mut *lock(query.get(start % n)))
            }
            Engine::Hosted { query, .. } => match cores::with_core(|c| f(c)) {
                Some(r) => r,
                None => f(&mut *lock(query)),
            },
        }
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
        let mut registry = self.registry_write();
        let new = !registry.contains_key(&reg.worker);
        let default_block_size = self.block_size();
        let entry = registry.entry(reg.worker).or_insert_with(|| WorkerEntry {
            registration: Registration::new(reg.worker),
            ranks: BTreeSet::new(),
            healthy: true,
            resyncing: BTreeSet::new(),
            config_error: None,
            health_error: None,
            events: 0,
            stream: None,
            block_size: default_block_size,
            degraded: BTreeSet::new(),
            kv_capacity: BTreeMap::new(),
        });
        let role = reg.role.unwrap_or(entry.registration.role());
        let model = reg
            .model
            .clone()
            .or_else(|| entry.registration.model.clone())
            .unwrap_or_default();
        let mut routing = lock(&self.routing);
        let moved = routing.model_of(reg.worker) != model;
        let router = routing.place(reg.worker, &model)?;
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
        self.note_pools(&routing);
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
        if moved && !new {
            // Blocks it cached for its old model are not its new model's.
            for &r in &all {
                self.clear(key(reg.worker, r))?;
            }
        }
        Ok(new)
    }

    /// Whether `worker` is registered.
    pub fn is_registered(&self, worker: WorkerId) -> bool {
        self.registry_read().contains_key(&worker)
    }

    /// Checks that `key`'s worker is registered, registering a new rank of it (up to
    /// [`MAX_RANKS_PER_WORKER`]). For events: a worker's ranks are learned from them.
    pub fn admit(&self, key: WorkerKey) -> Result<()> {
        {
            let registry = self.registry_read();
            match registry.get(&key.worker) {
                None => return Err(TransportError::UnknownWorker(key.worker.0)),
                Some(e) if e.ranks.contains(&key.dp_rank) => return Ok(()),
                Some(e) if e.ranks.len() >= MAX_RANKS_PER_WORKER => {
                    return Err(TransportError::TooManyRanks {
                        worker: key.worker.0,
                        limit: MAX_RANKS_PER_WORKER,
                    });
                }
                Some(_) => {}
            }
        }
        self.register(Registration {
            dp_ranks: vec![key.dp_rank],
            ..Registration::new(key.worker)
        })
        .map(|_| ())
    }

    /// Removes a worker: its blocks leave the index and its active requests are freed.
    /// Returns how many of its ranks held blocks, or `None` if it was not registered.
    pub fn remove_worker(&self, worker: WorkerId) -> Result<Option<usize>> {
        let mut registry = self.registry_write();
        if registry.remove(&worker).is_none() {
            return Ok(None);
        }
        drop(registry);
        self.persisted.forget_worker(worker);
        self.unverified.forget_worker(worker);
        {
            let mut routing = lock(&self.routing);
            routing.unplace(worker);
            self.note_pools(&routing);
        }
        let dropped = self.on_ingest(worker, &mut |e| e.remove_worker(worker))?;
        Ok(Some(dropped))
    }

    /// Is `worker` registered?
    pub fn registered(&self, worker: WorkerId) -> bool {
        self.registry_read().contains_key(&worker)
    }

    /// Takes a worker out of routing (failed health checks) or puts it back. Taking it out
    /// frees its active requests; its blocks stay indexed. Returns whether anything changed.
    pub fn set_healthy(&self, worker: WorkerId, healthy: bool) -> Result<bool> {
        let mut registry = self.registry_write();
        let Some(entry) = registry.get_mut(&worker) else {
            return Err(TransportError::UnknownWorker(worker.0));
        };
        if entry.healthy == healthy {
            return Ok(false);
        }
        entry.healthy = healthy;
        let mut routing = lock(&self.routing);
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
        self.note_pools(&routing);
        added?;
        Ok(true)
    }

    /// Records a configuration error in `worker`'s events; returns true the first time (so
    /// the caller logs once per worker).
    pub fn note_config_error(&self, worker: WorkerId, message: String) -> bool {
        let mut registry = self.registry_write();
        match registry.get_mut(&worker) {
            Some(e) if e.config_error.is_none() => {
                e.config_error = Some(message);
                true
            }
            _ => false,
        }
    }

    /// Records the outcome of `worker`'s last health check (`None`: it passed), shown in
    /// `/v1/workers` and `/ready`. Unknown workers are ignored.
    pub fn note_health(&self, worker: WorkerId, error: Option<String>) {
        // Most rounds change nothing: no write lock for them.
        let same = |e: &WorkerEntry| e.health_error == error;
        if self.registry_read().get(&worker).is_none_or(same) {
            return;
        }
        if let Some(e) = self.registry_write().get_mut(&worker) {
            e.health_error = error;
        }
    }

    /// Records where the subscription to `worker`'s event stream stands (the ZMQ
    /// subscriber calls this; `/ready` reads it). Unknown workers are ignored.
    pub fn note_stream(&self, worker: WorkerId, state: StreamState) {
        if let Some(e) = self.registry_write().get_mut(&worker) {
            e.stream = Some(state);
        }
    }

    /// The wake-ups of TensorRT-LLM workers' pollers ([`crate::trtllm::Pokes`]).
    pub fn trtllm_pokes(&self) -> &crate::trtllm::Pokes {
        &self.trtllm_pokes
    }

    /// The HTTP base URL `worker` registered, if any.
    pub fn worker_url(&self, worker: WorkerId) -> Option<String> {
        self.registry_read()
            .get(&worker)
            .and_then(|e| e.registration.url.clone())
    }

    /// The API key `worker` was registered with, if any.
    pub fn worker_api_key(&self, worker: WorkerId) -> Option<String> {
        self.registry_read()
            .get(&worker)
            .and_then(|e| e.registration.api_key.clone())
    }

    /// A registered worker's registration.
    pub fn registration(&self, worker: WorkerId) -> Option<Registration> {
        self.registry_read()
            .get(&worker)
            .map(|e| e.registration.clone())
    }

    /// Whether `model`'s healthy workers include both prefill and decode ones: its
    /// requests are then disaggregated. One atomic load while no model disaggregates.
    pub fn disaggregating(&self, model: &str) -> bool {
        self.disaggregating.load(Relaxed)
            && lock(&self.routing)
                .get_mut(model)
                .is_some_and(|ns| disaggregates(&ns.router))
    }

    /// Refreshes [`Hub::disaggregating`] after the schedulers' workers changed (called with
    /// the routing lock held, so updates are ordered).
    fn note_pools(&self, routing: &Namespaces) {
        let any = routing.iter().any(|(_, ns)| disaggregates(&ns.router));
        self.disaggregating.store(any, Relaxed);
    }

    /// The load routed requests put on `key` now.
    pub fn active_load(&self, key: WorkerKey) -> Option<ActiveLoad> {
        lock(&self.routing)
            .router_of_ref(key.worker)
            .and_then(|r| r.active_load(key))
    }

    /// Every registered worker, by id.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let registry = self.registry_read();
        let routing = lock(&self.routing);
        registry
            .values()
            .map(|e| WorkerInfo {
                registration: e.registration.clone(),
                healthy: e.healthy,
                resyncing: {
                    let mut r = e.resyncing.clone();
                    r.extend(self.unverified.ranks_of(e.registration.worker));
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

    /// Records the GPU KV cache size `key` reported, in blocks (TensorRT-LLM's `created`
    /// event). Shown in `/v1/workers`; ignored for unregistered workers.
    pub fn note_kv_capacity(&self, key: WorkerKey, blocks: u64) {
        if let Some(e) = self.registry_write().get_mut(&key.worker) {
            e.kv_capacity.insert(key.dp_rank, blocks);
        }
    }

    // ----- events -----

    /// Counts the events of `key` handed to the engine. With `refuse_stores` (the index is
    /// over its budget) its stores are not handed over: they are counted as `index_full`
    /// drops and the rank is marked degraded, until a batch whose stores are handed over.
    /// Returns how many stores were refused. `proves_continuity`: the batch itself shows its
    /// stream continues (its fence accepted it and the source cannot prove more), so an
    /// unverified key is trusted again (invariant 7); false for ZMQ batches, whose
    /// subscriber trusts its ranks itself once a replay is applied.
    fn count_events(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
        refuse_stores: bool,
        proves_continuity: bool,
    ) -> u64 {
        let (mut stored, mut removed, mut stores) = (0u64, 0u64, 0u64);
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => {
                    stores += 1;
                    stored += blocks.len() as u64;
                }
                KvEvent::Removed { blocks } => removed += blocks.len() as u64,
                KvEvent::Cleared => {}
            }
        }
        let refused = if refuse_stores { stores } else { 0 };
        let forwarded = (events.len() as u64).saturating_sub(refused);
        let m = &self.metrics;
        m.events_forwarded.fetch_add(forwarded, Relaxed);
        m.blocks_stored
            .fetch_add(if refuse_stores { 0 } else { stored }, Relaxed);
        m.blocks_removed.fetch_add(removed, Relaxed);
        if refused > 0 {
            let why = format!(
                "worker {} rank {}: the index is over --max-index-bytes ({} bytes)",
                key.worker,
                key.dp_rank,
                self.budget.bytes()
            );
            m.drop_input(DropReason::IndexFull, refused, &why);
        }
        let mut registry = self.registry_write();
        if let Some(e) = registry.get_mut(&key.worker) {
            e.events += forwarded;
            e.resyncing.remove(&key.dp_rank);
            if proves_continuity {
                // A batch its stream's fence accepted: the stream continues.
                self.unverified.remove(key);
            }
            let mark = (key.dp_rank, Degraded::IndexFull);
            if refused > 0 {
                e.degraded.insert(mark);
            } else if stores > 0 {
                e.degraded.remove(&mark);
            }
        }
        refused
    }

    /// Hands `events` of `key` to the engine without waiting for them to apply (the engine
    /// counts its refusals); its stores are refused while the index is over its budget
    /// ([`crate::bounds`]). Fails for unregistered workers.
    pub fn ingest(&self, key: WorkerKey, events: Vec<KvEvent>) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        self.hand_over(key, events, None)
    }

    /// Like [`Hub::ingest`] for batch `seq` of `key.worker`'s numbered stream (its ZMQ
    /// stream), whose bytes had `digest` (the stream's `BatchId::digest`; `None` where the
    /// source has none): the engine records both with the events, so a snapshot holds a
    /// batch exactly when it holds its number, and a restart can check that the publisher
    /// still has that very batch. Sent even with no events (the number is still taken).
    pub fn ingest_marked(
        &self,
        key: WorkerKey,
        events: Vec<KvEvent>,
        seq: u64,
        digest: Option<u64>,
    ) -> Result<()> {
        self.hand_over(key, events, Some((seq, digest)))
    }

    fn hand_over(
        &self,
        key: WorkerKey,
        mut events: Vec<KvEvent>,
        seq: Option<(u64, Option<u64>)>,
    ) -> Result<()> {
        self.refuse_events_if_approximate()?;
        self.admit(key)?;
        // A batch with a digest comes from a ZMQ stream, whose subscriber decides when its
        // ranks are trusted again: a replay's first batches are older than what the
        // publisher holds now, so they must not end the distrust (invariant 7).
        let proves_continuity = !matches!(seq, Some((_, Some(_))));
        if self.count_events(key, &events, self.budget.is_full(), proves_continuity) > 0 {
            events.retain(|e| !matches!(e, KvEvent::Stored { .. }));
        }
        if events.is_empty() && seq.is_none() {
            return Ok(());
        }
        let batch: Arc<[(WorkerKey, KvEvent)]> = events.into_iter().map(|e| (key, e)).collect();
        match seq {
            None => self.on_ingest(key.worker, &mut |e| e.send(&batch))?,
            Some((seq, digest)) => {
                let mark = StreamMark {
                    worker: key.worker,
                    stream: 0,
                    seq,
                    digest,
                };
                self.on_ingest(key.worker, &mut |e| e.send_marked(&batch, mark))?;
            }
        }
        Ok(())
    }

    /// The engine at a consistent cut (see `engine::snapshot`). Blocks until every core
    /// answered (up to the engine's sync timeout): call it from a thread that is not a
    /// core's (`spawn_blocking`), or the core it would block could not take part.
    pub fn snapshot_engine(&self) -> Result<EngineImage> {
        let image = match &self.engine {
            Engine::Threads { ingest, .. } => lock(ingest.get(0)).snapshot(),
            Engine::Hosted { ingest, .. } => lock(ingest).snapshot(),
        }?;
        Ok(image)
    }

    /// Drops every block of `worker` from the index, registered or not (a restored
    /// snapshot's workers that are gone, or whose streams cannot be resumed).
    pub fn forget_index(&self, worker: WorkerId) -> Result<usize> {
        let n = self.on_ingest(worker, &mut |e| e.remove_worker(worker))?;
        self.unverified.forget_worker(worker);
        Ok(n)
    }

    /// The warm-restart state (`crate::state`).
    pub fn persisted(&self) -> &crate::state::Persisted {
        &self.persisted
    }

    /// Applies `events` of `key` one by one and waits for each result (the HTTP events
    /// endpoint reports them), then until every shard has its share: a query made after
    /// this returns sees the batch. While the index is over its budget each store is
    /// refused with [`EngineError::IndexFull`] without reaching the engine. Fails only for
    /// unregistered workers or a stopped (or timed-out) engine.
    pub fn apply(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
    ) -> Result<Vec<std::result::Result<Applied, EngineError>>> {
        self.refuse_events_if_approximate()?;
        self.admit(key)?;
        let full = self.budget.is_full();
        self.count_events(key, events, full, true);
        let out = self.on_ingest(key.worker, &mut |engine| {
            let mut out = Vec::with_capacity(events.len());
            for e in events {
                if full && matches!(e, KvEvent::Stored { .. }) {
                    out.push(Err(EngineError::IndexFull));
                    continue;
                }
                match engine.apply(key, e) {
                    Err(e @ (EngineError::RuntimeStopped | EngineError::Timeout { .. })) => {
                        return Err(TransportError::from(e));
                    }
                    r => out.push(r),
                }
            }
            // The answer says the batch is in: every shard's share must be, so the next
            // query (on any core) sees it.
            engine.sync()?;
            Ok(out)
        })?;
        if out
            .iter()
            .any(|r| matches!(r, Err(EngineError::WorkerFull { .. })))
            && let Some(e) = self.registry_write().get_mut(&key.worker)
        {
            // Until the next refresh of the cached-block totals finds it below its cap.
            e.degraded.insert((key.dp_rank, Degraded::WorkerFull));
        }
        Ok(out)
    }

    /// Drops every block of `key` (a publisher restarted). Its blocks being gone, nothing
    /// of it is left to distrust.
    pub fn clear(&self, key: WorkerKey) -> Result<usize> {
        self.admit(key)?;
        let n = self.on_ingest(key.worker, &mut |e| e.clear(key))?;
        self.unverified.remove(key);
        Ok(n)
    }

    /// Routes `key` as uncached (overlap 0, shown resyncing) while keeping its blocks, until
    /// [`Hub::trust`], a clear or its next applied batch (invariant 7): its stream cannot
    /// tell yet whether they are current (restored from a snapshot, or reconnected). Works
    /// for keys not registered yet (a restore runs before registration).
    pub fn distrust(&self, key: WorkerKey) {
        self.unverified.insert(key);
    }

    /// `key`'s stream proved continuity: its blocks count again.
    pub fn trust(&self, key: WorkerKey) {
        self.unverified.remove(key);
    }

    /// Clears `key` because its stream could not be repaired and marks it resyncing until
    /// its next batch applies.
    pub fn resync(&self, key: WorkerKey) -> Result<usize> {
        let n = self.clear(key)?;
        self.metrics.resyncs.fetch_add(1, Relaxed);
        if let Some(e) = self.registry_write().get_mut(&key.worker) {
            e.resyncing.insert(key.dp_rank);
        }
        Ok(n)
    }

    /// Waits until everything handed to the engine so far is applied: by any thread, with
    /// cores on threads of their own; on hosted cores, by this thread's core and by the
    /// threads that are not cores (another core's events are ordered only by that core).
    pub fn sync(&self) -> Result<()> {
        match &self.engine {
            Engine::Threads { ingest, .. } => {
                for h in ingest.iter() {
                    lock(h).sync()?;
                }
            }
            Engine::Hosted { ingest, .. } => {
                if let Some(r) = cores::with_core(|c| c.sync()) {
                    r?;
                }
                lock(ingest).sync()?;
            }
        }
        Ok(())
    }

    /// Every core's figures (index size, refusals, queries). Each reading is also checked
    /// against the index's memory budget ([`crate::bounds`]).
    pub fn core_stats(&self) -> Result<Vec<CoreSummary>> {
        let stats = self.on_query(&mut |q| q.core_stats())?;
        let bytes: usize = stats
            .iter()
            .map(|c| c.index.bytes.saturating_add(c.directory_bytes))
            .sum();
        let was_full = self.budget.is_full();
        let reading = self.budget.observe(bytes as u64);
        if reading.full != was_full {
            match reading.full {
                true => tracing::warn!(
                    bytes,
                    budget = self.budget.limit(),
                    "the index is over --max-index-bytes: refusing stores until it is not"
                ),
                false => tracing::info!(bytes, "the index is within its budget again"),
            }
        }
        if reading.release {
            cores::request_memory_release();
        }
        Ok(stats)
    }

    /// Refreshes the per-key cached-block totals the scheduler breaks ties with (called
    /// periodically, off the routing path).
    pub fn refresh_cached_blocks(&self) -> Result<()> {
        let keys: Vec<WorkerKey> = {
            let registry = self.registry_read();
            registry
                .values()
                .flat_map(|e| {
                    let w = e.registration.worker;
                    e.ranks.iter().map(move |&r| key(w, r))
                })
                .collect()
        };
        let mut fresh = Vec::with_capacity(keys.len());
        for key in keys {
            let n = self.on_ingest(key.worker, &mut |e| e.cached_blocks(key))?;
            fresh.push((key, n));
        }
        if self.limits.max_blocks_per_key.is_some() {
            let mut registry = self.registry_write();
            for &(k, n) in &fresh {
                if let Some(e) = registry.get_mut(&k.worker) {
                    let mark = (k.dp_rank, Degraded::WorkerFull);
                    match self.limits.at_block_cap(n) {
                        true => e.degraded.insert(mark),
                        false => e.degraded.remove(&mark),
                    };
                }
            }
        }
        let mut routing = lock(&self.routing);
        let mut by_model: BTreeMap<String, Vec<(WorkerKey, u64)>> = BTreeMap::new();
        for (k, n) in fresh {
            by_model
                .entry(routing.model_of(k.worker).to_owned())
                .or_default()
                .push((k, n));
        }
        for (model, ns) in routing.iter_mut() {
            ns.router
                .set_cached_blocks(by_model.remove(model).unwrap_or_default());
        }
        Ok(())
    }

    /// The cached-block total of `key` as of the last refresh.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        lock(&self.routing)
            .router_of_ref(key.worker)
            .map_or(0, |r| r.cached_blocks(key))
    }

    // ----- routing -----

    /// The seq hashes of `tokens`' full blocks at the router's block size (the default
    /// namespace's; [`Hub::resolve_model`] gives a model's).
    pub fn hash_prompt(&self, tokens: &[u32], lora_name: Option<&str>) -> Vec<SeqHash> {
        seq_hashes(tokens, self.block_size() as usize, lora_seed(lora_name))
    }

    /// Which workers hold how much of the prompt whose full blocks are `seqs`. No state
    /// changes.
    pub fn find_matches_for(&self, seqs: &[SeqHash]) -> Result<Matches> {
        self.find_matches(DEFAULT_MODEL, seqs, Instant::now())
    }

    /// Which of `model`'s workers hold how much of the prompt: the model's block size, the
    /// prompt's full blocks and the overlaps. No state changes.
    pub fn overlap(
        &self,
        model: Option<&str>,
        tokens: &[u32],
        lora_name: Option<&str>,
    ) -> Result<(u32, usize, Matches)> {
        self.overlap_salted(model, tokens, lora_name, None)
    }

    /// [`Hub::overlap`] for a request with a `cache_salt` (vLLM's per-request cache
    /// namespace, folded into block 0's hash; `None` or `""` is no salt): only blocks stored
    /// under the same salt (and adapter) match.
    pub fn overlap_salted(
        &self,
        model: Option<&str>,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<(u32, usize, Matches)> {
        let (model, block_size) = self.resolve_model(model)?;
        let seqs = seq_hashes_salted(
            tokens,
            block_size as usize,
            lora_seed(lora_name),
            cache_salt,
        );
        let mut matches = self.find_matches(&model, &seqs, Instant::now())?;
        {
            let routing = lock(&self.routing);
            matches
                .overlaps
                .retain(|(k, _)| routing.model_of(k.worker) == model);
        }
        Ok((block_size, seqs.len(), matches))
    }

    /// Routes a request for `model` (see [`Hub::resolve_model`]) and records it as active
    /// on the chosen worker.
    pub fn route(&self, model: Option<&str>, call: &RouteCall<'_>, now: Instant) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let matches = self.find_matches(&model, &seqs, now)?;
        self.decide_with(&model, call, &seqs, &matches, now, Decide::default())
    }

    /// [`Hub::route`] with `custom` choosing the worker among the scored candidates (the
    /// Python package's custom policies). It runs under the routing lock, once per call.
    pub fn route_with(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        custom: &mut dyn Policy,
    ) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let matches = self.find_matches(&model, &seqs, now)?;
        let how = Decide {
            custom: Some(custom),
            client: None,
        };
        self.decide_with(&model, call, &seqs, &matches, now, how)
    }

    /// [`Hub::route`] for async callers: on a hosted core, a query for another core's shard
    /// waits without blocking the thread, which keeps serving meanwhile.
    pub async fn route_async(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
    ) -> Result<Routed> {
        self.route_async_as(model, call, now, None).await
    }

    /// [`Hub::route_async`] for a caller of the routing API (`POST /v1/route`): the request
    /// becomes `client`'s reservation ([`crate::reservations`]): refused past the client's
    /// cap, active for at most `--reservation-timeout-secs` unless freed, and only `client`
    /// may mark or free it.
    pub async fn reserve_async(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        client: ClientId,
    ) -> Result<Routed> {
        self.route_async_as(model, call, now, Some(client)).await
    }

    async fn route_async_as(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        client: Option<ClientId>,
    ) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let hosted = matches!(self.engine, Engine::Hosted { .. }) && !self.approximate;
        let matches = match hosted {
            true => match cores::find_matches(&seqs).await {
                Some(r) => self.unverified.filter(r?),
                None => self.find_matches(&model, &seqs, now)?,
            },
            false => self.find_matches(&model, &seqs, now)?,
        };
        let how = Decide {
            custom: None,
            client,
        };
        self.decide_with(&model, call, &seqs, &matches, now, how)
    }

    /// The namespace of the call and its prompt's seq hashes at that model's block size.
    fn prepare(&self, model: Option<&str>, call: &RouteCall<'_>) -> Result<(String, Vec<SeqHash>)> {
        let (model, block_size) = self.resolve_model(model)?;
        let seqs = seq_hashes_salted(
            call.tokens,
            block_size as usize,
            lora_seed(call.lora_name),
            call.cache_salt,
        );
        Ok((model, seqs))
    }

    /// The scheduler's decision for a request whose overlaps are known; records it.
    fn decide_with(
        &self,
        model: &str,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
        now: Instant,
        how: Decide<'_>,
    ) -> Result<Routed> {
        let routed = {
            let mut routing = lock(&self.routing);
            if let Some(client) = how.client
                && let Err(at) = routing.admit_reservation(client).or_else(|_| {
                    // At its cap: some of its reservations may have lapsed.
                    routing.expire(now);
                    routing.admit_reservation(client)
                })
            {
                self.metrics.too_many_reservations.fetch_add(1, Relaxed);
                return Err(TransportError::TooManyReservations {
                    client: at.client.to_string(),
                    limit: at.cap,
                });
            }
            if let Some(limit) = self.limits.max_active_requests
                && routing.routed_requests() >= limit
            {
                routing.expire(now);
                if routing.routed_requests() >= limit {
                    self.metrics.overloaded.fetch_add(1, Relaxed);
                    return Err(TransportError::Overloaded { limit });
                }
            }
            // Ids are unique across models (the namespaces' invariant 2): named ones are
            // checked here, generated ones never repeat.
            let named;
            let call = match &call.request_id {
                Some(n) if routing.is_active(n) => {
                    return Err(TransportError::DuplicateRequest(n.clone()));
                }
                Some(_) => call,
                None => {
                    named = RouteCall {
                        request_id: Some(routing.generate_id()),
                        ..*call
                    };
                    &named
                }
            };
            let Some(ns) = routing.get_mut(model) else {
                return Err(TransportError::UnknownModel(model.to_owned()));
            };
            let routed = ns
                .router
                .route_with(now, call, seqs, matches, how.custom)
                .map_err(refused)?;
            if let Some(client) = how.client {
                let lifetime = self
                    .limits
                    .reservation_timeout
                    .unwrap_or(crate::reservations::DEFAULT_RESERVATION_TIMEOUT);
                if lifetime < self.config.scheduler.request_timeout
                    && let Some(deadline) = now.checked_add(lifetime)
                {
                    // The request was routed just now: it is active.
                    let _ = ns.router.set_deadline(&routed.request_id, deadline);
                }
                routing.add_reservation(routed.request_id.clone(), client);
            }
            // Under the lock: peers see this replica's events in the order its state changed.
            if let Some(sink) = self.replicas.get() {
                let d = &routed.decision;
                sink.added(
                    &routed.request_id,
                    d.worker,
                    seqs,
                    call.tokens.len() as u64,
                    d.overlap_blocks,
                );
            }
            routed
        };
        let decision = &routed.decision;
        self.metrics.decided(decision.mode);
        self.metrics
            .decided_because(crate::metrics::DecisionReason::of(
                decision.overlap_blocks,
                decision.best_available_overlap_blocks,
            ));
        self.metrics
            .chosen_overlap
            .observe(f64::from(decision.overlap_blocks));
        self.metrics
            .best_overlap
            .observe(f64::from(decision.best_available_overlap_blocks));
        Ok(routed)
    }

    /// Marks a routed request prefilled: its first token streamed now (the chosen worker's
    /// TTFT model learns from the time since routing).
    pub fn prefilled(&self, request_id: &str) -> Result<()> {
        self.prefilled_as(request_id, None)
    }

    /// [`Hub::prefilled`] for a caller of the routing API: only `client`'s own reservations
    /// are known to it (anything else is [`TransportError::UnknownRequest`]).
    pub fn prefilled_by(&self, request_id: &str, client: ClientId) -> Result<()> {
        self.prefilled_as(request_id, Some(client))
    }

    fn prefilled_as(&self, request_id: &str, client: Option<ClientId>) -> Result<()> {
        check_request_id(request_id).map_err(|e| refused(RouteError::Name(e)))?;
        let now = Instant::now();
        let mut routing = lock(&self.routing);
        routing.check_holder(request_id, client)?;
        routing
            .with_request(request_id, |r| r.prefilled(now, request_id))
            .map_err(refused)?;
        if let Some(sink) = self.replicas.get() {
            sink.prefilled(request_id);
        }
        Ok(())
    }

    /// Frees a routed request (finished or cancelled).
    pub fn finish(&self, request_id: &str) -> Result<()> {
        self.finish_as(request_id, None)
    }

    /// [`Hub::finish`] for a caller of the routing API: only `client`'s own reservations
    /// are known to it (anything else is [`TransportError::UnknownRequest`]).
    pub fn finish_by(&self, request_id: &str, client: ClientId) -> Result<()> {
        self.finish_as(request_id, Some(client))
    }

    fn finish_as(&self, request_id: &str, client: Option<ClientId>) -> Result<()> {
        check_request_id(request_id).map_err(|e| refused(RouteError::Name(e)))?;
        let mut routing = lock(&self.routing);
        routing.check_holder(request_id, client)?;
        let key = routing
            .with_request(request_id, |r| {
                // The worker is looked up only where a TensorRT-LLM poller may want a poke.
                let key = self
                    .trtllm_pokes
                    .any()
                    .then(|| r.worker_of(request_id))
                    .flatten();
                r.finish(request_id).map(|()| key)
            })
            .map_err(refused)?;
        routing.reservations.remove(request_id);
        if let Some(sink) = self.replicas.get() {
            sink.freed(request_id);
        }
        if let Some(key) = key {
            // A TensorRT-LLM worker's new blocks are only seen when it is polled.
            self.trtllm_pokes.poke(key.worker);
        }
        Ok(())
    }

    /// Records the load a worker rank reported.
    /// The rank must be known (registered, or seen in the worker's events): a load report
    /// never creates a routing candidate.
    pub fn update_load(&self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        load.validate()?;
        match self.registry_read().get(&key.worker) {
            None => return Err(TransportError::UnknownWorker(key.worker.0)),
            Some(e) if !e.ranks.contains(&key.dp_rank) => {
                return Err(TransportError::UnknownRank {
                    worker: key.worker.0,
                    dp_rank: key.dp_rank.0,
                });
            }
            Some(_) => {}
        }
        // An unhealthy worker is out of routing; its report is not an error.
        match lock(&self.routing).router_of(key.worker) {
            Some(r) => Ok(r.update_load(key, load)?),
            None => Ok(()),
        }
    }

    /// Requests active over all workers.
    pub fn active_requests(&self) -> usize {
        lock(&self.routing).active_requests()
    }
}

/// How [`Hub::decide_with`] decides: a custom policy (the Python package's), and whether
/// the request is a client's reservation.
#[derive(Default)]
struct Decide<'a> {
    custom: Option<&'a mut dyn Policy>,
    client: Option<ClientId>,
}

/// Whether `router` has both prefill and decode workers (its requests disaggregate).
fn disaggregates(router: &engine::router::Router) -> bool {
    router.has_role(WorkerRole::Prefill) && router.has_role(WorkerRole::Decode)
}

/// A refusal of the router as the transports report it.
fn refused(e: RouteError) -> TransportError {
    match e {
        RouteError::Name(NameError::Duplicate(n)) => TransportError::DuplicateRequest(n),
        RouteError::Name(NameError::Unknown(n)) => TransportError::UnknownRequest(n),
        RouteError::Name(NameError::TooLong(n)) => TransportError::Invalid {
            name: "request_id",
            reason: format!(
                "{n} bytes is longer than the limit of {} bytes",
                engine::router::MAX_REQUEST_ID_BYTES
            ),
        },
        RouteError::Name(NameError::ControlCharacter(at)) => TransportError::Invalid {
            name: "request_id",
            reason: format!("holds a control character (at byte {at})"),
        },
        RouteError::Engine(e) => e.into(),
    }
}

/// How the hub reaches the engine (see the module docs).
#[derive(Debug)]
enum Engine {
    /// Cores on threads of their own.
    Threads {
        ingest: Handles<IngestHandle>,
        query: Handles<QueryHandle<Sharding>>,
        next_query: AtomicUsize,
    },
    /// Cores hosted on the edge's threads; these handles serve the other threads.
    Hosted {
        ingest: Mutex<IngestHandle>,
        query: Mutex<QueryHandle<Sharding>>,
    },
}

/// What the hub asks of the engine about events, whether through a handle or a hosted core.
trait EngineOps {
    fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> engine::Result<()>;
    fn send_marked(
        &mut self,
        events: &Arc<[(WorkerKey, KvEvent)]>,
        mark: StreamMark,
    ) -> engine::Result<()>;
    fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> engine::Result<Applied>;
    fn clear(&mut self, key: WorkerKey) -> engine::Result<usize>;
    fn remove_worker(&mut self, worker: WorkerId) -> engine::Result<usize>;
    fn cached_blocks(&mut self, key: WorkerKey) -> engine::Result<u64>;
    fn sync(&mut self) -> engine::Result<()>;
}

/// What the hub asks of the engine about the index.
trait QueryOps {
    fn find_matches(&mut self, seqs: &[SeqHash]) -> engine::Result<Matches>;
    fn core_stats(&mut self) -> engine::Result<Vec<CoreSummary>>;
}

macro_rules! engine_ops {
    ($t:ty) => {
        impl EngineOps for $t {
            fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> engine::Result<()> {
                <$t>::send(self, events)
            }
            fn send_marked(
                &mut self,
                events: &Arc<[(WorkerKey, KvEvent)]>,
                mark: StreamMark,
            ) -> engine::Result<()> {
                <$t>::send_marked(self, events, mark)
            }
            fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> engine::Result<Applied> {
                <$t>::apply(self, key, event)
            }
            fn clear(&mut self, key: WorkerKey) -> engine::Result<usize> {
                <$t>::clear(self, key)
            }
            fn remove_worker(&mut self, worker: WorkerId) -> engine::Result<usize> {
                <$t>::remove_worker(self, worker)
            }
            fn cached_blocks(&mut self, key: WorkerKey) -> engine::Result<u64> {
                <$t>::cached_blocks(self, key)
            }
            fn sync(&mut self) -> engine::Result<()> {
                <$t>::sync(self)
            }
        }
    };
}
engine_ops!(IngestHandle);
engine_ops!(CoreHost<Sharding>);

macro_rules! query_ops {
    ($t:ty) => {
        impl QueryOps for $t {
            fn find_matches(&mut self, seqs: &[SeqHash]) -> engine::Result<Matches> {
                <$t>::find_matches(self, seqs)
            }
            fn core_stats(&mut self) -> engine::Result<Vec<CoreSummary>> {
                <$t>::core_stats(self)
            }
        }
    };
}
query_ops!(QueryHandle<Sharding>);
query_ops!(CoreHost<Sharding>);

/// A non-empty list of engine handles, each behind its own mutex.
#[derive(Debug)]
struct Handles<T> {
    first: Mutex<T>,
    rest: Box<[Mutex<T>]>,
}

impl<T> Handles<T> {
    /// `None` if `handles` is empty.
    fn new(handles: Vec<T>) -> Option<Self> {
        let mut it = handles.into_iter().map(Mutex::new);
        Some(Self {
            first: it.next()?,
            rest: it.collect(),
        })
    }

    fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Handle `i` (`i < len()`; anything else gets the first).
    fn get(&self, i: usize) -> &Mutex<T> {
        i.checked_sub(1)
            .and_then(|j| self.rest.get(j))
            .unwrap_or(&self.first)
    }

    fn iter(&self) -> impl Iterator<Item = &Mutex<T>> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }
}

/// A hub over a freshly started engine: one shard thread per shard of `sharding`,
/// `ingest_handles` and `query_handles` handles. Join the returned runtime after dropping
/// the hub.
pub fn start_engine(
    config: HubConfig,
    sharding: Sharding,
    engine: engine::runtime::RuntimeConfig,
) -> Result<(Hub, engine::runtime::Runtime)> {
    start_engine_from(config, sharding, engine, None)
}

/// Like [`start_engine`], with the cores restored from a snapshot's image first.
pub fn start_engine_from(
    config: HubConfig,
    sharding: Sharding,
    engine: engine::runtime::RuntimeConfig,
    image: Option<&engine::snapshot::ArchivedEngineImage>,
) -> Result<(Hub, engine::runtime::Runtime)> {
    let started = engine::runtime::start_from(sharding, engine, image)?;
    let hub = Hub::new(config, started.ingest, started.query)?;
    Ok((hub, started.runtime))
}
