//! Who holds a node's blocks: a 32-bit value per node and the multi-holder sets behind it.
//!
//! Every block of a node has the same holder multiset (that is what makes a node a node), so
//! holders are kept per node, not per block. Most nodes in real traffic are held by exactly
//! one worker key once (a request's private tail), so that case is inline in the node;
//! anything else (several holders, or one holder with several copies) is a [`HolderSet`] in
//! a slab.
//!
//! # Invariants
//! 1. [`Holders::None`]: nobody holds the blocks (a node kept only because held blocks hang
//!    below it). `Single(s)`: exactly one holder with one copy. `Set(i)`: `sets[i]` is live
//!    and holds at least one holder; its `bits` are trimmed (no trailing zero word), and
//!    `extra` lists `count - 1` only for holders whose count exceeds 1.
//! 2. A set that falls back to one holder with one copy is demoted to `Single` and freed; a
//!    set that empties is freed and the value becomes `None`.
//! 3. Each live set is referenced by exactly one node (splits copy sets, never share them).

use super::slots::Slot;

const SET_TAG: u32 = 1 << 31;
const NONE_RAW: u32 = u32::MAX;

/// A decoded node holder value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holders {
    /// Nobody holds the blocks.
    None,
    /// One holder with one copy.
    Single(Slot),
    /// Index of a [`HolderSet`] in the slab.
    Set(u32),
}

impl Holders {
    /// Decodes a node's holder value.
    #[inline]
    pub fn from_raw(raw: u32) -> Self {
        if raw == NONE_RAW {
            Holders::None
        } else if raw & SET_TAG == 0 {
            Holders::Single(Slot(raw))
        } else {
            Holders::Set(raw & !SET_TAG)
        }
    }

    /// Encodes a node's holder value.
    #[inline]
    pub fn raw(self) -> u32 {
        match self {
            Holders::None => NONE_RAW,
            Holders::Single(s) => s.0,
            Holders::Set(i) => i | SET_TAG,
        }
    }
}

/// Several holders of a node (or one holder with several copies).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HolderSet {
    /// Bit `s` set iff slot `s` holds the blocks.
    pub bits: Vec<u64>,
    /// Number of bits set.
    pub len: u32,
    /// `(slot, count - 1)` for holders with more than one copy, sorted by slot. Rare, so a
    /// short list.
    extra: Vec<(Slot, u32)>,
}

impl HolderSet {
    /// Does `slot` hold the blocks?
    #[inline]
    pub fn contains(&self, slot: Slot) -> bool {
        let (w, b) = word_bit(slot);
        self.bits.get(w).is_some_and(|x| x & b != 0)
    }

