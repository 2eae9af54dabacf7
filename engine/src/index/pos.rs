//! Where a block lives in one tree: [`Pos`], and the tree's internal ids.
//!
//! A block is stored once, in a *run*: a contiguous array of seq_hashes created by one store
//! (and extended in place by later stores of the same worker). A block's [`Pos`] is its run
//! and its offset in that run. Nodes are views over ranges of a run, so splitting or merging
//! nodes never moves a block: a `Pos` stays valid for as long as the block lives, and a
//! worker's directory can record it (4 bytes) instead of the block's seq_hash (8 bytes).
//!
//! # Invariants
//! 1. `Pos::new(run, off)` requires `run < MAX_RUNS` and `off < MAX_RUN_LEN`; every
//!    constructor checks, so a `Pos` always decodes to the run and offset it was made from.

use std::fmt;

/// Blocks per run, at most. A longer chain is stored as several runs (several nodes).
pub const MAX_RUN_LEN: usize = 1 << OFF_BITS;

/// Runs per tree, at most (2^24: 16.7 M). Past it, stores that need a new run are refused.
pub const MAX_RUNS: usize = 1 << (32 - OFF_BITS);

const OFF_BITS: u32 = 8;
const OFF_MASK: u32 = (1 << OFF_BITS) - 1;

/// A block's run and offset in one tree; stable while the block lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pos(u32);

impl Pos {
    /// The block at `off` of run `run`, if both are in range.
    #[inline]
    pub fn new(run: RunId, off: usize) -> Option<Self> {
        (run.idx() < MAX_RUNS && off < MAX_RUN_LEN)
            .then_some(Self((run.0 << OFF_BITS) | off as u32))
    }

    /// The run holding the block.
    #[inline]
    pub fn run(self) -> RunId {
        RunId(self.0 >> OFF_BITS)
    }

    /// The block's offset in its run.
    #[inline]
    pub fn off(self) -> usize {
        (self.0 & OFF_MASK) as usize
    }

    /// The raw value (for compact storage).
    #[inline]
    pub fn raw(self) -> u32 {
        self.0
    }

    /// A position from [`Pos::raw`].
    #[inline]
    pub fn from_raw(raw: u32) -> Self {
        Self(raw)
    }
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.run().0, self.off())
    }
}

/// A run's number in its tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u32);

impl RunId {
    /// The run as an index.
    #[inline]
    pub fn idx(self) -> usize {
        self.0 as usize
    }
}

/// A node's number in its tree. Values stay below [`NodeId::LIMIT`], so the top bit is free
/// for tagging (see `nodes::Kids`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    /// Node ids are below this.
    pub const LIMIT: u32 = 1 << 31;

    /// The node as an index.
    #[inline]
    pub fn idx(self) -> usize {
        self.0 as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pos_round_trips_and_refuses_out_of_range() {
        let p = Pos::new(RunId(12_345), 255).unwrap();
        assert_eq!((p.run(), p.off()), (RunId(12_345), 255));
        assert_eq!(Pos::from_raw(p.raw()), p);
        assert!(Pos::new(RunId(0), MAX_RUN_LEN).is_none());
        assert!(Pos::new(RunId(MAX_RUNS as u32), 0).is_none());
        assert!(Pos::new(RunId(MAX_RUNS as u32 - 1), MAX_RUN_LEN - 1).is_some());
    }
}
