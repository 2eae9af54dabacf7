//! The worker registry: who is registered, with which ranks, addresses, role and model,
//! and what the router knows of each (health, stream state, configuration errors, event
//! counts, degraded ranks, KV capacity). No engine calls and no routing state: the hub's
//! facade ([`super::Hub`]) orchestrates those around it.
//!
//! # Invariants
//! 1. A worker has at least one rank once registered; a rank is never removed while the
//!    worker stays registered.
//! 2. At most [`MAX_RANKS_PER_WORKER`] ranks per worker.
//! 3. Addresses are stored canonical (the facade checks them before they get here).
//!
//! # Concurrency
//! One `RwLock` (level 1 of [`super::lock_order`]): taken before routing, the unverified
//! keys or an engine handle, never after; readers (health rounds, `/v1/workers`, each
//! event batch's admission) share it.

use super::lock_order::{Level, Ordered};
use crate::bounds::Degraded;
use crate::error::{Result, TransportError};
use engine::sched::{ActiveLoad, WorkerLoad, WorkerRole};
use engine::{DpRank, WorkerId, WorkerKey};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A worker as registered (over HTTP, `--zmq-worker`, or a QUIC hello).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel ranks (empty: rank 0).
    pub dp_ranks: Vec<DpRank>,
    /// Its HTTP base URL (health-checked and, for the OpenAI proxy, forwarded to). Stored
    /// as [`crate::outbound::WorkerUrl`]'s canonical text ([`super::Hub::register`] checks).
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
    /// new worker). See [`engine::router::namespaces`].
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

/// A registered worker, as `/v1/workers` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerInfo {
    /// Registration details (ranks as currently known).
    pub registration: Registration,
    /// Whether it takes part in routing (false after failed health checks).
    pub healthy: bool,
    /// Ranks routed as uncached: their event stream broke and was cleared (until a batch
    /// applies), or their blocks await proof of continuity (restored from a snapshot, or
    /// the stream reconnected: [`super::Hub::distrust`]).
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

/// A registered worker's entry.
#[derive(Debug)]
pub(super) struct WorkerEntry {
    pub registration: Registration,
    pub ranks: BTreeSet<DpRank>,
    pub healthy: bool,
    /// Ranks cleared because their stream could not be repaired, until a batch applies.
    pub resyncing: BTreeSet<DpRank>,
    pub config_error: Option<String>,
    pub health_error: Option<String>,
    pub events: u64,
    pub stream: Option<StreamState>,
    /// Its model's block size (what its events are converted at).
    pub block_size: u32,
    /// Ranks whose stores the bounds refused, and why.
    pub degraded: BTreeSet<(DpRank, Degraded)>,
    /// GPU KV cache size in blocks per rank, where reported.
    pub kv_capacity: BTreeMap<DpRank, u64>,
}

impl WorkerEntry {
    /// A new worker's entry, its events converted at `block_size`.
    pub fn new(worker: WorkerId, block_size: u32) -> Self {
        Self {
            registration: Registration::new(worker),
            ranks: BTreeSet::new(),
            healthy: true,
            resyncing: BTreeSet::new(),
            config_error: None,
            health_error: None,
            events: 0,
            stream: None,
            block_size,
            degraded: BTreeSet::new(),
            kv_capacity: BTreeMap::new(),
        }
    }
}

type Map = BTreeMap<WorkerId, WorkerEntry>;

/// See the module docs.
#[derive(Debug, Default)]
pub struct Registry {
    map: RwLock<Map>,
    /// Bumped after every change of a worker's ranks, model or presence: a [`Feed`]
    /// that saw the same number needs no registry visit to admit a batch.
    generation: AtomicU64,
}

/// What one event source keeps of its worker between batches ([`super::Hub::feed`]): its
/// block size and ranks as of a registry generation. While the generation is unchanged a
/// batch is admitted without a registry visit, and the only one it makes is its count.
#[derive(Clone, Debug)]
pub struct Feed {
    worker: WorkerId,
    /// `u64::MAX`: never read (the first batch reads the registry).
    generation: u64,
    block_size: u32,
    ranks: BTreeSet<DpRank>,
}

impl Feed {
    /// A feed of `worker`, read at its first batch.
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            generation: u64::MAX,
            block_size: 0,
            ranks: BTreeSet::new(),
        }
    }

    /// The worker.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The block size its events are converted at, as of the last refresh.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether `dp_rank` is known as of the last refresh.
    pub(super) fn knows(&self, dp_rank: DpRank) -> bool {
        self.ranks.contains(&dp_rank)
    }
}

/// Where a key stands for its events ([`Registry::check_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RankCheck {
    /// Registered, with this rank.
    Known,
    /// Registered; this rank is new (it registers itself).
    NewRank,
}

