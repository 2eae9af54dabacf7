//! `--replica-nats`: this router as one of several replicas sharing their load over NATS.
//! Wiring only; what is shared and how is `transport::replicas`.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use transport::hub::Hub;
use transport::replicas::{NatsAccess, ReplicaConfig, ReplicaLink, ReplicaSecret};
use transport::state::Loaded;
use transport::{DropReason, TransportError};

/// Replica settings.
#[derive(Debug, Args, Clone)]
pub struct ReplicaArgs {
    /// Share this router's load with its replicas over this NATS server (e.g.
    /// `nats://nats:4222`; several, comma-separated). Each replica subscribes to every
    /// worker's events itself; the requests each routes are published, so every replica's
    /// cost counts the whole cluster's load. NATS down: routing goes on with this replica's
    /// own load. `nats://user:password@host:4222` or `nats://token@host:4222` authenticate
    /// to the server; `tls://host:4222` requires TLS (system CAs, or `--replica-nats-ca`).
    #[arg(long, env = "KVENGINE_REPLICA_NATS", hide_env_values = true)]
    pub replica_nats: Option<String>,
    /// A PEM file of CA certificates to verify the NATS server with (instead of the
    /// system's); implies TLS.
    #[arg(long, env = "KVENGINE_REPLICA_NATS_CA")]
    pub replica_nats_ca: Option<PathBuf>,
    /// A PEM client certificate (chain) for NATS servers that verify clients; implies TLS.
    #[arg(
        long,
        env = "KVENGINE_REPLICA_NATS_CERT",
        requires = "replica_nats_key"
    )]
    pub replica_nats_cert: Option<PathBuf>,
    /// The key of `--replica-nats-cert` (PEM).
    #[arg(
        long,
        env = "KVENGINE_REPLICA_NATS_KEY",
        requires = "replica_nats_cert"
    )]
    pub replica_nats_key: Option<PathBuf>,
    /// The secret every replica of the deployment shares (at least 16 bytes; prefer the
    /// environment variable to the flag, which `ps` shows): every load frame, resync request
    /// and snapshot then carries an HMAC-SHA256 made with it, and one without a valid MAC is
    /// refused, counted and logged. Without it replica state is unauthenticated: whoever can
    /// publish on the subjects steers routing.
    #[arg(long, env = "KVENGINE_REPLICA_SECRET", hide_env_values = true)]
    pub replica_secret: Option<String>,
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
        config.nats = self.nats_access();
        config.secret = self.secret()?;
        config.subject = self.replica_subject.clone();
        if let Some(name) = &self.replica_name {
            config.name = name.clone();
        }
        config.heartbeat = Duration::from_millis(self.replica_heartbeat_ms);
        config.peer_timeout = Duration::from_millis(self.replica_timeout_ms);
        Ok(Some(config))
    }

    /// How to reach NATS.
    fn nats_access(&self) -> NatsAccess {
        NatsAccess {
            url: self.replica_nats.clone().unwrap_or_default(),
            ca: self.replica_nats_ca.clone(),
            client_cert: self
                .replica_nats_cert
                .clone()
                .zip(self.replica_nats_key.clone()),
        }
    }

    /// The shared secret, if one is set (an empty one is none).
    fn secret(&self) -> Result<Option<ReplicaSecret>> {
        self.replica_secret
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(ReplicaSecret::new)
            .transpose()
            .map_err(anyhow::Error::from)
    }
}

/// Starts the replica link if `args` asks for one.
pub async fn start(hub: &Arc<Hub>, args: &ReplicaArgs) -> Result<Option<ReplicaLink>> {
    let Some(config) = args.config()? else {
        return Ok(None);
    };
    let (url, subject, name) = (
        config.nats.redacted(),
        config.subject.clone(),
        config.name.clone(),
    );
    let authenticated = config.secret.is_some();
    let link = transport::replicas::start(hub.clone(), config)
        .await
        .context("--replica-nats")?;
    println!(
        "kvengine: replica {name} ({}) shares its load on NATS {url}, subject {subject}.*",
        link.id()
    );
    if authenticated {
        println!("kvengine: replica messages are authenticated (HMAC-SHA256, --replica-secret)");
    } else {
        println!(
            "kvengine: warning: replica state is unauthenticated: anyone who can publish on \
             {subject}.* or write the snapshot bucket steers this router's routing and \
             workers; set --replica-secret (KVENGINE_REPLICA_SECRET) on every replica"
        );
        tracing::warn!(
            "replica state is unauthenticated (no --replica-secret): anyone who can publish on \
             the replica subjects steers routing"
        );
    }
    Ok(Some(link))
}

impl ReplicaArgs {
    fn bucket(&self) -> Option<&str> {
        let bucket = self.replica_snapshot_bucket.as_str();
        (self.replica_nats.as_deref().is_some_and(|u| !u.is_empty()) && !bucket.is_empty())
            .then_some(bucket)
    }
}

/// What fetching the peers' snapshot gave.
#[derive(Debug, Default)]
pub struct PeerSnapshot {
    /// The snapshot and the seconds its fetch took.
    pub snapshot: Option<(Loaded, f64)>,
    /// Why one was refused for its MAC (counted once the hub exists: [`Self::record`]).
    refused: Option<TransportError>,
}

impl PeerSnapshot {
    /// Counts a snapshot refused for its MAC (`kvengine_events_rejected_total{reason=
    /// "unauthorized"}`).
    pub fn record(&self, hub: &Hub) {
        if let Some(e) = &self.refused {
            hub.metrics().drop_input(DropReason::Unauthorized, 1, e);
        }
    }
}

/// The peers' latest snapshot and the seconds it took to fetch, if this router is a
/// replica and they have one (before the engine starts, so on a runtime of its own).
/// Anything that goes wrong is said and means a cold start; a snapshot without a valid MAC
/// (with `--replica-secret`) is refused.
pub fn fetch_snapshot(args: &ReplicaArgs) -> PeerSnapshot {
    let mut out = PeerSnapshot::default();
    let Some(bucket) = args.bucket() else {
        return out;
    };
    let secret = match args.secret() {
        Ok(s) => s,
        // Said again, as an error, when the link starts.
        Err(_) => return out,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvengine: warning: cannot fetch the peers' snapshot: {e}");
            return out;
        }
    };
    let nats = args.nats_access();
    let fetched = runtime.block_on(transport::replicas::warm::fetch(
        &nats,
        bucket,
        secret.as_ref(),
        FETCH_TIMEOUT,
    ));
    match fetched {
        Ok(Some((loaded, seconds))) => {
            println!(
                "kvengine: fetched the replicas' snapshot from bucket {bucket} ({} MB in {seconds:.3} s)",
                loaded.len() >> 20
            );
            out.snapshot = Some((loaded, seconds));
        }
        Ok(None) => {
            println!("kvengine: no snapshot in bucket {bucket} yet; no warm start from peers");
        }
        Err(e @ TransportError::ReplicaMac { .. }) => {
            eprintln!("kvengine: warning: the peers' snapshot is refused: {e}; starting cold");
            out.refused = Some(e);
        }
        Err(e) => {
            eprintln!("kvengine: warning: no warm start from peers: {e}");
        }
    }
    out
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
