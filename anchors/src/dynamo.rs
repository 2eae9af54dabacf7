//! Dynamo's indexers (`dynamo-kv-router` 1.6.1) behind [`IndexerUnderTest`]: the
//! `ConcurrentRadixTreeCompressed` (CRTC) and the `PositionalIndexer`, each inside Dynamo's
//! own `ThreadPoolIndexer` (its event threads, sticky per worker; reads inline on the
//! caller's thread), as Dynamo's router runs them.
//!
//! # Mapping
//! * Worker key `(worker, dp_rank)` -> `WorkerWithDpRank { worker_id, dp_rank }`.
//! * `KvEvent::Stored { parent, blocks }` -> `KvCacheEventData::Stored` with
//!   `parent_hash = parent`, each block's `block_hash` = its engine hash; `Removed` ->
//!   `Removed` by engine hash; `Cleared` -> `Cleared`. Event ids count up per adapter.
//! * Dynamo is queried by `LocalBlockHash`es (tokens hashes), the harness by seq_hash
//!   chains, and kvengine's queries carry no tokens hashes. Two ways across:
//!   - CRTC ([`Keys::SeqAsLocal`]): CRTC walks its tree by `LocalBlockHash` and never
//!     relates it to the block hash, so each stored block's `tokens_hash` is given its
//!     seq_hash, which the anchor workloads make equal to its engine hash
//!     (`lab::workload::anchor`: "a block's engine hash is its seq_hash"), and a query's
//!     seq_hashes are passed as its `LocalBlockHash`es, with no translation on the query
//!     path. On W1-W4 every block id is distinct, so this keys the same tree, node for
//!     node, as the blocks' tokens hashes would.
//!   - Positional ([`Keys::Tokens`]): `PositionalIndexer` recomputes the seq_hash chain
//!     from the query's local hashes to verify each hit, so it gets the real tokens hashes
//!     in events, and each query is translated to its tokens hashes through a
//!     [`LocalQueries`] table (one lookup per query, keyed by the query's last seq_hash,
//!     which names its whole prefix) built from the tokens hashes the plan keeps for its
//!     queries, before the first run, outside every timed window and every
//!     resident-memory difference.
//!
//!   Either way, workloads whose engine hashes are not seq_hashes cannot be driven this way.
//! * `OverlapScores.scores` -> [`Matches::from_overlaps`].
//!
//! # Visibility
//! `apply_event` on Dynamo's thread pool only enqueues (`enqueue_event`). `apply_all` and
//! `mixed` enqueue every event and then await `ThreadPoolIndexer::flush_and_wait`, Dynamo's
//! FIFO barrier: it returns once every event thread has processed every task queued
//! before it, so all events are applied and visible to `find_matches` when they return.
//! The clock runs until the barrier returns.
//!
//! # Counting
//! Dynamo's event threads log and drop an event they cannot apply; nothing returns it to
//! the caller, so `anomalies` only counts events the pool refused to enqueue. Live
//! entries come from Dynamo's own `dump_events` (the tree rebuilt as stored events; one
//! entry per block per worker), read between phases as the harness allows.

use anyhow::{Context, Result, anyhow};
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer};
use engine::event::KvEvent;
use engine::{DpRank, Matches, SeqHash, WorkerId, WorkerKey};
use lab::driver::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    callers::run_callers, concurrent_mixed, round_robin,
};
use lab::workload::anchor::AnchorPlan;
use lab::workload::{EventStream, Query};
use std::collections::HashMap;
use std::sync::Arc;

/// Event threads of Dynamo's pool: one per core of this 2-core machine, as kvengine's
/// hosted runtime uses 2 cores.
pub const DEFAULT_EVENT_THREADS: usize = 2;

/// Dynamo's block size does not enter the tree (events carry hashes); it is what the
/// pool's constructor asks for.
const BLOCK_SIZE: u32 = 16;

/// `PositionalIndexer`'s jump size (blocks skipped between probes on a match).
pub const POSITIONAL_JUMP: usize = 32;

