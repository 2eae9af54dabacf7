//! The routing state: every model's namespace ([`engine::router::Namespaces`]: scheduler,
//! active requests, request ids, reservations, cached totals, approximate predictions),
//! whether some model disaggregates, the replica load sink and the finish wake-ups. The
//! decisions themselves are the sans-IO engine's; this drives them under one lock and
//! reports them as the transports do.
//!
//! # Invariants
//! 1. Bounds (the hub's invariant 5): no route makes more of this router's own requests
//!    active than `max_active_requests`; no client holds more route reservations than its
//!    cap (`crate::bounds`, [`engine::router::reservations`]).
//! 2. With a replica sink, each route, prefill and finish of this router's own requests is
//!    handed to it under the routing lock, once the state changed, so the sink sees them
//!    in the order they happened.
//! 3. `disaggregating` is true iff some model has healthy prefill and decode workers; it
//!    is refreshed under the lock whenever pools change.
//! 4. A caller of the routing API (a client) acts only on its own reservations; every
//!    other id is unknown to it.
//! 5. Admission ([`engine::router::admission`]): a request of a model whose queue is on
//!    waits when someone waits already or no worker of the model is free; waiters are
//!    admitted one at a time (`Routing::pump`, after every event that can free a
//!    worker: a finish, a load report, a pool change, a waiter leaving), woken after the
//!    lock is released. Every waiter leaves through `Routing::leave` exactly once.
//!
//! # Concurrency
//! One mutex (level 2 of [`super::lock_order`]), held for one decision; never across an
//! engine call.

use super::admission::Waiters;
use super::lock_order::{Level, Ordered, lock};
use super::replica_sink::LoadSink;
use super::wakeups::FinishWakeups;
use crate::bounds::Limits;
use crate::error::{Result, TransportError};
use engine::approx::ApproxConfig;
use engine::router::admission::{AdmissionConfig, Cancelled};
use engine::router::ids::RequestIds;
use engine::router::{
    ClientId, DEFAULT_MODEL, ModelError, ModelSpec, NameError, Namespaces, RouteCall, RouteError,
    Routed, Router, Ticket, check_request_id,
};
use engine::sched::Pool;
use engine::sched::{ActiveLoad, Policy, SchedulerConfig, ShadowSpec, WorkerLoad, WorkerRole};
use engine::{Matches, SeqHash, WaiterId, WorkerKey};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// See the module docs.
#[derive(Debug)]
pub struct Routing {
    namespaces: Mutex<Namespaces>,
    /// Whether some model disaggregates (invariant 3), read without the lock per request.
    disaggregating: AtomicBool,
    /// Router replicas: where this router's load events go.
    replicas: OnceLock<Arc<dyn LoadSink>>,
    /// Sources that want to know when a request finishes on a worker.
    wakeups: FinishWakeups,
    /// Requests waiting in the admission queues (invariant 5).
    waiters: Waiters,
    /// How many requests entered and left the admission queues so far, for whoever waits
    /// for the queue to reach a state ([`Routing::queue_tally`]).
    tally: tokio::sync::watch::Sender<QueueTally>,
}

/// Requests that entered and left the admission queues since start (a left request was
/// admitted, timed out, or its client went away).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueTally {
    /// Queued.
    pub entered: u64,
    /// Left the queue (admitted requests leave when routed).
    pub left: u64,
}

/// What [`Routing::enter`] decided for a request.
#[derive(Debug)]
pub(crate) enum Entry {
    /// Route now.
    Go,
    /// Wait for `rx` (admitted) until `deadline`, then leave with `id`.
    Wait {
        /// Its id in the model's queue.
        id: WaiterId,
        /// Fires when it is admitted.
        rx: tokio::sync::oneshot::Receiver<()>,
        /// When it gives up.
        deadline: Instant,
    },
    /// The queue is full.
    Full {
        /// Its capacity.
        capacity: usize,
    },
}

/// How a waiter leaves ([`Routing::leave`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leave {
    /// It was admitted and routed (or failed to): the pass goes back.
    Routed,
    /// Its deadline passed.
    TimedOut,
    /// Its client went away.
    Gone,
}

