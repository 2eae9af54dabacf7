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
    /// Builds the answer from per-key overlaps (zero overlaps dropped), for callers that know
    /// overlaps some other way: fixtures, other indexes, replicas.
    pub fn from_overlaps(pairs: impl IntoIterator<Item = (WorkerKey, u32)>) -> Self {
        let mut overlaps: Vec<(WorkerKey, u32)> = pairs.into_iter().filter(|p| p.1 > 0).collect();
        overlaps.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let best = overlaps.first().map_or(0, |p| p.1) as usize;
        // depth_counts[d] = keys with overlap > d: a histogram of overlaps, suffix-summed.
        let mut depth_counts = vec![0u32; best];
        for &(_, o) in &overlaps {
            if let Some(c) = depth_counts.get_mut(o as usize - 1) {
                *c += 1;
            }
        }
        for d in (1..best).rev() {
            let deeper = depth_counts.get(d).copied().unwrap_or(0);
            if let Some(c) = depth_counts.get_mut(d - 1) {
                *c += deeper;
            }
        }
        Self {
            overlaps,
            depth_counts,
        }
    }

    /// The overlap of `key` (0 if it holds not even the first block).
    pub fn overlap(&self, key: WorkerKey) -> u32 {
        self.overlaps
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |&(_, o)| o)
    }

    /// Per worker key, the larger of its overlaps in `self` and in `other`.
    pub fn max_with(&self, other: &Matches) -> Matches {
        if other.overlaps.is_empty() {
            return self.clone();
        }
        let mut pairs = self.overlaps.clone();
        for &(key, o) in &other.overlaps {
            match pairs.iter_mut().find(|(k, _)| *k == key) {
                Some(p) => p.1 = p.1.max(o),
                None => pairs.push((key, o)),
            }
        }
        Matches::from_overlaps(pairs)
    }

    /// The largest overlap of any worker key.
    pub fn best(&self) -> u32 {
        self.depth_counts.len() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_overlaps_sorts_drops_zeros_and_counts_depths() {
        let k = |w| WorkerKey::new(w, 0);
        let m = Matches::from_overlaps([(k(2), 1), (k(1), 3), (k(3), 0), (k(0), 1)]);
        assert_eq!(m.overlaps, vec![(k(1), 3), (k(0), 1), (k(2), 1)]);
        assert_eq!(m.depth_counts, vec![3, 1, 1]);
        assert_eq!(m.best(), 3);
        assert_eq!(m.overlap(k(2)), 1);
        assert_eq!(m.overlap(k(3)), 0);
        assert_eq!(Matches::from_overlaps([]), Matches::default());
    }

    #[test]
    fn max_with_takes_each_keys_larger_overlap() {
        let k = |w| WorkerKey::new(w, 0);
        let indexed = Matches::from_overlaps([(k(1), 3), (k(2), 1)]);
        let predicted = Matches::from_overlaps([(k(2), 4), (k(3), 2), (k(1), 1)]);
        let both = indexed.max_with(&predicted);
        assert_eq!(
            both,
            Matches::from_overlaps([(k(1), 3), (k(2), 4), (k(3), 2)])
        );
        assert_eq!(both, predicted.max_with(&indexed));
        assert_eq!(indexed.max_with(&Matches::default()), indexed);
        assert_eq!(Matches::default().max_with(&indexed), indexed);
    }
}
