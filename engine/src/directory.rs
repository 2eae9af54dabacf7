//! One worker key's directory: `engine hash -> (seq_hash, route)`, with copy counts.
//!
//! Engine hashes are the worker's own ids, meaningless to anyone else; the directory turns
//! them into seq_hashes so that a store can find its parent's prefix and a removal can find
//! the block it drops. They are never recomputed. The sharded engine also keeps each
//! block's route (which shards hold it) here, so a removal goes straight to its shards;
//! the single-shard index uses the zero-sized route `()`.
//!
//! # Invariants
//! 1. An engine hash is present iff the worker key holds at least one copy of it; its count
//!    is the number of stores minus the number of removals of it.
//! 2. An engine hash maps to exactly one seq_hash (and route) for as long as it is present;
//!    a store that would re-map it is a conflict and is refused.
//!
//! # Concurrency
//! Single writer: the thread that decodes this worker's events owns its directory.
//!
//! # Memory
//! 16 bytes per entry (engine hash, seq_hash) plus the route (4 more bytes in the sharded
//! engine; entries are 4-byte aligned), plus hashbrown's control byte. Copy counts above
//! one are rare (the same block stored twice without a removal between), so they live in a
//! small side map instead of widening every entry. The table is dropped when empty and
//! shrunk when it falls to an eighth of its capacity.

use crate::ids::{EngineHash, SeqHash};
use hashbrown::{HashMap, HashTable};
use std::fmt::Debug;

/// What a directory may store per block besides its seq_hash.
pub trait RouteValue: Copy + Debug + Default {}
impl<T: Copy + Debug + Default> RouteValue for T {}

/// Packed to 4-byte alignment: `(u64, u64, u32)` would otherwise pad to 24 bytes.
/// Fields are only ever read by value (never borrowed), as packed fields require.
#[repr(C, packed(4))]
#[derive(Clone, Copy)]
struct DirEntry<R> {
    engine: u64,
    seq: u64,
    route: R,
}

impl<R: RouteValue> DirEntry<R> {
    #[inline]
    fn engine(&self) -> u64 {
        self.engine
    }

    #[inline]
    fn seq(&self) -> SeqHash {
        SeqHash(self.seq)
    }

    #[inline]
    fn route(&self) -> R {
        self.route
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
pub enum Insert {
    /// First copy of this engine hash.
    New,
    /// Another copy of an engine hash already mapped to the same seq_hash.
    Again,
    /// The engine hash is mapped to another seq_hash; nothing changed.
    Conflict(SeqHash),
}

/// One worker key's engine-hash directory.
pub struct Directory<R = ()> {
    table: HashTable<DirEntry<R>>,
    /// `count - 1` for engine hashes held more than once.
    extra: HashMap<EngineHash, u32>,
}

impl<R> Default for Directory<R> {
    fn default() -> Self {
        Self {
            table: HashTable::new(),
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

impl<R: RouteValue> Directory<R> {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq_hash and route `engine` stands for, if present.
    #[inline]
    pub fn get(&self, engine: EngineHash) -> Option<(SeqHash, R)> {
        self.table
            .find(dir_hash(engine.0), |e| e.engine() == engine.0)
            .map(|e| (e.seq(), e.route()))
    }

    /// Records one more copy of `engine` as `seq` (placed at `route`).
    #[inline]
    pub fn insert(&mut self, engine: EngineHash, seq: SeqHash, route: R) -> Insert {
        let entry = self.table.entry(
            dir_hash(engine.0),
            |e| e.engine() == engine.0,
            |e| dir_hash(e.engine()),
        );
        match entry {
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(DirEntry {
                    engine: engine.0,
                    seq: seq.0,
                    route,
                });
                Insert::New
            }
            hashbrown::hash_table::Entry::Occupied(o) => {
                let have = o.get().seq();
                if have != seq {
                    return Insert::Conflict(have);
                }
                let extra = self.extra.entry(engine).or_insert(0);
                *extra = extra.saturating_add(1);
                Insert::Again
            }
        }
    }

    /// Drops one copy of `engine`; returns what it stood for, or `None` if absent.
    #[inline]
    pub fn remove(&mut self, engine: EngineHash) -> Option<(SeqHash, R)> {
        let occ = self
            .table
            .find_entry(dir_hash(engine.0), |e| e.engine() == engine.0)
            .ok()?;
        let found = (occ.get().seq(), occ.get().route());
        if let Some(extra) = self.extra.get_mut(&engine) {
            *extra -= 1;
            if *extra == 0 {
                self.extra.remove(&engine);
                if self.extra.is_empty() {
                    self.extra = HashMap::new();
                }
            }
            return Some(found);
        }
        occ.remove();
        self.maybe_shrink();
        Some(found)
    }

    fn maybe_shrink(&mut self) {
        let (len, cap) = (self.table.len(), self.table.capacity());
        if len == 0 {
            self.table = HashTable::new();
        } else if cap >= 1024 && len * 8 < cap {
            self.table.shrink_to(len * 2, |e| dir_hash(e.engine()));
        }
    }

    /// Takes every `(seq_hash, route, copies)` out, leaving the directory empty.
    pub fn drain(&mut self) -> impl Iterator<Item = (SeqHash, R, u32)> {
        let extra = std::mem::take(&mut self.extra);
        std::mem::take(&mut self.table).into_iter().map(move |e| {
            let more = extra.get(&EngineHash(e.engine())).copied().unwrap_or(0);
            (e.seq(), e.route(), more.saturating_add(1))
        })
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
        let (e, s) = (EngineHash(7), SeqHash(70));
        assert_eq!(d.insert(e, s, 3), Insert::New);
        assert_eq!(d.insert(e, s, 3), Insert::Again);
        assert_eq!(d.insert(e, SeqHash(71), 3), Insert::Conflict(s));
        assert_eq!(d.remove(e), Some((s, 3)));
        assert_eq!(d.get(e), Some((s, 3)));
        assert_eq!(d.remove(e), Some((s, 3)));
        assert_eq!(d.get(e), None);
        assert_eq!(d.remove(e), None);
        assert_eq!(d.heap_bytes(), Directory::<u32>::new().heap_bytes());
    }

    #[test]
    fn entries_stay_compact() {
        assert_eq!(size_of::<DirEntry<()>>(), 16);
        assert_eq!(size_of::<DirEntry<u32>>(), 20);
    }
}
