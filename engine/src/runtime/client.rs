//! Client handles: how the threads that decode events, and the edge, talk to the cores.
//!
//! Each handle owns one ring to every core and one reply ring from every core, so every
//! ring has exactly one producer and one consumer. A handle is `Send` but not `Sync`: move
//! it to the thread that uses it.
//!
//! # Invariants
//! 1. A full ring pauses the sender (it spins briefly, then yields) until the core makes
//!    room; nothing is dropped.
//! 2. A handle has at most one request with a reply outstanding per core, so reply rings
//!    never fill.
//! 3. [`IngestHandle::sync`] returns only once every operation produced from events this
//!    handle sent before it is applied, on every core.

use super::home_core;
use super::msg::{CoreSummary, FromCore, ToCore};
use super::waker::Waker;
use crate::directories::Applied;
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::ring::{Consumer, PopError, Producer, PushError};
use crate::sharding::ShardPolicy;
use std::sync::Arc;

/// Events per message when a handle forwards a shared slice.
const SEND_CHUNK: usize = 64;
/// Polls of a full request ring before a waiting client yields.
const SPINS_BEFORE_YIELD: u32 = 64;
/// Polls of an empty reply ring before a waiting client parks. Measured here (2-CPU EPYC,
/// `kvengine bench indexer`): with a CPU to itself, a client that polls ~2,000 times catches
/// most replies before parking (quiet query p99 3-7 us against 21 us at 64 polls); when the
/// client shares a CPU with a busy core, every poll is taken from that core, and 64 polls
/// is best (p99 13-19 us against 85-90 us). `start` picks by whether the machine has more
/// CPUs than cores.
pub(crate) const SPINS_BEFORE_PARK_SPARE_CPU: u32 = 2_048;
pub(crate) const SPINS_BEFORE_PARK_SHARED_CPU: u32 = 64;
/// Longest park while waiting for a reply (a core wakes the client when it replies).
const REPLY_PARK: std::time::Duration = std::time::Duration::from_millis(1);
/// A sender facing a full ring yields this many times, then sleeps [`FULL_NAP`] per retry:
/// a full ring means the core has at least a ring's worth of work queued, and a sender
/// that keeps yielding would compete with it for a CPU.
const YIELDS_BEFORE_NAP: u32 = 64;
const FULL_NAP: std::time::Duration = std::time::Duration::from_micros(20);

/// One client's rings to and from every core.
#[derive(Debug)]
pub(crate) struct Link {
    pub to: Vec<Producer<ToCore>>,
    pub from: Vec<Consumer<FromCore>>,
    /// The cores' wakers (to wake a core after a request).
    pub wakers: Arc<[Arc<Waker>]>,
    /// This client's waker (cores wake it after a reply).
    pub own: Arc<Waker>,
    /// Polls of an empty reply ring before parking (see [`SPINS_BEFORE_PARK_SPARE_CPU`]).
    pub spins_before_park: u32,
}

