//! One core's parts and per-run state, and the primitives every part of its work uses:
//! sending to a peer core, replying to a client.
//!
//! The lowest layer of a core: [`shard_loop`](super::shard_loop) runs the rounds and
//! `promotion` the trunk promotion protocol, both over these parts; this module knows
//! neither. The promotion protocol's own state is a plain field here
//! ([`Promo`], from `promotion_state`).
//!
//! # Invariants
//! 1. A message for a peer is pushed onto its ring only when nothing waits for that peer in
//!    `pending`: per peer, messages leave in the order they were sent.
//! 2. Sending and replying never wait: a full peer ring queues the message in `pending`, a
//!    full or gone client ring drops the reply (its caller times out or is gone).
//!
//! # Concurrency
//! Owned by the core's thread (or the thread hosting it); only the rings cross threads.

use super::barrier::SyncBarrier;
use super::msg::{EventSlice, FromCore, PeerMsg, Tagged, ToCore};
use super::promotion_state::Promo;
use super::waker::Waker;
use crate::ring::{Consumer, Producer, PushError};
use crate::sharding::ingest::{Ingest, Outbox};
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use crate::snapshot::StreamMark;
use crate::snapshot::image::EngineImage;
use crate::sole_writer::SoleWriter;
use std::collections::VecDeque;
use std::sync::Arc;

/// One core's parts: its shard, its share of the ingest, and its rings.
pub(crate) struct Core<P> {
    /// Written only by this core; the other cores' hosts read it in place (`hosted`
    /// invariant 3), so every write section is one chunk at most (`shard_loop` invariant 4).
    pub shard: SoleWriter<Shard>,
    pub ingest: Ingest<P>,
    pub outbox: Outbox,
    pub clients_in: Vec<Consumer<Tagged<ToCore>>>,
    pub clients_out: Vec<Producer<Tagged<FromCore>>>,
    /// Clients `0..ingest_clients` are ingest handles, the rest query handles.
    pub ingest_clients: usize,
    pub peers_in: Vec<Consumer<PeerMsg>>,
    /// Indexed by core id; `None` for this core (and once closed at shutdown).
    pub peers_out: Vec<Option<Producer<PeerMsg>>>,
    pub wakers: Arc<[Arc<Waker>]>,
    /// Clients' wakers, by client index: a client parked on its reply ring is woken after
    /// the reply is pushed.
    pub client_wakers: Arc<[Arc<Waker>]>,
    pub pinned_core: Option<usize>,
    /// Idle rounds before parking
    /// ([`YIELD_ROUNDS_SPARE_CPU`](super::shard_loop::YIELD_ROUNDS_SPARE_CPU) or
    /// [`YIELD_ROUNDS_SHARED_CPU`](super::shard_loop::YIELD_ROUNDS_SHARED_CPU)).
    pub yield_rounds: u32,
    /// Blocks applied per round ([`HOSTED_STEP_BLOCKS`](super::shard_loop::HOSTED_STEP_BLOCKS) or unbounded; `shard_loop` invariant 4).
    pub step_blocks: usize,
}

/// Per-run state of a core.
pub(crate) struct State {
    /// Messages for each peer waiting for room on its ring (`shard_loop` invariant 3).
    pub(super) pending: Vec<VecDeque<PeerMsg>>,
    /// Syncs waiting for this core's own `Sync` or for peers' fences (`shard_loop` invariant 2).
    pub(super) syncs: SyncBarrier,
    /// Queries answered.
    pub(super) queries: u64,
    /// Messages for peers whose ring had closed.
    pub(super) lost_peer_msgs: u64,
    /// This core's part in trunk promotions (`promotion`; its state is `promotion_state`'s).
    pub(crate) promo: Promo,
    /// This core has closed its rings to the peers (shutting down).
    pub(crate) closed_peers: bool,
    /// Every client ring is closed.
    pub(crate) clients_gone: bool,
    /// The part of an event slice not applied yet (`shard_loop` invariant 4).
    pub(crate) rest: Option<EventSlice>,
    /// The stream mark to record once `rest` is applied.
    pub(super) rest_mark: Option<StreamMark>,
    /// Per client, a message taken off its ring at a pause but not answerable there
    /// (`shard_loop` invariant 9); handled before the client's next.
    pub(super) held: Vec<Option<Tagged<ToCore>>>,
    /// This core's doorbell as the last pause read it (`waker` module docs).
    pub(super) rung_seen: u64,
}

