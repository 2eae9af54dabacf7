//! The archived layout of a snapshot: flat arrays of fixed-size records, so that bytecheck
//! validates them in one pass and a restore reads them in place (zero-copy) from the file's
//! buffer.
//!
//! # Invariants
//! 1. Changing any layout here changes [`super::FORMAT_VERSION`].
//! 2. A core's `nodes` are in parent-first order: a node's parent block is the last block of
//!    a node listed before it (or the node starts a sequence). `seqs` holds the nodes' blocks
//!    one node after another, `holders` their holders one node after another.
//! 3. A core's `entries` hold its directories' entries one worker key after another, in the
//!    order of `keys`.

use rkyv::{Archive, Deserialize, Serialize};

/// The whole engine at one consistent cut.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineImage {
    /// Shards (and cores) of the runtime it was taken from.
    pub shards: u32,
    /// The sharding policy it was taken under ([`crate::sharding::choice::Sharding::describe`]):
    /// routes recorded in directories mean something only under the same policy.
    pub policy: String,
    /// The trunk at the cut.
    pub trunk: TrunkImage,
    /// One image per core, in core order.
    pub cores: Vec<CoreImage>,
}

/// The adaptive policy's trunk.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct TrunkImage {
    /// Its version (0: empty, never promoted).
    pub version: u64,
    /// Trunk blocks.
    pub members: Vec<u64>,
    /// Blocks pinned to the shard they were in when their parent joined the trunk.
    pub pins: Vec<PinRec>,
}

/// A pinned block.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinRec {
    /// The block.
    pub seq: u64,
    /// Its shard.
    pub shard: u32,
}

/// One core: its shard of the tree, the directories of the workers homed on it, and the
/// last batch applied from each of their numbered streams.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct CoreImage {
    /// Tree nodes, parent first (invariant 2).
    pub nodes: Vec<NodeRec>,
    /// The nodes' blocks.
    pub seqs: Vec<u64>,
    /// The nodes' holders.
    pub holders: Vec<HolderRec>,
    /// Worker keys with a directory here.
    pub keys: Vec<KeyRec>,
    /// Directory entries (invariant 3).
    pub entries: Vec<EntryRec>,
    /// Stream marks of the workers homed here.
    pub marks: Vec<MarkRec>,
}

/// One tree node.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRec {
    /// The seq_hash of the block its first block continues (ignored if `root`).
    pub parent: u64,
    /// Its first block starts a sequence.
    pub root: bool,
    /// Its blocks (taken from `seqs` in order).
    pub len: u32,
    /// Its holders (taken from `holders` in order; 0: a structural node nobody holds).
    pub holders: u32,
}

/// A worker key holding every block of a node `count` times.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderRec {
    /// The worker.
    pub worker: u64,
    /// Its rank.
    pub rank: u32,
    /// Copies.
    pub count: u32,
}

/// A worker key's directory: its entries follow in `entries`.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRec {
    /// The worker.
    pub worker: u64,
    /// Its rank.
    pub rank: u32,
    /// Entries.
    pub len: u32,
}

/// One directory entry: an engine hash, the block it names and its copies.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRec {
    /// The worker's id for the block.
    pub engine: u64,
    /// The block's seq_hash.
    pub seq: u64,
    /// Its route under the policy.
    pub route: u32,
    /// Copies.
    pub count: u32,
}

/// The last batch applied from one numbered stream of a worker.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MarkRec {
    /// The worker.
    pub worker: u64,
    /// Which of its streams (the transport's numbering; 0 for a worker's ZMQ stream).
    pub stream: u32,
    /// The number of the last batch applied.
    pub seq: u64,
    /// A digest of that batch's bytes as received (the transport's `BatchId::digest`), to
    /// prove on restart that the publisher still numbers the same history; `None` when the
    /// stream has none (a mark upgraded from format 1, or a source without digests): the
    /// mark then cannot prove continuity.
    pub digest: Option<u64>,
}

/// Format 1's layout (before marks carried a digest), read only by [`super::upgrade`].
pub mod v1 {
    use super::{EntryRec, HolderRec, KeyRec, NodeRec, TrunkImage};
    use rkyv::{Archive, Deserialize, Serialize};

    /// Format 1's [`super::EngineImage`].
    #[derive(Archive, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
    pub struct EngineImage {
        /// Shards.
        pub shards: u32,
        /// Sharding policy.
        pub policy: String,
        /// The trunk.
        pub trunk: TrunkImage,
        /// Cores.
        pub cores: Vec<CoreImage>,
    }

    /// Format 1's [`super::CoreImage`].
    #[derive(Archive, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
    pub struct CoreImage {
        /// Tree nodes.
        pub nodes: Vec<NodeRec>,
        /// Their blocks.
        pub seqs: Vec<u64>,
        /// Their holders.
        pub holders: Vec<HolderRec>,
        /// Directories.
        pub keys: Vec<KeyRec>,
        /// Directory entries.
        pub entries: Vec<EntryRec>,
        /// Stream marks, without digests.
        pub marks: Vec<MarkRec>,
    }

    /// Format 1's [`super::MarkRec`]: no digest.
    #[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
    pub struct MarkRec {
        /// The worker.
        pub worker: u64,
        /// Its stream.
        pub stream: u32,
        /// The last batch's number.
        pub seq: u64,
    }
}
