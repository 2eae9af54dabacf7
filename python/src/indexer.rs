//! `kvengine.KvIndexer`: the exact prefix index of which worker caches which block, fed by
//! KV events (handed in, or subscribed to over ZMQ) and asked which workers hold how much of
//! a prompt. Dynamo's `KvIndexer` surface, with kvengine's engine underneath.
//!
//! # Threads
//! Every method may be called from any Python thread at the same time; index work runs
//! with the GIL released. A routing policy (see `router.rs`) must not call back into the
//! indexer or router it runs for: that raises `RuntimeError`.

use crate::core::{EngineSettings, Shared};
use crate::error::from_transport;
use crate::events::RawBatch;
use crate::guard::not_in_policy;
use engine::hash::{DEFAULT_BLOCK_SIZE, chain, lora_seed, seq_hashes, tokens_hashes};
use engine::sched::SchedulerConfig;
use engine::{Matches, TokensHash, WorkerId, WorkerKey};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::time::Duration;
use transport::zmq::ZmqSource;

/// The exact KV-block index of a cluster's workers, in-process.
///
/// Args:
///     block_size: tokens per KV block; must equal the workers' page size.
///     cores: shard threads the index runs on (default 1). More cores ingest and answer
///         more in parallel on a many-core host.
#[pyclass(frozen, module = "kvengine")]
#[derive(Debug)]
pub struct KvIndexer {
    pub(crate) shared: Arc<Shared>,
    pub(crate) block_size: u32,
}

pub(crate) fn check_block_size(block_size: u32) -> PyResult<u32> {
    match block_size {
        0 => Err(PyValueError::new_err("block_size must be positive")),
        n => Ok(n),
    }
}

/// `Matches` as Dynamo's Python API returns them: `{worker_id: blocks}`, or
/// `{(worker_id, dp_rank): blocks}` for workers with data-parallel ranks.
pub(crate) fn matches_dict<'py>(
    py: Python<'py>,
    shared: &Shared,
    matches: &Matches,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let ranked = shared.note_and_check_ranks(&matches.overlaps);
    for (&(key, blocks), ranked) in matches.overlaps.iter().zip(ranked) {
        if ranked {
            out.set_item((key.worker.0, key.dp_rank.0), blocks)?;
        } else {
            out.set_item(key.worker.0, blocks)?;
        }
    }
    Ok(out)
}

impl KvIndexer {
    pub(crate) fn remove_worker_impl(&self, py: Python<'_>, worker_id: u64) -> PyResult<bool> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            let worker = WorkerId(worker_id);
            shared.forget(worker);
            let hub = shared.hub();
            let removed = hub.remove_worker(worker).map_err(from_transport)?;
            // As for `clear`: every shard's share is gone when this returns.
            hub.sync().map_err(from_transport)?;
            Ok(removed.is_some())
        })
    }

    pub(crate) fn subscribe_impl(
        &self,
        py: Python<'_>,
        worker_id: u64,
        endpoint: &str,
        replay: Option<&str>,
    ) -> PyResult<()> {
        not_in_policy()?;
        let source =
            ZmqSource::new(WorkerId(worker_id), endpoint, replay).map_err(from_transport)?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || shared.subscribe(source))
    }

    pub(crate) fn find_matches_impl<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        not_in_policy()?;
        let tokens = crate::tokens::token_ids(token_ids)?;
        let seed = lora_seed(lora_name);
        let bs = self.block_size as usize;
        let shared = Arc::clone(&self.shared);
        let matches = py.detach(move || {
            let seqs = seq_hashes(&tokens, bs, seed);
            shared.hub().find_matches_for(&seqs).map_err(from_transport)
        })?;
        matches_dict(py, &self.shared, &matches)
    }

    fn apply_decoded(
        &self,
        py: Python<'_>,
        worker_id: u64,
        batch: RawBatch,
        wait: bool,
    ) -> PyResult<Py<PyDict>> {
        let shared = Arc::clone(&self.shared);
        let block_size = self.block_size;
        let worker = WorkerId(worker_id);
        let (decoded, blocks) = py.detach(move || -> PyResult<_> {
            let mut decoded = batch
                .decode(worker_id, block_size)
                .map_err(from_transport)?;
            shared.ensure_worker(worker)?;
            let key = WorkerKey {
                worker,
                dp_rank: decoded.dp_rank,
            };
            shared.note_rank(key);
            let events = std::mem::take(&mut decoded.events);
            let blocks: usize = events.iter().map(|e| e.blocks()).sum();
            let n = events.len();
            let hub = shared.hub();
            hub.ingest(key, events).map_err(from_transport)?;
            if wait {
                hub.sync().map_err(from_transport)?;
            }
            Ok((decoded, (n, blocks)))
        })?;
        let out = PyDict::new(py);
        out.set_item("events", blocks.0)?;
        out.set_item("blocks", blocks.1)?;
        let dropped = PyDict::new(py);
        for (reason, n) in &decoded.drops {
            dropped.set_item(reason.as_str(), n)?;
        }
        out.set_item("dropped", dropped)?;
        if let Some(got) = decoded.block_size_mismatch {
            return Err(PyValueError::new_err(format!(
                "stored events of worker {worker_id} have block size {got}, this index \
                 {block_size}: they were dropped (the batch's other events applied); set \
                 block_size to the workers' page size"
            )));
        }
        Ok(out.unbind())
    }
}

