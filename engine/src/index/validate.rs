//! A full check of the tree's structural invariants, for tests and debugging: O(size).

use super::ShardIndex;
use super::holders::Holders;
use super::nodes::{Kids, Parent};
use super::pos::{NodeId, Pos};
use hashbrown::{HashMap, HashSet};

impl ShardIndex {
    /// Checks every structural invariant of the tree (module docs of `index`, `runs`,
    /// `nodes`, `children`, `holders`, `seq_index`) and the counters; describes the first
    /// violation found. Walks the whole tree: for tests and debugging, not for hot paths.
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = HashSet::new();
        let mut runs = HashSet::new();
        let mut blocks = 0usize;
        let mut entries = 0u64;
        let mut per_slot: HashMap<u32, u64> = HashMap::new();
        let mut stack: Vec<(NodeId, Parent)> = Vec::new();
        for c in self.root.iter() {
            stack.push((c, Parent::Root));
        }
        while let Some((id, parent)) = stack.pop() {
            if !seen.insert(id) {
                return Err(format!("node {id:?} reached twice"));
            }
            let n = self.node(id).ok_or(format!("missing node {id:?}"))?;
            if n.parent() != parent {
                return Err(format!(
                    "node {id:?}: parent {:?}, linked from {parent:?}",
                    n.parent()
                ));
            }
            if n.len() == 0 || n.end() > self.runs.run_len(n.run) {
                return Err(format!(
                    "node {id:?}: range {}..{} outside its run",
                    n.start(),
                    n.end()
                ));
            }
            runs.insert(n.run);
            for off in n.start()..n.end() {
                let pos = Pos::new(n.run, off).ok_or("bad pos")?;
                if self.locate(pos) != Some((id, off - n.start())) {
                    return Err(format!("node {id:?}: {pos} does not locate to it"));
                }
                let seq = self.runs.seq(pos).ok_or("missing seq")?;
                if self.find(seq) != Some(pos) {
                    return Err(format!("node {id:?}: seq index misses {pos}"));
                }
            }
            let first = self.first_seq(&n).ok_or("no first seq")?;
            if self.child(parent, first) != Some(id) {
                return Err(format!("node {id:?}: its parent does not list it"));
            }
            let h = Holders::from_raw(n.holders);
            let distinct = self.sets.count(h) as u64;
            if distinct > 0 {
                blocks += n.len();
                entries += distinct * n.len() as u64;
                for s in 0..self.slots.capacity() as u32 {
                    if self.sets.contains(h, super::Slot(s)) {
                        *per_slot.entry(s).or_default() += n.len() as u64;
                    }
                }
            }
            match n.kids() {
                Kids::None if h == Holders::None => {
                    return Err(format!("node {id:?}: unheld leaf not pruned"));
                }
                Kids::None => {}
                Kids::One(c) => {
                    let cn = self.node(c).ok_or("missing child")?;
                    let ch = Holders::from_raw(cn.holders);
                    if cn.run == n.run && cn.start() == n.end() && self.sets.same(h, ch) {
                        return Err(format!("node {id:?} and its only child {c:?} not merged"));
                    }
                    stack.push((c, Parent::Node(id)));
                }
                Kids::Map(i) => {
                    let m = self.maps.get(i).ok_or("missing map")?;
                    if m.len() < 2 {
                        return Err(format!("node {id:?}: map with {} children", m.len()));
                    }
                    stack.extend(m.iter().map(|c| (c, Parent::Node(id))));
                }
            }
        }
        if seen.len() != self.nodes.len() {
            return Err(format!(
                "{} nodes reachable, {} live",
                seen.len(),
                self.nodes.len()
            ));
        }
        if runs.len() != self.runs.len() {
            return Err(format!(
                "{} runs viewed, {} live",
                runs.len(),
                self.runs.len()
            ));
        }
        if (blocks, entries) != (self.blocks, self.entries) {
            return Err(format!(
                "counted {blocks} blocks / {entries} entries, recorded {} / {}",
                self.blocks, self.entries
            ));
        }
        for (key, slot) in self.slots.iter() {
            let want = per_slot.get(&slot.0).copied().unwrap_or(0);
            if self.slots.blocks(slot) != want || want == 0 {
                return Err(format!(
                    "{key}: {} blocks recorded, {want} held",
                    self.slots.blocks(slot)
                ));
            }
        }
        let stored = self.blocks_stored(&seen);
        if stored != self.stored || self.by_seq.len() != stored + self.dead {
            return Err(format!(
                "seq index: {} entries for {stored} live and {} dead blocks (recorded {} live)",
                self.by_seq.len(),
                self.dead,
                self.stored
            ));
        }
        Ok(())
    }

    fn blocks_stored(&self, nodes: &HashSet<NodeId>) -> usize {
        nodes
            .iter()
            .filter_map(|&n| self.node(n))
            .map(|n| n.len())
            .sum()
    }
}
