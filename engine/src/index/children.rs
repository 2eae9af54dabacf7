//! Child maps: the children of a node (or of the root), keyed by their first block.
//!
//! A node with one child keeps it inline (`nodes::Kids::One`); two or more live in a map
//! here. Junction nodes (the end of a system prompt that thousands of requests continue)
//! have thousands of children, so the lookup is a hash probe, not a scan.
//!
//! # Invariants
//! 1. A map holds each child once, under the seq_hash of the child's first block; two
//!    children never share a first block (a store that would create one matches instead).
//! 2. A map with fewer than two children is dissolved by its owner (the root's map is the
//!    exception: it is not in the slab).
//! 3. The slab is back to its empty footprint when no map is live.

use super::pos::NodeId;
use crate::ids::SeqHash;
use hashbrown::HashTable;

/// One child: its first block's seq_hash and its node (12 bytes: 4-byte aligned).
#[derive(Clone, Copy, Debug)]
struct Child {
    seq: [u32; 2],
    node: u32,
}

impl Child {
    #[inline]
    fn seq(&self) -> u64 {
        u64::from(self.seq[0]) | (u64::from(self.seq[1]) << 32)
    }
}

/// seq_hashes are XXH3 outputs, already uniform: they are their own hash.
#[inline]
fn hash(seq: u64) -> u64 {
    seq
}

/// Children of one node, by first block.
#[derive(Debug, Default)]
pub struct ChildMap {
    table: HashTable<Child>,
}

impl ChildMap {
    /// The child starting with `seq`.
    #[inline]
    pub fn get(&self, seq: SeqHash) -> Option<NodeId> {
        self.table
            .find(hash(seq.0), |c| c.seq() == seq.0)
            .map(|c| NodeId(c.node))
    }

    /// Records `node` as the child starting with `seq` (replacing any entry for `seq`).
    pub fn set(&mut self, seq: SeqHash, node: NodeId) {
        let child = Child {
            seq: [seq.0 as u32, (seq.0 >> 32) as u32],
            node: node.0,
        };
        match self
            .table
            .entry(hash(seq.0), |c| c.seq() == seq.0, |c| hash(c.seq()))
        {
            hashbrown::hash_table::Entry::Occupied(mut o) => *o.get_mut() = child,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(child);
            }
        }
    }

    /// Forgets the child starting with `seq`; shrinks when mostly empty.
    pub fn remove(&mut self, seq: SeqHash) {
        if let Ok(o) = self.table.find_entry(hash(seq.0), |c| c.seq() == seq.0) {
            o.remove();
        }
        let (len, cap) = (self.table.len(), self.table.capacity());
        if len == 0 {
            self.table = HashTable::new();
        } else if cap >= 64 && len * 8 < cap {
            self.table.shrink_to(len * 2, |c| hash(c.seq()));
        }
    }

    /// Children.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Some child (the only one, when `len() == 1`).
    pub fn any(&self) -> Option<NodeId> {
        self.table.iter().next().map(|c| NodeId(c.node))
    }

    /// Every child.
    pub fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.table.iter().map(|c| NodeId(c.node))
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}

/// The slab of child maps.
#[derive(Debug, Default)]
pub struct ChildMaps {
    maps: Vec<ChildMap>,
    free: Vec<u32>,
    live: usize,
}

impl ChildMaps {
    /// The map `i`.
    #[inline]
    pub fn get(&self, i: u32) -> Option<&ChildMap> {
        self.maps.get(i as usize)
    }

    /// The map `i`, mutably.
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> Option<&mut ChildMap> {
        self.maps.get_mut(i as usize)
    }

    /// A new map holding `kids`.
    pub fn create(&mut self, kids: &[(SeqHash, NodeId)]) -> u32 {
        let mut map = ChildMap::default();
        for &(s, n) in kids {
            map.set(s, n);
        }
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                if let Some(m) = self.maps.get_mut(i as usize) {
                    *m = map;
                }
                i
            }
            None => {
                self.maps.push(map);
                (self.maps.len() - 1) as u32
            }
        }
    }

    /// Frees map `i`.
    pub fn release(&mut self, i: u32) {
        if let Some(m) = self.maps.get_mut(i as usize) {
            *m = ChildMap::default();
            self.live -= 1;
            if self.live == 0 {
                *self = Self::default();
            } else {
                self.free.push(i);
            }
        }
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.maps.capacity() * size_of::<ChildMap>()
            + self.free.capacity() * 4
            + self.maps.iter().map(ChildMap::heap_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_set_replace_remove_and_free() {
        let mut maps = ChildMaps::default();
        let i = maps.create(&[(SeqHash(1), NodeId(10)), (SeqHash(2), NodeId(20))]);
        let m = maps.get_mut(i).unwrap();
        assert_eq!(m.get(SeqHash(2)), Some(NodeId(20)));
        m.set(SeqHash(2), NodeId(21));
        assert_eq!((m.get(SeqHash(2)), m.len()), (Some(NodeId(21)), 2));
        m.remove(SeqHash(1));
        assert_eq!((m.get(SeqHash(1)), m.any()), (None, Some(NodeId(21))));
        maps.release(i);
        assert_eq!(maps.heap_bytes(), 0);
    }
}