/// How kvengine's hashes become Dynamo's `LocalBlockHash`es (module docs, "Mapping").
#[derive(Clone, Debug)]
pub enum Keys {
    /// Each block's seq_hash stands for its local hash, in events and queries.
    SeqAsLocal,
    /// Events carry the real tokens hashes; queries are translated through the table.
    Tokens(Arc<LocalQueries>),
}

/// Every query of a plan as Dynamo's `LocalBlockHash` list, keyed by its last seq_hash.
#[derive(Debug, Default)]
pub struct LocalQueries(HashMap<u64, Arc<[LocalBlockHash]>>);

impl LocalQueries {
    /// The hit and prefix-only queries of `plan` with the tokens hashes the plan keeps for
    /// them (`AnchorPlan::hit_tokens`, `prefix_tokens`).
    pub fn of(plan: &AnchorPlan) -> Self {
        let queries = plan.hit_queries.iter().zip(&plan.hit_tokens);
        let prefixes = plan.prefix_queries.iter().zip(&plan.prefix_tokens);
        let mut table = HashMap::new();
        for (q, tokens) in queries.chain(prefixes) {
            let Some(last) = q.last() else { continue };
            let local: Arc<[LocalBlockHash]> = tokens.iter().map(|t| LocalBlockHash(t.0)).collect();
            table.insert(last.0, local);
        }
        Self(table)
    }

    fn get(&self, seqs: &[SeqHash]) -> Option<&[LocalBlockHash]> {
        let last = seqs.last()?;
        self.0
            .get(&last.0)
            .map(|l| &l[..])
            .filter(|l| l.len() == seqs.len())
    }
}

/// Which Dynamo backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `ConcurrentRadixTreeCompressed`.
    Crtc,
    /// `PositionalIndexer` (jump [`POSITIONAL_JUMP`]).
    Positional,
}

/// One of Dynamo's indexers in its thread pool.
pub struct DynamoUnderTest<T: SyncIndexer> {
    name: &'static str,
    keys: Keys,
    pool: ThreadPoolIndexer<T>,
    threads: usize,
    rt: tokio::runtime::Runtime,
    next_event_id: u64,
    refused: u64,
}

impl<T: SyncIndexer> std::fmt::Debug for DynamoUnderTest<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoUnderTest")
            .field("name", &self.name)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// Dynamo's CRTC with `threads` event threads.
pub fn crtc(threads: usize) -> Result<Box<dyn IndexerUnderTest>> {
    Ok(Box::new(DynamoUnderTest::new(
        "dynamo-crtc",
        ConcurrentRadixTreeCompressed::new(),
        Keys::SeqAsLocal,
        threads,
    )?))
}

/// Dynamo's positional indexer with `threads` event threads, its queries translated
/// through `queries`.
pub fn positional(threads: usize, queries: Arc<LocalQueries>) -> Result<Box<dyn IndexerUnderTest>> {
    Ok(Box::new(DynamoUnderTest::new(
        "dynamo-positional",
        PositionalIndexer::new(POSITIONAL_JUMP),
        Keys::Tokens(queries),
        threads,
    )?))
}

impl<T: SyncIndexer> DynamoUnderTest<T> {
    fn new(name: &'static str, backend: T, keys: Keys, threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        // Waiting on Dynamo's barriers needs an executor; the pool's event threads are its own.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building the tokio runtime that awaits Dynamo's barriers")?;
        let pool = {
            let _enter = rt.enter();
            ThreadPoolIndexer::new(backend, threads, BLOCK_SIZE)
        };
        Ok(Self {
            name,
            keys,
            pool,
            threads,
            rt,
            next_event_id: 0,
            refused: 0,
        })
    }

    /// Enqueues every event of `streams` (one from each stream in turn), then waits on
    /// Dynamo's flush barrier (module docs, "Visibility").
    fn enqueue_and_flush(&mut self, streams: &[EventStream]) -> Result<()> {
        let mut refused = 0u64;
        let mut id = self.next_event_id;
        let tokens = matches!(self.keys, Keys::Tokens(_));
        for (key, ev) in round_robin(streams) {
            id += 1;
            if self
                .pool
                .enqueue_event(router_event(*key, ev, id, tokens))
                .is_err()
            {
                refused += 1;
            }
        }
        self.next_event_id = id;
        self.refused += refused;
        self.rt
            .block_on(self.pool.flush_and_wait())
            .map_err(|e| anyhow!("{}: flush barrier: {e}", self.name))
    }
}

