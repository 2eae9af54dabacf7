//! The router(s) and their simulated workers in one process, on the current tokio runtime.
//!
//! [`Cluster::start`] starts `workers` simulated vLLM workers ([`spawn_mixed_cluster`]),
//! then the router in front of them ([`Router::start`]: engine, hub, subscriptions, HTTP
//! edge and OpenAI proxy; worker `i` has id `i + 1`). With `replicas` N > 1 it starts N
//! such routers, all in front of the same workers under the same ids, and links their hubs
//! through a NATS server of their own ([`ReplicaSync`]), so each counts the others' load.
//!
//! A disaggregated cluster ([`ClusterConfig::disaggregated`]) starts `P` prefill workers
//! (ids `1..=P`) then `D` decode workers, each registered with its role (and, for SGLang's
//! bootstrap, its HTTP port); the OpenAI proxy disaggregates with the spec's protocol and
//! split, and the mode applies to the choice in both pools.
//!
//! # Invariants
//! 1. [`Cluster::shutdown`] stops everything it started, in order: the replica links (they
//!    hold the hubs), each router ([`Router::shutdown`]), the workers, the NATS server.
//! 2. A failed start stops what it had started.
//! 3. With `replicas` 1 there is no NATS server and no replica link: the cluster is the
//!    single router it always was.

pub use super::config::ClusterConfig;

use super::replicas::{ReplicaSync, SyncTotals};
use super::router::{Router, worker_ids};
use crate::workers::driver::Snapshot;
use crate::workers::{SimWorkerConfig, SimWorkerHandle, spawn_mixed_cluster};
use anyhow::{Context, Result, anyhow, bail};
use engine::WorkerId;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::hub::Hub;

/// A running cluster. Stop it with [`Cluster::shutdown`].
#[derive(Debug)]
pub struct Cluster {
    /// The first router (the only one without replicas).
    router: Router,
    /// The other replicas, in replica order.
    others: Vec<Router>,
    sync: Option<ReplicaSync>,
    workers: Vec<SimWorkerHandle>,
    ids: Vec<WorkerId>,
}

