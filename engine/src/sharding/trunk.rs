//! The trunk: blocks so widely shared that every shard keeps a copy, chosen by the traffic.
//!
//! Real traffic shares long prefixes (system prompts of hundreds of blocks; in a production
//! trace every request starts with the same block). Sharding by a sequence's first block
//! would put all of it on one shard, and a fixed replicated depth fails as soon as a prompt
//! is longer than it. So a block whose subtree branches widely (a *junction*: the end of a
//! system prompt that many requests continue) is promoted, with its path from the root,
//! into the trunk, which every shard holds; what continues a trunk block is placed by the
//! hash of its own first block, so the requests below a junction spread over the shards.
//!
//! A [`Trunk`] is an immutable snapshot: the trunk's blocks, and the *pins*: blocks that
//! continued a trunk block before it was promoted, which stay in the shard that had them
//! (so a promotion never moves a subtree, only copies a path). Placement and query routing
//! read a snapshot and nothing else, so the ingest and the edge agree on every block's
//! owner without asking a shard.
//!
//! # Invariants
//! 1. The trunk is closed under parents: a block's path from the root is in the trunk
//!    whenever the block is (a promotion adds whole paths).
//! 2. Versions only grow; every published snapshot has a larger version than the one
//!    before.
//!
//! # Concurrency
//! [`TrunkCell`] publishes snapshots: one writer at a time (the promotion in progress), any
//! number of readers. A reader keeps its own `Arc<Trunk>` and compares versions (one atomic
//! load) before using it; the mutex is taken only to pick up a new version, which happens
//! once per promotion, never on the steady-state path.

use super::ShardId;
use crate::ids::SeqHash;
use crate::snapshot::image::{ArchivedTrunkImage, PinRec, TrunkImage};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};
use hashbrown::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// seq_hashes are XXH3 outputs, already uniform: they are their own hash (placement asks
/// the trunk about blocks on the hot path).
#[derive(Clone, Copy, Debug, Default)]
struct SeqHasher(u64);

impl Hasher for SeqHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BySeq = BuildHasherDefault<SeqHasher>;

/// One version of the trunk.
#[derive(Clone, Debug, Default)]
pub struct Trunk {
    members: HashSet<SeqHash, BySeq>,
    pins: HashMap<SeqHash, ShardId, BySeq>,
    version: u64,
}

impl Trunk {
    /// Is `seq` a trunk block (held by every shard)?
    #[inline]
    pub fn contains(&self, seq: SeqHash) -> bool {
        !self.members.is_empty() && self.members.contains(&seq)
    }

    /// The shard a block continuing a trunk block stays in, if it was there before that
    /// trunk block was promoted.
    #[inline]
    pub fn pin(&self, seq: SeqHash) -> Option<ShardId> {
        if self.pins.is_empty() {
            return None;
        }
        self.pins.get(&seq).copied()
    }

    /// This snapshot's version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Trunk blocks.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// No trunk block.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// This trunk as a snapshot records it.
    pub fn image(&self) -> TrunkImage {
        TrunkImage {
            version: self.version,
            members: self.members.iter().map(|s| s.0).collect(),
            pins: self
                .pins
                .iter()
                .map(|(s, shard)| PinRec {
                    seq: s.0,
                    shard: u32::from(shard.0),
                })
                .collect(),
        }
    }

    /// The trunk a snapshot recorded (pins to shards past `shards` are dropped: the caller
    /// checked the layout).
    pub fn from_image(image: &ArchivedTrunkImage, shards: usize) -> Self {
        Self {
            members: image
                .members
                .iter()
                .map(|s| SeqHash(s.to_native()))
                .collect(),
            pins: image
                .pins
                .iter()
                .filter(|p| (p.shard.to_native() as usize) < shards)
                .map(|p| {
                    (
                        SeqHash(p.seq.to_native()),
                        ShardId(p.shard.to_native() as u16),
                    )
                })
                .collect(),
            version: image.version.to_native(),
        }
    }

    /// The next version: `path` joins the trunk, and each of `pins` stays in `from`.
    pub fn promoted(&self, path: &[SeqHash], pins: &[SeqHash], from: ShardId) -> Self {
        let mut next = self.clone();
        next.members.extend(path.iter().copied());
        next.pins.extend(pins.iter().map(|&s| (s, from)));
        next.version = self.version + 1;
        next
    }
}

/// Where the current trunk is published (see the module docs, "Concurrency").
#[derive(Debug, Default)]
pub struct TrunkCell {
    /// The published snapshot's version. Written (Release) after `current` changed, under
    /// the mutex; read (Acquire) by readers deciding whether to reload.
    version: AtomicU64,
    current: Mutex<Arc<Trunk>>,
}

impl TrunkCell {
    /// A cell holding the empty trunk (version 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// The published version.
    #[inline]
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// The published snapshot.
    pub fn load(&self) -> Arc<Trunk> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Publishes `next` (whose version must exceed the current one: invariant 2).
    pub fn publish(&self, next: Trunk) {
        let v = next.version;
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if v <= cur.version {
            return;
        }
        *cur = Arc::new(next);
        self.version.store(v, Ordering::Release);
    }
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;

    #[test]
    fn promotions_add_paths_and_pins_in_new_versions() {
        let cell = TrunkCell::new();
        let t0 = cell.load();
        assert!(t0.is_empty() && !t0.contains(SeqHash(1)) && t0.pin(SeqHash(9)).is_none());
        let t1 = t0.promoted(&[SeqHash(1), SeqHash(2)], &[SeqHash(9)], ShardId(1));
        cell.publish(t1.clone());
        assert_eq!(cell.version(), 1);
        let seen = cell.load();
        assert!(seen.contains(SeqHash(2)) && !seen.contains(SeqHash(9)));
        assert_eq!(seen.pin(SeqHash(9)), Some(ShardId(1)));
        cell.publish(t0.as_ref().clone());
        assert_eq!(
            cell.load().version(),
            1,
            "an older version is never published"
        );
    }
}

/// loom model of the publication: a reader that sees a version loads a snapshot at least
/// that new, whatever the interleaving with the writer.
#[cfg(all(test, kvengine_loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn a_seen_version_is_never_older_than_the_snapshot_loaded() {
        loom::model(|| {
            let cell = Arc::new(TrunkCell::new());
            let writer = {
                let cell = cell.clone();
                loom::thread::spawn(move || {
                    let t1 = cell.load().promoted(&[SeqHash(1)], &[], ShardId(0));
                    cell.publish(t1);
                })
            };
            let seen = cell.version();
            let snap = cell.load();
            assert!(snap.version() >= seen);
            if seen == 1 {
                assert!(snap.contains(SeqHash(1)));
            }
            writer.join().unwrap();
            assert_eq!(cell.version(), 1);
        });
    }
}