#[pymethods]
impl KvIndexer {
    #[new]
    #[pyo3(signature = (block_size = DEFAULT_BLOCK_SIZE as u32, cores = None))]
    fn new(py: Python<'_>, block_size: u32, cores: Option<usize>) -> PyResult<Self> {
        let block_size = check_block_size(block_size)?;
        let settings = EngineSettings {
            scheduler: SchedulerConfig {
                block_size,
                ..SchedulerConfig::default()
            },
            cores: cores.unwrap_or(1),
            ring_capacity: 1024,
            call_timeout: Duration::from_secs(5),
        };
        let shared = py.detach(|| Shared::start(settings))?;
        Ok(Self { shared, block_size })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Shard threads the index runs on.
    #[getter]
    fn cores(&self) -> usize {
        self.shared.cores()
    }

    /// Applies one batch of `worker_id`'s KV events, in order, after every batch handed in
    /// before it for that worker.
    ///
    /// `batch` is vLLM's msgpack payload (`bytes`, exactly as its ZMQ publisher sends it;
    /// SGLang's too), or the JSON shape of `POST /v1/events` as a dict
    /// (`{"dp_rank": 0, "events": [{"type": "stored", ...}]}`) or a list of event dicts.
    /// The worker is registered on first use. With `wait` (default) the call returns once
    /// the index shows the batch; without it, once the batch is queued.
    ///
    /// Returns `{"events": n, "blocks": n, "dropped": {reason: n}}`: what was handed to the
    /// index and what conversion dropped (blocks offloaded off the GPU, say). Stores whose
    /// parent the worker never stored are refused by the index and counted in `stats()`.
    ///
    /// Raises `ValueError` for a batch that does not decode, a JSON event with the wrong
    /// number of tokens (nothing of that batch applies), or stored events of another block
    /// size (the rest of the batch applies).
    #[pyo3(signature = (worker_id, batch, *, wait = true))]
    pub(crate) fn apply_events(
        &self,
        py: Python<'_>,
        worker_id: u64,
        batch: &Bound<'_, PyAny>,
        wait: bool,
    ) -> PyResult<Py<PyDict>> {
        not_in_policy()?;
        let raw = RawBatch::from_py(batch)?;
        self.apply_decoded(py, worker_id, raw, wait)
    }

    /// Clears every block `worker_id` (rank `dp_rank`) holds.
    #[pyo3(signature = (worker_id, dp_rank = 0))]
    fn clear(&self, py: Python<'_>, worker_id: u64, dp_rank: u32) -> PyResult<usize> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            let hub = shared.hub();
            let n = hub
                .clear(WorkerKey::new(worker_id, dp_rank))
                .map_err(from_transport)?;
            // The home core answers at once; the other shards drop their share at their next
            // round. Wait for them, so a query made after this returns sees the clear.
            hub.sync().map_err(from_transport)?;
            Ok(n)
        })
    }

    /// Removes `worker_id`: all its ranks' blocks, its subscription and (for a router) its
    /// active requests. Returns whether it was known.
    fn remove_worker(&self, py: Python<'_>, worker_id: u64) -> PyResult<bool> {
        self.remove_worker_impl(py, worker_id)
    }

    /// Subscribes to a vLLM / SGLang worker's ZMQ KV-event publisher (`tcp://host:5557`)
    /// and, with `replay` (`tcp://host:5558`), repairs gaps from its replay buffer. Runs in
    /// the background on a Rust thread until the worker is removed or the indexer dropped;
    /// batches are fenced by sequence number exactly as in the `kvengine` server.
    #[pyo3(signature = (worker_id, endpoint, replay = None))]
    fn subscribe_zmq(
        &self,
        py: Python<'_>,
        worker_id: u64,
        endpoint: &str,
        replay: Option<&str>,
    ) -> PyResult<()> {
        self.subscribe_impl(py, worker_id, endpoint, replay)
    }

    /// Worker ids with a running ZMQ subscription.
    fn subscriptions(&self) -> Vec<u64> {
        self.shared.subscribed().into_iter().map(|w| w.0).collect()
    }

    /// Which workers cache how many leading blocks of this prompt: `{worker_id: blocks}`
    /// (`{(worker_id, dp_rank): blocks}` for workers with data-parallel ranks). Workers
    /// holding none of it are absent.
    ///
    /// `token_ids`: a list of ints, or (much faster for long prompts) `bytes` of
    /// little-endian u32s / an `array.array("I")` / a numpy uint32 array.
    #[pyo3(signature = (token_ids, lora_name = None))]
    fn find_matches_for_request<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.find_matches_impl(py, token_ids, lora_name)
    }

    /// Like `find_matches_for_request`, from the prompt's block hashes as
    /// `compute_block_hashes` returns them (Dynamo's local block hashes, in order).
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        not_in_policy()?;
        let locals: Vec<TokensHash> = crate::tokens::block_hashes(block_hashes)?
            .into_iter()
            .map(TokensHash)
            .collect();
        let shared = Arc::clone(&self.shared);
        let matches = py.detach(move || {
            let seqs = chain(None, &locals);
            shared.hub().find_matches_for(&seqs).map_err(from_transport)
        })?;
        matches_dict(py, &self.shared, &matches)
    }

    /// The prompt's block hashes at this index's block size (see the module function).
    #[pyo3(signature = (token_ids, lora_name = None))]
    fn compute_block_hashes(
        &self,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&str>,
    ) -> PyResult<Vec<u64>> {
        compute_block_hashes(token_ids, self.block_size, lora_name)
    }

    /// The index's figures: `{"cores", "applied", "queries", "entries", "rejected":
    /// {reason: n}}` summed over the shard threads (`entries` counts a block copied to
    /// several shards once per copy).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        not_in_policy()?;
        let shared = Arc::clone(&self.shared);
        let cores = py.detach(move || shared.hub().core_stats().map_err(from_transport))?;
        let out = PyDict::new(py);
        let rejected = PyDict::new(py);
        let mut totals = engine::RejectCounts::default();
        for c in &cores {
            for (reason, n) in c.rejects.iter() {
                totals.add(reason, n);
            }
        }
        for (reason, n) in totals.iter() {
            rejected.set_item(reason.as_str(), n)?;
        }
        out.set_item("cores", cores.len())?;
        out.set_item("applied", cores.iter().map(|c| c.applied).sum::<u64>())?;
        out.set_item("queries", cores.iter().map(|c| c.queries).sum::<u64>())?;
        out.set_item(
            "entries",
            cores.iter().map(|c| c.index.entries).sum::<u64>(),
        )?;
        out.set_item("rejected", rejected)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!(
            "KvIndexer(block_size={}, cores={})",
            self.block_size,
            self.shared.cores()
        )
    }
}

