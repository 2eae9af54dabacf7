//! `kvengine.KvRouter`: the index plus the scheduler, in-process. `route` picks a worker
//! for a prompt by the KV cost (or a Python policy) and records the request as active
//! there until `free`; `Decision` says why.

use crate::candidate::Candidate;
use crate::core::{EngineSettings, Shared};
use crate::error::from_transport;
use crate::guard::not_in_policy;
use crate::indexer::{KvIndexer, check_block_size};
use crate::policy::PyPolicy;
use engine::router::RouteCall;
use engine::sched::{
    BusyThresholds, RouteMode, RouteOverrides, RouterCost, SchedulerConfig, WorkerLoad,
};
use engine::{WorkerId, WorkerKey};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transport::TransportError;
use transport::hub::{Hub, Registration};

/// Where a request went, and why: every candidate with its cost.
#[pyclass(frozen, get_all, module = "kvengine")]
#[derive(Debug)]
pub struct Decision {
    /// The request's id (the caller's, or generated: `kvr-` and 128 random bits in hex).
    pub request_id: String,
    /// The chosen worker.
    pub worker_id: u64,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// The mode that chose: `kv`, `round-robin`, `random`, `direct` or `custom` (a policy).
    pub mode: String,
    /// Leading blocks of the prompt the chosen worker caches.
    pub overlap_blocks: u32,
    /// The largest overlap any candidate had.
    pub best_available_overlap_blocks: u32,
    /// Full blocks in the prompt.
    pub blocks: usize,
    /// Candidates skipped as busy.
    pub busy_skipped: usize,
    /// Every candidate considered, in (worker_id, dp_rank) order.
    pub candidates: Vec<Candidate>,
}

#[pymethods]
impl Decision {
    /// `(worker_id, dp_rank)` of the chosen worker.
    #[getter]
    fn key(&self) -> (u64, u32) {
        (self.worker_id, self.dp_rank)
    }

    /// The chosen candidate.
    #[getter]
    fn chosen(&self) -> Option<Candidate> {
        self.candidates
            .iter()
            .find(|c| (c.worker_id, c.dp_rank) == (self.worker_id, self.dp_rank))
            .cloned()
    }

    /// The decision as plain dicts and lists (the shape of `POST /v1/route`'s answer).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("request_id", &self.request_id)?;
        d.set_item("worker_id", self.worker_id)?;
        d.set_item("dp_rank", self.dp_rank)?;
        d.set_item("mode", &self.mode)?;
        d.set_item("overlap_blocks", self.overlap_blocks)?;
        d.set_item(
            "best_available_overlap_blocks",
            self.best_available_overlap_blocks,
        )?;
        d.set_item("blocks", self.blocks)?;
        d.set_item("busy_skipped", self.busy_skipped)?;
        let cands = PyList::empty(py);
        for c in &self.candidates {
            let cd = PyDict::new(py);
            cd.set_item("worker_id", c.worker_id)?;
            cd.set_item("dp_rank", c.dp_rank)?;
            cd.set_item("overlap_blocks", c.overlap_blocks)?;
            cd.set_item("prefill_blocks", c.prefill_blocks)?;
            cd.set_item("decode_blocks", c.decode_blocks)?;
            cd.set_item("logit", c.logit)?;
            cands.append(cd)?;
        }
        d.set_item("candidates", cands)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Decision(request_id={:?}, worker_id={}, dp_rank={}, mode={:?}, overlap_blocks={}, \
             candidates={})",
            self.request_id,
            self.worker_id,
            self.dp_rank,
            self.mode,
            self.overlap_blocks,
            self.candidates.len()
        )
    }
}

