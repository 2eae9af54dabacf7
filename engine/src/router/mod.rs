//! Router state, sans-IO: the scheduler and its active load, request-id interning, the
//! per-worker cached-block totals ties are broken with, and the match source of approximate
//! mode. In the style of quinn-proto's `Connection`: it takes `now` and the request's
//! overlaps as arguments and does no I/O; a driver (the transport's `Hub`) asks the index
//! for overlaps and hands them in.
//!
//! # Invariants
//! 1. A request name is interned iff its request is active in the scheduler (expired,
//!    finished and removed-worker requests are forgotten with it).
//! 2. Internal request ids never repeat within one router; every request is named by its
//!    caller (ids for requests routed without one are generated once, by
//!    [`namespaces::Namespaces::generate_id`]: [`ids`] is the one id policy).
//! 3. In approximate mode every routing decision is recorded as a prediction of what the
//!    chosen worker now caches, and overlaps come from those predictions.
//! 4. A caller's name is at most [`MAX_REQUEST_ID_BYTES`] long and holds no control
//!    character ([`check_request_id`]); every call naming a request checks it first.
//! 5. A request a peer replica routed ([`Router::add_remote`]) is named by `(replica, name)`
//!    and interned iff active, like a local one; the two name spaces never meet (a peer's
//!    name can neither be finished locally nor block a local name). Its blocks count in
//!    its worker's load exactly as a local request's would, so a block two replicas' requests
//!    share counts once; in approximate mode it is a prediction too (invariant 3).
//! 6. With predict-on-route ([`SchedulerConfig::predict_on_route`], exact mode only) every
//!    decision, local or a peer's, is also recorded as a prediction that expires after the
//!    configured time, and a key's overlap in a decision is the larger of its indexed and
//!    its predicted overlap: the index is never overruled downwards, and a prediction
//!    outlives neither its time nor its worker.
//!
//! # Concurrency
//! Plain data, `Send`; its driver decides who may touch it (the hub keeps it under one
//! mutex, held for one decision).

use crate::approx::{ApproxConfig, ApproxIndex};
use crate::error::{EngineError, Result};
use crate::ids::{ReplicaId, RequestId, SeqHash, SessionId, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::sched::{
    ActiveLoad, Decision, KeyState, Policy, RouteOverrides, RouteRequest, Scheduler,
    SchedulerConfig, WorkerLoad, WorkerRole,
};
use hashbrown::HashMap;
use recent::RecentRoutes;
use std::time::Instant;

pub mod admission;
pub mod ids;
pub mod misses;
pub mod namespaces;
pub mod recent;
pub mod reservations;
pub mod sessions;
mod shadow;

pub use namespaces::{DEFAULT_MODEL, ModelError, ModelSpec, Namespace, Namespaces};
pub use reservations::{AtCap, ClientId};
pub use sessions::{MoveReason, SessionConfig, SessionRoute, SessionStats, Sessions};

/// A request to route.
#[derive(Clone, Debug, Default)]
pub struct RouteCall<'a> {
    /// The caller's id (must not be active). [`Router`] needs one
    /// ([`NameError::Missing`]); the namespaces generate it when absent.
    pub request_id: Option<String>,
    /// The prompt's token ids.
    pub tokens: &'a [u32],
    /// The LoRA adapter, if any (selects the hash seed).
    pub lora_name: Option<&'a str>,
    /// The request's `cache_salt`, if any (folded into block 0's hash as vLLM does; an
    /// empty salt is no salt, see [`crate::hash::seq_hashes_salted`]).
    pub cache_salt: Option<&'a str>,
    /// Per-call settings.
    pub overrides: RouteOverrides,
    /// The client's session, if it named one ([`sessions`]).
    pub session: Option<SessionId>,
}

/// A routed request.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    /// Its id (the caller's or a generated one).
    pub request_id: String,
    /// The scheduler's decision.
    pub decision: Decision,
    /// Full blocks in the prompt.
    pub blocks: usize,
    /// The namespace (model) it was routed in ([`namespaces::DEFAULT_MODEL`] for the
    /// default one).
    pub model: String,
    /// How its session routed it (`None`: no session, or sessions are off).
    pub session: Option<SessionRoute>,
    /// What a shadow policy would have chosen instead ([`Router::shadow`]), when the
    /// driver asked for one.
    pub shadow: Option<crate::sched::ShadowDecision>,
}

impl Routed {
    /// What the caller that routed it keeps to mark it prefilled and free it: its
    /// namespace and id, so neither needs a search over the namespaces.
    pub fn ticket(&self) -> Ticket {
        Ticket {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
        }
    }
}

