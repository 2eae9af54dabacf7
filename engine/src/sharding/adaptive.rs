//! The default sharding policy: a trunk chosen by the traffic, and every other block with
//! the first block of its own subtree.
//!
//! A block in the [`Trunk`] is everywhere. Any other block hangs below its *anchor*: the
//! first block of its path that is not in the trunk. The anchor's shard is the hash of its
//! seq_hash, unless the anchor was pinned (it continued a trunk block before that block's
//! promotion and stayed where it was); every block below the anchor lives with it. A query
//! walks the trunk along the request and goes to the shard of the first block past it.
//!
//! A block joins the trunk when the shard holding it sees it branch
//! [`Adaptive::junction_fanout`] times (see `sharding::promote`): no depth or size to
//! configure, and a system prompt of any length becomes trunk as soon as enough requests
//! continue it.
//!
//! # Route encoding
//! `Route(u32::MAX)`: everywhere. `Route(s)`: shard `s`.

use super::trunk::{Trunk, TrunkCell};
use super::{Placement, Route, ShardId, ShardPolicy, shard_of};
use crate::error::{EngineError, Result};
use crate::ids::SeqHash;
use crate::snapshot::image::{ArchivedTrunkImage, TrunkImage};
use crate::sync::Arc;

const EVERYWHERE: Route = Route(u32::MAX);

/// Trunk chosen by the traffic; other blocks with their anchor.
#[derive(Clone, Debug)]
pub struct Adaptive {
    shards: u16,
    junction_fanout: u32,
    cell: Arc<TrunkCell>,
    trunk: Arc<Trunk>,
}

impl Adaptive {
    /// Largest supported shard count.
    pub const MAX_SHARDS: usize = 1 << 15;
    /// Children a block must have in one shard before it joins the trunk, by default.
    /// Small enough that a hot prompt is promoted while its subtree is a handful of
    /// requests (which stay pinned where they are), large enough that an ordinary fork in
    /// a conversation is not replicated.
    pub const DEFAULT_JUNCTION_FANOUT: u32 = 8;

    /// `shards` shards (1..=32768); a block joins the trunk at `junction_fanout` (>= 2)
    /// children.
    pub fn new(shards: usize, junction_fanout: u32) -> Result<Self> {
        if shards == 0 || shards > Self::MAX_SHARDS {
            return Err(EngineError::InvalidArgument {
                name: "shards",
                reason: "must be within 1..=32768",
            });
        }
        if junction_fanout < 2 {
            return Err(EngineError::InvalidArgument {
                name: "junction_fanout",
                reason: "must be at least 2",
            });
        }
        let cell = Arc::new(TrunkCell::new());
        let trunk = cell.load();
        Ok(Self {
            shards: shards as u16,
            junction_fanout,
            cell,
            trunk,
        })
    }

    /// The trunk snapshot this copy of the policy routes with.
    pub fn trunk(&self) -> &Trunk {
        &self.trunk
    }

    /// Children at which a block joins the trunk.
    pub fn junction_fanout(&self) -> u32 {
        self.junction_fanout
    }

    #[inline]
    fn anchored(&self, seq: SeqHash, pinned: bool) -> Route {
        let pin = if pinned { self.trunk.pin(seq) } else { None };
        let s = pin.unwrap_or_else(|| shard_of(seq.0, self.shards.into()));
        Route(u32::from(s.0))
    }
}

impl ShardPolicy for Adaptive {
    fn shards(&self) -> usize {
        self.shards.into()
    }

    #[inline]
    fn place(&self, parent: Option<(SeqHash, Route)>, seq: SeqHash) -> Route {
        if self.trunk.contains(seq) {
            return EVERYWHERE;
        }
        match parent {
            None => self.anchored(seq, false),
            Some((p, r)) if r == EVERYWHERE || self.trunk.contains(p) => self.anchored(seq, true),
            Some((_, r)) => r,
        }
    }

    #[inline]
    fn placement(&self, seq: SeqHash, route: Route) -> Placement {
        if route == EVERYWHERE || self.trunk.contains(seq) {
            Placement::Everywhere
        } else {
            Placement::Shard(ShardId(route.0 as u16))
        }
    }

    #[inline]
    fn query_shard(&self, seqs: &[SeqHash]) -> ShardId {
        // A query's blocks are a chain from its first block, and the trunk is closed under
        // parents (trunk invariant 1): its members are a prefix of the chain, so the first
        // block past the trunk is found by binary search, not by asking for every block of
        // a long shared prompt (a 128-block system prompt was 128 set lookups a query).
        let past = seqs.partition_point(|&s| self.trunk.contains(s));
        match seqs.get(past) {
            Some(&first) => ShardId(self.anchored(first, past > 0).0 as u16),
            // All trunk: every shard can answer; spread by the request's last block.
            None => seqs
                .last()
                .map_or(ShardId(0), |s| shard_of(s.0, self.shards.into())),
        }
    }

