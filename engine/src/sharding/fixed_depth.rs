//! Sharding by the block at a fixed depth, with the shallower blocks in every shard.
//!
//! Blocks at depth `< D` (the first `D` blocks of every sequence: system prompts, chat
//! templates) are placed everywhere; a block at depth `>= D` lives in the shard chosen by
//! the seq_hash of its sequence's block at depth `D`. A query goes to that shard (or, if
//! the request has no block at depth `D`, to any shard: all its blocks are everywhere).
//!
//! This is the "simpler key" DESIGN.md allows instead of a learned trunk: it needs no
//! re-homing and no shared trunk set, and it is exact by construction. Its costs: a
//! shared prefix longer than `D` blocks still lands on one shard (raise `D`), and blocks
//! shallower than `D` cost one operation per shard. With `D = 0` it is plain first-block
//! sharding.
//!
//! # Route encoding
//! `Route(v)`: `v < D` means "depth `v`, everywhere"; `v >= D` means "shard `v - D`".

use super::{Placement, Route, ShardId, ShardPolicy, shard_of};
use crate::error::{EngineError, Result};
use crate::ids::SeqHash;

/// Blocks shallower than `depth` everywhere; deeper ones by the block at `depth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedDepth {
    shards: u16,
    depth: u32,
}

impl FixedDepth {
    /// Largest supported shard count (routes are `u32`, shard ids `u16`).
    pub const MAX_SHARDS: usize = 1 << 15;
    /// Largest supported replication depth.
    pub const MAX_DEPTH: u32 = 1 << 30;

    /// `shards` shards, blocks at depth `< depth` everywhere.
    pub fn new(shards: usize, depth: u32) -> Result<Self> {
        if shards == 0 || shards > Self::MAX_SHARDS {
            return Err(EngineError::InvalidArgument {
                name: "shards",
                reason: "must be within 1..=32768",
            });
        }
        if depth > Self::MAX_DEPTH {
            return Err(EngineError::InvalidArgument {
                name: "replicate_depth",
                reason: "must be at most 2^30 blocks",
            });
        }
        Ok(Self {
            shards: shards as u16,
            depth,
        })
    }

    /// The replication depth `D`.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    #[inline]
    fn anchored(&self, seq: SeqHash) -> Route {
        Route(self.depth + u32::from(shard_of(seq.0, self.shards.into()).0))
    }
}

impl ShardPolicy for FixedDepth {
    fn shards(&self) -> usize {
        self.shards.into()
    }

    #[inline]
    fn place(&self, parent: Option<(SeqHash, Route)>, seq: SeqHash) -> Route {
        let depth = match parent.map(|p| p.1) {
            None => 0,
            Some(Route(v)) if v >= self.depth => return Route(v),
            Some(Route(v)) => v + 1,
        };
        if depth < self.depth {
            Route(depth)
        } else {
            self.anchored(seq)
        }
    }

    #[inline]
    fn placement(&self, _seq: SeqHash, route: Route) -> Placement {
        match route.0.checked_sub(self.depth) {
            None => Placement::Everywhere,
            Some(s) => Placement::Shard(ShardId(s as u16)),
        }
    }

    #[inline]
    fn query_shard(&self, seqs: &[SeqHash]) -> ShardId {
        match seqs.get(self.depth as usize).or(seqs.last()) {
            Some(s) => shard_of(s.0, self.shards.into()),
            None => ShardId(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{BASE_SEED, seq_hashes};

    fn routes(p: &FixedDepth, seqs: &[SeqHash]) -> Vec<Placement> {
        crate::sharding::chain_placements(p, seqs)
    }

    #[test]
    fn shallow_blocks_everywhere_deep_ones_with_their_query() {
        let p = FixedDepth::new(4, 2).unwrap();
        for n in 0..50u32 {
            let tokens: Vec<u32> = (0..80).map(|t| t * 7 + n).collect();
            let seqs = seq_hashes(&tokens, 16, BASE_SEED);
            let placed = routes(&p, &seqs);
            assert_eq!(
                &placed[..2],
                &[Placement::Everywhere, Placement::Everywhere]
            );
            let q = p.query_shard(&seqs);
            assert!(placed[2..].iter().all(|&x| x == Placement::Shard(q)));
            // Every prefix of the request is answered by a shard that has all its blocks.
            for len in 1..=seqs.len() {
                let q = p.query_shard(&seqs[..len]);
                assert!(
                    placed[..len]
                        .iter()
                        .all(|&x| x == Placement::Everywhere || x == Placement::Shard(q))
                );
            }
        }
    }

    #[test]
    fn depth_zero_is_first_block_sharding_and_spreads() {
        let p = FixedDepth::new(8, 0).unwrap();
        let mut seen = [0u32; 8];
        for n in 0..800u32 {
            let seqs = seq_hashes(&[n, 1, 2, 3], 4, BASE_SEED);
            let placed = routes(&p, &seqs);
            assert_eq!(placed[0], Placement::Shard(p.query_shard(&seqs)));
            seen[p.query_shard(&seqs).idx()] += 1;
        }
        assert!(seen.iter().all(|&c| c > 60), "{seen:?}");
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(FixedDepth::new(0, 1).is_err());
        assert!(FixedDepth::new(40_000, 1).is_err());
        assert!(FixedDepth::new(2, u32::MAX).is_err());
        assert_eq!(FixedDepth::new(1, 3).unwrap().query_shard(&[]), ShardId(0));
    }
}
