//! What travels over the rings: client -> core, core -> client, core -> core.

use crate::directories::Applied;
use crate::error::{RejectCounts, Result};
use crate::event::KvEvent;
use crate::ids::{SeqHash, WorkerId, WorkerKey};
use crate::index::IndexStats;
use crate::matches::Matches;
use crate::sharding::ShardId;
use crate::sharding::ops::OpBatch;
use crate::sharding::promote::Promotion;
use crate::snapshot::StreamMark;
use crate::snapshot::image::{CoreImage, EngineImage};
use std::ops::Range;
use std::sync::Arc;

/// Events shared by reference: a client sends the same slice to every core, and each core
/// applies the events of the workers it is home to.
pub(crate) type EventSlice = (Arc<[(WorkerKey, KvEvent)]>, Range<usize>);

/// A client message or a core's reply, with the tag that pairs them: a client numbers its
/// calls, and a reply carries its call's tag, so a reply that arrives after its caller gave
/// up (a deadline passed) is recognised and discarded instead of answering the next call.
#[derive(Debug)]
pub(crate) struct Tagged<T> {
    /// The call's number on its client (0 for messages that get no reply).
    pub tag: u64,
    /// The message.
    pub msg: T,
}

/// A client's message to one core.
#[derive(Debug)]
pub(crate) enum ToCore {
    /// Apply the events of this slice whose worker lives on this core (no reply); then
    /// record the stream mark, if any (its worker lives here), so that a snapshot never
    /// holds part of a marked batch without its mark.
    Events(EventSlice, Option<StreamMark>),
    /// Apply one event (this core is its worker's home); reply `Applied`.
    Apply(WorkerKey, KvEvent),
    /// Clear one worker key (home core); reply `Count`.
    Clear(WorkerKey),
    /// Forget a worker (home core); reply `Count`.
    RemoveWorker(WorkerId),
    /// Distinct engine hashes a worker key holds (home core); reply `Count`.
    CachedBlocks(WorkerKey),
    /// A prefix query; reply `Matches`.
    Query(Box<[SeqHash]>),
    /// Reply `Synced` once every operation from events this client sent before is applied,
    /// on this core and by every peer.
    Sync,
    /// Reply with this core's figures.
    Stats,
    /// To the coordinator (core 0): reply `Snapshot` with the engine at a consistent cut
    /// (a snapshot round, `promotion`), written into these buffers (one per core, in core
    /// order; allocated and touched by the client, so the cores fill them without page
    /// faults while they are frozen).
    Snapshot(Vec<CoreImage>),
    /// Do nothing for this long, then reply `Count(0)`: a stuck core, for the tests of
    /// callers' deadlines.
    #[cfg(any(test, feature = "test-util"))]
    Stall(std::time::Duration),
    /// Panic: a core with a bug, for the test that the process then exits.
    #[cfg(any(test, feature = "test-util"))]
    Panic,
}

/// A core's reply to one client.
#[derive(Debug)]
pub(crate) enum FromCore {
    Matches(Matches),
    Applied(Result<Applied>),
    Count(usize),
    Synced,
    Stats(Box<CoreSummary>),
    Snapshot(Box<EngineImage>),
}

/// A core's message to another core.
#[derive(Debug)]
pub(crate) enum PeerMsg {
    /// Operations for the receiving core's shard, in order.
    Ops(Vec<OpBatch>),
    /// Everything this core produced from client `client`'s events before its `Sync` tagged
    /// `tag` precedes this marker on this ring.
    Fence { client: usize, tag: u64 },
    /// To the coordinator: `tip`, in shard `from`, has become a junction.
    Junction { from: ShardId, tip: SeqHash },
    /// From the coordinator: stop taking events for promotion round `epoch` of `junctions`
    /// (each exported by the shard named with it).
    Freeze {
        epoch: u64,
        junctions: Arc<[(ShardId, SeqHash)]>,
        /// A snapshot round: every core images itself once drained (no junctions then).
        snapshot: bool,
        /// The receiving core's image buffer (a snapshot round).
        buffer: Option<Box<CoreImage>>,
    },
    /// Everything this core produced before it froze for `epoch` precedes this marker.
    Drained { epoch: u64 },
    /// From an exporting core: the paths of its junctions in round `epoch` (possibly none).
    Graft {
        epoch: u64,
        promotions: Arc<[Promotion]>,
    },
    /// To the coordinator: this core grafted every path of `epoch` (and, in a snapshot
    /// round, this is its image).
    Grafted {
        epoch: u64,
        from: ShardId,
        image: Option<Box<CoreImage>>,
    },
    /// From the coordinator: the new trunk is published (or the round was abandoned);
    /// take events again.
    Thaw { epoch: u64 },
}

/// One core's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreSummary {
    /// Which core (and shard).
    pub shard: ShardId,
    /// Block operations its shard applied.
    pub applied: u64,
    /// Operations that could not apply (0 unless routing is wrong).
    pub inconsistencies: u64,
    /// Queries answered.
    pub queries: u64,
    /// Its shard's index sizes.
    pub index: IndexStats,
    /// Engine hashes in the directories of the workers homed here.
    pub directory_entries: usize,
    /// Heap bytes of those directories.
    pub directory_bytes: usize,
    /// Refusals of events homed here.
    pub rejects: RejectCounts,
    /// The core it is pinned to, if any.
    pub pinned_core: Option<usize>,
    /// Trunk promotions it published (core 0) or grafted.
    pub promotions: u64,
    /// Junctions its shard reported for promotion.
    pub junctions_reported: u64,
    /// Junction reports it took as the promotions' coordinator (core 0; 0 elsewhere).
    pub junctions_heard: u64,
    /// A promotion round is queued or running here.
    pub promoting: bool,
    /// Messages waiting in its incoming rings (from clients and peer cores) when it
    /// reported.
    pub ring_backlog: usize,
    /// Messages for peer cores waiting because their rings were full.
    pub pending_peer_msgs: usize,
}
