//! [`IndexerUnderTest`] for the thread-per-core runtime ([`engine::runtime`]): core threads
//! (each ingests its own workers' events and owns a shard) fed by one ingest handle per
//! producer thread, and one query handle per query thread.
//!
//! `cores` is the number of core threads. A producer only forwards shared slices of its
//! pre-generated stream (the cores do the work); query threads run beside the cores (on a
//! machine with as many CPUs as cores they share CPUs with them; the report states the
//! thread counts).
//!
//! # Invariants
//! 1. Producer `i` sends stream `i` through ingest handle `i`; `apply_all` and `mixed`
//!    return only after every handle has synced, so every event is applied and visible to
//!    the next query (driver invariant 1).
//! 2. Query handle 0 serves the harness's own single queries and `stats`; mixed-phase query
//!    thread `t` uses handle `t + 1`; `query_callers` caller `c` uses handle `c` (so it
//!    supports as many callers as there are handles: mixed query threads + 1).
//! 3. Dropping the driver closes every handle and joins the shards.

use super::{CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan};
use crate::workload::{EventStream, Query};
use anyhow::{Context, Result, bail};
use engine::runtime::{IngestHandle, QueryHandle, Runtime, RuntimeConfig, start};
use engine::sharding::ShardPolicy;
use engine::sharding::choice::Sharding;
use engine::{Matches, SeqHash};
use std::hint::black_box;

/// The runtime with its handles.
#[derive(Debug)]
pub struct RuntimeUnderTest {
    runtime: Option<Runtime>,
    ingest: Vec<IngestHandle>,
    query: Vec<QueryHandle<Sharding>>,
    shards: usize,
    sharding: String,
    anomalies: u64,
}

impl RuntimeUnderTest {
    /// One shard thread per shard of `sharding` (pinned if `pin`), `producers` ingest
    /// handles and `query_threads` mixed-phase query handles.
    pub fn new(
        sharding: Sharding,
        producers: usize,
        query_threads: usize,
        pin: bool,
    ) -> Result<Self> {
        let shards = sharding.shards();
        let described = sharding.describe();
        let policy = sharding;
        let config = RuntimeConfig {
            ring_capacity: 256,
            pin_cores: pin,
            ingest_handles: producers.max(1),
            query_handles: query_threads + 1,
            ..RuntimeConfig::default()
        };
        let st = start(policy, config).context("starting the runtime")?;
        Ok(Self {
            runtime: Some(st.runtime),
            ingest: st.ingest,
            query: st.query,
            shards,
            sharding: described,
            anomalies: 0,
        })
    }

    /// Runs one producer thread per stream; returns the anomalies they saw.
    fn produce(handles: &mut [IngestHandle], streams: &[EventStream]) -> Result<u64> {
        if streams.len() > handles.len() {
            bail!(
                "{} streams but {} ingest handles",
                streams.len(),
                handles.len()
            );
        }
        std::thread::scope(|s| {
            let threads: Vec<_> = handles
                .iter_mut()
                .zip(streams)
                .map(|(h, stream)| {
                    s.spawn(move || -> Result<u64> {
                        // Refusals are counted by the cores; `stats` reads them.
                        h.send(stream)?;
                        // Until every event is applied and the trunk promotions they
                        // caused are done.
                        h.settle()?;
                        Ok(0)
                    })
                })
                .collect();
            let mut total = 0u64;
            let mut first_err = None;
            for t in threads {
                match t.join() {
                    Ok(Ok(n)) => total += n,
                    Ok(Err(e)) => first_err = first_err.or(Some(e)),
                    Err(_) => {
                        first_err = first_err.or(Some(anyhow::anyhow!("a producer panicked")))
                    }
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok(total),
            }
        })
    }
}

impl IndexerUnderTest for RuntimeUnderTest {
    fn name(&self) -> String {
        format!(
            "runtime(cores={}, {}, producers={}, query_threads={})",
            self.shards,
            self.sharding,
            self.ingest.len(),
            self.query.len().saturating_sub(1)
        )
    }

    fn cores(&self) -> usize {
        self.shards
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        self.anomalies += Self::produce(&mut self.ingest, streams)?;
        Ok(())
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        let q = self.query.first_mut().context("no query handle")?;
        Ok(q.find_matches(seqs)?)
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        _plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        let (query_handles, ingest) = (&mut self.query, &mut self.ingest);
        let (anomalies, outcome) = super::concurrent_mixed(
            query_handles.iter_mut().skip(1),
            queries,
            || Self::produce(ingest, streams),
            |h, q| {
                black_box(h.find_matches(q)?);
                Ok(())
            },
        )?;
        self.anomalies += anomalies;
        Ok(outcome)
    }

    fn mixed_mode(&self) -> MixedMode {
        MixedMode::Concurrent
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        super::callers::run_callers(&mut self.query, lists, keep, |h, q| Ok(h.find_matches(q)?))
    }

    fn max_callers(&self) -> usize {
        self.query.len()
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        let q = self.query.first_mut().context("no query handle")?;
        let cores = q.core_stats()?;
        Ok(IndexerStats {
            live_entries: cores.iter().map(|s| s.directory_entries as u64).sum(),
            bytes: cores
                .iter()
                .map(|s| s.directory_bytes + s.index.bytes)
                .sum(),
            shard_ops: cores.iter().map(|s| s.applied).collect(),
            anomalies: self.anomalies
                + cores
                    .iter()
                    .map(|s| s.inconsistencies + s.rejects.total())
                    .sum::<u64>(),
        })
    }
}

impl Drop for RuntimeUnderTest {
    fn drop(&mut self) {
        self.ingest.clear();
        self.query.clear();
        if let Some(rt) = self.runtime.take() {
            let _ = rt.join();
        }
    }
}
