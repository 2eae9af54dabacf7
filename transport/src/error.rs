//! The transport crate's one error type, the labels dropped input is counted under, and
//! [`chain`]: an error and its sources as one line.

use engine::{EngineError, RejectReason};

/// Why a transport refused or dropped input. Every variant maps to a [`DropReason`] label
/// for `kvengine_events_rejected_total{reason=...}`.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A msgpack KV-event batch (vLLM / SGLang) could not be decoded.
    #[error("malformed msgpack batch: {0}")]
    MalformedMsgpack(String),
    /// A frame failed validation: native (rkyv), replica, or ZMTP (a greeting, command or
    /// message frame from a ZMQ peer).
    #[error("malformed frame: {0}")]
    MalformedFrame(String),
    /// A JSON body could not be decoded.
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    /// A body, frame or batch is larger than the configured limit.
    #[error("{what} of {got} bytes exceeds the limit of {limit} bytes")]
    Oversized {
        /// What was too large.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The limit.
        limit: usize,
    },
    /// A stored event's block size differs from the router's.
    #[error("block size {got} differs from the router's {expected}")]
    BlockSizeMismatch {
        /// The router's block size.
        expected: u32,
        /// The event's.
        got: u32,
    },
    /// A stored event's token count is not `blocks * block_size`.
    #[error("stored event has {tokens} token ids for {blocks} blocks of {block_size}")]
    TokenCountMismatch {
        /// Token ids carried.
        tokens: usize,
        /// Block hashes carried.
        blocks: usize,
        /// Block size in force.
        block_size: u32,
    },
    /// The worker is not registered.
    #[error("unknown worker {0}")]
    UnknownWorker(u64),
    /// A load report for a rank the worker was not registered with, nor has published
    /// events for (load reports never create ranks).
    #[error("worker {worker} has no rank {dp_rank}")]
    UnknownRank {
        /// The worker.
        worker: u64,
        /// The rank named.
        dp_rank: u32,
    },
    /// A worker's events named more ranks than [`crate::hub::MAX_RANKS_PER_WORKER`].
    #[error("worker {worker} would have more than {limit} data-parallel ranks")]
    TooManyRanks {
        /// The worker.
        worker: u64,
        /// The cap.
        limit: usize,
    },
    /// No worker serves the requested model.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// A connection presented no or the wrong ingest token.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    /// A replica message (load frame, resync request, snapshot) without a valid MAC
    /// (`--replica-secret`).
    #[error("replica {what} {why} (is --replica-secret the same on every replica?)")]
    ReplicaMac {
        /// `frame`, `resync` or `snapshot`.
        what: &'static str,
        /// What is wrong with its MAC.
        why: &'static str,
    },
    /// A peer speaks a protocol version this build does not.
    #[error("unsupported protocol version {got} (this build speaks {supported})")]
    UnsupportedVersion {
        /// The peer's version.
        got: u32,
        /// Ours.
        supported: u32,
    },
    /// No active request has this id.
    #[error("no active request {0:?}")]
    UnknownRequest(String),
    /// A request with this id is already active.
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
    /// The router already carries its most active requests (`--max-active-requests`): try
    /// again shortly.
    #[error("the router is at its limit of {limit} active requests")]
    Overloaded {
        /// The limit.
        limit: usize,
    },
    /// Every candidate worker is busy and the model's admission queue holds its most
    /// waiters (`--admission-queue`): try again shortly.
    #[error("every worker is busy and the admission queue is full ({capacity} waiting)")]
    QueueFull {
        /// The queue's capacity.
        capacity: usize,
    },
    /// A request waited in the admission queue for `--admission-timeout-ms` without a
    /// worker dropping below its busy threshold.
    #[error(
        "every worker stayed busy for the {waited_ms} ms this request may wait (--admission-timeout-ms)"
    )]
    QueueTimeout {
        /// How long it waited.
        waited_ms: u64,
    },
    /// A client of the routing API already holds its most open reservations
    /// (`--max-reservations-per-client`).
    #[error(
        "{client} holds {limit} open route reservations, the most one client may \
         (--max-reservations-per-client): free finished ones with DELETE /v1/requests/{{id}}"
    )]
    TooManyReservations {
        /// The client (its address).
        client: String,
        /// The cap.
        limit: usize,
    },
    /// A prompt longer than `--max-prompt-tokens`.
    #[error("the prompt has more than {limit} tokens (--max-prompt-tokens)")]
    PromptTooLong {
        /// The cap.
        limit: usize,
    },
    /// A request or registration is invalid.
    #[error("invalid {name}: {reason}")]
    Invalid {
        /// What is invalid.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// The engine refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Socket, TLS or file I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The `wire` crate's refusals, as the router names (and counts) them: the same variants
/// and messages as before the decoders moved there.
impl From<wire::WireError> for TransportError {
    fn from(e: wire::WireError) -> Self {
        match e {
            wire::WireError::Oversized { what, got, limit } => {
                TransportError::Oversized { what, got, limit }
            }
            wire::WireError::MalformedMsgpack { what, at } => {
                TransportError::MalformedMsgpack(format!("{what} at byte {at}"))
            }
            wire::WireError::MalformedJson { what, source } => {
                TransportError::MalformedJson(format!("{what}: {source}"))
            }
        }
    }
}

/// `Result` with [`TransportError`].
pub type Result<T> = std::result::Result<T, TransportError>;

/// Why a call to a worker whose answer the router reads (health check, metrics page, model
/// list, prefill answer, TensorRT-LLM event page) gave no answer to use
/// ([`crate::outbound::fetch`]).
#[derive(Debug, thiserror::Error)]
pub enum WorkerCallError {
    /// No connection or no answer: refused, unresolvable, a failed TLS handshake (the
    /// causes, `: `-separated).
    #[error("{0}")]
    Connect(String),
    /// The answer was larger than its kind's cap (it was not read further).
    #[error("{kind} answer over the cap of {cap} bytes")]
    TooLarge {
        /// What the answer was for.
        kind: crate::worker_answers::BodyKind,
        /// The cap.
        cap: usize,
    },
    /// The answer was not whole within its deadline.
    #[error("{kind} answer not whole within {deadline:?}")]
    TooSlow {
        /// What the answer was for.
        kind: crate::worker_answers::BodyKind,
        /// The deadline of the whole exchange.
        deadline: std::time::Duration,
    },
    /// The answer broke off.
    #[error("the answer broke off: {0}")]
    Broken(String),
}

/// The label a dropped or refused input is counted under. The engine's own refusals keep
/// their [`RejectReason`] labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// A msgpack batch that does not decode.
    MalformedMsgpack,
    /// A native, replica or ZMTP frame (or ZMTP greeting) that fails validation.
    MalformedFrame,
    /// A JSON body that does not decode.
    MalformedJson,
    /// Too large.
    Oversized,
    /// Block size differs from the router's.
    BlockSizeMismatch,
    /// Token count is not blocks times block size.
    TokenCountMismatch,
    /// A block stored in (or removed from) a medium other than GPU memory.
    NonGpuMedium,
    /// An event for a worker that is not registered.
    UnknownWorker,
    /// Missing or wrong ingest token, or a replica message (frame, resync request,
    /// snapshot) without a valid MAC (`--replica-secret`).
    Unauthorized,
    /// Unsupported protocol version.
    UnsupportedVersion,
    /// A batch whose sequence number was already applied (replay overlap).
    DuplicateSeq,
    /// A store refused because the index was over its memory budget (`--max-index-bytes`;
    /// the engine counts its own `index_full` under the same label).
    IndexFull,
    /// A QUIC connection that did not complete its authenticated hello in time (closed).
    HelloTimeout,
    /// A QUIC connection refused at once: too many connections had not authenticated yet.
    TooManyUnauthenticated,
    /// The engine refused an event (see [`RejectReason`]).
    Engine(RejectReason),
    /// Anything else.
    Other,
}

