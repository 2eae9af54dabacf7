//! `find_matches`: per worker key, how long a prefix of the request it holds.
//!
//! # Algorithm
//! Walk the request's seq_hashes in order, keeping the set of worker keys that held every
//! block so far (`Active`). A key that is missing at depth `d` leaves with overlap `d`. The
//! walk ends when nobody is left or the request ends. Blocks are probed in chunks of
//! [`CHUNK`]: the probes of one chunk do not depend on each other, so their cache misses
//! overlap. The first block is probed alone first, so a request nobody holds costs one
//! probe; otherwise an early exit wastes at most `CHUNK - 1` probes.
//!
//! `Active` is a single slot while only one key is left (the usual case past a shared
//! prefix: one compare per block) and a bitset over slots otherwise.

use super::holders::{Holders, word_bit};
use super::{ShardIndex, Slot};
use crate::ids::SeqHash;
use crate::matches::Matches;

/// Blocks probed at once. Measured in `benches/index.rs` on this project's 2-core EPYC:
/// 32 beats 16 (a 2048-block query: 26 µs -> 17 µs); 64 measured the same or slower, and
/// starting with smaller chunks cost 15% on 512-block queries.
const CHUNK: usize = 32;

enum Active {
    One(Slot),
    Many { bits: Vec<u64>, len: u32 },
}

impl ShardIndex {
    /// The overlap of every worker key holding `seqs[0]` (see [`Matches`]).
    pub fn find_matches(&self, seqs: &[SeqHash]) -> Matches {
        let mut out = Matches::default();
        let Some(&first) = seqs.first() else {
            return out;
        };
        if self.lookup(first).is_none() {
            return out;
        }
        let mut probes = [None::<Holders>; CHUNK];
        let mut active: Option<Active> = None;
        let mut depth = 0usize;
        'chunks: for chunk in seqs.chunks(CHUNK) {
            for (p, s) in probes.iter_mut().zip(chunk) {
                *p = self.lookup(*s);
            }
            for probe in probes.iter().take(chunk.len()) {
                let next = match active.take() {
                    None => self.start(*probe),
                    Some(a) => self.step(a, *probe, depth as u32, &mut out),
                };
                match next {
                    Some(a) => {
                        out.depth_counts.push(a.len());
                        active = Some(a);
                        depth += 1;
                    }
                    None => break 'chunks,
                }
            }
        }
        if let Some(a) = active {
            self.leave_all(&a, depth as u32, &mut out);
        }
        out.overlaps
            .sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    fn start(&self, probe: Option<Holders>) -> Option<Active> {
        match probe? {
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

    /// Intersects `active` with the holders of block `depth`; keys that drop out leave with
    /// overlap `depth`.
    fn step(
        &self,
        active: Active,
        probe: Option<Holders>,
        depth: u32,
        out: &mut Matches,
    ) -> Option<Active> {
        let Some(holders) = probe else {
            self.leave_all(&active, depth, out);
            return None;
        };
        match (active, holders) {
            (Active::One(a), Holders::Single(s)) => {
                if a == s {
                    Some(Active::One(a))
                } else {
                    self.leave(a, depth, out);
                    None
                }
            }
            (Active::One(a), Holders::Set(i)) => {
                if self.sets.get(i).is_some_and(|set| set.contains(a)) {
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
                        let slot = Slot(w as u32 * 64 + gone.trailing_zeros());
                        self.leave(slot, depth, out);
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
        if let Some(key) = self.slots.key(slot) {
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

impl Active {
    fn len(&self) -> u32 {
        match self {
            Active::One(_) => 1,
            Active::Many { len, .. } => *len,
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
