//! `--replica-nats`: this router as one of several replicas sharing their load over NATS.
//! Wiring only; what is shared and how is `transport::replicas`.

use anyhow::{Context, Result};
use clap::Args;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use transport::hub::Hub;
use transport::replicas::{ReplicaConfig, ReplicaLink};
use transport::state::Loaded;

/// Replica settings.
#[derive(Debug, Args, Clone)]
pub struct ReplicaArgs {
    /// Share this router's load with its replicas over this NATS server (e.g.
    /// `nats://nats:4222`; several, comma-separated). Each replica subscribes to every
    /// worker's events itself; the requests each routes are published, so every replica's
    /// cost counts the whole cluster's load. NATS down: routing goes on with this replica's
    /// own load.
    #[arg(long, env = "KVENGINE_REPLICA_NATS")]
    pub replica_nats: Option<String>,
    /// Subject prefix shared by one deployment's replicas.
    #[arg(long, env = "KVENGINE_REPLICA_SUBJECT", default_value = "kvengine")]
    pub replica_subject: String,
    /// This replica's name in logs and peers' views (default: host-pid).
    #[arg(long, env = "KVENGINE_REPLICA_NAME")]
    pub replica_name: Option<String>,
    /// Milliseconds between heartbeats.
    #[arg(long, env = "KVENGINE_REPLICA_HEARTBEAT_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub replica_heartbeat_ms: u64,
    /// A peer silent this many milliseconds is dead: the load it added is dropped.
    #[arg(long, env = "KVENGINE_REPLICA_TIMEOUT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(50..=3_600_000))]
    pub replica_timeout_ms: u64,
    /// JetStream object-store bucket the replicas keep their latest snapshot in: a replica
    /// that starts restores from it and replays each worker from the snapshot's marks
    /// (same `--cores` and sharding flags needed). Empty: no warm start from peers.
    #[arg(
        long,
        env = "KVENGINE_REPLICA_SNAPSHOT_BUCKET",
        default_value = "kvengine-snapshots"
    )]
    pub replica_snapshot_bucket: String,
    /// Seconds between the snapshots this replica puts in the bucket (0: never puts one,
    /// only reads at start).
    #[arg(long, env = "KVENGINE_REPLICA_SNAPSHOT_INTERVAL_S", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub replica_snapshot_interval_s: u64,
}

/// How long a starting replica waits for its peers' snapshot before starting cold.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

impl ReplicaArgs {
    /// The link's configuration, if this router is a replica.
    pub fn config(&self) -> Result<Option<ReplicaConfig>> {
        let Some(url) = self.replica_nats.clone().filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        anyhow::ensure!(
            self.replica_timeout_ms > self.replica_heartbeat_ms,
            "--replica-timeout-ms ({}) must be longer than --replica-heartbeat-ms ({})",
            self.replica_timeout_ms,
            self.replica_heartbeat_ms
        );
        let mut config = ReplicaConfig::new(url);
        config.subject = self.replica_subject.clone();
        if let Some(name) = &self.replica_name {
            config.name = name.clone();
        }
        config.heartbeat = Duration::from_millis(self.replica_heartbeat_ms);
        config.peer_timeout = Duration::from_millis(self.replica_timeout_ms);
        Ok(Some(config))
    }
}

/// Starts the replica link if `args` asks for one.
pub async fn start(hub: &Arc<Hub>, args: &ReplicaArgs) -> Result<Option<ReplicaLink>> {
    let Some(config) = args.config()? else {
        return Ok(None);
    };
    let (url, subject, name) = (
        config.url.clone(),
        config.subject.clone(),
        config.name.clone(),
    );
    let link = transport::replicas::start(hub.clone(), config)
        .await
        .context("--replica-nats")?;
    println!(
        "kvengine: replica {name} ({}) shares its load on NATS {url}, subject {subject}.*",
        link.id()
    );
    Ok(Some(link))
}

impl ReplicaArgs {
    fn bucket(&self) -> Option<&str> {
        let bucket = self.replica_snapshot_bucket.as_str();
        (self.replica_nats.as_deref().is_some_and(|u| !u.is_empty()) && !bucket.is_empty())
            .then_some(bucket)
    }
}

/// The peers' latest snapshot and the seconds it took to fetch, if this router is a
/// replica and they have one (before the engine starts, so on a runtime of its own).
/// Anything that goes wrong is said and means a cold start.
pub fn fetch_snapshot(args: &ReplicaArgs) -> Option<(Loaded, f64)> {
    let bucket = args.bucket()?;
    let url = args.replica_nats.as_deref()?;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvengine: warning: cannot fetch the peers' snapshot: {e}");
            return None;
        }
    };
    match runtime.block_on(transport::replicas::warm::fetch(url, bucket, FETCH_TIMEOUT)) {
        Ok(Some((loaded, seconds))) => {
            println!(
                "kvengine: fetched the replicas' snapshot from bucket {bucket} ({} MB in {seconds:.3} s)",
                loaded.len() >> 20
            );
            Some((loaded, seconds))
        }
        Ok(None) => {
            println!("kvengine: no snapshot in bucket {bucket} yet; no warm start from peers");
            None
        }
        Err(e) => {
            eprintln!("kvengine: warning: no warm start from peers: {e}");
            None
        }
    }
}

/// Starts putting this replica's snapshots in the bucket, if configured.
pub fn put_snapshots(
    hub: &Arc<Hub>,
    link: &ReplicaLink,
    args: &ReplicaArgs,
    policy: &str,
) -> Option<JoinHandle<()>> {
    let bucket = args.bucket()?;
    let every = (args.replica_snapshot_interval_s > 0)
        .then(|| Duration::from_secs(args.replica_snapshot_interval_s))?;
    Some(link.put_snapshots_every(hub.clone(), bucket.to_owned(), policy.to_owned(), every))
}