/// A routed request as its router-side caller holds it ([`Routed::ticket`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The namespace it was routed in.
    pub model: String,
    /// Its id.
    pub request_id: String,
}

/// The longest request id accepted, in bytes: ids are kept while their request is active,
/// so an unbounded one would let a caller grow the router's memory at will.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Why a named request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NameError {
    /// The name is already active.
    Duplicate(String),
    /// No active request has this name.
    Unknown(String),
    /// The name is longer than [`MAX_REQUEST_ID_BYTES`] (its length).
    TooLong(usize),
    /// The name holds a control character (its byte offset): it would end up in logs and
    /// headers, where one could forge a line.
    ControlCharacter(usize),
    /// A request routed without a name where one is needed (a [`Router`] routes named
    /// requests; [`Namespaces`] names the others).
    Missing,
}

/// Whether `name` may name a request (invariant 4): at most [`MAX_REQUEST_ID_BYTES`] bytes
/// and no control character (`char::is_control`: C0, DEL and C1).
pub fn check_request_id(name: &str) -> std::result::Result<(), NameError> {
    if name.len() > MAX_REQUEST_ID_BYTES {
        return Err(NameError::TooLong(name.len()));
    }
    match name.char_indices().find(|(_, c)| c.is_control()) {
        Some((at, _)) => Err(NameError::ControlCharacter(at)),
        None => Ok(()),
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Router {
    scheduler: Scheduler,
    /// The namespace this router serves (its requests' [`Routed::model`]).
    namespace: String,
    ids: HashMap<String, RequestId>,
    names: HashMap<RequestId, String>,
    next_id: u64,
    remote: HashMap<(ReplicaId, String), RequestId>,
    remote_names: HashMap<RequestId, (ReplicaId, String)>,
    cached: HashMap<WorkerKey, u64>,
    approx: Option<ApproxIndex>,
    sessions: Sessions,
    /// Predict-on-route's predictions (exact mode only, invariant 6).
    predicted: Option<RecentRoutes>,
}

/// A request a peer replica routed ([`Router::add_remote`]).
#[derive(Clone, Copy, Debug)]
pub struct RemoteRequest<'a> {
    /// The peer.
    pub replica: ReplicaId,
    /// Its name at the peer.
    pub name: &'a str,
    /// Where it runs.
    pub key: WorkerKey,
    /// Its prompt's full blocks.
    pub blocks: &'a [SeqHash],
    /// Its prompt's tokens.
    pub input_tokens: u64,
    /// Blocks the worker had cached when it was routed.
    pub overlap_blocks: u32,
}

/// A request this router routed and has not freed, as a peer replica needs it to count the
/// request's load ([`Router::local_requests`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRequest {
    /// Its name.
    pub name: String,
    /// Where it runs.
    pub key: WorkerKey,
    /// Its prompt's full blocks.
    pub blocks: Vec<SeqHash>,
    /// Prefill tokens it still adds (0 once prefilled).
    pub pending_prefill_tokens: u64,
}

impl Router {
    /// A router with no workers; `approx`: route without KV events (approximate mode).
    pub fn new(config: SchedulerConfig, approx: Option<ApproxConfig>) -> Result<Self> {
        let predicted = match (approx, config.predict_on_route) {
            (None, Some(ttl)) => Some(RecentRoutes::new(ttl)),
            _ => None,
        };
        Ok(Self {
            predicted,
            scheduler: Scheduler::new(config)?,
            namespace: String::new(),
            ids: HashMap::new(),
            names: HashMap::new(),
            next_id: 0,
            remote: HashMap::new(),
            remote_names: HashMap::new(),
            cached: HashMap::new(),
            approx: approx.map(ApproxIndex::new).transpose()?,
            sessions: Sessions::default(),
        })
    }

    /// Names the namespace this router serves (the namespaces name theirs).
    pub fn set_namespace(&mut self, name: &str) {
        name.clone_into(&mut self.namespace);
    }

    /// Keeps sessions as `config` says (off by default).
    pub fn set_sessions(&mut self, config: SessionConfig) {
        self.sessions.set_config(config);
    }

