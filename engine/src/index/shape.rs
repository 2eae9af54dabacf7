//! Changing the tree's shape: finding a position's node, parent-child links, splitting a
//! node, merging a node into its only child, pruning dead leaves.
//!
//! Every operation here keeps the module invariants of `index` (runs, nodes and child maps
//! agree) and changes no holder multiset of any block; the callers in `store` and `remove`
//! change holders and then call [`ShardIndex::settle`] or [`ShardIndex::prune`].

use super::ShardIndex;
use super::holders::Holders;
use super::nodes::{Kids, Node, Parent};
use super::pos::{NodeId, Pos};
use crate::ids::SeqHash;

impl ShardIndex {
    /// The node holding `pos` and the block's offset inside that node.
    #[inline]
    pub(super) fn locate(&self, pos: Pos) -> Option<(NodeId, usize)> {
        let id = self.runs.get(pos.run())?.segs.find(pos.off())?;
        let n = self.nodes.get(id)?;
        (n.run == pos.run() && pos.off() < n.end()).then(|| (id, pos.off() - n.start()))
    }

    /// The node `id` (a copy: nodes are 20 bytes).
    #[inline]
    pub(super) fn node(&self, id: NodeId) -> Option<Node> {
        self.nodes.get(id).copied()
    }

    /// The seq_hash of `node`'s first block.
    #[inline]
    pub(super) fn first_seq(&self, node: &Node) -> Option<SeqHash> {
        self.runs.seq(Pos::new(node.run, node.start())?)
    }

    /// The child of `parent` whose first block is `seq`.
    #[inline]
    pub(super) fn child(&self, parent: Parent, seq: SeqHash) -> Option<NodeId> {
        match parent {
            Parent::Root => self.root.get(seq),
            Parent::Node(p) => match self.nodes.get(p)?.kids() {
                Kids::None => None,
                Kids::One(c) => {
                    let first = self.nodes.get(c).and_then(|n| self.first_seq(n))?;
                    (first == seq).then_some(c)
                }
                Kids::Map(i) => self.maps.get(i)?.get(seq),
            },
        }
    }

    /// Links `child` (first block `seq`) under `parent`.
    pub(super) fn add_child(&mut self, parent: Parent, seq: SeqHash, child: NodeId) {
        let p = match parent {
            Parent::Root => return self.root.set(seq, child),
            Parent::Node(p) => p,
        };
        let Some(kids) = self.nodes.get(p).map(Node::kids) else {
            return;
        };
        let kids = match kids {
            Kids::None => Kids::One(child),
            Kids::One(c) => {
                let Some(first) = self.nodes.get(c).and_then(|n| self.first_seq(n)) else {
                    return;
                };
                Kids::Map(self.maps.create(&[(first, c), (seq, child)]))
            }
            Kids::Map(i) => {
                if let Some(m) = self.maps.get_mut(i) {
                    m.set(seq, child);
                }
                Kids::Map(i)
            }
        };
        if let Some(n) = self.nodes.get_mut(p) {
            n.set_kids(kids);
        }
    }

    /// `parent`'s child starting with `seq` is now `new`.
    fn replace_child(&mut self, parent: Parent, seq: SeqHash, new: NodeId) {
        let p = match parent {
            Parent::Root => return self.root.set(seq, new),
            Parent::Node(p) => p,
        };
        match self.nodes.get(p).map(Node::kids) {
            Some(Kids::One(_)) => {
                if let Some(n) = self.nodes.get_mut(p) {
                    n.set_kids(Kids::One(new));
                }
            }
            Some(Kids::Map(i)) => {
                if let Some(m) = self.maps.get_mut(i) {
                    m.set(seq, new);
                }
            }
            Some(Kids::None) | None => {}
        }
    }

    /// Unlinks `parent`'s child starting with `seq`; a map left with one child dissolves.
    fn drop_child(&mut self, parent: Parent, seq: SeqHash) {
        let p = match parent {
            Parent::Root => return self.root.remove(seq),
            Parent::Node(p) => p,
        };
        let kids = match self.nodes.get(p).map(Node::kids) {
            Some(Kids::One(_)) => Kids::None,
            Some(Kids::Map(i)) => {
                let Some(m) = self.maps.get_mut(i) else {
                    return;
                };
                m.remove(seq);
                if m.len() >= 2 {
                    return;
                }
                let only = m.any();
                self.maps.release(i);
                only.map_or(Kids::None, Kids::One)
            }
            Some(Kids::None) | None => return,
        };
        if let Some(n) = self.nodes.get_mut(p) {
            n.set_kids(kids);
        }
    }