/// Settings, named as the `kvengine` command line names them (`--router-mode` is
/// `router_mode`).
const SETTINGS: [&str; 20] = [
    "router_mode",
    "router_cost",
    "router_stall_weight",
    "router_recompute_weight",
    "router_footprint_weight",
    "cached_refresh_ms",
    "predict_on_route_ms",
    "kv_cache_block_size",
    "router_temperature",
    "kv_overlap_score_weight",
    "decode_overlap_weight",
    "busy_threshold",
    "busy_max_waiting",
    "busy_max_active",
    "request_timeout_secs",
    "max_active_requests_per_worker",
    "cores",
    "ring_capacity",
    "engine_timeout_ms",
    "seed",
];

/// How long the per-worker cached-block totals the footprint term and tie-breaks read stay
/// in use before a route re-reads them from the index (the router process's health loop
/// refreshes them at this interval; in-process there is no loop, so `route` does).
const DEFAULT_CACHED_REFRESH: Duration = Duration::from_secs(2);

fn settings_from(
    config: Option<&Bound<'_, PyDict>>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<(EngineSettings, Duration)> {
    let mut cached_refresh = DEFAULT_CACHED_REFRESH;
    let mut s = EngineSettings {
        scheduler: SchedulerConfig::default(),
        cores: 1,
        ring_capacity: 1024,
        call_timeout: Duration::from_secs(5),
    };
    let mut busy = BusyThresholds::default();
    for dict in [config, kwargs].into_iter().flatten() {
        for (k, v) in dict.iter() {
            let raw: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("KvRouter setting names are strings"))?;
            let name = raw.trim_start_matches('-').replace('-', "_");
            let bad = |e: PyErr| PyValueError::new_err(format!("KvRouter setting {raw}: {e}"));
            match name.as_str() {
                "router_mode" => {
                    let m: String = v.extract().map_err(bad)?;
                    s.scheduler.mode = RouteMode::from_str(&m)
                        .map_err(|e| PyValueError::new_err(format!("router_mode {m:?}: {e}")))?;
                }
                "router_cost" => {
                    let c: String = v.extract().map_err(bad)?;
                    s.scheduler.cost = RouterCost::from_str(&c)
                        .map_err(|e| PyValueError::new_err(format!("router_cost {c:?}: {e}")))?;
                }
                "router_stall_weight" => s.scheduler.stall_weight = v.extract().map_err(bad)?,
                "router_recompute_weight" => {
                    s.scheduler.recompute_weight = v.extract().map_err(bad)?
                }
                "router_footprint_weight" => {
                    s.scheduler.footprint_weight = v.extract().map_err(bad)?
                }
                "cached_refresh_ms" => {
                    cached_refresh = Duration::from_millis(v.extract().map_err(bad)?)
                }
                "predict_on_route_ms" => {
                    let ms: u64 = v.extract().map_err(bad)?;
                    s.scheduler.predict_on_route =
                        (ms > 0).then(|| std::time::Duration::from_millis(ms));
                }
                "kv_cache_block_size" => {
                    s.scheduler.block_size = check_block_size(v.extract().map_err(bad)?)?
                }
                "router_temperature" => s.scheduler.temperature = v.extract().map_err(bad)?,
                "kv_overlap_score_weight" => {
                    s.scheduler.overlap_weight = v.extract().map_err(bad)?
                }
                "decode_overlap_weight" => {
                    s.scheduler.decode_overlap_weight = v.extract().map_err(bad)?
                }
                "busy_threshold" => busy.max_kv_usage = v.extract().map_err(bad)?,
                "busy_max_waiting" => busy.max_waiting = v.extract().map_err(bad)?,
                "busy_max_active" => busy.max_active = v.extract().map_err(bad)?,
                "request_timeout_secs" => {
                    s.scheduler.request_timeout = Duration::from_secs(v.extract().map_err(bad)?)
                }
                "max_active_requests_per_worker" => {
                    let n: u64 = v.extract().map_err(bad)?;
                    s.scheduler.max_active_per_key = (n > 0).then_some(n);
                }
                "cores" => s.cores = v.extract().map_err(bad)?,
                "ring_capacity" => s.ring_capacity = v.extract().map_err(bad)?,
                "engine_timeout_ms" => {
                    s.call_timeout = Duration::from_millis(v.extract().map_err(bad)?)
                }
                "seed" => s.scheduler.seed = v.extract().map_err(bad)?,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "unknown KvRouter setting {raw:?}; known: {}",
                        SETTINGS.join(", ")
                    )));
                }
            }
        }
    }
    s.scheduler.busy = busy;
    s.scheduler.validate().map_err(crate::error::from_engine)?;
    if !(1..=1024).contains(&s.cores) {
        return Err(PyValueError::new_err("cores must be within 1..=1024"));
    }
    if s.ring_capacity < 2 {
        return Err(PyValueError::new_err("ring_capacity must be at least 2"));
    }
    Ok((s, cached_refresh))
}

