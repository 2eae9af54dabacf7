//! Models: one routing namespace per served model.
//!
//! A router in front of several models keeps, per model, its own pool of workers, block size
//! and [`Router`] (scheduler, active requests, cached totals, predictions in approximate
//! mode). The KV index itself is shared: a worker's blocks are indexed under its own worker
//! key, and a request for model `m` is scored only against `m`'s workers, so another model's
//! blocks never count as a hit however its hashes happen to line up (two models with the
//! same tokenizer and block size hash the same prompt alike).
//!
//! Workers registered without a model join the *default* namespace ([`DEFAULT_MODEL`], the
//! `--kv-cache-block-size` router of a single-model deployment). A request names its model:
//! * a model with a namespace (named in configuration, or by a registered worker) routes
//!   there;
//! * any other name routes to the default namespace while it has workers (their model is not
//!   known to the router, so the worker decides: vLLM answers 404 for a model it does not
//!   serve), and is refused as unknown otherwise;
//! * no name routes to the default namespace if it has workers, else to the only named model;
//!   with several it is refused (the caller must say which).
//!
//! # Invariants
//! 1. A worker is in exactly one namespace: `worker_model[w]` names it, and only that
//!    namespace's router knows `w`'s keys.
//! 2. A request id is active in at most one namespace: ids are checked against every
//!    namespace before routing, and a generated id ([`super::ids`], the one id policy) is
//!    drawn again until no namespace has it active.
//! 3. The default namespace always exists; a named one exists while it is declared or has
//!    workers.
//!
//! # Concurrency
//! None: owned by its driver (the transport's routing state) behind one mutex.

use super::admission::{AdmissionConfig, AdmissionQueue};
use super::ids::RequestIds;
use super::reservations::{AtCap, ClientId, Reservations};
use super::sessions::SessionConfig;
use super::{NameError, RouteError, Router, Ticket};
use crate::approx::ApproxConfig;
use crate::ids::WorkerId;
use crate::sched::SchedulerConfig;
use std::collections::{BTreeMap, HashMap};

type Result<T> = std::result::Result<T, RouteError>;

/// The namespace of workers registered without a model.
pub const DEFAULT_MODEL: &str = "";

/// A model named in configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name clients send in `model`.
    pub name: String,
    /// Its workers' KV block size, in tokens (`None`: the router's `--kv-cache-block-size`).
    pub block_size: Option<u32>,
}

/// Why a request's model was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelError {
    /// No namespace serves this model.
    NotFound(String),
    /// Several models are served and the request named none.
    Required(Vec<String>),
    /// A declared model cannot change its block size while it exists.
    BlockSize {
        /// The model.
        model: String,
        /// Its block size.
        has: u32,
        /// The one asked for.
        wanted: u32,
    },
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotFound(m) => write!(f, "model {m:?} is not served here"),
            Self::Required(all) => {
                write!(f, "this router serves several models ({all:?}); name one")
            }
            Self::BlockSize { model, has, wanted } => {
                write!(
                    f,
                    "model {model:?} already has block size {has}, not {wanted}"
                )
            }
        }
    }
}

/// One model's routing state.
#[derive(Debug)]
pub struct Namespace {
    /// Its scheduler, active requests, cached totals and predictions.
    pub router: Router,
    /// Its workers' block size.
    pub block_size: u32,
    /// Requests waiting for room among its workers ([`super::admission`]).
    pub admission: AdmissionQueue,
    /// Named in configuration: kept when its last worker goes.
    declared: bool,
    workers: usize,
}

/// Every model's routing state. See the module docs.
#[derive(Debug)]
pub struct Namespaces {
    base: SchedulerConfig,
    approx: Option<ApproxConfig>,
    by_model: BTreeMap<String, Namespace>,
    worker_model: HashMap<WorkerId, String>,
    /// Where generated request ids come from.
    ids: RequestIds,
    /// Requests routed through the routing API, by client ([`super::reservations`]).
    pub reservations: Reservations,
    /// How every namespace keeps sessions.
    sessions: SessionConfig,
    /// How every namespace's admission queue is bounded.
    admission: AdmissionConfig,
}

impl Namespaces {
    /// The default namespace alone, with `base`'s block size.
    pub fn new(base: SchedulerConfig, approx: Option<ApproxConfig>) -> Result<Self> {
        let mut by_model = BTreeMap::new();
        by_model.insert(
            DEFAULT_MODEL.to_owned(),
            Namespace {
                router: Router::new(base, approx)?,
                block_size: base.block_size,
                admission: AdmissionQueue::new(0),
                declared: true,
                workers: 0,
            },
        );
        Ok(Self {
            base,
            approx,
            by_model,
            worker_model: HashMap::new(),
            ids: RequestIds::default(),
            reservations: Reservations::default(),
            sessions: SessionConfig::OFF,
            admission: AdmissionConfig::OFF,
        })
    }