    /// Adds one copy for `slot`; returns true if `slot` did not hold the blocks before.
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
        match self.extra.binary_search_by_key(&slot, |e| e.0) {
            Ok(i) => {
                if let Some(e) = self.extra.get_mut(i) {
                    e.1 = e.1.saturating_add(1);
                }
            }
            Err(i) => self.extra.insert(i, (slot, 1)),
        }
        false
    }

    /// Adds `copies` (at least 1) copies for `slot` at once; returns true if `slot` did not
    /// hold the blocks before. Costs the same whatever `copies` is (a snapshot's holder may
    /// claim billions).
    pub fn add_copies(&mut self, slot: Slot, copies: u32) -> bool {
        // `add` counts one of them.
        let newly = self.add(slot);
        let more = copies.saturating_sub(1);
        if more > 0 {
            match self.extra.binary_search_by_key(&slot, |e| e.0) {
                Ok(i) => {
                    if let Some(e) = self.extra.get_mut(i) {
                        e.1 = e.1.saturating_add(more);
                    }
                }
                Err(i) => self.extra.insert(i, (slot, more)),
            }
        }
        newly
    }

    /// Drops one copy for `slot`; returns `Some(true)` if `slot` no longer holds the blocks,
    /// `Some(false)` if copies remain, `None` if it held none.
    pub fn remove(&mut self, slot: Slot) -> Option<bool> {
        if !self.contains(slot) {
            return None;
        }
        if let Ok(i) = self.extra.binary_search_by_key(&slot, |e| e.0) {
            if let Some(e) = self.extra.get_mut(i) {
                e.1 -= 1;
                if e.1 == 0 {
                    self.extra.remove(i);
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

/// The slab of holder sets, and every operation on node holder values.
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

    fn insert(&mut self, set: HolderSet) -> Holders {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                if let Some(slot) = self.sets.get_mut(i as usize) {
                    *slot = set;
                }
                Holders::Set(i)
            }
            None => {
                self.sets.push(set);
                Holders::Set((self.sets.len() - 1) as u32)
            }
        }
    }

    fn release(&mut self, i: u32) {
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

    /// Does `slot` hold a node whose holder value is `h`?
    #[inline]
    pub fn contains(&self, h: Holders, slot: Slot) -> bool {
        match h {
            Holders::None => false,
            Holders::Single(s) => s == slot,
            Holders::Set(i) => self.get(i).is_some_and(|s| s.contains(slot)),
        }
    }

    /// Distinct holders of `h`.
    pub fn count(&self, h: Holders) -> u32 {
        match h {
            Holders::None => 0,
            Holders::Single(_) => 1,
            Holders::Set(i) => self.get(i).map_or(0, |s| s.len),
        }
    }

    /// `h` plus one copy for `slot`, and whether `slot` is a new holder.
    pub fn add(&mut self, h: Holders, slot: Slot) -> (Holders, bool) {
        match h {
            Holders::None => (Holders::Single(slot), true),
            Holders::Single(other) => {
                let mut set = HolderSet::default();
                set.add(other);
                let newly = set.add(slot);
                (self.insert(set), newly)
            }
            Holders::Set(i) => {
                let newly = self.sets.get_mut(i as usize).is_some_and(|s| s.add(slot));
                (h, newly)
            }
        }
    }

    /// `h` plus `copies` copies for `slot` (0: nothing changes), and whether `slot` is a new
    /// holder; one step whatever `copies` is.
    pub fn add_copies(&mut self, h: Holders, slot: Slot, copies: u32) -> (Holders, bool) {
        match (copies, h) {
            (0, _) => (h, false),
            (1, _) => self.add(h, slot),
            (_, Holders::None) => {
                let mut set = HolderSet::default();
                let newly = set.add_copies(slot, copies);
                (self.insert(set), newly)
            }
            (_, Holders::Single(other)) => {
                let mut set = HolderSet::default();
                set.add(other);
                let newly = set.add_copies(slot, copies);
                (self.insert(set), newly)
            }
            (_, Holders::Set(i)) => {
                let newly = self
                    .sets
                    .get_mut(i as usize)
                    .is_some_and(|s| s.add_copies(slot, copies));
                (h, newly)
            }
        }
    }

    /// `h` minus one copy for `slot`, and whether `slot` no longer holds; `None` if `slot`
    /// held no copy (nothing changes).
    pub fn remove(&mut self, h: Holders, slot: Slot) -> Option<(Holders, bool)> {
        match h {
            Holders::None => None,
            Holders::Single(s) if s == slot => Some((Holders::None, true)),
            Holders::Single(_) => None,
            Holders::Set(i) => {
                let set = self.sets.get_mut(i as usize)?;
                let gone = set.remove(slot)?;
                if set.len == 0 {
                    self.release(i);
                    Some((Holders::None, gone))
                } else if let Some(sole) = set.sole_single() {
                    self.release(i);
                    Some((Holders::Single(sole), gone))
                } else {
                    Some((h, gone))
                }
            }
        }
    }

    /// Every holder of `h` with its copy count, by slot.
    pub fn holders_of(&self, h: Holders) -> Vec<(Slot, u32)> {
        match h {
            Holders::None => Vec::new(),
            Holders::Single(s) => vec![(s, 1)],
            Holders::Set(i) => {
                let Some(set) = self.get(i) else {
                    return Vec::new();
                };
                let mut out = Vec::with_capacity(set.len as usize);
                for (w, &word) in set.bits.iter().enumerate() {
                    let mut rest = word;
                    while rest != 0 {
                        let slot = Slot(w as u32 * 64 + rest.trailing_zeros());
                        let more = set
                            .extra
                            .binary_search_by_key(&slot, |e| e.0)
                            .ok()
                            .and_then(|i| set.extra.get(i))
                            .map_or(0, |e| e.1);
                        out.push((slot, 1 + more));
                        rest &= rest - 1;
                    }
                }
                out
            }
        }
    }

    /// A copy of `h` for another node (sets are never shared, invariant 3).
    pub fn duplicate(&mut self, h: Holders) -> Holders {
        match h {
            Holders::Set(i) => match self.get(i).cloned() {
                Some(set) => self.insert(set),
                None => Holders::None,
            },
            other => other,
        }
    }

    /// Frees whatever `h` owns.
    pub fn drop_value(&mut self, h: Holders) {
        if let Holders::Set(i) = h {
            self.release(i);
        }
    }

    /// Do `a` and `b` describe the same multiset?
    pub fn same(&self, a: Holders, b: Holders) -> bool {
        match (a, b) {
            (Holders::Set(x), Holders::Set(y)) => x == y || self.get(x) == self.get(y),
            (x, y) => x == y,
        }
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
            Holders::None,
            Holders::Single(Slot(0)),
            Holders::Single(Slot(Slot::MAX)),
            Holders::Set(7),
        ] {
            assert_eq!(Holders::from_raw(h.raw()), h);
        }
    }

    #[test]
    fn values_count_copies_demote_and_empty() {
        let mut slab = SetSlab::default();
        let (h, new) = slab.add(Holders::None, Slot(3));
        assert!(new);
        let (h, new) = slab.add(h, Slot(130));
        assert!(new && matches!(h, Holders::Set(_)));
        let (h, new) = slab.add(h, Slot(3));
        assert!(!new);
        assert_eq!(slab.count(h), 2);
        let dup = slab.duplicate(h);
        assert!(slab.same(h, dup) && dup != h);
        assert_eq!(slab.remove(h, Slot(3)), Some((h, false)));
        assert_eq!(
            slab.remove(h, Slot(3)),
            Some((Holders::Single(Slot(130)), true))
        );
        assert!(!slab.same(h, dup));
        assert_eq!(slab.remove(Holders::Single(Slot(130)), Slot(3)), None);
        assert_eq!(
            slab.remove(Holders::Single(Slot(130)), Slot(130)),
            Some((Holders::None, true))
        );
        slab.drop_value(dup);
        assert_eq!(slab.heap_bytes(), 0);
        assert_eq!(slab.heap_bytes(), 0);
    }
}