impl Cluster {
    /// Starts a cluster on the current tokio runtime.
    pub async fn start(cfg: &ClusterConfig) -> Result<Self> {
        if cfg.workers == 0 {
            bail!("a cluster needs at least one worker");
        }
        if cfg.replicas == 0 {
            bail!("a cluster needs at least one router");
        }
        if let Some(d) = &cfg.disagg {
            d.validate()
                .map_err(|e| anyhow!("disaggregation {d}: {e}"))?;
            if d.workers() != cfg.workers {
                bail!(
                    "disaggregation {d} needs {} workers, not {}",
                    d.workers(),
                    cfg.workers
                );
            }
        }
        let base = SimWorkerConfig {
            engine: cfg.engine.clone(),
            speedup: cfg.speedup,
            events: cfg.events,
            ..SimWorkerConfig::default()
        };
        let workers = spawn_mixed_cluster(&cfg.roles(), base, None)
            .await
            .context("cannot start the simulated workers")?;
        let mut routers = Vec::with_capacity(cfg.replicas);
        for i in 0..cfg.replicas {
            // Each replica its own seed, as `kvengine` gives them: shared seeds would line
            // up their random picks and tie-breaks.
            let own = ClusterConfig {
                seed: cfg.seed.wrapping_add(i as u64),
                ..cfg.clone()
            };
            match Router::start(&own, &workers).await {
                Ok(r) => routers.push(r),
                Err(e) => {
                    // The start's error is the one to report.
                    let _ = stop(None, routers, workers).await;
                    return Err(e).with_context(|| format!("router replica {i}"));
                }
            }
        }
        let sync = if cfg.replicas > 1 && cfg.share_load {
            let hubs: Vec<&Arc<Hub>> = routers.iter().map(Router::hub).collect();
            match ReplicaSync::start(&hubs).await {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = stop(None, routers, workers).await;
                    return Err(e).context("cannot link the router replicas over NATS");
                }
            }
        } else {
            None
        };
        let mut routers = routers.into_iter();
        let Some(router) = routers.next() else {
            // Not reached (`replicas` >= 1), but nothing is left running if it were.
            let _ = stop(sync, Vec::new(), workers).await;
            bail!("no router started");
        };
        Ok(Self {
            router,
            others: routers.collect(),
            sync,
            ids: worker_ids(&workers),
            workers,
        })
    }

    /// Every router, in replica order.
    pub fn routers(&self) -> impl Iterator<Item = &Router> {
        std::iter::once(&self.router).chain(&self.others)
    }

    /// The first router's base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        self.router.url()
    }

    /// Every router's base URL, in replica order.
    pub fn urls(&self) -> Vec<String> {
        self.routers().map(Router::url).collect()
    }

    /// The first router's HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.router.addr()
    }

    /// The first router's hub.
    pub fn hub(&self) -> &Arc<Hub> {
        self.router.hub()
    }

    /// Every router's hub, in replica order.
    pub fn hubs(&self) -> Vec<&Arc<Hub>> {
        self.routers().map(Router::hub).collect()
    }

    /// The workers' ids, in worker order.
    pub fn worker_ids(&self) -> Vec<WorkerId> {
        self.ids.clone()
    }

    /// The workers.
    pub fn workers(&self) -> &[SimWorkerHandle] {
        &self.workers
    }

    /// Every worker's current load and counters, in worker order.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.workers.iter().map(SimWorkerHandle::snapshot).collect()
    }

    /// The replicas' link, if there are several.
    pub fn sync(&self) -> Option<&ReplicaSync> {
        self.sync.as_ref()
    }

    /// Starts the window the replica sync is measured over (nothing without replicas).
    pub fn mark_sync(&mut self) {
        if let Some(s) = &mut self.sync {
            s.mark();
        }
    }

    /// What the replica sync did since [`Self::mark_sync`] (`None` without replicas).
    pub fn sync_totals(&self) -> Option<SyncTotals> {
        self.sync.as_ref().map(ReplicaSync::totals)
    }

    /// Waits (at most `limit`) until no router has an active request and, with replicas,
    /// the sync has caught up ([`ReplicaSync::settled`]); returns how many requests are
    /// still active, summed over the routers (a replica counts its peers' requests too).
    /// A sync still behind at the deadline is reported on stderr: its figures are partial.
    pub async fn wait_idle(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            // Idle first: once no hub has a request of its own, no new load event can be
            // handed to a link, so a settled sync stays settled.
            let n = self
                .routers()
                .map(|r| r.hub().routing().active_requests())
                .sum();
            let settled = n == 0 && self.sync.as_ref().is_none_or(ReplicaSync::settled);
            if settled {
                return 0;
            }
            if Instant::now() >= deadline {
                if n == 0 {
                    eprintln!(
                        "kvengine replay: warning: the replica sync had not caught up within \
                         {limit:?}: its figures are partial"
                    );
                }
                return n;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops everything (see invariant 1).
    pub async fn shutdown(self) -> Result<()> {
        let Self {
            router,
            mut others,
            sync,
            workers,
            ..
        } = self;
        others.insert(0, router);
        stop(sync, others, workers).await
    }
}

/// Stops the replica links, then each router, then the workers, then the NATS server;
/// returns the first router's error, if any (every part is stopped regardless).
async fn stop(
    sync: Option<ReplicaSync>,
    routers: Vec<Router>,
    workers: Vec<SimWorkerHandle>,
) -> Result<()> {
    // The links hold the hubs (and may still apply a peer's frame): they go first.
    let nats = match sync {
        Some(s) => Some(s.stop_links().await),
        None => None,
    };
    let mut outcome = Ok(());
    for r in routers {
        let stopped = r.shutdown().await;
        if outcome.is_ok() {
            outcome = stopped;
        }
    }
    for w in workers {
        w.shutdown().await;
    }
    drop(nats);
    outcome
}
