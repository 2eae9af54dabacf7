//! Typed KV events, as every transport decodes them.
//!
//! Events are per worker key. Engine hashes are the worker's own ids; the engine resolves them
//! through that worker's directory and never recomputes them.

use crate::ids::{EngineHash, TokensHash};

/// One block of a store: the worker's id for it and the hash of its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    /// The worker's own id for the block.
    pub engine_hash: EngineHash,
    /// Hash of the block's tokens (see [`crate::hash::tokens_hash`]).
    pub tokens_hash: TokensHash,
}

/// A change to one worker key's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A chain of blocks was stored: `blocks[0]`'s parent is `parent` (`None`: it starts a
    /// sequence), every later block's parent is the block before it.
    Stored {
        /// Engine hash of the block before `blocks[0]`.
        parent: Option<EngineHash>,
        /// The new blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// One copy of each listed block was evicted.
    Removed {
        /// Engine hashes of the evicted blocks.
        blocks: Vec<EngineHash>,
    },
    /// The worker key's whole cache was emptied.
    Cleared,
}

impl KvEvent {
    /// Blocks the event names (0 for `Cleared`): a measure of the work applying it takes.
    pub fn blocks(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            KvEvent::Removed { blocks } => blocks.len(),
            KvEvent::Cleared => 0,
        }
    }
}