    /// The session table.
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Records that a peer replica routed session `id` to `key` at `now`; false (nothing
    /// recorded) for a key not in routing here, or with sessions off.
    pub fn assign_session(&mut self, now: Instant, id: SessionId, key: WorkerKey) -> bool {
        let known = self.scheduler.key_state(key, crate::sched::Pool::Whole) != KeyState::Gone;
        if known && self.sessions.enabled() {
            self.sessions.assign(now, id, key);
        }
        known && self.sessions.enabled()
    }

    /// Whether a request of `pool` routed now would find a key neither busy nor full
    /// (the admission queue's test of room).
    pub fn has_room(&self, pool: crate::sched::Pool) -> bool {
        self.scheduler.has_room(pool)
    }

    /// Whether overlaps come from routing predictions (approximate mode).
    pub fn approximate(&self) -> bool {
        self.approx.is_some()
    }

    // ----- workers -----

    /// Adds `key` to routing with `role` (or changes its role).
    pub fn add_worker(&mut self, key: WorkerKey, role: WorkerRole) -> Result<()> {
        self.scheduler.add_worker_with_role(key, role).map(|_| ())
    }

    /// Takes every rank of `worker` out of routing: its active requests are freed and
    /// forgotten (and, `forget`: its predictions and cached totals too, for a worker that
    /// is gone rather than unhealthy).
    pub fn remove_worker(&mut self, worker: WorkerId, forget: bool) {
        self.scheduler.remove_worker(worker);
        if forget {
            self.sessions.remove_worker(worker);
        }
        // A prediction outlives neither its time nor its worker (invariant 6), even an
        // unhealthy one's: its cache may be gone when it comes back.
        if let Some(p) = &mut self.predicted {
            p.remove_worker(worker);
        }
        let gone: Vec<RequestId> = self
            .names
            .keys()
            .chain(self.remote_names.keys())
            .copied()
            .filter(|&id| !self.scheduler.is_active(id))
            .collect();
        for id in gone {
            self.forget(id);
        }
        if forget {
            if let Some(a) = &mut self.approx {
                a.remove_worker(worker);
            }
            self.cached.retain(|k, _| k.worker != worker);
        }
    }

    /// Whether some routable worker has `role`.
    pub fn has_role(&self, role: WorkerRole) -> bool {
        self.scheduler.has_role(role)
    }

    /// The load routed requests put on `key` now.
    pub fn active_load(&self, key: WorkerKey) -> Option<ActiveLoad> {
        self.scheduler.active_load(key)
    }

    /// The load `key` last reported.
    pub fn reported_load(&self, key: WorkerKey) -> Option<WorkerLoad> {
        self.scheduler.reported_load(key)
    }

    /// Records the load `key` reported (ignored for a worker out of routing).
    pub fn update_load(&mut self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        match self.scheduler.update_load(key, load) {
            Err(EngineError::UnknownWorker { .. }) => Ok(()),
            r => r,
        }
    }

    /// Replaces the cached-block totals ties are broken with.
    pub fn set_cached_blocks(&mut self, totals: impl IntoIterator<Item = (WorkerKey, u64)>) {
        self.cached = totals.into_iter().collect();
    }

    /// `key`'s cached-block total as of the last [`Router::set_cached_blocks`], plus the
    /// blocks routed to it since that it did not cache yet (an estimate that only grows
    /// until the next refresh replaces it).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.cached.get(&key).copied().unwrap_or(0)
    }

    // ----- requests -----

    /// Overlaps predicted in approximate mode (`None` in exact mode: ask the index).
    pub fn predicted_matches(&mut self, now: Instant, seqs: &[SeqHash]) -> Option<Matches> {
        let a = self.approx.as_mut()?;
        a.expire(now);
        Some(a.find_matches(seqs))
    }

    /// Routes `call` (whose full blocks are `seqs` and overlaps `matches`) and records it as
    /// active on the chosen worker. Requests past their timeout are expired first.
    pub fn route(
        &mut self,
        now: Instant,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
    ) -> std::result::Result<Routed, RouteError> {
        self.route_with(now, call, seqs, matches, None)
    }

