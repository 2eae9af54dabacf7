//! How the hub reaches the engine: one trait, [`EngineAccess`], implemented by both runtime
//! layouts.
//!
//! * [`Threads`]: cores on threads of their own ([`start_engine`]). Engine handles are
//!   `Send` but not `Sync`, so each sits behind its own mutex; one worker's events always
//!   take the same ingest handle (`home_core(worker) % n`, so the engine applies them in the
//!   order they were handed over), queries take whichever query handle is free.
//! * [`Hosted`]: cores hosted on the edge's threads ([`crate::cores`]). A call made on a
//!   core thread goes through that thread's core (a query for its shard answered in place,
//!   anything else over its rings while it keeps stepping its core); a call from any other
//!   thread takes the shared fallback handles.
//!
//! # Concurrency
//! A handle's mutex is level 4 of [`super::lock_order`]: the last lock taken, and the only
//! one held across an engine call.

use super::lock_order::{Level, lock};
use crate::cores;
use crate::error::{Result, TransportError};
use engine::directories::Applied;
use engine::event::KvEvent;
use engine::runtime::{CoreSummary, IngestHandle, QueryHandle, home_core};
use engine::sharding::choice::Sharding;
use engine::snapshot::{EngineImage, StreamMark};
use engine::{EngineError, Matches, SeqHash, WorkerId, WorkerKey};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// A batch of one worker's events, tagged with their keys.
pub type Batch = Arc<[(WorkerKey, KvEvent)]>;

/// What the hub asks of the engine (see the module docs).
pub trait EngineAccess: Send + Sync + std::fmt::Debug {
    /// Hands `batch` of `worker` over without waiting; with `mark`, the engine records the
    /// stream position with it (snapshots hold a batch exactly when they hold its mark).
    fn send(&self, worker: WorkerId, batch: &Batch, mark: Option<StreamMark>) -> Result<()>;
    /// Applies `events` of `key` one by one, each answered (stores refused with
    /// [`EngineError::IndexFull`] when `refuse_stores`), then waits until every shard has
    /// its share. Fails only for a stopped or timed-out engine.
    fn apply_all(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
        refuse_stores: bool,
    ) -> Result<Vec<std::result::Result<Applied, EngineError>>>;
    /// Drops every block of `key`.
    fn clear(&self, key: WorkerKey) -> Result<usize>;
    /// Drops every block of `worker`.
    fn remove_worker(&self, worker: WorkerId) -> Result<usize>;
    /// `key`'s cached blocks.
    fn cached_blocks(&self, key: WorkerKey) -> Result<u64>;
    /// Waits until what was handed over is applied (see [`super::Hub::sync`]).
    fn sync(&self) -> Result<()>;
    /// The overlaps of the prompt whose full blocks are `seqs`.
    fn find_matches(&self, seqs: &[SeqHash]) -> Result<Matches>;
    /// Every core's figures.
    fn core_stats(&self) -> Result<Vec<CoreSummary>>;
    /// The engine at a consistent cut; blocks until every core answered.
    fn snapshot(&self) -> Result<EngineImage>;
    /// Whether queries may wait on another core's shard without blocking the thread
    /// ([`crate::cores::find_matches`]).
    fn hosted(&self) -> bool;
}

/// Applies `events` through `ingest`, as [`EngineAccess::apply_all`] says.
fn apply_through<E>(
    ingest: &mut E,
    key: WorkerKey,
    events: &[KvEvent],
    refuse_stores: bool,
    apply: impl Fn(&mut E, WorkerKey, &KvEvent) -> engine::Result<Applied>,
    sync: impl Fn(&mut E) -> engine::Result<()>,
) -> Result<Vec<std::result::Result<Applied, EngineError>>> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        if refuse_stores && matches!(e, KvEvent::Stored { .. }) {
            out.push(Err(EngineError::IndexFull));
            continue;
        }
        match apply(ingest, key, e) {
            Err(e @ (EngineError::RuntimeStopped | EngineError::Timeout { .. })) => {
                return Err(TransportError::from(e));
            }
            r => out.push(r),
        }
    }
    // The answer says the batch is in: every shard's share must be, so the next query (on
    // any core) sees it.
    sync(ingest)?;
    Ok(out)
}

