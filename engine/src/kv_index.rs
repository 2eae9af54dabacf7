//! The exact KV index of one shard: worker directories plus the prefix index.
//!
//! [`KvIndex`] applies typed [`KvEvent`]s per worker key and answers prefix queries. It is
//! DESIGN.md's "Semantics of the index" made concrete; `engine/tests/index_model.rs` checks it
//! against a plain `HashMap` model on random event interleavings.
//!
//! # Invariants
//! 1. For every worker key, the index's copy count of each seq_hash equals the sum of the
//!    directory counts of the engine hashes mapped to it (DESIGN.md's multiset).
//! 2. A refused event changes nothing: a store is validated (parent) before it is applied,
//!    and a store that hits an engine-hash conflict half way is rolled back.
//! 3. A worker key with an empty directory holds nothing and has neither a directory nor a
//!    slot, so memory returns to the empty footprint when everyone removes everything.
//! 4. Every refusal is counted once under its [`RejectReason`].
//!
//! # Concurrency
//! Owned by one thread; the sharded runtime gives each shard its own.

use crate::directory::{Directory, Insert};
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::{KvEvent, StoredBlock};
use crate::hash::seq_hash;
use crate::ids::{EngineHash, SeqHash, WorkerId, WorkerKey};
use crate::index::{IndexStats, ShardIndex, Slot};
use crate::matches::Matches;
use hashbrown::HashMap;

/// What an accepted event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Block copies added or dropped.
    pub blocks: usize,
    /// Engine hashes of a removal that this worker key did not hold (counted, skipped).
    pub unknown: usize,
}

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
#[derive(Debug, Default)]
pub struct KvIndex {
    index: ShardIndex,
    dirs: HashMap<WorkerKey, Directory>,
    rejects: RejectCounts,
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event of `key`. A refused event is counted and changes nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        match event {
            KvEvent::Stored { parent, blocks } => self
                .apply_stored(key, *parent, blocks)
                .map(|blocks| Applied { blocks, unknown: 0 }),
            KvEvent::Removed { blocks } => Ok(self.apply_removed(key, blocks)),
            KvEvent::Cleared => Ok(Applied {
                blocks: self.clear(key),
                unknown: 0,
            }),
        }
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
        let result = self.try_store(key, parent, blocks);
        if let Err(e) = &result {
            self.rejects.add(e.reason(), 1);
        }
        result
    }

    fn try_store(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
    ) -> Result<usize> {
        let mut prev = match parent {
            None => None,
            Some(p) => Some(
                self.dirs
                    .get(&key)
                    .and_then(|d| d.get(p))
                    .map(|(seq, ())| seq)
                    .ok_or(EngineError::UnknownParent {
                        worker: key,
                        parent: p,
                    })?,
            ),
        };
        if blocks.is_empty() {
            return Ok(0);
        }
        let slot = self.index.slots_mut().get_or_insert(key)?;
        let dir = self.dirs.entry(key).or_default();
        for (i, b) in blocks.iter().enumerate() {
            let seq = seq_hash(prev, b.tokens_hash);
            if let Insert::Conflict(_) = dir.insert(b.engine_hash, seq, ()) {
                Self::rollback(&mut self.index, dir, slot, blocks.get(..i).unwrap_or(&[]));
                self.forget_if_empty(key);
                return Err(EngineError::EngineHashConflict {
                    worker: key,
                    block: b.engine_hash,
                });
            }
            self.index.add(slot, seq);
            prev = Some(seq);
        }
        Ok(blocks.len())
    }

    #[cold]
    #[inline(never)]
    fn rollback(index: &mut ShardIndex, dir: &mut Directory, slot: Slot, done: &[StoredBlock]) {
        for b in done {
            if let Some((seq, ())) = dir.remove(b.engine_hash) {
                index.remove(slot, seq);
            }
        }
    }

    /// Drops one copy of each listed block of `key`. Unknown engine hashes are counted
    /// under `unknown_block` and skipped; the known ones are applied.
    pub fn apply_removed(&mut self, key: WorkerKey, blocks: &[EngineHash]) -> Applied {
        let mut applied = Applied::default();
        match (self.dirs.get_mut(&key), self.index.slots().get(key)) {
            (Some(dir), Some(slot)) => {
                for &e in blocks {
                    match dir.remove(e) {
                        Some((seq, ())) => {
                            let dropped = self.index.remove(slot, seq);
                            debug_assert!(dropped.is_some(), "directory and index disagree");
                            applied.blocks += 1;
                        }
                        None => applied.unknown += 1,
                    }
                }
                self.forget_if_empty(key);
            }
            _ => applied.unknown = blocks.len(),
        }
        if applied.unknown > 0 {
            self.rejects
                .add(RejectReason::UnknownBlock, applied.unknown as u64);
        }
        applied
    }

    /// Empties `key`'s cache (one dp rank only); returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> usize {
        let (Some(mut dir), Some(slot)) = (self.dirs.remove(&key), self.index.slots().get(key))
        else {
            return 0;
        };
        let mut dropped = 0;
        for (seq, (), copies) in dir.drain() {
            for _ in 0..copies {
                self.index.remove(slot, seq);
            }
            dropped += copies as usize;
        }
        self.index.slots_mut().release(key);
        self.shrink_dirs();
        dropped
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let keys: Vec<WorkerKey> = self
            .dirs
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        for &k in &keys {
            self.clear(k);
        }
        keys.len()
    }

    fn forget_if_empty(&mut self, key: WorkerKey) {
        if self.dirs.get(&key).is_some_and(Directory::is_empty) {
            self.dirs.remove(&key);
            self.index.slots_mut().release(key);
            self.shrink_dirs();
        }
    }

    fn shrink_dirs(&mut self) {
        if self.dirs.is_empty() {
            self.dirs = HashMap::new();
        }
    }

    /// Overlaps of the request `seqs` (see [`Matches`]).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        self.index.find_matches(seqs)
    }

    /// Distinct blocks `key` holds (the scheduler's tie-breaker).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.index
            .slots()
            .get(key)
            .map_or(0, |s| self.index.slots().blocks(s))
    }

    /// Worker keys holding at least one block.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.dirs.keys().copied()
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        &self.rejects
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> KvStats {
        let index = self.index.stats();
        let directory_entries = self.dirs.values().map(Directory::len).sum();
        let directory_bytes = self.dirs.allocation_size()
            + self.dirs.values().map(Directory::heap_bytes).sum::<usize>();
        KvStats {
            index,
            directory_entries,
            directory_bytes,
            bytes: index.bytes + directory_bytes,
        }
    }
}
