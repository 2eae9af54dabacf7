//! The body of a core thread: it owns one shard and the directories of the workers homed
//! on it.
//!
//! A core applies the KV events of its own workers (directories, seq_hash chaining,
//! routing), applies the resulting operations for its own shard at once, and sends the
//! others to the cores that own them, over one SPSC ring per ordered pair of cores. It also
//! answers queries for its shard. Nothing is shared between cores but the rings and, for
//! reading only, the shards: a hosted core's host reads another core's shard in place
//! (`hosted` invariant 3), between that core's write sections (`sole_writer`), each of
//! which applies at most one chunk of operations (invariant 4) or one promoted path
//! (rare: a trunk promotion's graft).
//!
//! Layers: the core's parts and its send / reply primitives are `core_state`'s, the trunk
//! promotion protocol is `promotion`'s (over those parts), and this loop, on top, serves the
//! rings in rounds and calls the protocol.
//!
//! # Invariants
//! 1. Messages of one client are handled in the order the client sent them, and so are the
//!    messages of one peer core.
//! 2. `Synced` (tag `t`) goes to client `c` only when this core has handled `c`'s `Sync`
//!    tagged `t` and has received `Fence { c, t }` from every peer: each peer sends that
//!    fence after the operations it produced from `c`'s earlier events, on the same ring.
//!    The count is kept by [`SyncBarrier`] (`barrier`).
//! 8. Every reply carries the tag of the message it answers.
//! 3. Peer rings are never waited on: a message for a full peer ring waits in `pending`,
//!    and while anything is pending the core takes no new events from clients (so pending
//!    stays bounded) but keeps draining its peers (so two cores pushing to each other never
//!    deadlock).
//! 4. Serving order each round: peer operations, queries, then at most [`INGEST_BURST`]
//!    messages from each ingest client. A round applies at most about `step_blocks` blocks
//!    of one event slice (at least one event); the rest of the slice is kept and
//!    applied first in the next rounds, before any further ingest message, under the same
//!    conditions as a new message (not while frozen or backed up). The core applies its
//!    shard's operations (its own events' share and its peers') [`QUERY_CHUNK_BLOCKS`]
//!    blocks at a time and answers waiting queries after each chunk, so a query on the
//!    rings waits for at most one chunk (plus the directory work of one event), and a
//!    caller that steps this core (a host) waits for at most one round's slice.
//! 5. The thread exits when every client ring is closed and drained, nothing is pending,
//!    and every peer has closed its ring to this core; it closes its own peer rings first.
//! 6. A panic in this thread aborts the process.
//! 9. While it applies one event's directory work, the core answers the `Query` messages
//!    waiting on its query clients' rings every
//!    [`PAUSE_BLOCKS`](crate::directories::PAUSE_BLOCKS) blocks (only the shard is read,
//!    and the shard is untouched until the directory work is done), scanning the rings
//!    only when its doorbell moved (`waker` module docs: a hint; the round scans every
//!    ring whatever it says). A client's message of
//!    another kind is held, one per client, and handled before anything else of that
//!    client's, so per-client order (invariant 1) holds.
//! 10. Operations for a peer do not wake it when it is parked, unless its ring is half
//!     full: a parked core is idle, and its next round applies them before it answers any
//!     query (its peers come first, invariant 4). That round starts with its next message
//!     of any other kind (a query, a fence, a promotion step: they all wake it), its park
//!     bound ([`PARK`], or the host's), or, for a hosted core, a read in place on its
//!     thread (`CoreHost` steps a parked core that has peer messages first). Measured on
//!     the Mooncake replay through the proxy (docs/benchmarks.md, issue 31): a wake-up per
//!     operations message was most of what the second core cost.
//! 7. Trunk promotions follow `promotion`'s protocol; while frozen for one, the core takes
//!    no ingest-client message and does not close its peer rings.

use super::core_state::{Core, State, push_reply};
use super::home::home_core;
use super::msg::{CoreSummary, FromCore, PeerMsg, Tagged, ToCore};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerKey};
use crate::matches::Matches;
use crate::ring::{Consumer, PopError};
use crate::sharding::ops::{BlockOp, OpBatch};
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use crate::sole_writer::{Reader, SoleWriter};
use std::collections::VecDeque;
use std::time::Duration;

