//! Promoting junctions into the trunk while the cores run: a short freeze coordinated by
//! core 0.
//!
//! `sharding::promote` requires that no operation routed by the old trunk is in flight
//! when the new one is published. The single-threaded engine gets that for free; here the
//! cores agree on it by message:
//!
//! 1. A core that routes enough stores under one block (or whose shard makes a block branch
//!    past the policy's junction threshold) sends `Junction` to the coordinator (core 0),
//!    which queues it and runs one round at a time, for every junction queued when the
//!    round starts (a workload's first junctions tend to appear together: one freeze for
//!    all of them).
//! 2. The coordinator sends `Freeze` with the round's junctions to every core and freezes
//!    itself. A frozen core takes no more messages from ingest clients (queries and peers
//!    are still served) and sends `Drained` to every other core, behind everything it sent
//!    them before.
//! 3. Each core holding some of the junctions (an *exporter*), once it has `Drained` from
//!    every other core (so every operation for its shard from before the freeze is
//!    applied), exports their paths and sends them (`Graft`) to every other core. A core
//!    that has grafted what every other exporter sent tells the coordinator (`Grafted`).
//! 4. When every core has grafted, the coordinator publishes the new trunk and sends
//!    `Thaw`; each core picks up the trunk and takes events again.
//!
//! Queries keep flowing: before the publication they are routed by the old trunk to the
//! shards that have the whole paths, after it by the new one to shards that grafted them.
//!
//! # Invariants
//! 1. A core takes no ingest-client message between its `Freeze` and its `Thaw`.
//! 2. An export happens after the exporter has applied every operation sent to it before
//!    any core froze (rings are FIFO and each core's `Drained` follows its operations).
//! 3. The trunk is published only after every shard has grafted every path of the round.
//! 4. Shutdown: the coordinator starts no round once its clients are gone; a core that has
//!    closed its peer rings ignores `Freeze`; a core never closes its peer rings while
//!    frozen; and the coordinator abandons a round (thawing everyone, publishing nothing)
//!    if a peer ring closes under it.
//! 5. The paths grafted in one round are disjoint (`sharding::promote` invariant 3): paths
//!    of different exporters are (a non-trunk block lives in one shard), and an exporter
//!    exports its junctions with [`Shard::export_round`].
//!
//! # Concurrency
//! Each core's [`Promo`] is its own; the coordinator's also holds the queue and the round.
//!
//! [`Promo`]: super::promotion_state::Promo
//! [`Shard::export_round`]: crate::sharding::shard::Shard::export_round

use super::core_state::{Core, State};
use super::msg::PeerMsg;
use super::promotion_state::{Active, Deferred, Round};
use crate::ids::SeqHash;
use crate::sharding::promote::Promotion;
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use crate::snapshot::image::{CoreImage, EngineImage};
use std::sync::Arc;

/// The core that runs the rounds.
const COORDINATOR: usize = 0;

impl<P: ShardPolicy> Core<P> {
    fn coordinator(&self) -> bool {
        self.me().idx() == COORDINATOR
    }

    /// Sends `msg` to every other core whose ring is still open.
    fn broadcast(&mut self, st: &mut State, msg: impl Fn() -> PeerMsg) {
        for p in 0..self.cores() {
            if p != self.me().idx() && matches!(self.peers_out.get(p), Some(Some(_))) {
                self.send_peer(st, p, msg());
            }
        }
    }

    /// After this core routed events or its shard changed: report new junctions (seen by
    /// the ingest as it routed stores, or by the shard as it branched) to the coordinator.
    pub(crate) fn note_junctions(&mut self, st: &mut State) {
        let mut junctions = self.ingest.take_junctions();
        if let Some((tip, fanout)) = self.shard.write(Shard::take_branch)
            && self.ingest.policy().is_junction(tip, fanout)
        {
            junctions.push((self.me(), tip));
        }
        for (from, tip) in junctions {
            st.promo.reported += 1;
            if self.coordinator() {
                self.queue_junction(st, from, tip);
            } else {
                self.send_peer(st, COORDINATOR, PeerMsg::Junction { from, tip });
            }
        }
    }

