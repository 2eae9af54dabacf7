//! Splitting the index across shards: which shard holds which block, and who asks whom.
//!
//! A shard owns a partition of the index outright (its own [`ShardIndex`]); nothing is
//! shared. Every query must be answerable by exactly one shard, so all blocks of one
//! request's path must be in the shard its query goes to. A [`ShardPolicy`] decides:
//!
//! * the [`Route`] of every stored block, from its parent's route and its own seq_hash (the
//!   ingest side keeps routes in the worker directories, so a removal goes straight to the
//!   shards that hold the block);
//! * which shard answers a query.
//!
//! Blocks that many sequences share (a system prompt) must not pin all traffic to one
//! shard, so a policy may place a block [`Placement::Everywhere`]: every shard holds a copy
//! and applies its events.
//!
//! The modules here are sans-IO and single-threaded: [`ingest::Ingest`] turns KV events
//! into per-shard operation batches, [`shard::Shard`] applies them, and
//! [`sharded::ShardedIndex`] wires N shards to one ingest in one thread, which is both the
//! exactness reference for the threaded runtime and what its tests compare against the
//! reference model.
//!
//! # Invariants (every policy MUST keep them)
//! 1. For any request `seqs`, every stored block whose seq_hash is `seqs[i]` is placed
//!    `Everywhere` or in `query_shard(seqs)`.
//! 2. `place` is a pure function of the parent's route and the block's seq_hash, so every
//!    worker (and every copy of an engine hash) gets the same route for the same block.
//!
//! [`ShardIndex`]: crate::index::ShardIndex

pub mod fixed_depth;
pub mod ingest;
pub mod shard;
pub mod sharded;

use crate::ids::SeqHash;
use std::fmt;

/// A shard's number, `0..shards`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(pub u16);

impl ShardId {
    /// The shard as an index into per-shard vectors.
    #[inline]
    pub fn idx(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shard-{}", self.0)
    }
}

/// A block's route as a policy encodes it (opaque outside the policy; stored per directory
/// entry, so it is 4 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Route(pub u32);

/// Where a block's entries live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In every shard.
    Everywhere,
    /// In one shard.
    Shard(ShardId),
}

/// How the index is split. See the module docs for the invariants implementations MUST
/// keep. Implementations are immutable and cheap to call on the hot path (no allocation,
/// no locks).
pub trait ShardPolicy: Send + Sync + fmt::Debug {
    /// Number of shards.
    fn shards(&self) -> usize;

    /// The route of a block with `seq`, whose parent has route `parent` (`None` for the
    /// first block of a sequence).
    fn place(&self, parent: Option<Route>, seq: SeqHash) -> Route;

    /// Where the entries of a block with `route` live.
    fn placement(&self, route: Route) -> Placement;

    /// The shard that answers a query for `seqs`.
    fn query_shard(&self, seqs: &[SeqHash]) -> ShardId;
}

/// Maps a uniform 64-bit hash onto `0..shards` (Lemire's multiply-shift: no division).
#[inline]
pub fn shard_of(hash: u64, shards: usize) -> ShardId {
    ShardId(((u128::from(hash) * shards as u128) >> 64) as u16)
}