    /// Every namespace, present and future, keeps sessions as `config` says.
    pub fn set_sessions(&mut self, config: SessionConfig) {
        self.sessions = config;
        for ns in self.by_model.values_mut() {
            ns.router.set_sessions(config);
        }
    }

    /// Every namespace, present and future, bounds its admission queue as `config` says
    /// (a queue shrunk below its waiters keeps them until they leave).
    pub fn set_admission(&mut self, config: AdmissionConfig) {
        self.admission = config;
        for ns in self.by_model.values_mut() {
            if ns.admission.capacity() != config.capacity && ns.admission.is_empty() {
                ns.admission = AdmissionQueue::new(config.capacity);
            }
        }
    }

    /// How admission queues are bounded.
    pub fn admission_config(&self) -> AdmissionConfig {
        self.admission
    }

    /// Generated request ids come from `ids` from now on (a serving router's draw from
    /// the system's CSPRNG).
    pub fn set_ids(&mut self, ids: RequestIds) {
        self.ids = ids;
    }

    fn create(&mut self, name: &str, block_size: u32, declared: bool) -> Result<()> {
        if let Some(ns) = self.by_model.get_mut(name) {
            ns.declared |= declared;
            return Ok(());
        }
        let config = SchedulerConfig {
            block_size,
            ..self.base
        };
        let mut router = Router::new(config, self.approx)?;
        router.set_namespace(name);
        router.set_sessions(self.sessions);
        self.by_model.insert(
            name.to_owned(),
            Namespace {
                router,
                block_size,
                admission: AdmissionQueue::new(self.admission.capacity),
                declared,
                workers: 0,
            },
        );
        Ok(())
    }

    /// Declares `spec` (idempotent; a declared model's block size cannot change while it
    /// exists).
    pub fn declare(&mut self, spec: &ModelSpec) -> Result<()> {
        let bs = spec.block_size.unwrap_or(self.base.block_size);
        if let Some(ns) = self.by_model.get(&spec.name)
            && ns.block_size != bs
        {
            return Err(RouteError::Model(ModelError::BlockSize {
                model: spec.name.clone(),
                has: ns.block_size,
                wanted: bs,
            }));
        }
        self.create(&spec.name, bs, true)
    }

    /// The namespace `worker` is in (the default one if it is unknown).
    pub fn model_of(&self, worker: WorkerId) -> &str {
        self.worker_model
            .get(&worker)
            .map_or(DEFAULT_MODEL, String::as_str)
    }

    /// The router of `worker`'s namespace.
    pub fn router_of(&mut self, worker: WorkerId) -> Option<&mut Router> {
        let m = self.worker_model.get(&worker)?;
        self.by_model.get_mut(m).map(|ns| &mut ns.router)
    }

    /// The router of `worker`'s namespace, read-only.
    pub fn router_of_ref(&self, worker: WorkerId) -> Option<&Router> {
        let m = self.worker_model.get(&worker)?;
        self.by_model.get(m).map(|ns| &ns.router)
    }

    /// A namespace by name.
    pub fn get_mut(&mut self, model: &str) -> Option<&mut Namespace> {
        self.by_model.get_mut(model)
    }

