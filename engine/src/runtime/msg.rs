//! What travels over the rings between clients (ingest, query) and shards.

use crate::ids::SeqHash;
use crate::index::IndexStats;
use crate::matches::Matches;
use crate::sharding::ShardId;
use crate::sharding::ingest::OpBatch;

/// A client's message to one shard.
#[derive(Debug)]
pub(crate) enum ToShard {
    /// Operations to apply, in order.
    Ops(Vec<OpBatch>),
    /// A prefix query; the answer goes back on the asking client's reply ring.
    Query(Box<[SeqHash]>),
    /// Reply `Synced(n)` once everything this client sent before is applied.
    Sync(u64),
    /// Reply with this shard's figures.
    Stats,
}

/// A shard's reply to one client.
#[derive(Debug)]
pub(crate) enum FromShard {
    /// The answer to a query.
    Matches(Matches),
    /// Everything sent before `Sync(n)` is applied.
    Synced(u64),
    /// The shard's figures.
    Stats(ShardSummary),
}

/// One shard's figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSummary {
    /// Which shard.
    pub shard: ShardId,
    /// Block operations applied.
    pub applied: u64,
    /// Operations that could not apply (0 unless the ingest is wrong).
    pub inconsistencies: u64,
    /// Queries answered.
    pub queries: u64,
    /// Index sizes.
    pub index: IndexStats,
    /// The core it is pinned to, if any.
    pub pinned_core: Option<usize>,
}
