//! A block's path from the root, as the sharded engine's trunk promotion exports it.
//!
//! Promoting a hot block into the trunk copies its path (the blocks from the root down to
//! it, with who holds them) from the shard that has it to every other shard, and leaves the
//! path's other branches where they are. [`ShardIndex::path_to`] reads that path.

use super::ShardIndex;
use super::holders::Holders;
use super::nodes::{Kids, Parent};
use super::pos::{NodeId, Pos};
use crate::ids::{SeqHash, WorkerKey};

/// One node's stretch of a root-to-block path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPiece {
    /// The stretch's blocks, in chain order.
    pub seqs: Vec<SeqHash>,
    /// Who holds them, with copy counts (every block of a node has the same holders).
    pub holders: Vec<(WorkerKey, u32)>,
    /// First blocks of what continues the stretch's last block off the path (its other
    /// children; for the path's end, every continuation).
    pub side: Vec<SeqHash>,
}

impl ShardIndex {
    /// The path from the root down to the block at `pos` (inclusive), top-down, one piece
    /// per node; `None` if `pos` is not a live block.
    pub fn path_to(&self, pos: Pos) -> Option<Vec<PathPiece>> {
        let (mut n, o) = self.locate(pos)?;
        let mut end = o + 1;
        let mut below: Option<NodeId> = None;
        let mut pieces = Vec::new();
        loop {
            let node = self.node(n)?;
            let seqs = self.runs.slice(node.run, node.start(), end).to_vec();
            let holders = self
                .sets
                .holders_of(Holders::from_raw(node.holders))
                .into_iter()
                .filter_map(|(s, c)| Some((self.slots.key(s)?, c)))
                .collect();
            let side = if end < node.len() {
                self.runs
                    .seq_at(node.run, node.start() + end)
                    .into_iter()
                    .collect()
            } else {
                self.kid_firsts(n, below)
            };
            pieces.push(PathPiece {
                seqs,
                holders,
                side,
            });
            match node.parent() {
                Parent::Root => break,
                Parent::Node(p) => {
                    below = Some(n);
                    n = p;
                    end = self.node(p)?.len();
                }
            }
        }
        pieces.reverse();
        Some(pieces)
    }

    /// First blocks of `n`'s children, except `skip`.
    fn kid_firsts(&self, n: NodeId, skip: Option<NodeId>) -> Vec<SeqHash> {
        let kids: Vec<NodeId> = match self.node(n).map(|x| x.kids()) {
            Some(Kids::One(c)) => vec![c],
            Some(Kids::Map(i)) => self.maps.get(i).map_or(Vec::new(), |m| m.iter().collect()),
            _ => Vec::new(),
        };
        kids.into_iter()
            .filter(|&c| Some(c) != skip)
            .filter_map(|c| self.node(c).and_then(|x| self.first_seq(&x)))
            .collect()
    }
}
