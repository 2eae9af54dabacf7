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

use super::home::home_core;
use super::msg::{CoreSummary, FromCore, Tagged, ToCore};
use super::waker::Waker;
use crate::directories::Applied;
use crate::error::{EngineError, RejectCounts, RejectReason, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::ring::{Consumer, PopError, Producer, PushError};
use crate::sharding::ShardPolicy;
use crate::snapshot::StreamMark;
use crate::snapshot::image::{CoreImage, EngineImage};
use hashbrown::HashMap;
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
    /// Calls whose replies are collected later ([`Link::begin_query`]), by (core, tag),
    /// with the reply once it arrived: a wait for another call keeps these instead of
    /// discarding them as late.
    pub awaited: HashMap<(usize, u64), Option<FromCore>>,
    /// Scratch for [`Link::send_events`]: which cores a chunk of events goes to.
    pub homes: Vec<bool>,
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

/// What a waiting caller does meanwhile: a hosted core steps its own work (so a core that
/// waits for another never stops serving the others, and two cores waiting on each other
/// both progress); returns whether it did anything. Plain handles do nothing.
pub(crate) type Work<'a> = &'a mut dyn FnMut() -> bool;

/// The [`Work`] of a thread with nothing else to do.
pub(crate) fn idle() -> bool {
    false
}

impl Link {
    fn next_tag(&mut self) -> u64 {
        self.last_tag += 1;
        self.last_tag
    }

    fn send(
        &mut self,
        core: usize,
        tag: u64,
        mut msg: ToCore,
        deadline: Deadline,
        work: Work<'_>,
    ) -> Result<()> {
        let (Some(ring), Some(waker)) = (self.to.get_mut(core), self.wakers.get(core)) else {
            return Err(EngineError::RuntimeStopped);
        };
        let mut spins = 0u32;
        loop {
            match ring.try_push(Tagged { tag, msg }) {
                Ok(()) => {
                    waker.ring();
                    return Ok(());
                }
                Err(PushError::Closed(_)) => return Err(EngineError::RuntimeStopped),
                Err(PushError::Full(m)) => {
                    msg = m.msg;
                    waker.wake();
                    if work() {
                        spins = 0;
                    } else if spins >= SPINS_BEFORE_YIELD + YIELDS_BEFORE_NAP {
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
    /// given up before: does `work` meanwhile; with none, spins briefly, then parks until
    /// the core wakes this client (so a waiting client leaves its CPU to the cores), until
    /// `deadline`.
    fn recv(
        &mut self,
        core: usize,
        tag: u64,
        deadline: Deadline,
        work: Work<'_>,
    ) -> Result<FromCore> {
        let ring = self.from.get_mut(core).ok_or(EngineError::RuntimeStopped)?;
        let mut spins = 0u32;
        loop {
            match ring.try_pop() {
                Ok(m) if m.tag == tag => return Ok(m.msg),
                Ok(m) => {
                    // A reply collected later, or a late one to a call given up on.
                    if let Some(slot) = self.awaited.get_mut(&(core, m.tag)) {
                        *slot = Some(m.msg);
                    }
                }
                Err(PopError::Closed) => return Err(EngineError::RuntimeStopped),
                Err(PopError::Empty) if work() => spins = 0,
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

    pub(crate) fn cores(&self) -> usize {
        self.to.len()
    }

    fn call(&mut self, core: usize, msg: ToCore, work: Work<'_>) -> Result<FromCore> {
        let tag = self.next_tag();
        let deadline = Deadline::after(self.call_timeout);
        self.send(core, tag, msg, deadline, work)?;
        self.recv(core, tag, deadline, work)
    }

    /// Sends a message that gets no reply.
    fn post(&mut self, core: usize, msg: ToCore, work: Work<'_>) -> Result<()> {
        self.send(core, 0, msg, Deadline::after(self.call_timeout), work)
    }

    fn count(&mut self, core: usize, msg: ToCore, work: Work<'_>) -> Result<usize> {
        match self.call(core, msg, work)? {
            FromCore::Count(n) => Ok(n),
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    fn home(&self, worker: WorkerId) -> usize {
        home_core(worker, self.cores()).idx()
    }

    // ----- the operations, shared by the handles and hosted cores -----

    /// Makes `core` do nothing for `pause` (a stuck core, for tests of deadlines); returns
    /// once it replied or the call timed out.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn stall(&mut self, core: usize, pause: Duration, work: Work<'_>) -> Result<()> {
        self.call(core, ToCore::Stall(pause), work).map(|_| ())
    }

    /// Every core's figures.
    pub(crate) fn stats(&mut self, work: Work<'_>) -> Result<Vec<CoreSummary>> {
        let mut out = Vec::with_capacity(self.cores());
        for c in 0..self.cores() {
            match self.call(c, ToCore::Stats, work)? {
                FromCore::Stats(s) => out.push(*s),
                _ => return Err(EngineError::RuntimeStopped),
            }
        }
        Ok(out)
    }

    /// See [`IngestHandle::apply`].
    pub(crate) fn apply(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        work: Work<'_>,
    ) -> Result<Applied> {
        let home = self.home(key.worker);
        match self.call(home, ToCore::Apply(key, event.clone()), work)? {
            FromCore::Applied(r) => r,
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    /// See [`IngestHandle::send`].
    pub(crate) fn send_events(
        &mut self,
        events: &Arc<[(WorkerKey, KvEvent)]>,
        mark: Option<StreamMark>,
        work: Work<'_>,
    ) -> Result<()> {
        let cores = self.cores();
        let marked_home = mark.map(|m| self.home(m.worker));
        // Reused across batches: this is the ingest hot path.
        let mut homes = std::mem::take(&mut self.homes);
        homes.resize(cores, false);
        // A marked batch goes whole, as one slice: its home core records the mark when the
        // slice is done and puts a snapshot's freeze off until then, so an image holds all
        // of the batch or none of it. Split into chunks, a snapshot could cut between two
        // of them, and the batch, replayed whole after a restart from that image, would
        // apply its first chunk twice. (Per-round work stays bounded: a core applies a
        // long slice over several rounds, shard_loop invariant 4.)
        let chunk = if mark.is_some() {
            events.len().max(1)
        } else {
            SEND_CHUNK
        };
        let mut start = 0;
        let mut mark_sent = false;
        while start < events.len() {
            let end = (start + chunk).min(events.len());
            homes.iter_mut().for_each(|h| *h = false);
            for (key, _) in events.get(start..end).unwrap_or_default() {
                if let Some(h) = homes.get_mut(home_core(key.worker, cores).idx()) {
                    *h = true;
                }
            }
            for (c, _) in homes.iter().enumerate().filter(|(_, h)| **h) {
                // The mark rides with the last chunk its home applies.
                let m = mark.filter(|_| end == events.len() && marked_home == Some(c));
                mark_sent |= m.is_some();
                if let Err(e) = self.post(c, ToCore::Events((events.clone(), start..end), m), work)
                {
                    self.homes = homes;
                    return Err(e);
                }
            }
            start = end;
        }
        self.homes = homes;
        if let (Some(m), Some(home), false) = (mark, marked_home, mark_sent) {
            let n = events.len();
            self.post(home, ToCore::Events((events.clone(), n..n), Some(m)), work)?;
        }
        Ok(())
    }

    /// See [`IngestHandle::snapshot`].
    pub(crate) fn snapshot(
        &mut self,
        buffers: Vec<CoreImage>,
        work: Work<'_>,
    ) -> Result<EngineImage> {
        let tag = self.next_tag();
        let deadline = Deadline::after(self.sync_timeout);
        self.send(0, tag, ToCore::Snapshot(buffers), deadline, work)?;
        match self.recv(0, tag, deadline, work)? {
            FromCore::Snapshot(image) => Ok(*image),
            _ => Err(EngineError::RuntimeStopped),
        }
    }

    /// See [`IngestHandle::clear`].
    pub(crate) fn clear(&mut self, key: WorkerKey, work: Work<'_>) -> Result<usize> {
        let home = self.home(key.worker);
        self.count(home, ToCore::Clear(key), work)
    }

    /// See [`IngestHandle::remove_worker`].
    pub(crate) fn remove_worker(&mut self, worker: WorkerId, work: Work<'_>) -> Result<usize> {
        let home = self.home(worker);
        self.count(home, ToCore::RemoveWorker(worker), work)
    }

    /// See [`IngestHandle::cached_blocks`].
    pub(crate) fn cached_blocks(&mut self, key: WorkerKey, work: Work<'_>) -> Result<u64> {
        let home = self.home(key.worker);
        Ok(self.count(home, ToCore::CachedBlocks(key), work)? as u64)
    }

    /// See [`IngestHandle::sync`].
    pub(crate) fn sync(&mut self, work: Work<'_>) -> Result<()> {
        let tag = self.next_tag();
        let deadline = Deadline::after(self.sync_timeout);
        for c in 0..self.cores() {
            self.send(c, tag, ToCore::Sync, deadline, work)?;
        }
        for c in 0..self.cores() {
            match self.recv(c, tag, deadline, work)? {
                FromCore::Synced => {}
                _ => return Err(EngineError::RuntimeStopped),
            }
        }
        Ok(())
    }

    /// Sends a query to `core` without waiting for its reply, which
    /// [`Link::poll_query`] collects; `None` if the ring is full right now (ask with
    /// [`Link::query`] instead).
    pub(crate) fn begin_query(&mut self, core: usize, seqs: &[SeqHash]) -> Result<Option<u64>> {
        let tag = self.next_tag();
        let (Some(ring), Some(waker)) = (self.to.get_mut(core), self.wakers.get(core)) else {
            return Err(EngineError::RuntimeStopped);
        };
        let msg = Tagged {
            tag,
            msg: ToCore::Query(seqs.into()),
        };
        match ring.try_push(msg) {
            Ok(()) => {
                waker.ring();
                self.awaited.insert((core, tag), None);
                Ok(Some(tag))
            }
            Err(PushError::Full(_)) => Ok(None),
            Err(PushError::Closed(_)) => Err(EngineError::RuntimeStopped),
        }
    }

    /// The reply to query `tag` sent to `core` by [`Link::begin_query`], if it arrived;
    /// collects whatever replies `core` sent meanwhile.
    pub(crate) fn poll_query(&mut self, core: usize, tag: u64) -> Option<Result<Matches>> {
        let Some(ring) = self.from.get_mut(core) else {
            return Some(Err(EngineError::RuntimeStopped));
        };
        loop {
            match ring.try_pop() {
                Ok(m) => {
                    if let Some(slot) = self.awaited.get_mut(&(core, m.tag)) {
                        *slot = Some(m.msg);
                    }
                }
                Err(PopError::Empty) => break,
                Err(PopError::Closed) => {
                    self.awaited.remove(&(core, tag));
                    return Some(Err(EngineError::RuntimeStopped));
                }
            }
        }
        match self.awaited.get(&(core, tag)) {
            Some(None) => None,
            _ => match self.awaited.remove(&(core, tag)) {
                Some(Some(FromCore::Matches(m))) => Some(Ok(m)),
                _ => Some(Err(EngineError::RuntimeStopped)),
            },
        }
    }

    /// Gives up on query `tag` (its deadline passed): its reply is discarded on arrival.
    pub(crate) fn forget_query(&mut self, core: usize, tag: u64) {
        self.awaited.remove(&(core, tag));
    }

    /// Whether any reply is waiting to be collected.
    pub(crate) fn replies_waiting(&self) -> bool {
        self.from.iter().any(|r| !r.is_empty())
    }

    /// Asks `core` for the overlaps of `seqs`.
    pub(crate) fn query(
        &mut self,
        core: usize,
        seqs: &[SeqHash],
        work: Work<'_>,
    ) -> Result<Matches> {
        match self.call(core, ToCore::Query(seqs.into()), work)? {
            FromCore::Matches(m) => Ok(m),
            _ => Err(EngineError::RuntimeStopped),
        }
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
/// the handle sends each event there.
#[derive(Debug)]
pub struct IngestHandle {
    link: Link,
}

impl IngestHandle {
    pub(crate) fn new(link: Link) -> Self {
        Self { link }
    }

    /// Applies one event of `key` on its home core and returns what it did (see
    /// [`crate::directories::Directories::apply`]). Its operations for other cores may
    /// still be in flight: [`IngestHandle::sync`] waits for them.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        self.link.apply(key, event, &mut idle)
    }

    /// Sends `events` without waiting: each chunk of the slice goes to the home cores of
    /// the workers in it (one core for one worker's batch), and each core applies the
    /// events of its own workers. Refusals are counted by the cores
    /// ([`IngestHandle::rejects`]).
    pub fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> Result<()> {
        self.link.send_events(events, None, &mut idle)
    }

    /// Like [`IngestHandle::send`], and records `mark` (the batch's number on its stream)
    /// on its worker's home core once the events are applied there.
    pub fn send_marked(
        &mut self,
        events: &Arc<[(WorkerKey, KvEvent)]>,
        mark: StreamMark,
    ) -> Result<()> {
        self.link.send_events(events, Some(mark), &mut idle)
    }

    /// The engine at a consistent cut: every core's shard, directories and stream marks,
    /// and the trunk (see `crate::snapshot`). Ingest pauses on each core only from its
    /// freeze to its image (a promotion round's freeze). Waits up to the sync timeout.
    pub fn snapshot(&mut self) -> Result<EngineImage> {
        let buffers = self.snapshot_buffers()?;
        self.snapshot_into(buffers)
    }

    /// Image buffers for [`IngestHandle::snapshot_into`], one per core, sized by the cores'
    /// current figures and touched here, on the caller's thread, so that the frozen cores
    /// copy into memory that takes no page fault.
    pub fn snapshot_buffers(&mut self) -> Result<Vec<CoreImage>> {
        Ok(self
            .core_stats()?
            .iter()
            .map(|c| crate::snapshot::prepared(c.index.nodes, c.index.blocks, c.directory_entries))
            .collect())
    }

    /// [`IngestHandle::snapshot`] into `buffers` (from [`IngestHandle::snapshot_buffers`]):
    /// the call's duration bounds how long ingest paused.
    pub fn snapshot_into(&mut self, buffers: Vec<CoreImage>) -> Result<EngineImage> {
        self.link.snapshot(buffers, &mut idle)
    }

    /// Empties `key`'s cache; returns how many block copies it dropped.
    pub fn clear(&mut self, key: WorkerKey) -> Result<usize> {
        self.link.clear(key, &mut idle)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<usize> {
        self.link.remove_worker(worker, &mut idle)
    }

    /// Distinct engine hashes `key` holds.
    pub fn cached_blocks(&mut self, key: WorkerKey) -> Result<u64> {
        self.link.cached_blocks(key, &mut idle)
    }

    /// Waits until every core has applied everything produced from the events this handle
    /// sent before.
    pub fn sync(&mut self) -> Result<()> {
        self.link.sync(&mut idle)
    }

    /// Like [`IngestHandle::sync`], and then waits until the trunk promotions those events
    /// caused are done (every junction reported has been taken by the coordinator and no
    /// round is queued or running), so that what follows sees the index and the trunk
    /// settled.
    pub fn settle(&mut self) -> Result<()> {
        loop {
            self.sync()?;
            let cores = self.link.stats(&mut idle)?;
            let reported: u64 = cores.iter().map(|c| c.junctions_reported).sum();
            let heard: u64 = cores.iter().map(|c| c.junctions_heard).sum();
            if reported == heard && cores.iter().all(|c| !c.promoting) {
                return Ok(());
            }
            std::thread::yield_now();
        }
    }

    /// Refusals counted by all cores, per reason.
    pub fn rejects(&mut self) -> Result<RejectCounts> {
        let mut total = RejectCounts::default();
        for s in self.link.stats(&mut idle)? {
            for r in RejectReason::ALL {
                total.add(r, s.rejects.get(r));
            }
        }
        Ok(total)
    }

    /// Every core's figures.
    pub fn core_stats(&mut self) -> Result<Vec<CoreSummary>> {
        self.link.stats(&mut idle)
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
        self.link.query(c, seqs, &mut idle)
    }

    /// Every core's figures.
    pub fn core_stats(&mut self) -> Result<Vec<CoreSummary>> {
        self.link.stats(&mut idle)
    }

    /// Makes `core` do nothing for `pause`: a stuck core, for tests of callers' deadlines.
    #[cfg(any(test, feature = "test-util"))]
    pub fn stall_core(&mut self, core: usize, pause: Duration) -> Result<()> {
        self.link.stall(core, pause, &mut idle)
    }

    /// Makes `core` panic: a core with a bug, for the test that the process exits.
    #[cfg(any(test, feature = "test-util"))]
    pub fn panic_core(&mut self, core: usize) -> Result<()> {
        self.link.post(core, ToCore::Panic, &mut idle)
    }
}
