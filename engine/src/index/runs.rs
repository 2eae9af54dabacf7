//! Block storage: runs of seq_hashes with stable positions, and which node views which range.
//!
//! A store that creates blocks puts them in a new run (or appends them to the run of the
//! node it extends); the run never moves its blocks, so a block's [`Pos`] stays valid until
//! the block dies. Nodes are views over disjoint ranges of runs; a run records its views
//! ([`Segs`]) so that a `Pos` finds its node in one or two steps.
//!
//! # Invariants
//! 1. A run's segments are sorted by start, do not overlap, and each names the live node
//!    whose range starts there; blocks outside every segment are dead (their node was
//!    pruned) and are never referenced again.
//! 2. A run with no segment is freed at once (its blocks and its id); when no run is live
//!    the slab is back to its empty footprint.
//! 3. A run holds at most [`MAX_RUN_LEN`] blocks.

use super::pos::{MAX_RUN_LEN, MAX_RUNS, NodeId, Pos, RunId};
use crate::ids::SeqHash;

/// A node's view of a run: the node whose range starts at `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// First offset of the node's range.
    pub start: u16,
    /// The node.
    pub node: NodeId,
}

/// The views of one run, sorted by start (one view is the common case: kept inline).
#[derive(Clone, Debug, Default)]
pub enum Segs {
    /// No live view: the run is free.
    #[default]
    None,
    /// One view.
    One(Seg),
    /// Several views, sorted by start.
    Many(Vec<Seg>),
}

impl Segs {
    fn as_slice(&self) -> &[Seg] {
        match self {
            Segs::None => &[],
            Segs::One(s) => std::slice::from_ref(s),
            Segs::Many(v) => v,
        }
    }

    /// The node whose view starts at or before `off` (the caller checks `off` is inside its
    /// range).
    #[inline]
    pub fn find(&self, off: usize) -> Option<NodeId> {
        let segs = self.as_slice();
        let i = segs.partition_point(|s| usize::from(s.start) <= off);
        segs.get(i.checked_sub(1)?).map(|s| s.node)
    }

    fn insert(&mut self, seg: Seg) {
        match self {
            Segs::None => *self = Segs::One(seg),
            Segs::One(s) => {
                let s = *s;
                let v = if s.start < seg.start {
                    vec![s, seg]
                } else {
                    vec![seg, s]
                };
                *self = Segs::Many(v);
            }
            Segs::Many(v) => {
                let i = v.partition_point(|s| s.start < seg.start);
                v.insert(i, seg);
            }
        }
    }

    fn remove(&mut self, node: NodeId) {
        match self {
            Segs::None => {}
            Segs::One(s) => {
                if s.node == node {
                    *self = Segs::None;
                }
            }
            Segs::Many(v) => {
                v.retain(|s| s.node != node);
                match v.as_slice() {
                    [] => *self = Segs::None,
                    [only] => *self = Segs::One(*only),
                    _ => {}
                }
            }
        }
    }

    fn set_start(&mut self, node: NodeId, start: u16) {
        match self {
            Segs::None => {}
            Segs::One(s) => {
                if s.node == node {
                    s.start = start;
                }
            }
            Segs::Many(v) => {
                if let Some(s) = v.iter_mut().find(|s| s.node == node) {
                    s.start = start;
                }
                v.sort_unstable_by_key(|s| s.start);
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Segs::Many(v) => v.capacity() * size_of::<Seg>(),
            _ => 0,
        }
    }
}

/// One run.
#[derive(Debug, Default)]
pub struct Run {
    /// The blocks, in chain order.
    pub seqs: Vec<SeqHash>,
    /// The nodes viewing ranges of `seqs`.
    pub segs: Segs,
}

/// The slab of runs.
#[derive(Debug, Default)]
pub struct Runs {
    runs: Vec<Run>,
    free: Vec<RunId>,
    live: usize,
}

impl Runs {
    /// The run `id`.
    #[inline]
    pub fn get(&self, id: RunId) -> Option<&Run> {
        self.runs.get(id.idx())
    }

    /// The seq_hash at `pos`, if that block is stored.
    #[inline]
    pub fn seq(&self, pos: Pos) -> Option<SeqHash> {
        self.get(pos.run())?.seqs.get(pos.off()).copied()
    }

    /// The seq_hash at offset `off` of run `id`.
    #[inline]
    pub fn seq_at(&self, id: RunId, off: usize) -> Option<SeqHash> {
        self.get(id)?.seqs.get(off).copied()
    }

    /// Blocks in run `id` (0 for a free run).
    #[inline]
    pub fn run_len(&self, id: RunId) -> usize {
        self.get(id).map_or(0, |r| r.seqs.len())
    }

