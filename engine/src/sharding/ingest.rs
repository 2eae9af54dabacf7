//! The ingest side of the sharded engine: worker directories in, per-shard batches out.
//!
//! [`Ingest`] is the sharded engine's front half: the shared event semantics
//! ([`Directories`], routes from the [`ShardPolicy`]) with an [`Outbox`] as the sink, one
//! queue of operation batches per shard. Whoever drives it (a test, the threaded runtime)
//! delivers the outbox to the shards.
//!
//! # Invariants
//! 1. Everything `KvIndex` promises about directories and refusals holds here too: a
//!    refused event changes nothing (a store refused for an engine-hash conflict emits its
//!    stores followed by the removals that undo them, so every shard ends where it
//!    started); every refusal is counted.
//! 2. Per shard, operations are emitted in event order; an accepted event's operations are
//!    all emitted before the call returns.
//! 3. A block placed `Everywhere` gets the same operation in every shard's queue.
//!
//! # Concurrency
//! Single writer: one ingest thread owns an `Ingest` and the directories of the workers
//! whose events it decodes.

use super::ops::{BlockOp, OpBatch};
use super::shard::Shard;
use super::{Placement, Route, ShardId, ShardPolicy};
use crate::directories::{Applied, BlockStore, Directories};
use crate::error::{EngineError, RejectCounts, Result};
use crate::event::KvEvent;
use crate::ids::{DpRank, EngineHash, SeqHash, WorkerId, WorkerKey};
use crate::snapshot::StreamMark;
use crate::snapshot::image::{ArchivedCoreImage, CoreImage, EntryRec, KeyRec, MarkRec};
use hashbrown::HashMap;
use std::fmt;

/// Operations waiting to be delivered, one queue per shard.
#[derive(Debug, Default)]
pub struct Outbox {
    queues: Vec<Vec<OpBatch>>,
}

impl Outbox {
    /// An empty outbox for `shards` shards.
    pub fn new(shards: usize) -> Self {
        Self {
            queues: (0..shards).map(|_| Vec::new()).collect(),
        }
    }

    /// Queues a stored chain for `shard`; a chain continuing the previous batch of the same
    /// key (a sequence stored block by block) extends it.
    fn push_store(
        &mut self,
        shard: usize,
        key: WorkerKey,
        parent: Option<SeqHash>,
        seqs: &[SeqHash],
    ) {
        let Some(queue) = self.queues.get_mut(shard) else {
            return;
        };
        match queue.last_mut() {
            Some(b)
                if b.key == key
                    && matches!(b.op, BlockOp::Store { .. })
                    && parent.is_some()
                    && b.seqs.last().copied() == parent =>
            {
                b.seqs.extend_from_slice(seqs)
            }
            _ => queue.push(OpBatch {
                key,
                op: BlockOp::Store { parent },
                seqs: seqs.to_vec(),
            }),
        }
    }

    /// Queues the removal of one copy of `seq` for `shard`.
    fn push_remove(&mut self, shard: usize, key: WorkerKey, seq: SeqHash) {
        let Some(queue) = self.queues.get_mut(shard) else {
            return;
        };
        match queue.last_mut() {
            Some(b) if b.key == key && b.op == BlockOp::Remove => b.seqs.push(seq),
            _ => queue.push(OpBatch {
                key,
                op: BlockOp::Remove,
                seqs: vec![seq],
            }),
        }
    }

    /// Takes shard `shard`'s queue.
    pub fn take(&mut self, shard: ShardId) -> Vec<OpBatch> {
        self.queues
            .get_mut(shard.idx())
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Nothing queued for any shard.
    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(Vec::is_empty)
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.queues.len()
    }
}

/// What a sharded directory records per block: its seq_hash (to chain stores and address
/// shards) and its route (which shards hold it). 12 bytes, 4-byte aligned; fields are only
/// read by value, as packed fields require.
#[repr(C, packed(4))]
#[derive(Clone, Copy)]
pub struct Placed {
    seq: u64,
    route: u32,
}

impl Placed {
    /// The block's seq_hash.
    #[inline]
    pub fn seq(&self) -> SeqHash {
        SeqHash(self.seq)
    }

    /// The block's route.
    #[inline]
    pub fn route(&self) -> Route {
        Route(self.route)
    }
}

impl fmt::Debug for Placed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Placed({}, {:?})", self.seq(), self.route())
    }
}

