//! The simulated workers' one error type (the lab's only typed error: its harnesses report
//! with `anyhow`, but `kvengine sim`, the replay cluster and the tests match on these).
//!
//! A refused call changes nothing: a worker that fails to start has released what it
//! bound, and a fault refused by a stopped worker was not injected.

use sim::SimError;

/// Why a simulated worker refused a call or failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A worker setting outside its documented range.
    #[error("invalid {name}: {reason}")]
    InvalidConfig {
        /// The setting.
        name: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The simulated engine refused its configuration.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// A KV-event publisher socket (vLLM format) could not be bound.
    #[error("transport: {0}")]
    Transport(#[from] transport::TransportError),
    /// A worker's HTTP socket failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A worker that has stopped (or is stopping) was asked something.
    #[error("the simulated worker has stopped")]
    Stopped,
    /// A fault this worker cannot simulate (a restart of a TensorRT-LLM-format worker).
    #[error("{0} is not simulated for this worker")]
    Unsupported(&'static str),
}

/// `Result` with [`WorkerError`].
pub type Result<T> = std::result::Result<T, WorkerError>;
