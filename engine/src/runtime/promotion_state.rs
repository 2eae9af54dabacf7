//! The state of the trunk promotion protocol on one core: the round it is frozen for, and
//! on the coordinator (core 0) the queue and the round in progress.
//!
//! Plain data, a leaf of the runtime: the per-run state of a core
//! ([`State`](super::core_state::State)) holds a [`Promo`], the loop asks it whether the
//! core may take events, and `promotion` (the protocol) is the only writer of its fields.
//!
//! # Invariants
//! 1. `frozen` is `Some` exactly between a core's `Freeze` and its `Thaw` (`promotion`
//!    invariant 1): while it is, the core takes no ingest-client message.
//! 2. `active` is `Some` only on the coordinator, for the one round in progress.
//! 3. The counters (`rounds`, `reported`, `heard`) only grow.

use crate::ids::SeqHash;
use crate::sharding::ShardId;
use crate::sharding::promote::Promotion;
use crate::snapshot::image::CoreImage;
use hashbrown::HashMap;
use std::sync::Arc;

/// A round's junctions: (the shard exporting it, the block).
pub(super) type Junctions = Arc<[(ShardId, SeqHash)]>;

/// A snapshot freeze put off until this core's event slice is done.
#[derive(Debug)]
pub(super) struct Deferred {
    pub(super) epoch: u64,
    pub(super) junctions: Junctions,
    pub(super) buffer: Option<Box<CoreImage>>,
}

/// The round a core is frozen for.
#[derive(Clone, Debug)]
pub(super) struct Round {
    pub(super) epoch: u64,
    pub(super) junctions: Arc<[(ShardId, SeqHash)]>,
    /// A snapshot round: this core images itself once drained.
    pub(super) snapshot: bool,
    /// Its image, until sent to the coordinator.
    pub(super) image: Option<Box<CoreImage>>,
    /// Distinct shards among `junctions`.
    pub(super) exporters: usize,
    /// This core exported its junctions (if it has any).
    pub(super) exported: bool,
    /// `Graft`s received from other exporters.
    pub(super) grafts: usize,
    /// This core told the coordinator it grafted everything.
    pub(super) grafted: bool,
}

/// The coordinator's view of the round in progress.
#[derive(Debug, Default)]
pub(super) struct Active {
    pub(super) epoch: u64,
    /// Cores (the coordinator included) that grafted every path.
    pub(super) grafted: usize,
    pub(super) promotions: Vec<Arc<[Promotion]>>,
    /// A snapshot round: the clients waiting for it, and the images so far by core.
    pub(super) snapshot: Vec<(usize, u64)>,
    pub(super) images: Vec<(usize, Box<CoreImage>)>,
}

/// One core's part in promotions.
#[derive(Debug, Default)]
pub(crate) struct Promo {
    pub(super) frozen: Option<Round>,
    /// `Drained` markers received per epoch (they may arrive before the `Freeze`).
    pub(super) drained: HashMap<u64, usize>,
    pub(super) queue: Vec<(ShardId, SeqHash)>,
    pub(super) active: Option<Active>,
    /// Coordinator: clients waiting for a snapshot round to start (`(client, tag)`).
    pub(super) snapshot_waiters: Vec<(usize, u64)>,
    /// Coordinator: image buffers for the next snapshot round, by core.
    pub(super) snapshot_buffers: Vec<CoreImage>,
    /// A snapshot round's freeze that waits for this core's event slice to finish.
    pub(super) deferred: Option<Deferred>,
    pub(super) next_epoch: u64,
    /// Promotions this core published (coordinator) or grafted.
    pub(crate) rounds: u64,
    /// Junctions this core reported to the coordinator.
    pub(crate) reported: u64,
    /// Coordinator: junction reports it has taken (queued, or dropped as already promoted).
    pub(crate) heard: u64,
}

impl Promo {
    /// Is this core frozen (invariant 1)?
    pub(crate) fn frozen(&self) -> bool {
        self.frozen.is_some()
    }

    /// Is a round in progress here (a core must not close its rings then)?
    pub(crate) fn busy(&self) -> bool {
        self.frozen.is_some() || self.active.is_some() || self.deferred.is_some()
    }

    /// Is a round in progress or queued (coordinator)?
    pub(crate) fn pending(&self) -> bool {
        self.busy() || !self.queue.is_empty() || !self.snapshot_waiters.is_empty()
    }
}
