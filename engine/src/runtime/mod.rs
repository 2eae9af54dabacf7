//! The thread-per-core runtime.
//!
//! `start` spawns one thread per core, pinned where a core exists. Each core owns one shard
//! of the index outright and the directories of the workers homed on it (a worker's home is
//! a hash of its id, so all its dp ranks share one). A core applies its own workers' events,
//! keeps the operations for its own shard and sends the rest to their cores. Every pair of
//! cores has one SPSC ring each way ([`crate::ring`]), and every client handle one ring to
//! and from every core: no locks, and nothing shared by all cores.
//!
//! # Invariants
//! 1. The cores together answer exactly what the single-threaded [`ShardedIndex`] would,
//!    given the same events (tested against the reference model with 1, 2, 3 and 8 cores).
//! 2. Shutdown: dropping every handle closes the client rings; each core finishes what it
//!    was sent, closes its rings to the other cores, drains theirs and exits;
//!    [`Runtime::join`] returns their final figures. Nothing sent is lost.
//! 3. A core thread that panics aborts the process (with a line on stderr naming the core):
//!    a core that is gone can never answer, and a half-applied operation cannot be trusted.
//! 4. Every call on a handle has a deadline ([`RuntimeConfig::call_timeout`]), so a stuck
//!    core gives its callers [`EngineError::Timeout`], not a hang.
//!
//! # Concurrency
//! Handles are `Send`, not `Sync`: each belongs to one thread.
//!
//! [`ShardedIndex`]: crate::sharding::sharded::ShardedIndex

mod barrier;
mod client;
mod core_state;
#[cfg(test)]
mod deadline_tests;
mod home;
mod hosted;
mod load;
mod msg;
mod promotion;
mod promotion_state;
mod shard_loop;
mod waker;

pub use client::{IngestHandle, QueryHandle};
pub use home::home_core;
pub use hosted::{CoreHost, Lookup, SentQuery};
pub use load::CoreLoads;
pub use msg::CoreSummary;

/// For the loom model of the sync protocol (`loom-tests/tests/barrier.rs`) only.
#[cfg(kvengine_loom)]
#[doc(hidden)]
pub use barrier::SyncBarrier;

use crate::error::{EngineError, Result};
use crate::ring::ring;
use crate::sharding::ingest::{Ingest, Outbox};
use crate::sharding::shard::Shard;
use crate::sharding::{ShardId, ShardPolicy};
use crate::snapshot::image::ArchivedEngineImage;
use crate::sole_writer::{Reader, SoleWriter};
use client::Link;
use core_state::Core;
use hosted::Peers;
use shard_loop::Runner;
use std::sync::Arc;
use std::thread::JoinHandle;
use waker::Waker;

/// How to start the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Messages each ring holds.
    pub ring_capacity: usize,
    /// Pin core thread `i` to CPU `i` (where that CPU exists).
    pub pin_cores: bool,
    /// Ingest handles to create.
    pub ingest_handles: usize,
    /// Query handles to create.
    pub query_handles: usize,
    /// The longest a handle waits for one call (a query, an apply, a clear): a core that
    /// does not answer in time gives the caller [`EngineError::Timeout`].
    pub call_timeout: std::time::Duration,
    /// The longest [`IngestHandle::sync`] waits (it waits for everything sent before it to
    /// apply, so it may legitimately take longer than one call).
    pub sync_timeout: std::time::Duration,
    /// The most engine hashes one worker key's directory may hold (`None`: no cap); a store
    /// past it is refused as a whole (`crate::directories`, invariant 4).
    pub max_blocks_per_key: Option<usize>,
    /// Other busy threads share the CPUs this runtime would count as spare (several
    /// runtimes in one process, as the replay's router replicas): its cores and clients
    /// get off the CPU soon when idle, as when the cores take every CPU, instead of
    /// yield-spinning as if the spare CPUs were theirs.
    pub cpus_shared: bool,
    /// Hosted cores read the other cores' shards in place (`hosted` invariant 3); `false`
    /// asks the owning core over the ring for every query of another shard, as before
    /// reads in place (for A B comparisons, and for tests of the forwarded path).
    pub read_others_in_place: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            ring_capacity: 1024,
            pin_cores: true,
            ingest_handles: 1,
            query_handles: 1,
            call_timeout: std::time::Duration::from_secs(5),
            sync_timeout: std::time::Duration::from_secs(60),
            max_blocks_per_key: None,
            cpus_shared: false,
            read_others_in_place: true,
        }
    }
}

