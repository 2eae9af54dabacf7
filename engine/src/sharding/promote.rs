//! Promoting a junction into the trunk: one shard exports the junction's path, every other
//! shard imports it, and the policy publishes the new trunk.
//!
//! A shard notices a junction when a store makes one of its blocks branch (the tree reports
//! the branch, the policy decides with [`ShardPolicy::is_junction`]). The path from the
//! junction's anchor down to the junction leaves that shard's private part of the index:
//! every other shard gets a copy with the same holders and copy counts (grafted under
//! whatever trunk ancestors it lacks), and the blocks that already continue the path stay
//! where they are (pinned). Nothing else moves.
//!
//! # Invariants
//! 1. After a promotion every shard holds the path with the same holder multisets, so a
//!    query routed by the new trunk gets the answer the exporting shard would have given.
//! 2. A promotion is applied while no event of the shards' workers is in flight (the
//!    single-threaded engine applies it between two events; the runtime drains its rings
//!    first), so no operation can reach a shard routed by the old trunk after the new one
//!    is published.
//! 3. Every block is grafted at most once per publication: [`Shard::import`] adds the
//!    path's holders, so a block imported twice would keep copies that the removals (one
//!    per shard) never take back. Promotions published together (the runtime's round) are
//!    exported together with [`Shard::export_round`], which makes them disjoint.
//!
//! [`ShardPolicy::is_junction`]: super::ShardPolicy::is_junction

use super::ShardId;
use super::shard::Shard;
use crate::ids::SeqHash;
use crate::index::PathPiece;

/// A junction's path, as the shard that holds it exports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Promotion {
    /// The exporting shard.
    pub from: ShardId,
    /// Trunk blocks from the root down to the path's parent (every shard holds them, but a
    /// shard may lack them as structure if nothing hangs below them there).
    pub ancestors: Vec<SeqHash>,
    /// The promoted blocks, top-down, with their holders.
    pub path: Vec<PathPiece>,
    /// First blocks of what already continues the path: they stay in `from`.
    pub pins: Vec<SeqHash>,
}

impl Promotion {
    /// The promoted blocks, top-down.
    pub fn seqs(&self) -> Vec<SeqHash> {
        self.path
            .iter()
            .flat_map(|p| p.seqs.iter().copied())
            .collect()
    }
}

impl Shard {
    /// The path from the root to `tip`, cut where it leaves the trunk (`in_trunk`); `None`
    /// if `tip` is not here or already in the trunk.
    pub fn export(&self, tip: SeqHash, in_trunk: impl Fn(SeqHash) -> bool) -> Option<Promotion> {
        let pos = self.index().find(tip)?;
        let pieces = self.index().path_to(pos)?;
        let mut ancestors = Vec::new();
        let mut path = Vec::new();
        for piece in pieces {
            if !path.is_empty() {
                path.push(piece);
                continue;
            }
            // Trunk blocks form a prefix of the path (trunk invariant 1).
            let cut = piece.seqs.iter().take_while(|&&s| in_trunk(s)).count();
            let (above, below) = piece.seqs.split_at(cut);
            ancestors.extend_from_slice(above);
            if !below.is_empty() {
                path.push(PathPiece {
                    seqs: below.to_vec(),
                    ..piece
                });
            }
        }
        if path.is_empty() {
            return None;
        }
        let pins = path.iter().flat_map(|p| p.side.iter().copied()).collect();
        Some(Promotion {
            from: self.id(),
            ancestors,
            path,
            pins,
        })
    }

