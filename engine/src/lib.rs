//! kvengine's core.
//!
//! This crate holds everything that decides: block hashing, the exact prefix index of which
//! worker holds which block, the per-worker engine-hash directory, worker selection, and the
//! thread-per-core runtime that runs shards of the index on cores. It opens no sockets,
//! reads no clock (callers pass `now`; the runtime only parks with a timeout), and never
//! panics on input: every refusal is an [`EngineError`], counted by [`RejectReason`].
//! Everything but [`runtime`] is single-threaded and sans-IO.
//!
//! # Components
//! * [`hash`]: `tokens_hash` / `seq_hash` exactly as DESIGN.md defines them.
//! * [`index`]: one shard's worth of the prefix index (`seq_hash -> holders`).
//! * [`directory`]: per worker key, `engine hash -> seq_hash` with copy counts, in a
//!   [`paged`] table that grows a page at a time.
//! * [`directories`]: every worker key's directory and what a KV event means (shared by
//!   the single-shard index and the sharded ingest).
//! * [`kv_index`]: the two together, applying typed [`event::KvEvent`]s.
//! * [`sched`]: active requests, the cost function and the routing modes.
//! * [`approx`]: the index fed by routing decisions when workers publish no events.
//! * [`sharding`]: splitting the index across shards (policy, ingest routing, shards).
//! * [`ring`]: the bounded SPSC ring that threads use to talk to shards.
//! * [`runtime`]: the thread-per-core runtime: shard threads, ingest and query handles.
//! * [`snapshot`]: the engine at a consistent cut, as a checksummed file, for warm restarts.
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod approx;
pub mod directories;
pub mod directory;
pub mod error;
pub mod event;
pub mod hash;
pub mod ids;
pub mod index;
pub mod kv_index;
pub mod matches;
pub mod paged;
pub mod ring;
pub mod router;
pub mod runtime;
pub mod sched;
pub mod sharding;
pub mod snapshot;
mod sole_writer;
mod sync;

pub use error::{EngineError, RejectCounts, RejectReason, Result};
pub use ids::{
    DpRank, EngineHash, ReplicaId, RequestId, SeqHash, SessionId, TokensHash, WaiterId, WorkerId,
    WorkerKey,
};
pub use matches::Matches;
