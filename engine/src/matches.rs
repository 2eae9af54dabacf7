//! The answer to a prefix query.

use crate::ids::WorkerKey;

/// Overlaps of one request against the index.
///
/// # Invariants
/// 1. `overlaps` holds each worker key with overlap at least 1 exactly once, sorted by
///    overlap descending, then by key.
/// 2. `depth_counts[d]` is how many worker keys hold all of the request's first `d + 1`
///    blocks; it is non-increasing, its length is the largest overlap, and
///    `depth_counts[0] == overlaps.len()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    /// `(worker key, overlap in blocks)` for every worker holding the first block.
    pub overlaps: Vec<(WorkerKey, u32)>,
    /// Per matched depth, how many worker keys hold the prefix up to it.
    pub depth_counts: Vec<u32>,
}

impl Matches {
    /// The overlap of `key` (0 if it holds not even the first block).
    pub fn overlap(&self, key: WorkerKey) -> u32 {
        self.overlaps
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |&(_, o)| o)
    }

    /// The largest overlap of any worker key.
    pub fn best(&self) -> u32 {
        self.depth_counts.len() as u32
    }
}
