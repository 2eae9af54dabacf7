//! The engine's one error type.
//!
//! Every event or query the engine refuses maps to one variant, and every variant maps to one
//! [`RejectReason`], the label under which it is counted. A refused event changes nothing.

use crate::ids::{EngineHash, WorkerId, WorkerKey};

/// Why the engine refused an event, a query or a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A store named a parent engine hash this worker key does not hold.
    #[error("worker {worker}: unknown parent block {parent}")]
    UnknownParent {
        /// Who sent the store.
        worker: WorkerKey,
        /// The parent it named.
        parent: EngineHash,
    },
    /// A removal named an engine hash this worker key does not hold.
    #[error("worker {worker}: unknown block {block}")]
    UnknownBlock {
        /// Who sent the removal.
        worker: WorkerKey,
        /// The first unknown engine hash.
        block: EngineHash,
    },
    /// A store re-used an engine hash that this worker key already holds for another prefix.
    #[error("worker {worker}: block {block} is already stored under another prefix")]
    EngineHashConflict {
        /// Who sent the store.
        worker: WorkerKey,
        /// The conflicting engine hash.
        block: EngineHash,
    },
    /// The worker is not known to the engine.
    #[error("unknown worker {worker}")]
    UnknownWorker {
        /// The worker named.
        worker: WorkerId,
    },
    /// A worker's block size differs from the engine's.
    #[error("block size {got} does not match the configured {expected}")]
    BlockSizeMismatch {
        /// The engine's block size.
        expected: u32,
        /// What the worker reported.
        got: u32,
    },
    /// A request or routing call named no usable worker.
    #[error("no worker available")]
    NoWorkers,
    /// A routing call's pool has no registered worker (e.g. prefill with no prefill worker).
    #[error("no {pool} worker available")]
    NoWorkersInPool {
        /// The pool's name.
        pool: &'static str,
    },
    /// A request id that is not active.
    #[error("unknown request {0}")]
    UnknownRequest(crate::ids::RequestId),
    /// A request id that is already active.
    #[error("request {0} is already active")]
    DuplicateRequest(crate::ids::RequestId),
    /// Every candidate worker key already carries the most active requests allowed
    /// ([`crate::sched::SchedulerConfig::max_active_per_key`]): try again shortly.
    #[error("every worker is at its limit of {limit} active requests")]
    AtCapacity {
        /// The limit.
        limit: u64,
    },
    /// Every candidate worker is busy and the admission queue already holds its most
    /// waiters ([`crate::router::admission`]): try again shortly.
    #[error("every worker is busy and the admission queue is full ({capacity} waiting)")]
    QueueFull {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The worker key space of one index is exhausted.
    #[error("too many worker keys")]
    TooManyWorkers,
    /// A block position that is not a live block: an internal inconsistency between a
    /// directory and its index (never expected; counted where it happens).
    #[error("a block position that is not live")]
    UnknownPosition,
    /// An index has no room for more blocks: its run or node id space is exhausted, or the
    /// router's memory budget (`--max-index-bytes`) is spent.
    #[error("the index has no room for more blocks")]
    IndexFull,
    /// A store would take a worker key's directory past its cap of engine hashes
    /// (`--max-blocks-per-worker`); it was refused as a whole.
    #[error("worker {worker}: storing {blocks} more blocks would pass its cap of {limit}")]
    WorkerFull {
        /// Who sent the store.
        worker: WorkerKey,
        /// Blocks in the refused store.
        blocks: usize,
        /// The cap.
        limit: usize,
    },
    /// The sharded runtime has stopped (a shard thread is gone); nothing more can apply.
    #[error("the runtime has stopped")]
    RuntimeStopped,
    /// A core did not answer in time (it is stuck or badly behind); the call was given up.
    #[error("core {core} did not answer within {waited_ms} ms")]
    Timeout {
        /// The core that did not answer.
        core: usize,
        /// How long the caller waited.
        waited_ms: u64,
    },
    /// A snapshot that cannot be restored: damaged, of another format version, or taken
    /// under another shard layout.
    #[error("snapshot not usable: {0}")]
    BadSnapshot(String),
    /// A parameter outside its documented range.
    #[error("invalid {name}: {reason}")]
    InvalidArgument {
        /// The parameter.
        name: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// `Result` with [`EngineError`].
pub type Result<T> = std::result::Result<T, EngineError>;

/// The label a refusal is counted under (`kvengine_events_rejected_total{reason=...}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// See [`EngineError::UnknownParent`].
    UnknownParent,
    /// See [`EngineError::UnknownBlock`].
    UnknownBlock,
    /// See [`EngineError::EngineHashConflict`].
    EngineHashConflict,
    /// See [`EngineError::UnknownWorker`].
    UnknownWorker,
    /// See [`EngineError::BlockSizeMismatch`].
    BlockSizeMismatch,
    /// See [`EngineError::WorkerFull`].
    WorkerFull,
    /// See [`EngineError::IndexFull`].
    IndexFull,
    /// Any other refusal.
    Other,
}

impl RejectReason {
    /// Every reason, in counter order.
    pub const ALL: [RejectReason; 8] = [
        RejectReason::UnknownParent,
        RejectReason::UnknownBlock,
        RejectReason::EngineHashConflict,
        RejectReason::UnknownWorker,
        RejectReason::BlockSizeMismatch,
        RejectReason::WorkerFull,
        RejectReason::IndexFull,
        RejectReason::Other,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::UnknownParent => "unknown_parent",
            RejectReason::UnknownBlock => "unknown_block",
            RejectReason::EngineHashConflict => "engine_hash_conflict",
            RejectReason::UnknownWorker => "unknown_worker",
            RejectReason::BlockSizeMismatch => "block_size_mismatch",
            RejectReason::WorkerFull => "worker_full",
            RejectReason::IndexFull => "index_full",
            RejectReason::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl EngineError {
    /// The label this refusal is counted under.
    pub fn reason(&self) -> RejectReason {
        match self {
            EngineError::UnknownParent { .. } => RejectReason::UnknownParent,
            EngineError::UnknownBlock { .. } => RejectReason::UnknownBlock,
            EngineError::EngineHashConflict { .. } => RejectReason::EngineHashConflict,
            EngineError::UnknownWorker { .. } => RejectReason::UnknownWorker,
            EngineError::BlockSizeMismatch { .. } => RejectReason::BlockSizeMismatch,
            EngineError::WorkerFull { .. } => RejectReason::WorkerFull,
            EngineError::IndexFull => RejectReason::IndexFull,
            _ => RejectReason::Other,
        }
    }
}

/// Refusals counted per reason. Owned by one thread; exported by message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RejectCounts([u64; RejectReason::ALL.len()]);

impl RejectCounts {
    /// Counts one refusal of `reason`.
    pub fn add(&mut self, reason: RejectReason, n: u64) {
        if let Some(c) = self.0.get_mut(reason.index()) {
            *c = c.saturating_add(n);
        }
    }

    /// How many refusals of `reason` were counted.
    pub fn get(&self, reason: RejectReason) -> u64 {
        self.0.get(reason.index()).copied().unwrap_or(0)
    }

    /// All refusals.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `(reason, count)` for every reason.
    pub fn iter(&self) -> impl Iterator<Item = (RejectReason, u64)> + '_ {
        RejectReason::ALL.iter().map(|&r| (r, self.get(r)))
    }
}