/// Messages taken from one query client per round (each is one query).
const QUERY_BURST: usize = 64;
/// Messages taken from one ingest client per round.
const INGEST_BURST: usize = 2;
/// Blocks of an event slice (and of peers' operations) a hosted core applies per round. Its
/// thread runs other tasks between rounds (the HTTP edge, awaited replies): one round of
/// ~256 blocks is ~10-20 µs here, where a whole 64-event slice of 128-block stores took
/// ~200 µs. A core on a thread of its own has no such tasks and answers ring queries
/// between events anyway, so it takes whole slices: measured, the bound cost its QUIC
/// ingest 10-15% in polls and peer messages (docs/benchmarks.md, issue 10).
pub(crate) const HOSTED_STEP_BLOCKS: usize = 256;
/// Blocks of one batch a core applies to its shard before it answers the queries waiting
/// on its rings (invariant 4): a long prefill's event (thousands of blocks) is applied a
/// chunk at a time. Measured on W1 (issue 32), chunks of 32 split its 96-block stores into
/// appends that grow their runs and cost 10-30% of the store rate, with no gain in the read
/// p99 under ingest (the directory work's pauses, invariant 9, brought that from ~230 µs to
/// ~20 µs); 128 leaves W1's events whole.
pub(crate) const QUERY_CHUNK_BLOCKS: usize = 128;
/// Messages taken from one peer per round.
const PEER_BURST: usize = 16;
/// Idle rounds spent spinning, then yielding, before parking.
const SPIN_ROUNDS: u32 = 64;
pub(crate) const YIELD_ROUNDS_SPARE_CPU: u32 = 1_064;
/// When the cores take every CPU, whatever else runs (the HTTP edge, decoders, clients)
/// competes with them, and each `sched_yield` is a syscall that takes the run-queue lock:
/// measured on the 2-CPU machine under `/v1/route` load, 1,000 yields per idle stretch cost
/// ~20% of the CPU time. Park soon instead; clients wake a parked core.
pub(crate) const YIELD_ROUNDS_SHARED_CPU: u32 = SPIN_ROUNDS + 16;
/// Longest park. Wake-ups are not missed (the protocol is loom-checked, and closing a ring
/// wakes its reader), so this only bounds an idle core's wake-up rate: 16 idle cores cost
/// well under 1% of a CPU.
const PARK: Duration = Duration::from_millis(20);

/// Answers the queries waiting on the query clients' rings while the core is in the middle
/// of an event's directory work (a [`BlockStore::pause`]): the shard is whole then, only the
/// directories are mid-event. Only `Query` messages are answered; a client's other message
/// is held for the round to handle in order, and that client waits until it has been
/// (invariant 9).
///
/// [`BlockStore::pause`]: crate::directories::BlockStore::pause
fn answer_waiting_queries(
    shard: &SoleWriter<Shard>,
    clients_in: &mut [Consumer<Tagged<ToCore>>],
    clients_out: &mut [crate::ring::Producer<Tagged<FromCore>>],
    client_wakers: &[std::sync::Arc<super::waker::Waker>],
    doorbell: Option<&super::waker::Waker>,
    first: usize,
    st: &mut State,
) {
    // Nothing pushed since the last look: no ring to scan (the round scans them anyway).
    if let Some(d) = doorbell
        && !d.rung_since(&mut st.rung_seen)
    {
        return;
    }
    for (i, inbox) in clients_in.iter_mut().enumerate().skip(first) {
        if st.held.get(i).is_some_and(Option::is_some) {
            continue;
        }
        for _ in 0..QUERY_BURST {
            let Ok(Tagged { tag, msg }) = inbox.try_pop() else {
                break;
            };
            match msg {
                ToCore::Query(seqs) => {
                    st.queries += 1;
                    let m = shard.read(|s| s.find_matches(&seqs));
                    push_reply(clients_out, client_wakers, i, tag, FromCore::Matches(m));
                }
                other => {
                    if let Some(h) = st.held.get_mut(i) {
                        *h = Some(Tagged { tag, msg: other });
                    }
                    break;
                }
            }
        }
    }
}

/// Nothing queued on `ring`, and it has not closed since it was last seen open.
fn unchanged<T>(ring: &Consumer<T>, seen_open: bool) -> bool {
    ring.is_empty() && !(seen_open && ring.is_closed())
}

/// Aborts the process if the core thread unwinds.
struct AbortOnPanic(usize);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "kvengine: core {} panicked; aborting rather than serving wrong answers",
                self.0
            );
            std::process::abort();
        }
    }
}

/// A core and its per-run state, stepped one round at a time: by its own thread
/// ([`Core::run`]) or by the thread that hosts it ([`super::CoreHost`]).
pub(crate) struct Runner<P> {
    core: Core<P>,
    st: State,
    clients_open: Vec<bool>,
    peers_open: Vec<bool>,
}

