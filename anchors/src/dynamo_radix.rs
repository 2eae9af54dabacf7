//! Dynamo's `RadixTree` (`dynamo-kv-router` 1.6.1) behind [`IndexerUnderTest`], as Dynamo
//! runs it: inside its `KvIndexer`, which owns the tree on a thread of its own (a
//! single-threaded runtime) and serves events and match requests from channels, one at a
//! time. Reads therefore queue behind writes, which is what the mixed phase measures.
//!
//! # Mapping
//! As for CRTC ([`crate::dynamo`], "Mapping", `Keys::SeqAsLocal`): each stored block's
//! local hash is its seq_hash (equal to its engine hash on the anchor workloads), and a
//! query's seq_hashes are its `LocalBlockHash`es.
//!
//! # Visibility
//! `apply_event` awaits room in the indexer's event channel; `apply_all` and `mixed` send
//! every event, then await `KvIndexer::flush_and_wait`, its FIFO barrier (it returns once
//! every event accepted before it is applied). The clock runs until it returns.
//!
//! # Threads
//! The adapter's own runtime (current-thread) awaits on the harness's thread; callers on
//! other threads await their match requests through its handle (`Handle::block_on`),
//! which needs no I/O or timer driver: the indexer's channels are all in memory.
//!
//! # Counting
//! Dynamo's indexer logs and drops an event it cannot apply; `anomalies` stays 0. Live
//! entries come from `dump_events` (one entry per block per worker).

use crate::dynamo::router_event;
use anyhow::{Context, Result, anyhow};
use dynamo_kv_router::indexer::{KvIndexer, KvIndexerInterface, KvIndexerMetrics};
use dynamo_kv_router::protocols::{KvCacheEventData, LocalBlockHash, WorkerWithDpRank};
use engine::{DpRank, Matches, SeqHash, WorkerId, WorkerKey};
use lab::driver::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    callers::run_callers, concurrent_mixed, round_robin,
};
use lab::workload::{EventStream, Query};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The block size the indexer's constructor asks for (events carry hashes).
const BLOCK_SIZE: u32 = 16;

/// Dynamo's `RadixTree` in its `KvIndexer`.
pub struct RadixUnderTest {
    indexer: KvIndexer,
    token: CancellationToken,
    rt: tokio::runtime::Runtime,
    next_event_id: u64,
}

impl std::fmt::Debug for RadixUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixUnderTest").finish_non_exhaustive()
    }
}

/// A fresh `KvIndexer` (its tree thread started).
pub fn build() -> Result<Box<dyn IndexerUnderTest>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime that awaits Dynamo's indexer")?;
    let token = CancellationToken::new();
    let indexer = {
        let _enter = rt.enter();
        KvIndexer::new(
            token.clone(),
            BLOCK_SIZE,
            Arc::new(KvIndexerMetrics::new_unregistered()),
        )
    };
    Ok(Box::new(RadixUnderTest {
        indexer,
        token,
        rt,
        next_event_id: 0,
    }))
}

impl Drop for RadixUnderTest {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// One query through the indexer's match channel.
fn find(handle: &tokio::runtime::Handle, indexer: &KvIndexer, seqs: &[SeqHash]) -> Result<Matches> {
    let local: Vec<LocalBlockHash> = seqs.iter().map(|s| LocalBlockHash(s.0)).collect();
    let scores = handle
        .block_on(indexer.find_matches(local))
        .map_err(|e| anyhow!("dynamo-radix-tree: find_matches: {e}"))?;
    Ok(Matches::from_overlaps(
        scores.scores.iter().map(|(w, &o)| (key_of(*w), o)),
    ))
}

fn key_of(w: WorkerWithDpRank) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w.worker_id),
        dp_rank: DpRank(w.dp_rank),
    }
}

impl RadixUnderTest {
    /// Sends every event of `streams` (one from each stream in turn), then waits on the
    /// indexer's flush barrier (module docs, "Visibility").
    fn send_and_flush(
        indexer: &KvIndexer,
        rt: &tokio::runtime::Runtime,
        next_event_id: &mut u64,
        streams: &[EventStream],
    ) -> Result<()> {
        rt.block_on(async {
            for (key, ev) in round_robin(streams) {
                *next_event_id += 1;
                indexer
                    .apply_event(router_event(*key, ev, *next_event_id, false))
                    .await;
            }
            indexer.flush_and_wait().await
        })
        .map(|_| ())
        .map_err(|e| anyhow!("dynamo-radix-tree: flush barrier: {e}"))
    }
}

impl IndexerUnderTest for RadixUnderTest {
    fn name(&self) -> String {
        "dynamo-radix-tree(kv-indexer thread)".to_owned()
    }

    fn cores(&self) -> usize {
        1
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        Self::send_and_flush(&self.indexer, &self.rt, &mut self.next_event_id, streams)
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        find(self.rt.handle(), &self.indexer, seqs)
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        _plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        let handle = self.rt.handle().clone();
        let (indexer, rt, next) = (&self.indexer, &self.rt, &mut self.next_event_id);
        let ((), outcome) = concurrent_mixed(
            std::iter::repeat(()),
            queries,
            || Self::send_and_flush(indexer, rt, next, streams),
            |(), q| {
                std::hint::black_box(find(&handle, indexer, q)?);
                Ok(())
            },
        )?;
        Ok(outcome)
    }

    fn mixed_mode(&self) -> MixedMode {
        MixedMode::Concurrent
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        let handle = self.rt.handle().clone();
        let mut shared = vec![(&handle, &self.indexer); lists.len()];
        run_callers(&mut shared, lists, keep, |(h, ix), q| find(h, ix, q))
    }

    fn max_callers(&self) -> usize {
        usize::MAX
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        let dump = self
            .rt
            .block_on(self.indexer.dump_events())
            .map_err(|e| anyhow!("dynamo-radix-tree: dump_events: {e}"))?;
        let live_entries = dump
            .iter()
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) => s.blocks.len() as u64,
                _ => 0,
            })
            .sum();
        Ok(IndexerStats {
            live_entries,
            bytes: 0,
            shard_ops: Vec::new(),
            anomalies: 0,
        })
    }
}