    /// [`Router::route`] with `custom` choosing the worker (see
    /// [`Scheduler::route_with`](crate::sched::Scheduler::route_with)).
    pub fn route_with(
        &mut self,
        now: Instant,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
        custom: Option<&mut dyn Policy>,
    ) -> std::result::Result<Routed, RouteError> {
        self.expire(now);
        if let Some(n) = &call.request_id {
            check_request_id(n).map_err(RouteError::Name)?;
        }
        let name = match &call.request_id {
            Some(n) if self.ids.contains_key(n) => {
                return Err(RouteError::Name(NameError::Duplicate(n.clone())));
            }
            Some(n) => n.clone(),
            None => return Err(RouteError::Name(NameError::Missing)),
        };
        let id = RequestId(self.next_id);
        let request = RouteRequest {
            id,
            blocks: seqs,
            input_tokens: call.tokens.len() as u64,
            overrides: call.overrides,
        };
        // A session sticks unless the call names its worker or policy.
        let (session, stick) = match call.session {
            Some(sid) if self.sessions.enabled() && call.overrides.worker.is_none() => {
                let (r, k) = self
                    .sessions
                    .plan(now, sid, &self.scheduler, call.overrides.pool);
                (Some(r), k)
            }
            _ => (None, None),
        };
        let mut sticky = stick.map(|key| sessions::Sticky {
            key,
            mode: call.overrides.mode.unwrap_or(self.scheduler.config().mode),
        });
        let custom: Option<&mut dyn Policy> = match (sticky.as_mut(), custom) {
            (Some(s), _) => Some(s),
            (None, Some(c)) => Some(&mut *c),
            (None, None) => None,
        };
        let merged = self.with_predictions(now, seqs, matches);
        let matches = merged.as_ref().unwrap_or(matches);
        let cached = &self.cached;
        let decision = self
            .scheduler
            .route_with(
                now,
                &request,
                matches,
                &|k| cached.get(&k).copied().unwrap_or(0),
                custom,
            )
            .map_err(RouteError::Engine)?;
        if let Some(sid) = call.session {
            self.sessions.assign(now, sid, decision.worker);
        }
        // Until the next refresh, the chosen key's footprint grows by what it will store.
        let stored = (seqs.len() as u64).saturating_sub(u64::from(decision.overlap_blocks));
        if stored > 0 {
            let n = self.cached.entry(decision.worker).or_insert(0);
            *n = n.saturating_add(stored);
        }
        self.next_id += 1;
        self.ids.insert(name.clone(), id);
        self.names.insert(id, name.clone());
        if let Some(a) = self.approx.as_mut() {
            a.insert(now, decision.worker, seqs);
        } else if let Some(p) = self.predicted.as_mut() {
            p.insert(now, decision.worker, seqs);
        }
        Ok(Routed {
            request_id: name,
            decision,
            blocks: seqs.len(),
            model: self.namespace.clone(),
            session,
            shadow: None,
        })
    }

    /// With predict-on-route, `matches` with the live predictions for `seqs` merged in
    /// (invariant 6); `None`: use `matches` as they are.
    fn with_predictions(
        &mut self,
        now: Instant,
        seqs: &[SeqHash],
        matches: &Matches,
    ) -> Option<Matches> {
        let p = self.predicted.as_mut()?;
        p.expire(now);
        let predicted = p.find_matches(seqs);
        (!predicted.overlaps.is_empty()).then(|| matches.max_with(&predicted))
    }

    fn id(&self, name: &str) -> std::result::Result<RequestId, RouteError> {
        check_request_id(name).map_err(RouteError::Name)?;
        self.ids
            .get(name)
            .copied()
            .ok_or_else(|| RouteError::Name(NameError::Unknown(name.to_owned())))
    }

    fn forget(&mut self, id: RequestId) {
        if let Some(name) = self.names.remove(&id) {
            self.ids.remove(&name);
        } else if let Some(name) = self.remote_names.remove(&id) {
            self.remote.remove(&name);
        }
    }

    /// Marks request `name` prefilled: its first token streamed at `now`, which teaches the
    /// chosen worker's TTFT model ([`crate::sched::ttft`]).
    pub fn prefilled(&mut self, now: Instant, name: &str) -> std::result::Result<(), RouteError> {
        let id = self.id(name)?;
        self.scheduler
            .first_token(now, id)
            .map_err(RouteError::Engine)
    }

    /// The worker key a routed request of this router is on, while it is active.
    pub fn worker_of(&self, name: &str) -> Option<WorkerKey> {
        let id = self.id(name).ok()?;
        self.scheduler.active_request(id).map(|(key, ..)| key)
    }

    /// Frees request `name` (finished or cancelled).
    pub fn finish(&mut self, name: &str) -> std::result::Result<(), RouteError> {
        let id = self.id(name)?;
        self.forget(id);
        self.scheduler.free(id).map_err(RouteError::Engine)
    }

    // ----- requests peer replicas routed -----

    /// Records `request`, which a peer replica routed, as active from `now`, as if this
    /// router had routed it (invariant 5). Returns false if it is already active (a peer's
    /// state is sent again after a gap; the second copy changes nothing). Its key must be
    /// in routing here.
    pub fn add_remote(
        &mut self,
        now: Instant,
        request: &RemoteRequest<'_>,
    ) -> std::result::Result<bool, RouteError> {
        check_request_id(request.name).map_err(RouteError::Name)?;
        let scoped = (request.replica, request.name.to_owned());
        if self.remote.contains_key(&scoped) {
            return Ok(false);
        }
        let id = RequestId(self.next_id);
        self.scheduler
            .add_active(
                now,
                request.key,
                id,
                request.blocks,
                request.input_tokens,
                request.overlap_blocks,
            )
            .map_err(RouteError::Engine)?;
        self.next_id += 1;
        self.remote.insert(scoped.clone(), id);
        self.remote_names.insert(id, scoped);
        // In approximate mode (and with predict-on-route) a peer's decision predicts the
        // worker's cache as ours would.
        if let Some(a) = self.approx.as_mut() {
            a.insert(now, request.key, request.blocks);
        } else if let Some(p) = self.predicted.as_mut() {
            p.insert(now, request.key, request.blocks);
        }
        Ok(true)
    }

