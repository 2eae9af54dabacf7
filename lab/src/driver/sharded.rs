//! [`IndexerUnderTest`] for [`ShardedIndex`] with a [`Sharding`] policy (the adaptive trunk by
//! default, or fixed depth): N shards behind one ingest, all in the caller's thread.
//!
//! It measures what sharding costs and how evenly a workload spreads (`shard_ops` from
//! [`Shard::applied`]), not parallel speed-up: `cores` reports the shard count, but one
//! thread does all the work.
//!
//! # Invariants
//! 1. `live_entries` counts each (block, worker) pair once (the ingest directories'
//!    engine hashes), however many shards replicate the block; `bytes` adds every shard's
//!    index and the directories, so `bytes / live_entries` includes replication's cost.
//! 2. A refused event, a removal of an unheld block, or a shard inconsistency adds to
//!    `anomalies` (driver invariant 3).
//!
//! # Concurrency
//! Events and the mixed phase run in the caller's thread. `query_callers` shares
//! `&ShardedIndex` (which is `Sync`) across K scoped reader threads; nothing writes
//! meanwhile.
//!
//! [`Shard::applied`]: engine::sharding::shard::Shard::applied

use super::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    StepIndexer, apply_streams,
};
use crate::workload::{EventStream, Query};
use anyhow::Result;
use engine::event::KvEvent;
use engine::sharding::choice::Sharding;
use engine::sharding::sharded::ShardedIndex;
use engine::{Matches, SeqHash, WorkerKey};

/// The sharded index, single-threaded.
#[derive(Debug)]
pub struct ShardedUnderTest {
    index: ShardedIndex<Sharding>,
    anomalies: u64,
}

impl ShardedUnderTest {
    /// The shards `sharding` describes, in one thread.
    pub fn new(sharding: Sharding) -> Self {
        Self {
            index: ShardedIndex::new(sharding),
            anomalies: 0,
        }
    }

    /// The index (for checks after a run).
    pub fn index(&self) -> &ShardedIndex<Sharding> {
        &self.index
    }
}

impl StepIndexer for ShardedUnderTest {
    #[inline]
    fn apply_one(&mut self, key: WorkerKey, event: &KvEvent) {
        match self.index.apply(key, event) {
            Ok(a) => self.anomalies += a.unknown as u64,
            Err(_) => self.anomalies += 1,
        }
    }

    #[inline]
    fn query_one(&self, seqs: &[SeqHash]) -> Matches {
        self.index.find_matches(seqs)
    }
}

impl IndexerUnderTest for ShardedUnderTest {
    fn name(&self) -> String {
        format!(
            "sharded-st(shards={}, {})",
            self.index.shards().len(),
            self.index.policy().describe()
        )
    }

    fn cores(&self) -> usize {
        self.index.shards().len()
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        apply_streams(self, streams);
        Ok(())
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        Ok(self.query_one(seqs))
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        Ok(super::interleaved_mixed(self, streams, queries, plan))
    }

    fn mixed_mode(&self) -> MixedMode {
        MixedMode::Interleaved
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        // The index is `Sync`: every caller shares `&index` (no lock, no copy).
        let mut shared = vec![&self.index; lists.len()];
        super::callers::run_callers(&mut shared, lists, keep, |ix, q| Ok(ix.find_matches(q)))
    }

    fn max_callers(&self) -> usize {
        usize::MAX
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        let st = self.index.stats();
        let shards = self.index.shards();
        Ok(IndexerStats {
            live_entries: st.directory_entries as u64,
            bytes: st.index_bytes + st.directory_bytes,
            shard_ops: shards.iter().map(|s| s.applied()).collect(),
            anomalies: self.anomalies + shards.iter().map(|s| s.inconsistencies()).sum::<u64>(),
        })
    }
}