    /// Splits node `n` after its first `k` blocks (`0 < k < len`). The new node takes the
    /// first `k` blocks and `n`'s place under its parent; `n` keeps the rest, its children
    /// and its id (so no child needs a new parent). Returns the new node.
    pub(super) fn split(&mut self, n: NodeId, k: usize) -> Option<NodeId> {
        let node = self.node(n)?;
        if k == 0 || k >= node.len() {
            return None;
        }
        let seq = self.first_seq(&node)?;
        let mut head = Node::new(
            node.run,
            node.start(),
            k,
            node.parent(),
            Holders::None.raw(),
        );
        head.set_kids(Kids::One(n));
        let h = self.nodes.insert(head)?;
        let holders = self.sets.duplicate(Holders::from_raw(node.holders));
        if let Some(hn) = self.nodes.get_mut(h) {
            hn.holders = holders.raw();
        }
        if let Some(tail) = self.nodes.get_mut(n) {
            tail.start += k as u16;
            tail.len -= k as u16;
            tail.set_parent(Parent::Node(h));
        }
        self.replace_child(node.parent(), seq, h);
        self.runs.move_view(node.run, n, node.start() + k);
        self.runs.add_view(node.run, node.start(), h);
        Some(h)
    }

    /// Splits `n` so that its blocks `a..b` (`a < b <= len`) are one node, which it returns.
    pub(super) fn isolate(&mut self, n: NodeId, a: usize, b: usize) -> Option<NodeId> {
        if a > 0 {
            self.split(n, a)?;
        }
        let len = self.node(n)?.len();
        if b - a < len {
            self.split(n, b - a)
        } else {
            Some(n)
        }
    }

    /// If `p`'s only child continues `p`'s range of the same run with the same holders, the
    /// child absorbs `p` (keeping its own id and children) and is returned.
    fn merge_down(&mut self, p: NodeId) -> Option<NodeId> {
        let pn = self.node(p)?;
        let Kids::One(c) = pn.kids() else {
            return None;
        };
        let cn = self.node(c)?;
        let (ph, ch) = (Holders::from_raw(pn.holders), Holders::from_raw(cn.holders));
        if cn.run != pn.run || cn.start() != pn.end() || !self.sets.same(ph, ch) {
            return None;
        }
        let seq = self.first_seq(&pn)?;
        if let Some(child) = self.nodes.get_mut(c) {
            child.start = pn.start;
            child.len += pn.len;
            child.set_parent(pn.parent());
        }
        self.replace_child(pn.parent(), seq, c);
        self.runs.move_view(pn.run, c, pn.start());
        self.runs.drop_view(pn.run, p);
        self.sets.drop_value(ph);
        self.nodes.remove(p);
        Some(c)
    }

    /// Restores path compression around `n` after its holders changed (invariant 4);
    /// returns the node that now covers `n`'s blocks.
    pub(super) fn settle(&mut self, n: NodeId) -> NodeId {
        let mut n = n;
        if let Some(Parent::Node(p)) = self.nodes.get(n).map(Node::parent)
            && let Some(merged) = self.merge_down(p)
        {
            n = merged;
        }
        self.merge_down(n).unwrap_or(n)
    }

    /// Deletes `n` if nobody holds it and nothing hangs below it, then its ancestors while
    /// the same holds for them (invariant 2); merges where a deletion leaves one child.
    pub(super) fn prune(&mut self, n: NodeId) {
        let mut cur = n;
        loop {
            let Some(node) = self.node(cur) else {
                return;
            };
            if Holders::from_raw(node.holders) != Holders::None || node.kids() != Kids::None {
                self.settle(cur);
                return;
            }
            let Some(seq) = self.first_seq(&node) else {
                return;
            };
            self.drop_child(node.parent(), seq);
            // The seq_hash table forgets lazily (seq_index invariant 1): rebuilt once dead
            // entries outnumber live blocks, which also gives memory back.
            self.stored -= node.len();
            self.dead += node.len();
            self.runs.drop_view(node.run, cur);
            self.nodes.remove(cur);
            if self.dead > self.stored && !self.defer_dead_rebuilds {
                self.rebuild_seq_index();
            }
            match node.parent() {
                Parent::Root => return,
                Parent::Node(p) => cur = p,
            }
        }
    }
}