    /// Handles a promotion message from a peer; false if `msg` is not one.
    pub(crate) fn handle_promotion(&mut self, st: &mut State, msg: PeerMsg) -> bool {
        match msg {
            PeerMsg::Junction { from, tip } => self.queue_junction(st, from, tip),
            PeerMsg::Freeze {
                epoch,
                junctions,
                snapshot,
                buffer,
            } => {
                if !st.closed_peers {
                    self.freeze(
                        st,
                        epoch,
                        junctions,
                        snapshot.then(|| buffer.unwrap_or_default()),
                    );
                }
            }
            PeerMsg::Drained { epoch } => {
                *st.promo.drained.entry(epoch).or_insert(0) += 1;
                self.maybe_export(st);
            }
            PeerMsg::Graft { epoch, promotions } => self.graft(st, epoch, promotions),
            PeerMsg::Grafted { epoch, from, image } => {
                if let Some(a) = st.promo.active.as_mut().filter(|a| a.epoch == epoch) {
                    a.grafted += 1;
                    if let Some(img) = image {
                        a.images.push((from.idx(), img));
                    }
                }
                self.maybe_finish(st);
            }
            PeerMsg::Thaw { epoch } => self.thaw(st, epoch),
            PeerMsg::Ops(_) | PeerMsg::Fence { .. } => return false,
        }
        true
    }

    fn queue_junction(&mut self, st: &mut State, from: ShardId, tip: SeqHash) {
        st.promo.heard += 1;
        let known = st.promo.queue.iter().any(|&(_, t)| t == tip);
        if !st.clients_gone && !known && !self.ingest.policy().in_trunk(tip) {
            st.promo.queue.push((from, tip));
        }
        self.maybe_start(st);
    }

    /// A client asks for a snapshot (coordinator only; another core answers nothing
    /// useful, and the client's call fails).
    pub(crate) fn request_snapshot(
        &mut self,
        st: &mut State,
        client: usize,
        tag: u64,
        buffers: Vec<CoreImage>,
    ) {
        if !self.coordinator() {
            self.reply_count(client, tag);
            return;
        }
        st.promo.snapshot_waiters.push((client, tag));
        if st.promo.snapshot_buffers.is_empty() {
            st.promo.snapshot_buffers = buffers;
        }
        self.maybe_start(st);
    }

    fn maybe_start(&mut self, st: &mut State) {
        if st.promo.active.is_some() || st.clients_gone || st.closed_peers {
            return;
        }
        if !st.promo.snapshot_waiters.is_empty() {
            // A snapshot round carries no junctions: they wait for the next round, so the
            // images and the trunk they are taken with agree.
            st.promo.next_epoch += 1;
            let epoch = st.promo.next_epoch;
            st.promo.active = Some(Active {
                epoch,
                snapshot: std::mem::take(&mut st.promo.snapshot_waiters),
                ..Active::default()
            });
            let junctions: Arc<[(ShardId, SeqHash)]> = Arc::new([]);
            let mut buffers: Vec<Option<Box<CoreImage>>> =
                std::mem::take(&mut st.promo.snapshot_buffers)
                    .into_iter()
                    .map(|b| Some(Box::new(b)))
                    .collect();
            let me = self.me().idx();
            for p in 0..self.cores() {
                if p != me && matches!(self.peers_out.get(p), Some(Some(_))) {
                    let buffer = buffers.get_mut(p).and_then(Option::take);
                    let msg = PeerMsg::Freeze {
                        epoch,
                        junctions: junctions.clone(),
                        snapshot: true,
                        buffer,
                    };
                    self.send_peer(st, p, msg);
                }
            }
            let own = buffers
                .get_mut(me)
                .and_then(Option::take)
                .unwrap_or_default();
            self.freeze(st, epoch, junctions, Some(own));
            return;
        }
        let policy = self.ingest.policy();
        let junctions: Arc<[(ShardId, SeqHash)]> = std::mem::take(&mut st.promo.queue)
            .into_iter()
            .filter(|&(_, tip)| !policy.in_trunk(tip))
            .collect();
        if junctions.is_empty() {
            return;
        }
        st.promo.next_epoch += 1;
        let epoch = st.promo.next_epoch;
        st.promo.active = Some(Active {
            epoch,
            ..Active::default()
        });
        self.broadcast(st, || PeerMsg::Freeze {
            epoch,
            junctions: junctions.clone(),
            snapshot: false,
            buffer: None,
        });
        self.freeze(st, epoch, junctions, None);
    }

