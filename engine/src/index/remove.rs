//! Dropping copies of blocks for one worker key.
//!
//! # Algorithm
//! A removal names positions; consecutive positions of one run (ascending or descending:
//! engines evict a sequence's blocks in either order) are taken as one range. Each range is
//! cut at node boundaries, and each piece loses one copy for the worker at once: a piece
//! that is a whole node costs one holder update, no matter how long; a partial piece splits
//! its node first. Nodes nobody holds any more are pruned if nothing hangs below them, and
//! path compression is restored around what changed.

use super::ShardIndex;
use super::holders::Holders;
use super::pos::{NodeId, Pos, RunId};
use super::slots::Slot;
use crate::ids::WorkerKey;

/// What a removal did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Block copies dropped.
    pub removed: usize,
    /// Positions that were not a live block held by the worker key (nothing changed for
    /// them; 0 when the caller's directory is consistent with the tree).
    pub missing: usize,
}

impl ShardIndex {
    /// Drops one copy of each block at `positions` for `key` (a position may be listed
    /// several times: one copy each time).
    pub fn remove(&mut self, key: WorkerKey, positions: &[Pos]) -> Removed {
        let mut out = Removed::default();
        let Some(slot) = self.slots.get(key) else {
            out.missing = positions.len();
            return out;
        };
        let mut i = 0;
        while let Some(&first) = positions.get(i) {
            let mut j = i + 1;
            let dir = positions.get(j).and_then(|&p| step(first, p));
            if let Some(d) = dir {
                while let (Some(&a), Some(&b)) = (positions.get(j - 1), positions.get(j)) {
                    if step(a, b) != Some(d) {
                        break;
                    }
                    j += 1;
                }
            }
            let last = positions.get(j - 1).copied().unwrap_or(first);
            let (lo, hi) = (first.off().min(last.off()), first.off().max(last.off()));
            self.release_range(slot, first.run(), lo, hi + 1, &mut out);
            i = j;
        }
        if self.slots.blocks(slot) == 0 {
            self.slots.release(key);
        }
        out
    }

    /// Drops one copy for `slot` of blocks `lo..hi` of run `run`.
    fn release_range(&mut self, slot: Slot, run: RunId, lo: usize, hi: usize, out: &mut Removed) {
        let mut off = lo;
        while off < hi {
            let Some((n, o)) = Pos::new(run, off).and_then(|p| self.locate(p)) else {
                out.missing += 1;
                off += 1;
                continue;
            };
            let take = self.node(n).map_or(1, |x| x.len() - o).min(hi - off);
            if self.release(slot, n, o, o + take) {
                out.removed += take;
            } else {
                out.missing += take;
            }
            off += take;
        }
    }

    /// Drops one copy for `slot` of blocks `a..b` of node `n`; false (and no change) if
    /// `slot` holds none.
    fn release(&mut self, slot: Slot, n: NodeId, a: usize, b: usize) -> bool {
        let Some(node) = self.node(n) else {
            return false;
        };
        if !self.sets.contains(Holders::from_raw(node.holders), slot) {
            return false;
        }
        let Some(target) = self.isolate(n, a, b) else {
            return false;
        };
        let Some(node) = self.node(target) else {
            return false;
        };
        let Some((left, gone)) = self.sets.remove(Holders::from_raw(node.holders), slot) else {
            return false;
        };
        if let Some(t) = self.nodes.get_mut(target) {
            t.holders = left.raw();
        }
        let len = node.len();
        if gone {
            self.entries -= len as u64;
            self.slots.lost(slot, len as u64);
        }
        if left == Holders::None {
            self.blocks -= len;
            self.prune(target);
        } else {
            self.settle(target);
        }
        true
    }
}

/// `Some(+1)` / `Some(-1)` when `b` follows / precedes `a` in the same run.
#[inline]
fn step(a: Pos, b: Pos) -> Option<i8> {
    if a.run() != b.run() {
        None
    } else if b.off() == a.off() + 1 {
        Some(1)
    } else if b.off() + 1 == a.off() {
        Some(-1)
    } else {
        None
    }
}
