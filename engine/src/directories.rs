//! Every worker key's directory, and DESIGN.md's event semantics on top of them.
//!
//! This is the one implementation of what a KV event means: a store resolves its parent
//! through the worker key's directory, chains seq_hashes and records each block; a removal
//! drops one copy per engine hash; a clear empties the worker key; removing a worker clears
//! all its dp ranks. Where the blocks go is the caller's [`BlockStore`]: the single-shard
//! [`crate::kv_index::KvIndex`] stores them in its tree and records tree positions, the
//! sharded [`crate::sharding::ingest::Ingest`] queues them for the shards and records each
//! block's seq_hash and route.
//!
//! # Invariants
//! 1. A refused event changes nothing. A store whose parent is unknown is refused before
//!    anything happens. A store is checked for engine-hash conflicts as its directory entries
//!    are recorded, after the blocks went to the store; on a conflict the entries recorded so
//!    far are taken back and the store is told to drop the copies it added, so the
//!    directories and the multiset end where they started.
//! 2. Every refusal is counted once under its [`RejectReason`]; unknown engine hashes of a
//!    removal are counted one by one and skipped, the known ones applied.
//! 3. A worker key with an empty directory has no directory, and the map gives its memory
//!    back once no worker key is left.
//! 4. No worker key's directory holds more engine hashes than its cap
//!    ([`Directories::with_max_blocks_per_key`]; none by default): a store of `n` blocks to a
//!    directory of `len` entries is refused as a whole ([`EngineError::WorkerFull`]) when
//!    `len + n` exceeds the cap, before anything happens (invariant 1). The rule counts the
//!    store's blocks, not the new entries they would make (a block stored again adds a copy,
//!    not an entry), so it is decided without a lookup; removals and clears always apply.
//!
//! 5. A store that starts a sequence (no parent) and names only blocks the worker key holds
//!    already, each under the same engine hash and at the same seq_hash, adds nothing: it
//!    reports held blocks, it does not cache them again. vLLM sends exactly this for a request
//!    with `kv_cache_report_mode: "full"` (its prefix-cache hits, re-announced from block 0),
//!    and removes each block once when it evicts it; counting those reports as copies kept
//!    evicted blocks in the index. A store with a parent still adds a copy per block (vLLM
//!    caches a recomputed block again when a whole prompt was a hit, and removes each
//!    physical copy). The one case this reads the other way, a one-block prompt recomputed
//!    into a second physical block, undercounts: the index may miss that block after one
//!    copy is evicted, never claim a block that is gone.
//!
//! # Concurrency
//! Single writer: owned by the thread that decodes these workers' events.

use crate::directory::{BlockRef, Directory, Insert};
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::{KvEvent, StoredBlock};
use crate::hash::seq_hash;
use crate::ids::{EngineHash, SeqHash, WorkerId, WorkerKey};
use hashbrown::HashMap;

/// What an accepted event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Block copies added or dropped.
    pub blocks: usize,
    /// Engine hashes of a removal that this worker key did not hold (counted, skipped).
    pub unknown: usize,
}

/// Where the blocks of accepted events go, and what the directories record for them.
///
/// Implementations MUST apply the calls in order and MUST NOT change anything when `store`
/// returns an error; callers guarantee that `remove` only names blocks the worker key holds
/// (a reference its directory recorded).
pub trait BlockStore<R> {
    /// The seq_hash of a recorded block.
    fn seq_of(&self, block: R) -> Option<SeqHash>;

    /// Do two references name the same block?
    fn same_block(&self, a: R, b: R) -> bool;

    /// One more copy of each of `seqs` for `key`, chained under `parent` (`None`: the chain
    /// starts a sequence); pushes one reference per block onto `out`, in order.
    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<R>,
        seqs: &[SeqHash],
        out: &mut Vec<R>,
    ) -> Result<()>;

    /// One copy fewer of each block (a block may be listed several times).
    fn remove(&mut self, key: WorkerKey, blocks: &[R]);

    /// Called every [`PAUSE_BLOCKS`] blocks of one event's directory work, between two
    /// blocks: the directories are mid-event, the store is not (a core answers the queries
    /// waiting for it here, since queries read only the store). Does nothing by default.
    #[inline]
    fn pause(&mut self) {}
}

/// Blocks of directory work between two [`BlockStore::pause`] calls. Each block's directory
/// entry is a random access into the worker's table, often a cache miss: measured on W1,
/// a 96-block event's directory work took 20-40 µs, held queries that long, and was the
/// largest share of the read stall while ingest runs (issue 32). At 16 blocks the gaps
/// between pauses were still 8-12 µs at times; 4, with the core's doorbell making an idle
/// pause one load, took W1's read p99 under ingest from 17.1 to 14.3 µs (docs/benchmarks.md,
/// issue 32 sixth pass).
pub const PAUSE_BLOCKS: usize = 4;