/// The running core threads.
#[derive(Debug)]
pub struct Runtime {
    threads: Vec<JoinHandle<CoreSummary>>,
    pinned: Vec<Option<usize>>,
}

/// A started runtime and its handles.
#[derive(Debug)]
pub struct Started<P> {
    /// The core threads.
    pub runtime: Runtime,
    /// Ingest handles (`config.ingest_handles` of them).
    pub ingest: Vec<IngestHandle>,
    /// Query handles (`config.query_handles` of them).
    pub query: Vec<QueryHandle<P>>,
}

/// Starts one core thread per shard of `policy`.
pub fn start<P: ShardPolicy + Clone + 'static>(
    policy: P,
    config: RuntimeConfig,
) -> Result<Started<P>> {
    start_from(policy, config, None)
}

/// Like [`start`], with every core restored from `image` first (see [`start_hosted_from`]).
pub fn start_from<P: ShardPolicy + Clone + 'static>(
    mut policy: P,
    config: RuntimeConfig,
    image: Option<&ArchivedEngineImage>,
) -> Result<Started<P>> {
    if let Some(img) = image {
        policy.restore_trunk(&img.trunk);
    }
    let built = build(policy.clone(), &config, Layout::Threads, image)?;
    let mut threads = Vec::with_capacity(built.cores.len());
    let mut pinned = Vec::with_capacity(built.cores.len());
    for (k, (core, cpu)) in built.cores.into_iter().enumerate() {
        pinned.push(cpu.map(|c| c.id));
        let handle = std::thread::Builder::new()
            .name(format!("kvengine-core-{k}"))
            .spawn(move || {
                if let Some(c) = cpu {
                    core_affinity::set_for_current(c);
                }
                core.run()
            })
            .map_err(|_| EngineError::RuntimeStopped)?;
        threads.push(handle);
    }
    let mut links = built.links.into_iter();
    let ingest = links
        .by_ref()
        .take(config.ingest_handles)
        .map(IngestHandle::new)
        .collect();
    let query = links.map(|l| QueryHandle::new(policy.clone(), l)).collect();
    Ok(Started {
        runtime: Runtime { threads, pinned },
        ingest,
        query,
    })
}

/// Cores for the caller's threads ([`start_hosted`]) and handles for every other thread.
#[derive(Debug)]
pub struct Hosted<P> {
    /// One per shard, in shard order: move each to its own thread and step it there.
    pub cores: Vec<CoreHost<P>>,
    /// For threads that are not cores.
    pub ingest: IngestHandle,
    /// For threads that are not cores.
    pub query: QueryHandle<P>,
}

/// Builds one core per shard of `policy` without starting threads: the caller hosts each
/// [`CoreHost`] on a thread of its own (see its docs). `config`'s handle counts are
/// ignored: each core gets one ingest and one query ring to every core, and one handle of
/// each kind serves the threads that are not cores.
pub fn start_hosted<P: ShardPolicy + Clone + 'static>(
    policy: P,
    config: RuntimeConfig,
) -> Result<Hosted<P>> {
    start_hosted_from(policy, config, None)
}

/// Like [`start_hosted`], with every core restored from `image` first: the trunk is
/// published, then the cores' shards and directories are rebuilt in parallel (rayon), one
/// task per core. Refused ([`EngineError::BadSnapshot`]) if the image was taken with
/// another number of shards or does not add up.
pub fn start_hosted_from<P: ShardPolicy + Clone + 'static>(
    mut policy: P,
    config: RuntimeConfig,
    image: Option<&ArchivedEngineImage>,
) -> Result<Hosted<P>> {
    if let Some(img) = image {
        policy.restore_trunk(&img.trunk);
    }
    let cores = policy.shards();
    let config = RuntimeConfig {
        ingest_handles: cores + 1,
        query_handles: cores + 1,
        ..config
    };
    let built = build(policy.clone(), &config, Layout::Hosted, image)?;
    // Client order: every core's ingest link, the outsiders' ingest handle, every core's
    // query link, the outsiders' query handle.
    let mut links = built.links.into_iter();
    let core_ingest: Vec<Link> = links.by_ref().take(cores).collect();
    let ingest = links.next().map(IngestHandle::new);
    let core_query: Vec<Link> = links.by_ref().take(cores).collect();
    let query = links.next().map(|l| QueryHandle::new(policy.clone(), l));
    let (Some(ingest), Some(query)) = (ingest, query) else {
        return Err(EngineError::RuntimeStopped);
    };
    // Every host reads the other cores' shards in place (`hosted` invariant 3).
    let shards: Vec<Reader<Shard>> = if config.read_others_in_place {
        built.cores.iter().map(|(c, _)| c.shard.reader()).collect()
    } else {
        Vec::new()
    };
    let hosts = built
        .cores
        .into_iter()
        .zip(core_ingest.into_iter().zip(core_query))
        .zip(built.wakers.iter().cloned())
        .map(|(((core, cpu), (i, q)), waker)| {
            let peers = Peers {
                shards: shards.clone(),
                wakers: built.wakers.clone(),
            };
            CoreHost::new(Runner::new(core), policy.clone(), i, q, waker, cpu, peers)
        })
        .collect();
    Ok(Hosted {
        cores: hosts,
        ingest,
        query,
    })
}

