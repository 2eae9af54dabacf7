//! Cores hosted on the caller's threads: the edge (HTTP, event decoders) and a core share one
//! thread, so a query for the core's own shard is answered in place and nothing on that
//! path waits for the OS to schedule another thread.
//!
//! [`start_hosted`](super::start_hosted) builds the same cores and rings as
//! [`start`](super::start), but hands each core back as a [`CoreHost`] instead of spawning
//! its thread. The caller moves each host to a thread of its own (an async runtime's, say)
//! and calls [`CoreHost::step`] between its other work; when the core has nothing to do,
//! [`CoreHost::sleep_as`] parks it as a task that any message for it wakes.
//!
//! # Invariants
//! 1. A host is used by one thread at a time (it is `Send`, not `Sync`).
//! 2. Everything a core does for its peers and clients happens in `step`, whichever way it
//!    is called: from the owner's loop, or from a call on this host that waits for another
//!    core (a host waiting for a reply steps its own core meanwhile, so two cores that wait
//!    for each other both progress, and neither stops serving the rest). While it waits
//!    for another core's answer to a query, it serves only the queries on its rings
//!    (`Runner::step_queries`): the answer needs nothing else from it, and an event begun
//!    meanwhile would delay the caller by the event's whole work.
//! 3. A query reads its shard in place: the host's own, on its own thread; another core's,
//!    through that shard's [`Reader`] (`sole_writer`: the owning core writes it a chunk
//!    per section, so a read waits at most for one chunk, never for a whole event or for
//!    the owner to look at its rings). It sees every operation the owner has applied.
//!    Operations still on the owner's rings are applied by its next round, unless it is
//!    parked (they do not wake it, `shard_loop` invariant 10): a query for a parked core
//!    that this host has sent operations it has not taken yet goes over the host's query
//!    ring instead, exactly as a [`QueryHandle`]'s would, which wakes it and is answered
//!    after them. So a host's query sees its own earlier operations as a forwarded one
//!    would; [`CoreHost::sync`] is the barrier for everyone's.
//!
//! [`Reader`]: crate::sole_writer::Reader
//! 4. Events, clears and syncs go over the host's ingest ring, even to its own core, so the
//!    core's ordering and backpressure rules (shard_loop invariants 1, 3, 7) hold for them
//!    unchanged.
//! 5. Each call waits at most its deadline, as a handle's does.
//!
//! [`QueryHandle`]: super::QueryHandle

use super::client::Link;
use super::msg::CoreSummary;
use super::shard_loop::Runner;
use super::waker::Waker;
use crate::directories::Applied;
use crate::error::Result;
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use crate::snapshot::StreamMark;
use crate::sole_writer::Reader;
use std::sync::Arc;
use std::time::Duration;

/// Longest park of a host that waits in [`CoreHost::run_to_end`] for its peers to finish.
const END_PARK: Duration = Duration::from_millis(5);

/// A query sent to another core by [`CoreHost::start_query`], its reply still to collect.
#[derive(Debug)]
pub struct SentQuery {
    core: usize,
    tag: u64,
}

impl SentQuery {
    /// The core it went to.
    pub fn core(&self) -> usize {
        self.core
    }
}

/// Where a query is answered.
enum Place {
    /// Here and now (no blocks, or this core owns the query's shard).
    Here(Matches),
    /// By this core.
    Core(usize),
}

/// What [`CoreHost::start_query`] did.
#[derive(Debug)]
pub enum Lookup {
    /// Answered at once: by this core's shard, or (its ring to the other core full) by
    /// waiting for the other core while stepping this one.
    Done(Result<Matches>),
    /// Sent to another core: collect the reply with [`CoreHost::poll_query`].
    Sent(SentQuery),
}

/// What a host reads the other cores' shards with (invariant 3), by core id.
#[derive(Clone)]
pub(crate) struct Peers {
    /// Every core's shard (this host's own is read through its core instead).
    pub(crate) shards: Vec<Reader<Shard>>,
    /// Every core's waker: whether a core is parked.
    pub(crate) wakers: Arc<[Arc<Waker>]>,
}

