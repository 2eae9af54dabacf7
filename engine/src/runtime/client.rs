//! Client handles: how the threads that decode events, and the edge, talk to the cores.
//!
//! Each handle owns one ring to every core and one reply ring from every core, so every
//! ring has exactly one producer and one consumer. A handle is `Send` but not `Sync`: move
//! it to the thread that uses it.
//!
//! # Invariants
//! 1. A full ring pauses the sender (it spins briefly, then yields) until the core makes
//!    room or the call's deadline passes; nothing is dropped silently: a message that could
//!    not be queued in time is an [`EngineError::Timeout`] to the caller.
//! 2. Every call waits at most [`RuntimeConfig::call_timeout`] (a sync or settle at most
//!    [`RuntimeConfig::sync_timeout`]): a stuck core gives its callers an error, never a
//!    hang.
//! 3. Calls are tagged: a reply carries its call's tag, and a reply to a call whose caller
//!    gave up is discarded when it arrives, so a late answer never answers a later call.
//!    A handle waits for one call per core at a time, so its reply rings hold at most the
//!    late replies of the calls it gave up on plus one.
//! 4. [`IngestHandle::sync`] returns only once every operation produced from events this
//!    handle sent before it is applied, on every core.
//!
//! # Time
//! The only clock this crate reads is here: [`std::time::Instant::now`] bounds how long a
//! caller waits. No answer depends on it.
//!
//! [`RuntimeConfig::call_timeout`]: super::RuntimeConfig::call_timeout
//! [`RuntimeConfig::sync_timeout`]: super::RuntimeConfig::sync_timeout

use super::home_core;
use super::msg::{CoreSummary, FromCore, Tagged, ToCore};
use super::waker::Waker;
use crate::directories::Applied;
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::ring::{Consumer, PopError, Producer, PushError};
use crate::sharding::ShardPolicy;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
const REPLY_PARK: Duration = Duration::from_millis(1);
/// A sender facing a full ring yields this many times, then sleeps [`FULL_NAP`] per retry:
/// a full ring means the core has at least a ring's worth of work queued, and a sender
/// that keeps yielding would compete with it for a CPU.
const YIELDS_BEFORE_NAP: u32 = 64;
const FULL_NAP: Duration = Duration::from_micros(20);

/// One client's rings to and from every core.
#[derive(Debug)]
pub(crate) struct Link {
    pub to: Vec<Producer<Tagged<ToCore>>>,
    pub from: Vec<Consumer<Tagged<FromCore>>>,
    /// The cores' wakers (to wake a core after a request).
    pub wakers: Arc<[Arc<Waker>]>,
    /// This client's waker (cores wake it after a reply).
    pub own: Arc<Waker>,
    /// Polls of an empty reply ring before parking (see [`SPINS_BEFORE_PARK_SPARE_CPU`]).
    pub spins_before_park: u32,
    /// How long one call may wait.
    pub call_timeout: Duration,
    /// How long a sync may wait.
    pub sync_timeout: Duration,
    /// The tag of the last call (tags count up from 1; 0 marks messages without reply).
    pub last_tag: u64,
}

/// When a wait gives up, and how long it was allowed.
#[derive(Clone, Copy, Debug)]
struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    fn after(budget: Duration) -> Self {
        Self {
            at: Instant::now() + budget,
            budget,
        }
    }

    /// Time left, or the error for a wait on `core` that ran out of it.
    fn left(&self, core: usize) -> Result<Duration> {
        let now = Instant::now();
        if now >= self.at {
            return Err(EngineError::Timeout {
                core,
                waited_ms: u64::try_from(self.budget.as_millis()).unwrap_or(u64::MAX),
            });
        }
        Ok(self.at - now)
    }
}

impl Link {
    fn next_tag(&mut self) -> u64 {
        self.last_tag += 1;
        self.last_tag
    }

    fn send(&mut self, core: usize, tag: u64, mut msg: ToCore, deadline: Deadline) -> Result<()> {
        let (Some(ring), Some(waker)) = (self.to.get_mut(core), self.wakers.get(core)) else {
            return Err(EngineError::RuntimeStopped);
        };
        let mut spins = 0u32;
        loop {
            match ring.try_push(Tagged { tag, msg }) {
                Ok(()) => {
                    waker.wake();
                    return Ok(());
                }
                Err(PushError::Closed(_)) => return Err(EngineError::RuntimeStopped),
                Err(PushError::Full(m)) => {
                    msg = m.msg;
                    waker.wake();
                    if spins >= SPINS_BEFORE_YIELD + YIELDS_BEFORE_NAP {
                        deadline.left(core)?;
                        std::thread::sleep(FULL_NAP);
                    } else {
                        backoff(&mut spins);
                    }
                }
            }
        }
    }

