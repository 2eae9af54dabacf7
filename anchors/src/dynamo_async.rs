//! Dynamo's indexers that are driven through its async `KvIndexerInterface`
//! (`dynamo-kv-router` 1.6.1) behind [`IndexerUnderTest`]:
//!
//! * `RadixTree`, as Dynamo runs it: inside its `KvIndexer`, which owns the tree on a thread
//!   of its own (a single-threaded runtime) and serves events and match requests from
//!   channels, one at a time. Reads therefore queue behind writes, which is what the mixed
//!   phase measures. (Dynamo's own guide, `src/indexer/README.md`, "Indexer Selection
//!   Guide", keeps `RadixTree` for the worker-side local index and unit tests and names
//!   `ThreadPoolIndexer<CRTC>` the router's default.)
//! * `BranchShardedIndexer<ThreadPoolIndexer<CRTC>>` (BSI): a bounded routing trie over
//!   [`BSI_SHARDS`] CRTC shards of one event thread each (2 event threads, as the CRTC
//!   adapter has), routing depth [`BSI_DEPTH`] (the depth Dynamo's own delegate tests
//!   build it with; the crate has no production default). Reads run inline on the caller.
//!
//! # Mapping
//! As for CRTC ([`crate::dynamo`], "Mapping", `Keys::SeqAsLocal`): each stored block's
//! local hash is its seq_hash (equal to its engine hash on the anchor workloads), and a
//! query's seq_hashes are its `LocalBlockHash`es.
//!
//! # Visibility
//! `apply_all` and `mixed` send every event through `apply_event`, then await the
//! interface's `flush` (`KvIndexer::flush_and_wait`; for BSI, every shard's
//! `flush_and_wait`), a FIFO barrier: it returns once every event accepted before it is
//! applied. The clock runs until it returns.
//!
//! # Threads
//! The adapter's own runtime (current-thread) drives sends and barriers on the harness's
//! thread; callers on other threads await their reads through its handle
//! (`Handle::block_on`), which needs no I/O or timer driver and spawns nothing: the
//! `KvIndexer`'s match channel is in memory and BSI's reads complete inline.
//!
//! # Counting
//! Dynamo's indexers log and drop an event they cannot apply; `anomalies` stays 0. Live
//! entries come from `dump_events` (one entry per block per worker).

use crate::dynamo::{dump_stats, key_of, router_event};
use anyhow::{Context, Result, anyhow};
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{
    BranchShardedIndexer, KvIndexer, KvIndexerInterface, KvIndexerMetrics, ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::LocalBlockHash;
use engine::{Matches, SeqHash};
use lab::driver::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    callers::run_callers, concurrent_mixed, round_robin,
};
use lab::workload::{EventStream, Query};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The block size the indexers' constructors ask for (events carry hashes).
const BLOCK_SIZE: u32 = 16;

/// BSI's shards (one event thread each).
pub const BSI_SHARDS: usize = 2;

/// BSI's routing depth.
pub const BSI_DEPTH: usize = 1;

/// One of Dynamo's async indexers.
pub struct AsyncUnderTest<I> {
    name: &'static str,
    indexer: I,
    token: CancellationToken,
    rt: tokio::runtime::Runtime,
    next_event_id: u64,
}

impl<I> std::fmt::Debug for AsyncUnderTest<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncUnderTest")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime that awaits Dynamo's indexer")
}

/// A fresh `KvIndexer` (its tree thread started).
pub fn radix_tree() -> Result<Box<dyn IndexerUnderTest>> {
    let rt = runtime()?;
    let token = CancellationToken::new();
    let indexer = {
        let _enter = rt.enter();
        KvIndexer::new(
            token.clone(),
            BLOCK_SIZE,
            Arc::new(KvIndexerMetrics::new_unregistered()),
        )
    };
    Ok(Box::new(AsyncUnderTest {
        name: "dynamo-radix-tree(kv-indexer thread)",
        indexer,
        token,
        rt,
        next_event_id: 0,
    }))
}

/// A fresh BSI over [`BSI_SHARDS`] CRTC shards, routing depth [`BSI_DEPTH`].
pub fn branch_sharded() -> Result<Box<dyn IndexerUnderTest>> {
    let rt = runtime()?;
    let indexer = {
        let _enter = rt.enter();
        let shards = (0..BSI_SHARDS)
            .map(|_| ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE))
            .collect();
        BranchShardedIndexer::new(shards, BSI_DEPTH, BLOCK_SIZE)
    };
    Ok(Box::new(AsyncUnderTest {
        name: "dynamo-branch-sharded(2 crtc shards x 1 event thread, depth 1)",
        indexer,
        token: CancellationToken::new(),
        rt,
        next_event_id: 0,
    }))
}

impl<I> Drop for AsyncUnderTest<I> {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// One query through the indexer's read path.
fn find<I: KvIndexerInterface>(
    handle: &tokio::runtime::Handle,
    indexer: &I,
    seqs: &[SeqHash],
) -> Result<Matches> {
    let local: Vec<LocalBlockHash> = seqs.iter().map(|s| LocalBlockHash(s.0)).collect();
    let scores = handle
        .block_on(indexer.find_matches(local))
        .map_err(|e| anyhow!("find_matches: {e}"))?;
    Ok(Matches::from_overlaps(
        scores.scores.iter().map(|(w, &o)| (key_of(*w), o)),
    ))
}

/// Sends every event of `streams` (one from each stream in turn), then waits on the
/// indexer's flush barrier (module docs, "Visibility").
fn send_and_flush<I: KvIndexerInterface>(
    indexer: &I,
    rt: &tokio::runtime::Runtime,
    next_event_id: &mut u64,
    streams: &[EventStream],
) {
    rt.block_on(async {
        for (key, ev) in round_robin(streams) {
            *next_event_id += 1;
            indexer
                .apply_event(router_event(*key, ev, *next_event_id, false))
                .await;
        }
        indexer.flush().await
    });
}

impl<I: KvIndexerInterface + Send + Sync> IndexerUnderTest for AsyncUnderTest<I> {
    fn name(&self) -> String {
        self.name.to_owned()
    }

    fn cores(&self) -> usize {
        1
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        send_and_flush(&self.indexer, &self.rt, &mut self.next_event_id, streams);
        Ok(())
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
            || {
                send_and_flush(indexer, rt, next, streams);
                Ok(())
            },
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
        run_callers(&mut shared, lists, keep, |(h, ix), q| find(h, *ix, q))
    }

    fn max_callers(&self) -> usize {
        usize::MAX
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        dump_stats(self.rt.block_on(self.indexer.dump_events()), self.name, 0)
    }
}