    fn refresh(&mut self) {
        if self.cell.version() != self.trunk.version() {
            self.trunk = self.cell.load();
        }
    }

    fn is_junction(&self, tip: SeqHash, fanout: u32) -> bool {
        fanout >= self.junction_fanout && !self.trunk.contains(tip)
    }

    fn in_trunk(&self, seq: SeqHash) -> bool {
        self.trunk.contains(seq)
    }

    fn promote(&mut self, path: &[SeqHash], pins: &[SeqHash], from: ShardId) {
        let current = self.cell.load();
        self.cell.publish(current.promoted(path, pins, from));
        self.refresh();
    }

    fn trunk_image(&self) -> TrunkImage {
        self.trunk.image()
    }

    fn restore_trunk(&mut self, trunk: &ArchivedTrunkImage) {
        self.cell
            .publish(Trunk::from_image(trunk, self.shards.into()));
        self.refresh();
    }
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;
    use crate::hash::{BASE_SEED, seq_hashes};

    fn routes(p: &Adaptive, seqs: &[SeqHash]) -> Vec<Placement> {
        crate::sharding::chain_placements(p, seqs)
    }

    /// The binary search of `query_shard` answers what a scan for the first block past the
    /// trunk answers, for chains that leave a 40-block trunk at every depth.
    #[test]
    fn the_query_shard_is_the_first_block_past_the_trunk() {
        let mut p = Adaptive::new(4, 8).unwrap();
        let prompt: Vec<u32> = (0..40 * 16).collect();
        let prompt_seqs = seq_hashes(&prompt, 16, BASE_SEED);
        p.promote(&prompt_seqs, &[], ShardId(0));
        let scan = |seqs: &[SeqHash]| match seqs.iter().position(|&s| !p.in_trunk(s)) {
            Some(i) => ShardId(p.anchored(seqs[i], i > 0).0 as u16),
            None => seqs
                .last()
                .map_or(ShardId(0), |s| shard_of(s.0, p.shards.into())),
        };
        for keep in 0..=40 {
            for tail in [0usize, 1, 7] {
                let tokens: Vec<u32> = prompt[..keep * 16]
                    .iter()
                    .copied()
                    .chain((0..tail * 16).map(|t| t as u32 * 7 + 100_000 + keep as u32))
                    .collect();
                let seqs = seq_hashes(&tokens, 16, BASE_SEED);
                assert_eq!(
                    p.query_shard(&seqs),
                    scan(&seqs),
                    "keep {keep}, tail {tail}"
                );
            }
        }
    }

    #[test]
    fn a_promoted_prompt_is_everywhere_and_its_continuations_spread() {
        let mut p = Adaptive::new(4, 8).unwrap();
        let prompt: Vec<u32> = (0..64).collect();
        let prompt_seqs = seq_hashes(&prompt, 16, BASE_SEED);
        // Before promotion everything follows the first block.
        let q = p.query_shard(&prompt_seqs);
        assert!(
            routes(&p, &prompt_seqs)
                .iter()
                .all(|&x| x == Placement::Shard(q))
        );
        let mut copy = p.clone();
        let pinned = SeqHash(12345);
        p.promote(&prompt_seqs, &[pinned], q);
        copy.refresh();
        assert_eq!(copy.trunk().len(), 4, "other copies pick the promotion up");
        let mut seen = [0u32; 4];
        for n in 0..400u32 {
            let tokens: Vec<u32> = prompt
                .iter()
                .copied()
                .chain((0..32).map(|t| t * 13 + n))
                .collect();
            let seqs = seq_hashes(&tokens, 16, BASE_SEED);
            let placed = routes(&p, &seqs);
            assert!(placed[..4].iter().all(|&x| x == Placement::Everywhere));
            let s = p.query_shard(&seqs);
            assert!(placed[4..].iter().all(|&x| x == Placement::Shard(s)));
            seen[s.idx()] += 1;
        }
        assert!(seen.iter().all(|&c| c > 60), "{seen:?}");
        // A pinned continuation stays where it was.
        let mut with_pin = prompt_seqs.clone();
        with_pin.push(pinned);
        assert_eq!(p.query_shard(&with_pin), q);
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(Adaptive::new(0, 8).is_err());
        assert!(Adaptive::new(40_000, 8).is_err());
        assert!(Adaptive::new(2, 1).is_err());
        assert!(!Adaptive::new(2, 4).unwrap().is_junction(SeqHash(1), 3));
        assert!(Adaptive::new(2, 4).unwrap().is_junction(SeqHash(1), 4));
    }
}