    /// `len` blocks of run `id` from offset `start`.
    #[inline]
    pub fn slice(&self, id: RunId, start: usize, len: usize) -> &[SeqHash] {
        self.get(id)
            .and_then(|r| r.seqs.get(start..start + len))
            .unwrap_or(&[])
    }

    /// Can `n` more runs be created?
    pub fn has_room(&self, n: usize) -> bool {
        self.free.len() + (MAX_RUNS - self.runs.len()) >= n
    }

    /// A new run holding `seqs` (at most [`MAX_RUN_LEN`]), viewed by `node` from offset 0.
    /// `None` when the run space is exhausted (callers check [`Runs::has_room`] first).
    pub fn create(&mut self, seqs: &[SeqHash], node: NodeId) -> Option<RunId> {
        let seqs = seqs.get(..seqs.len().min(MAX_RUN_LEN))?;
        let run = Run {
            seqs: seqs.to_vec(),
            segs: Segs::One(Seg { start: 0, node }),
        };
        let id = match self.free.pop() {
            Some(id) => {
                *self.runs.get_mut(id.idx())? = run;
                id
            }
            None if self.runs.len() < MAX_RUNS => {
                self.runs.push(run);
                RunId((self.runs.len() - 1) as u32)
            }
            None => return None,
        };
        self.live += 1;
        Some(id)
    }

    /// Appends `seqs` to run `id` (the caller checked it has room: invariant 3).
    pub fn append(&mut self, id: RunId, seqs: &[SeqHash]) {
        if let Some(r) = self.runs.get_mut(id.idx()) {
            r.seqs.extend_from_slice(seqs);
        }
    }

    /// Records that `node` views run `id` from `start`.
    pub fn add_view(&mut self, id: RunId, start: usize, node: NodeId) {
        if let Some(r) = self.runs.get_mut(id.idx()) {
            r.segs.insert(Seg {
                start: start as u16,
                node,
            });
        }
    }

    /// `node`'s view of run `id` now starts at `start`.
    pub fn move_view(&mut self, id: RunId, node: NodeId, start: usize) {
        if let Some(r) = self.runs.get_mut(id.idx()) {
            r.segs.set_start(node, start as u16);
        }
    }

    /// `node` no longer views run `id`; frees the run if nothing else does (invariant 2).
    pub fn drop_view(&mut self, id: RunId, node: NodeId) {
        let Some(r) = self.runs.get_mut(id.idx()) else {
            return;
        };
        r.segs.remove(node);
        if matches!(r.segs, Segs::None) {
            *r = Run::default();
            self.live -= 1;
            if self.live == 0 {
                *self = Self::default();
            } else {
                self.free.push(id);
            }
        }
    }

    /// Live runs.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.runs.capacity() * size_of::<Run>()
            + self.free.capacity() * size_of::<RunId>()
            + self
                .runs
                .iter()
                .map(|r| r.seqs.capacity() * size_of::<SeqHash>() + r.segs.heap_bytes())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_find_the_view_covering_an_offset() {
        let mut s = Segs::default();
        assert_eq!(s.find(0), None);
        s.insert(Seg {
            start: 10,
            node: NodeId(1),
        });
        assert_eq!(s.find(9), None);
        assert_eq!(s.find(10), Some(NodeId(1)));
        s.insert(Seg {
            start: 0,
            node: NodeId(2),
        });
        s.insert(Seg {
            start: 20,
            node: NodeId(3),
        });
        assert_eq!(
            [s.find(0), s.find(15), s.find(200)],
            [Some(NodeId(2)), Some(NodeId(1)), Some(NodeId(3))]
        );
        s.set_start(NodeId(1), 12);
        assert_eq!(s.find(11), Some(NodeId(2)));
        s.remove(NodeId(2));
        s.remove(NodeId(3));
        assert!(matches!(s, Segs::One(_)));
        s.remove(NodeId(1));
        assert!(matches!(s, Segs::None));
    }

    #[test]
    fn runs_free_when_unviewed_and_reset_when_empty() {
        let mut runs = Runs::default();
        let a = runs.create(&[SeqHash(1), SeqHash(2)], NodeId(0)).unwrap();
        let b = runs.create(&[SeqHash(3)], NodeId(1)).unwrap();
        runs.append(b, &[SeqHash(4)]);
        assert_eq!(runs.seq(Pos::new(b, 1).unwrap()), Some(SeqHash(4)));
        runs.drop_view(a, NodeId(0));
        assert_eq!(runs.seq(Pos::new(a, 0).unwrap()), None);
        let c = runs.create(&[SeqHash(5)], NodeId(2)).unwrap();
        assert_eq!(c, a, "a freed id is reused");
        runs.drop_view(b, NodeId(1));
        runs.drop_view(c, NodeId(2));
        assert_eq!(runs.len(), 0);
        assert_eq!(runs.heap_bytes(), 0);
    }
}
