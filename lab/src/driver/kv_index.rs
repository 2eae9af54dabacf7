//! [`IndexerUnderTest`] for the one-shard [`KvIndex`]: the single-threaded baseline.
//!
//! # Invariants
//! 1. `applied` counts block copies added or dropped, so `shard_ops` is comparable with
//!    the sharded implementations' per-shard counts.
//! 2. A refused event or a removal of an unheld block adds to `anomalies` (driver
//!    invariant 3); the index itself counts the same refusals in `rejects()`.
//!
//! # Concurrency
//! Events and the mixed phase run in the caller's thread. `query_callers` shares
//! `&KvIndex` (which is `Sync`) across K scoped reader threads; nothing writes meanwhile.

use super::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    StepIndexer, apply_streams,
};
use crate::workload::{EventStream, Query};
use anyhow::Result;
use engine::event::KvEvent;
use engine::kv_index::KvIndex;
use engine::{Matches, SeqHash, WorkerKey};

/// The one-shard index, driven in the caller's thread.
#[derive(Debug, Default)]
pub struct KvIndexUnderTest {
    index: KvIndex,
    applied: u64,
    anomalies: u64,
}

impl KvIndexUnderTest {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// The index (for checks after a run).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }
}

impl StepIndexer for KvIndexUnderTest {
    #[inline]
    fn apply_one(&mut self, key: WorkerKey, event: &KvEvent) {
        match self.index.apply(key, event) {
            Ok(a) => {
                self.applied += a.blocks as u64;
                self.anomalies += a.unknown as u64;
            }
            Err(_) => self.anomalies += 1,
        }
    }

    #[inline]
    fn query_one(&self, seqs: &[SeqHash]) -> Matches {
        self.index.find_matches(seqs)
    }
}

impl IndexerUnderTest for KvIndexUnderTest {
    fn name(&self) -> String {
        "kv-index".to_owned()
    }

    fn cores(&self) -> usize {
        1
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
        Ok(IndexerStats {
            live_entries: st.index.entries,
            bytes: st.bytes,
            shard_ops: vec![self.applied],
            anomalies: self.anomalies,
        })
    }
}