/// kvengine's event as Dynamo's (module docs, "Mapping"): blocks carry their tokens hash
/// as local hash when `tokens`, else their seq_hash (= engine hash).
pub fn router_event(key: WorkerKey, ev: &KvEvent, event_id: u64, tokens: bool) -> RouterEvent {
    let data = match ev {
        KvEvent::Stored { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.engine_hash.0),
                    tokens_hash: LocalBlockHash(if tokens {
                        b.tokens_hash.0
                    } else {
                        b.engine_hash.0
                    }),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        KvEvent::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks
                .iter()
                .map(|b| ExternalSequenceBlockHash(b.0))
                .collect(),
        }),
        KvEvent::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(
        key.worker.0,
        KvCacheEvent {
            event_id,
            data,
            dp_rank: key.dp_rank.0,
        },
    )
}

/// One query through Dynamo's inline read path (what `ThreadPoolIndexer::find_matches`
/// runs on the caller's thread), mapped back to kvengine's answer.
fn find<T: SyncIndexer>(backend: &T, keys: &Keys, seqs: &[SeqHash]) -> Matches {
    let translated = match keys {
        Keys::Tokens(table) => table.get(seqs),
        Keys::SeqAsLocal => None,
    };
    let scores = match translated {
        Some(local) => backend.find_matches(local, false),
        None => {
            let local: Vec<LocalBlockHash> = seqs.iter().map(|s| LocalBlockHash(s.0)).collect();
            backend.find_matches(&local, false)
        }
    };
    Matches::from_overlaps(scores.scores.iter().map(|(w, &o)| (key_of(*w), o)))
}

/// Dynamo's worker and dp rank as kvengine's worker key.
pub(crate) fn key_of(w: WorkerWithDpRank) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w.worker_id),
        dp_rank: DpRank(w.dp_rank),
    }
}

impl<T: SyncIndexer> IndexerUnderTest for DynamoUnderTest<T> {
    fn name(&self) -> String {
        format!("{}(event-threads={})", self.name, self.threads)
    }

    fn cores(&self) -> usize {
        self.threads
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        self.enqueue_and_flush(streams)
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        Ok(find(self.pool.backend(), &self.keys, seqs))
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        _plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        let backend = self.pool.backend_arc();
        let keys = self.keys.clone();
        let ((), outcome) = concurrent_mixed(
            std::iter::repeat(()),
            queries,
            || self.enqueue_and_flush(streams),
            |(), q| {
                std::hint::black_box(find(&*backend, &keys, q));
                Ok(())
            },
        )?;
        Ok(outcome)
    }

    fn mixed_mode(&self) -> MixedMode {
        MixedMode::Concurrent
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        let mut shared = vec![(self.pool.backend(), &self.keys); lists.len()];
        run_callers(&mut shared, lists, keep, |(b, keys), q| {
            Ok(find(*b, keys, q))
        })
    }

    fn max_callers(&self) -> usize {
        usize::MAX
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        dump_stats(
            self.rt.block_on(self.pool.dump_events()),
            self.name,
            self.refused,
        )
    }
}

/// A Dynamo indexer's figures from its `dump_events`: live (block, worker) entries are
/// the blocks of its stored events (one per block per worker); it reports no bytes.
pub(crate) fn dump_stats(
    dump: std::result::Result<Vec<RouterEvent>, dynamo_kv_router::indexer::KvRouterError>,
    name: &str,
    anomalies: u64,
) -> Result<IndexerStats> {
    let dump = dump.map_err(|e| anyhow!("{name}: dump_events: {e}"))?;
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
        anomalies,
    })
}

/// Builds `backend` with `threads` event threads (`queries`: the positional indexer's
/// query table).
pub fn build(
    backend: Backend,
    threads: usize,
    queries: &Arc<LocalQueries>,
) -> Result<Box<dyn IndexerUnderTest>> {
    match backend {
        Backend::Crtc => crtc(threads),
        Backend::Positional => positional(threads, Arc::clone(queries)),
    }
}
