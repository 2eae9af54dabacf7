//! One shard's worth of the prefix index: a path-compressed radix tree of blocks.
//!
//! Consecutive blocks that the same worker keys hold the same number of times, with no
//! branch between them, form one node. A node is a view over a range of a *run*: the
//! contiguous seq_hashes of blocks stored together. So a store of a 96-block tail is one
//! node, one allocation and one contiguous copy; a query walks nodes and compares runs
//! sequentially; holder sets are per node, not per block. Splitting a node (a worker holds
//! part of it, or a chain diverges inside it) only cuts a view in two, so a block never
//! moves: its [`Pos`] is stable while it lives, and a worker's directory records it
//! (`engine hash -> Pos`, 12 bytes) instead of a seq_hash.
//!
//! Stores and removals come by position (the single-shard index, whose directories know
//! positions) or by seq_hash (the sharded engine, whose directories live with the ingest):
//! every tree keeps a keyless `seq_hash -> Pos` table ([`ShardIndex::find`], 5 bytes a
//! block). Queries use it too: DESIGN.md defines a worker's overlap by which seq_hashes it
//! holds, not by where they hang, so a query block that does not continue the walk is
//! looked up wherever it is stored (for a request's real chain that is one probe, where
//! the match ends).
//!
//! # Invariants
//! 1. DESIGN.md's multiset: for every worker key, the copies it holds of each block are the
//!    stores minus the removals the callers applied for it. Every block of a node has the
//!    same holder multiset; a node's first block continues its parent's last block.
//! 2. A block lives iff it is held or a held block hangs below it; a node whose blocks are
//!    unheld and that has no children is pruned at once, so when every worker removes
//!    everything the tree is back to its empty footprint (every slab resets).
//! 3. Two siblings never start with the same seq_hash: a store follows existing blocks
//!    before it creates any.
//! 4. After every call, a node and its only child are merged when they view adjacent
//!    ranges of one run with the same holders (path compression is restored after splits).
//! 5. `blocks` = blocks of held nodes; `entries` = sum over held nodes of length x distinct
//!    holders = sum of [`WorkerSlots::blocks`].
//!
//! # Concurrency
//! Owned by one thread (its shard); `&mut self` for every change, queries take `&self`.
//!
//! # Algorithm
//! A radix tree with path compression (Morrison's PATRICIA, over block hashes instead of
//! bits), as SGLang's and Dynamo's compressed trees do; nodes as views over immutable runs
//! are this crate's choice, so that positions survive splits.

mod children;
mod holders;
mod image;
mod nodes;
mod path;
mod pos;
mod remove;
mod runs;
mod seq_index;
mod shape;
mod slots;
mod store;
#[cfg(test)]
mod tests;
mod validate;
mod walk;

pub use image::holder_key;
pub use path::PathPiece;
pub use pos::{MAX_RUN_LEN, MAX_RUNS, Pos, RunId};
pub use remove::Removed;
pub use slots::{Slot, WorkerSlots};
pub use store::RebuiltSeqIndex;

use crate::ids::{SeqHash, WorkerKey};
use children::{ChildMap, ChildMaps};
use holders::{Holders, SetSlab};
use nodes::Nodes;
use runs::Runs;
use seq_index::SeqIndex;

/// Sizes of one index, for tests, metrics and the memory benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks held by anyone.
    pub blocks: usize,
    /// `(block, worker key)` pairs held.
    pub entries: u64,
    /// Live tree nodes.
    pub nodes: usize,
    /// Worker keys holding anything.
    pub worker_keys: usize,
    /// Heap bytes owned by the index.
    pub bytes: usize,
}

/// The prefix index of one shard.
#[derive(Debug, Default)]
pub struct ShardIndex {
    nodes: Nodes,
    runs: Runs,
    maps: ChildMaps,
    root: ChildMap,
    sets: SetSlab,
    slots: WorkerSlots,
    by_seq: SeqIndex,
    /// Blocks of live nodes (held or structural).
    stored: usize,
    /// Blocks pruned since the seq_hash table was last rebuilt (its stale entries).
    dead: usize,
    /// Dead entries' rebuilds wait for the owner's check ([`ShardIndex::defer_dead_rebuilds`]).
    defer_dead_rebuilds: bool,
    blocks: usize,
    entries: u64,
    branch: Option<(Pos, u32)>,
}

impl ShardIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// The slot table (worker key <-> slot).
    pub fn slots(&self) -> &WorkerSlots {
        &self.slots
    }

    /// The seq_hash of the block at `pos`, if it is stored.
    #[inline]
    pub fn seq(&self, pos: Pos) -> Option<SeqHash> {
        self.runs.seq(pos)
    }

    /// The position of the live block `seq`.
    #[inline]
    pub fn find(&self, seq: SeqHash) -> Option<Pos> {
        self.by_seq.find(seq, |p| self.is_live(p, seq))
    }

    /// Is the block at `pos` live and named `seq`?
    #[inline]
    pub fn is_live(&self, pos: Pos, seq: SeqHash) -> bool {
        self.runs.seq(pos) == Some(seq) && self.locate(pos).is_some()
    }

    /// Does `key` hold the block at `pos`?
    pub fn holds(&self, key: WorkerKey, pos: Pos) -> bool {
        let (Some(slot), Some((n, _))) = (self.slots.get(key), self.locate(pos)) else {
            return false;
        };
        self.nodes
            .get(n)
            .is_some_and(|node| self.sets.contains(Holders::from_raw(node.holders), slot))
    }

    /// Distinct blocks `key` holds.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.slots.get(key).map_or(0, |s| self.slots.blocks(s))
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks,
            entries: self.entries,
            nodes: self.nodes.len(),
            worker_keys: self.slots.len(),
            bytes: self.nodes.heap_bytes()
                + self.runs.heap_bytes()
                + self.maps.heap_bytes()
                + self.root.heap_bytes()
                + self.sets.heap_bytes()
                + self.slots.heap_bytes()
                + self.by_seq.heap_bytes(),
        }
    }
}