    /// Waits for the reply tagged `tag` from `core`, discarding late replies to calls
    /// given up before: spins briefly, then parks until the core wakes this client (so a
    /// waiting client leaves its CPU to the cores), until `deadline`.
    fn recv(&mut self, core: usize, tag: u64, deadline: Deadline) -> Result<FromCore> {
        let ring = self.from.get_mut(core).ok_or(EngineError::RuntimeStopped)?;
        let mut spins = 0u32;
        loop {
            match ring.try_pop() {
                Ok(m) if m.tag == tag => return Ok(m.msg),
                // A late reply to a call its caller gave up on.
                Ok(_) => {}
                Err(PopError::Closed) => return Err(EngineError::RuntimeStopped),
                Err(PopError::Empty) if spins < self.spins_before_park => {
                    spins += 1;
                    std::hint::spin_loop();
                }
                Err(PopError::Empty) => {
                    let left = deadline.left(core)?;
                    self.own.register_current();
                    self.own.prepare_sleep();
                    if ring.is_empty() {
                        self.own.sleep(REPLY_PARK.min(left));
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
        let tag = self.next_tag();
        let deadline = Deadline::after(self.call_timeout);
        self.send(core, tag, msg, deadline)?;
        self.recv(core, tag, deadline)
    }

    /// Sends a message that gets no reply.
    fn post(&mut self, core: usize, msg: ToCore) -> Result<()> {
        self.send(core, 0, msg, Deadline::after(self.call_timeout))
    }

    /// Makes `core` do nothing for `pause` (a stuck core, for tests of deadlines); returns
    /// once it replied or the call timed out.
    #[cfg(any(test, feature = "test-util"))]
    fn stall(&mut self, core: usize, pause: Duration) -> Result<()> {
        self.call(core, ToCore::Stall(pause)).map(|_| ())
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
}

impl IngestHandle {
    pub(crate) fn new(link: Link) -> Self {
        Self { link }
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

    /// Sends `events` without waiting: each chunk of the slice goes to the home cores of
    /// the workers in it (one core for one worker's batch), and each core applies the
    /// events of its own workers. Refusals are counted by the cores
    /// ([`IngestHandle::rejects`]).
    pub fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> Result<()> {
        let cores = self.link.cores();
        let mut homes = vec![false; cores];
        let mut start = 0;
        while start < events.len() {
            let end = (start + SEND_CHUNK).min(events.len());
            homes.iter_mut().for_each(|h| *h = false);
            for (key, _) in events.get(start..end).unwrap_or_default() {
                if let Some(h) = homes.get_mut(home_core(key.worker, cores).idx()) {
                    *h = true;
                }
            }
            for (c, _) in homes.iter().enumerate().filter(|(_, h)| **h) {
                self.link
                    .post(c, ToCore::Events((events.clone(), start..end)))?;
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
        let tag = self.link.next_tag();
        let deadline = Deadline::after(self.link.sync_timeout);
        for c in 0..self.link.cores() {
            self.link.send(c, tag, ToCore::Sync, deadline)?;
        }
        for c in 0..self.link.cores() {
            match self.link.recv(c, tag, deadline)? {
                FromCore::Synced => {}
                _ => return Err(EngineError::RuntimeStopped),
            }
        }
        Ok(())
    }

    /// Makes `core` do nothing for `pause`: a stuck core, for tests of callers' deadlines.
    #[cfg(any(test, feature = "test-util"))]
    pub fn stall_core(&mut self, core: usize, pause: Duration) -> Result<()> {
        self.link.stall(core, pause)
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

    /// Makes `core` do nothing for `pause`: a stuck core, for tests of callers' deadlines.
    #[cfg(any(test, feature = "test-util"))]
    pub fn stall_core(&mut self, core: usize, pause: Duration) -> Result<()> {
        self.link.stall(core, pause)
    }
    /// Makes `core` panic: a core with a bug, for the test that the process exits.
    #[cfg(any(test, feature = "test-util"))]
    pub fn panic_core(&mut self, core: usize) -> Result<()> {
        self.link.post(core, ToCore::Panic)
    }
}
