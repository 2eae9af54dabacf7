//! The simulator's one error type.
//!
//! Every refusal of the simulator (a bad configuration, a request id used twice, a malformed
//! trace line, an engine call that failed) is one [`SimError`] variant with typed fields. A
//! refused call changes nothing.

use std::path::PathBuf;

use engine::{EngineError, RequestId};

/// Why the simulator refused a call or an input.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration value outside its documented range.
    #[error("invalid {name}: {reason}")]
    InvalidConfig {
        /// The setting.
        name: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A request id that is already being served by this worker.
    #[error("request {0} is already active on this worker")]
    DuplicateRequest(RequestId),
    /// A request id this worker is not serving.
    #[error("request {0} is not active on this worker")]
    UnknownRequest(RequestId),
    /// A request the simulated engine cannot serve as submitted.
    #[error("request {id}: {reason}")]
    InvalidRequest {
        /// The request.
        id: RequestId,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A request whose whole sequence (prompt and outputs) needs more pages than the
    /// engine's KV cache has, so it could never finish.
    #[error("request {id} needs {needed_blocks} KV blocks, the cache has {kv_blocks}")]
    RequestTooLarge {
        /// The request.
        id: RequestId,
        /// Pages its prompt and outputs need.
        needed_blocks: u64,
        /// Pages in the cache.
        kv_blocks: u32,
    },
    /// A trace file could not be read.
    #[error("cannot read trace {path}: {source}")]
    TraceIo {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A trace line is not a valid JSON record.
    #[error("trace line {line}: {source}")]
    TraceJson {
        /// 1-based line number.
        line: usize,
        /// The decode error.
        source: serde_json::Error,
    },
    /// A trace record decodes but is inconsistent.
    #[error("trace line {line}: {reason}")]
    TraceRecord {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The routing engine refused a call.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
}

/// `Result` with [`SimError`].
pub type Result<T> = std::result::Result<T, SimError>;
