//! A Python callable as a routing policy: `KvRouter(policy=fn)`.
//!
//! The engine scores every candidate as for `kv` mode (overlap, prefill and decode blocks,
//! logit) and hands the list, with each candidate's active and reported load, to the
//! callable; it returns the worker to use. Everything else (busy filtering, recording the
//! request as active, expiry) stays in Rust.
//!
//! # Locks and the GIL
//! The callable runs under the hub's routing lock, holding the GIL. That is safe because
//! no thread waits for the routing lock while holding the GIL: every route call releases
//! the GIL before it reaches the hub (core.rs invariant 1). A thread running the policy may
//! wait for the GIL; the thread holding it never waits for the lock, so it lets go. A call
//! back into the router from inside the policy would wait for its own lock: `guard.rs`
//! turns that into a `RuntimeError`.

use crate::candidate::Candidate;
use crate::guard::InPolicy;
use engine::sched::kv::KvPolicy;
use engine::sched::{Policy, RouteMode, SelectionInput};
use engine::{EngineError, WorkerKey};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use rand::rngs::SmallRng;

/// The refusal the engine sees when the callable failed; the caller raises `error` instead.
const POLICY_FAILED: EngineError = EngineError::InvalidArgument {
    name: "policy",
    reason: "the routing policy raised or chose no candidate",
};

/// See the module docs.
pub(crate) struct PyPolicy {
    callable: Py<PyAny>,
    prompt_blocks: usize,
    /// What the callable raised (or why its answer was refused).
    pub(crate) error: Option<PyErr>,
}

impl PyPolicy {
    pub(crate) fn new(callable: Py<PyAny>, prompt_blocks: usize) -> Self {
        Self {
            callable,
            prompt_blocks,
            error: None,
        }
    }
}

impl Policy for PyPolicy {
    fn mode(&self) -> RouteMode {
        RouteMode::Custom
    }

    fn select(
        &mut self,
        input: &SelectionInput<'_>,
        rng: &mut SmallRng,
    ) -> engine::Result<WorkerKey> {
        let _marked = InPolicy::enter();
        let answer = Python::attach(|py| -> PyResult<Option<WorkerKey>> {
            let candidates = input
                .candidates
                .iter()
                .map(|c| {
                    Candidate::with_load(
                        c,
                        self.prompt_blocks,
                        (input.load)(c.key),
                        (input.cached_blocks)(c.key),
                    )
                })
                .collect::<Vec<_>>();
            let list = PyList::new(py, candidates)?;
            let chosen = self.callable.call1(py, (list,))?;
            parse_choice(chosen.bind(py), input)
        });
        match answer {
            Ok(Some(key)) => Ok(key),
            // `None`: the policy defers to the kv cost for this request.
            Ok(None) => KvPolicy.select(input, rng),
            Err(e) => {
                self.error = Some(e);
                Err(POLICY_FAILED)
            }
        }
    }
}

/// The key a policy's answer names: a `Candidate`, a `(worker_id, dp_rank)` tuple, or a
/// worker id (its lowest-logit candidate rank). `None` defers to the kv cost.
fn parse_choice(
    chosen: &Bound<'_, PyAny>,
    input: &SelectionInput<'_>,
) -> PyResult<Option<WorkerKey>> {
    if chosen.is_none() {
        return Ok(None);
    }
    let key = if let Ok(c) = chosen.cast::<Candidate>() {
        c.get().key()
    } else if let Ok(t) = chosen.cast::<PyTuple>() {
        let (w, r): (u64, u32) = t
            .extract()
            .map_err(|_| PyTypeError::new_err("a policy's tuple answer is (worker_id, dp_rank)"))?;
        WorkerKey::new(w, r)
    } else if let Ok(w) = chosen.extract::<u64>() {
        input
            .candidates
            .iter()
            .filter(|c| c.key.worker.0 == w)
            .min_by(|a, b| a.logit.total_cmp(&b.logit))
            .map(|c| c.key)
            .ok_or_else(|| not_offered(&format!("worker {w}"), input))?
    } else {
        return Err(PyTypeError::new_err(format!(
            "a routing policy returns a Candidate, a worker id, a (worker_id, dp_rank) tuple \
             or None, not {}",
            chosen.get_type().name()?
        )));
    };
    match input.candidates.iter().any(|c| c.key == key) {
        true => Ok(Some(key)),
        false => Err(not_offered(
            &format!("(worker {}, rank {})", key.worker.0, key.dp_rank.0),
            input,
        )),
    }
}

fn not_offered(what: &str, input: &SelectionInput<'_>) -> PyErr {
    let offered: Vec<String> = input
        .candidates
        .iter()
        .map(|c| format!("({}, {})", c.key.worker.0, c.key.dp_rank.0))
        .collect();
    PyValueError::new_err(format!(
        "the routing policy chose {what}, which is not a candidate; candidates (worker_id, \
         dp_rank): {}",
        offered.join(", ")
    ))
}
