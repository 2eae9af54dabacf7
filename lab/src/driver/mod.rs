//! What the harness drives: the [`IndexerUnderTest`] trait and its single-threaded
//! implementations.
//!
//! The harness runs the same phases on any indexer: bulk event application from several
//! producer streams, single queries, and a mixed phase where events and queries run at the
//! same time. A threaded runtime runs producers and query threads concurrently; a
//! single-threaded index interleaves them ([`interleaved_mixed`] does that for any
//! [`StepIndexer`]).
//!
//! * [`kv_index::KvIndexUnderTest`]: the one-shard [`engine::kv_index::KvIndex`] (1 core).
//! * [`sharded::ShardedUnderTest`]: [`engine::sharding::sharded::ShardedIndex`] with the
//!   fixed-depth policy, N shards in one thread (for `shard_balance`; `cores` = shards).
//! * [`runtime::RuntimeUnderTest`]: the threaded runtime, N pinned shard threads fed by
//!   producer threads over SPSC rings (`cores` = shard threads).
//! * [`hosted::HostedUnderTest`]: the same runtime with its cores hosted on N threads of the
//!   driver, each applying its producer streams and issuing its queries through its core
//!   (`cores` = threads).
//!
//! [`IndexerUnderTest::query_callers`] runs K concurrent query callers on a quiet index
//! ([`callers`]): the single-threaded indexes are `Sync` and share `&index` across K scoped
//! threads; the runtime gives each caller its own query handle.
//!
//! # Invariants (every implementation MUST keep them)
//! 1. When `apply_all` or `mixed` returns `Ok`, every event of every stream has been
//!    applied and is visible to the next `query`.
//! 2. Events of one stream are applied in stream order; streams share no worker (the
//!    workload guarantees it), so their relative order is free.
//! 3. A refused event, or a removal of a block the worker does not hold, is a bug of the
//!    workload or of the indexer: it is counted in [`IndexerStats::anomalies`] (or
//!    returned as an error), never silently dropped.
//! 4. `stats` is called only between phases; its cost is never timed.
//!
//! # Concurrency
//! The harness calls every method from one thread, one call at a time (`&mut self`). An
//! implementation may run its own threads inside a call; they must be quiescent (all
//! events applied, all queries answered) when the call returns.

pub mod callers;
pub mod hosted;
pub mod kv_index;
pub mod runtime;
pub mod sharded;

pub use callers::{AnswerSummary, CallersOutcome};

use crate::workload::{EventStream, Query};
use anyhow::Result;
use engine::event::KvEvent;
use engine::{Matches, SeqHash, WorkerKey};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Knobs of the mixed phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MixedPlan {
    /// Single-threaded implementations issue one query after this many events (one
    /// request's worth: a store and, later, its eviction). Threaded implementations ignore
    /// it and run their query threads closed-loop.
    pub events_per_query: usize,
}

impl Default for MixedPlan {
    fn default() -> Self {
        Self {
            events_per_query: 2,
        }
    }
}

impl MixedPlan {
    /// One query after every `events_per_query` events (at least 1).
    pub fn with_events_per_query(events_per_query: usize) -> Self {
        Self {
            events_per_query: events_per_query.max(1),
        }
    }
}

/// How [`IndexerUnderTest::mixed`] overlaps events and queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MixedMode {
    /// One thread: a query after every `events_per_query` events ([`interleaved_mixed`]).
    Interleaved,
    /// Producer threads apply events while query threads run closed-loop beside them.
    Concurrent,
}

/// What a mixed phase measured.
#[derive(Clone, Debug)]
pub struct MixedOutcome {
    /// From the start of the call until every stream was applied.
    pub elapsed: Duration,
    /// Latency of every query answered while the streams were being applied, in
    /// nanoseconds (see [`latency_histogram`]).
    pub latencies_ns: Histogram<u64>,
}

/// An indexer the harness can drive. See the module docs for the invariants
/// implementations MUST keep.
pub trait IndexerUnderTest {
    /// A short description for the report (`"kv-index"`, `"sharded-st(shards=2, ...)"`).
    fn name(&self) -> String;

    /// Shards / cores in use (reported as `cores`).
    fn cores(&self) -> usize;

    /// Applies every event of `streams` (`streams[i]`: everything producer `i` sends, in
    /// order) and returns when all are applied and visible to queries.
    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()>;

    /// One query; returns its overlaps (an error only if the indexer can no longer
    /// answer, e.g. a stopped runtime).
    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches>;