/// Cores on threads of their own.
#[derive(Debug)]
pub struct Threads {
    ingest: Handles<IngestHandle>,
    query: Handles<QueryHandle<Sharding>>,
    next_query: AtomicUsize,
}

impl Threads {
    /// Over a started engine's handles (at least one of each).
    pub fn new(ingest: Vec<IngestHandle>, query: Vec<QueryHandle<Sharding>>) -> Result<Self> {
        let (Some(ingest), Some(query)) = (Handles::new(ingest), Handles::new(query)) else {
            return Err(TransportError::Invalid {
                name: "hub",
                reason: "needs at least one ingest and one query handle".into(),
            });
        };
        Ok(Self {
            ingest,
            query,
            next_query: AtomicUsize::new(0),
        })
    }

    fn home(&self, worker: WorkerId) -> &Mutex<IngestHandle> {
        self.ingest.get(home_core(worker, self.ingest.len()).idx())
    }

    /// A free query handle if there is one, else the next in turn.
    fn on_query<R>(&self, f: impl FnOnce(&mut QueryHandle<Sharding>) -> R) -> R {
        let n = self.query.len();
        let start = self.next_query.fetch_add(1, Relaxed);
        for i in 0..n {
            let entered = Level::Handle.enter();
            if let Ok(mut h) = self.query.get(start.wrapping_add(i) % n).try_lock() {
                let r = f(&mut h);
                drop(entered);
                return r;
            }
        }
        f(&mut lock(Level::Handle, self.query.get(start % n)))
    }
}

impl EngineAccess for Threads {
    fn send(&self, worker: WorkerId, batch: &Batch, mark: Option<StreamMark>) -> Result<()> {
        let mut h = lock(Level::Handle, self.home(worker));
        Ok(match mark {
            None => h.send(batch),
            Some(mark) => h.send_marked(batch, mark),
        }?)
    }
    fn apply_all(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
        refuse_stores: bool,
    ) -> Result<Vec<std::result::Result<Applied, EngineError>>> {
        let mut h = lock(Level::Handle, self.home(key.worker));
        apply_through(
            &mut *h,
            key,
            events,
            refuse_stores,
            |h, k, e| h.apply(k, e),
            |h| h.sync(),
        )
    }
    fn clear(&self, key: WorkerKey) -> Result<usize> {
        Ok(lock(Level::Handle, self.home(key.worker)).clear(key)?)
    }
    fn remove_worker(&self, worker: WorkerId) -> Result<usize> {
        Ok(lock(Level::Handle, self.home(worker)).remove_worker(worker)?)
    }
    fn cached_blocks(&self, key: WorkerKey) -> Result<u64> {
        Ok(lock(Level::Handle, self.home(key.worker)).cached_blocks(key)?)
    }
    fn sync(&self) -> Result<()> {
        for h in self.ingest.iter() {
            lock(Level::Handle, h).sync()?;
        }
        Ok(())
    }
    fn find_matches(&self, seqs: &[SeqHash]) -> Result<Matches> {
        Ok(self.on_query(|q| q.find_matches(seqs))?)
    }
    fn core_stats(&self) -> Result<Vec<CoreSummary>> {
        Ok(self.on_query(|q| q.core_stats())?)
    }
    fn snapshot(&self) -> Result<EngineImage> {
        Ok(lock(Level::Handle, self.ingest.get(0)).snapshot()?)
    }
    fn hosted(&self) -> bool {
        false
    }
}

/// Cores hosted on the edge's threads; these handles serve the other threads.
#[derive(Debug)]
pub struct Hosted {
    ingest: Mutex<IngestHandle>,
    query: Mutex<QueryHandle<Sharding>>,
}

impl Hosted {
    /// With the fallback handles for threads that are not cores.
    pub fn new(ingest: IngestHandle, query: QueryHandle<Sharding>) -> Self {
        Self {
            ingest: Mutex::new(ingest),
            query: Mutex::new(query),
        }
    }
}

