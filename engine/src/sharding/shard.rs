//! One shard: a [`ShardIndex`] that applies block operations and answers queries.
//!
//! # Invariants
//! 1. A worker key has a slot in this shard iff it holds at least one entry here.
//! 2. An operation that cannot apply (a removal of something this shard does not hold, or
//!    a worker key beyond the slot space) changes nothing and is counted in
//!    [`Shard::inconsistencies`]; with a correct ingest the count stays 0.
//!
//! # Concurrency
//! Owned by its shard thread (or by the single-shard `KvIndex`); nothing in it is shared.
//!
//! [`ShardIndex`]: crate::index::ShardIndex

use super::ShardId;
use super::ingest::{BlockOp, OpBatch};
use crate::directories::BlockSink;
use crate::ids::{SeqHash, WorkerKey};
use crate::index::{IndexStats, ShardIndex};
use crate::matches::Matches;

/// One shard's part of the index.
#[derive(Debug)]
pub struct Shard {
    id: ShardId,
    index: ShardIndex,
    applied: u64,
    inconsistencies: u64,
}

impl Shard {
    /// An empty shard.
    pub fn new(id: ShardId) -> Self {
        Self {
            id,
            index: ShardIndex::new(),
            applied: 0,
            inconsistencies: 0,
        }
    }

    /// This shard's number.
    pub fn id(&self) -> ShardId {
        self.id
    }

    /// Applies one batch.
    pub fn apply(&mut self, batch: &OpBatch) {
        match batch.op {
            BlockOp::Add => self.add_seqs(batch.key, batch.seqs.iter().copied()),
            BlockOp::Remove => self.remove_seqs(batch.key, batch.seqs.iter().copied()),
        }
    }

    /// One more copy of each block for `key` (nothing, not even a slot, if `seqs` is
    /// empty).
    pub fn add_seqs(&mut self, key: WorkerKey, seqs: impl Iterator<Item = SeqHash>) {
        let mut seqs = seqs.peekable();
        if seqs.peek().is_none() {
            return;
        }
        let Ok(slot) = self.index.slots_mut().get_or_insert(key) else {
            self.inconsistencies += seqs.count() as u64;
            return;
        };
        for s in seqs {
            self.index.add(slot, s);
            self.applied += 1;
        }
    }

    /// One copy fewer of each block for `key`.
    pub fn remove_seqs(&mut self, key: WorkerKey, seqs: impl Iterator<Item = SeqHash>) {
        let mut seqs = seqs.peekable();
        if seqs.peek().is_none() {
            return;
        }
        let Some(slot) = self.index.slots().get(key) else {
            self.inconsistencies += seqs.count() as u64;
            return;
        };
        for s in seqs {
            match self.index.remove(slot, s) {
                Some(_) => self.applied += 1,
                None => self.inconsistencies += 1,
            }
        }
        if self.index.slots().blocks(slot) == 0 {
            self.index.slots_mut().release(key);
        }
    }

    /// Overlaps of `seqs` (the policy sent this query here, so this shard holds every
    /// block of its path).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        self.index.find_matches(seqs)
    }

    /// Distinct blocks `key` holds in this shard.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        let slots = self.index.slots();
        slots.get(key).map_or(0, |s| slots.blocks(s))
    }

    /// Block operations applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Operations that could not apply (see invariant 2).
    pub fn inconsistencies(&self) -> u64 {
        self.inconsistencies
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> IndexStats {
        self.index.stats()
    }
}

/// The single-shard index applies accepted events straight to its shard.
impl<R: Copy> BlockSink<R> for Shard {
    #[inline]
    fn add(&mut self, key: WorkerKey, blocks: &[(SeqHash, R)]) {
        self.add_seqs(key, blocks.iter().map(|b| b.0));
    }

    #[inline]
    fn remove(&mut self, key: WorkerKey, blocks: &[(SeqHash, R)]) {
        self.remove_seqs(key, blocks.iter().map(|b| b.0));
    }
}
