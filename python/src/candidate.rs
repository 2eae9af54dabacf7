//! `kvengine.Candidate`: one worker rank as the cost function saw it, in a `Decision`'s
//! list and in what a Python routing policy receives.
//!
//! A leaf: `router` builds candidates for decisions and `policy` for the callable, and the
//! policy reads the one the callable chose back; neither needs the other for it.
//!
//! # Invariants
//! 1. The load fields (`active_*`, `num_requests_waiting`, `kv_usage`, `cached_blocks`)
//!    are `Some` exactly in the candidates a policy receives ([`Candidate::with_load`]).
//! 2. Frozen: a candidate never changes after it is built.

use engine::WorkerKey;
use engine::sched::{CandidateScore, KeyLoad};
use pyo3::prelude::*;

/// One candidate worker rank as the cost function saw it.
///
/// `active_*`, `num_requests_waiting`, `kv_usage` and `cached_blocks` are filled for the
/// candidates a routing policy receives and are `None` in a `Decision`'s list.
#[pyclass(frozen, get_all, skip_from_py_object, module = "kvengine")]
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The worker.
    pub worker_id: u64,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Leading blocks of the prompt it caches.
    pub overlap_blocks: u32,
    /// Blocks it would prefill for this request, its queue included.
    pub prefill_blocks: f64,
    /// Blocks it would hold in active requests with this one added.
    pub decode_blocks: u64,
    /// The kv cost (lower is better): `overlap_weight * prefill_blocks + decode_blocks`
    /// with `router_cost="dynamo"` (the default), predicted TTFT in ms with `"ttft"`.
    pub logit: f64,
    /// Distinct blocks of its active requests.
    pub active_blocks: Option<u64>,
    /// Tokens its active requests have still to prefill.
    pub active_prefill_tokens: Option<u64>,
    /// Requests routed to it and not freed.
    pub active_requests: Option<u64>,
    /// Requests waiting in its queue, as it last reported (`update_load`).
    pub num_requests_waiting: Option<u64>,
    /// Fraction of its KV cache in use, as it last reported.
    pub kv_usage: Option<f64>,
    /// Blocks it caches in total (as of the last refresh).
    pub cached_blocks: Option<u64>,
    /// Full blocks in the prompt (the same for every candidate of a call).
    pub prompt_blocks: usize,
}

impl Candidate {
    pub(crate) fn from_score(c: &CandidateScore, prompt_blocks: usize) -> Self {
        Self {
            worker_id: c.key.worker.0,
            dp_rank: c.key.dp_rank.0,
            overlap_blocks: c.overlap_blocks,
            prefill_blocks: c.prefill_blocks,
            decode_blocks: c.decode_blocks,
            logit: c.logit,
            active_blocks: None,
            active_prefill_tokens: None,
            active_requests: None,
            num_requests_waiting: None,
            kv_usage: None,
            cached_blocks: None,
            prompt_blocks,
        }
    }

    pub(crate) fn with_load(
        c: &CandidateScore,
        prompt_blocks: usize,
        load: KeyLoad,
        cached: u64,
    ) -> Self {
        Self {
            active_blocks: Some(load.active.active_blocks),
            active_prefill_tokens: Some(load.active.active_prefill_tokens),
            active_requests: Some(load.active.active_requests),
            num_requests_waiting: load.reported.map(|r| r.num_requests_waiting),
            kv_usage: load.reported.map(|r| r.kv_usage),
            cached_blocks: Some(cached),
            ..Self::from_score(c, prompt_blocks)
        }
    }

    pub(crate) fn key(&self) -> WorkerKey {
        WorkerKey::new(self.worker_id, self.dp_rank)
    }
}

#[pymethods]
impl Candidate {
    /// `(worker_id, dp_rank)`.
    #[getter(key)]
    fn py_key(&self) -> (u64, u32) {
        (self.worker_id, self.dp_rank)
    }

    fn __repr__(&self) -> String {
        format!(
            "Candidate(worker_id={}, dp_rank={}, overlap_blocks={}, prefill_blocks={:?}, \
             decode_blocks={}, logit={:?})",
            self.worker_id,
            self.dp_rank,
            self.overlap_blocks,
            self.prefill_blocks,
            self.decode_blocks,
            self.logit
        )
    }
}