/// How [`Routing::decide`] decides: a custom policy (the Python package's), and whether
/// the request is a client's reservation.
#[derive(Default)]
#[allow(missing_debug_implementations)]
pub(crate) struct Decide<'a> {
    /// Chooses the worker among the scored candidates.
    pub custom: Option<&'a mut dyn Policy>,
    /// The caller of the routing API whose reservation this is.
    pub client: Option<ClientId>,
    /// A shadow decision to take beside the real one ([`super::shadow`]).
    pub shadow: Option<ShadowSpec>,
}

/// Which routed request a prefill or finish is about.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Target<'a> {
    /// By id, from a caller of the routing API (`Some(client)`: only its own reservations
    /// are known to it) or the router itself (`None`); found by a search of the namespaces.
    Id(&'a str, Option<ClientId>),
    /// By the ticket its router-side caller kept: no search.
    Ticket(&'a Ticket),
}

impl Target<'_> {
    fn id(&self) -> &str {
        match self {
            Self::Id(id, _) => id,
            Self::Ticket(t) => &t.request_id,
        }
    }
}

/// A routing refusal that the hub counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A client at its reservation cap.
    TooManyReservations,
    /// The router at its active-request cap.
    Overloaded,
}

impl Routing {
    /// The default namespace alone; approximate mode with `approx`; ids from `ids`.
    pub fn new(
        scheduler: SchedulerConfig,
        approx: Option<ApproxConfig>,
        ids: RequestIds,
    ) -> Result<Self> {
        let mut namespaces = Namespaces::new(scheduler, approx).map_err(refused)?;
        namespaces.set_ids(ids);
        Ok(Self {
            namespaces: Mutex::new(namespaces),
            disaggregating: AtomicBool::new(false),
            replicas: OnceLock::new(),
            wakeups: FinishWakeups::default(),
            waiters: Waiters::default(),
            tally: tokio::sync::watch::Sender::new(QueueTally::default()),
        })
    }