    /// Freezes now, or (a snapshot round while an event slice is half applied) once the
    /// slice is done: an image must not hold part of a marked batch. `snapshot`: a
    /// snapshot round, with this core's image buffer.
    fn freeze(
        &mut self,
        st: &mut State,
        epoch: u64,
        junctions: Arc<[(ShardId, SeqHash)]>,
        snapshot: Option<Box<CoreImage>>,
    ) {
        if snapshot.is_some() && st.rest.is_some() {
            st.promo.deferred = Some(Deferred {
                epoch,
                junctions,
                buffer: snapshot,
            });
            return;
        }
        let mut shards: Vec<ShardId> = junctions.iter().map(|h| h.0).collect();
        shards.sort_unstable();
        shards.dedup();
        let exports_here = shards.contains(&self.me());
        st.promo.frozen = Some(Round {
            epoch,
            junctions,
            snapshot: snapshot.is_some(),
            exported: !exports_here && snapshot.is_none(),
            image: snapshot,
            exporters: shards.len(),
            grafts: 0,
            grafted: false,
        });
        self.broadcast(st, || PeerMsg::Drained { epoch });
        self.maybe_export(st);
        self.maybe_grafted(st);
    }

    /// An exporter exports once every other core has drained into it (invariant 2).
    fn maybe_export(&mut self, st: &mut State) {
        let Some(round) = st.promo.frozen.as_ref().filter(|r| !r.exported) else {
            return;
        };
        let drained = st.promo.drained.get(&round.epoch).copied().unwrap_or(0);
        if drained + 1 < self.cores() {
            return;
        }
        let (epoch, junctions) = (round.epoch, round.junctions.clone());
        if round.snapshot {
            // Every operation any core produced before it froze is applied here, and no
            // core takes events until the thaw: this core's part of the cut.
            let mut image = st
                .promo
                .frozen
                .as_mut()
                .and_then(|r| r.image.take())
                .unwrap_or_default();
            self.shard.read(|s| s.image_into(&mut image));
            self.ingest.export(&mut image);
            if let Some(r) = st.promo.frozen.as_mut() {
                r.exported = true;
                r.image = Some(image);
            }
            self.maybe_grafted(st);
            return;
        }
        if let Some(r) = st.promo.frozen.as_mut() {
            r.exported = true;
        }
        let policy = self.ingest.policy();
        let me = self.me();
        // One round's paths are published together, so they are exported together:
        // disjoint, or the other shards would graft shared blocks twice (invariant 5).
        let tips = junctions.iter().filter(|h| h.0 == me).map(|h| h.1);
        let promotions: Arc<[Promotion]> = self
            .shard
            .read(|s| s.export_round(tips, |h| policy.in_trunk(h)))
            .into();
        self.broadcast(st, || PeerMsg::Graft {
            epoch,
            promotions: promotions.clone(),
        });
        if self.coordinator()
            && let Some(a) = st.promo.active.as_mut().filter(|a| a.epoch == epoch)
        {
            a.promotions.push(promotions);
        }
        self.maybe_grafted(st);
    }

    fn graft(&mut self, st: &mut State, epoch: u64, promotions: Arc<[Promotion]>) {
        for p in promotions.iter() {
            self.shard.write(|s| s.import(p));
            st.promo.rounds += 1;
        }
        if let Some(r) = st.promo.frozen.as_mut().filter(|r| r.epoch == epoch) {
            r.grafts += 1;
        }
        if self.coordinator()
            && let Some(a) = st.promo.active.as_mut().filter(|a| a.epoch == epoch)
        {
            a.promotions.push(promotions);
        }
        self.maybe_grafted(st);
    }

