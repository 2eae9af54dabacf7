//! The ingest gate: what every batch of KV events passes before it reaches the engine.
//!
//! It counts the batch (router totals and the worker's entry), refuses its stores while
//! the index is over its memory budget ([`crate::bounds`]), and keeps the *unverified*
//! worker keys: keys whose blocks are kept but route as uncached until their stream
//! proves continuity (restored from a snapshot, or reconnected: the hub's invariant 7).
//!
//! # Invariants
//! 1. While the budget is full no store of a batch is handed on; each refused store is
//!    counted as an `index_full` drop and its rank marked degraded, until a batch of its
//!    stores is accepted again.
//! 2. A key is unverified from [`IngestGate::distrust`] until [`IngestGate::trust`], a
//!    clear, or a counted batch that proves its stream continues; its overlaps are
//!    removed from every answer meanwhile (`IngestGate::filter`).
//!
//! # Concurrency
//! The unverified keys sit behind a mutex (level 3 of [`super::lock_order`]) with an
//! atomic "any" flag, so a query pays one atomic load while no key is unverified. The
//! budget is atomics. Counting a batch takes the registry's write lock once.

use super::lock_order::{Level, lock};
use super::registry::Registry;
use crate::bounds::{Degraded, IndexBudget};
use crate::error::DropReason;
use crate::metrics::Metrics;
use engine::event::KvEvent;
use engine::{DpRank, Matches, WorkerId, WorkerKey};
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// See the module docs.
#[derive(Debug, Default)]
pub struct IngestGate {
    /// The index's memory budget and its last reading.
    pub(super) budget: IndexBudget,
    unverified: Unverified,
}

/// Worker keys routed as uncached until their stream proves continuity. One atomic load
/// per query while there are none.
#[derive(Debug, Default)]
struct Unverified {
    any: AtomicBool,
    keys: Mutex<BTreeSet<WorkerKey>>,
}

/// What counting one batch decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counted {
    /// Stores refused (the budget is full): the caller drops them from the batch.
    pub refused: u64,
}

impl IngestGate {
    /// A gate with `budget`.
    pub(super) fn new(budget: IndexBudget) -> Self {
        Self {
            budget,
            unverified: Unverified::default(),
        }
    }

    /// Whether the index is over its budget now.
    pub(super) fn full(&self) -> bool {
        self.budget.is_full()
    }

    /// Routes `key` as uncached until trusted (invariant 2).
    pub fn distrust(&self, key: WorkerKey) {
        let mut keys = lock(Level::Unverified, &self.unverified.keys);
        keys.insert(key);
        self.unverified.any.store(true, Relaxed);
    }

    /// `key`'s blocks count again.
    pub fn trust(&self, key: WorkerKey) {
        if !self.unverified.any.load(Relaxed) {
            return;
        }
        let mut keys = lock(Level::Unverified, &self.unverified.keys);
        keys.remove(&key);
        self.unverified.any.store(!keys.is_empty(), Relaxed);
    }

    /// Forgets every key of `worker` (removed, or its blocks dropped).
    pub(super) fn forget_worker(&self, worker: WorkerId) {
        if !self.unverified.any.load(Relaxed) {
            return;
        }
        let mut keys = lock(Level::Unverified, &self.unverified.keys);
        keys.retain(|k| k.worker != worker);
        self.unverified.any.store(!keys.is_empty(), Relaxed);
    }

    /// `worker`'s unverified ranks.
    pub(super) fn unverified_ranks(&self, worker: WorkerId) -> Vec<DpRank> {
        if !self.unverified.any.load(Relaxed) {
            return Vec::new();
        }
        lock(Level::Unverified, &self.unverified.keys)
            .iter()
            .filter(|k| k.worker == worker)
            .map(|k| k.dp_rank)
            .collect()
    }

    /// `matches` without the unverified keys' overlaps.
    pub(super) fn filter(&self, matches: Matches) -> Matches {
        if !self.unverified.any.load(Relaxed) {
            return matches;
        }
        let keys = lock(Level::Unverified, &self.unverified.keys);
        if !matches.overlaps.iter().any(|(k, _)| keys.contains(k)) {
            return matches;
        }
        Matches::from_overlaps(
            matches
                .overlaps
                .into_iter()
                .filter(|(k, _)| !keys.contains(k)),
        )
    }

    /// Counts the events of `key` handed on, in `metrics` and `key`'s registry entry.
    /// With `refuse_stores` its stores are not handed on (invariant 1). `proves_continuity`:
    /// the batch itself shows its stream continues (its fence accepted it and the source
    /// cannot prove more), so an unverified key is trusted again; false for ZMQ batches,
    /// whose subscriber trusts its ranks itself once a replay is applied.
    pub(super) fn count(
        &self,
        registry: &Registry,
        metrics: &Metrics,
        key: WorkerKey,
        events: &[KvEvent],
        refuse_stores: bool,
        proves_continuity: bool,
    ) -> Counted {
        let (mut stored, mut removed, mut stores) = (0u64, 0u64, 0u64);
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => {
                    stores += 1;
                    stored += blocks.len() as u64;
                }
                KvEvent::Removed { blocks } => removed += blocks.len() as u64,
                KvEvent::Cleared => {}
            }
        }
        let refused = if refuse_stores { stores } else { 0 };
        let forwarded = (events.len() as u64).saturating_sub(refused);
        metrics.events_forwarded.fetch_add(forwarded, Relaxed);
        metrics
            .blocks_stored
            .fetch_add(if refuse_stores { 0 } else { stored }, Relaxed);
        metrics.blocks_removed.fetch_add(removed, Relaxed);
        if refused > 0 {
            let why = format!(
                "worker {} rank {}: the index is over --max-index-bytes ({} bytes)",
                key.worker,
                key.dp_rank,
                self.budget.bytes()
            );
            metrics.drop_input(DropReason::IndexFull, refused, &why);
        }
        let mut map = registry.write();
        if let Some(e) = map.get_mut(&key.worker) {
            e.events += forwarded;
            e.resyncing.remove(&key.dp_rank);
            if proves_continuity {
                // A batch its stream's fence accepted: the stream continues.
                self.trust(key);
            }
            let mark = (key.dp_rank, Degraded::IndexFull);
            if refused > 0 {
                e.degraded.insert(mark);
            } else if stores > 0 {
                e.degraded.remove(&mark);
            }
        }
        Counted { refused }
    }
}
