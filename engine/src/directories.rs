//! Every worker key's directory, and DESIGN.md's event semantics on top of them.
//!
//! This is the one implementation of what a KV event means: a store resolves its parent
//! through the worker key's directory, chains seq_hashes and records each block; a removal
//! drops one copy per engine hash; a clear empties the worker key; removing a worker clears
//! all its dp ranks. What happens to the resulting block operations is the caller's
//! [`BlockSink`]: the single-shard [`crate::kv_index::KvIndex`] applies them to its shard
//! at once, the sharded [`crate::sharding::ingest::Ingest`] queues them per shard.
//!
//! # Invariants
//! 1. A refused event changes no directory and emits nothing: a store is checked (parent,
//!    then engine-hash conflicts, undone in the directory if found half way) before any
//!    block reaches the sink.
//! 2. Every refusal is counted once under its [`RejectReason`]; unknown engine hashes of a
//!    removal are counted one by one and skipped, the known ones applied.
//! 3. A worker key with an empty directory has no directory, and the map gives its memory
//!    back once no worker key is left.
//!
//! # Concurrency
//! Single writer: owned by the thread that decodes these workers' events.

use crate::directory::{Directory, Insert, RouteValue};
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

/// Where the block operations of accepted events go.
///
/// Implementations MUST apply the operations of one call in order; callers guarantee that a
/// removal only names a block the worker key holds (its directory said so).
pub trait BlockSink<R> {
    /// One more copy of each block, for `key`.
    fn add(&mut self, key: WorkerKey, blocks: &[(SeqHash, R)]);
    /// One copy fewer of each block (a block may be listed several times), for `key`.
    fn remove(&mut self, key: WorkerKey, blocks: &[(SeqHash, R)]);
}

/// A block's route from its parent's route and its own seq_hash (see
/// [`crate::sharding::ShardPolicy::place`]); the single-shard index uses `()`.
pub trait Placer<R> {
    /// The route of a block with `seq` under a parent routed `parent`.
    fn place(&self, parent: Option<R>, seq: SeqHash) -> R;
}

/// One shard: every block has the unit route.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unrouted;

impl Placer<()> for Unrouted {
    #[inline]
    fn place(&self, _: Option<()>, _: SeqHash) {}
}

/// Every worker key's directory.
#[derive(Debug)]
pub struct Directories<R> {
    dirs: HashMap<WorkerKey, Directory<R>>,
    rejects: RejectCounts,
    scratch: Vec<(SeqHash, R)>,
}

impl<R> Default for Directories<R> {
    fn default() -> Self {
        Self {
            dirs: HashMap::new(),
            rejects: RejectCounts::default(),
            scratch: Vec::new(),
        }
    }
}

impl<R: RouteValue> Directories<R> {
    /// No worker keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event of `key`, sending its block operations to `sink`. A refused event
    /// is counted and changes nothing.
    pub fn apply(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        placer: &impl Placer<R>,
        sink: &mut impl BlockSink<R>,
    ) -> Result<Applied> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let result = self.store(key, *parent, blocks, placer, sink);
                self.count(&result);
                result.map(|blocks| Applied { blocks, unknown: 0 })
            }
            KvEvent::Removed { blocks } => Ok(self.remove(key, blocks, sink)),
            KvEvent::Cleared => Ok(Applied {
                blocks: self.clear(key, sink),
                unknown: 0,
            }),
        }
    }

    /// Stores a chain of blocks under `parent` for `key`; returns how many were added.
    /// Refused as a whole if `parent` is unknown for `key` or an engine hash is already
    /// stored for `key` under another prefix. Does not count refusals (see
    /// [`Directories::apply`]).
    pub fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
        placer: &impl Placer<R>,
        sink: &mut impl BlockSink<R>,
    ) -> Result<usize> {
        let (mut prev_seq, mut prev_route) = match parent {
            None => (None, None),
            Some(p) => {
                let (seq, route) = self.dirs.get(&key).and_then(|d| d.get(p)).ok_or(
                    EngineError::UnknownParent {
                        worker: key,
                        parent: p,
                    },
                )?;
                (Some(seq), Some(route))
            }
        };
        if blocks.is_empty() {
            return Ok(0);
        }
        let dir = self.dirs.entry(key).or_default();
        self.scratch.clear();
        for (i, b) in blocks.iter().enumerate() {
            let seq = seq_hash(prev_seq, b.tokens_hash);
            let route = placer.place(prev_route, seq);
            if let Insert::Conflict(_) = dir.insert(b.engine_hash, seq, route) {
                Self::undo(dir, blocks.get(..i).unwrap_or(&[]));
                self.forget_if_empty(key);
                return Err(EngineError::EngineHashConflict {
                    worker: key,
                    block: b.engine_hash,
                });
            }
            self.scratch.push((seq, route));
            prev_seq = Some(seq);
            prev_route = Some(route);
        }
        sink.add(key, &self.scratch);
        Ok(blocks.len())
    }

    /// Counts a refused store under its reason.
    pub fn count<T>(&mut self, result: &Result<T>) {
        if let Err(e) = result {
            self.rejects.add(e.reason(), 1);
        }
    }

    #[cold]
    #[inline(never)]
    fn undo(dir: &mut Directory<R>, done: &[StoredBlock]) {
        for b in done {
            dir.remove(b.engine_hash);
        }
    }

    /// Drops one copy of each listed block of `key`; unknown engine hashes are counted and
    /// skipped.
    pub fn remove(
        &mut self,
        key: WorkerKey,
        blocks: &[EngineHash],
        sink: &mut impl BlockSink<R>,
    ) -> Applied {
        let mut applied = Applied::default();
        match self.dirs.get_mut(&key) {
            Some(dir) => {
                self.scratch.clear();
                for &e in blocks {
                    match dir.remove(e) {
                        Some(found) => self.scratch.push(found),
                        None => applied.unknown += 1,
                    }
                }
                applied.blocks = self.scratch.len();
                sink.remove(key, &self.scratch);
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
    pub fn clear(&mut self, key: WorkerKey, sink: &mut impl BlockSink<R>) -> usize {
        let Some(mut dir) = self.dirs.remove(&key) else {
            return 0;
        };
        self.scratch.clear();
        for (seq, route, copies) in dir.drain() {
            for _ in 0..copies {
                self.scratch.push((seq, route));
            }
        }
        let dropped = self.scratch.len();
        sink.remove(key, &self.scratch);
        self.forget_if_empty(key);
        dropped
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId, sink: &mut impl BlockSink<R>) -> usize {
        let keys: Vec<WorkerKey> = self
            .dirs
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        for &k in &keys {
            self.clear(k, sink);
        }
        keys.len()
    }

    fn forget_if_empty(&mut self, key: WorkerKey) {
        if self.dirs.get(&key).is_some_and(Directory::is_empty) {
            self.dirs.remove(&key);
        }
        if self.dirs.is_empty() {
            self.dirs = HashMap::new();
            self.scratch = Vec::new();
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

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        &self.rejects
    }

    /// Engine hashes in all directories, and the heap bytes of everything here.
    pub fn size(&self) -> (usize, usize) {
        let entries = self.dirs.values().map(Directory::len).sum();
        let bytes = self.dirs.allocation_size()
            + self.dirs.values().map(Directory::heap_bytes).sum::<usize>()
            + self.scratch.capacity() * size_of::<(SeqHash, R)>();
        (entries, bytes)
    }
}