impl<P: ShardPolicy> Runner<P> {
    pub(crate) fn new(core: Core<P>) -> Self {
        let mut st = State::new(core.cores());
        st.held = (0..core.clients_in.len()).map(|_| None).collect();
        let clients_open = vec![true; core.clients_in.len()];
        let peers_open = vec![true; core.peers_in.len()];
        Self {
            core,
            st,
            clients_open,
            peers_open,
        }
    }

    pub(crate) fn shard_id(&self) -> ShardId {
        self.core.me()
    }

    /// One round: peers' operations, pending peer messages, then clients in serving order
    /// (invariant 4), and shutdown once everything is gone (invariant 5). Returns whether
    /// anything was done. A panic inside aborts the process (invariant 6), whichever
    /// thread steps.
    pub(crate) fn step(&mut self) -> bool {
        let _guard = AbortOnPanic(self.core.me().idx());
        let Self {
            core,
            st,
            clients_open,
            peers_open,
        } = self;
        let mut progressed = core.serve_peers(st, peers_open);
        progressed |= core.flush_pending(st);
        let n = core.clients_in.len();
        let ingest = core.ingest_clients.min(n);
        if st.rest.is_some() && !st.no_events() {
            core.continue_events(st);
            progressed = true;
        }
        // While frozen for a promotion, or while peers are backed up, take no events.
        for i in (ingest..n).chain(0..ingest) {
            let burst = if i < ingest {
                INGEST_BURST
            } else {
                QUERY_BURST
            };
            for _ in 0..burst {
                // Checked before every ingest message, not once per round: handling one
                // can freeze this core (the coordinator starts a promotion when the
                // events it routed make a junction), and then the next must wait.
                if i < ingest && (st.no_events() || st.rest.is_some()) {
                    break;
                }
                match core.next_msg(st, i) {
                    Ok(msg) => {
                        progressed = true;
                        core.handle_client(st, i, msg);
                    }
                    Err(PopError::Empty) => break,
                    Err(PopError::Closed) => {
                        if let Some(o) = clients_open.get_mut(i) {
                            *o = false;
                        }
                        break;
                    }
                }
            }
        }
        st.clients_gone = clients_open.iter().all(|o| !o);
        if st.promo.busy() && peers_open.iter().any(|o| !o) {
            core.abandon_round(st);
        }
        let nothing_pending = st.pending.iter().all(VecDeque::is_empty);
        if !st.closed_peers
            && nothing_pending
            && st.rest.is_none()
            && st.clients_gone
            && !st.promo.busy()
        {
            // No client can send more events, and everything we produced is on the
            // rings: close ours, so the peers can finish too.
            for p in &mut core.peers_out {
                *p = None;
            }
            // A closed ring does not wake its reader: wake the peers ourselves.
            for (i, w) in core.wakers.iter().enumerate() {
                if i != core.me().idx() {
                    w.wake();
                }
            }
            st.closed_peers = true;
            progressed = true;
        }
        progressed
    }

    /// A round for a host that waits for another core's answer to its own query: the
    /// queries waiting on this core's rings, and nothing else. The answer needs nothing
    /// from this core (a core never waits on a peer ring, invariant 3), and an event
    /// started now would delay noticing it by the event's whole work; the host steps
    /// fully again once it has its answer.
    pub(crate) fn step_queries(&mut self) -> bool {
        let _guard = AbortOnPanic(self.core.me().idx());
        self.core.serve_queries(&mut self.st)
    }

    /// The core has closed its rings and every peer has closed theirs: it has ended.
    pub(crate) fn finished(&self) -> bool {
        self.st.closed_peers && self.peers_open.iter().all(|o| !o)
    }

    /// A peer's message waits on this core's rings.
    pub(crate) fn peer_ops_waiting(&self) -> bool {
        self.core.peers_in.iter().any(|r| !r.is_empty())
    }

