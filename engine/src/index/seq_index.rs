//! A keyless `seq_hash -> Pos` table: finds any live block by its seq_hash.
//!
//! The sharded engine's directories live with the ingest, on another core than the tree,
//! so its operations name blocks by seq_hash; and a query block that does not continue the
//! walk is looked up wherever it hangs (see `walk`). The table stores only the 4-byte
//! position; the key is read from the run the position points to (the block's own
//! storage), so it costs 5 bytes a bucket (value + control byte) instead of 13.
//!
//! # Invariants
//! 1. The table holds the position of every live block of the tree, and may still hold
//!    positions of blocks that died since the last rebuild: deletion is lazy, because
//!    erasing an entry is a random memory access per removed block, while the tree's
//!    rebuild (invariant 3) re-inserts only live blocks, in run order.
//! 2. A lookup accepts an entry only if the block at its position is live and has the
//!    seq_hash asked for (the caller's check), so stale entries are never returned. (Two
//!    live blocks with one seq_hash, which needs an XXH3 collision, would make lookups
//!    return one of them: the engine then counts an inconsistency rather than corrupt
//!    anything.)
//! 3. The table never rehashes by itself: every insert is preceded by a room check
//!    ([`SeqIndex::has_room`]), and growing or shrinking is a rebuild by the tree, which
//!    re-inserts its live blocks in run order. hashbrown's own rehash would re-read every
//!    key through its position, one random memory access per block per doubling: measured,
//!    that tripled the cost of a store.

use super::pos::{Pos, RunId};
use super::runs::Runs;
use crate::ids::SeqHash;
use hashbrown::HashTable;

/// seq_hashes are XXH3 outputs, already uniform: they are their own hash.
#[inline]
fn hash(seq: SeqHash) -> u64 {
    seq.0
}

/// Positions of live blocks, found by their seq_hash.
#[derive(Debug, Default)]
pub struct SeqIndex {
    table: HashTable<u32>,
}

impl SeqIndex {
    /// The position of `seq`: the first entry for it that `accept` (the block at the
    /// position is live and has this seq_hash) takes.
    #[inline]
    pub fn find(&self, seq: SeqHash, accept: impl Fn(Pos) -> bool) -> Option<Pos> {
        self.table
            .find(hash(seq), |&p| accept(Pos::from_raw(p)))
            .map(|&p| Pos::from_raw(p))
    }

    /// Can `n` more blocks be recorded without the table growing?
    #[inline]
    pub fn has_room(&self, n: usize) -> bool {
        self.table.capacity() - self.table.len() >= n
    }

    /// An empty table with room for `n` blocks, to be filled with [`SeqIndex::record_range`].
    pub fn with_room(n: usize) -> Self {
        Self {
            table: if n == 0 {
                HashTable::new()
            } else {
                HashTable::with_capacity(n)
            },
        }
    }

    /// Records blocks `start..start + len` of run `run` (already stored in `runs`); the
    /// caller made room ([`SeqIndex::has_room`], invariant 3).
    pub fn record_range(&mut self, runs: &Runs, run: RunId, start: usize, len: usize) {
        let seqs = runs.slice(run, start, len);
        for (off, &seq) in (start..).zip(seqs) {
            let Some(pos) = Pos::new(run, off) else {
                continue;
            };
            // The hasher only runs on growth, which invariant 3 rules out.
            self.table.insert_unique(hash(seq), pos.raw(), |&p| {
                runs.seq(Pos::from_raw(p)).map_or(0, hash)
            });
        }
    }

    /// Entries (live blocks, and dead ones since the last rebuild).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}