    /// Every namespace.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Namespace)> {
        self.by_model.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Every namespace, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Namespace)> {
        self.by_model.iter_mut().map(|(k, v)| (k.as_str(), v))
    }

    /// Every namespace's router.
    pub fn routers(&self) -> impl Iterator<Item = &Router> {
        self.by_model.values().map(|ns| &ns.router)
    }

    /// Every namespace's router, mutably.
    pub fn routers_mut(&mut self) -> impl Iterator<Item = &mut Router> {
        self.by_model.values_mut().map(|ns| &mut ns.router)
    }

    /// Puts `worker` in `model`'s namespace (created with the router's block size if
    /// new). If it was in another one it leaves that one first (its keys, active
    /// requests, predictions and cached totals there are forgotten). Returns the router of
    /// its namespace.
    pub fn place(&mut self, worker: WorkerId, model: &str) -> Result<&mut Router> {
        if self.worker_model.get(&worker).map(String::as_str) != Some(model) {
            self.create(model, self.base.block_size, false)?;
            self.unplace(worker);
            self.worker_model.insert(worker, model.to_owned());
            if let Some(ns) = self.by_model.get_mut(model) {
                ns.workers += 1;
            }
        }
        self.by_model
            .get_mut(model)
            .map(|ns| &mut ns.router)
            .ok_or_else(|| RouteError::Model(ModelError::NotFound(model.to_owned())))
    }

    /// Takes `worker` out of its namespace, which goes away if it was neither declared nor
    /// has workers left.
    pub fn unplace(&mut self, worker: WorkerId) {
        let Some(model) = self.worker_model.remove(&worker) else {
            return;
        };
        if let Some(ns) = self.by_model.get_mut(&model) {
            ns.router.remove_worker(worker, true);
            ns.workers = ns.workers.saturating_sub(1);
            if ns.workers == 0 && !ns.declared && ns.router.active_requests() == 0 {
                self.by_model.remove(&model);
            }
        }
    }

    /// The namespace a request naming `requested` routes in (see the module docs).
    pub fn resolve(&self, requested: Option<&str>) -> std::result::Result<&str, ModelError> {
        let default_has_workers = self
            .by_model
            .get(DEFAULT_MODEL)
            .is_some_and(|ns| ns.workers > 0);
        match requested {
            Some(m) => match self.by_model.get_key_value(m) {
                Some((k, _)) => Ok(k.as_str()),
                None if default_has_workers || self.named().next().is_none() => Ok(DEFAULT_MODEL),
                None => Err(ModelError::NotFound(m.to_owned())),
            },
            None => {
                if default_has_workers {
                    return Ok(DEFAULT_MODEL);
                }
                let mut named = self.named();
                match (named.next(), named.next()) {
                    (Some(only), None) => Ok(only),
                    (None, _) => Ok(DEFAULT_MODEL),
                    (Some(_), Some(_)) => Err(ModelError::Required(
                        self.named().map(str::to_owned).collect(),
                    )),
                }
            }
        }
    }

    /// The named models, sorted.
    pub fn named(&self) -> impl Iterator<Item = &str> {
        self.by_model
            .keys()
            .map(String::as_str)
            .filter(|m| *m != DEFAULT_MODEL)
    }

    /// `model`'s block size (the router's for an unknown one).
    pub fn block_size(&self, model: &str) -> u32 {
        self.by_model
            .get(model)
            .map_or(self.base.block_size, |ns| ns.block_size)
    }

    /// Whether request `name` is active in any namespace.
    pub fn is_active(&self, name: &str) -> bool {
        self.by_model.values().any(|ns| ns.router.is_active(name))
    }

    /// The id a request routed without one gets ([`super::ids`]): never active anywhere
    /// (invariant 2).
    pub fn generate_id(&mut self) -> String {
        loop {
            let name = self.ids.draw();
            if !self.is_active(&name) {
                return name;
            }
        }
    }

    /// Whether `client` may make one more route reservation ([`super::reservations`]).
    pub fn admit_reservation(&mut self, client: ClientId) -> std::result::Result<(), AtCap> {
        let by_model = &self.by_model;
        self.reservations.admit(client, |id| {
            by_model.values().any(|ns| ns.router.is_active(id))
        })
    }

    /// For a caller of the routing API (`Some(client)`): `id` must be its own reservation,
    /// else it is unknown ([`NameError::Unknown`]: whether it exists is not told). The
    /// router's own calls (`None`) pass.
    pub fn check_holder(&self, id: &str, client: Option<ClientId>) -> Result<()> {
        match client {
            Some(c) if !self.reservations.held_by(id, c) => {
                Err(RouteError::Name(NameError::Unknown(id.to_owned())))
            }
            _ => Ok(()),
        }
    }

    /// Records request `id`, just routed, as `client`'s reservation.
    pub fn add_reservation(&mut self, id: String, client: ClientId) {
        let by_model = &self.by_model;
        self.reservations.insert(id, client, |id| {
            by_model.values().any(|ns| ns.router.is_active(id))
        });
    }

    /// Runs `f` on the router where request `name` is active.
    pub fn with_request<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Router) -> Result<R>,
    ) -> Result<R> {
        match self
            .by_model
            .values_mut()
            .find(|ns| ns.router.is_active(name))
        {
            Some(ns) => f(&mut ns.router),
            None => Err(RouteError::Name(NameError::Unknown(name.to_owned()))),
        }
    }

    /// Runs `f` on the router of `ticket`'s namespace, where its request is active (no
    /// search: the ticket names the namespace).
    pub fn with_ticket<R>(
        &mut self,
        ticket: &Ticket,
        f: impl FnOnce(&mut Router) -> Result<R>,
    ) -> Result<R> {
        match self.by_model.get_mut(&ticket.model) {
            Some(ns) if ns.router.is_active(&ticket.request_id) => f(&mut ns.router),
            _ => Err(RouteError::Name(NameError::Unknown(
                ticket.request_id.clone(),
            ))),
        }
    }

    /// Requests this replica routed that are active, over every namespace (peers'
    /// requests are theirs to bound).
    pub fn routed_requests(&self) -> usize {
        self.by_model
            .values()
            .map(|ns| ns.router.routed_requests())
            .sum()
    }

    /// Requests active over every namespace (peer replicas' included).
    pub fn active_requests(&self) -> usize {
        self.by_model
            .values()
            .map(|ns| ns.router.active_requests())
            .sum()
    }

    /// Frees the requests of every namespace whose timeout has passed by `now`.
    pub fn expire(&mut self, now: std::time::Instant) {
        for ns in self.by_model.values_mut() {
            ns.router.expire(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spaces() -> Namespaces {
        Namespaces::new(SchedulerConfig::default(), None).unwrap()
    }

    #[test]
    fn requests_resolve_to_the_right_namespace() {
        let mut n = spaces();
        // Nothing named: every request, named or not, goes to the default namespace.
        assert_eq!(n.resolve(Some("anything")), Ok(DEFAULT_MODEL));
        assert_eq!(n.resolve(None), Ok(DEFAULT_MODEL));
        n.declare(&ModelSpec {
            name: "a".into(),
            block_size: Some(32),
        })
        .unwrap();
        assert_eq!(n.resolve(Some("a")), Ok("a"));
        assert_eq!(n.resolve(None), Ok("a"), "the only named model");
        assert_eq!(n.resolve(Some("b")), Err(ModelError::NotFound("b".into())));
        n.place(WorkerId(2), "b").unwrap();
        assert_eq!(n.resolve(Some("b")), Ok("b"));
        assert_eq!(
            n.resolve(None),
            Err(ModelError::Required(vec!["a".into(), "b".into()]))
        );
        // A worker of unknown model: unknown names go to it (it decides).
        n.place(WorkerId(3), DEFAULT_MODEL).unwrap();
        assert_eq!(n.resolve(Some("c")), Ok(DEFAULT_MODEL));
        assert_eq!(n.resolve(None), Ok(DEFAULT_MODEL));
        assert_eq!(n.block_size("a"), 32);
        assert_eq!(n.block_size("b"), SchedulerConfig::default().block_size);
    }

    #[test]
    fn undeclared_namespaces_go_with_their_last_worker() {
        let mut n = spaces();
        n.declare(&ModelSpec {
            name: "kept".into(),
            block_size: None,
        })
        .unwrap();
        n.place(WorkerId(1), "kept").unwrap();
        n.place(WorkerId(2), "learned").unwrap();
        assert_eq!(n.named().collect::<Vec<_>>(), ["kept", "learned"]);
        // Moving a worker leaves its old namespace.
        n.place(WorkerId(2), "kept").unwrap();
        assert_eq!(n.named().collect::<Vec<_>>(), ["kept"]);
        assert_eq!(n.model_of(WorkerId(2)), "kept");
        n.unplace(WorkerId(1));
        n.unplace(WorkerId(2));
        assert_eq!(n.named().collect::<Vec<_>>(), ["kept"]);
        assert_eq!(n.model_of(WorkerId(2)), DEFAULT_MODEL);
        // A declared model's block size is fixed.
        assert!(
            n.declare(&ModelSpec {
                name: "kept".into(),
                block_size: Some(64),
            })
            .is_err()
        );
    }

    #[test]
    fn generated_ids_are_unguessable_and_never_active() {
        let mut n = spaces();
        let r = n.place(WorkerId(1), "m").unwrap();
        r.add_worker(
            crate::WorkerKey::new(1, 0),
            crate::sched::WorkerRole::default(),
        )
        .unwrap();
        let call = super::super::RouteCall {
            request_id: Some("kvr-0".into()),
            tokens: &[1; 16],
            ..Default::default()
        };
        r.route(
            std::time::Instant::now(),
            &call,
            &[],
            &crate::Matches::default(),
        )
        .unwrap();
        assert!(n.is_active("kvr-0"));
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| n.generate_id()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            let hex = id.strip_prefix("kvr-").unwrap();
            assert_eq!(hex.len(), 32, "{id}");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        // Not a counter: two ids in a row share no long prefix (128 random bits each).
        let (a, b) = (n.generate_id(), n.generate_id());
        assert_ne!(a[..12], b[..12], "{a} {b}");
        assert!(n.with_request("kvr-0", |r| r.finish("kvr-0")).is_ok());
        assert!(n.with_request("kvr-0", |r| r.finish("kvr-0")).is_err());
    }
}
