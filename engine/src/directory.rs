//! One worker key's directory: `engine hash -> block reference`, with copy counts.
//!
//! Engine hashes are the worker's own ids, meaningless to anyone else; the directory turns
//! them into a reference to the block they name, so that a store can find its parent and a
//! removal the block it drops. They are never recomputed. What a reference is belongs to the
//! index behind the directory: the single-shard index records the block's tree position
//! (`index::Pos`, 4 bytes), the sharded engine the block's seq_hash and route (12 bytes).
//!
//! # Invariants
//! 1. An engine hash is present iff the worker key holds at least one copy of it; its count
//!    is the number of stores minus the number of removals of it.
//! 2. An engine hash names exactly one block for as long as it is present; a store that
//!    would re-map it is a conflict and is refused.
//!
//! # Concurrency
//! Single writer: the thread that decodes this worker's events owns its directory.
//!
//! # Memory
//! 8 bytes of engine hash plus the reference per entry (entries are 4-byte aligned: 12 bytes
//! with a position), plus hashbrown's control byte. Copy counts above one are rare (the same
//! block stored twice without a removal between), so they live in a small side map instead
//! of widening every entry. The entries live in a [`PagedTable`]: it grows a page of at most
//! 112 entries at a time, so no store waits for the whole directory to rehash (a core
//! answers queries between events, and a 7,168-entry rehash was ~280 µs of stall). The
//! table is dropped when empty, and so is each page's allocation; a page that still holds
//! entries keeps its buckets (at most 128), so a directory that drains only in part keeps
//! up to a page's buckets per 56 entries it once held.

use crate::ids::EngineHash;
use crate::paged::PagedTable;
use hashbrown::HashMap;
use std::fmt::Debug;

/// What a directory may record per block.
pub trait BlockRef: Copy + Debug {}
impl<T: Copy + Debug> BlockRef for T {}

/// Packed to 4-byte alignment: `(u64, u32)` would otherwise pad to 16 bytes.
/// Fields are only ever read by value (never borrowed), as packed fields require.
#[repr(C, packed(4))]
#[derive(Clone, Copy)]
struct DirEntry<R> {
    engine: u64,
    block: R,
}

impl<R: BlockRef> DirEntry<R> {
    #[inline]
    fn engine(&self) -> u64 {
        self.engine
    }

    #[inline]
    fn block(&self) -> R {
        self.block
    }
}

/// Engine hashes are not ours to trust: a worker could send clustered values, so they are
/// mixed before they index the table (a multiply-xorshift finaliser, cheap and bijective).
#[inline]
fn dir_hash(engine: u64) -> u64 {
    let x = engine.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// What a store of one engine hash did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert<R> {
    /// First copy of this engine hash.
    New,
    /// Another copy of an engine hash already naming the same block.
    Again,
    /// The engine hash names another block (given); nothing changed.
    Conflict(R),
}

/// One worker key's engine-hash directory.
pub struct Directory<R = ()> {
    table: PagedTable<DirEntry<R>>,
    /// `count - 1` for engine hashes held more than once.
    extra: HashMap<EngineHash, u32>,
}

impl<R> Default for Directory<R> {
    fn default() -> Self {
        Self {
            table: PagedTable::new(),
            extra: HashMap::new(),
        }
    }
}

impl<R> Debug for Directory<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("len", &self.table.len())
            .field("extra", &self.extra.len())
            .finish()
    }
}

impl<R: BlockRef> Directory<R> {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// The block `engine` stands for, if present.
    #[inline]
    pub fn get(&self, engine: EngineHash) -> Option<R> {
        self.table
            .find(dir_hash(engine.0), |e| e.engine() == engine.0)
            .map(DirEntry::block)
    }

    /// Reads the entries of `engines` (present or not) and discards what it finds, so that
    /// the lookups that follow hit the cache. Each lookup's cache misses (the page, its
    /// control bytes, the entry) depend on each other, but the lookups of a batch do not, so
    /// the CPU overlaps them here where a loop of removals, each finished before the next
    /// starts, waited for them one by one (issue 32: two thirds of `remove`'s time was those
    /// two loads).
    #[inline]
    pub fn touch(&self, engines: &[EngineHash]) {
        for &engine in engines {
            std::hint::black_box(
                self.table
                    .find(dir_hash(engine.0), |e| e.engine() == engine.0)
                    .is_some(),
            );
        }
    }

