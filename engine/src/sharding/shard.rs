//! One shard: a prefix tree addressed by seq_hash, applying the ingest's operations and
//! answering queries.
//!
//! # Invariants
//! 1. A worker key has a slot in this shard iff it holds at least one block here.
//! 2. An operation that cannot apply (a parent or block this shard does not hold, or a
//!    tree with no room left) changes nothing and is counted in [`Shard::inconsistencies`];
//!    with a correct ingest the count stays 0.
//!
//! # Concurrency
//! Owned by its shard thread; nothing in it is shared.

use super::ShardId;
use super::ops::{BlockOp, OpBatch};
use crate::error::{EngineError, Result};
use crate::ids::{SeqHash, WorkerKey};
use crate::index::{IndexStats, Pos, RebuiltSeqIndex, ShardIndex, holder_key};
use crate::matches::Matches;
use crate::snapshot::image::{ArchivedCoreImage, CoreImage};

/// One shard's part of the index.
#[derive(Debug)]
pub struct Shard {
    id: ShardId,
    index: ShardIndex,
    applied: u64,
    inconsistencies: u64,
    positions: Vec<Pos>,
}

impl Shard {
    /// An empty shard.
    pub fn new(id: ShardId) -> Self {
        Self {
            id,
            index: ShardIndex::new(),
            applied: 0,
            inconsistencies: 0,
            positions: Vec::new(),
        }
    }

    /// This shard's number.
    pub fn id(&self) -> ShardId {
        self.id
    }

    /// Applies one batch.
    pub fn apply(&mut self, batch: &OpBatch) {
        match batch.op {
            BlockOp::Store { parent } => self.store_seqs(batch.key, parent, &batch.seqs),
            BlockOp::Remove => self.remove_seqs(batch.key, &batch.seqs),
        }
    }

    /// One more copy of each block of the chain `seqs` for `key`, continuing the block
    /// `parent` (which this shard holds: the policy places a chain with its parent).
    pub fn store_seqs(&mut self, key: WorkerKey, parent: Option<SeqHash>, seqs: &[SeqHash]) {
        let parent = match parent {
            None => None,
            Some(p) => match self.index.find(p) {
                Some(pos) => Some(pos),
                None => {
                    self.inconsistencies += seqs.len() as u64;
                    return;
                }
            },
        };
        self.positions.clear();
        match self.index.store(key, parent, seqs, &mut self.positions) {
            Ok(()) => self.applied += seqs.len() as u64,
            Err(_) => self.inconsistencies += seqs.len() as u64,
        }
    }

    /// One copy fewer of each block for `key`.
    pub fn remove_seqs(&mut self, key: WorkerKey, seqs: &[SeqHash]) {
        if seqs.is_empty() {
            return;
        }
        self.positions.clear();
        let mut prev: Option<Pos> = None;
        for &s in seqs {
            // A removal lists a stored chain's blocks in order (forwards or backwards), and
            // a chain's blocks sit side by side in a run: try the neighbours of the last
            // block found before the seq_hash table.
            let near = prev.and_then(|p| {
                [p.off().checked_add(1), p.off().checked_sub(1)]
                    .into_iter()
                    .flatten()
                    .filter_map(|o| Pos::new(p.run(), o))
                    .find(|&q| self.index.is_live(q, s))
            });
            match near.or_else(|| self.index.find(s)) {
                Some(p) => {
                    self.positions.push(p);
                    prev = Some(p);
                }
                None => self.inconsistencies += 1,
            }
        }
        let r = self.index.remove(key, &self.positions);
        self.applied += r.removed as u64;
        self.inconsistencies += r.missing as u64;
        if self.index.slots().is_empty() {
            // Back to the empty footprint.
            self.positions = Vec::new();
        }
    }

    /// The block that last gained a child here, with its children count (taken).
    pub fn take_branch(&mut self) -> Option<(SeqHash, u32)> {
        let (pos, fanout) = self.index.take_branch()?;
        Some((self.index.seq(pos)?, fanout))
    }

