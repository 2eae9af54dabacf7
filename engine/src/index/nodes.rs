//! Tree nodes: a node is a view over a range of one run, with one holder value for all its
//! blocks and its children.
//!
//! # Invariants
//! 1. A live node's range `start..start + len` lies inside its run, `len >= 1`, and its run
//!    lists a segment `(start, this node)` (runs invariant 1).
//! 2. `parent` is the node whose last block is the parent of this node's first block, or
//!    [`Parent::Root`]; the parent lists this node among its children under this node's
//!    first seq_hash.
//! 3. The slab is back to its empty footprint when no node is live.
//! 4. A free slot has length 0; a live node has length >= 1.

use super::pos::{NodeId, RunId};

/// A node's parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// The node's first block starts a sequence.
    Root,
    /// The node's first block continues this node's last block.
    Node(NodeId),
}

const NO_PARENT: u32 = u32::MAX;
const MAP_TAG: u32 = 1 << 31;
const NO_KIDS: u32 = u32::MAX;

/// A node's children, encoded in 32 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kids {
    /// A leaf.
    None,
    /// Exactly one child (the usual case inside a chain).
    One(NodeId),
    /// A child map (`children::ChildMaps`) with at least two children.
    Map(u32),
}

impl Kids {
    #[inline]
    fn from_raw(raw: u32) -> Self {
        if raw == NO_KIDS {
            Kids::None
        } else if raw & MAP_TAG == 0 {
            Kids::One(NodeId(raw))
        } else {
            Kids::Map(raw & !MAP_TAG)
        }
    }

    #[inline]
    fn raw(self) -> u32 {
        match self {
            Kids::None => NO_KIDS,
            Kids::One(n) => n.0,
            Kids::Map(i) => i | MAP_TAG,
        }
    }
}

/// One node (20 bytes).
#[derive(Clone, Copy, Debug)]
pub struct Node {
    /// The run it views.
    pub run: RunId,
    /// First offset of its range in the run.
    pub start: u16,
    /// Blocks in its range (1..=256).
    pub len: u16,
    parent: u32,
    /// Holder value (see `holders::Holders::raw`).
    pub holders: u32,
    kids: u32,
}

impl Node {
    /// A leaf over `run[start..start + len]`.
    pub fn new(run: RunId, start: usize, len: usize, parent: Parent, holders: u32) -> Self {
        let mut n = Self {
            run,
            start: start as u16,
            len: len as u16,
            parent: NO_PARENT,
            holders,
            kids: NO_KIDS,
        };
        n.set_parent(parent);
        n
    }

    /// The range's first offset.
    #[inline]
    pub fn start(&self) -> usize {
        usize::from(self.start)
    }

    /// The range's length.
    #[inline]
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// One past the range's last offset.
    #[inline]
    pub fn end(&self) -> usize {
        self.start() + self.len()
    }

    /// The parent.
    #[inline]
    pub fn parent(&self) -> Parent {
        if self.parent == NO_PARENT {
            Parent::Root
        } else {
            Parent::Node(NodeId(self.parent))
        }
    }

    /// Sets the parent.
    #[inline]
    pub fn set_parent(&mut self, p: Parent) {
        self.parent = match p {
            Parent::Root => NO_PARENT,
            Parent::Node(n) => n.0,
        };
    }

    /// The children.
    #[inline]
    pub fn kids(&self) -> Kids {
        Kids::from_raw(self.kids)
    }

    /// Sets the children.
    #[inline]
    pub fn set_kids(&mut self, k: Kids) {
        self.kids = k.raw();
    }
}

/// The slab of nodes.
#[derive(Debug, Default)]
pub struct Nodes {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    live: usize,
}

impl Nodes {
    /// The node `id`.
    #[inline]
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id.idx())
    }

    /// The node `id`, mutably.
    #[inline]
    pub fn get_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.nodes.get_mut(id.idx())
    }

    /// Can `n` more nodes be created?
    pub fn has_room(&self, n: usize) -> bool {
        self.free.len() + (NodeId::LIMIT as usize).saturating_sub(self.nodes.len()) >= n
    }

    /// Stores `node`, returning its id (`None` when the id space is exhausted; callers
    /// check [`Nodes::has_room`] first).
    pub fn insert(&mut self, node: Node) -> Option<NodeId> {
        let id = match self.free.pop() {
            Some(id) => {
                *self.nodes.get_mut(id.idx())? = node;
                id
            }
            None if self.nodes.len() < NodeId::LIMIT as usize => {
                self.nodes.push(node);
                NodeId((self.nodes.len() - 1) as u32)
            }
            None => return None,
        };
        self.live += 1;
        Some(id)
    }

    /// Frees node `id` (its length becomes 0: the mark of a free node).
    pub fn remove(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get_mut(id.idx()) {
            n.len = 0;
            self.live -= 1;
            if self.live == 0 {
                *self = Self::default();
            } else {
                self.free.push(id);
            }
        }
    }

    /// Every live node.
    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.len > 0)
    }

    /// Live nodes.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>() + self.free.capacity() * size_of::<NodeId>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_fields_round_trip_in_20_bytes() {
        assert_eq!(size_of::<Node>(), 20);
        let mut n = Node::new(RunId(3), 4, 256, Parent::Root, 7);
        assert_eq!((n.start(), n.len(), n.end()), (4, 256, 260));
        assert_eq!(n.parent(), Parent::Root);
        n.set_parent(Parent::Node(NodeId(9)));
        assert_eq!(n.parent(), Parent::Node(NodeId(9)));
        for k in [Kids::None, Kids::One(NodeId(5)), Kids::Map(2)] {
            n.set_kids(k);
            assert_eq!(n.kids(), k);
        }
    }
}