/// Removals whose directory entries are read ahead together ([`Directory::touch`]): the
/// more lookups overlap, the fewer misses a removal waits for; 16 took W1's removals from
/// 9.2M to 15.1M blocks/s.
const READ_AHEAD_BLOCKS: usize = 16;

/// The cap on one worker key's engine hashes that `kvengine` applies unless told otherwise
/// (`--max-blocks-per-worker`): 4,194,304 blocks, 64 Mi tokens at 16 tokens a block, more
/// than any GPU's KV cache holds. The library's own default is no cap.
pub const DEFAULT_MAX_BLOCKS_PER_KEY: usize = 1 << 22;

/// Every worker key's directory.
#[derive(Debug)]
pub struct Directories<R> {
    dirs: HashMap<WorkerKey, Directory<R>>,
    rejects: RejectCounts,
    seqs: Vec<SeqHash>,
    refs: Vec<R>,
    /// The most engine hashes one worker key may hold (invariant 4).
    max_per_key: usize,
}

impl<R> Default for Directories<R> {
    fn default() -> Self {
        Self {
            dirs: HashMap::new(),
            rejects: RejectCounts::default(),
            seqs: Vec::new(),
            refs: Vec::new(),
            max_per_key: usize::MAX,
        }
    }
}

impl<R: BlockRef> Directories<R> {
    /// No worker keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps each worker key's directory at `max` engine hashes (`None`: no cap; see
    /// invariant 4).
    pub fn with_max_blocks_per_key(mut self, max: Option<usize>) -> Self {
        self.max_per_key = max.unwrap_or(usize::MAX);
        self
    }

    /// The cap on each worker key's engine hashes (`None`: no cap).
    pub fn max_blocks_per_key(&self) -> Option<usize> {
        (self.max_per_key != usize::MAX).then_some(self.max_per_key)
    }

