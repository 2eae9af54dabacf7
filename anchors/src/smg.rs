//! SMG's event-driven KV index (`kv-index` 2.0.0, `ChainIndex`) behind
//! [`IndexerUnderTest`].
//!
//! `ChainIndex` is a library, not a service: writers call it with each worker's own lane
//! map (`ChainBlockMap`, the engine-hash directory SMG's gateway keeps per worker), readers
//! call `find_matches` concurrently without locks. Here the harness's thread is the one
//! writer lane for every worker; queries run on other threads beside it in the mixed
//! phase and on the K caller threads of `query_callers`.
//!
//! # Mapping
//! * Worker key -> SMG's interned worker id (`intern_worker("worker/dp_rank")`), mapped
//!   back through a table for answers.
//! * `Stored { parent, blocks }` -> `apply_stored(worker, blocks, parent, map)` with each
//!   block's `seq_hash` = its engine hash and `content_hash` = its seq_hash; on the anchor
//!   workloads the engine hash is the seq_hash, and every block id is distinct, so this
//!   keys the same runs as tokens hashes would (see [`crate::dynamo`], "Mapping", for
//!   why: queries are seq_hash chains). `Removed` -> `apply_removed`; `Cleared` ->
//!   `apply_cleared`.
//! * A query's seq_hashes are its `ContentHash`es; `OverlapScores.scores` (internal id ->
//!   overlap) -> [`Matches::from_overlaps`].
//!
//! # Visibility
//! Every call applies synchronously: when `apply_stored` / `apply_removed` return, the
//! change is published to readers (SMG's seqlocked runs). `apply_all` returns after the
//! last call, so everything is visible; no barrier is needed.
//!
//! # Counting
//! A store SMG refuses (`ApplyError`) counts as an anomaly. Live entries are SMG's
//! `current_size` (blocks held, a block two workers hold counting twice); bytes are its
//! arena and run-slab chunks.

use crate::common::worker_name;
use anyhow::{Result, anyhow};
use engine::event::KvEvent;
use engine::{Matches, SeqHash, WorkerKey};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use lab::driver::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    callers::run_callers, concurrent_mixed, round_robin,
};
use lab::workload::{EventStream, Query};
use std::collections::HashMap;

/// SMG's `ChainIndex`, written from the harness's thread.
#[derive(Default)]
pub struct SmgUnderTest {
    index: ChainIndex,
    lanes: Lanes,
}

/// The writer side: per worker, SMG's id and lane map.
#[derive(Default)]
struct Lanes {
    by_key: HashMap<WorkerKey, (u32, ChainBlockMap)>,
    /// SMG's worker id -> kvengine's worker key.
    keys: Vec<Option<WorkerKey>>,
    anomalies: u64,
    scratch: Vec<StoredBlock>,
    removed: Vec<SequenceHash>,
}

impl std::fmt::Debug for SmgUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmgUnderTest")
            .field("workers", &self.lanes.by_key.len())
            .finish_non_exhaustive()
    }
}

/// A fresh SMG index.
pub fn build() -> Result<Box<dyn IndexerUnderTest>> {
    Ok(Box::new(SmgUnderTest::default()))
}

impl Lanes {
    /// Interns `key` with SMG the first time it is seen.
    fn intern(&mut self, index: &ChainIndex, key: WorkerKey) -> Result<()> {
        if !self.by_key.contains_key(&key) {
            let id = index
                .intern_worker(&worker_name(key))
                .map_err(|e| anyhow!("smg: {e}"))?;
            let slot = id as usize;
            if self.keys.len() <= slot {
                self.keys.resize(slot + 1, None);
            }
            if let Some(k) = self.keys.get_mut(slot) {
                *k = Some(key);
            }
            self.by_key.insert(key, (id, ChainBlockMap::new()));
        }
        Ok(())
    }

    fn apply(&mut self, index: &ChainIndex, key: WorkerKey, ev: &KvEvent) -> Result<()> {
        self.intern(index, key)?;
        let Some((id, map)) = self.by_key.get_mut(&key) else {
            return Ok(());
        };
        match ev {
            KvEvent::Stored { parent, blocks } => {
                self.scratch.clear();
                self.scratch.extend(blocks.iter().map(|b| StoredBlock {
                    seq_hash: SequenceHash(b.engine_hash.0),
                    content_hash: ContentHash(b.engine_hash.0),
                }));
                let parent = parent.map(|p| SequenceHash(p.0));
                if index.apply_stored(*id, &self.scratch, parent, map).is_err() {
                    self.anomalies += 1;
                }
            }
            KvEvent::Removed { blocks } => {
                self.removed.clear();
                self.removed
                    .extend(blocks.iter().map(|b| SequenceHash(b.0)));
                index.apply_removed(*id, &self.removed, map);
            }
            KvEvent::Cleared => index.apply_cleared(*id, map),
        }
        Ok(())
    }

    fn apply_all(&mut self, index: &ChainIndex, streams: &[EventStream]) -> Result<()> {
        for (key, ev) in round_robin(streams) {
            self.apply(index, *key, ev)?;
        }
        Ok(())
    }
}

fn find(index: &ChainIndex, keys: &[Option<WorkerKey>], seqs: &[SeqHash]) -> Matches {
    let content: Vec<ContentHash> = seqs.iter().map(|s| ContentHash(s.0)).collect();
    let scores = index.find_matches(&content, false);
    Matches::from_overlaps(
        scores
            .scores
            .iter()
            .filter_map(|(&w, &o)| keys.get(w as usize).copied().flatten().map(|k| (k, o))),
    )
}

impl IndexerUnderTest for SmgUnderTest {
    fn name(&self) -> String {
        "smg-kv-index(chain-index)".to_owned()
    }

    fn cores(&self) -> usize {
        1
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        self.lanes.apply_all(&self.index, streams)
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        Ok(find(&self.index, &self.lanes.keys, seqs))
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        _plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        // The readers map SMG's ids back through a copy of the table, so every worker the
        // phase names is interned before they start (the anchor's mixed phase only stores
        // for workers the base phase already named: this interns nothing there).
        let index = &self.index;
        let lanes = &mut self.lanes;
        for (key, _) in streams.iter().flat_map(|s| s.iter()) {
            lanes.intern(index, *key)?;
        }
        let keys = lanes.keys.clone();
        let ((), outcome) = concurrent_mixed(
            std::iter::repeat(()),
            queries,
            || lanes.apply_all(index, streams),
            |(), q| {
                std::hint::black_box(find(index, &keys, q));
                Ok(())
            },
        )?;
        Ok(outcome)
    }

    fn mixed_mode(&self) -> MixedMode {
        MixedMode::Concurrent
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        let mut shared = vec![(&self.index, &self.lanes.keys[..]); lists.len()];
        run_callers(&mut shared, lists, keep, |(ix, keys), q| {
            Ok(find(ix, keys, q))
        })
    }

    fn max_callers(&self) -> usize {
        usize::MAX
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        let st = self.index.stats();
        Ok(IndexerStats {
            live_entries: self.index.current_size() as u64,
            bytes: st.arena_chunk_bytes + st.slab_bytes,
            shard_ops: Vec::new(),
            anomalies: self.lanes.anomalies,
        })
    }
}
