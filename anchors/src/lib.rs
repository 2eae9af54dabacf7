//! Anchors for kvengine's indexer harness: Dynamo's and SMG's released indexers, driven
//! through their public APIs as [`lab::driver::IndexerUnderTest`]s, so the anchor harness
//! (`lab::anchor`, what `kvengine bench indexer --workload dynamo-w1` runs) times and checks
//! them exactly as it does kvengine.
//!
//! * [`dynamo`]: `dynamo-kv-router` 1.6.1's `ConcurrentRadixTreeCompressed` and
//!   `PositionalIndexer`, in Dynamo's `ThreadPoolIndexer`.
//! * [`dynamo_async`]: its `RadixTree`, in Dynamo's `KvIndexer` (one thread owns the tree),
//!   and its `BranchShardedIndexer` over CRTC shards.
//! * [`smg`]: `kv-index` 2.0.0's `ChainIndex`.
//!
//! Its own workspace (see Cargo.toml): `dynamo-kv-router` pins tokio, which must not enter
//! the product's lock file.

pub mod common;
pub mod dynamo;
pub mod dynamo_async;
pub mod smg;

use anyhow::{Result, bail};
use lab::driver::IndexerUnderTest;
use lab::workload::anchor::AnchorPlan;
use std::sync::Arc;

/// The anchors `--against` names.
pub const ANCHORS: &[&str] = &[
    "dynamo-crtc",
    "dynamo-positional",
    "dynamo-radix-tree",
    "dynamo-branch-sharded",
    "smg",
];

/// What the adapters need from the plan, built once before the first run (outside every
/// timed window and resident-memory difference).
#[derive(Debug)]
pub struct Prepared {
    /// The positional indexer's query table (empty unless it is wanted).
    pub local_queries: Arc<dynamo::LocalQueries>,
}

impl Prepared {
    /// What anchors `names` need from `plan`.
    pub fn new<'a>(plan: &AnchorPlan, names: impl IntoIterator<Item = &'a str>) -> Self {
        let positional = names.into_iter().any(|n| n == "dynamo-positional");
        Self {
            local_queries: Arc::new(if positional {
                dynamo::LocalQueries::of(plan)
            } else {
                dynamo::LocalQueries::default()
            }),
        }
    }
}

/// A fresh indexer for anchor `name` (one of [`ANCHORS`]); Dynamo's pools get
/// `event_threads` event threads.
pub fn build(
    name: &str,
    event_threads: usize,
    prepared: &Prepared,
) -> Result<Box<dyn IndexerUnderTest>> {
    let q = &prepared.local_queries;
    match name {
        "dynamo-crtc" => dynamo::build(dynamo::Backend::Crtc, event_threads, q),
        "dynamo-positional" => dynamo::build(dynamo::Backend::Positional, event_threads, q),
        "dynamo-radix-tree" => dynamo_async::radix_tree(),
        "dynamo-branch-sharded" => dynamo_async::branch_sharded(),
        "smg" => smg::build(),
        other => bail!("unknown anchor {other:?}; known: {}", ANCHORS.join(", ")),
    }
}
