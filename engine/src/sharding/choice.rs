//! [`Sharding`]: the policy chosen at start-up, as one concrete type for the handles to hold.

use super::adaptive::Adaptive;
use super::fixed_depth::FixedDepth;
use super::trunk::Trunk;
use super::{Placement, Route, ShardId, ShardPolicy};
use crate::error::Result;
use crate::ids::SeqHash;
use crate::snapshot::image::{ArchivedTrunkImage, TrunkImage};

/// Either policy, chosen by configuration (`--replicate-depth` picks the fixed one).
#[derive(Clone, Debug)]
pub enum Sharding {
    /// The trunk chosen by the traffic (the default).
    Adaptive(Adaptive),
    /// The first `D` blocks of every sequence everywhere.
    FixedDepth(FixedDepth),
}

impl Sharding {
    /// The default: an adaptive trunk over `shards` shards.
    pub fn adaptive(shards: usize) -> Result<Self> {
        Adaptive::new(shards, Adaptive::DEFAULT_JUNCTION_FANOUT).map(Self::Adaptive)
    }

    /// `shards` shards; `replicate_depth`: `Some(d)` for [`FixedDepth`], `None` for
    /// [`Adaptive`] with `junction_fanout`.
    pub fn configured(
        shards: usize,
        replicate_depth: Option<u32>,
        junction_fanout: u32,
    ) -> Result<Self> {
        match replicate_depth {
            Some(d) => FixedDepth::new(shards, d).map(Self::FixedDepth),
            None => Adaptive::new(shards, junction_fanout).map(Self::Adaptive),
        }
    }

    /// The trunk, for the adaptive policy.
    pub fn trunk(&self) -> Option<&Trunk> {
        match self {
            Self::Adaptive(a) => Some(a.trunk()),
            Self::FixedDepth(_) => None,
        }
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        match self {
            Self::Adaptive(a) => {
                format!("adaptive trunk (junction fanout {})", a.junction_fanout())
            }
            Self::FixedDepth(f) => format!("replicate depth {} blocks", f.depth()),
        }
    }
}

macro_rules! both {
    ($self:ident, $p:ident => $e:expr) => {
        match $self {
            Sharding::Adaptive($p) => $e,
            Sharding::FixedDepth($p) => $e,
        }
    };
}

impl ShardPolicy for Sharding {
    fn shards(&self) -> usize {
        both!(self, p => p.shards())
    }

    #[inline]
    fn place(&self, parent: Option<(SeqHash, Route)>, seq: SeqHash) -> Route {
        both!(self, p => p.place(parent, seq))
    }

    #[inline]
    fn placement(&self, seq: SeqHash, route: Route) -> Placement {
        both!(self, p => p.placement(seq, route))
    }

    #[inline]
    fn query_shard(&self, seqs: &[SeqHash]) -> ShardId {
        both!(self, p => p.query_shard(seqs))
    }

    fn refresh(&mut self) {
        both!(self, p => p.refresh())
    }

    fn is_junction(&self, tip: SeqHash, fanout: u32) -> bool {
        both!(self, p => p.is_junction(tip, fanout))
    }

    fn in_trunk(&self, seq: SeqHash) -> bool {
        both!(self, p => p.in_trunk(seq))
    }

    fn promote(&mut self, path: &[SeqHash], pins: &[SeqHash], from: ShardId) {
        both!(self, p => p.promote(path, pins, from))
    }

    fn trunk_image(&self) -> TrunkImage {
        both!(self, p => p.trunk_image())
    }

    fn restore_trunk(&mut self, trunk: &ArchivedTrunkImage) {
        both!(self, p => p.restore_trunk(trunk))
    }
}