impl Registry {
    pub(super) fn read(&self) -> Ordered<RwLockReadGuard<'_, Map>> {
        let entered = Level::Registry.enter();
        Ordered::new(
            entered,
            self.map
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    pub(super) fn write(&self) -> Ordered<RwLockWriteGuard<'_, Map>> {
        let entered = Level::Registry.enter();
        Ordered::new(
            entered,
            self.map
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Notes a change of some worker's ranks, model or presence (after the write).
    pub(super) fn bump(&self) {
        self.generation.fetch_add(1, Relaxed);
    }

    /// Brings `feed` up to date if the registry changed since it was read (one atomic load
    /// otherwise); `default` is the block size of an unregistered worker.
    pub fn refresh(&self, feed: &mut Feed, default: u32) {
        let now = self.generation.load(Relaxed);
        if now == feed.generation {
            return;
        }
        let map = self.read();
        match map.get(&feed.worker) {
            Some(e) => {
                feed.block_size = e.block_size;
                feed.ranks.clone_from(&e.ranks);
            }
            None => {
                feed.block_size = default;
                feed.ranks.clear();
            }
        }
        feed.generation = now;
    }

    /// Whether `worker` is registered.
    pub fn contains(&self, worker: WorkerId) -> bool {
        self.read().contains_key(&worker)
    }

    /// The block size `worker`'s events are converted at (`default` for an unregistered
    /// worker).
    pub fn block_size_of(&self, worker: WorkerId, default: u32) -> u32 {
        self.read().get(&worker).map_or(default, |e| e.block_size)
    }

    /// Whether `key`'s worker is registered and knows the rank (invariant 2 for a new one).
    pub(super) fn check_rank(&self, key: WorkerKey) -> Result<RankCheck> {
        match self.read().get(&key.worker) {
            None => Err(TransportError::UnknownWorker(key.worker.0)),
            Some(e) if e.ranks.contains(&key.dp_rank) => Ok(RankCheck::Known),
            Some(e) if e.ranks.len() >= MAX_RANKS_PER_WORKER => Err(TransportError::TooManyRanks {
                worker: key.worker.0,
                limit: MAX_RANKS_PER_WORKER,
            }),
            Some(_) => Ok(RankCheck::NewRank),
        }
    }

    /// Every registered key.
    pub(super) fn keys(&self) -> Vec<WorkerKey> {
        self.read()
            .values()
            .flat_map(|e| {
                let worker = e.registration.worker;
                e.ranks
                    .iter()
                    .map(move |&dp_rank| WorkerKey { worker, dp_rank })
            })
            .collect()
    }

    /// Records a configuration error in `worker`'s events; returns true the first time (so
    /// the caller logs once per worker).
    pub fn note_config_error(&self, worker: WorkerId, message: String) -> bool {
        match self.write().get_mut(&worker) {
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
        if self.read().get(&worker).is_none_or(same) {
            return;
        }
        if let Some(e) = self.write().get_mut(&worker) {
            e.health_error = error;
        }
    }

    /// Records where the subscription to `worker`'s event stream stands (the ZMQ
    /// subscriber calls this; `/ready` reads it). Unknown workers are ignored.
    pub fn note_stream(&self, worker: WorkerId, state: StreamState) {
        if let Some(e) = self.write().get_mut(&worker) {
            e.stream = Some(state);
        }
    }

    /// Records the GPU KV cache size `key` reported, in blocks (TensorRT-LLM's `created`
    /// event). Shown in `/v1/workers`; ignored for unregistered workers.
    pub fn note_kv_capacity(&self, key: WorkerKey, blocks: u64) {
        if let Some(e) = self.write().get_mut(&key.worker) {
            e.kv_capacity.insert(key.dp_rank, blocks);
        }
    }

    /// Marks `key` resyncing until its next batch applies.
    pub(super) fn mark_resyncing(&self, key: WorkerKey) {
        if let Some(e) = self.write().get_mut(&key.worker) {
            e.resyncing.insert(key.dp_rank);
        }
    }

    /// Marks `key` degraded for `why` (until the bounds find it well again).
    pub(super) fn mark_degraded(&self, key: WorkerKey, why: Degraded) {
        if let Some(e) = self.write().get_mut(&key.worker) {
            e.degraded.insert((key.dp_rank, why));
        }
    }

    /// The HTTP base URL `worker` registered, if any.
    pub fn url(&self, worker: WorkerId) -> Option<String> {
        self.read()
            .get(&worker)
            .and_then(|e| e.registration.url.clone())
    }

    /// The API key `worker` was registered with, if any.
    pub fn api_key(&self, worker: WorkerId) -> Option<String> {
        self.read()
            .get(&worker)
            .and_then(|e| e.registration.api_key.clone())
    }

    /// A registered worker's registration.
    pub fn registration(&self, worker: WorkerId) -> Option<Registration> {
        self.read().get(&worker).map(|e| e.registration.clone())
    }
}