    fn remote_id(
        &self,
        replica: ReplicaId,
        name: &str,
    ) -> std::result::Result<RequestId, RouteError> {
        check_request_id(name).map_err(RouteError::Name)?;
        self.remote
            .get(&(replica, name.to_owned()))
            .copied()
            .ok_or_else(|| RouteError::Name(NameError::Unknown(name.to_owned())))
    }

    /// Whether peer `replica`'s request `name` is active here.
    pub fn is_remote_active(&self, replica: ReplicaId, name: &str) -> bool {
        self.remote.contains_key(&(replica, name.to_owned()))
    }

    /// Marks peer `replica`'s request `name` prefilled.
    pub fn prefilled_remote(
        &mut self,
        replica: ReplicaId,
        name: &str,
    ) -> std::result::Result<(), RouteError> {
        let id = self.remote_id(replica, name)?;
        self.scheduler.prefilled(id).map_err(RouteError::Engine)
    }

    /// Frees peer `replica`'s request `name`.
    pub fn finish_remote(
        &mut self,
        replica: ReplicaId,
        name: &str,
    ) -> std::result::Result<(), RouteError> {
        let id = self.remote_id(replica, name)?;
        self.forget(id);
        self.scheduler.free(id).map_err(RouteError::Engine)
    }

    /// Frees every request of peer `replica` (it is gone, or its state is about to be sent
    /// again); returns how many.
    pub fn forget_replica(&mut self, replica: ReplicaId) -> usize {
        let ids: Vec<RequestId> = self
            .remote
            .iter()
            .filter(|((r, _), _)| *r == replica)
            .map(|(_, &id)| id)
            .collect();
        for &id in &ids {
            self.forget(id);
            // Expired ones are gone already; the rest are active.
            let _ = self.scheduler.free(id);
        }
        ids.len()
    }

    /// Active requests this router routed.
    pub fn routed_requests(&self) -> usize {
        self.names.len()
    }

    /// Active requests peer replicas routed.
    pub fn remote_requests(&self) -> usize {
        self.remote.len()
    }

    /// Every request this router routed that is still active, for a peer that must learn
    /// them (after a gap in what it received, or when it joins).
    pub fn local_requests(&self) -> Vec<LocalRequest> {
        self.names
            .iter()
            .filter_map(|(&id, name)| {
                let (key, blocks, pending) = self.scheduler.active_request(id)?;
                Some(LocalRequest {
                    name: name.clone(),
                    key,
                    blocks: blocks.to_vec(),
                    pending_prefill_tokens: pending,
                })
            })
            .collect()
    }

    /// Worker keys in routing (healthy ones: unhealthy workers are taken out).
    pub fn routable_workers(&self) -> usize {
        self.scheduler.worker_count()
    }

    /// Whether request `name` (routed here) is active.
    pub fn is_active(&self, name: &str) -> bool {
        self.ids.contains_key(name)
    }

    /// Requests active over all workers (peer replicas' included).
    pub fn active_requests(&self) -> usize {
        self.scheduler.active_requests()
    }

    /// Frees request `name` at `deadline` (instead of the configured timeout after it was
    /// routed) if it is still active then.
    pub fn set_deadline(
        &mut self,
        name: &str,
        deadline: Instant,
    ) -> std::result::Result<(), RouteError> {
        let id = self.id(name)?;
        self.scheduler
            .set_deadline(id, deadline)
            .map_err(RouteError::Engine)
    }

    /// Frees (and forgets) the requests whose timeout has passed by `now`; routing does
    /// this first anyway.
    pub fn expire(&mut self, now: Instant) {
        for id in self.scheduler.expire(now) {
            self.forget(id);
        }
    }
}

/// Why routing or a request update was refused.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteError {
    /// A request name problem.
    Name(NameError),
    /// The scheduler refused (no workers, an invalid override, ...).
    Engine(EngineError),
    /// The request's model ([`namespaces`]).
    Model(ModelError),
}

impl From<EngineError> for RouteError {
    fn from(e: EngineError) -> Self {
        Self::Engine(e)
    }
}

#[cfg(test)]
mod tests;
