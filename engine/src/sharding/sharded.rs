//! N shards behind one ingest, in one thread: the sharded engine without the threads.
//!
//! [`ShardedIndex`] applies each event through [`Ingest`] and delivers the outbox to its
//! [`Shard`]s at once, and sends each query to the one shard the policy names. When a
//! delivery makes a block a junction, it is promoted into the trunk at once (between two
//! events, as `promote` requires). It gives
//! exactly the answers of the single-shard [`crate::kv_index::KvIndex`] (tested against
//! the reference model with 1, 2, 3 and 8 shards), so the threaded runtime, which moves the
//! same batches over rings, can be checked against it.

use super::ingest::{Ingest, Outbox};
use super::shard::Shard;
use super::{ShardId, ShardPolicy};
use crate::error::{RejectCounts, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::kv_index::Applied;
use crate::matches::Matches;

/// Sizes of a sharded index, summed over shards (entries of blocks placed everywhere count
/// once per shard).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardedStats {
    /// `(block, worker key)` entries over all shards.
    pub entries: u64,
    /// Distinct blocks per shard, summed.
    pub blocks: usize,
    /// Heap bytes of all shards.
    pub index_bytes: usize,
    /// Engine hashes in all directories.
    pub directory_entries: usize,
    /// Heap bytes of all directories.
    pub directory_bytes: usize,
}

/// The sharded engine, single-threaded.
#[derive(Debug)]
pub struct ShardedIndex<P> {
    ingest: Ingest<P>,
    shards: Vec<Shard>,
    outbox: Outbox,
}

impl<P: ShardPolicy> ShardedIndex<P> {
    /// Empty shards as `policy` describes them.
    pub fn new(policy: P) -> Self {
        let n = policy.shards();
        Self {
            shards: (0..n).map(|i| Shard::new(ShardId(i as u16))).collect(),
            outbox: Outbox::new(n),
            ingest: Ingest::new(policy),
        }
    }

    /// Caps each worker key at `max` engine hashes (`None`: no cap), as the threaded
    /// runtime's [`RuntimeConfig::max_blocks_per_key`](crate::runtime::RuntimeConfig) does.
    pub fn with_max_blocks_per_key(mut self, max: Option<usize>) -> Self {
        self.ingest = self.ingest.with_max_blocks_per_key(max);
        self
    }

    fn deliver(&mut self) {
        let mut junctions = Vec::new();
        for shard in &mut self.shards {
            for batch in self.outbox.take(shard.id()) {
                shard.apply(&batch);
            }
            if let Some((tip, fanout)) = shard.take_branch()
                && self.ingest.policy().is_junction(tip, fanout)
            {
                junctions.push((shard.id(), tip));
            }
        }
        junctions.extend(self.ingest.take_junctions());
        for (from, tip) in junctions {
            if !self.ingest.policy().in_trunk(tip) {
                self.promote(from, tip);
            }
        }
    }

    /// Promotes the junction `tip` of shard `from` into the trunk (see
    /// `sharding::promote`).
    fn promote(&mut self, from: ShardId, tip: SeqHash) {
        let policy = self.ingest.policy();
        let Some(p) = self
            .shards
            .get(from.idx())
            .and_then(|s| s.export(tip, |x| policy.in_trunk(x)))
        else {
            return;
        };
        for shard in &mut self.shards {
            if shard.id() != from {
                shard.import(&p);
            }
        }
        self.ingest.policy_mut().promote(&p.seqs(), &p.pins, from);
    }

    /// Applies one event of `key` (see [`Ingest::apply`]).
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        let r = self.ingest.apply(key, event, &mut self.outbox);
        self.deliver();
        r
    }

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> usize {
        let n = self.ingest.clear(key, &mut self.outbox);
        self.deliver();
        n
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let n = self.ingest.remove_worker(worker, &mut self.outbox);
        self.deliver();
        n
    }

    /// Overlaps of `seqs`, answered by the one shard the policy names.
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        let s = self.ingest.policy().query_shard(seqs);
        self.shards
            .get(s.idx())
            .map(|shard| shard.find_matches(seqs))
            .unwrap_or_default()
    }

    /// Distinct engine hashes `key` holds.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.ingest.cached_blocks(key)
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.ingest.rejects()
    }

    /// The sharding policy (with the trunk it routes by).
    pub fn policy(&self) -> &P {
        self.ingest.policy()
    }

    /// The shards (for per-shard figures: balance, inconsistencies).
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Sizes, summed over shards.
    pub fn stats(&self) -> ShardedStats {
        let (directory_entries, directory_bytes) = self.ingest.directory_size();
        let mut s = ShardedStats {
            directory_entries,
            directory_bytes,
            ..ShardedStats::default()
        };
        for shard in &self.shards {
            let st = shard.stats();
            s.entries += st.entries;
            s.blocks += st.blocks;
            s.index_bytes += st.bytes;
        }
        s
    }
}