/// Counts the stores that continue each block placed in one shard, to report junctions as
/// soon as the router sees them (the shard holding the block would see them only after they
/// crossed a ring, behind whatever is queued there).
///
/// Bounded: when it holds [`JunctionWatch::CAPACITY`] parents it starts over, so only
/// parents that many stores continue in a row are reported; the shards' own branch reports
/// catch the rest.
#[derive(Debug, Default)]
struct JunctionWatch {
    counts: hashbrown::HashMap<SeqHash, u32>,
    found: Vec<(ShardId, SeqHash)>,
}

impl JunctionWatch {
    const CAPACITY: usize = 1 << 14;

    fn saw<P: ShardPolicy>(&mut self, policy: &P, parent: SeqHash, shard: ShardId) {
        if self.counts.len() >= Self::CAPACITY {
            self.counts = hashbrown::HashMap::new();
        }
        let n = self.counts.entry(parent).or_insert(0);
        *n += 1;
        if policy.is_junction(parent, *n) {
            self.counts.remove(&parent);
            self.found.push((shard, parent));
        }
    }
}

/// The outbox as the directories see it: each block goes to the queues of its placement,
/// except that blocks of the `local` shard (if any) are applied to it at once.
struct OutboxSink<'a, P> {
    policy: &'a P,
    outbox: &'a mut Outbox,
    local: Option<&'a mut Shard>,
    scratch: &'a mut Vec<SeqHash>,
    junctions: &'a mut JunctionWatch,
    /// Called at the directories' pauses ([`BlockStore::pause`]).
    pause: Option<&'a mut dyn FnMut()>,
}

impl<P: ShardPolicy> OutboxSink<'_, P> {
    fn is_local(&self, shard: usize) -> bool {
        self.local.as_ref().is_some_and(|l| l.id().idx() == shard)
    }
}

impl<P: ShardPolicy> BlockStore<Placed> for OutboxSink<'_, P> {
    #[inline]
    fn seq_of(&self, block: Placed) -> Option<SeqHash> {
        Some(block.seq())
    }

    #[inline]
    fn same_block(&self, a: Placed, b: Placed) -> bool {
        a.seq() == b.seq()
    }

    /// A chain is placed as "everywhere" for its first `trunk` blocks and in one shard
    /// after that (`ShardPolicy` invariant 1), so each shard gets one contiguous prefix of
    /// the chain: the owner all of it, every other shard the replicated part.
    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<Placed>,
        seqs: &[SeqHash],
        out: &mut Vec<Placed>,
    ) -> Result<()> {
        if let Some(p) = parent
            && let Placement::Shard(x) = self.policy.placement(p.seq(), p.route())
        {
            self.junctions.saw(self.policy, p.seq(), x);
        }
        // Blocks are placed one by one only while the chain is replicated; once a block
        // lands in a shard, every later one does too (the policy's invariant 3), so the rest
        // of the chain takes its route without asking the policy per block.
        let mut prev = parent.map(|p| (p.seq(), p.route()));
        let mut trunk = 0usize;
        let mut owner: Option<(ShardId, crate::sharding::Route)> = None;
        for &s in seqs {
            let r = match owner {
                Some((_, r)) => r,
                None => {
                    let r = self.policy.place(prev, s);
                    match self.policy.placement(s, r) {
                        Placement::Everywhere => trunk += 1,
                        Placement::Shard(x) => owner = Some((x, r)),
                    }
                    r
                }
            };
            out.push(Placed {
                seq: s.0,
                route: r.0,
            });
            prev = Some((s, r));
        }
        let owner = owner.map(|o| o.0);
        let parent = parent.map(|p| p.seq());
        for shard in 0..self.outbox.shards() {
            let k = if owner.map(ShardId::idx) == Some(shard) {
                seqs.len()
            } else {
                trunk
            };
            let Some(chain) = seqs.get(..k).filter(|c| !c.is_empty()) else {
                continue;
            };
            if self.is_local(shard) {
                if let Some(l) = self.local.as_deref_mut() {
                    l.store_seqs(key, parent, chain);
                }
            } else {
                self.outbox.push_store(shard, key, parent, chain);
            }
        }
        Ok(())
    }

    #[inline]
    fn pause(&mut self) {
        if let Some(p) = self.pause.as_mut() {
            p();
        }
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[Placed]) {
        self.scratch.clear();
        let shards = self.outbox.shards();
        for b in blocks {
            let seq = b.seq();
            let to = |shard: usize, sink: &mut Self| {
                if sink.is_local(shard) {
                    sink.scratch.push(seq);
                } else {
                    sink.outbox.push_remove(shard, key, seq);
                }
            };
            match self.policy.placement(seq, b.route()) {
                Placement::Everywhere => (0..shards).for_each(|s| to(s, self)),
                Placement::Shard(s) => to(s.idx(), self),
            }
        }
        if let Some(l) = self.local.as_deref_mut() {
            l.remove_seqs(key, self.scratch);
        }
    }
}