impl EngineAccess for Hosted {
    fn send(&self, _: WorkerId, batch: &Batch, mark: Option<StreamMark>) -> Result<()> {
        let r = match mark {
            None => cores::with_core(|c| c.send(batch))
                .unwrap_or_else(|| lock(Level::Handle, &self.ingest).send(batch)),
            Some(mark) => cores::with_core(|c| c.send_marked(batch, mark))
                .unwrap_or_else(|| lock(Level::Handle, &self.ingest).send_marked(batch, mark)),
        };
        Ok(r?)
    }
    fn apply_all(
        &self,
        key: WorkerKey,
        events: &[KvEvent],
        refuse_stores: bool,
    ) -> Result<Vec<std::result::Result<Applied, EngineError>>> {
        let on_core = cores::with_core(|c| {
            apply_through(
                c,
                key,
                events,
                refuse_stores,
                |c, k, e| c.apply(k, e),
                |c| c.sync(),
            )
        });
        match on_core {
            Some(r) => r,
            None => apply_through(
                &mut *lock(Level::Handle, &self.ingest),
                key,
                events,
                refuse_stores,
                |h, k, e| h.apply(k, e),
                |h| h.sync(),
            ),
        }
    }
    fn clear(&self, key: WorkerKey) -> Result<usize> {
        Ok(cores::with_core(|c| c.clear(key))
            .unwrap_or_else(|| lock(Level::Handle, &self.ingest).clear(key))?)
    }
    fn remove_worker(&self, worker: WorkerId) -> Result<usize> {
        Ok(cores::with_core(|c| c.remove_worker(worker))
            .unwrap_or_else(|| lock(Level::Handle, &self.ingest).remove_worker(worker))?)
    }
    fn cached_blocks(&self, key: WorkerKey) -> Result<u64> {
        Ok(cores::with_core(|c| c.cached_blocks(key))
            .unwrap_or_else(|| lock(Level::Handle, &self.ingest).cached_blocks(key))?)
    }
    fn sync(&self) -> Result<()> {
        // This thread's core, and the threads that are not cores (another core's events
        // are ordered only by that core).
        if let Some(r) = cores::with_core(|c| c.sync()) {
            r?;
        }
        Ok(lock(Level::Handle, &self.ingest).sync()?)
    }
    fn find_matches(&self, seqs: &[SeqHash]) -> Result<Matches> {
        Ok(cores::with_core(|c| c.find_matches(seqs))
            .unwrap_or_else(|| lock(Level::Handle, &self.query).find_matches(seqs))?)
    }
    fn core_stats(&self) -> Result<Vec<CoreSummary>> {
        Ok(cores::with_core(|c| c.core_stats())
            .unwrap_or_else(|| lock(Level::Handle, &self.query).core_stats())?)
    }
    fn snapshot(&self) -> Result<EngineImage> {
        Ok(lock(Level::Handle, &self.ingest).snapshot()?)
    }
    fn hosted(&self) -> bool {
        true
    }
}

/// A non-empty list of engine handles, each behind its own mutex.
#[derive(Debug)]
struct Handles<T> {
    first: Mutex<T>,
    rest: Box<[Mutex<T>]>,
}

impl<T> Handles<T> {
    /// `None` if `handles` is empty.
    fn new(handles: Vec<T>) -> Option<Self> {
        let mut it = handles.into_iter().map(Mutex::new);
        Some(Self {
            first: it.next()?,
            rest: it.collect(),
        })
    }

    fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Handle `i` (`i < len()`; anything else gets the first).
    fn get(&self, i: usize) -> &Mutex<T> {
        i.checked_sub(1)
            .and_then(|j| self.rest.get(j))
            .unwrap_or(&self.first)
    }

    fn iter(&self) -> impl Iterator<Item = &Mutex<T>> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }
}

/// A hub over a freshly started engine: one shard thread per shard of `sharding`. Join the
/// returned runtime after dropping the hub.
pub fn start_engine(
    config: super::HubConfig,
    sharding: Sharding,
    engine: engine::runtime::RuntimeConfig,
) -> Result<(super::Hub, engine::runtime::Runtime)> {
    start_engine_from(config, sharding, engine, None)
}

/// Like [`start_engine`], with the cores restored from a snapshot's image first.
pub fn start_engine_from(
    config: super::HubConfig,
    sharding: Sharding,
    engine: engine::runtime::RuntimeConfig,
    image: Option<&engine::snapshot::ArchivedEngineImage>,
) -> Result<(super::Hub, engine::runtime::Runtime)> {
    let started = engine::runtime::start_from(sharding, engine, image)?;
    let hub = super::Hub::new(config, started.ingest, started.query)?;
    Ok((hub, started.runtime))
}
