//! The exact KV index of one shard: worker directories plus the prefix tree.
//!
//! [`KvIndex`] applies typed [`KvEvent`]s per worker key and answers prefix queries. It is
//! DESIGN.md's "Semantics of the index" made concrete, as [`Directories`] (the event
//! semantics, shared with the sharded ingest) storing into one [`ShardIndex`], the
//! path-compressed tree. Directories record tree positions (`engine hash -> Pos`, 12
//! bytes an entry), so a removal goes straight to its block without any seq_hash lookup;
//! `engine/tests/index_model.rs` checks the whole against a plain `HashMap` model on random
//! event interleavings.
//!
//! # Invariants
//! 1. For every worker key, the tree's copy count of each block equals the sum of the
//!    directory counts of the engine hashes that name it (DESIGN.md's multiset).
//! 2. A refused event changes nothing (see [`Directories`]).
//! 3. A worker key that holds nothing has neither a directory nor a slot, so memory returns
//!    to the empty footprint when everyone removes everything.
//! 4. Every refusal is counted once under its [`crate::RejectReason`].
//!
//! # Concurrency
//! Owned by one thread; queries take `&self`, so several threads may query a `KvIndex` that
//! nobody changes.

pub use crate::directories::Applied;

use crate::directories::{BlockStore, Directories};
use crate::error::{RejectCounts, Result};
use crate::event::{KvEvent, StoredBlock};
use crate::ids::{EngineHash, SeqHash, WorkerId, WorkerKey};
use crate::index::{IndexStats, Pos, ShardIndex};
use crate::matches::Matches;

/// Sizes of a [`KvIndex`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// The prefix tree.
    pub index: IndexStats,
    /// Engine hashes in all directories.
    pub directory_entries: usize,
    /// Heap bytes of all directories.
    pub directory_bytes: usize,
    /// Heap bytes of everything (tree + directories).
    pub bytes: usize,
}

/// The tree as the directories see it: blocks are recorded by position.
#[derive(Debug, Default)]
struct Tree {
    tree: ShardIndex,
    /// Positions a removal named that were not live blocks of the worker (0 unless the
    /// directories and the tree disagree).
    stale: u64,
}

impl BlockStore<Pos> for Tree {
    #[inline]
    fn seq_of(&self, block: Pos) -> Option<SeqHash> {
        self.tree.seq(block)
    }

    #[inline]
    fn same_block(&self, a: Pos, b: Pos) -> bool {
        a == b
    }

    #[inline]
    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<Pos>,
        seqs: &[SeqHash],
        out: &mut Vec<Pos>,
    ) -> Result<()> {
        self.tree.store(key, parent, seqs, out)
    }

    #[inline]
    fn remove(&mut self, key: WorkerKey, blocks: &[Pos]) {
        self.stale += self.tree.remove(key, blocks).missing as u64;
    }
}

/// The exact KV index of one shard.
#[derive(Debug, Default)]
pub struct KvIndex {
    dirs: Directories<Pos>,
    tree: Tree,
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps each worker key at `max` engine hashes (`None`: no cap); a store past it is
    /// refused as a whole (see [`Directories::with_max_blocks_per_key`]).
    pub fn with_max_blocks_per_key(mut self, max: Option<usize>) -> Self {
        self.dirs = self.dirs.with_max_blocks_per_key(max);
        self
    }

    /// Applies one event of `key`. A refused event is counted and changes nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        self.dirs.apply(key, event, &mut self.tree)
    }

    /// Stores a chain of blocks under `parent` for `key`; returns how many were added.
    ///
    /// Refused as a whole (and counted) if `parent` is unknown for `key`, the store would
    /// pass `key`'s cap, or an engine hash is already stored for `key` under another prefix.
    pub fn apply_stored(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
    ) -> Result<usize> {
        let result = self.dirs.store(key, parent, blocks, &mut self.tree);
        self.dirs.count(&result);
        result
    }

    /// Drops one copy of each listed block of `key`. Unknown engine hashes are counted
    /// under `unknown_block` and skipped; the known ones are applied.
    pub fn apply_removed(&mut self, key: WorkerKey, blocks: &[EngineHash]) -> Applied {
        self.dirs.remove(key, blocks, &mut self.tree)
    }

    /// Empties `key`'s cache (one dp rank only); returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> usize {
        self.dirs.clear(key, &mut self.tree)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        self.dirs.remove_worker(worker, &mut self.tree)
    }

    /// Overlaps of the request `seqs` (see [`Matches`]).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        self.tree.tree.find_matches(seqs)
    }

    /// Distinct blocks `key` holds (the scheduler's tie-breaker).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.tree.tree.cached_blocks(key)
    }

    /// Worker keys holding at least one block.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.dirs.worker_keys()
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.dirs.rejects()
    }

    /// Removals the tree could not apply (0 unless directories and tree disagree).
    pub fn inconsistencies(&self) -> u64 {
        self.tree.stale
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> KvStats {
        let index = self.tree.tree.stats();
        let (directory_entries, directory_bytes) = self.dirs.size();
        KvStats {
            index,
            directory_entries,
            directory_bytes,
            bytes: index.bytes + directory_bytes,
        }
    }
}
