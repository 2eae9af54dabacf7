//! A keyless `seq_hash -> Pos` table: finds any live block by its seq_hash.
//!
//! The sharded engine's directories live with the ingest, on another core than the tree,
//! so its operations name blocks by seq_hash; and a query block that does not continue the
//! walk is looked up wherever it hangs (see `walk`). The table stores only the 4-byte
//! position; the key is read from the run the position points to (the block's own
//! storage), so it costs 5 bytes a bucket (value + control byte) instead of 13.
//!
//! # Invariants
//! 1. The table holds the position of every live block of the tree, once.
//! 2. A lookup compares the stored block's seq_hash, so it never returns a block with a
//!    different seq_hash. (Two live blocks with one seq_hash, which needs an XXH3 collision,
//!    would make lookups return one of them: the engine then counts an inconsistency rather
//!    than corrupt anything.)
//! 3. The table never rehashes by itself: every insert is preceded by [`SeqIndex::reserve`],
//!    and growing or shrinking is a rebuild by the tree, which re-inserts its blocks in run
//!    order. hashbrown's own rehash would re-read every key through its position, one random
//!    memory access per block per doubling: measured, that tripled the cost of a store.

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
    /// The position of `seq`.
    #[inline]
    pub fn find(&self, seq: SeqHash, runs: &Runs) -> Option<Pos> {
        self.table
            .find(hash(seq), |&p| runs.seq(Pos::from_raw(p)) == Some(seq))
            .map(|&p| Pos::from_raw(p))
    }

    /// Can `n` more blocks be recorded without the table growing?
    #[inline]
    pub fn has_room(&self, n: usize) -> bool {
        self.table.capacity() - self.table.len() >= n
    }

    /// Should the table be rebuilt smaller (it is mostly empty)?
    #[inline]
    pub fn too_big(&self) -> bool {
        // Not `capacity()`: erased slots may become tombstones, which hashbrown subtracts
        // from the capacity, so an emptied table can report none. A bucket is 5 bytes.
        let (len, buckets) = (self.table.len(), self.table.allocation_size() / 5);
        (len == 0 && buckets > 0) || (buckets >= 1024 && len * 8 < buckets)
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

    /// Forgets blocks `start..start + len` of run `run` (still stored in `runs`).
    pub fn forget_range(&mut self, runs: &Runs, run: RunId, start: usize, len: usize) {
        let seqs = runs.slice(run, start, len);
        for (off, &seq) in (start..).zip(seqs) {
            let Some(pos) = Pos::new(run, off) else {
                continue;
            };
            if let Ok(e) = self.table.find_entry(hash(seq), |&p| p == pos.raw()) {
                e.remove();
            }
        }
    }

    /// Blocks recorded.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}