/// One core, to be driven by the thread it is moved to. See the module docs.
pub struct CoreHost<P> {
    runner: Runner<P>,
    policy: P,
    ingest: Link,
    query: Link,
    waker: Arc<Waker>,
    cpu: Option<core_affinity::CoreId>,
    peers: Peers,
    /// Between a [`CoreHost::sleep_as`] that let it sleep and the next
    /// [`CoreHost::awake`]: the driver is not stepping it, even once woken.
    parked: std::cell::Cell<bool>,
}

impl<P> std::fmt::Debug for CoreHost<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreHost")
            .field("cpu", &self.cpu.map(|c| c.id))
            .finish()
    }
}

impl<P: ShardPolicy> CoreHost<P> {
    pub(crate) fn new(
        runner: Runner<P>,
        policy: P,
        ingest: Link,
        query: Link,
        waker: Arc<Waker>,
        cpu: Option<core_affinity::CoreId>,
        peers: Peers,
    ) -> Self {
        Self {
            runner,
            policy,
            ingest,
            query,
            waker,
            cpu,
            peers,
            parked: std::cell::Cell::new(false),
        }
    }

    /// This core's shard.
    pub fn shard(&self) -> ShardId {
        self.runner.shard_id()
    }

    /// Pins the calling thread to this core's CPU, where one was assigned; returns it.
    pub fn pin_current_thread(&self) -> Option<usize> {
        let cpu = self.cpu?;
        core_affinity::set_for_current(cpu).then_some(cpu.id)
    }

    /// One round of the core's work: peers' operations, clients' messages, promotions.
    /// Returns whether anything was done.
    pub fn step(&mut self) -> bool {
        self.runner.step()
    }

    /// Every client and peer is gone and everything is drained: the core has ended.
    pub fn finished(&self) -> bool {
        self.runner.finished()
    }

    /// Prepares to sleep as `task`: returns true if nothing is queued for the core, in which
    /// case the caller returns `Pending` and is woken by the next message for the core;
    /// false if something arrived (step again). Call [`CoreHost::awake`] once running again.
    pub fn sleep_as(&self, task: &std::task::Waker) -> bool {
        self.waker.register_task(task);
        self.waker.prepare_sleep();
        if self.runner.quiet() && !self.query.replies_waiting() && !self.ingest.replies_waiting() {
            self.parked.set(true);
            true
        } else {
            self.waker.cancel_sleep();
            false
        }
    }

    /// The host runs again after [`CoreHost::sleep_as`].
    pub fn awake(&self) {
        self.parked.set(false);
        self.waker.cancel_sleep();
    }

    /// Overlaps of `seqs`: read in place (invariant 3), or asked of the core that owns the
    /// query's shard (stepping this core meanwhile).
    pub fn find_matches(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        match self.place(seqs) {
            Place::Here(m) => Ok(m),
            Place::Core(core) => {
                let runner = &mut self.runner;
                self.query.query(core, seqs, &mut || runner.step_queries())
            }
        }
    }

    /// Answers `seqs` in place where this core can, or names the core that owns them.
    fn place(&mut self, seqs: &[SeqHash]) -> Place {
        if seqs.is_empty() {
            return Place::Here(Matches::default());
        }
        self.policy.refresh();
        let shard = self.policy.query_shard(seqs);
        if shard == self.runner.shard_id() {
            // A parked core has not seen the operations its peers sent since it parked
            // (they do not wake it, `shard_loop` invariant 10; and one woken by a half-full
            // ring may not have run yet): one round applies them, so a read in place sees
            // what a forwarded query would.
            if self.parked.get() && self.runner.peer_ops_waiting() {
                self.runner.step();
            }
            return Place::Here(self.runner.query_local(seqs));
        }
        let core = shard.idx();
        match self.peers.shards.get(core) {
            Some(other) if !self.unseen_by_parked(core) => {
                Place::Here(self.runner.query_other(other, seqs))
            }
            _ => Place::Core(core),
        }
    }

    /// This host has sent `core` operations it has not taken yet, and `core` is parked, so
    /// it would not apply them before a read in place (invariant 3). Dekker's pattern with
    /// the core's park (`waker` module docs): our push came before this check's fence, its
    /// `sleeping` store before its look at its rings, so either it sees the operations and
    /// does not park, or this sees it parked.
    fn unseen_by_parked(&self, core: usize) -> bool {
        self.runner.sent_untaken(core) && self.peers.wakers.get(core).is_some_and(|w| w.asleep())
    }

