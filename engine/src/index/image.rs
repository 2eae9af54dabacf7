//! A tree to and from its snapshot image (`crate::snapshot::image`): nodes parent first,
//! each with its blocks and its holders.
//!
//! Export walks the tree breadth-first from the root, so a node's parent is always listed
//! before it (image invariant 2). Import replays each node as one store per holder copy
//! under its parent's last block (or creates it unheld, for a structural node that only
//! carries held descendants), so the rebuilt tree holds exactly the same multiset per worker
//! key and the same parent links; node boundaries may differ (path compression is redone by
//! the stores), which no query can tell.

use super::ShardIndex;
use super::holders::Holders;
use super::nodes::Kids;
use super::pos::Pos;
use crate::error::{EngineError, Result};
use crate::ids::{DpRank, SeqHash, WorkerId, WorkerKey};
use crate::snapshot::image::{HolderRec, NodeRec};
use std::collections::VecDeque;

impl ShardIndex {
    /// Appends every node (parent first), its blocks and its holders to the image arrays.
    pub fn export(
        &self,
        nodes: &mut Vec<NodeRec>,
        seqs: &mut Vec<u64>,
        holders: &mut Vec<HolderRec>,
    ) {
        let mut queue: VecDeque<_> = self.root.iter().collect();
        // Reserved up front: the cut freezes every core while this runs.
        nodes.reserve(self.nodes.len());
        seqs.reserve(self.stored);
        holders.reserve(self.nodes.len());
        while let Some(id) = queue.pop_front() {
            let Some(n) = self.node(id) else { continue };
            let parent = match n.parent() {
                super::nodes::Parent::Root => None,
                super::nodes::Parent::Node(p) => self
                    .node(p)
                    .and_then(|pn| Pos::new(pn.run, pn.end().saturating_sub(1)))
                    .and_then(|pos| self.runs.seq(pos)),
            };
            let run = self.runs.slice(n.run, n.start(), n.len());
            let hs = self.sets.holders_of(Holders::from_raw(n.holders));
            let before = holders.len();
            holders.extend(hs.iter().filter_map(|&(slot, count)| {
                self.slots.key(slot).map(|k| HolderRec {
                    worker: k.worker.0,
                    rank: k.dp_rank.0,
                    count,
                })
            }));
            nodes.push(NodeRec {
                parent: parent.map_or(0, |s| s.0),
                root: parent.is_none(),
                len: run.len() as u32,
                holders: (holders.len() - before) as u32,
            });
            seqs.extend(run.iter().map(|s| s.0));
            match n.kids() {
                Kids::None => {}
                Kids::One(c) => queue.push_back(c),
                Kids::Map(i) => {
                    if let Some(m) = self.maps.get(i) {
                        queue.extend(m.iter());
                    }
                }
            }
        }
    }

    /// Rebuilds one exported node: its blocks under `parent` (`None`: a sequence start),
    /// held by `holders` (worker key, copies). The parent must have been imported before.
    pub fn import_node(
        &mut self,
        parent: Option<SeqHash>,
        seqs: &[SeqHash],
        holders: impl Iterator<Item = (WorkerKey, u32)>,
        scratch: &mut Vec<Pos>,
    ) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let at = match parent {
            None => None,
            Some(p) => Some(self.find(p).ok_or(EngineError::UnknownPosition)?),
        };
        let mut held = false;
        for (key, count) in holders {
            if count == 0 {
                continue;
            }
            // One store, then the other copies in one step: `count` comes from the file and
            // a loop over it would let a crafted snapshot stall the start (billions of
            // stores).
            scratch.clear();
            self.store(key, at, seqs, scratch)?;
            self.add_copies(key, at, seqs, count - 1)?;
            held = true;
        }
        if !held {
            if !self
                .runs
                .has_room(seqs.len().div_ceil(super::MAX_RUN_LEN) + 1)
                || !self.nodes.has_room(3 * seqs.len() + 2)
            {
                return Err(EngineError::IndexFull);
            }
            scratch.clear();
            self.create(None, at, seqs, scratch);
        }
        Ok(())
    }
}

/// The worker key of an image holder.
pub fn holder_key(h: &crate::snapshot::image::ArchivedHolderRec) -> (WorkerKey, u32) {
    (
        WorkerKey {
            worker: WorkerId(h.worker.to_native()),
            dp_rank: DpRank(h.rank.to_native()),
        },
        h.count.to_native(),
    )
}
