//! One shard's worth of the prefix index: `seq_hash -> holders`.
//!
//! A seq_hash names a whole prefix, so the index needs no tree: a flat hash table from
//! seq_hash to the worker keys holding that block answers every question. A query hashes
//! its request once and probes the table once per block; the probes of a run of blocks are
//! independent, so the CPU overlaps their cache misses instead of chasing child pointers.
//!
//! # Invariants
//! 1. The table holds a seq_hash iff at least one worker key holds at least one copy of it:
//!    a block nobody holds is removed at once, so memory returns to the empty footprint
//!    when every worker removes everything.
//! 2. Per `(seq_hash, slot)` the index keeps the copy count of DESIGN.md's multiset model
//!    (inline for the usual single holder with one copy; see `holders.rs`).
//! 3. `entries` = number of `(seq_hash, slot)` pairs with a positive count
//!    = sum of [`WorkerSlots::blocks`].
//!
//! # Concurrency
//! Owned by one thread (its shard); `&mut self` for every change, queries take `&self`.
//!
//! # Memory
//! A table entry is 12 bytes (seq_hash + a 32-bit holder value) plus hashbrown's control
//! byte; see `stats()` and docs/benchmarks.md for measured bytes per (block, worker) entry.

mod holders;
mod slots;
mod walk;

pub use slots::{Slot, WorkerSlots};

use crate::ids::SeqHash;
use hashbrown::HashTable;
use holders::{HolderSet, Holders, SetSlab};

/// A table entry: 12 bytes, 4-byte aligned (a `u64` field would pad it to 16).
#[derive(Clone, Copy, Debug)]
struct Entry {
    seq: [u32; 2],
    holders: u32,
}

impl Entry {
    #[inline]
    fn seq(&self) -> u64 {
        u64::from(self.seq[0]) | (u64::from(self.seq[1]) << 32)
    }

    #[inline]
    fn new(seq: u64, holders: Holders) -> Self {
        Self {
            seq: [seq as u32, (seq >> 32) as u32],
            holders: holders.raw(),
        }
    }
}

/// seq_hashes are XXH3 outputs, already uniform: the table uses them as their own hash.
#[inline]
fn table_hash(seq: u64) -> u64 {
    seq
}

/// Sizes of one index, for tests, metrics and the memory benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct seq_hashes held by anyone.
    pub blocks: usize,
    /// `(seq_hash, worker key)` pairs held.
    pub entries: u64,
    /// Blocks with more than one holder (or copy).
    pub shared_blocks: usize,
    /// Worker keys holding anything.
    pub worker_keys: usize,
    /// Heap bytes owned by the index.
    pub bytes: usize,
}

/// The prefix index of one shard.
#[derive(Debug, Default)]
pub struct ShardIndex {
    table: HashTable<Entry>,
    sets: SetSlab,
    slots: WorkerSlots,
    entries: u64,
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

    /// The slot table, mutably (to mint and release slots).
    pub fn slots_mut(&mut self) -> &mut WorkerSlots {
        &mut self.slots
    }

    /// Adds one copy of `seq` for `slot`; returns true if `slot` did not hold it before.
    pub fn add(&mut self, slot: Slot, seq: SeqHash) -> bool {
        let h = table_hash(seq.0);
        let entry = self
            .table
            .entry(h, |e| e.seq() == seq.0, |e| table_hash(e.seq()));
        let newly = match entry {
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(Entry::new(seq.0, Holders::Single(slot)));
                true
            }
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                let e = o.get_mut();
                match Holders::from_raw(e.holders) {
                    Holders::Single(other) => {
                        let mut set = HolderSet::default();
                        set.add(other);
                        let newly = set.add(slot);
                        e.holders = Holders::Set(self.sets.insert(set)).raw();
                        newly
                    }
                    Holders::Set(i) => self.sets.get_mut(i).is_some_and(|s| s.add(slot)),
                }
            }
        };
        if newly {
            self.entries += 1;
            self.slots.bump_blocks(slot, true);
        }
        newly
    }

    /// Drops one copy of `seq` for `slot`.
    ///
    /// Returns `Some(true)` if `slot` no longer holds it, `Some(false)` if copies remain,
    /// `None` if `slot` held none (nothing changes).
    pub fn remove(&mut self, slot: Slot, seq: SeqHash) -> Option<bool> {
        let h = table_hash(seq.0);
        let mut occ = self.table.find_entry(h, |e| e.seq() == seq.0).ok()?;
        let e = occ.get_mut();
        let released = match Holders::from_raw(e.holders) {
            Holders::Single(s) if s == slot => {
                occ.remove();
                true
            }
            Holders::Single(_) => return None,
            Holders::Set(i) => {
                let set = self.sets.get_mut(i)?;
                let released = set.remove(slot)?;
                if set.len == 0 {
                    occ.remove();
                    self.sets.remove(i);
                } else if let Some(sole) = set.sole_single() {
                    e.holders = Holders::Single(sole).raw();
                    self.sets.remove(i);
                }
                released
            }
        };
        if released {
            self.entries -= 1;
            self.slots.bump_blocks(slot, false);
            self.maybe_shrink();
        }
        Some(released)
    }

    /// Gives memory back once the table is mostly empty (amortised: it must shrink 8x
    /// between two rehashes).
    fn maybe_shrink(&mut self) {
        let (len, cap) = (self.table.len(), self.table.capacity());
        if len == 0 {
            self.table = HashTable::new();
        } else if cap >= 1024 && len * 8 < cap {
            self.table.shrink_to(len * 2, |e| table_hash(e.seq()));
        }
    }

    /// Does `slot` hold `seq`?
    pub fn holds(&self, slot: Slot, seq: SeqHash) -> bool {
        match self.lookup(seq) {
            Some(Holders::Single(s)) => s == slot,
            Some(Holders::Set(i)) => self.sets.get(i).is_some_and(|s| s.contains(slot)),
            None => false,
        }
    }

    #[inline]
    fn lookup(&self, seq: SeqHash) -> Option<Holders> {
        self.table
            .find(table_hash(seq.0), |e| e.seq() == seq.0)
            .map(|e| Holders::from_raw(e.holders))
    }

    /// Sizes and heap bytes.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.table.len(),
            entries: self.entries,
            shared_blocks: self.sets.len(),
            worker_keys: self.slots.len(),
            bytes: self.table.allocation_size() + self.sets.heap_bytes() + self.slots.heap_bytes(),
        }
    }
}
