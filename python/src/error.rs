//! From the Rust crates' errors to Python exceptions.
//!
//! Bad input (malformed batches, wrong block sizes, bad arguments) is `ValueError`; an
//! unknown worker or request is `KeyError`; a stopped or stalled engine is
//! `kvengine.EngineError` (a `RuntimeError`); socket failures are `OSError`. Every message
//! is the Rust error's, which names what was wrong.

use engine::EngineError;
use pyo3::PyErr;
use pyo3::exceptions::{PyKeyError, PyOSError, PyRuntimeError, PyValueError};
use transport::error::TransportError;

pyo3::create_exception!(
    _kvengine,
    KvEngineError,
    PyRuntimeError,
    "The engine could not serve the call: it stopped, did not answer before its deadline, \
     no registered worker can take the request, or every one is at its active-request limit."
);

/// The Python exception for a transport (or hub) error.
pub(crate) fn from_transport(e: TransportError) -> PyErr {
    let msg = e.to_string();
    match e {
        TransportError::UnknownWorker(_)
        | TransportError::UnknownRequest(_)
        | TransportError::UnknownModel(_)
        | TransportError::UnknownRank { .. } => PyKeyError::new_err(msg),
        TransportError::Engine(e) => from_engine(e),
        TransportError::Overloaded { .. }
        | TransportError::TooManyReservations { .. }
        | TransportError::QueueFull { .. }
        | TransportError::QueueTimeout { .. } => KvEngineError::new_err(msg),
        TransportError::Io { .. } => PyOSError::new_err(msg),
        TransportError::MalformedMsgpack(_)
        | TransportError::MalformedFrame(_)
        | TransportError::MalformedJson(_)
        | TransportError::Oversized { .. }
        | TransportError::BlockSizeMismatch { .. }
        | TransportError::TokenCountMismatch { .. }
        | TransportError::Unauthorized(_)
        | TransportError::ReplicaMac { .. }
        | TransportError::UnsupportedVersion { .. }
        | TransportError::DuplicateRequest(_)
        | TransportError::TooManyRanks { .. }
        | TransportError::PromptTooLong { .. }
        | TransportError::Invalid { .. } => PyValueError::new_err(msg),
    }
}

/// The Python exception for an engine error.
pub(crate) fn from_engine(e: EngineError) -> PyErr {
    let msg = e.to_string();
    match e {
        EngineError::RuntimeStopped
        | EngineError::Timeout { .. }
        | EngineError::NoWorkers
        | EngineError::NoWorkersInPool { .. }
        | EngineError::AtCapacity { .. }
        | EngineError::QueueFull { .. } => KvEngineError::new_err(msg),
        EngineError::UnknownWorker { .. } => PyKeyError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}
