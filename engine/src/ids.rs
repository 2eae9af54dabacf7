//! Typed identifiers used across the engine.
//!
//! Every id is a `Copy` newtype over an integer so that a worker id can never be passed where
//! a block hash is expected. Interning of strings (model names, LoRA names) into ids happens at
//! the edge, never per block.

use std::fmt;

/// A GPU worker (one engine process group), as the cluster names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

/// A data-parallel rank inside one worker. Each rank is its own engine with its own KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DpRank(pub u32);

/// The unit everything is tracked per: one data-parallel rank of one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
}

impl WorkerKey {
    /// The key of `worker`'s rank `dp_rank`.
    pub const fn new(worker: u64, dp_rank: u32) -> Self {
        Self {
            worker: WorkerId(worker),
            dp_rank: DpRank(dp_rank),
        }
    }
}

/// XXH3 hash of one block's token ids: position independent, not chained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TokensHash(pub u64);

/// Chained hash naming a whole prefix: the block and every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHash(pub u64);

/// A worker's own opaque id for a block (vLLM's u64, SGLang's i64 bit-cast, or a folded
/// digest). Only meaningful together with the worker key that reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// A routed request, as the caller names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// One kvengine router process among replicas that route as one (chosen at start, so a
/// restarted replica is a new one: what its previous life added expires with it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u64);

/// A client's session (sticky routing, [`crate::router::sessions`]): the 64-bit XXH3 of the
/// session header's value, so the table's memory does not depend on what clients send and
/// replicas name a session alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl SessionId {
    /// The id of a session named `name` (the header's value, as sent).
    pub fn of(name: &[u8]) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(name))
    }
}

/// A request waiting in an admission queue ([`crate::router::admission`]), named by its
/// driver (unique among the driver's waiters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaiterId(pub u64);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(
    WorkerId, DpRank, TokensHash, SeqHash, EngineHash, RequestId, WaiterId
);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker, self.dp_rank)
    }
}
