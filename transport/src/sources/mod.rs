//! Each worker's event sources, in one place: which sources a worker has (a ZMQ
//! subscription per publisher, or a TensorRT-LLM poller), started when it registers and
//! stopped when it leaves, on the worker's home core. The router binary, the Python
//! package and the replay bench all keep their sources here. QUIC publishers register
//! themselves over their own connections ([`crate::native`]): nothing to start for them.
//!
//! A stream's resume point (a restored snapshot's mark) is taken by its subscription when
//! it starts ([`crate::zmq::spawn_subscriber_on`] reads [`crate::hub::Persisted`]).
//!
//! # Invariants
//! 1. At most one running task per (worker, source address): a repeated registration keeps
//!    the running stream and its fence.
//! 2. A worker has one kind of source: registering it with a TensorRT-LLM poll interval
//!    stops its other sources (a worker that moved from ZMQ, or to another URL).
//! 3. [`Sources::stop`] aborts every task of the worker before it returns, so a caller
//!    that then removes the worker from the hub sees no batch of it land afterwards when
//!    both run on the worker's home core (`POST`/`DELETE /v1/workers` do).
//! 4. Dropping the [`Sources`] aborts every task.
//!
//! # Concurrency
//! The task map sits behind a mutex held for a lookup, a spawn or an abort; never across
//! an `.await`, and never while a hub lock is held.

use crate::cores::Homes;
use crate::hub::{Hub, Registration};
use crate::outbound::Outbound;
use crate::trtllm::{TrtllmSource, spawn_poller_on};
use crate::zmq::{SubscriberConfig, ZmqSource, spawn_subscriber_on};
use engine::WorkerId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

/// How new sources are set up.
#[derive(Clone, Debug, Default)]
pub struct SourcesConfig {
    /// ZMQ subscriptions' settings.
    pub zmq: SubscriberConfig,
    /// The client settings TensorRT-LLM pollers use.
    pub outbound: Outbound,
    /// Each worker's home core, where its sources run (none: `runtime`).
    pub homes: Option<Homes>,
}

type Tasks = HashMap<(WorkerId, String), JoinHandle<()>>;

/// See the module docs.
pub struct Sources {
    hub: Arc<Hub>,
    config: SourcesConfig,
    /// Where sources of workers without a home core run.
    runtime: Handle,
    tasks: Mutex<Tasks>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("tasks", &self.lock().len())
            .finish_non_exhaustive()
    }
}

impl Sources {
    /// Sources for `hub`'s workers; tasks without a home core run on `runtime`.
    pub fn new(hub: Arc<Hub>, config: SourcesConfig, runtime: Handle) -> Arc<Self> {
        Arc::new(Self {
            hub,
            config,
            runtime,
            tasks: Mutex::new(HashMap::new()),
        })
    }

    /// Sources for `hub`'s workers on the current tokio runtime.
    pub fn on_current(hub: Arc<Hub>, config: SourcesConfig) -> Arc<Self> {
        Self::new(hub, config, Handle::current())
    }

    fn lock(&self) -> MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn home(&self, worker: WorkerId) -> &Handle {
        self.config
            .homes
            .as_ref()
            .and_then(|h| h.home(worker))
            .unwrap_or(&self.runtime)
    }

    /// Starts what `reg` names (already registered with the hub): a TensorRT-LLM poller
    /// when it has a poll interval and a URL (invariant 2), else a ZMQ subscription when it
    /// has a publisher; nothing otherwise. A source that cannot start is logged.
    pub fn start(&self, reg: &Registration) {
        if let (Some(interval), Some(url)) = (reg.trtllm_poll, &reg.url) {
            match TrtllmSource::new(reg.worker, url, interval) {
                Ok(source) => {
                    self.stop_except(reg.worker, &source.events_url());
                    self.poll(source);
                }
                Err(e) => tracing::warn!(worker = %reg.worker, "not polling: {e}"),
            }
            return;
        }
        let Some(zmq) = &reg.zmq else { return };
        match ZmqSource::new(reg.worker, zmq, reg.replay.as_deref()) {
            Ok(source) => self.subscribe(source),
            Err(e) => tracing::warn!(worker = %reg.worker, "not subscribing: {e}"),
        }
    }

    /// Subscribes to a ZMQ publisher (invariant 1: kept if already running).
    pub fn subscribe(&self, source: ZmqSource) {
        let mut tasks = self.lock();
        let id = (source.worker, source.publisher.clone());
        if tasks.get(&id).is_some_and(|t| !t.is_finished()) {
            return;
        }
        let on = self.home(source.worker);
        let task = spawn_subscriber_on(on, self.hub.clone(), source, self.config.zmq);
        tasks.insert(id, task);
    }

    /// Polls a TensorRT-LLM worker's events (invariant 1: kept if already running).
    pub fn poll(&self, source: TrtllmSource) {
        let mut tasks = self.lock();
        let id = (source.worker, source.events_url());
        if tasks.get(&id).is_some_and(|t| !t.is_finished()) {
            return;
        }
        let on = self.home(source.worker);
        let task = spawn_poller_on(on, self.hub.clone(), source, &self.config.outbound);
        tasks.insert(id, task);
    }

    /// Stops every source of `worker` (invariant 3).
    pub fn stop(&self, worker: WorkerId) {
        self.stop_where(worker, None);
    }

    /// Stops `worker`'s sources other than the one at `keep`.
    pub fn stop_except(&self, worker: WorkerId, keep: &str) {
        self.stop_where(worker, Some(keep));
    }

    fn stop_where(&self, worker: WorkerId, keep: Option<&str>) {
        self.lock().retain(|(w, address), task| {
            let gone = *w == worker && keep != Some(address.as_str());
            if gone {
                task.abort();
            }
            !gone
        });
    }

    /// Workers with a running source.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut out: Vec<WorkerId> = self
            .lock()
            .iter()
            .filter(|(_, t)| !t.is_finished())
            .map(|((w, _), _)| *w)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Stops every source and waits until their tasks are gone (their hub handles
    /// dropped).
    pub async fn shutdown(&self) {
        let tasks: Vec<JoinHandle<()>> = self.lock().drain().map(|(_, t)| t).collect();
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
    }
}

impl Drop for Sources {
    fn drop(&mut self) {
        for (_, t) in self.lock().drain() {
            t.abort();
        }
    }
}