/// The KV-aware router, in-process: an index of the workers' caches plus the scheduler.
///
/// Args:
///     config: settings named as the `kvengine` command line's flags (`router_mode`,
///         `kv_cache_block_size`, `kv_overlap_score_weight`, `router_temperature`,
///         `busy_threshold`, `busy_max_waiting`, `request_timeout_secs`, `cores`, ...);
///         keyword arguments are merged over it.
///     policy: a callable choosing the worker from the scored candidates (see the docs,
///         "Custom routing policies"); `None` uses `router_mode`.
#[pyclass(frozen, module = "kvengine")]
#[derive(Debug)]
pub struct KvRouter {
    indexer: Py<KvIndexer>,
    shared: Arc<Shared>,
    policy: Option<Py<PyAny>>,
    config: SchedulerConfig,
    /// See [`DEFAULT_CACHED_REFRESH`].
    cached_refresh: Duration,
    /// When the cached-block totals were last read from the index (`None`: never).
    refreshed: Mutex<Option<Instant>>,
}

impl KvRouter {
    /// Re-reads the per-worker cached-block totals from the index if `force`, or if they
    /// are older than `cached_refresh` (or were never read). Called with the GIL released.
    fn refresh_cached(&self, hub: &Hub, now: Instant, force: bool) -> Result<(), TransportError> {
        let mut last = self
            .refreshed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !force && last.is_some_and(|t| now.saturating_duration_since(t) < self.cached_refresh) {
            return Ok(());
        }
        hub.refresh_cached_blocks()?;
        *last = Some(now);
        Ok(())
    }
}

#[pymethods]
impl KvRouter {
    #[new]
    #[pyo3(signature = (config = None, *, policy = None, **kwargs))]
    fn new(
        py: Python<'_>,
        config: Option<&Bound<'_, PyDict>>,
        policy: Option<Py<PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let (settings, cached_refresh) = settings_from(config, kwargs)?;
        if let Some(p) = &policy
            && !p.bind(py).is_callable()
        {
            return Err(PyTypeError::new_err("policy must be callable"));
        }
        let shared = py.detach(|| Shared::start(settings))?;
        let indexer = Py::new(
            py,
            KvIndexer {
                shared: Arc::clone(&shared),
                block_size: settings.scheduler.block_size,
            },
        )?;
        Ok(Self {
            indexer,
            shared,
            policy,
            config: settings.scheduler,
            cached_refresh,
            refreshed: Mutex::new(None),
        })
    }

    /// The router's index (shared: events applied there are what `route` sees).
    #[getter]
    fn indexer(&self, py: Python<'_>) -> Py<KvIndexer> {
        self.indexer.clone_ref(py)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.config.block_size
    }

