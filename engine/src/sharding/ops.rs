//! What the ingest sends the shards: batches of block operations for one worker key.
//!
//! A leaf of `sharding`: [`ingest`](super::ingest) produces these batches, a
//! [`Shard`](super::shard::Shard) applies them, and the threaded runtime carries them
//! between cores; none of them needs the others to name the message.
//!
//! # Invariants
//! 1. A store batch's `seqs` are one chain in chain order: `seqs[0]` continues `parent`
//!    and each block continues the one before it.
//! 2. A batch holds the operations of one worker key for one shard, in event order.

use crate::ids::{SeqHash, WorkerKey};

/// What to do with a batch's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockOp {
    /// One more copy of each block, as a chain continuing `parent` (`None`: the chain
    /// starts a sequence).
    Store {
        /// The seq_hash of the block the chain continues.
        parent: Option<SeqHash>,
    },
    /// One copy fewer of each block.
    Remove,
}

/// Operations of one worker key for one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpBatch {
    /// Whose blocks.
    pub key: WorkerKey,
    /// What to do with them.
    pub op: BlockOp,
    /// The blocks, in event order (for a store: the chain, in chain order).
    pub seqs: Vec<SeqHash>,
}
