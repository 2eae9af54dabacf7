//! Storing a chain of blocks for one worker key.
//!
//! # Algorithm
//! Walk from the parent block along the chain while the tree already has the next block:
//! inside a node that is one compare per block, at a node's end one child lookup. Each
//! matched stretch of a node gains one copy for the worker (the node is split at the
//! stretch's ends if the stretch is not the whole node). At the first block the tree lacks,
//! the rest of the chain is created in one go: appended in place to the parent's run when
//! the parent is the worker's own unshared, childless node at the end of its run (a
//! sequence growing during decode), otherwise as new runs of at most [`MAX_RUN_LEN`]
//! blocks, one node each.

use super::ShardIndex;
use super::holders::Holders;
use super::nodes::{Kids, Node, Parent};
use super::pos::{MAX_RUN_LEN, NodeId, Pos, RunId};
use super::slots::Slot;
use crate::error::{EngineError, Result};
use crate::ids::{SeqHash, WorkerKey};

impl ShardIndex {
    /// One more copy of each of `seqs` for `key`, as a chain continuing the block at
    /// `parent` (`None`: the chain starts a sequence). Appends each block's position to
    /// `out`, in chain order.
    ///
    /// Refused, changing nothing, if `parent` is not a live block
    /// ([`EngineError::UnknownPosition`]), the tree has no room left
    /// ([`EngineError::IndexFull`]) or the worker key space is exhausted.
    pub fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<Pos>,
        seqs: &[SeqHash],
        out: &mut Vec<Pos>,
    ) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        if let Some(p) = parent
            && self.locate(p).is_none()
        {
            return Err(EngineError::UnknownPosition);
        }
        // Every matched stretch may split its node twice; created blocks need a run (and
        // a node) per MAX_RUN_LEN blocks. Checked up front so a store never stops half way.
        let runs_needed = seqs.len().div_ceil(MAX_RUN_LEN) + 1;
        if !self.runs.has_room(runs_needed) || !self.nodes.has_room(3 * seqs.len() + 2) {
            return Err(EngineError::IndexFull);
        }
        let slot = self.slots.get_or_insert(key)?;
        out.reserve(seqs.len());
        let mut at = parent;
        let mut i = 0;
        while let Some(&next) = seqs.get(i) {
            let rest = seqs.get(i..).unwrap_or(&[]);
            let Some((n, o)) = self.next_block(at, next) else {
                self.create(Some(slot), at, rest, out);
                return Ok(());
            };
            let Some(node) = self.node(n) else {
                return Err(EngineError::UnknownPosition);
            };
            let first = node.start() + o;
            let have = self.runs.slice(node.run, first, node.len() - o);
            let m = have.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if m == 0 {
                // next_block only returns a block equal to `next`; unreachable in a
                // consistent tree, but never loop on it.
                return Err(EngineError::UnknownPosition);
            }
            self.hold(slot, n, o, o + m, 1);
            out.extend((first..first + m).filter_map(|off| Pos::new(node.run, off)));
            at = Pos::new(node.run, first + m - 1);
            i += m;
        }
        Ok(())
    }

    /// `copies` more copies of each of `seqs` for `key`, a chain that is already in the tree
    /// under `parent` (a [`ShardIndex::store`] of it came first): the same as `copies` more
    /// stores, in one walk whatever `copies` is (a snapshot's holder may claim billions of
    /// copies; restoring must not loop over them).
    ///
    /// Refused ([`EngineError::UnknownPosition`]) if `parent` or a block of the chain is not
    /// in the tree, [`EngineError::IndexFull`] if the splits it may need find no room.
    pub fn add_copies(
        &mut self,
        key: WorkerKey,
        parent: Option<Pos>,
        seqs: &[SeqHash],
        copies: u32,
    ) -> Result<()> {
        if seqs.is_empty() || copies == 0 {
            return Ok(());
        }
        if let Some(p) = parent
            && self.locate(p).is_none()
        {
            return Err(EngineError::UnknownPosition);
        }
        if !self.nodes.has_room(3 * seqs.len() + 2) {
            return Err(EngineError::IndexFull);
        }
        let slot = self.slots.get_or_insert(key)?;
        let mut at = parent;
        let mut i = 0;
        while let Some(&next) = seqs.get(i) {
            let rest = seqs.get(i..).unwrap_or(&[]);
            let (n, o) = self
                .next_block(at, next)
                .ok_or(EngineError::UnknownPosition)?;
            let node = self.node(n).ok_or(EngineError::UnknownPosition)?;
            let first = node.start() + o;
            let have = self.runs.slice(node.run, first, node.len() - o);
            let m = have.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if m == 0 {
                return Err(EngineError::UnknownPosition);
            }
            let run = node.run;
            self.hold(slot, n, o, o + m, copies);
            at = Pos::new(run, first + m - 1);
            i += m;
        }
        Ok(())
    }

    /// Makes sure the chain `seqs` exists under `parent` without adding a holder: missing
    /// blocks are created unheld. For grafting replicated blocks under ancestors this tree
    /// lacks: the caller MUST then store held blocks at or below the chain's end, or call
    /// [`ShardIndex::prune_unheld`] on it, so that no unheld leaf stays (invariant 2).
    /// Appends each block's position to `out`.
    pub fn ensure(
        &mut self,
        parent: Option<Pos>,
        seqs: &[SeqHash],
        out: &mut Vec<Pos>,
    ) -> Result<()> {
        if let Some(p) = parent
            && self.locate(p).is_none()
        {
            return Err(EngineError::UnknownPosition);
        }
        if !self.runs.has_room(seqs.len().div_ceil(MAX_RUN_LEN) + 1)
            || !self.nodes.has_room(seqs.len() + 2)
        {
            return Err(EngineError::IndexFull);
        }
        let mut at = parent;
        for (i, &next) in seqs.iter().enumerate() {
            let Some((n, o)) = self.next_block(at, next) else {
                self.create(None, at, seqs.get(i..).unwrap_or(&[]), out);
                return Ok(());
            };
            let Some(node) = self.node(n) else {
                return Err(EngineError::UnknownPosition);
            };
            at = Pos::new(node.run, node.start() + o);
            out.extend(at);
        }
        Ok(())
    }

    /// Prunes the block at `pos` and its ancestors while they are unheld leaves (after an
    /// [`ShardIndex::ensure`] that nothing was stored below).
    pub fn prune_unheld(&mut self, pos: Pos) {
        let Some((n, o)) = self.locate(pos) else {
            return;
        };
        let Some(node) = self.node(n) else {
            return;
        };
        if Holders::from_raw(node.holders) != Holders::None || node.kids() != Kids::None {
            return;
        }
        // Only the blocks up to `pos` were ensured; anything after it in the node is not
        // this caller's to drop.
        if o + 1 == node.len() {
            self.prune(n);
        }
    }

    /// The last branch a store created: the position of the block that gained a child, and
    /// how many children it has now. Taken (cleared) by the call.
    pub fn take_branch(&mut self) -> Option<(Pos, u32)> {
        self.branch.take()
    }

    /// The existing block after `at` (or starting a sequence) whose seq_hash is `seq`, as
    /// (node, offset in node).
    fn next_block(&self, at: Option<Pos>, seq: SeqHash) -> Option<(NodeId, usize)> {
        let Some(p) = at else {
            return self.root.get(seq).map(|c| (c, 0));
        };
        let (n, o) = self.locate(p)?;
        let node = self.nodes.get(n)?;
        if o + 1 < node.len() {
            let here = self.runs.seq_at(node.run, node.start() + o + 1)?;
            (here == seq).then_some((n, o + 1))
        } else {
            self.child(Parent::Node(n), seq).map(|c| (c, 0))
        }
    }

    /// `copies` more copies for `slot` of blocks `a..b` of node `n`.
    fn hold(&mut self, slot: Slot, n: NodeId, a: usize, b: usize, copies: u32) {
        let Some(target) = self.isolate(n, a, b) else {
            return;
        };
        let Some(node) = self.node(target) else {
            return;
        };
        let h = Holders::from_raw(node.holders);
        let (held, newly) = self.sets.add_copies(h, slot, copies);
        let len = node.len();
        if h == Holders::None {
            self.blocks += len;
        }
        if newly {
            self.entries += len as u64;
            self.slots.gained(slot, len as u64);
        }
        if let Some(t) = self.nodes.get_mut(target) {
            t.holders = held.raw();
        }
        self.settle(target);
    }

    /// Creates `seqs` as a chain continuing `at`, held once by `slot` (`None`: unheld).
    pub(super) fn create(
        &mut self,
        slot: Option<Slot>,
        at: Option<Pos>,
        seqs: &[SeqHash],
        out: &mut Vec<Pos>,
    ) {
        let mut parent = match at {
            None => Parent::Root,
            Some(p) => {
                let Some((n, o)) = self.locate(p) else {
                    return;
                };
                let len = self.node(n).map_or(0, |x| x.len());
                if o + 1 < len {
                    // The chain leaves `n` half way: the head up to `at` becomes the parent.
                    match self.split(n, o + 1) {
                        Some(head) => Parent::Node(head),
                        None => return,
                    }
                } else {
                    Parent::Node(n)
                }
            }
        };
        let mut rest = seqs;
        if let (Parent::Node(n), Some(slot)) = (parent, slot) {
            rest = self.extend_in_place(slot, n, rest, out);
        }
        let holders = slot.map_or(Holders::None, Holders::Single).raw();
        let mut first_child = true;
        while let Some(&first) = rest.first() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_RUN_LEN));
            let leaf = Node::new(RunId(0), 0, chunk.len(), parent, holders);
            let Some(id) = self.nodes.insert(leaf) else {
                return;
            };
            let Some(run) = self.runs.create(chunk, id) else {
                self.nodes.remove(id);
                return;
            };
            if let Some(node) = self.nodes.get_mut(id) {
                node.run = run;
            }
            self.add_child(parent, first, id);
            if first_child && let Parent::Node(p) = parent {
                self.note_branch(p);
            }
            first_child = false;
            self.created(slot, run, 0, chunk.len(), out);
            parent = Parent::Node(id);
            rest = tail;
        }
    }

    /// Appends a prefix of `seqs` to node `n`'s run when `n` is `slot`'s own unshared,
    /// childless node ending its run; returns what is left.
    fn extend_in_place<'a>(
        &mut self,
        slot: Slot,
        n: NodeId,
        seqs: &'a [SeqHash],
        out: &mut Vec<Pos>,
    ) -> &'a [SeqHash] {
        let Some(node) = self.node(n) else {
            return seqs;
        };
        let run_len = self.runs.run_len(node.run);
        let own = Holders::from_raw(node.holders) == Holders::Single(slot);
        if !own || node.kids() != Kids::None || node.end() != run_len || run_len >= MAX_RUN_LEN {
            return seqs;
        }
        let (chunk, rest) = seqs.split_at(seqs.len().min(MAX_RUN_LEN - run_len));
        self.runs.append(node.run, chunk);
        if let Some(x) = self.nodes.get_mut(n) {
            x.len += chunk.len() as u16;
        }
        self.created(Some(slot), node.run, run_len, chunk.len(), out);
        rest
    }

    /// Remembers that node `p` just gained a child (see [`ShardIndex::take_branch`]).
    fn note_branch(&mut self, p: NodeId) {
        let Some(node) = self.node(p) else {
            return;
        };
        let kids = match node.kids() {
            Kids::None => 0,
            Kids::One(_) => 1,
            Kids::Map(i) => self.maps.get(i).map_or(0, |m| m.len() as u32),
        };
        if let Some(last) = Pos::new(node.run, node.end() - 1) {
            self.branch = Some((last, kids));
        }
    }

    /// Bookkeeping for `len` blocks created at `run[start..]`, held once by `slot`.
    fn created(
        &mut self,
        slot: Option<Slot>,
        run: RunId,
        start: usize,
        len: usize,
        out: &mut Vec<Pos>,
    ) {
        if let Some(slot) = slot {
            self.blocks += len;
            self.entries += len as u64;
            self.slots.gained(slot, len as u64);
        }
        out.extend((start..start + len).filter_map(|o| Pos::new(run, o)));
        self.stored += len;
        if self.by_seq.has_room(len) {
            self.by_seq.record_range(&self.runs, run, start, len);
        } else {
            // The blocks are already in their node: the rebuild records them too.
            self.rebuild_seq_index();
        }
    }

    /// Rebuilds the seq_hash table from the tree with room for half as many blocks again as
    /// it has, re-inserting every live block in run order (seq_index invariant 3). (hashbrown
    /// rounds buckets up to a power of two, so the table still doubles each time; asking for
    /// twice the blocks would double it twice whenever the count sits just past a power of
    /// two, leaving it 37% full: measured, 13 bytes a block instead of 6.5 on W1.)
    #[cold]
    #[inline(never)]
    pub(super) fn rebuild_seq_index(&mut self) {
        let fresh = self.rebuilt_seq_index(0);
        self.by_seq = fresh.0;
        self.dead = 0;
    }

    /// The seq_hash table as the in-place rebuild (`rebuild_seq_index`) would build it now, with
    /// room for at least `n` more blocks; built from `&self`, so a caller whose readers
    /// must not wait for the rebuild does it outside its write section and installs the
    /// result ([`ShardIndex::install_seq_index`]) before anything else writes.
    pub fn rebuilt_seq_index(&self, n: usize) -> RebuiltSeqIndex {
        let live = self.stored;
        let mut fresh = super::seq_index::SeqIndex::with_room(live + (live / 2).max(n));
        for node in self.nodes.iter() {
            fresh.record_range(&self.runs, node.run, node.start(), node.len());
        }
        RebuiltSeqIndex(fresh)
    }

    /// Would a change of up to `n` blocks rebuild the seq_hash table inside it (a store's
    /// blocks find no room, or dead entries already outnumber live blocks)?
    pub fn seq_index_rebuild_due(&self, n: usize) -> bool {
        !self.by_seq.has_room(n) || self.dead > self.stored
    }

    /// Installs a table [`ShardIndex::rebuilt_seq_index`] built from this tree as it still
    /// is (nothing changed it since); returns the old one, to be dropped outside the
    /// caller's write section.
    pub fn install_seq_index(&mut self, fresh: RebuiltSeqIndex) -> RebuiltSeqIndex {
        self.dead = 0;
        RebuiltSeqIndex(std::mem::replace(&mut self.by_seq, fresh.0))
    }

    /// Leaves the rebuild that dead entries call for (more dead than live blocks) to the
    /// caller's next [`ShardIndex::seq_index_rebuild_due`] check instead of doing it in
    /// the removal that crossed the line. Growth (no room for a store) still rebuilds at
    /// once: the store needs the room.
    pub fn defer_dead_rebuilds(&mut self) {
        self.defer_dead_rebuilds = true;
    }
}

/// A seq_hash table rebuilt from a tree, to be installed in it
/// ([`ShardIndex::install_seq_index`]).
#[derive(Debug)]
pub struct RebuiltSeqIndex(super::seq_index::SeqIndex);

impl ShardIndex {}
