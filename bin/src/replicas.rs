//! `--replica-nats`: this router as one of several replicas sharing their load over NATS.
//! Wiring only; what is shared and how is `transport::replicas`.

use anyhow::{Context, Result};
use clap::Args;
use std::sync::Arc;
use std::time::Duration;
use transport::hub::Hub;
use transport::replicas::{ReplicaConfig, ReplicaLink};

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
}

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