    /// The configured mode (`custom` when a policy is set).
    #[getter]
    fn mode(&self) -> &'static str {
        match self.policy {
            Some(_) => RouteMode::Custom.as_str(),
            None => self.config.mode.as_str(),
        }
    }

    /// Registers a worker (with its data-parallel ranks, default rank 0) as a routing
    /// candidate. Workers whose events are applied or subscribed register themselves.
    #[pyo3(signature = (worker_id, dp_ranks = None))]
    fn add_worker(
        &self,
        py: Python<'_>,
        worker_id: u64,
        dp_ranks: Option<Vec<u32>>,
    ) -> PyResult<bool> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            let ranks: Vec<engine::DpRank> = dp_ranks
                .unwrap_or_default()
                .into_iter()
                .map(engine::DpRank)
                .collect();
            for &r in &ranks {
                shared.note_rank(WorkerKey {
                    worker: WorkerId(worker_id),
                    dp_rank: r,
                });
            }
            shared
                .hub()
                .register(Registration {
                    dp_ranks: ranks,
                    ..Registration::new(WorkerId(worker_id))
                })
                .map_err(from_transport)
        })
    }

    /// Removes a worker: its blocks, its active requests, its subscription. Returns whether
    /// it was known.
    fn remove_worker(&self, py: Python<'_>, worker_id: u64) -> PyResult<bool> {
        self.indexer.get().remove_worker_impl(py, worker_id)
    }

    /// Applies a batch of a worker's KV events (see `KvIndexer.apply_events`).
    #[pyo3(signature = (worker_id, batch, *, wait = true))]
    fn apply_events(
        &self,
        py: Python<'_>,
        worker_id: u64,
        batch: &Bound<'_, PyAny>,
        wait: bool,
    ) -> PyResult<Py<PyDict>> {
        self.indexer.get().apply_events(py, worker_id, batch, wait)
    }

    /// Subscribes to a worker's ZMQ KV events (see `KvIndexer.subscribe_zmq`).
    #[pyo3(signature = (worker_id, endpoint, replay = None))]
    fn subscribe_zmq(
        &self,
        py: Python<'_>,
        worker_id: u64,
        endpoint: &str,
        replay: Option<&str>,
    ) -> PyResult<()> {
        self.indexer
            .get()
            .subscribe_impl(py, worker_id, endpoint, replay)
    }

    /// Records the load a worker rank reports about itself (scraped from its metrics):
    /// requests waiting and the fraction of its KV cache in use. Busy thresholds and
    /// policies see it.
    #[pyo3(signature = (worker_id, num_requests_waiting, kv_usage, dp_rank = 0))]
    fn update_load(
        &self,
        py: Python<'_>,
        worker_id: u64,
        num_requests_waiting: u64,
        kv_usage: f64,
        dp_rank: u32,
    ) -> PyResult<()> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            shared
                .hub()
                .update_load(
                    WorkerKey::new(worker_id, dp_rank),
                    WorkerLoad {
                        num_requests_waiting,
                        kv_usage,
                    },
                )
                .map_err(from_transport)
        })
    }

    /// Chooses a worker for the prompt and records the request as active on it until
    /// `free(request_id)`.
    ///
    /// `token_ids` as for `find_matches_for_request`. `request_id` must not be active
    /// (one is generated when absent). Per-call overrides: `mode` (`kv`, `round-robin`,
    /// `random`, `direct`), `worker_id` (implies `direct`), `overlap_weight`,
    /// `temperature`; a call that names a mode or worker is routed by that mode even when
    /// a policy is set.
    ///
    /// Raises `ValueError` for a duplicate id or bad override, `KeyError` for an unknown
    /// worker, `kvengine.EngineError` when no worker is registered, and whatever the
    /// policy raised.
    #[pyo3(signature = (
        token_ids, request_id = None, *, lora_name = None, mode = None, worker_id = None,
        overlap_weight = None, temperature = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        request_id: Option<String>,
        lora_name: Option<String>,
        mode: Option<&str>,
        worker_id: Option<u64>,
        overlap_weight: Option<f64>,
        temperature: Option<f64>,
    ) -> PyResult<Decision> {
        not_in_policy()?;
        let tokens = crate::tokens::token_ids(token_ids)?;
        let mode = mode
            .map(RouteMode::from_str)
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("mode: {e}")))?;
        let overrides = RouteOverrides {
            mode,
            worker: worker_id.map(WorkerId),
            overlap_weight,
            temperature,
            ..RouteOverrides::default()
        };
        let policy = match (mode, worker_id, &self.policy) {
            (None, None, Some(p)) => Some(PyPolicy::new(
                p.clone_ref(py),
                tokens.len() / self.config.block_size as usize,
            )),
            _ => None,
        };
        let shared = Arc::clone(&self.shared);
        let (routed, policy_error) = py.detach(|| {
            let hub = shared.hub();
            let now = Instant::now();
            if let Err(e) = self.refresh_cached(hub, now, false) {
                return (Err(e), None);
            }
            let call = RouteCall {
                request_id,
                tokens: &tokens,
                lora_name: lora_name.as_deref(),
                cache_salt: None,
                overrides,
                session: None,
            };
            match policy {
                Some(mut p) => {
                    let r = hub.route_with(None, &call, now, &mut p);
                    (r, p.error.take())
                }
                None => (hub.route(None, &call, now), None),
            }
        });
        if let Some(e) = policy_error {
            return Err(e);
        }
        let routed = routed.map_err(from_transport)?;
        let d = routed.decision;
        Ok(Decision {
            request_id: routed.request_id,
            worker_id: d.worker.worker.0,
            dp_rank: d.worker.dp_rank.0,
            mode: d.mode.as_str().to_owned(),
            overlap_blocks: d.overlap_blocks,
            best_available_overlap_blocks: d.best_available_overlap_blocks,
            blocks: routed.blocks,
            busy_skipped: d.busy_skipped,
            candidates: d
                .candidates
                .iter()
                .map(|c| Candidate::from_score(c, routed.blocks))
                .collect(),
        })
    }

    /// Marks a routed request prefilled (its first token is out): its prompt no longer
    /// counts as prefill load.
    fn mark_prefilled(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || shared.hub().prefilled(&request_id).map_err(from_transport))
    }

    /// Frees a routed request (finished or cancelled).
    fn free(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || shared.hub().finish(&request_id).map_err(from_transport))
    }

    /// Re-reads the per-worker cached-block totals from the index now (`route` does it
    /// itself once they are `cached_refresh_ms` old). Until the next read, each route adds
    /// the blocks the chosen worker will store to its total.
    fn refresh_cached_blocks(&self, py: Python<'_>) -> PyResult<()> {
        not_in_policy()?;
        py.detach(|| self.refresh_cached(self.shared.hub(), Instant::now(), true))
            .map_err(from_transport)
    }

    /// Requests routed and not freed yet.
    #[getter]
    fn active_requests(&self, py: Python<'_>) -> PyResult<usize> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        Ok(py.detach(move || shared.hub().routing().active_requests()))
    }

    /// The load routed requests put on a worker rank: `{"active_blocks",
    /// "active_prefill_tokens", "active_requests"}`, or `None` for an unknown rank.
    #[pyo3(signature = (worker_id, dp_rank = 0))]
    fn active_load<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        dp_rank: u32,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        let load = py.detach(move || {
            shared
                .hub()
                .routing()
                .active_load(WorkerKey::new(worker_id, dp_rank))
        });
        load.map(|l| {
            let d = PyDict::new(py);
            d.set_item("active_blocks", l.active_blocks)?;
            d.set_item("active_prefill_tokens", l.active_prefill_tokens)?;
            d.set_item("active_requests", l.active_requests)?;
            Ok(d)
        })
        .transpose()
    }

    /// Which workers cache how much of the prompt (see `KvIndexer.find_matches_for_request`).
    #[pyo3(signature = (token_ids, lora_name = None))]
    fn find_matches_for_request<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.indexer
            .get()
            .find_matches_impl(py, token_ids, lora_name)
    }

    fn __repr__(&self) -> String {
        format!(
            "KvRouter(mode={:?}, kv_cache_block_size={}, cores={})",
            self.mode(),
            self.config.block_size,
            self.shared.cores()
        )
    }
}
