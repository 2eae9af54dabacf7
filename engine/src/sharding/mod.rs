//! Splitting the index across shards: which shard holds which block, and who asks whom.
//!
//! A shard owns a partition of the index outright (its own [`ShardIndex`]); nothing is
//! shared. Every query must be answerable by exactly one shard, so all blocks of one
//! request's path must be in the shard its query goes to. A [`ShardPolicy`] decides:
//!
//! * the [`Route`] of every stored block, from its parent and its own seq_hash (the ingest
//!   side keeps routes in the worker directories, so a removal goes straight to the shards
//!   that hold the block);
//! * which shard answers a query.
//!
//! Blocks that many sequences share (a system prompt) must not pin all traffic to one
//! shard, so a policy may place a block [`Placement::Everywhere`]: every shard holds a copy
//! and applies its events. [`adaptive::Adaptive`] (the default) decides which blocks by the
//! traffic (the [`trunk`]); [`fixed_depth::FixedDepth`] replicates the first `D` blocks of
//! every sequence.
//!
//! The modules here are sans-IO and single-threaded: [`ingest::Ingest`] turns KV events
//! into per-shard operation batches ([`ops`]), [`shard::Shard`] applies them, and
//! [`sharded::ShardedIndex`] wires N shards to one ingest in one thread, which is both the
//! exactness reference for the threaded runtime and what its tests compare against the
//! reference model.
//!
//! # Invariants (every policy MUST keep them, for a given trunk version)
//! 1. For any request `seqs`, every stored block on the request's path whose seq_hash is
//!    `seqs[i]` is placed `Everywhere` or in `query_shard(seqs)`.
//! 2. `place` is a pure function of the parent (its seq_hash and route) and the block's
//!    seq_hash, so every worker (and every copy of an engine hash) gets the same route for
//!    the same block.
//! 3. A chain is placed `Everywhere` for a prefix and in one shard after it: a block below
//!    one placed in a shard is placed in that shard.
//! 4. `placement(seq, route)` is where the block is now: for a block whose route was
//!    computed under an older trunk, promotion may have made it `Everywhere`, never moved it
//!    to another shard.
//!
//! [`ShardIndex`]: crate::index::ShardIndex

pub mod adaptive;
pub mod choice;
pub mod fixed_depth;
pub mod ingest;
pub mod ops;
pub mod promote;
pub mod shard;
pub mod sharded;
pub mod trunk;

use crate::ids::SeqHash;
use crate::snapshot::image::{ArchivedTrunkImage, TrunkImage};
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
/// keep. Routing calls are cheap on the hot path (no allocation, no locks); a policy with a
/// trunk reads a snapshot of it, picked up by [`ShardPolicy::refresh`].
pub trait ShardPolicy: Send + Sync + fmt::Debug {
    /// Number of shards.
    fn shards(&self) -> usize;

    /// The route of a block with `seq` whose parent is `parent` (its seq_hash and route;
    /// `None` for the first block of a sequence).
    fn place(&self, parent: Option<(SeqHash, Route)>, seq: SeqHash) -> Route;

    /// Where the entries of the block `seq`, placed at `route`, live now.
    fn placement(&self, seq: SeqHash, route: Route) -> Placement;

    /// The shard that answers a query for `seqs`, a prompt's chain of seq_hashes from its
    /// first block (what `crate::hash` computes; a slice that is not a chain gets some
    /// shard, and its answer may miss blocks, never a panic).
    fn query_shard(&self, seqs: &[SeqHash]) -> ShardId;

    /// Picks up the latest trunk, if the policy has one (called by the policy's owner
    /// between events, never between the blocks of one event).
    fn refresh(&mut self) {}

    /// Should `tip`, a block of one shard's private part of the index that now has
    /// `fanout` children there, join the trunk?
    fn is_junction(&self, _tip: SeqHash, _fanout: u32) -> bool {
        false
    }

    /// Is `seq` in the trunk?
    fn in_trunk(&self, _seq: SeqHash) -> bool {
        false
    }

    /// Publishes a promotion: `path` joins the trunk and `pins` stay in `from` (policies
    /// without a trunk ignore it).
    fn promote(&mut self, _path: &[SeqHash], _pins: &[SeqHash], _from: ShardId) {}

    /// The trunk, for a snapshot (empty for policies without one).
    fn trunk_image(&self) -> TrunkImage {
        TrunkImage::default()
    }

    /// Publishes a snapshot's trunk (before any core starts; ignored by policies without
    /// a trunk).
    fn restore_trunk(&mut self, _trunk: &ArchivedTrunkImage) {}
}

/// Maps a uniform 64-bit hash onto `0..shards` (Lemire's multiply-shift: no division).
#[inline]
pub fn shard_of(hash: u64, shards: usize) -> ShardId {
    ShardId(((u128::from(hash) * shards as u128) >> 64) as u16)
}

/// Test helper: the placement of every block of one chain, each placed after its parent.
#[cfg(test)]
pub(crate) fn chain_placements(p: &dyn ShardPolicy, seqs: &[SeqHash]) -> Vec<Placement> {
    let mut parent = None;
    seqs.iter()
        .map(|&s| {
            let r = p.place(parent, s);
            parent = Some((s, r));
            p.placement(s, r)
        })
        .collect()
}