/// The prompt's block hashes: XXH3-64 (seed 1337, or the LoRA adapter's seed) of each full
/// block's token ids as little-endian u32s. Bit-exact with Dynamo's `compute_block_hash_for_seq`
/// (its `LocalBlockHash`); the trailing partial block is not hashed.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size = DEFAULT_BLOCK_SIZE as u32, lora_name = None))]
pub fn compute_block_hashes(
    token_ids: &Bound<'_, PyAny>,
    block_size: u32,
    lora_name: Option<&str>,
) -> PyResult<Vec<u64>> {
    hash_prompt(token_ids, block_size, lora_name, |t, bs, seed| {
        tokens_hashes(t, bs, seed)
            .into_iter()
            .map(|h| h.0)
            .collect()
    })
}

/// The prompt's sequence hashes: block i's hash names the whole prefix up to it (what the
/// index is keyed by; DESIGN.md "Vocabulary").
#[pyfunction]
#[pyo3(signature = (token_ids, block_size = DEFAULT_BLOCK_SIZE as u32, lora_name = None))]
pub fn compute_seq_hashes(
    token_ids: &Bound<'_, PyAny>,
    block_size: u32,
    lora_name: Option<&str>,
) -> PyResult<Vec<u64>> {
    hash_prompt(token_ids, block_size, lora_name, |t, bs, seed| {
        seq_hashes(t, bs, seed).into_iter().map(|h| h.0).collect()
    })
}

/// Reads the prompt, then hashes it with `hash(tokens, block_size, seed)`, GIL released.
fn hash_prompt(
    token_ids: &Bound<'_, PyAny>,
    block_size: u32,
    lora_name: Option<&str>,
    hash: fn(&[u32], usize, u64) -> Vec<u64>,
) -> PyResult<Vec<u64>> {
    let block_size = check_block_size(block_size)? as usize;
    let tokens = crate::tokens::token_ids(token_ids)?;
    let seed = lora_seed(lora_name);
    Ok(token_ids
        .py()
        .detach(move || hash(&tokens, block_size, seed)))
}
