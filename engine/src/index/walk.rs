//! `find_matches`: per worker key, how long a prefix of the request it holds.
//!
//! # Algorithm
//! Walk the tree along the request: the root's child with the first block, then per node
//! compare the node's run with the request sequentially (one compare per block, on one
//! contiguous array), and at a node's end look up the child with the next block. The set of
//! worker keys that held every block so far (`Active`) is intersected once per node, not
//! once per block: a key missing from a node leaves with the depth at the node's start; keys
//! still active where the request diverges inside a node (or ends) leave with the depth
//! reached. The walk ends when nobody is left.
//!
//! Overlap is defined by which seq_hashes a worker holds (DESIGN.md), so when the next
//! block is not where the walk expects it (not the next block of the node, not a child),
//! it is looked up by seq_hash wherever it is stored and the walk resumes there. For a
//! request's real chain that lookup misses (a chained seq_hash can only hang below its
//! parent), so it costs one probe per query; it makes the answer exact for any sequence of
//! seq_hashes.
//!
//! `Active` is a single slot while only one key is left (the usual case past a shared
//! prefix) and a bitset over slots otherwise.

use super::ShardIndex;
use super::holders::{Holders, word_bit};
use super::nodes::Parent;
use super::pos::NodeId;
use super::slots::Slot;
use crate::ids::SeqHash;
use crate::matches::Matches;

enum Active {
    One(Slot),
    Many { bits: Vec<u64>, len: u32 },
}

impl Active {
    fn len(&self) -> u32 {
        match self {
            Active::One(_) => 1,
            Active::Many { len, .. } => *len,
        }
    }
}

impl ShardIndex {
    /// The overlap of every worker key holding `seqs[0]` (see [`Matches`]).
    ///
    /// `seqs` is a request's chain of seq_hashes (each continues the one before): the walk
    /// follows the tree, so a block stored under another prefix never matches.
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        let mut out = Matches::default();
        let mut at = seqs.first().and_then(|&s| match self.root.get(s) {
            Some(n) => Some((n, 0)),
            None => self.anywhere(s),
        });
        let mut active: Option<Active> = None;
        let mut depth = 0usize;
        while let Some((n, o)) = at {
            let Some(node) = self.node(n) else {
                break;
            };
            let holders = Holders::from_raw(node.holders);
            active = match active.take() {
                None => self.start(holders),
                Some(a) => self.step(a, holders, depth as u32, &mut out),
            };
            let Some(a) = &active else {
                break;
            };
            let run = self.runs.slice(node.run, node.start() + o, node.len() - o);
            let rest = seqs.get(depth..).unwrap_or(&[]);
            let m = run.iter().zip(rest).take_while(|(x, y)| x == y).count();
            if m == 0 {
                break;
            }
            out.depth_counts.extend(std::iter::repeat_n(a.len(), m));
            depth += m;
            let Some(&next) = seqs.get(depth) else {
                break;
            };
            let child = if o + m == node.len() {
                self.child(Parent::Node(n), next).map(|c| (c, 0))
            } else {
                None
            };
            at = child.or_else(|| self.anywhere(next));
        }
        if let Some(a) = active {
            self.leave_all(&a, depth as u32, &mut out);
        }
        out.overlaps
            .sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// Where the live block `seq` is, wherever it hangs.
    #[cold]
    fn anywhere(&self, seq: SeqHash) -> Option<(NodeId, usize)> {
        self.find(seq).and_then(|p| self.locate(p))
    }

    fn start(&self, holders: Holders) -> Option<Active> {
        match holders {
            Holders::None => None,
            Holders::Single(s) => Some(Active::One(s)),
            Holders::Set(i) => {
                let set = self.sets.get(i)?;
                Some(Active::Many {
                    bits: set.bits.clone(),
                    len: set.len,
                })
            }
        }
    }

    /// Intersects `active` with a node's holders; keys that drop out leave with overlap
    /// `depth` (the blocks before the node).
    fn step(
        &self,
        active: Active,
        holders: Holders,
        depth: u32,
        out: &mut Matches,
    ) -> Option<Active> {
        match (active, holders) {
            (a, Holders::None) => {
                self.leave_all(&a, depth, out);
                None
            }
            (Active::One(a), h) => {
                if self.sets.contains(h, a) {
                    Some(Active::One(a))
                } else {
                    self.leave(a, depth, out);
                    None
                }
            }
            (Active::Many { bits, len }, Holders::Single(s)) => {
                let (w, b) = word_bit(s);
                let kept = bits.get(w).is_some_and(|x| x & b != 0);
                let many = Active::Many { bits, len };
                if kept {
                    self.leave_except(&many, s, depth, out);
                    Some(Active::One(s))
                } else {
                    self.leave_all(&many, depth, out);
                    None
                }
            }
            (Active::Many { mut bits, .. }, Holders::Set(i)) => {
                let set_bits: &[u64] = self.sets.get(i).map_or(&[], |s| &s.bits);
                let mut len = 0u32;
                for (w, word) in bits.iter_mut().enumerate() {
                    let keep = *word & set_bits.get(w).copied().unwrap_or(0);
                    let mut gone = *word & !keep;
                    while gone != 0 {
                        self.leave(Slot(w as u32 * 64 + gone.trailing_zeros()), depth, out);
                        gone &= gone - 1;
                    }
                    *word = keep;
                    len += keep.count_ones();
                }
                (len > 0).then_some(Active::Many { bits, len })
            }
        }
    }

    fn leave(&self, slot: Slot, depth: u32, out: &mut Matches) {
        if depth > 0
            && let Some(key) = self.slots.key(slot)
        {
            out.overlaps.push((key, depth));
        }
    }

    fn leave_except(&self, active: &Active, keep: Slot, depth: u32, out: &mut Matches) {
        match active {
            Active::One(a) if *a != keep => self.leave(*a, depth, out),
            Active::One(_) => {}
            Active::Many { bits, .. } => for_each_slot(bits, |s| {
                if s != keep {
                    self.leave(s, depth, out);
                }
            }),
        }
    }

    fn leave_all(&self, active: &Active, depth: u32, out: &mut Matches) {
        match active {
            Active::One(a) => self.leave(*a, depth, out),
            Active::Many { bits, .. } => for_each_slot(bits, |s| self.leave(s, depth, out)),
        }
    }
}

fn for_each_slot(bits: &[u64], mut f: impl FnMut(Slot)) {
    for (w, &word) in bits.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            f(Slot(w as u32 * 64 + rest.trailing_zeros()));
            rest &= rest - 1;
        }
    }
}