    /// The namespaces, locked (level 2).
    pub(crate) fn lock(&self) -> Ordered<MutexGuard<'_, Namespaces>> {
        lock(Level::Routing, &self.namespaces)
    }

    /// Runs `f` on the namespaces under the lock (the replica link applies peers' load
    /// with it).
    pub(crate) fn with_lock<R>(&self, f: impl FnOnce(&mut Namespaces) -> R) -> R {
        f(&mut self.lock())
    }

    /// Caps reservations at `cap` per client.
    pub(super) fn cap_reservations(&self, cap: Option<usize>) {
        self.lock().reservations = engine::router::reservations::Reservations::new(cap);
    }

    /// Keeps sessions as `config` says (`None`: off) in every model.
    pub(super) fn set_sessions(&self, config: Option<engine::router::SessionConfig>) {
        self.lock()
            .set_sessions(config.unwrap_or(engine::router::SessionConfig::OFF));
    }

    /// Bounds every model's admission queue as `config` says (`None`: no queue).
    pub(super) fn set_admission(&self, config: Option<AdmissionConfig>) {
        self.lock()
            .set_admission(config.unwrap_or(AdmissionConfig::OFF));
    }

    /// Whether a request of `model` with `priority` routes now or waits (invariant 5).
    /// A model with no queue, no routable worker (routing then answers why) or a free
    /// worker and nobody waiting routes now.
    pub(crate) fn enter(&self, model: &str, priority: i64, now: Instant) -> Entry {
        let entry = {
            let mut routing = self.lock();
            let timeout = routing.admission_config().timeout;
            match routing.get_mut(model) {
                Some(ns)
                    if ns.admission.enabled()
                        && ns.router.routable_workers() > 0
                        && (ns.admission.must_wait() || !ns.router.has_room(Pool::Whole)) =>
                {
                    let deadline = now.checked_add(timeout).unwrap_or(now);
                    let id = self.waiters.next_id();
                    match ns.admission.push(id, priority, deadline) {
                        Ok(()) => {
                            // Registered before the lock is released: a pump admitting it
                            // finds its sender (the waiters' lock is a leaf).
                            let rx = self.waiters.register(id);
                            Entry::Wait { id, rx, deadline }
                        }
                        Err(engine::EngineError::QueueFull { capacity }) => {
                            Entry::Full { capacity }
                        }
                        // `push` refuses nothing else; a queue that did is as good as full.
                        Err(_) => Entry::Full { capacity: 0 },
                    }
                }
                _ => return Entry::Go,
            }
        };
        if matches!(entry, Entry::Wait { .. }) {
            self.tally.send_modify(|t| t.entered += 1);
            // A pass may be free with room already (the test and the push raced an event).
            self.pump();
        }
        entry
    }

    /// Waiter `id` of `model` leaves (invariant 5); returns whether it had been admitted
    /// (for [`Leave::TimedOut`]: it was admitted just as its deadline passed and should
    /// route after all, then leave again with [`Leave::Routed`]).
    pub(crate) fn leave(&self, model: &str, id: WaiterId, how: Leave) -> bool {
        let admitted = {
            let mut routing = self.lock();
            let Some(ns) = routing.get_mut(model) else {
                // Its model went away with its queue.
                drop(routing);
                self.waiters.forget(id);
                self.tally.send_modify(|t| t.left += 1);
                return false;
            };
            let q = &mut ns.admission;
            match how {
                Leave::TimedOut if q.is_waiting(id) => {
                    q.cancel(id);
                    false
                }
                Leave::TimedOut => q.pass_of(id),
                Leave::Routed | Leave::Gone => q.cancel(id) == Cancelled::Admitted,
            }
        };
        self.waiters.forget(id);
        if how != Leave::TimedOut || !admitted {
            self.tally.send_modify(|t| t.left += 1);
        }
        self.pump();
        admitted
    }

    /// Watches how many requests entered and left the admission queues: a test (or a
    /// monitor) waits for a state with `wait_for` instead of polling.
    pub fn queue_tally(&self) -> tokio::sync::watch::Receiver<QueueTally> {
        self.tally.subscribe()
    }

    /// Admits the next waiter of every model that has a free worker and no pass out, and
    /// wakes them with the lock released (invariant 5). Nothing while nobody waits.
    pub(crate) fn pump(&self) {
        if self.waiters.idle() {
            return;
        }
        let admitted: Vec<WaiterId> = {
            let mut routing = self.lock();
            routing
                .iter_mut()
                .filter(|(_, ns)| !ns.admission.is_empty() && !ns.admission.pass_out())
                .filter(|(_, ns)| {
                    ns.router.has_room(Pool::Whole) || ns.router.routable_workers() == 0
                })
                .filter_map(|(_, ns)| ns.admission.admit_next())
                .collect()
        };
        for id in admitted {
            // A waiter already gone returns the pass as it leaves.
            self.waiters.wake(id);
        }
    }

    /// Requests waiting in every model's admission queue.
    pub fn queued(&self) -> usize {
        self.lock().iter().map(|(_, ns)| ns.admission.len()).sum()
    }

    /// Every model's session figures, summed.
    pub fn session_stats(&self) -> engine::router::SessionStats {
        let mut total = engine::router::SessionStats::default();
        for r in self.lock().routers() {
            total += r.sessions().stats();
        }
        total
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

    /// The finish wake-ups ([`FinishWakeups`]).
    pub fn finish_wakeups(&self) -> &FinishWakeups {
        &self.wakeups
    }

    /// Declares a served model (before its workers register).
    pub fn declare_model(&self, spec: &ModelSpec) -> Result<()> {
        self.lock().declare(spec).map_err(refused)
    }

    /// The namespace a request naming `requested` routes in, with its block size.
    pub fn resolve_model(&self, requested: Option<&str>) -> Result<(String, u32)> {
        let ns = self.lock();
        let model = ns
            .resolve(requested)
            .map_err(|e| refused(RouteError::Model(e)))?;
        Ok((model.to_owned(), ns.block_size(model)))
    }

    /// The served models by name (the default namespace excluded), each with whether it
    /// has a healthy worker.
    pub fn models(&self) -> Vec<(String, bool)> {
        self.lock()
            .iter()
            .filter(|(m, _)| *m != DEFAULT_MODEL)
            .map(|(m, ns)| (m.to_owned(), ns.router.routable_workers() > 0))
            .collect()
    }

    /// The model `worker` serves ([`DEFAULT_MODEL`] if it named none or is unknown).
    pub fn model_of(&self, worker: engine::WorkerId) -> String {
        self.lock().model_of(worker).to_owned()
    }

    /// The block size of `model`'s namespace (the router's for an unknown one).
    pub fn block_size_in(&self, model: &str) -> u32 {
        self.lock().block_size(model)
    }

    /// Whether `model`'s healthy workers include both prefill and decode ones: its
    /// requests are then disaggregated. One atomic load while no model disaggregates.
    pub fn disaggregating(&self, model: &str) -> bool {
        self.disaggregating.load(Relaxed)
            && self
                .lock()
                .get_mut(model)
                .is_some_and(|ns| disaggregates(&ns.router))
    }

    /// Refreshes `disaggregating` after the pools changed (invariant 3: called with the
    /// lock held, so updates are ordered).
    pub(super) fn note_pools(&self, namespaces: &Namespaces) {
        let any = namespaces.iter().any(|(_, ns)| disaggregates(&ns.router));
        self.disaggregating.store(any, Relaxed);
    }

    /// The load routed requests put on `key` now.
    pub fn active_load(&self, key: WorkerKey) -> Option<ActiveLoad> {
        self.lock()
            .router_of_ref(key.worker)
            .and_then(|r| r.active_load(key))
    }

    /// The cached-block total of `key` as of the last refresh.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.lock()
            .router_of_ref(key.worker)
            .map_or(0, |r| r.cached_blocks(key))
    }

    /// Sets the cached-block totals the schedulers break ties with.
    pub(super) fn set_cached_blocks(&self, fresh: Vec<(WorkerKey, u64)>) {
        let mut ns = self.lock();
        let mut by_model: BTreeMap<String, Vec<(WorkerKey, u64)>> = BTreeMap::new();
        for (k, n) in fresh {
            by_model
                .entry(ns.model_of(k.worker).to_owned())
                .or_default()
                .push((k, n));
        }
        for (model, namespace) in ns.iter_mut() {
            namespace
                .router
                .set_cached_blocks(by_model.remove(model).unwrap_or_default());
        }
    }

    /// `model`'s predictions for `seqs` (approximate mode), if it has a namespace.
    pub(super) fn predicted_matches(
        &self,
        model: &str,
        seqs: &[SeqHash],
        now: Instant,
    ) -> Option<Matches> {
        self.lock()
            .get_mut(model)
            .and_then(|ns| ns.router.predicted_matches(now, seqs))
    }

    /// `matches` restricted to `model`'s workers.
    pub(super) fn retain_model(&self, model: &str, matches: &mut Matches) {
        let ns = self.lock();
        matches
            .overlaps
            .retain(|(k, _)| ns.model_of(k.worker) == model);
    }

    /// The scheduler's decision for a request whose overlaps are known; records it.
    /// `lifetime`: how long a client's reservation stays active unless freed (shorter than
    /// the scheduler's request timeout to matter).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decide(
        &self,
        model: &str,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
        now: Instant,
        how: Decide<'_>,
        limits: &Limits,
        lifetime: Option<Duration>,
    ) -> std::result::Result<Routed, (Option<Refusal>, TransportError)> {
        let mut routing = self.lock();
        if let Some(client) = how.client
            && let Err(at) = routing.admit_reservation(client).or_else(|_| {
                // At its cap: some of its reservations may have lapsed.
                routing.expire(now);
                routing.admit_reservation(client)
            })
        {
            let e = TransportError::TooManyReservations {
                client: at.client.to_string(),
                limit: at.cap,
            };
            return Err((Some(Refusal::TooManyReservations), e));
        }
        if let Some(limit) = limits.max_active_requests
            && routing.routed_requests() >= limit
        {
            routing.expire(now);
            if routing.routed_requests() >= limit {
                return Err((
                    Some(Refusal::Overloaded),
                    TransportError::Overloaded { limit },
                ));
            }
        }
        // Ids are unique across models (the namespaces' invariant 2): named ones are
        // checked here, generated ones never repeat.
        let named;
        let call = match &call.request_id {
            Some(n) if routing.is_active(n) => {
                return Err((None, TransportError::DuplicateRequest(n.clone())));
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
            return Err((None, TransportError::UnknownModel(model.to_owned())));
        };
        // Before the real decision, on the same state (the shadow's invariant 1).
        let shadow = how
            .shadow
            .and_then(|spec| ns.router.shadow(now, call, seqs, matches, &spec).ok());
        let mut routed = ns
            .router
            .route_with(now, call, seqs, matches, how.custom)
            .map_err(|e| (None, refused(e)))?;
        routed.shadow = shadow;
        if let Some(client) = how.client {
            if let Some(deadline) = lifetime.and_then(|l| now.checked_add(l)) {
                // The request was routed just now: it is active.
                let _ = ns.router.set_deadline(&routed.request_id, deadline);
            }
            routing.add_reservation(routed.request_id.clone(), client);
        }
        // Under the lock (invariant 2).
        if let Some(sink) = self.replicas.get() {
            let d = &routed.decision;
            if let (Some(_), Some(sid)) = (routed.session, call.session) {
                sink.session(model, sid, d.worker);
            }
            sink.added(
                &routed.request_id,
                d.worker,
                seqs,
                call.tokens.len() as u64,
                d.overlap_blocks,
            );
        }
        Ok(routed)
    }

    /// Marks a routed request prefilled at `now` (invariant 4 for a client).
    pub(super) fn prefilled(&self, target: Target<'_>, now: Instant) -> Result<()> {
        let id = target.id();
        check_request_id(id).map_err(|e| refused(RouteError::Name(e)))?;
        let mut routing = self.lock();
        match target {
            Target::Id(id, client) => {
                routing.check_holder(id, client).map_err(refused)?;
                routing.with_request(id, |r| r.prefilled(now, id))
            }
            Target::Ticket(t) => routing.with_ticket(t, |r| r.prefilled(now, id)),
        }
        .map_err(refused)?;
        if let Some(sink) = self.replicas.get() {
            sink.prefilled(id);
        }
        Ok(())
    }

    /// Frees a routed request (invariant 4 for a client) and wakes its worker's finish
    /// listeners.
    pub(super) fn finish(&self, target: Target<'_>) -> Result<()> {
        let id = target.id();
        check_request_id(id).map_err(|e| refused(RouteError::Name(e)))?;
        let mut routing = self.lock();
        let finish = |r: &mut Router| {
            // The worker is looked up only where someone listens for it.
            let key = self.wakeups.any().then(|| r.worker_of(id)).flatten();
            r.finish(id).map(|()| key)
        };
        let key = match target {
            Target::Id(id, client) => {
                routing.check_holder(id, client).map_err(refused)?;
                routing.with_request(id, finish)
            }
            Target::Ticket(t) => routing.with_ticket(t, finish),
        }
        .map_err(refused)?;
        routing.reservations.remove(id);
        if let Some(sink) = self.replicas.get() {
            sink.freed(id);
        }
        drop(routing);
        if let Some(key) = key {
            self.wakeups.wake(key.worker);
        }
        self.pump();
        Ok(())
    }

    /// Records the load a known rank reported (an unhealthy worker is out of routing: its
    /// report is not an error).
    pub(super) fn update_load(&self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        let updated = match self.lock().router_of(key.worker) {
            Some(r) => r.update_load(key, load),
            None => Ok(()),
        };
        self.pump();
        Ok(updated?)
    }

    /// Requests active over all workers.
    pub fn active_requests(&self) -> usize {
        self.lock().active_requests()
    }
}

/// Whether `router` has both prefill and decode workers (its requests disaggregate).
fn disaggregates(router: &Router) -> bool {
    router.has_role(WorkerRole::Prefill) && router.has_role(WorkerRole::Decode)
}

/// A refusal of the router as the transports report it.
pub(super) fn refused(e: RouteError) -> TransportError {
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
        RouteError::Name(NameError::Missing) => TransportError::Invalid {
            name: "request_id",
            reason: "missing".into(),
        },
        RouteError::Model(ModelError::NotFound(m)) => TransportError::UnknownModel(m),
        RouteError::Model(e) => TransportError::Invalid {
            name: "model",
            reason: e.to_string(),
        },
        RouteError::Engine(e) => e.into(),
    }
}
