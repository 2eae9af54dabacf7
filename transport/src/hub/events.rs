//! The facade's event stage: a batch of KV events from any source (ZMQ, QUIC, HTTP,
//! TensorRT-LLM) passes the [`IngestGate`](super::IngestGate) (counted; stores refused
//! while the index is over budget) and goes to the engine through the worker's one ingest
//! path (the hub's invariants 1, 2, 5 and 7); clears, resyncs and trust for the streams;
//! the engine's figures and snapshot.

use super::engine_link::Batch;
use super::{Feed, Hub};
use crate::bounds::Degraded;
use crate::cores;
use crate::error::{Result, TransportError};
use engine::directories::Applied;
use engine::event::KvEvent;
use engine::runtime::CoreSummary;
use engine::snapshot::{EngineImage, StreamMark};
use engine::{EngineError, WorkerId, WorkerKey};

impl Hub {
    pub(super) fn refuse_events_if_approximate(&self) -> Result<()> {
        match self.approximate {
            false => Ok(()),
            true => Err(TransportError::Invalid {
                name: "events",
                reason: "KV events are disabled on this router (--no-kv-events)".into(),
            }),
        }
    }

    /// Hands `events` of `key` to the engine without waiting for them to apply (the engine
    /// counts its refusals); its stores are refused while the index is over its budget
    /// ([`crate::bounds`]). Fails for unregistered workers.
    pub fn ingest(&self, key: WorkerKey, events: Vec<KvEvent>) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        self.hand_over(key, events, None)
    }

    /// Like [`Hub::ingest`] for batch `seq` of `key.worker`'s numbered stream (its ZMQ
    /// stream), whose bytes had `digest` (the stream's `BatchId::digest`; `None` where the
    /// source has none): the engine records both with the events, so a snapshot holds a
    /// batch exactly when it holds its number, and a restart can check that the publisher
    /// still has that very batch. Sent even with no events (the number is still taken).
    pub fn ingest_marked(
        &self,
        key: WorkerKey,
        events: Vec<KvEvent>,
        seq: u64,
        digest: Option<u64>,
    ) -> Result<()> {
        self.hand_over(key, events, Some((seq, digest)))
    }

    /// A feed of `worker` for one event source ([`Feed`]), up to date.
    pub fn feed(&self, worker: WorkerId) -> Feed {
        let mut feed = Feed::new(worker);
        self.refresh_feed(&mut feed);
        feed
    }

    /// Brings `feed` up to date with the registry (one atomic load while nothing changed):
    /// its block size is then the one to convert the next batch at.
    pub fn refresh_feed(&self, feed: &mut Feed) {
        self.registry.refresh(feed, self.block_size());
    }

    /// [`Hub::ingest_marked`] for the source that keeps `feed`: a batch of a rank the feed
    /// knows is admitted without a registry visit (the count is the batch's only one).
    pub fn ingest_fed(
        &self,
        feed: &mut Feed,
        dp_rank: engine::DpRank,
        events: Vec<KvEvent>,
        seq: u64,
        digest: Option<u64>,
    ) -> Result<()> {
        self.refresh_feed(feed);
        let key = WorkerKey {
            worker: feed.worker(),
            dp_rank,
        };
        let known = feed.knows(dp_rank);
        self.hand_over_as(key, events, Some((seq, digest)), known)
    }

    fn hand_over(
        &self,
        key: WorkerKey,
        events: Vec<KvEvent>,
        seq: Option<(u64, Option<u64>)>,
    ) -> Result<()> {
        self.hand_over_as(key, events, seq, false)
    }

    /// `admitted`: the caller's feed knows the key as registered now.
    fn hand_over_as(
        &self,
        key: WorkerKey,
        mut events: Vec<KvEvent>,
        seq: Option<(u64, Option<u64>)>,
        admitted: bool,
    ) -> Result<()> {
        self.refuse_events_if_approximate()?;
        if !admitted {
            self.admit(key)?;
        }
        // A batch with a digest comes from a ZMQ stream, whose subscriber decides when its
        // ranks are trusted again (invariant 7).
        let proves_continuity = !matches!(seq, Some((_, Some(_))));
        let counted = self.gate.count(
            &self.registry,
            &self.metrics,
            key,
            &events,
            self.gate.full(),
            proves_continuity,
        );
        if counted.refused > 0 {
            events.retain(|e| !matches!(e, KvEvent::Stored { .. }));
        }
        if events.is_empty() && seq.is_none() {
            return Ok(());
        }
        let batch: Batch = events.into_iter().map(|e| (key, e)).collect();
        let mark = seq.map(|(seq, digest)| StreamMark {
            worker: key.worker,
            stream: 0,
            seq,
            digest,
        });
        self.engine.send(key.worker, &batch, mark)
    }

    /// Applies `events` of `key` one by one and waits for each result (the HTTP events
    /// endpoint reports them), then until every shard has its share: a query made after
    /// this returns sees the batch. While the index is over its budget each store is
    /// refused with [`EngineError::IndexFull`] without reaching the engine. Fails only for
    /// unregistered workers or a stopped (or timed-out) engine.
    pub fn apply(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
    ) -> Result<Vec<std::result::Result<Applied, EngineError>>> {
        self.refuse_events_if_approximate()?;
        self.admit(key)?;
        let full = self.gate.full();
        self.gate
            .count(&self.registry, &self.metrics, key, events, full, true);
        let out = self.engine.apply_all(key, events, full)?;
        if out
            .iter()
            .any(|r| matches!(r, Err(EngineError::WorkerFull { .. })))
        {
            // Until the next refresh of the cached-block totals finds it below its cap.
            self.registry.mark_degraded(key, Degraded::WorkerFull);
        }
        Ok(out)
    }

    /// Drops every block of `key` (a publisher restarted). Its blocks being gone, nothing
    /// of it is left to distrust.
    pub fn clear(&self, key: WorkerKey) -> Result<usize> {
        self.admit(key)?;
        let n = self.engine.clear(key)?;
        self.gate.trust(key);
        Ok(n)
    }

    /// Clears `key` because its stream could not be repaired and marks it resyncing until
    /// its next batch applies.
    pub fn resync(&self, key: WorkerKey) -> Result<usize> {
        let n = self.clear(key)?;
        self.metrics
            .resyncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.registry.mark_resyncing(key);
        Ok(n)
    }

    /// Routes `key` as uncached (overlap 0, shown resyncing) while keeping its blocks, until
    /// [`Hub::trust`], a clear or its next applied batch (invariant 7). Works for keys not
    /// registered yet (a restore runs before registration).
    pub fn distrust(&self, key: WorkerKey) {
        self.gate.distrust(key);
    }

    /// `key`'s stream proved continuity: its blocks count again.
    pub fn trust(&self, key: WorkerKey) {
        self.gate.trust(key);
    }

    /// Drops every block of `worker` from the index, registered or not (a restored
    /// snapshot's workers that are gone, or whose streams cannot be resumed).
    pub fn forget_index(&self, worker: WorkerId) -> Result<usize> {
        let n = self.engine.remove_worker(worker)?;
        self.gate.forget_worker(worker);
        Ok(n)
    }

    /// The engine at a consistent cut (see `engine::snapshot`). Blocks until every core
    /// answered (up to the engine's sync timeout): call it from a thread that is not a
    /// core's (`spawn_blocking`), or the core it would block could not take part.
    pub fn snapshot_engine(&self) -> Result<EngineImage> {
        self.engine.snapshot()
    }

    /// Waits until everything handed to the engine so far is applied: by any thread, with
    /// cores on threads of their own; on hosted cores, by this thread's core and by the
    /// threads that are not cores (another core's events are ordered only by that core).
    pub fn sync(&self) -> Result<()> {
        self.engine.sync()
    }

    /// Every core's figures (index size, refusals, queries). Each reading is also checked
    /// against the index's memory budget ([`crate::bounds`]).
    pub fn core_stats(&self) -> Result<Vec<CoreSummary>> {
        let stats = self.engine.core_stats()?;
        let bytes: usize = stats
            .iter()
            .map(|c| c.index.bytes.saturating_add(c.directory_bytes))
            .sum();
        let budget = &self.gate.budget;
        let was_full = budget.is_full();
        let reading = budget.observe(bytes as u64);
        if reading.full != was_full {
            match reading.full {
                true => tracing::warn!(
                    bytes,
                    budget = budget.limit(),
                    "the index is over --max-index-bytes: refusing stores until it is not"
                ),
                false => tracing::info!(bytes, "the index is within its budget again"),
            }
        }
        if reading.release {
            cores::request_memory_release();
        }
        Ok(stats)
    }

    /// Refreshes the per-key cached-block totals the scheduler breaks ties with (called
    /// periodically, off the routing path).
    pub fn refresh_cached_blocks(&self) -> Result<()> {
        let keys = self.registry.keys();
        let mut fresh = Vec::with_capacity(keys.len());
        for key in keys {
            fresh.push((key, self.engine.cached_blocks(key)?));
        }
        if self.limits.max_blocks_per_key.is_some() {
            let mut registry = self.registry.write();
            for &(k, n) in &fresh {
                if let Some(e) = registry.get_mut(&k.worker) {
                    let mark = (k.dp_rank, Degraded::WorkerFull);
                    match self.limits.at_block_cap(n) {
                        true => e.degraded.insert(mark),
                        false => e.degraded.remove(&mark),
                    };
                }
            }
        }
        self.routing.set_cached_blocks(fresh);
        Ok(())
    }
}
