//! The ingest side of the sharded engine: worker directories in, per-shard batches out.
//!
//! [`Ingest`] is the sharded engine's front half: the shared event semantics
//! ([`Directories`], routes from the [`ShardPolicy`]) with an [`Outbox`] as the sink, one
//! queue of operation batches per shard. Whoever drives it (a test, the threaded runtime)
//! delivers the outbox to the shards.
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

use super::shard::Shard;
use super::{Placement, Route, ShardId, ShardPolicy};
use crate::directories::{Applied, BlockSink, Directories, Placer};
use crate::error::{RejectCounts, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};

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

    /// Queues `seq` for the shards of `placement`, except `skip` (a shard the caller
    /// applies to directly).
    #[inline]
    fn push(
        &mut self,
        placement: Placement,
        skip: Option<ShardId>,
        key: WorkerKey,
        op: BlockOp,
        seq: SeqHash,
    ) {
        match placement {
            Placement::Shard(s) if Some(s) == skip => {}
            Placement::Shard(s) => {
                if let Some(q) = self.queues.get_mut(s.idx()) {
                    Self::push_one(q, key, op, seq);
                }
            }
            Placement::Everywhere => {
                for (i, q) in self.queues.iter_mut().enumerate() {
                    if skip.map(ShardId::idx) != Some(i) {
                        Self::push_one(q, key, op, seq);
                    }
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

/// The policy as the directories see it.
struct PolicyPlacer<'a, P>(&'a P);

impl<P: ShardPolicy> Placer<Route> for PolicyPlacer<'_, P> {
    #[inline]
    fn place(&self, parent: Option<Route>, seq: SeqHash) -> Route {
        self.0.place(parent, seq)
    }
}

/// The outbox as the directories see it: each block goes to the queues of its placement,
/// except that blocks of the `local` shard (if any) are applied to it at once.
struct OutboxSink<'a, P> {
    policy: &'a P,
    outbox: &'a mut Outbox,
    local: Option<&'a mut Shard>,
}

impl<P: ShardPolicy> OutboxSink<'_, P> {
    fn route(&mut self, key: WorkerKey, op: BlockOp, blocks: &[(SeqHash, Route)]) {
        let me = self.local.as_ref().map(|s| s.id());
        if let (Some(me), Some(shard)) = (me, self.local.as_deref_mut()) {
            let policy = self.policy;
            let seqs = blocks
                .iter()
                .filter(move |b| match policy.placement(b.1) {
                    Placement::Everywhere => true,
                    Placement::Shard(s) => s == me,
                })
                .map(|b| b.0);
            match op {
                BlockOp::Add => shard.add_seqs(key, seqs),
                BlockOp::Remove => shard.remove_seqs(key, seqs),
            }
        }
        for &(seq, route) in blocks {
            let placement = self.policy.placement(route);
            self.outbox.push(placement, me, key, op, seq);
        }
    }
}

impl<P: ShardPolicy> BlockSink<Route> for OutboxSink<'_, P> {
    fn add(&mut self, key: WorkerKey, blocks: &[(SeqHash, Route)]) {
        self.route(key, BlockOp::Add, blocks);
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[(SeqHash, Route)]) {
        self.route(key, BlockOp::Remove, blocks);
    }
}

/// Worker directories and the routing of their events to shards.
#[derive(Debug)]
pub struct Ingest<P> {
    policy: P,
    dirs: Directories<Route>,
}

impl<P: ShardPolicy> Ingest<P> {
    /// An ingest with no workers, routing with `policy`.
    pub fn new(policy: P) -> Self {
        Self {
            policy,
            dirs: Directories::new(),
        }
    }

    /// The sharding policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Applies one event of `key`, appending its operations to `out`. A refused event is
    /// counted and emits nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent, out: &mut Outbox) -> Result<Applied> {
        let mut sink = OutboxSink {
            policy: &self.policy,
            outbox: out,
            local: None,
        };
        self.dirs
            .apply(key, event, &PolicyPlacer(&self.policy), &mut sink)
    }

    /// Like [`Ingest::apply`], but the operations for `local` are applied to it at once
    /// instead of being queued (a core applying its own shard's share).
    pub fn apply_local(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        out: &mut Outbox,
        local: &mut Shard,
    ) -> Result<Applied> {
        let mut sink = OutboxSink {
            policy: &self.policy,
            outbox: out,
            local: Some(local),
        };
        self.dirs
            .apply(key, event, &PolicyPlacer(&self.policy), &mut sink)
    }

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey, out: &mut Outbox) -> usize {
        let mut sink = OutboxSink {
            policy: &self.policy,
            outbox: out,
            local: None,
        };
        self.dirs.clear(key, &mut sink)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId, out: &mut Outbox) -> usize {
        let mut sink = OutboxSink {
            policy: &self.policy,
            outbox: out,
            local: None,
        };
        self.dirs.remove_worker(worker, &mut sink)
    }

    /// Distinct engine hashes `key` holds (its cached blocks, unless it maps two engine
    /// hashes to one prefix).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.dirs.engine_hashes(key) as u64
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.dirs.rejects()
    }

    /// Engine hashes in all directories, and their heap bytes.
    pub fn directory_size(&self) -> (usize, usize) {
        self.dirs.size()
    }
}
