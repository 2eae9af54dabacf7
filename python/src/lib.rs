//! `import kvengine`: kvengine's exact KV-block index and router inside a Python process.
//!
//! The extension module `kvengine._kvengine`; the Python package (`python/py/kvengine`)
//! re-exports it beside the pure-Python HTTP `Client`. The classes are thin: the index,
//! the scheduler, the event decoders and the ZMQ subscriber are the engine and transport
//! crates' own, driven through the same `Hub` as the server, so an answer here is the
//! server's answer.
//!
//! # Components
//! * `indexer`: `KvIndexer`, `compute_block_hashes`, `compute_seq_hashes`.
//! * `router`: `KvRouter`, `Decision`.
//! * `candidate`: `Candidate`, one worker rank as the cost function saw it.
//! * `policy`: a Python callable as the engine's routing `Policy`.
//! * `core`: the engine, hub and ZMQ runtime an indexer and its router share.
//! * `events`, `tokens`: Python objects to batches and token ids.
//! * `guard`: refuses calls back into the router from inside its policy.
//! * `error`: Rust errors to Python exceptions.

mod candidate;
mod core;
mod error;
mod events;
mod guard;
mod indexer;
mod policy;
mod router;
mod tokens;

use pyo3::prelude::*;

// No mimalloc here, unlike the server: as a global allocator in a dlopen()ed extension it
// fails to load ("cannot allocate memory in static TLS block").

#[pymodule]
fn _kvengine(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<indexer::KvIndexer>()?;
    m.add_class::<router::KvRouter>()?;
    m.add_class::<router::Decision>()?;
    m.add_class::<candidate::Candidate>()?;
    m.add_function(wrap_pyfunction!(indexer::compute_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(indexer::compute_seq_hashes, m)?)?;
    m.add("EngineError", m.py().get_type::<error::KvEngineError>())?;
    m.add("DEFAULT_BLOCK_SIZE", engine::hash::DEFAULT_BLOCK_SIZE)?;
    Ok(())
}