    /// Messages this core sent `peer` wait on its ring, or for room on it.
    pub(crate) fn sent_untaken(&self, peer: usize) -> bool {
        let on_ring = self
            .core
            .peers_out
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|r| !r.is_empty());
        on_ring || self.st.pending.get(peer).is_some_and(|q| !q.is_empty())
    }

    /// Messages for peers wait for room: keep going rather than park.
    pub(crate) fn peers_backed_up(&self) -> bool {
        self.st.pending.iter().any(|q| !q.is_empty())
    }

    /// Nothing queued for the core, and no ring closed since it last looked (a close must
    /// be noticed now, not at the next timeout). Call after `prepare_sleep`.
    pub(crate) fn quiet(&self) -> bool {
        // A slice left for later is work, unless a freeze holds it (the thaw arrives on a
        // peer ring, and wakes the core).
        (self.st.rest.is_none() || self.st.promo.frozen())
            && !self.peers_backed_up()
            && self.st.held.iter().all(Option::is_none)
            && self
                .core
                .clients_in
                .iter()
                .zip(&self.clients_open)
                .all(|(c, o)| unchanged(c, *o))
            && self
                .core
                .peers_in
                .iter()
                .zip(&self.peers_open)
                .all(|(c, o)| unchanged(c, *o))
    }

    /// Answers a query for this core's shard in place (the caller runs on this core's
    /// thread).
    pub(crate) fn query_local(&mut self, seqs: &[SeqHash]) -> Matches {
        let _guard = AbortOnPanic(self.core.me().idx());
        self.st.queries += 1;
        self.core.shard.read(|s| s.find_matches(seqs))
    }

    /// Answers a query for another core's shard in place, on this core's thread (counted
    /// as this core's: it answered).
    pub(crate) fn query_other(&mut self, shard: &Reader<Shard>, seqs: &[SeqHash]) -> Matches {
        let _guard = AbortOnPanic(self.core.me().idx());
        self.st.queries += 1;
        shard.read(|s| s.find_matches(seqs))
    }

    pub(crate) fn summary(&self) -> CoreSummary {
        self.core.summary(&self.st)
    }
}