    /// The prefix tree (for promotion).
    pub(crate) fn index(&self) -> &ShardIndex {
        &self.index
    }

    /// The prefix tree, mutably (for promotion).
    pub(crate) fn index_mut(&mut self) -> &mut ShardIndex {
        &mut self.index
    }

    /// Counts `n` operations that could not apply (invariant 2).
    pub(crate) fn note_inconsistent(&mut self, n: usize) {
        self.inconsistencies += n as u64;
    }

    /// Overlaps of `seqs` (the policy sent this query here, so this shard holds every
    /// block of its path).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        self.index.find_matches(seqs)
    }

    /// Distinct blocks `key` holds in this shard.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.index.cached_blocks(key)
    }

    /// A shard that other threads read while its owner writes (`runtime::hosted`
    /// invariant 3): the seq_hash table's rebuilds are left to the owner, who builds the
    /// table outside its write sections ([`Shard::rebuilt_table_if_due`]) instead of
    /// inside a store or removal, where readers would wait for all of it (tens of ms at a
    /// few million blocks).
    pub fn with_rebuilds_outside(mut self) -> Self {
        self.index.defer_dead_rebuilds();
        self
    }

    /// Before a change of up to `n` blocks: the seq_hash table, rebuilt from `&self`, if
    /// the change would otherwise rebuild it; install it with [`Shard::install_table`]
    /// before any other change.
    pub fn rebuilt_table_if_due(&self, n: usize) -> Option<RebuiltSeqIndex> {
        self.index
            .seq_index_rebuild_due(n)
            .then(|| self.index.rebuilt_seq_index(n))
    }

    /// Installs a table from [`Shard::rebuilt_table_if_due`]; returns the old one (drop it
    /// outside the write section).
    pub fn install_table(&mut self, fresh: RebuiltSeqIndex) -> RebuiltSeqIndex {
        self.index.install_seq_index(fresh)
    }

    /// Block operations applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Operations that could not apply (see invariant 2).
    pub fn inconsistencies(&self) -> u64 {
        self.inconsistencies
    }

    /// Adds this shard's tree to a snapshot image.
    pub fn image_into(&self, image: &mut CoreImage) {
        self.index
            .export(&mut image.nodes, &mut image.seqs, &mut image.holders);
    }

    /// Rebuilds the tree of a snapshot image (into an empty shard).
    pub fn restore_image(&mut self, image: &ArchivedCoreImage) -> Result<()> {
        let bad = |what: &str| EngineError::BadSnapshot(format!("shard {}: {what}", self.id.0));
        let (seqs, holders) = (image.seqs.as_slice(), image.holders.as_slice());
        let (mut s_at, mut h_at) = (0usize, 0usize);
        let mut chain: Vec<SeqHash> = Vec::new();
        for n in image.nodes.iter() {
            let len = n.len.to_native() as usize;
            let count = n.holders.to_native() as usize;
            let blocks = seqs
                .get(s_at..s_at.saturating_add(len))
                .ok_or_else(|| bad("node blocks missing"))?;
            let hs = holders
                .get(h_at..h_at.saturating_add(count))
                .ok_or_else(|| bad("holders missing"))?;
            s_at += len;
            h_at += count;
            chain.clear();
            chain.extend(blocks.iter().map(|s| SeqHash(s.to_native())));
            let parent = (!n.root).then(|| SeqHash(n.parent.to_native()));
            self.index
                .import_node(
                    parent,
                    &chain,
                    hs.iter().map(holder_key),
                    &mut self.positions,
                )
                .map_err(|e| bad(&format!("a node does not fit: {e}")))?;
        }
        if s_at != seqs.len() || h_at != holders.len() {
            return Err(bad("data left over"));
        }
        self.positions.clear();
        Ok(())
    }

    /// Checks the tree's structural invariants (O(size): for tests and debugging).
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.index.validate()
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> IndexStats {
        let mut s = self.index.stats();
        s.bytes += self.positions.capacity() * size_of::<Pos>();
        s
    }
}
