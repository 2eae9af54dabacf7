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
//! Keys leave in groups of increasing depth. Each group is pushed in descending key order
//! (walking the slot table's key ranking, not sorting), so reversing the list once at the
//! end gives [`Matches`]' order: deepest first, then by key.

use super::ShardIndex;
use super::holders::{Holders, word_bit};
use super::nodes::Parent;
use super::pos::NodeId;
use super::slots::Slot;
use crate::ids::SeqHash;
use crate::matches::Matches;

/// Words of a slot bitset kept inline (256 slots); wider clusters spill to the heap.
const INLINE_WORDS: usize = 4;

/// A bitset over slots that does not allocate for up to 256 slots.
#[derive(Clone)]
enum Bits {
    Inline([u64; INLINE_WORDS], usize),
    Heap(Vec<u64>),
}

impl Bits {
    fn from_slice(words: &[u64]) -> Self {
        if words.len() <= INLINE_WORDS {
            let mut a = [0u64; INLINE_WORDS];
            if let Some(dst) = a.get_mut(..words.len()) {
                dst.copy_from_slice(words);
            }
            Bits::Inline(a, words.len())
        } else {
            Bits::Heap(words.to_vec())
        }
    }

    fn words(&self) -> &[u64] {
        match self {
            Bits::Inline(a, n) => a.get(..*n).unwrap_or(&[]),
            Bits::Heap(v) => v,
        }
    }

    fn words_mut(&mut self) -> &mut [u64] {
        match self {
            Bits::Inline(a, n) => a.get_mut(..*n).unwrap_or(&mut []),
            Bits::Heap(v) => v,
        }
    }

    fn contains(&self, slot: Slot) -> bool {
        let (w, b) = word_bit(slot);
        self.words().get(w).is_some_and(|x| x & b != 0)
    }
}

enum Active {
    One(Slot),
    Many { bits: Bits, len: u32 },
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
    /// `seqs` is a request's chain of seq_hashes (each continues the one before); the answer
    /// is exact for any sequence (see the module docs).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        let mut out = Matches::default();
        let mut at = seqs.first().and_then(|&s| match self.root.get(s) {
            Some(n) => Some((n, 0)),
            None => self.anywhere(s),
        });
        if at.is_none() {
            return out;
        }
        out.depth_counts.reserve(seqs.len());
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
        out.overlaps.reverse();
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
                    bits: Bits::from_slice(&set.bits),
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
                if bits.contains(s) {
                    let mut gone = bits;
                    let (w, b) = word_bit(s);
                    if let Some(x) = gone.words_mut().get_mut(w) {
                        *x &= !b;
                    }
                    self.leave_group(&gone, len - 1, depth, out);
                    Some(Active::One(s))
                } else {
                    self.leave_group(&bits, len, depth, out);
                    None
                }
            }
            (Active::Many { mut bits, len }, Holders::Set(i)) => {
                let set_bits: &[u64] = self.sets.get(i).map_or(&[], |s| &s.bits);
                let mut gone = bits.clone();
                let (mut kept, mut left) = (0u32, 0u32);
                for (w, (word, g)) in bits
                    .words_mut()
                    .iter_mut()
                    .zip(gone.words_mut())
                    .enumerate()
                {
                    let keep = *word & set_bits.get(w).copied().unwrap_or(0);
                    *g = *word & !keep;
                    *word = keep;
                    kept += keep.count_ones();
                    left += g.count_ones();
                }
                debug_assert_eq!(kept + left, len);
                if left > 0 {
                    self.leave_group(&gone, left, depth, out);
                }
                (kept > 0).then_some(Active::Many { bits, len: kept })
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

    /// Pushes the `len` slots of `bits` with overlap `depth`, in descending key order.
    fn leave_group(&self, bits: &Bits, len: u32, depth: u32, out: &mut Matches) {
        if depth == 0 || len == 0 {
            return;
        }
        out.overlaps.reserve(len as usize);
        let ranked = self.slots.by_rank();
        if (len as usize) * 8 >= ranked.len() {
            // A large share of the keys: walk the ranking once.
            for &s in ranked.iter().rev() {
                if bits.contains(s) {
                    self.leave(s, depth, out);
                }
            }
            return;
        }
        // A few keys: sort them by rank.
        let mut few: Vec<(u32, Slot)> = Vec::with_capacity(len as usize);
        for (w, &word) in bits.words().iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                let s = Slot(w as u32 * 64 + rest.trailing_zeros());
                few.push((self.slots.rank(s), s));
                rest &= rest - 1;
            }
        }
        few.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        for (_, s) in few {
            self.leave(s, depth, out);
        }
    }

    fn leave_all(&self, active: &Active, depth: u32, out: &mut Matches) {
        match active {
            Active::One(a) => self.leave(*a, depth, out),
            Active::Many { bits, len } => self.leave_group(bits, *len, depth, out),
        }
    }
}