    /// Applies `streams` as [`IndexerUnderTest::apply_all`] does while queries run: query
    /// thread `t` issues `queries[t]` in order, cyclically, until every stream is applied
    /// (a single-threaded implementation interleaves one query after every
    /// `plan.events_per_query` events; a threaded one runs one closed-loop query thread per
    /// list, concurrently with one producer per stream). Returns the time until every
    /// stream was applied and the latency of every query answered meanwhile; empty lists
    /// issue nothing.
    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        plan: &MixedPlan,
    ) -> Result<MixedOutcome>;

    /// How [`IndexerUnderTest::mixed`] runs events and queries together.
    fn mixed_mode(&self) -> MixedMode;

    /// Runs `lists[c]` on caller `c`, K = `lists.len()` callers at once, on the quiet
    /// index (no events meanwhile); keeps every whole answer when `keep`. The caller
    /// guarantees K is at most [`IndexerUnderTest::max_callers`]; the implementation MUST
    /// run the K callers concurrently (one in the calling thread when K = 1), each on its
    /// own thread and query path, and return per caller its latencies, answer summaries
    /// and (if kept) answers in list order (see [`callers`]).
    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome>;

    /// Most concurrent callers [`IndexerUnderTest::query_callers`] supports.
    fn max_callers(&self) -> usize;

    /// Sizes and counters now (between phases; not timed).
    fn stats(&mut self) -> Result<IndexerStats>;
}

/// What an indexer reports between phases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexerStats {
    /// Live (block, worker) entries: each pair once, however many shards replicate it.
    pub live_entries: u64,
    /// Heap bytes of index and worker directories, over all shards.
    pub bytes: usize,
    /// Block operations each shard has applied so far (replicated blocks count in every
    /// shard that applies them); one element per shard.
    pub shard_ops: Vec<u64>,
    /// Refused events, removals of unheld blocks and shard inconsistencies so far; a
    /// correct run keeps it at 0.
    pub anomalies: u64,
}

impl IndexerStats {
    /// Block operations each shard applied since `before` (shards `before` did not know
    /// start at 0).
    pub fn shard_ops_since(&self, before: &IndexerStats) -> Vec<u64> {
        self.shard_ops
            .iter()
            .zip(before.shard_ops.iter().chain(std::iter::repeat(&0)))
            .map(|(now, then)| now.saturating_sub(*then))
            .collect()
    }
}

/// A latency histogram in nanoseconds, 1 ns to 1 hour, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("constant bounds are valid")
}

/// An index applied one event and one query at a time, in the caller's thread.
pub trait StepIndexer {
    /// Applies one event. Anomalies are counted by the implementation (invariant 3).
    fn apply_one(&mut self, key: WorkerKey, event: &KvEvent);

    /// Answers one query.
    fn query_one(&self, seqs: &[SeqHash]) -> Matches;
}

/// Every event of `streams`, one from each stream in turn (streams share no worker, so
/// this is a valid global order; it is how concurrent producers would interleave).
pub fn round_robin(streams: &[EventStream]) -> impl Iterator<Item = &(WorkerKey, KvEvent)> {
    let mut pos = vec![0usize; streams.len()];
    let mut next = 0usize;
    let mut remaining: usize = streams.iter().map(|s| s.len()).sum();
    std::iter::from_fn(move || {
        while remaining > 0 {
            let i = next;
            next = (next + 1) % streams.len();
            if let (Some(s), Some(p)) = (streams.get(i), pos.get_mut(i))
                && let Some(item) = s.get(*p)
            {
                *p += 1;
                remaining -= 1;
                return Some(item);
            }
        }
        None
    })
}

/// [`IndexerUnderTest::apply_all`] for a [`StepIndexer`].
pub fn apply_streams<S: StepIndexer>(ix: &mut S, streams: &[EventStream]) {
    if let [only] = streams {
        for (key, ev) in only.iter() {
            ix.apply_one(*key, ev);
        }
    } else {
        for (key, ev) in round_robin(streams) {
            ix.apply_one(*key, ev);
        }
    }
}