impl DropReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::MalformedMsgpack => "malformed_msgpack",
            DropReason::MalformedFrame => "malformed_frame",
            DropReason::MalformedJson => "malformed_json",
            DropReason::Oversized => "oversized",
            DropReason::BlockSizeMismatch => "block_size_mismatch",
            DropReason::TokenCountMismatch => "token_count_mismatch",
            DropReason::NonGpuMedium => "non_gpu_medium",
            DropReason::UnknownWorker => "unknown_worker",
            DropReason::Unauthorized => "unauthorized",
            DropReason::UnsupportedVersion => "unsupported_version",
            DropReason::DuplicateSeq => "duplicate_seq",
            DropReason::IndexFull => "index_full",
            DropReason::HelloTimeout => "hello_timeout",
            DropReason::TooManyUnauthenticated => "too_many_unauthenticated",
            DropReason::Engine(r) => r.as_str(),
            DropReason::Other => "other",
        }
    }
}

impl TransportError {
    /// The label this error is counted under.
    pub fn reason(&self) -> DropReason {
        match self {
            TransportError::MalformedMsgpack(_) => DropReason::MalformedMsgpack,
            TransportError::MalformedFrame(_) => DropReason::MalformedFrame,
            TransportError::MalformedJson(_) => DropReason::MalformedJson,
            TransportError::Oversized { .. } => DropReason::Oversized,
            TransportError::BlockSizeMismatch { .. } => DropReason::BlockSizeMismatch,
            TransportError::TokenCountMismatch { .. } => DropReason::TokenCountMismatch,
            TransportError::UnknownWorker(_)
            | TransportError::UnknownRank { .. }
            | TransportError::TooManyRanks { .. } => DropReason::UnknownWorker,
            TransportError::Unauthorized(_) | TransportError::ReplicaMac { .. } => {
                DropReason::Unauthorized
            }
            TransportError::UnsupportedVersion { .. } => DropReason::UnsupportedVersion,
            TransportError::Engine(e) => DropReason::Engine(e.reason()),
            TransportError::Invalid { .. }
            | TransportError::UnknownRequest(_)
            | TransportError::UnknownModel(_)
            | TransportError::DuplicateRequest(_)
            | TransportError::Overloaded { .. }
            | TransportError::QueueFull { .. }
            | TransportError::QueueTimeout { .. }
            | TransportError::TooManyReservations { .. }
            | TransportError::Io { .. } => DropReason::Other,
            TransportError::PromptTooLong { .. } => DropReason::Oversized,
        }
    }
}

/// `e` and its sources, `: `-separated (a client error's cause, e.g. the TLS verifier's
/// complaint, is in its sources), repeated messages once.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let msg = s.to_string();
        if !out.ends_with(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        source = s.source();
    }
    out
}
