//! Dense per-index slot numbers for worker keys.
//!
//! Holder sets are bitsets over slots, so slots are small and dense: a released slot is
//! reused before a new one is minted.
//!
//! # Invariants
//! 1. `keys[s]` is `Some(k)` iff slot `s` is live and `by_key[k] == s`.
//! 2. A slot is released only when its worker key holds no entry in the index, so no holder
//!    set ever names a released slot.
//! 3. `blocks[s]` is the number of distinct seq hashes slot `s` holds (count > 0).
//! 4. `by_rank` lists the live slots in the order of their worker keys (answers list keys in
//!    that order without sorting); it is rebuilt when a slot is minted or released, which
//!    happens when a worker key first stores or last drops a block, not per event.

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use hashbrown::HashMap;

/// A worker key's dense number inside one index. Values stay below [`Slot::MAX`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(pub u32);

impl Slot {
    /// Slots are 31-bit: the top bit of a table value tags holder sets.
    pub const MAX: u32 = (1 << 31) - 1;

    /// The slot as an index into per-slot vectors.
    #[inline]
    pub fn idx(self) -> usize {
        self.0 as usize
    }
}

/// The slot table of one index.
#[derive(Debug, Default)]
pub struct WorkerSlots {
    by_key: HashMap<WorkerKey, Slot>,
    keys: Vec<Option<WorkerKey>>,
    blocks: Vec<u64>,
    free: Vec<Slot>,
    by_rank: Vec<Slot>,
    rank: Vec<u32>,
}

impl WorkerSlots {
    /// The slot of `key`, if it has one.
    #[inline]
    pub fn get(&self, key: WorkerKey) -> Option<Slot> {
        self.by_key.get(&key).copied()
    }

    /// The slot of `key`, minting one if needed.
    pub fn get_or_insert(&mut self, key: WorkerKey) -> Result<Slot> {
        if let Some(&s) = self.by_key.get(&key) {
            return Ok(s);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let n = self.keys.len();
                if n > Slot::MAX as usize {
                    return Err(EngineError::TooManyWorkers);
                }
                self.keys.push(None);
                self.blocks.push(0);
                Slot(n as u32)
            }
        };
        if let Some(k) = self.keys.get_mut(slot.idx()) {
            *k = Some(key);
        }
        self.by_key.insert(key, slot);
        self.rerank();
        Ok(slot)
    }

    fn rerank(&mut self) {
        self.by_rank.clear();
        self.by_rank.extend(self.by_key.values().copied());
        let keys = &self.keys;
        self.by_rank
            .sort_unstable_by_key(|s| keys.get(s.idx()).copied().flatten());
        self.rank.clear();
        self.rank.resize(self.keys.len(), u32::MAX);
        for (r, s) in self.by_rank.iter().enumerate() {
            if let Some(x) = self.rank.get_mut(s.idx()) {
                *x = r as u32;
            }
        }
    }

    /// `slot`'s position in [`WorkerSlots::by_rank`].
    #[inline]
    pub fn rank(&self, slot: Slot) -> u32 {
        self.rank.get(slot.idx()).copied().unwrap_or(u32::MAX)
    }

    /// Live slots in worker-key order (invariant 4).
    #[inline]
    pub fn by_rank(&self) -> &[Slot] {
        &self.by_rank
    }

    /// Forgets `key` and frees its slot for reuse.
    ///
    /// Caller guarantees the slot holds no entry (invariant 2).
    pub fn release(&mut self, key: WorkerKey) {
        let Some(slot) = self.by_key.remove(&key) else {
            return;
        };
        if let Some(k) = self.keys.get_mut(slot.idx()) {
            *k = None;
        }
        if self.by_key.is_empty() {
            // Back to the empty footprint: nothing refers to any slot any more.
            *self = Self::default();
        } else {
            self.free.push(slot);
            self.rerank();
        }
    }

    /// The worker key living in `slot`.
    #[inline]
    pub fn key(&self, slot: Slot) -> Option<WorkerKey> {
        self.keys.get(slot.idx()).copied().flatten()
    }

    /// How many slots exist (live or free): bitsets are at most this wide.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.keys.len()
    }

    /// Live worker keys.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// No live worker key.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Distinct blocks held by `slot`.
    #[inline]
    pub fn blocks(&self, slot: Slot) -> u64 {
        self.blocks.get(slot.idx()).copied().unwrap_or(0)
    }

    /// `slot` now holds `n` more distinct blocks.
    #[inline]
    pub fn gained(&mut self, slot: Slot, n: u64) {
        if let Some(b) = self.blocks.get_mut(slot.idx()) {
            *b += n;
        }
    }

    /// `slot` now holds `n` fewer distinct blocks.
    #[inline]
    pub fn lost(&mut self, slot: Slot, n: u64) {
        if let Some(b) = self.blocks.get_mut(slot.idx()) {
            *b = b.saturating_sub(n);
        }
    }

    /// Live `(key, slot)` pairs.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, Slot)> + '_ {
        self.by_key.iter().map(|(&k, &s)| (k, s))
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.by_key.allocation_size()
            + self.keys.capacity() * size_of::<Option<WorkerKey>>()
            + self.blocks.capacity() * size_of::<u64>()
            + self.free.capacity() * size_of::<Slot>()
            + self.by_rank.capacity() * size_of::<Slot>()
            + self.rank.capacity() * size_of::<u32>()
    }
}