    /// Records one more copy of `engine` as `block`; `same(existing)` tells whether an
    /// existing entry names the same block.
    #[inline]
    pub fn insert(&mut self, engine: EngineHash, block: R, same: impl Fn(R) -> bool) -> Insert<R> {
        let hash = dir_hash(engine.0);
        let (inserted, have) = self.table.find_or_insert(
            hash,
            |e| e.engine() == engine.0,
            || DirEntry {
                engine: engine.0,
                block,
            },
            |e| dir_hash(e.engine()),
        );
        if inserted {
            return Insert::New;
        }
        let Some(have) = have.map(|e| e.block()) else {
            // Not reached (the table always has a page once asked); never drop the entry.
            self.table.insert_unique(
                hash,
                DirEntry {
                    engine: engine.0,
                    block,
                },
                |e| dir_hash(e.engine()),
            );
            return Insert::New;
        };
        if !same(have) {
            return Insert::Conflict(have);
        }
        let extra = self.extra.entry(engine).or_insert(0);
        *extra = extra.saturating_add(1);
        Insert::Again
    }

    /// Drops one copy of `engine`; returns what it stood for, or `None` if absent.
    #[inline]
    pub fn remove(&mut self, engine: EngineHash) -> Option<R> {
        let hash = dir_hash(engine.0);
        if let Some(extra) = self.extra.get_mut(&engine) {
            let found = self
                .table
                .find(hash, |e| e.engine() == engine.0)
                .map(DirEntry::block)?;
            *extra -= 1;
            if *extra == 0 {
                self.extra.remove(&engine);
                if self.extra.is_empty() {
                    self.extra = HashMap::new();
                }
            }
            return Some(found);
        }
        self.table
            .remove(hash, |e| e.engine() == engine.0)
            .map(|e| e.block())
    }

    /// Takes every `(block, copies)` out, leaving the directory empty.
    pub fn drain(&mut self) -> impl Iterator<Item = (R, u32)> {
        let extra = std::mem::take(&mut self.extra);
        std::mem::take(&mut self.table)
            .into_entries()
            .map(move |e| {
                let more = extra.get(&EngineHash(e.engine())).copied().unwrap_or(0);
                (e.block(), more.saturating_add(1))
            })
    }

    /// Every `(engine hash, block, copies)` (for a snapshot).
    pub fn iter(&self) -> impl Iterator<Item = (EngineHash, R, u32)> + '_ {
        self.table.iter().map(|e| {
            let engine = EngineHash(e.engine());
            let more = self.extra.get(&engine).copied().unwrap_or(0);
            (engine, e.block(), more.saturating_add(1))
        })
    }

    /// Records `engine` as `block` with `copies` copies (a snapshot's entry; `copies` 0 is
    /// ignored). A present engine hash is overwritten: a snapshot names each once.
    pub fn restore(&mut self, engine: EngineHash, block: R, copies: u32) {
        if copies == 0 {
            return;
        }
        let hash = dir_hash(engine.0);
        let entry = DirEntry {
            engine: engine.0,
            block,
        };
        match self.table.find_mut(hash, |e| e.engine() == engine.0) {
            Some(have) => *have = entry,
            None => self
                .table
                .insert_unique(hash, entry, |e| dir_hash(e.engine())),
        }
        if copies > 1 {
            self.extra.insert(engine, copies - 1);
        } else {
            self.extra.remove(&engine);
        }
    }

    /// Room for `n` more engine hashes without growing.
    pub fn reserve(&mut self, n: usize) {
        self.table.reserve(n, |e| dir_hash(e.engine()));
    }

    /// Distinct engine hashes held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size() + self.extra.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_copies_and_refuses_remaps() {
        let mut d = Directory::<u32>::new();
        let e = EngineHash(7);
        assert_eq!(d.insert(e, 70, |h| h == 70), Insert::New);
        assert_eq!(d.insert(e, 70, |h| h == 70), Insert::Again);
        assert_eq!(d.insert(e, 71, |h| h == 71), Insert::Conflict(70));
        assert_eq!(d.remove(e), Some(70));
        assert_eq!(d.get(e), Some(70));
        assert_eq!(d.remove(e), Some(70));
        assert_eq!(d.get(e), None);
        assert_eq!(d.remove(e), None);
        assert_eq!(d.heap_bytes(), Directory::<u32>::new().heap_bytes());
    }

    #[test]
    fn entries_stay_compact() {
        assert_eq!(size_of::<DirEntry<u32>>(), 12);
        assert_eq!(size_of::<DirEntry<[u32; 3]>>(), 20);
    }
}