impl Link {
    fn send(&mut self, core: usize, mut msg: ToCore) -> Result<()> {
        let (Some(ring), Some(waker)) = (self.to.get_mut(core), self.wakers.get(core)) else {
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
                    if spins >= SPINS_BEFORE_YIELD + YIELDS_BEFORE_NAP {
                        std::thread::sleep(FULL_NAP);
                    } else {
                        backoff(&mut spins);
                    }
                }
            }
        }
    }

    /// Waits for the next reply from `core`: spins briefly, then parks until the core
    /// wakes this client, so a waiting client leaves its CPU to the cores.
    fn recv(&mut self, core: usize) -> Result<FromCore> {
        let ring = self.from.get_mut(core).ok_or(EngineError::RuntimeStopped)?;
        let mut spins = 0u32;
        loop {
            match ring.try_pop() {
                Ok(m) => return Ok(m),
                Err(PopError::Closed) => return Err(EngineError::RuntimeStopped),
                Err(PopError::Empty) if spins < self.spins_before_park => {
                    spins += 1;
                    std::hint::spin_loop();
                }
                Err(PopError::Empty) => {
                    self.own.register_current();
                    self.own.prepare_sleep();
                    if ring.is_empty() {
                        self.own.sleep(REPLY_PARK);
                    } else {
                        self.own.cancel_sleep();
                    }
                }
            }
        }
    }

    fn cores(&self) -> usize {
        self.to.len()
    }

    fn call(&mut self, core: usize, msg: ToCore) -> Result<FromCore> {
        self.send(core, msg)?;
        self.recv(core)
    }

    fn count(&mut self, core: usize, msg: ToCore) -> Result<usize> {
        match self.call(core, msg)? {
            FromCore::Count(n) => Ok(n),
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    /// Every core's figures.
    fn stats(&mut self) -> Result<Vec<CoreSummary>> {
        let mut out = Vec::with_capacity(self.cores());
        for c in 0..self.cores() {
            match self.call(c, ToCore::Stats)? {
                FromCore::Stats(s) => out.push(*s),
                _ => return Err(EngineError::RuntimeStopped),
            }
        }
        Ok(out)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Closing a ring does not wake its reader: close ours, then wake every core so it
        // sees the close now rather than at its next park timeout.
        self.to.clear();
        for w in self.wakers.iter() {
            w.wake();
        }
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

/// Feeds KV events to the cores. Each worker has a home core that owns its directory;
/// the handle sends each event there (or a shared slice to every core, each taking its own
/// workers' events).
#[derive(Debug)]
pub struct IngestHandle {
    link: Link,
    syncs: u64,
}

impl IngestHandle {
    pub(crate) fn new(link: Link) -> Self {
        Self { link, syncs: 0 }
    }

    fn home(&self, worker: WorkerId) -> usize {
        home_core(worker, self.link.cores()).idx()
    }

    /// Applies one event of `key` on its home core and returns what it did (see
    /// [`crate::directories::Directories::apply`]). Its operations for other cores may
    /// still be in flight: [`IngestHandle::sync`] waits for them.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        let home = self.home(key.worker);
        match self.link.call(home, ToCore::Apply(key, event.clone()))? {
            FromCore::Applied(r) => r,
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    /// Sends `events` without waiting: every core receives the slice (in chunks) and
    /// applies the events of its own workers. Refusals are counted by the cores
    /// ([`IngestHandle::rejects`]).
    pub fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> Result<()> {
        let mut start = 0;
        while start < events.len() {
            let end = (start + SEND_CHUNK).min(events.len());
            for c in 0..self.link.cores() {
                self.link
                    .send(c, ToCore::Events((events.clone(), start..end)))?;
            }
            start = end;
        }
        Ok(())
    }

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> Result<usize> {
        let home = self.home(key.worker);
        self.link.count(home, ToCore::Clear(key))
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<usize> {
        let home = self.home(worker);
        self.link.count(home, ToCore::RemoveWorker(worker))
    }

    /// Distinct engine hashes `key` holds.
    pub fn cached_blocks(&mut self, key: WorkerKey) -> Result<u64> {
        let home = self.home(key.worker);
        Ok(self.link.count(home, ToCore::CachedBlocks(key))? as u64)
    }

    /// Waits until every core has applied everything produced from the events this handle
    /// sent before.
    pub fn sync(&mut self) -> Result<()> {
        self.syncs += 1;
        let n = self.syncs;
        for c in 0..self.link.cores() {
            self.link.send(c, ToCore::Sync(n))?;
        }
        for c in 0..self.link.cores() {
            loop {
                match self.link.recv(c)? {
                    FromCore::Synced(m) if m == n => break,
                    // Nothing else is outstanding on this handle (invariant 2).
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Like [`IngestHandle::sync`], and then waits until the trunk promotions those events
    /// caused are done (every hub reported has been taken by the coordinator and no round
    /// is queued or running), so that what follows sees the index and the trunk settled.
    pub fn settle(&mut self) -> Result<()> {
        loop {
            self.sync()?;
            let cores = self.link.stats()?;
            let reported: u64 = cores.iter().map(|c| c.hubs_reported).sum();
            let heard: u64 = cores.iter().map(|c| c.hubs_heard).sum();
            if reported == heard && cores.iter().all(|c| !c.promoting) {
                return Ok(());
            }
            std::thread::yield_now();
        }
    }

    /// Refusals counted by all cores, per reason.
    pub fn rejects(&mut self) -> Result<RejectCounts> {
        let mut total = RejectCounts::default();
        for s in self.link.stats()? {
            for r in RejectReason::ALL {
                total.add(r, s.rejects.get(r));
            }
        }
        Ok(total)
    }

    /// Every core's figures.
    pub fn core_stats(&mut self) -> Result<Vec<CoreSummary>> {
        self.link.stats()
    }
}

/// Asks the cores for overlaps. Queries are answered by one core each, chosen by the
/// policy.
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
        self.policy.refresh();
        let c = self.policy.query_shard(seqs).idx();
        match self.link.call(c, ToCore::Query(seqs.into()))? {
            FromCore::Matches(m) => Ok(m),
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    /// Every core's figures.
    pub fn core_stats(&mut self) -> Result<Vec<CoreSummary>> {
        self.link.stats()
    }
}