    /// Starts a query without waiting for another core: answered in place when this core
    /// owns the query's shard, otherwise sent (see [`Lookup`]).
    pub fn start_query(&mut self, seqs: &[SeqHash]) -> Lookup {
        let core = match self.place(seqs) {
            Place::Here(m) => return Lookup::Done(Ok(m)),
            Place::Core(core) => core,
        };
        match self.query.begin_query(core, seqs) {
            Ok(Some(tag)) => Lookup::Sent(SentQuery { core, tag }),
            Ok(None) => {
                let runner = &mut self.runner;
                Lookup::Done(self.query.query(core, seqs, &mut || runner.step_queries()))
            }
            Err(e) => Lookup::Done(Err(e)),
        }
    }

    /// The reply to `sent`, if it has arrived.
    pub fn poll_query(&mut self, sent: &SentQuery) -> Option<Result<Matches>> {
        self.query.poll_query(sent.core, sent.tag)
    }

    /// Gives up on `sent` (its caller's deadline passed); its reply is dropped on arrival.
    pub fn forget_query(&mut self, sent: SentQuery) {
        self.query.forget_query(sent.core, sent.tag);
    }

    /// Whether a reply to this host is waiting to be collected.
    pub fn replies_waiting(&self) -> bool {
        self.query.replies_waiting()
    }

    /// How long a call on this host may wait.
    pub fn call_timeout(&self) -> Duration {
        self.query.call_timeout
    }

    /// See [`super::IngestHandle::send`].
    pub fn send(&mut self, events: &Arc<[(WorkerKey, KvEvent)]>) -> Result<()> {
        let runner = &mut self.runner;
        self.ingest.send_events(events, None, &mut || runner.step())
    }

    /// See [`super::IngestHandle::send_marked`].
    pub fn send_marked(
        &mut self,
        events: &Arc<[(WorkerKey, KvEvent)]>,
        mark: StreamMark,
    ) -> Result<()> {
        let runner = &mut self.runner;
        self.ingest
            .send_events(events, Some(mark), &mut || runner.step())
    }

    /// See [`super::IngestHandle::apply`].
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> Result<Applied> {
        let runner = &mut self.runner;
        self.ingest.apply(key, event, &mut || runner.step())
    }

    /// See [`super::IngestHandle::clear`].
    pub fn clear(&mut self, key: WorkerKey) -> Result<usize> {
        let runner = &mut self.runner;
        self.ingest.clear(key, &mut || runner.step())
    }

    /// See [`super::IngestHandle::remove_worker`].
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<usize> {
        let runner = &mut self.runner;
        self.ingest.remove_worker(worker, &mut || runner.step())
    }

    /// See [`super::IngestHandle::cached_blocks`].
    pub fn cached_blocks(&mut self, key: WorkerKey) -> Result<u64> {
        let runner = &mut self.runner;
        self.ingest.cached_blocks(key, &mut || runner.step())
    }

    /// Waits until every core applied everything this host sent before (see
    /// [`super::IngestHandle::sync`]).
    pub fn sync(&mut self) -> Result<()> {
        let runner = &mut self.runner;
        self.ingest.sync(&mut || runner.step())
    }

    /// Every core's figures.
    pub fn core_stats(&mut self) -> Result<Vec<CoreSummary>> {
        let runner = &mut self.runner;
        self.query.stats(&mut || runner.step())
    }

    /// Makes `core` do nothing for `pause`: a stuck core, for tests of callers' deadlines.
    #[cfg(any(test, feature = "test-util"))]
    pub fn stall_core(&mut self, core: usize, pause: Duration) -> Result<()> {
        let runner = &mut self.runner;
        self.query.stall(core, pause, &mut || runner.step())
    }

    /// Closes this host's rings and runs the core on the calling thread until every client
    /// and peer is gone; returns its final figures. Call once the thread's other work is
    /// over.
    pub fn run_to_end(self) -> CoreSummary {
        let Self {
            mut runner,
            ingest,
            query,
            waker,
            ..
        } = self;
        drop((ingest, query));
        waker.register_current();
        let mut idle = 0u32;
        while !runner.finished() {
            if runner.step() {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if idle < 64 {
                std::hint::spin_loop();
                continue;
            }
            waker.prepare_sleep();
            if runner.quiet() {
                waker.sleep(END_PARK);
            } else {
                waker.cancel_sleep();
            }
        }
        runner.summary()
    }
}
