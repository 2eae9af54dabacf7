//! The thread-per-core sharded runtime.
//!
//! `start` spawns one thread per shard, each owning its [`Shard`] outright, pinned to a core
//! where one exists. Clients (ingest and query handles) reach shards only through bounded
//! SPSC rings ([`crate::ring`]): one ring per (client, shard) pair each way, so no lock and no
//! shared mutable state is on the hot path, and nothing is shared by all shards.
//!
//! # Invariants
//! 1. Each shard answers exactly what the single-threaded [`ShardedIndex`] would, given the
//!    same operations (tested against the reference model with 1, 2, 3 and 8 shards).
//! 2. Shutdown: dropping every handle closes the rings; each shard drains what was sent and
//!    exits; [`Runtime::join`] returns their final figures. Nothing sent is lost.
//! 3. A shard thread that panics aborts the process.
//!
//! # Concurrency
//! Handles are `Send`, not `Sync`: each belongs to one thread. Shards never talk to each
//! other; a block placed everywhere reaches every shard through the ingest's own rings.
//!
//! [`Shard`]: crate::sharding::shard::Shard
//! [`ShardedIndex`]: crate::sharding::sharded::ShardedIndex

mod client;
mod msg;
mod shard_loop;
mod waker;

pub use client::{IngestHandle, QueryHandle};
pub use msg::ShardSummary;

use crate::error::{EngineError, Result};
use crate::ring::ring;
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use client::Link;
use shard_loop::ShardThread;
use std::sync::Arc;
use std::thread::JoinHandle;
use waker::Waker;

/// How to start the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Messages each ring holds.
    pub ring_capacity: usize,
    /// Pin shard `i` to core `i` (where that core exists).
    pub pin_cores: bool,
    /// Ingest handles to create.
    pub ingest_handles: usize,
    /// Query handles to create.
    pub query_handles: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            ring_capacity: 1024,
            pin_cores: true,
            ingest_handles: 1,
            query_handles: 1,
        }
    }
}

/// The running shard threads.
#[derive(Debug)]
pub struct Runtime {
    threads: Vec<JoinHandle<ShardSummary>>,
    pinned: Vec<Option<usize>>,
}

/// A started runtime and its handles.
#[derive(Debug)]
pub struct Started<P> {
    /// The shard threads.
    pub runtime: Runtime,
    /// Ingest handles (`config.ingest_handles` of them).
    pub ingest: Vec<IngestHandle<P>>,
    /// Query handles (`config.query_handles` of them).
    pub query: Vec<QueryHandle<P>>,
}

/// Starts one thread per shard of `policy`.
pub fn start<P: ShardPolicy + Clone + 'static>(
    policy: P,
    config: RuntimeConfig,
) -> Result<Started<P>> {
    let shards = policy.shards();
    let clients = config.ingest_handles + config.query_handles;
    if shards == 0 || clients == 0 || config.ring_capacity == 0 {
        return Err(EngineError::InvalidArgument {
            name: "runtime",
            reason: "needs at least one shard, one handle and a non-empty ring",
        });
    }
    let wakers: Arc<[Arc<Waker>]> = (0..shards).map(|_| Arc::new(Waker::default())).collect();
    // links[c] is client c's side; inboxes[s] / replies[s] are shard s's side.
    let mut links: Vec<Link> = (0..clients)
        .map(|_| Link {
            to: Vec::with_capacity(shards),
            from: Vec::with_capacity(shards),
            wakers: wakers.clone(),
        })
        .collect();
    let mut inboxes: Vec<Vec<_>> = (0..shards).map(|_| Vec::with_capacity(clients)).collect();
    let mut replies: Vec<Vec<_>> = (0..shards).map(|_| Vec::with_capacity(clients)).collect();
    for link in &mut links {
        for s in 0..shards {
            let (tx, rx) = ring(config.ring_capacity);
            link.to.push(tx);
            if let Some(v) = inboxes.get_mut(s) {
                v.push(rx);
            }
            let (tx, rx) = ring(config.ring_capacity);
            link.from.push(rx);
            if let Some(v) = replies.get_mut(s) {
                v.push(tx);
            }
        }
    }
    let cores = if config.pin_cores {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut threads = Vec::with_capacity(shards);
    let mut pinned = Vec::with_capacity(shards);
    for (s, (inboxes, replies)) in inboxes.into_iter().zip(replies).enumerate() {
        let core = cores.get(s).copied();
        pinned.push(core.map(|c| c.id));
        let worker = ShardThread {
            shard: Shard::new(ShardId(s as u16)),
            inboxes,
            replies,
            waker: wakers.get(s).cloned().unwrap_or_default(),
            pinned_core: core.map(|c| c.id),
            ingest_clients: config.ingest_handles,
        };
        let handle = std::thread::Builder::new()
            .name(format!("kvengine-shard-{s}"))
            .spawn(move || {
                if let Some(c) = core {
                    core_affinity::set_for_current(c);
                }
                worker.run()
            })
            .map_err(|_| EngineError::RuntimeStopped)?;
        threads.push(handle);
    }
    let mut links = links.into_iter();
    let ingest = links
        .by_ref()
        .take(config.ingest_handles)
        .map(|l| IngestHandle::new(policy.clone(), l))
        .collect();
    let query = links.map(|l| QueryHandle::new(policy.clone(), l)).collect();
    Ok(Started {
        runtime: Runtime { threads, pinned },
        ingest,
        query,
    })
}

impl Runtime {
    /// Shards started.
    pub fn shards(&self) -> usize {
        self.threads.len()
    }

    /// The core each shard is pinned to (`None`: not pinned, e.g. more shards than cores).
    pub fn pinned(&self) -> &[Option<usize>] {
        &self.pinned
    }

    /// Waits for every shard to drain and exit (drop every handle first) and returns their
    /// final figures.
    pub fn join(self) -> Result<Vec<ShardSummary>> {
        self.threads
            .into_iter()
            .map(|t| t.join().map_err(|_| EngineError::RuntimeStopped))
            .collect()
    }
}