/// [`IndexerUnderTest::mixed`] for a [`StepIndexer`]: one query after every
/// `plan.events_per_query` events, taking query lists in turn and each list cyclically.
pub fn interleaved_mixed<S: StepIndexer>(
    ix: &mut S,
    streams: &[EventStream],
    queries: &[Vec<Query>],
    plan: &MixedPlan,
) -> MixedOutcome {
    let lists: Vec<&Vec<Query>> = queries.iter().filter(|l| !l.is_empty()).collect();
    let mut cursors = vec![0usize; lists.len()];
    let mut list = 0usize;
    let every = plan.events_per_query.max(1);
    let mut since = 0usize;
    let mut hist = latency_histogram();
    let start = Instant::now();
    for (key, ev) in round_robin(streams) {
        ix.apply_one(*key, ev);
        since += 1;
        if since < every || lists.is_empty() {
            continue;
        }
        since = 0;
        let (Some(l), Some(c)) = (lists.get(list), cursors.get_mut(list)) else {
            continue;
        };
        let Some(q) = l.get(*c) else { continue };
        *c = (*c + 1) % l.len();
        list = (list + 1) % lists.len();
        let t = Instant::now();
        black_box(ix.query_one(black_box(q)));
        hist.saturating_record(t.elapsed().as_nanos() as u64);
    }
    MixedOutcome {
        elapsed: start.elapsed(),
        latencies_ns: hist,
    }
}

/// [`IndexerUnderTest::mixed`] for an indexer read while it is written: `queries[i]` is
/// issued cyclically, closed loop, on a thread of its own with the i-th of `readers`
/// (empty lists get no thread), while `apply` runs in the calling thread. The elapsed time
/// is `apply`'s. Returns only once `apply` returned and every query thread stopped (a
/// thread stops at the first query it would issue after that); a query's error, then
/// `apply`'s, is the result's.
pub fn concurrent_mixed<R: Send, T>(
    readers: impl IntoIterator<Item = R>,
    queries: &[Vec<Query>],
    apply: impl FnOnce() -> Result<T>,
    query: impl Fn(&mut R, &Query) -> Result<()> + Sync,
) -> Result<(T, MixedOutcome)> {
    let done = std::sync::atomic::AtomicBool::new(false);
    let (done, query) = (&done, &query);
    std::thread::scope(|s| {
        let threads: Vec<_> = readers
            .into_iter()
            .zip(queries)
            .filter(|(_, list)| !list.is_empty())
            .map(|(mut reader, list)| {
                s.spawn(move || -> Result<_> {
                    let mut hist = latency_histogram();
                    for q in list.iter().cycle() {
                        if done.load(std::sync::atomic::Ordering::Acquire) {
                            break;
                        }
                        let t = Instant::now();
                        query(&mut reader, black_box(q))?;
                        hist.saturating_record(t.elapsed().as_nanos() as u64);
                    }
                    Ok(hist)
                })
            })
            .collect();
        let start = Instant::now();
        let applied = apply();
        let elapsed = start.elapsed();
        done.store(true, std::sync::atomic::Ordering::Release);
        let mut latencies_ns = latency_histogram();
        for t in threads {
            let h = t
                .join()
                .map_err(|_| anyhow::anyhow!("a query thread panicked"))??;
            latencies_ns
                .add(&h)
                .map_err(|e| anyhow::anyhow!("merging latency histograms: {e}"))?;
        }
        Ok((
            applied?,
            MixedOutcome {
                elapsed,
                latencies_ns,
            },
        ))
    })
}

/// `busiest shard's share of operations / (1 / shards)`: 1.0 is perfect balance, `shards`
/// is everything on one shard. 1.0 when nothing was applied.
pub fn shard_balance(ops: &[u64]) -> f64 {
    let total: u64 = ops.iter().sum();
    let max = ops.iter().copied().max().unwrap_or(0);
    if total == 0 {
        1.0
    } else {
        max as f64 * ops.len() as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn round_robin_takes_one_from_each_stream_in_turn() {
        let ev = |w| (WorkerKey::new(w, 0), KvEvent::Cleared);
        let a: EventStream = Arc::from(vec![ev(0), ev(2), ev(4)]);
        let b: EventStream = Arc::from(vec![ev(1)]);
        let c: EventStream = Arc::from(Vec::new());
        let order: Vec<u64> = round_robin(&[a, b, c]).map(|(k, _)| k.worker.0).collect();
        assert_eq!(order, vec![0, 1, 2, 4]);
        assert_eq!(round_robin(&[]).count(), 0);
    }

    #[test]
    fn balance_is_max_share_over_fair_share() {
        assert_eq!(shard_balance(&[5, 5]), 1.0);
        assert_eq!(shard_balance(&[10, 0]), 2.0);
        assert_eq!(shard_balance(&[3]), 1.0);
        assert_eq!(shard_balance(&[0, 0]), 1.0);
        assert!((shard_balance(&[6, 4]) - 1.2).abs() < 1e-12);
    }
}