    /// Applies one event of `key` to `store`. A refused event is counted and changes
    /// nothing.
    pub fn apply(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        store: &mut impl BlockStore<R>,
    ) -> Result<Applied> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let result = self.store(key, *parent, blocks, store);
                self.count(&result);
                result.map(|blocks| Applied { blocks, unknown: 0 })
            }
            KvEvent::Removed { blocks } => Ok(self.remove(key, blocks, store)),
            KvEvent::Cleared => Ok(Applied {
                blocks: self.clear(key, store),
                unknown: 0,
            }),
        }
    }

    /// Stores a chain of blocks under `parent` for `key`; returns how many were added.
    /// Refused as a whole if `parent` is unknown for `key`, the store would pass `key`'s
    /// cap (invariant 4) or an engine hash is already stored for `key` under another
    /// prefix. Does not count refusals (see [`Directories::apply`]).
    pub fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
        store: &mut impl BlockStore<R>,
    ) -> Result<usize> {
        let unknown = |p| EngineError::UnknownParent {
            worker: key,
            parent: p,
        };
        let parent_ref = match parent {
            None => None,
            Some(p) => Some(
                self.dirs
                    .get(&key)
                    .and_then(|d| d.get(p))
                    .ok_or(unknown(p))?,
            ),
        };
        if blocks.is_empty() {
            return Ok(0);
        }
        if parent.is_none() && self.holds_root_chain(key, blocks, store) {
            // A report of blocks the worker holds already (invariant 5): no copy added.
            return Ok(0);
        }
        let held = self.engine_hashes(key);
        if held.saturating_add(blocks.len()) > self.max_per_key {
            return Err(EngineError::WorkerFull {
                worker: key,
                blocks: blocks.len(),
                limit: self.max_per_key,
            });
        }
        let mut prev = match (parent, parent_ref) {
            (Some(p), Some(r)) => Some(store.seq_of(r).ok_or(unknown(p))?),
            _ => None,
        };
        self.seqs.clear();
        for b in blocks {
            let s = seq_hash(prev, b.tokens_hash);
            self.seqs.push(s);
            prev = Some(s);
        }
        self.refs.clear();
        store.store(key, parent_ref, &self.seqs, &mut self.refs)?;
        let dir = self.dirs.entry(key).or_default();
        let mut recorded = 0;
        let mut conflict = None;
        for (b, &r) in blocks.iter().zip(&self.refs) {
            if let Insert::Conflict(_) =
                dir.insert(b.engine_hash, r, |have| store.same_block(have, r))
            {
                conflict = Some(b.engine_hash);
                break;
            }
            recorded += 1;
            if recorded % PAUSE_BLOCKS == 0 {
                store.pause();
            }
        }
        if conflict.is_none() && recorded == blocks.len() {
            return Ok(blocks.len());
        }
        // Take everything back (invariant 1): the entries recorded, then the copies added.
        for b in blocks.get(..recorded).unwrap_or(&[]) {
            dir.remove(b.engine_hash);
        }
        store.remove(key, &self.refs);
        self.forget_if_empty(key);
        Err(match conflict {
            Some(block) => EngineError::EngineHashConflict { worker: key, block },
            None => EngineError::UnknownPosition,
        })
    }

    /// Does `key` hold every one of `blocks`, chained from the root, already: each under its
    /// engine hash and at its seq_hash (invariant 5)? Allocates nothing.
    fn holds_root_chain(
        &self,
        key: WorkerKey,
        blocks: &[StoredBlock],
        store: &impl BlockStore<R>,
    ) -> bool {
        let Some(dir) = self.dirs.get(&key) else {
            return false;
        };
        let mut prev = None;
        blocks.iter().all(|b| {
            let s = seq_hash(prev, b.tokens_hash);
            prev = Some(s);
            dir.get(b.engine_hash)
                .and_then(|r| store.seq_of(r))
                .is_some_and(|have| have == s)
        })
    }

    /// Counts a refused store under its reason.
    pub fn count<T>(&mut self, result: &Result<T>) {
        if let Err(e) = result {
            self.rejects.add(e.reason(), 1);
        }
    }

    /// Drops one copy of each listed block of `key`; unknown engine hashes are counted and
    /// skipped.
    pub fn remove(
        &mut self,
        key: WorkerKey,
        blocks: &[EngineHash],
        store: &mut impl BlockStore<R>,
    ) -> Applied {
        let mut applied = Applied::default();
        match self.dirs.get_mut(&key) {
            Some(dir) => {
                self.refs.clear();
                for (i, &e) in blocks.iter().enumerate() {
                    if i % READ_AHEAD_BLOCKS == 0 {
                        // The chunk of removals about to run: its lookups' cache misses
                        // overlap (W1's removals 9.2M to 15.1M blocks/s, docs/benchmarks.md).
                        // Stores do not do this: their entries are new, and reading ahead
                        // made W1's and W4's stores slower in 4 of 5 pairs.
                        let end = blocks.len().min(i + READ_AHEAD_BLOCKS);
                        dir.touch(blocks.get(i..end).unwrap_or(&[]));
                    }
                    match dir.remove(e) {
                        Some(found) => self.refs.push(found),
                        None => applied.unknown += 1,
                    }
                    if (i + 1) % PAUSE_BLOCKS == 0 {
                        store.pause();
                    }
                }
                applied.blocks = self.refs.len();
                store.remove(key, &self.refs);
                self.forget_if_empty(key);
            }
            None => applied.unknown = blocks.len(),
        }
        if applied.unknown > 0 {
            self.rejects
                .add(RejectReason::UnknownBlock, applied.unknown as u64);
        }
        applied
    }

    /// Empties `key`'s cache (one dp rank only); returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey, store: &mut impl BlockStore<R>) -> usize {
        let Some(mut dir) = self.dirs.remove(&key) else {
            return 0;
        };
        self.refs.clear();
        for (r, copies) in dir.drain() {
            for _ in 0..copies {
                self.refs.push(r);
            }
        }
        let dropped = self.refs.len();
        store.remove(key, &self.refs);
        self.forget_if_empty(key);
        dropped
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId, store: &mut impl BlockStore<R>) -> usize {
        let keys: Vec<WorkerKey> = self
            .dirs
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        for &k in &keys {
            self.clear(k, store);
        }
        keys.len()
    }

    fn forget_if_empty(&mut self, key: WorkerKey) {
        if self.dirs.get(&key).is_some_and(Directory::is_empty) {
            self.dirs.remove(&key);
        }
        if self.dirs.is_empty() {
            self.dirs = HashMap::new();
            self.seqs = Vec::new();
            self.refs = Vec::new();
        }
    }

    /// Distinct engine hashes `key` holds.
    pub fn engine_hashes(&self, key: WorkerKey) -> usize {
        self.dirs.get(&key).map_or(0, Directory::len)
    }

    /// Worker keys holding at least one block.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.dirs.keys().copied()
    }

    /// Every worker key's directory (for a snapshot).
    pub fn directories(&self) -> impl Iterator<Item = (WorkerKey, &Directory<R>)> + '_ {
        self.dirs.iter().map(|(k, d)| (*k, d))
    }

    /// `key`'s directory, created empty if absent, to restore a snapshot's entries into.
    /// A directory left empty must be dropped with [`Directories::forget_empty`].
    pub fn restoring(&mut self, key: WorkerKey) -> &mut Directory<R> {
        self.dirs.entry(key).or_default()
    }

    /// Drops empty directories (after a restore), keeping invariant 3.
    pub fn forget_empty(&mut self) {
        self.dirs.retain(|_, d| !d.is_empty());
        if self.dirs.is_empty() {
            self.dirs = HashMap::new();
        }
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        &self.rejects
    }

    /// Engine hashes in all directories, and the heap bytes of everything here.
    pub fn size(&self) -> (usize, usize) {
        let entries = self.dirs.values().map(Directory::len).sum();
        let bytes = self.dirs.allocation_size()
            + self.dirs.values().map(Directory::heap_bytes).sum::<usize>()
            + self.seqs.capacity() * size_of::<SeqHash>()
            + self.refs.capacity() * size_of::<R>();
        (entries, bytes)
    }
}

