//! The exact KV index of one shard: worker directories plus the prefix index.
//!
//! [`KvIndex`] applies typed [`KvEvent`]s per worker key and answers prefix queries. It is
//! DESIGN.md's "Semantics of the index" made concrete, as [`Directories`] (the event
//! semantics, shared with the sharded ingest) feeding one [`Shard`];
//! `engine/tests/index_model.rs` checks it against a plain `HashMap` model on random event
//! interleavings.
//!
//! # Invariants
//! 1. For every worker key, the index's copy count of each seq_hash equals the sum of the
//!    directory counts of the engine hashes mapped to it (DESIGN.md's multiset).
//! 2. A refused event changes nothing (see [`Directories`]).
//! 3. A worker key that holds nothing has neither a directory nor a slot, so memory returns
//!    to the empty footprint when everyone removes everything.
//! 4. Every refusal is counted once under its [`crate::RejectReason`].
//!
//! # Concurrency
//! Owned by one thread.

pub use crate::directories::Applied;

use crate::directories::{Directories, Unrouted};
use crate::error::{RejectCounts, Result};
use crate::event::{KvEvent, StoredBlock};
use crate::ids::{EngineHash, SeqHash, WorkerId, WorkerKey};
use crate::index::IndexStats;
use crate::matches::Matches;
use crate::sharding::ShardId;
use crate::sharding::shard::Shard;

/// Sizes of a [`KvIndex`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// The prefix index.
    pub index: IndexStats,
    /// Engine hashes in all directories.
    pub directory_entries: usize,
    /// Heap bytes of all directories.
    pub directory_bytes: usize,
    /// Heap bytes of everything (index + directories).
    pub bytes: usize,
}

/// The exact KV index of one shard.
#[derive(Debug)]
pub struct KvIndex {
    dirs: Directories<()>,
    shard: Shard,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self {
            dirs: Directories::new(),
            shard: Shard::new(ShardId(0)),
        }
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event of `key`. A refused event is counted and changes nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        self.dirs.apply(key, event, &Unrouted, &mut self.shard)
    }

    /// Stores a chain of blocks under `parent` for `key`; returns how many were added.
    ///
    /// Refused as a whole (and counted) if `parent` is unknown for `key` or an engine hash
    /// is already stored for `key` under another prefix.
    pub fn apply_stored(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
    ) -> Result<usize> {
        let result = self
            .dirs
            .store(key, parent, blocks, &Unrouted, &mut self.shard);
        self.dirs.count(&result);
        result
    }

    /// Drops one copy of each listed block of `key`. Unknown engine hashes are counted
    /// under `unknown_block` and skipped; the known ones are applied.
    pub fn apply_removed(&mut self, key: WorkerKey, blocks: &[EngineHash]) -> Applied {
        self.dirs.remove(key, blocks, &mut self.shard)
    }

    /// Empties `key`'s cache (one dp rank only); returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> usize {
        self.dirs.clear(key, &mut self.shard)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        self.dirs.remove_worker(worker, &mut self.shard)
    }

    /// Overlaps of the request `seqs` (see [`Matches`]).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        self.shard.find_matches(seqs)
    }

    /// Distinct blocks `key` holds (the scheduler's tie-breaker).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.shard.cached_blocks(key)
    }

    /// Worker keys holding at least one block.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.dirs.worker_keys()
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.dirs.rejects()
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> KvStats {
        let index = self.shard.stats();
        let (directory_entries, directory_bytes) = self.dirs.size();
        KvStats {
            index,
            directory_entries,
            directory_bytes,
            bytes: index.bytes + directory_bytes,
        }
    }
}