impl<P: ShardPolicy> Core<P> {
    /// Runs the core on the calling thread (its own) until it ends; see the module docs.
    pub(crate) fn run(self) -> CoreSummary {
        let me = self.me().idx();
        let _guard = AbortOnPanic(me);
        let my_waker = self.wakers.get(me).cloned().unwrap_or_default();
        my_waker.register_current();
        let yield_rounds = self.yield_rounds;
        let mut runner = Runner::new(self);
        let mut idle = 0u32;
        loop {
            let progressed = runner.step();
            if runner.finished() {
                break;
            }
            if progressed {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if idle < SPIN_ROUNDS {
                std::hint::spin_loop();
            } else if idle < yield_rounds || runner.peers_backed_up() {
                std::thread::yield_now();
            } else {
                my_waker.prepare_sleep();
                // Quiet: nothing queued, and no ring closed since we last looked (a close
                // must be noticed now, not at the next timeout).
                if runner.quiet() {
                    my_waker.sleep(PARK);
                } else {
                    my_waker.cancel_sleep();
                }
            }
        }
        runner.summary()
    }

    /// Takes at most [`PEER_BURST`] messages from each peer, and stops taking operations
    /// once about `step_blocks` blocks of them are applied this round (invariant 4).
    fn serve_peers(&mut self, st: &mut State, open: &mut [bool]) -> bool {
        let mut progressed = false;
        let mut applied = 0usize;
        for i in 0..self.peers_in.len() {
            for _ in 0..PEER_BURST {
                if applied >= self.step_blocks {
                    break;
                }
                let Some(inbox) = self.peers_in.get_mut(i) else {
                    break;
                };
                match inbox.try_pop() {
                    Ok(PeerMsg::Ops(batches)) => {
                        progressed = true;
                        for b in &batches {
                            self.apply_chunked(st, b);
                            applied += b.seqs.len().max(1);
                        }
                        self.note_junctions(st);
                    }
                    Ok(PeerMsg::Fence { client, tag }) => {
                        progressed = true;
                        if st.syncs.peer_fence(client, tag) {
                            self.reply(client, tag, FromCore::Synced);
                        }
                    }
                    Ok(other) => {
                        progressed = true;
                        self.handle_promotion(st, other);
                    }
                    Err(PopError::Empty) => break,
                    Err(PopError::Closed) => {
                        if let Some(o) = open.get_mut(i) {
                            *o = false;
                        }
                        break;
                    }
                }
            }
        }
        progressed
    }

    fn handle_client(&mut self, st: &mut State, client: usize, tagged: Tagged<ToCore>) {
        let me = self.me();
        let cores = self.cores();
        let Tagged { tag, msg } = tagged;
        match msg {
            ToCore::Events(slice, mark) => {
                st.rest = Some(slice);
                st.rest_mark = mark;
                self.continue_events(st);
            }
            ToCore::Apply(key, ev) => {
                let r = self.apply_event(st, key, &ev);
                self.flush_outbox(st);
                self.note_junctions(st);
                self.reply(client, tag, FromCore::Applied(r));
            }
            ToCore::Clear(key) => {
                let n = self.ingest.clear(key, &mut self.outbox);
                self.flush_outbox(st);
                self.reply(client, tag, FromCore::Count(n));
            }
            ToCore::RemoveWorker(w) => {
                let n = self.ingest.remove_worker(w, &mut self.outbox);
                self.flush_outbox(st);
                self.reply(client, tag, FromCore::Count(n));
            }
            ToCore::CachedBlocks(key) => {
                let n = self.ingest.cached_blocks(key) as usize;
                self.reply(client, tag, FromCore::Count(n));
            }
            ToCore::Query(seqs) => {
                st.queries += 1;
                let m = self.shard.read(|s| s.find_matches(&seqs));
                self.reply(client, tag, FromCore::Matches(m));
            }
            ToCore::Sync => {
                for p in 0..cores {
                    if p != me.idx() {
                        self.send_peer(st, p, PeerMsg::Fence { client, tag });
                    }
                }
                if st.syncs.own_sync(client, tag) {
                    self.reply(client, tag, FromCore::Synced);
                }
            }
            ToCore::Stats => {
                let s = self.summary(st);
                self.reply(client, tag, FromCore::Stats(Box::new(s)));
            }
            ToCore::Snapshot(buffers) => self.request_snapshot(st, client, tag, buffers),
            #[cfg(any(test, feature = "test-util"))]
            ToCore::Stall(d) => {
                std::thread::sleep(d);
                self.reply(client, tag, FromCore::Count(0));
            }
            #[cfg(any(test, feature = "test-util"))]
            ToCore::Panic => panic!("asked to panic (test hook)"),
        }
    }

    /// Applies the events of `st.rest` whose worker lives here, until about `step_blocks`
    /// blocks are done (invariant 4); what is left stays in `st.rest`.
    fn continue_events(&mut self, st: &mut State) {
        let Some((events, range)) = st.rest.take() else {
            return;
        };
        let me = self.me();
        let cores = self.cores();
        let mut budget = self.step_blocks;
        let mut next = range.start;
        while next < range.end && budget > 0 {
            let Some((key, ev)) = events.get(next) else {
                break;
            };
            next += 1;
            if home_core(key.worker, cores) == me {
                // This shard's share is applied at once, a chunk at a time, and queries
                // are answered at the directories' pauses, so a waiting query sees at most
                // one chunk's work ahead of it; peers' shares go at the end of the round.
                // Refusals are counted by the directories.
                let _ = self.apply_event(st, *key, ev);
                budget = budget.saturating_sub(ev.blocks().max(1));
            }
        }
        self.flush_outbox(st);
        // The rest of the slice is put back (or its mark recorded) before `note_junctions`:
        // on the coordinator it may start a round, and a snapshot round must see a half
        // applied slice to put its freeze off (an image must never hold part of a batch
        // without its mark; found by bin/tests/crash_restart.rs as a block lost after a
        // restart, the batch's first events applied twice).
        if next < range.end {
            st.rest = Some((events, next..range.end));
        } else if let Some(m) = st.rest_mark.take() {
            self.ingest.mark(m);
        }
        self.note_junctions(st);
        if st.rest.is_none() {
            // A snapshot round waits for the slice to finish before this core freezes.
            self.freeze_deferred(st);
        }
    }

    /// Applies this shard's share of the event just routed (the outbox's queue for this
    /// shard), a chunk at a time (invariant 4).
    fn apply_own(&mut self, st: &mut State) {
        let own = self.outbox.take(self.me());
        for b in &own {
            self.apply_chunked(st, b);
        }
    }

    /// Applies `batch` [`QUERY_CHUNK_BLOCKS`] blocks at a time, answering waiting queries
    /// after each chunk: a stored chain in pieces, each continuing the last block of the
    /// one before (the same chain, as a worker that sent it in several events would have
    /// made it), a removal in pieces of its list.
    fn apply_chunked(&mut self, st: &mut State, batch: &OpBatch) {
        let mut parent = match batch.op {
            BlockOp::Store { parent } => parent,
            BlockOp::Remove => None,
        };
        for chunk in batch.seqs.chunks(QUERY_CHUNK_BLOCKS) {
            self.prepare_section(chunk.len());
            match batch.op {
                BlockOp::Store { .. } => {
                    self.shard.write(|s| s.store_seqs(batch.key, parent, chunk));
                    parent = chunk.last().copied();
                }
                BlockOp::Remove => {
                    self.shard.write(|s| s.remove_seqs(batch.key, chunk));
                    // Dead entries that now outnumber live blocks: rebuilt at once (the
                    // memory goes back, DESIGN.md), outside a section.
                    self.prepare_section(0);
                }
            }
            self.serve_queries(st);
        }
    }

    /// Before a write section of up to `n` blocks: a seq_hash table rebuild the section
    /// would do is done here instead, reading the shard without a lock while the other
    /// hosts read it too (`sole_writer` invariant 2); only installing it is a section.
    /// Measured on W3 with a probe: rebuilds inside sections held readers 4-67 ms.
    fn prepare_section(&mut self, n: usize) {
        if let Some(fresh) = self.shard.read(|s| s.rebuilt_table_if_due(n)) {
            let old = self.shard.write(|s| s.install_table(fresh));
            drop(old);
        }
    }

    /// Answers queries already waiting (between two events of a slice). Only query
    /// clients are served here, so per-client order is kept. Returns whether any was.
    fn serve_queries(&mut self, st: &mut State) -> bool {
        let mut served = false;
        for i in self.ingest_clients..self.clients_in.len() {
            for _ in 0..QUERY_BURST {
                match self.next_msg(st, i) {
                    Ok(msg) => {
                        served = true;
                        self.handle_client(st, i, msg);
                    }
                    Err(_) => break,
                }
            }
        }
        served
    }

    /// Client `i`'s next message: the one held for it at a pause (invariant 9), else the
    /// next on its ring.
    fn next_msg(&mut self, st: &mut State, i: usize) -> Result<Tagged<ToCore>, PopError> {
        if let Some(msg) = st.held.get_mut(i).and_then(Option::take) {
            return Ok(msg);
        }
        match self.clients_in.get_mut(i) {
            Some(inbox) => inbox.try_pop(),
            None => Err(PopError::Empty),
        }
    }

    /// Applies one event of this core's workers, answering the queries waiting on the
    /// rings at the directories' pauses (invariant 9), then applies this shard's share.
    fn apply_event(
        &mut self,
        st: &mut State,
        key: WorkerKey,
        ev: &KvEvent,
    ) -> crate::error::Result<crate::directories::Applied> {
        let Core {
            ingest,
            outbox,
            shard,
            clients_in,
            clients_out,
            client_wakers,
            ingest_clients,
            wakers,
            ..
        } = self;
        let first = *ingest_clients;
        let doorbell = wakers.get(shard.read(Shard::id).idx()).map(|w| &**w);
        let mut pause = || {
            answer_waiting_queries(
                shard,
                clients_in,
                clients_out,
                client_wakers,
                doorbell,
                first,
                st,
            );
        };
        let r = ingest.apply_pausing(key, ev, outbox, &mut pause);
        self.apply_own(st);
        r
    }

    /// Applies this core's share of the outbox, queues the rest for the peers.
    fn flush_outbox(&mut self, st: &mut State) {
        let me = self.me().idx();
        for s in 0..self.outbox.shards() {
            let batches = self.outbox.take(ShardId(s as u16));
            if batches.is_empty() {
                continue;
            }
            if s == me {
                // A chunk per write section: the other hosts read this shard meanwhile.
                for b in &batches {
                    self.apply_chunked(st, b);
                }
            } else {
                self.send_peer(st, s, PeerMsg::Ops(batches));
            }
        }
    }

    fn summary(&self, st: &State) -> CoreSummary {
        let (directory_entries, directory_bytes) = self.ingest.directory_size();
        CoreSummary {
            shard: self.me(),
            applied: self.shard.read(Shard::applied),
            inconsistencies: self.shard.read(Shard::inconsistencies) + st.lost_peer_msgs,
            queries: st.queries,
            index: self.shard.read(Shard::stats),
            directory_entries,
            directory_bytes,
            rejects: self.ingest.rejects().clone(),
            pinned_core: self.pinned_core,
            promotions: st.promo.rounds,
            junctions_reported: st.promo.reported,
            junctions_heard: st.promo.heard,
            promoting: st.promo.pending(),
            ring_backlog: self.clients_in.iter().map(|r| r.len()).sum::<usize>()
                + self.peers_in.iter().map(|r| r.len()).sum::<usize>(),
            pending_peer_msgs: st.pending.iter().map(VecDeque::len).sum(),
        }
    }
}