impl State {
    /// The state a core starts a run with, among `cores` cores.
    pub(super) fn new(cores: usize) -> Self {
        Self {
            pending: (0..cores).map(|_| VecDeque::new()).collect(),
            syncs: SyncBarrier::new(cores.saturating_sub(1)),
            queries: 0,
            lost_peer_msgs: 0,
            promo: Promo::default(),
            closed_peers: false,
            clients_gone: false,
            rest: None,
            rest_mark: None,
            held: Vec::new(),
            rung_seen: 0,
        }
    }

    /// No events may be taken now: frozen for a promotion, or messages for peers wait for
    /// room (`shard_loop` invariants 3 and 7).
    pub(super) fn no_events(&self) -> bool {
        self.promo.frozen() || self.pending.iter().any(|q| !q.is_empty())
    }
}

impl<P: ShardPolicy> Core<P> {
    /// This core's id (its shard's).
    pub(crate) fn me(&self) -> ShardId {
        self.shard.read(Shard::id)
    }

    /// The number of cores.
    pub(crate) fn cores(&self) -> usize {
        self.peers_out.len()
    }

    /// Sends `msg` to core `peer`, or queues it behind what already waits for that peer's
    /// ring (never waits: `shard_loop` invariant 3). A message for a closed ring is lost
    /// and counted.
    ///
    /// Operations do not wake a parked peer unless its ring is half full (`shard_loop`
    /// invariant 10): the peer applies them before the queries of its next round, which
    /// its next message of any other kind or its park bound starts.
    pub(crate) fn send_peer(&mut self, st: &mut State, peer: usize, msg: PeerMsg) {
        let Some(queue) = st.pending.get_mut(peer) else {
            return;
        };
        if !queue.is_empty() {
            queue.push_back(msg);
            return;
        }
        let urgent = !matches!(msg, PeerMsg::Ops(_));
        match self.peers_out.get_mut(peer) {
            Some(Some(ring)) => match ring.try_push(msg) {
                Ok(()) => {
                    if (urgent || ring.len() * 2 >= ring.capacity())
                        && let Some(w) = self.wakers.get(peer)
                    {
                        w.wake();
                    }
                }
                Err(PushError::Full(m)) => queue.push_back(m),
                Err(PushError::Closed(_)) => st.lost_peer_msgs += 1,
            },
            _ => st.lost_peer_msgs += 1,
        }
    }

    /// Moves queued peer messages onto their rings while there is room; whether any moved.
    pub(super) fn flush_pending(&mut self, st: &mut State) -> bool {
        let mut progressed = false;
        for (peer, queue) in st.pending.iter_mut().enumerate() {
            while let Some(msg) = queue.pop_front() {
                let Some(Some(ring)) = self.peers_out.get_mut(peer) else {
                    st.lost_peer_msgs += 1;
                    continue;
                };
                match ring.try_push(msg) {
                    Ok(()) => {
                        progressed = true;
                        if let Some(w) = self.wakers.get(peer) {
                            w.wake();
                        }
                    }
                    Err(PushError::Full(m)) => {
                        queue.push_front(m);
                        break;
                    }
                    Err(PushError::Closed(_)) => st.lost_peer_msgs += 1,
                }
            }
        }
        progressed
    }

    /// Replies to a call this core cannot answer (the client then fails it).
    pub(crate) fn reply_count(&mut self, client: usize, tag: u64) {
        self.reply(client, tag, FromCore::Count(0));
    }

    /// Replies with a snapshot.
    pub(crate) fn reply_snapshot(&mut self, client: usize, tag: u64, image: Box<EngineImage>) {
        self.reply(client, tag, FromCore::Snapshot(image));
    }

    /// Pushes a reply to `client` and wakes it (a client that is gone is skipped).
    pub(super) fn reply(&mut self, client: usize, tag: u64, msg: FromCore) {
        push_reply(&mut self.clients_out, &self.client_wakers, client, tag, msg);
    }
}

/// Pushes a reply to `client` and wakes it (a client that is gone is skipped): `Core::reply`
/// over the two fields it needs, for callers that hold other fields of the core.
pub(super) fn push_reply(
    clients_out: &mut [Producer<Tagged<FromCore>>],
    client_wakers: &[Arc<Waker>],
    client: usize,
    tag: u64,
    msg: FromCore,
) {
    if let Some(out) = clients_out.get_mut(client) {
        // A client that is gone no longer needs its answer, and one that gave up on older
        // calls drains their late replies before its next one, so a reply ring fills only
        // if a client stops reading: its caller then times out.
        let _ = out.try_push(Tagged { tag, msg });
        if let Some(w) = client_wakers.get(client) {
            w.wake();
        }
    }
}