    /// A core that exported (if it had to) and grafted every other exporter's paths says so.
    fn maybe_grafted(&mut self, st: &mut State) {
        let Some(r) = st.promo.frozen.as_ref() else {
            return;
        };
        let others = r.exporters - usize::from(r.junctions.iter().any(|h| h.0 == self.me()));
        if r.grafted || !r.exported || r.grafts < others {
            return;
        }
        let epoch = r.epoch;
        let mut image = None;
        if let Some(r) = st.promo.frozen.as_mut() {
            r.grafted = true;
            image = r.image.take();
        }
        if self.coordinator() {
            let me = self.me().idx();
            if let Some(a) = st.promo.active.as_mut().filter(|a| a.epoch == epoch) {
                a.grafted += 1;
                if let Some(img) = image {
                    a.images.push((me, img));
                }
            }
            self.maybe_finish(st);
        } else {
            let from = self.me();
            self.send_peer(st, COORDINATOR, PeerMsg::Grafted { epoch, from, image });
        }
    }

    /// Publishes and thaws once every core grafted every path (invariant 3).
    fn maybe_finish(&mut self, st: &mut State) {
        let Some(a) = st.promo.active.as_ref() else {
            return;
        };
        if a.grafted < self.cores() {
            return;
        }
        let epoch = a.epoch;
        let promotions: Vec<Arc<[Promotion]>> = a.promotions.clone();
        for p in promotions.iter().flat_map(|ps| ps.iter()) {
            self.ingest.policy_mut().promote(&p.seqs(), &p.pins, p.from);
            st.promo.rounds += 1;
        }
        // Thawed first: answering moves the images (a clone only for a second waiter).
        let done = st.promo.active.take();
        self.broadcast(st, || PeerMsg::Thaw { epoch });
        self.thaw(st, epoch);
        if let Some(a) = done.filter(|a| !a.snapshot.is_empty()) {
            self.answer_snapshot(a);
        }
        self.maybe_start(st);
    }

    /// Coordinator, once every core sent its image: answers the round's waiters.
    fn answer_snapshot(&mut self, round: Active) {
        let Active {
            snapshot: mut waiters,
            mut images,
            ..
        } = round;
        images.sort_by_key(|(core, _)| *core);
        let image = EngineImage {
            shards: self.cores() as u32,
            policy: String::new(),
            trunk: self.ingest.policy().trunk_image(),
            cores: images.into_iter().map(|(_, img)| *img).collect(),
        };
        let last = waiters.pop();
        for (client, tag) in waiters {
            self.reply_snapshot(client, tag, Box::new(image.clone()));
        }
        if let Some((client, tag)) = last {
            self.reply_snapshot(client, tag, Box::new(image));
        }
    }

    /// After this core's event slice finished: the snapshot freeze it put off.
    pub(crate) fn freeze_deferred(&mut self, st: &mut State) {
        if let Some(d) = st.promo.deferred.take() {
            let buffer = d.buffer.unwrap_or_default();
            self.freeze(st, d.epoch, d.junctions, Some(buffer));
        }
    }

    fn thaw(&mut self, st: &mut State, epoch: u64) {
        if st.promo.frozen.as_ref().is_some_and(|r| r.epoch == epoch) {
            st.promo.frozen = None;
        }
        st.promo.drained.remove(&epoch);
        self.ingest.policy_mut().refresh();
    }

    /// Coordinator: a peer ring closed during a round (shutdown): thaw everyone, publish
    /// nothing (invariant 4).
    pub(crate) fn abandon_round(&mut self, st: &mut State) {
        let Some(a) = st.promo.active.take() else {
            return;
        };
        st.promo.queue.clear();
        let epoch = a.epoch;
        self.broadcast(st, || PeerMsg::Thaw { epoch });
        self.thaw(st, epoch);
    }
}
