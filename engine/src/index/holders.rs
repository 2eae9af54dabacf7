//! Who holds a block: the 32-bit table value and the multi-holder sets behind it.
//!
//! Most blocks in real traffic are held by exactly one worker key once (a request's private
//! tail), so that case lives inline in the table value; anything else (several holders, or
//! one holder with several copies) moves to a [`HolderSet`] in a slab.
//!
//! # Invariants
//! 1. A value with the top bit clear is `Single(slot)`: exactly one holder, count 1.
//! 2. A value with the top bit set is `Set(i)`: `sets[i]` is live and holds at least one
//!    holder; its `bits` are trimmed (no trailing zero word), and `extra[s]` lists
//!    `count - 1` only for holders whose count exceeds 1.
//! 3. A set that falls back to one holder with count 1 is demoted to `Single` and freed.

use super::slots::Slot;

const SET_TAG: u32 = 1 << 31;

/// A decoded table value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holders {
    /// One holder with one copy.
    Single(Slot),
    /// Index of a [`HolderSet`] in the slab.
    Set(u32),
}

impl Holders {
    /// Decodes a table value.
    #[inline]
    pub fn from_raw(raw: u32) -> Self {
        if raw & SET_TAG == 0 {
            Holders::Single(Slot(raw))
        } else {
            Holders::Set(raw & !SET_TAG)
        }
    }

    /// Encodes a table value.
    #[inline]
    pub fn raw(self) -> u32 {
        match self {
            Holders::Single(s) => s.0,
            Holders::Set(i) => i | SET_TAG,
        }
    }
}

/// Several holders of one block (or one holder with several copies).
#[derive(Debug, Default, Clone)]
pub struct HolderSet {
    /// Bit `s` set iff slot `s` holds the block.
    pub bits: Vec<u64>,
    /// Number of bits set.
    pub len: u32,
    /// `(slot, count - 1)` for holders with more than one copy. Rare, so a short list.
    extra: Vec<(Slot, u32)>,
}

impl HolderSet {
    /// Does `slot` hold the block?
    #[inline]
    pub fn contains(&self, slot: Slot) -> bool {
        let (w, b) = word_bit(slot);
        self.bits.get(w).is_some_and(|x| x & b != 0)
    }

    /// Adds one copy for `slot`; returns true if `slot` did not hold the block before.
    pub fn add(&mut self, slot: Slot) -> bool {
        let (w, b) = word_bit(slot);
        if self.bits.len() <= w {
            self.bits.resize(w + 1, 0);
        }
        let Some(word) = self.bits.get_mut(w) else {
            return false;
        };
        if *word & b == 0 {
            *word |= b;
            self.len += 1;
            return true;
        }
        match self.extra.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, c)) => *c = c.saturating_add(1),
            None => self.extra.push((slot, 1)),
        }
        false
    }

    /// Drops one copy for `slot`; returns `Some(true)` if `slot` no longer holds the block,
    /// `Some(false)` if copies remain, `None` if it held none.
    pub fn remove(&mut self, slot: Slot) -> Option<bool> {
        if !self.contains(slot) {
            return None;
        }
        if let Some(pos) = self.extra.iter().position(|(s, _)| *s == slot) {
            if let Some((_, c)) = self.extra.get_mut(pos) {
                *c -= 1;
                if *c == 0 {
                    self.extra.swap_remove(pos);
                }
            }
            return Some(false);
        }
        let (w, b) = word_bit(slot);
        if let Some(word) = self.bits.get_mut(w) {
            *word &= !b;
        }
        self.len -= 1;
        while self.bits.last() == Some(&0) {
            self.bits.pop();
        }
        Some(true)
    }

    /// If exactly one holder with one copy remains, that holder (the set can be demoted).
    pub fn sole_single(&self) -> Option<Slot> {
        if self.len != 1 || !self.extra.is_empty() {
            return None;
        }
        let (w, word) = self.bits.iter().enumerate().find(|(_, w)| **w != 0)?;
        Some(Slot(w as u32 * 64 + word.trailing_zeros()))
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.bits.capacity() * 8 + self.extra.capacity() * size_of::<(Slot, u32)>()
    }
}

/// Word index and bit mask of `slot` in a bitset.
#[inline]
pub fn word_bit(slot: Slot) -> (usize, u64) {
    (slot.idx() / 64, 1u64 << (slot.0 % 64))
}

/// Slab of holder sets with a free list.
#[derive(Debug, Default)]
pub struct SetSlab {
    sets: Vec<HolderSet>,
    free: Vec<u32>,
    live: usize,
}

impl SetSlab {
    /// The set at `i`.
    #[inline]
    pub fn get(&self, i: u32) -> Option<&HolderSet> {
        self.sets.get(i as usize)
    }

    /// The set at `i`, mutably.
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> Option<&mut HolderSet> {
        self.sets.get_mut(i as usize)
    }

    /// Stores `set`, returning its index.
    pub fn insert(&mut self, set: HolderSet) -> u32 {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                if let Some(slot) = self.sets.get_mut(i as usize) {
                    *slot = set;
                }
                i
            }
            None => {
                self.sets.push(set);
                (self.sets.len() - 1) as u32
            }
        }
    }

    /// Frees the set at `i`.
    pub fn remove(&mut self, i: u32) {
        if let Some(slot) = self.sets.get_mut(i as usize) {
            *slot = HolderSet::default();
            self.live -= 1;
            if self.live == 0 {
                *self = Self::default();
            } else {
                self.free.push(i);
            }
        }
    }

    /// Live sets.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.sets.capacity() * size_of::<HolderSet>()
            + self.sets.iter().map(HolderSet::heap_bytes).sum::<usize>()
            + self.free.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip() {
        for h in [
            Holders::Single(Slot(0)),
            Holders::Single(Slot(Slot::MAX)),
            Holders::Set(7),
        ] {
            assert_eq!(Holders::from_raw(h.raw()), h);
        }
    }

    #[test]
    fn set_counts_copies_and_demotes() {
        let mut s = HolderSet::default();
        assert!(s.add(Slot(3)));
        assert!(s.add(Slot(130)));
        assert!(!s.add(Slot(3)));
        assert_eq!(s.len, 2);
        assert_eq!(s.remove(Slot(3)), Some(false));
        assert_eq!(s.remove(Slot(3)), Some(true));
        assert_eq!(s.remove(Slot(3)), None);
        assert_eq!(s.sole_single(), Some(Slot(130)));
        assert_eq!(s.remove(Slot(130)), Some(true));
        assert!(s.bits.is_empty());
    }
}