#[cfg(test)]
mod tests {
    use crate::error::{EngineError, RejectReason};
    use crate::event::{KvEvent, StoredBlock};
    use crate::ids::{EngineHash, TokensHash, WorkerKey};
    use crate::kv_index::KvIndex;

    fn chain(parent: Option<u64>, hashes: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent: parent.map(EngineHash),
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    engine_hash: EngineHash(h),
                    tokens_hash: TokensHash(h * 7),
                })
                .collect(),
        }
    }

    #[test]
    fn a_root_chain_held_already_is_a_report_not_a_copy() {
        let mut ix = KvIndex::new();
        let a = WorkerKey::new(1, 0);
        let removed = |h: &[u64]| KvEvent::Removed {
            blocks: h.iter().map(|&h| EngineHash(h)).collect(),
        };
        ix.apply(a, &chain(None, &[1, 2, 3])).unwrap();
        // vLLM's "full" report of a two-block prefix hit, twice: no copies added.
        for _ in 0..2 {
            assert_eq!(ix.apply(a, &chain(None, &[1, 2])).unwrap().blocks, 0);
        }
        // A recomputed last block cached again under its parent is a second copy.
        assert_eq!(ix.apply(a, &chain(Some(2), &[3])).unwrap().blocks, 1);
        // A root chain only partly held is a store: every block gets a copy.
        assert_eq!(ix.apply(a, &chain(None, &[1, 2, 3, 4])).unwrap().blocks, 4);
        assert_eq!(ix.cached_blocks(a), 4);
        // One eviction per physical block: 1 and 2 had two stores (the reports added none),
        // 3 had three, 4 one.
        ix.apply(a, &removed(&[1, 2, 3, 3, 4])).unwrap();
        assert_eq!(ix.cached_blocks(a), 3);
        ix.apply(a, &removed(&[1, 2, 3])).unwrap();
        assert_eq!(ix.cached_blocks(a), 0, "nothing outlives its evictions");
        assert_eq!(ix.stats().directory_entries, 0);
    }

    #[test]
    fn a_store_past_the_cap_is_refused_whole_and_counted() {
        let mut ix = KvIndex::new().with_max_blocks_per_key(Some(4));
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(1, 1));
        ix.apply(a, &chain(None, &[1, 2, 3])).unwrap();
        let before = ix.stats();
        let refused = ix.apply(a, &chain(Some(3), &[4, 5]));
        assert_eq!(
            refused,
            Err(EngineError::WorkerFull {
                worker: a,
                blocks: 2,
                limit: 4
            })
        );
        assert_eq!(ix.stats(), before, "a refused store changes nothing");
        assert_eq!(ix.rejects().get(RejectReason::WorkerFull), 1);
        // Exactly up to the cap is fine; another rank has its own cap.
        ix.apply(a, &chain(Some(3), &[4])).unwrap();
        ix.apply(b, &chain(None, &[1, 2, 3, 4])).unwrap();
        // At the cap even a block stored again under its parent is refused: the rule
        // counts blocks. A report of held blocks from the root adds nothing: not refused.
        assert!(ix.apply(a, &chain(Some(1), &[2])).is_err());
        assert_eq!(ix.apply(a, &chain(None, &[1, 2])).map(|a| a.blocks), Ok(0));
        // Removals still apply and make room.
        ix.apply(
            a,
            &KvEvent::Removed {
                blocks: vec![EngineHash(4)],
            },
        )
        .unwrap();
        ix.apply(a, &chain(Some(3), &[5])).unwrap();
        assert_eq!(ix.rejects().get(RejectReason::WorkerFull), 2);
        assert_eq!(ix.cached_blocks(a), 4);
    }

    #[test]
    fn no_cap_by_default() {
        let dirs = super::Directories::<crate::index::Pos>::new();
        assert_eq!(dirs.max_blocks_per_key(), None);
        assert_eq!(
            dirs.with_max_blocks_per_key(Some(9)).max_blocks_per_key(),
            Some(9)
        );
        let mut ix = KvIndex::new();
        let hashes: Vec<u64> = (1..=1000).collect();
        ix.apply(WorkerKey::new(1, 0), &chain(None, &hashes))
            .unwrap();
        assert_eq!(ix.cached_blocks(WorkerKey::new(1, 0)), 1000);
    }
}