    /// The paths of `tips` for promotions that are published together (one runtime
    /// round; `in_trunk` is the trunk before it): each path ends where the trunk or a path
    /// exported before it in the call does, as it would once those were published, so no
    /// block is in two of them (invariant 3). Two junctions of one shard share blocks
    /// whenever one is below the other or they branch from a common block outside the
    /// trunk.
    pub fn export_round(
        &self,
        tips: impl IntoIterator<Item = SeqHash>,
        in_trunk: impl Fn(SeqHash) -> bool,
    ) -> Vec<Promotion> {
        let mut exported = hashbrown::HashSet::new();
        tips.into_iter()
            .filter_map(|tip| {
                let p = self.export(tip, |s| in_trunk(s) || exported.contains(&s))?;
                exported.extend(p.seqs());
                Some(p)
            })
            .collect()
    }

    /// Grafts an exported path: its trunk ancestors as structure where missing, then each
    /// piece with its holders and copies.
    pub fn import(&mut self, p: &Promotion) {
        let mut positions = Vec::new();
        if self
            .index_mut()
            .ensure(None, &p.ancestors, &mut positions)
            .is_err()
        {
            self.note_inconsistent(p.seqs().len());
            return;
        }
        let mut at = positions.last().copied();
        for piece in &p.path {
            positions.clear();
            if self
                .index_mut()
                .ensure(at, &piece.seqs, &mut positions)
                .is_err()
            {
                self.note_inconsistent(piece.seqs.len());
                return;
            }
            for &(key, copies) in &piece.holders {
                for _ in 0..copies {
                    let mut held = Vec::new();
                    if self
                        .index_mut()
                        .store(key, at, &piece.seqs, &mut held)
                        .is_err()
                    {
                        self.note_inconsistent(piece.seqs.len());
                    }
                }
            }
            at = positions.last().copied();
        }
        if let Some(end) = at {
            self.index_mut().prune_unheld(end);
        }
        // Grafting is not traffic: a branch it made is no junction.
        let _ = self.take_branch();
    }
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;
    use crate::ids::{DpRank, WorkerId, WorkerKey};

    fn key(w: u64) -> WorkerKey {
        WorkerKey {
            worker: WorkerId(w),
            dp_rank: DpRank(0),
        }
    }

    fn seqs(v: &[u64]) -> Vec<SeqHash> {
        v.iter().copied().map(SeqHash).collect()
    }

    /// Three junctions of one shard in one round (2, 3 below it, and 6, 3's sibling): every
    /// other shard grafts each shared block once, so it answers as the exporter does, and
    /// one removal per held block (what the ingest sends every shard once the blocks are
    /// trunk) empties it.
    #[test]
    fn a_round_grafts_each_shared_block_once() {
        let mut from = Shard::new(ShardId(0));
        let mut to = Shard::new(ShardId(1));
        let (a, b) = (key(1), key(2));
        from.store_seqs(a, None, &seqs(&[1, 2, 3, 4]));
        from.store_seqs(b, None, &seqs(&[1, 2, 3, 5]));
        from.store_seqs(b, Some(SeqHash(2)), &seqs(&[6, 7]));
        from.store_seqs(a, Some(SeqHash(2)), &seqs(&[6, 8]));
        let round = from.export_round(seqs(&[3, 2, 6]), |_| false);
        let mut all: Vec<SeqHash> = round.iter().flat_map(Promotion::seqs).collect();
        all.sort_unstable();
        assert_eq!(all, seqs(&[1, 2, 3, 6]), "each block in one path");
        let mut pins: Vec<SeqHash> = round.iter().flat_map(|p| p.pins.clone()).collect();
        pins.sort_unstable();
        assert_eq!(pins, seqs(&[4, 5, 6, 7, 8]), "every continuation is pinned");
        for p in &round {
            to.import(p);
        }
        for q in [[1, 2, 3], [1, 2, 6]] {
            assert_eq!(to.find_matches(&seqs(&q)), from.find_matches(&seqs(&q)));
        }
        for k in [a, b] {
            to.remove_seqs(k, &seqs(&[1, 2, 3, 6]));
        }
        assert_eq!(to.inconsistencies(), 0);
        assert_eq!((to.stats().blocks, to.stats().entries), (0, 0));
    }
}
