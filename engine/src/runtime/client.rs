//! Client handles: how ingest threads and query threads talk to the shards.
//!
//! Each handle owns one ring to every shard and one reply ring from every shard, so every
//! ring has exactly one producer and one consumer. A handle is `Send` but not `Sync`: move
//! it to the thread that uses it.
//!
//! # Invariants
//! 1. A full ring pauses the sender (it spins, then yields) until the shard makes room;
//!    nothing is dropped.
//! 2. [`IngestHandle::sync`] returns only once every shard has applied everything this
//!    handle sent before it.

use super::msg::{FromShard, ShardSummary, ToShard};
use super::waker::Waker;
use crate::error::{EngineError, RejectCounts, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::kv_index::Applied;
use crate::matches::Matches;
use crate::ring::{Consumer, PopError, Producer, PushError};
use crate::sharding::ingest::{Ingest, Outbox};
use crate::sharding::{ShardId, ShardPolicy};
use std::sync::Arc;

/// Block operations buffered before an ingest handle sends them on its own: large enough
/// to amortise a ring transfer, small enough (tens of microseconds of shard work) that a
/// query queued behind it is not held up long.
const FLUSH_OPS: usize = 1024;
/// Polls of an empty reply ring before the waiting client starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 64;

/// One client's rings to and from every shard.
#[derive(Debug)]
pub(crate) struct Link {
    pub to: Vec<Producer<ToShard>>,
    pub from: Vec<Consumer<FromShard>>,
    pub wakers: Arc<[Arc<Waker>]>,
}

impl Link {
    fn send(&mut self, shard: usize, mut msg: ToShard) -> Result<()> {
        let (Some(ring), Some(waker)) = (self.to.get_mut(shard), self.wakers.get(shard)) else {
            return Err(EngineError::RuntimeStopped);
        };
        let mut spins = 0u32;
        loop {
            match ring.try_push(msg) {
                Ok(()) => {
                    waker.wake();
                    return Ok(());
                }
                Err(PushError::Closed(_)) => return Err(EngineError::RuntimeStopped),
                Err(PushError::Full(m)) => {
                    msg = m;
                    waker.wake();
                    backoff(&mut spins);
                }
            }
        }
    }

    fn recv(&mut self, shard: usize) -> Result<FromShard> {
        let ring = self
            .from
            .get_mut(shard)
            .ok_or(EngineError::RuntimeStopped)?;
        let mut spins = 0u32;
        loop {
            match ring.try_pop() {
                Ok(m) => return Ok(m),
                Err(PopError::Closed) => return Err(EngineError::RuntimeStopped),
                Err(PopError::Empty) => backoff(&mut spins),
            }
        }
    }

    fn shards(&self) -> usize {
        self.to.len()
    }
}

#[inline]
fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < SPINS_BEFORE_YIELD {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Feeds KV events of the workers it owns into the shards. Owns those workers'
/// directories: a worker's events must always go through the same handle.
#[derive(Debug)]
pub struct IngestHandle<P> {
    ingest: Ingest<P>,
    outbox: Outbox,
    link: Link,
    buffered: usize,
    syncs: u64,
}

impl<P: ShardPolicy> IngestHandle<P> {
    pub(crate) fn new(policy: P, link: Link) -> Self {
        let shards = link.shards();
        Self {
            ingest: Ingest::new(policy),
            outbox: Outbox::new(shards),
            link,
            buffered: 0,
            syncs: 0,
        }
    }

    /// Applies one event of `key` (see [`Ingest::apply`]). Its operations are sent to the
    /// shards once enough are buffered, or by [`IngestHandle::flush`].
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        let applied = self.ingest.apply(key, event, &mut self.outbox)?;
        self.buffered += applied.blocks;
        if self.buffered >= FLUSH_OPS {
            self.flush()?;
        }
        Ok(applied)
    }

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> Result<usize> {
        let n = self.ingest.clear(key, &mut self.outbox);
        self.buffered += n;
        self.flush()?;
        Ok(n)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<usize> {
        let n = self.ingest.remove_worker(worker, &mut self.outbox);
        self.flush()?;
        Ok(n)
    }

    /// Sends every buffered operation to its shard.
    pub fn flush(&mut self) -> Result<()> {
        for s in 0..self.outbox.shards() {
            let batches = self.outbox.take(ShardId(s as u16));
            if !batches.is_empty() {
                self.link.send(s, ToShard::Ops(batches))?;
            }
        }
        self.buffered = 0;
        Ok(())
    }

    /// Flushes, then waits until every shard has applied everything sent so far.
    pub fn sync(&mut self) -> Result<()> {
        self.flush()?;
        self.syncs += 1;
        let n = self.syncs;
        for s in 0..self.link.shards() {
            self.link.send(s, ToShard::Sync(n))?;
        }
        for s in 0..self.link.shards() {
            loop {
                match self.link.recv(s)? {
                    FromShard::Synced(m) if m == n => break,
                    // Nothing else is ever addressed to an ingest handle.
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Distinct engine hashes `key` holds.
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.ingest.cached_blocks(key)
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.ingest.rejects()
    }

    /// Engine hashes in this handle's directories, and their heap bytes.
    pub fn directory_size(&self) -> (usize, usize) {
        self.ingest.directory_size()
    }
}

/// Asks shards for overlaps. Queries are answered by one shard each, chosen by the policy.
#[derive(Debug)]
pub struct QueryHandle<P> {
    policy: P,
    link: Link,
}

impl<P: ShardPolicy> QueryHandle<P> {
    pub(crate) fn new(policy: P, link: Link) -> Self {
        Self { policy, link }
    }

    /// Overlaps of `seqs` (see [`Matches`]).
    pub fn find_matches(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        if seqs.is_empty() {
            return Ok(Matches::default());
        }
        let s = self.policy.query_shard(seqs).idx();
        self.link.send(s, ToShard::Query(seqs.into()))?;
        loop {
            if let FromShard::Matches(m) = self.link.recv(s)? {
                return Ok(m);
            }
        }
    }

    /// Every shard's figures.
    pub fn shard_stats(&mut self) -> Result<Vec<ShardSummary>> {
        let mut out = Vec::with_capacity(self.link.shards());
        for s in 0..self.link.shards() {
            self.link.send(s, ToShard::Stats)?;
            loop {
                if let FromShard::Stats(st) = self.link.recv(s)? {
                    out.push(st);
                    break;
                }
            }
        }
        Ok(out)
    }
}