/// Whose waker a client's replies wake.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Every client is a thread of its own.
    Threads,
    /// The first `cores` ingest clients and the first `cores` query clients belong to the
    /// cores (core `k`'s replies wake core `k`, which polls them between its work).
    Hosted,
}

struct Built<P> {
    cores: Vec<(Core<P>, Option<core_affinity::CoreId>)>,
    links: Vec<Link>,
    wakers: Arc<[Arc<Waker>]>,
}

/// The cores and every ring between them and their clients.
fn build<P: ShardPolicy + Clone>(
    policy: P,
    config: &RuntimeConfig,
    layout: Layout,
    image: Option<&ArchivedEngineImage>,
) -> Result<Built<P>> {
    let cores = policy.shards();
    if let Some(img) = image
        && (img.shards.to_native() as usize != cores || img.cores.len() != cores)
    {
        return Err(EngineError::BadSnapshot(format!(
            "taken with {} shards ({} core images), this runtime has {cores}",
            img.shards.to_native(),
            img.cores.len()
        )));
    }
    let clients = config.ingest_handles + config.query_handles;
    if cores == 0 || clients == 0 || config.ring_capacity == 0 {
        return Err(EngineError::InvalidArgument {
            name: "runtime",
            reason: "needs at least one core, one handle and a non-empty ring",
        });
    }
    let wakers: Arc<[Arc<Waker>]> = (0..cores).map(|_| Arc::new(Waker::default())).collect();
    // Client rings: links[c] is client c's side; clients_in[k] / clients_out[k] core k's.
    // A hosted core's own clients share its thread and its waker.
    let host_of = |c: usize| match layout {
        Layout::Threads => None,
        Layout::Hosted if c < config.ingest_handles => Some(c),
        Layout::Hosted => Some(c - config.ingest_handles),
    };
    let client_wakers: Arc<[Arc<Waker>]> = (0..clients)
        .map(|c| match host_of(c).and_then(|k| wakers.get(k)) {
            Some(w) => w.clone(),
            None => Arc::new(Waker::default()),
        })
        .collect();
    // Clients on a CPU of their own may poll longer for replies; clients sharing CPUs with
    // busy cores must get off the CPU quickly. A host is its core: no core thread waits
    // for its CPU, and a parked host is woken by the OS only after tens of microseconds
    // (measured: hit p99 under ingest 100-300 µs with hosts parking after 64 polls), so
    // hosts poll as long as clients with a CPU to themselves.
    let cpus_available = match config.cpus_shared {
        true => cores,
        false => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let spins_before_park = |c: usize| {
        let is_host = host_of(c).is_some_and(|k| k < cores);
        if cpus_available > cores || is_host {
            client::SPINS_BEFORE_PARK_SPARE_CPU
        } else {
            client::SPINS_BEFORE_PARK_SHARED_CPU
        }
    };
    let yield_rounds = if cpus_available > cores {
        shard_loop::YIELD_ROUNDS_SPARE_CPU
    } else {
        shard_loop::YIELD_ROUNDS_SHARED_CPU
    };
    let mut links: Vec<Link> = client_wakers
        .iter()
        .enumerate()
        .map(|(c, own)| Link {
            to: Vec::with_capacity(cores),
            from: Vec::with_capacity(cores),
            wakers: wakers.clone(),
            own: own.clone(),
            spins_before_park: spins_before_park(c),
            call_timeout: config.call_timeout,
            sync_timeout: config.sync_timeout,
            last_tag: 0,
            awaited: Default::default(),
            homes: Vec::with_capacity(cores),
        })
        .collect();
    let mut clients_in: Vec<Vec<_>> = (0..cores).map(|_| Vec::with_capacity(clients)).collect();
    let mut clients_out: Vec<Vec<_>> = (0..cores).map(|_| Vec::with_capacity(clients)).collect();
    for link in &mut links {
        for k in 0..cores {
            let (tx, rx) = ring(config.ring_capacity);
            link.to.push(tx);
            if let Some(v) = clients_in.get_mut(k) {
                v.push(rx);
            }
            let (tx, rx) = ring(config.ring_capacity);
            link.from.push(rx);
            if let Some(v) = clients_out.get_mut(k) {
                v.push(tx);
            }
        }
    }
    // Peer rings: peers_out[a][b] sends a -> b, peers_in[b] holds the receiving ends.
    let mut peers_out: Vec<Vec<Option<_>>> = (0..cores)
        .map(|_| (0..cores).map(|_| None).collect())
        .collect();
    let mut peers_in: Vec<Vec<_>> = (0..cores).map(|_| Vec::new()).collect();
    for a in 0..cores {
        for b in 0..cores {
            if a == b {
                continue;
            }
            let (tx, rx) = ring(config.ring_capacity);
            if let Some(slot) = peers_out.get_mut(a).and_then(|v| v.get_mut(b)) {
                *slot = Some(tx);
            }
            if let Some(v) = peers_in.get_mut(b) {
                v.push(rx);
            }
        }
    }
    let cpus = if config.pin_cores {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let parts = clients_in
        .into_iter()
        .zip(clients_out)
        .zip(peers_in.into_iter().zip(peers_out));
    let mut built: Vec<(Core<P>, Option<core_affinity::CoreId>)> = parts
        .enumerate()
        .map(|(k, ((cin, cout), (pin, pout)))| {
            let cpu = cpus.get(k).copied();
            let core = Core {
                shard: SoleWriter::new(Shard::new(ShardId(k as u16)).with_rebuilds_outside()),
                ingest: Ingest::new(policy.clone())
                    .with_max_blocks_per_key(config.max_blocks_per_key),
                outbox: Outbox::new(cores),
                clients_in: cin,
                clients_out: cout,
                ingest_clients: config.ingest_handles,
                peers_in: pin,
                peers_out: pout,
                wakers: wakers.clone(),
                client_wakers: client_wakers.clone(),
                pinned_core: cpu.map(|c| c.id),
                yield_rounds,
                step_blocks: match layout {
                    Layout::Threads => usize::MAX,
                    Layout::Hosted => shard_loop::HOSTED_STEP_BLOCKS,
                },
            };
            (core, cpu)
        })
        .collect();
    if let Some(img) = image {
        restore_cores(&mut built, img)?;
    }
    Ok(Built {
        cores: built,
        links,
        wakers,
    })
}

/// Rebuilds every core's shard and directories from its image, one rayon task per core.
fn restore_cores<P: ShardPolicy>(
    cores: &mut [(Core<P>, Option<core_affinity::CoreId>)],
    image: &ArchivedEngineImage,
) -> Result<()> {
    use rayon::prelude::*;
    cores
        .par_iter_mut()
        .zip(image.cores.as_slice().par_iter())
        .map(|((core, _), img)| {
            core.shard.write(|s| s.restore_image(img))?;
            core.ingest.restore(img)
        })
        .collect::<Result<Vec<()>>>()
        .map(|_| ())
}

impl Runtime {
    /// Core threads started.
    pub fn cores(&self) -> usize {
        self.threads.len()
    }

    /// The CPU each core thread is pinned to (`None`: not pinned, e.g. more cores than
    /// CPUs).
    pub fn pinned(&self) -> &[Option<usize>] {
        &self.pinned
    }

    /// Waits for every core to finish and exit (drop every handle first) and returns their
    /// final figures.
    pub fn join(self) -> Result<Vec<CoreSummary>> {
        self.threads
            .into_iter()
            .map(|t| t.join().map_err(|_| EngineError::RuntimeStopped))
            .collect()
    }
}
