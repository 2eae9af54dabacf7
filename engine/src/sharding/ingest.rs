//! The ingest side of the sharded engine: worker directories in, per-shard batches out.
//!
//! [`Ingest`] does for the sharded engine what [`crate::kv_index::KvIndex`] does for one
//! shard, minus the index itself: it resolves engine hashes through each worker key's
//! directory, chains seq_hashes, asks the [`ShardPolicy`] where each block goes, and
//! appends the resulting operations to an [`Outbox`] with one queue per shard. Whoever
//! drives it (a test, the threaded runtime) delivers the outbox to the shards.
//!
//! # Invariants
//! 1. Everything `KvIndex` promises about directories and refusals holds here too: a
//!    refused event changes nothing and emits nothing; every refusal is counted.
//! 2. Per shard, operations are emitted in event order; an accepted event's operations are
//!    all emitted before the call returns.
//! 3. A block placed `Everywhere` gets the same operation in every shard's queue.
//!
//! # Concurrency
//! Single writer: one ingest thread owns an `Ingest` and the directories of the workers
//! whose events it decodes.

use super::{Placement, Route, ShardId, ShardPolicy};
use crate::directory::{Directory, Insert};
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::{KvEvent, StoredBlock};
use crate::hash::seq_hash;
use crate::ids::{EngineHash, SeqHash, WorkerId, WorkerKey};
use crate::kv_index::Applied;
use hashbrown::HashMap;

/// Add or drop one copy per listed block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockOp {
    /// One more copy of each block.
    Add,
    /// One copy fewer of each block.
    Remove,
}

/// Operations of one worker key for one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpBatch {
    /// Whose blocks.
    pub key: WorkerKey,
    /// What to do with them.
    pub op: BlockOp,
    /// The blocks, in event order.
    pub seqs: Vec<SeqHash>,
}

/// Operations waiting to be delivered, one queue per shard.
#[derive(Debug, Default)]
pub struct Outbox {
    queues: Vec<Vec<OpBatch>>,
}

impl Outbox {
    /// An empty outbox for `shards` shards.
    pub fn new(shards: usize) -> Self {
        Self {
            queues: (0..shards).map(|_| Vec::new()).collect(),
        }
    }

    #[inline]
    fn push_one(queue: &mut Vec<OpBatch>, key: WorkerKey, op: BlockOp, seq: SeqHash) {
        match queue.last_mut() {
            Some(b) if b.key == key && b.op == op => b.seqs.push(seq),
            _ => queue.push(OpBatch {
                key,
                op,
                seqs: vec![seq],
            }),
        }
    }

    #[inline]
    fn push(&mut self, placement: Placement, key: WorkerKey, op: BlockOp, seq: SeqHash) {
        match placement {
            Placement::Shard(s) => {
                if let Some(q) = self.queues.get_mut(s.idx()) {
                    Self::push_one(q, key, op, seq);
                }
            }
            Placement::Everywhere => {
                for q in &mut self.queues {
                    Self::push_one(q, key, op, seq);
                }
            }
        }
    }

    /// Takes shard `shard`'s queue.
    pub fn take(&mut self, shard: ShardId) -> Vec<OpBatch> {
        self.queues
            .get_mut(shard.idx())
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Nothing queued for any shard.
    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(Vec::is_empty)
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.queues.len()
    }
}

/// Worker directories and the routing of their events to shards.
#[derive(Debug)]
pub struct Ingest<P> {
    policy: P,
    dirs: HashMap<WorkerKey, Directory<Route>>,
    rejects: RejectCounts,
    scratch: Vec<(SeqHash, Route)>,
}

impl<P: ShardPolicy> Ingest<P> {
    /// An ingest with no workers, routing with `policy`.
    pub fn new(policy: P) -> Self {
        Self {
            policy,
            dirs: HashMap::new(),
            rejects: RejectCounts::default(),
            scratch: Vec::new(),
        }
    }

    /// The sharding policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Applies one event of `key`, appending its operations to `out`. A refused event is
    /// counted and emits nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent, out: &mut Outbox) -> Result<Applied> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let result = self.store(key, *parent, blocks, out);
                if let Err(e) = &result {
                    self.rejects.add(e.reason(), 1);
                }
                result.map(|blocks| Applied { blocks, unknown: 0 })
            }
            KvEvent::Removed { blocks } => Ok(self.remove(key, blocks, out)),
            KvEvent::Cleared => Ok(Applied {
                blocks: self.clear(key, out),
                unknown: 0,
            }),
        }
    }

    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
        out: &mut Outbox,
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
            let route = self.policy.place(prev_route, seq);
            if let Insert::Conflict(_) = dir.insert(b.engine_hash, seq, route) {
                for done in blocks.get(..i).unwrap_or(&[]) {
                    dir.remove(done.engine_hash);
                }
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
        for &(seq, route) in &self.scratch {
            out.push(self.policy.placement(route), key, BlockOp::Add, seq);
        }
        Ok(blocks.len())
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[EngineHash], out: &mut Outbox) -> Applied {
        let mut applied = Applied::default();
        match self.dirs.get_mut(&key) {
            Some(dir) => {
                for &e in blocks {
                    match dir.remove(e) {
                        Some((seq, route)) => {
                            out.push(self.policy.placement(route), key, BlockOp::Remove, seq);
                            applied.blocks += 1;
                        }
                        None => applied.unknown += 1,
                    }
                }
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

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey, out: &mut Outbox) -> usize {
        let Some(mut dir) = self.dirs.remove(&key) else {
            return 0;
        };
        let mut dropped = 0;
        for (seq, route, copies) in dir.drain() {
            let placement = self.policy.placement(route);
            for _ in 0..copies {
                out.push(placement, key, BlockOp::Remove, seq);
            }
            dropped += copies as usize;
        }
        self.forget_if_empty(key);
        dropped
    }

    /// Drops `key`'s directory once it is empty, and the directory map's memory once no
    /// worker key is left (memory returns to the empty footprint).
    fn forget_if_empty(&mut self, key: WorkerKey) {
        if self.dirs.get(&key).is_some_and(Directory::is_empty) {
            self.dirs.remove(&key);
        }
        if self.dirs.is_empty() {
            self.dirs = HashMap::new();
        }
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId, out: &mut Outbox) -> usize {
        let keys: Vec<WorkerKey> = self
            .dirs
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        for &k in &keys {
            self.clear(k, out);
        }
        keys.len()
    }

    /// Distinct engine hashes `key` holds (its cached blocks, unless it maps two engine
    /// hashes to one prefix).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.dirs.get(&key).map_or(0, |d| d.len() as u64)
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        &self.rejects
    }

    /// Engine hashes in all directories, and their heap bytes.
    pub fn directory_size(&self) -> (usize, usize) {
        let entries = self.dirs.values().map(Directory::len).sum();
        let bytes = self.dirs.allocation_size()
            + self.dirs.values().map(Directory::heap_bytes).sum::<usize>();
        (entries, bytes)
    }
}
