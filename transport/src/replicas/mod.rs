//! Router replicas (`--replica-nats`): several kvengine processes that route as one.
//!
//! Every replica keeps the whole index itself: it subscribes to every worker's KV events
//! (ZMQ PUB fans out to each subscriber). What replicas must share is the load they add:
//! each publishes the requests it routes, prefills and frees ([`wire::LoadEvent`]) on NATS,
//! and applies its peers' as *remote requests* of its routers
//! ([`engine::router::Router::add_remote`]), so every replica's cost function counts the
//! whole cluster's active blocks and pending prefill, and a block two replicas' requests
//! share still counts once.
//!
//! * [`wire`]: the frames on NATS and their decoding (a fuzz target reads it).
//! * [`peers`]: membership, sans-IO: ordering, gaps, dead peers.
//! * [`outbox`]: the hub's side: load events queued for the link, never blocking a route.
//! * `apply`: a peer's events applied to the hub's routers.
//! * [`link`]: the task that talks to NATS.
//! * [`warm`]: snapshots in a JetStream object store, for a replica that starts.
//! * [`auth`]: the MAC on every message (`--replica-secret`).
//! * [`nats`]: reaching NATS (servers, credentials, TLS).
//!
//! # Failure
//! * A peer silent for `--replica-timeout-ms` is dead: what it added is freed.
//! * A gap in a peer's frames (or a peer first heard mid-stream) asks it for its whole
//!   state, which it sends as a `Reset` and its active requests; until then its requests
//!   also expire after the router's request timeout.
//! * NATS unreachable: the replica routes on its own load only (peers' load is dropped, not
//!   trusted while unheard), counts the outage and shows it in `/ready`'s details; routing
//!   never waits for NATS. On reconnecting it sends its state and asks for everyone's.
//!
//! # Trust
//! With a shared secret ([`ReplicaConfig::secret`]) every frame, resync request and
//! snapshot carries an HMAC-SHA256 tag ([`auth`]), checked before anything in it is used;
//! what fails is dropped, counted (`kvengine_replica_unauthenticated`, and
//! `kvengine_events_rejected_total{reason="unauthorized"}`) and logged. Without one, replica
//! state is unauthenticated: anyone who can publish on the subjects can steer routing (a
//! warning says so at start). Snapshots never carry secrets (worker API keys stay in the
//! configuration and the state directory's key file, [`crate::state`]), and a registration
//! learnt from one is checked against `--worker-hosts` like one over the API.
//!
//! # Invariants
//! 1. The hub queues a request's events under its routing lock, so each replica publishes
//!    them in the order its own state changed (an `Added` before its `Freed`).
//! 2. Applying a peer's event is idempotent where a resent state can repeat it (an `Added`
//!    already active, a `Prefilled` twice, a `Freed` of an unknown request change nothing).
//! 3. Nothing a peer says is applied to the local requests: a remote request lives in its
//!    own name space per replica.
//!
//! # Concurrency
//! The hub calls [`LoadSink`] from any thread under its routing lock (a `try_send`, never
//! a wait). One tokio task ([`link::start`] spawns it) owns the NATS client and the [`peers::Peers`]
//! table; counters are atomics read by `/metrics` and `/ready`.

pub(crate) mod apply;
pub mod auth;
pub mod link;
pub mod nats;
pub mod outbox;
pub mod peers;
pub mod warm;
pub mod wire;

use engine::ReplicaId;
use std::time::Duration;

pub use crate::hub::{LoadSink, ReplicaStats, ReplicaStatus};
pub use auth::ReplicaSecret;
pub use link::{ReplicaLink, start};
pub use nats::NatsAccess;
pub use outbox::Outbox;

/// How a replica joins its peers.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// The NATS server(s), e.g. `nats://127.0.0.1:4222` (comma-separated for a cluster),
    /// and how to authenticate to them.
    pub nats: NatsAccess,
    /// The deployment's shared secret: every message is authenticated with it ([`auth`]).
    /// `None`: replica state is unauthenticated.
    pub secret: Option<ReplicaSecret>,
    /// Subject prefix shared by the replicas of one router deployment.
    pub subject: String,
    /// This replica's name (logs, `/v1/replicas`).
    pub name: String,
    /// Interval between heartbeats.
    pub heartbeat: Duration,
    /// A peer silent this long is dead and its load is dropped.
    pub peer_timeout: Duration,
}

impl ReplicaConfig {
    /// Defaults for `url`: prefix `kvengine`, heartbeats every second, peers dead after 5 s.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            nats: NatsAccess::new(url),
            secret: None,
            subject: "kvengine".into(),
            name: default_name(),
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
        }
    }

    /// The subject of load frames.
    pub fn load_subject(&self) -> String {
        format!("{}.load", self.subject)
    }

    /// The subject of resync requests.
    pub fn resync_subject(&self) -> String {
        format!("{}.resync", self.subject)
    }

    /// The subject of session assignments.
    pub fn sessions_subject(&self) -> String {
        format!("{}.sessions", self.subject)
    }
}

/// `host-pid`: unique enough for logs; the id is what peers key on.
fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "kvengine".into());
    format!("{host}-{}", std::process::id())
}

/// A fresh replica id: a process that starts again is a new replica (what its previous
/// life added expires with it), so the id is drawn from the clock, the pid and an address.
pub fn new_replica_id() -> ReplicaId {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let seed = [
        nanos,
        u64::from(std::process::id()),
        std::ptr::addr_of!(local) as u64,
    ];
    let bytes: Vec<u8> = seed.iter().flat_map(|v| v.to_le_bytes()).collect();
    // 0 means "everyone" in a resync request.
    ReplicaId(xxhash_rust::xxh3::xxh3_64(&bytes).max(1))
}