/// Worker directories and the routing of their events to shards.
#[derive(Debug)]
pub struct Ingest<P> {
    policy: P,
    dirs: Directories<Placed>,
    /// The last batch applied per numbered stream of the workers whose events come here.
    /// `(seq, digest)` of the last batch applied per numbered stream.
    marks: HashMap<(WorkerId, u32), (u64, Option<u64>)>,
    scratch: Vec<SeqHash>,
    junctions: JunctionWatch,
}

impl<P: ShardPolicy> Ingest<P> {
    /// An ingest with no workers, routing with `policy`.
    pub fn new(policy: P) -> Self {
        Self {
            policy,
            dirs: Directories::new(),
            marks: HashMap::new(),
            scratch: Vec::new(),
            junctions: JunctionWatch::default(),
        }
    }

    /// The directories and a sink over `out` (with `local` applied at once, and `pause`
    /// called at the directories' pauses), borrowed side by side.
    fn parts<'a>(
        &'a mut self,
        out: &'a mut Outbox,
        local: Option<&'a mut Shard>,
        pause: Option<&'a mut dyn FnMut()>,
    ) -> (&'a mut Directories<Placed>, OutboxSink<'a, P>) {
        let sink = OutboxSink {
            policy: &self.policy,
            outbox: out,
            local,
            scratch: &mut self.scratch,
            junctions: &mut self.junctions,
            pause,
        };
        (&mut self.dirs, sink)
    }

    /// Caps each worker key at `max` engine hashes (`None`: no cap); a store past it is
    /// refused as a whole (see [`Directories::with_max_blocks_per_key`]).
    pub fn with_max_blocks_per_key(mut self, max: Option<usize>) -> Self {
        self.dirs = self.dirs.with_max_blocks_per_key(max);
        self
    }

    /// The sharding policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Junctions seen routing stores since the last call: (shard holding it, block).
    pub fn take_junctions(&mut self) -> Vec<(ShardId, SeqHash)> {
        std::mem::take(&mut self.junctions.found)
    }

    /// The sharding policy, mutably (to refresh or promote).
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }

    /// Applies one event of `key`, appending its operations to `out`. A refused event is
    /// counted and emits nothing.
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent, out: &mut Outbox) -> Result<Applied> {
        let (dirs, mut sink) = self.parts(out, None, None);
        dirs.apply(key, event, &mut sink)
    }

    /// Like [`Ingest::apply`], calling `pause` at the directories' pauses
    /// ([`BlockStore::pause`]): every [`PAUSE_BLOCKS`](crate::directories::PAUSE_BLOCKS)
    /// blocks of the event's directory work, before its operations are queued or after.
    pub fn apply_pausing(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        out: &mut Outbox,
        pause: &mut dyn FnMut(),
    ) -> Result<Applied> {
        let (dirs, mut sink) = self.parts(out, None, Some(pause));
        dirs.apply(key, event, &mut sink)
    }

    /// Like [`Ingest::apply`], but the operations for `local` are applied to it at once
    /// instead of being queued (a core applying its own shard's share).
    pub fn apply_local(
        &mut self,
        key: WorkerKey,
        event: &KvEvent,
        out: &mut Outbox,
        local: &mut Shard,
    ) -> Result<Applied> {
        let (dirs, mut sink) = self.parts(out, Some(local), None);
        dirs.apply(key, event, &mut sink)
    }

    /// Empties `key`'s cache and forgets its worker's stream marks; returns how many block
    /// copies it dropped. A mark says which batches the held blocks came from: once they are
    /// gone it would only make a restored router resume a stream (a restarted publisher's)
    /// from a batch it no longer has, and count the restart a second time.
    pub fn clear(&mut self, key: WorkerKey, out: &mut Outbox) -> usize {
        self.marks.retain(|(w, _), _| *w != key.worker);
        let (dirs, mut sink) = self.parts(out, None, None);
        dirs.clear(key, &mut sink)
    }

    /// Forgets every dp rank of `worker`; returns how many worker keys it had.
    pub fn remove_worker(&mut self, worker: WorkerId, out: &mut Outbox) -> usize {
        self.marks.retain(|(w, _), _| *w != worker);
        let (dirs, mut sink) = self.parts(out, None, None);
        dirs.remove_worker(worker, &mut sink)
    }

    /// Records that batch `mark.seq` of a stream has been applied (after its events).
    pub fn mark(&mut self, mark: StreamMark) {
        self.marks
            .insert((mark.worker, mark.stream), (mark.seq, mark.digest));
    }

    /// Adds the directories and stream marks to a snapshot image.
    pub fn export(&self, image: &mut CoreImage) {
        // Reserved up front: growing by doubling would copy the entries (tens of MB per
        // core at 10 M entries) while every core is frozen for the cut.
        let (entries, _) = self.dirs.size();
        image.entries.reserve(entries);
        image.keys.reserve(self.dirs.directories().count());
        image.marks.reserve(self.marks.len());
        for (key, dir) in self.dirs.directories() {
            image.keys.push(KeyRec {
                worker: key.worker.0,
                rank: key.dp_rank.0,
                len: dir.len() as u32,
            });
            image
                .entries
                .extend(dir.iter().map(|(engine, placed, count)| EntryRec {
                    engine: engine.0,
                    seq: placed.seq,
                    route: placed.route,
                    count,
                }));
        }
        image.marks.extend(
            self.marks
                .iter()
                .map(|(&(w, stream), &(seq, digest))| MarkRec {
                    worker: w.0,
                    stream,
                    seq,
                    digest,
                }),
        );
    }

    /// Restores the directories and stream marks of a snapshot image (into an empty
    /// ingest). Refused, with what was restored so far kept, if the image's directory
    /// lengths do not add up; a length is checked against the entries left before anything
    /// is reserved for it, so the work and memory are bounded by the image's size.
    pub fn restore(&mut self, image: &ArchivedCoreImage) -> Result<()> {
        let mut entries = image.entries.iter();
        for k in image.keys.iter() {
            let key = WorkerKey {
                worker: WorkerId(k.worker.to_native()),
                dp_rank: DpRank(k.rank.to_native()),
            };
            let len = k.len.to_native() as usize;
            // Checked against the entries left before reserving: the length comes from the
            // file, and reserving it unchecked lets a crafted one ask for gigabytes.
            if len > entries.len() {
                return Err(EngineError::BadSnapshot(format!(
                    "worker {} rank {} claims {len} directory entries; {} are left in the image",
                    key.worker,
                    key.dp_rank,
                    entries.len()
                )));
            }
            let dir = self.dirs.restoring(key);
            dir.reserve(len);
            for _ in 0..len {
                let e = entries
                    .next()
                    .ok_or_else(|| EngineError::BadSnapshot("directory entries missing".into()))?;
                let placed = Placed {
                    seq: e.seq.to_native(),
                    route: e.route.to_native(),
                };
                dir.restore(
                    EngineHash(e.engine.to_native()),
                    placed,
                    e.count.to_native(),
                );
            }
        }
        self.dirs.forget_empty();
        if entries.next().is_some() {
            return Err(EngineError::BadSnapshot(
                "directory entries left over".into(),
            ));
        }
        for m in image.marks.iter() {
            self.marks.insert(
                (WorkerId(m.worker.to_native()), m.stream.to_native()),
                (m.seq.to_native(), m.digest.as_ref().map(|d| d.to_native())),
            );
        }
        Ok(())
    }

    /// Distinct engine hashes `key` holds (its cached blocks, unless it maps two engine
    /// hashes to one prefix).
    pub fn cached_blocks(&self, key: WorkerKey) -> u64 {
        self.dirs.engine_hashes(key) as u64
    }

    /// Refusals so far, per reason.
    pub fn rejects(&self) -> &RejectCounts {
        self.dirs.rejects()
    }

    /// Engine hashes in all directories, and their heap bytes.
    pub fn directory_size(&self) -> (usize, usize) {
        self.dirs.size()
    }
}
