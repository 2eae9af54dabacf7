//! What the routing state tells router replicas ([`crate::replicas`]) about this router's
//! own requests, and the replica link's counters (`/metrics`, `/ready`). Defined here, on
//! the routing side, so routing does not depend on the replica link: the link implements
//! [`LoadSink`] and is handed to [`super::Routing::set_replicas`].
//!
//! # Invariants
//! 1. A sink is called under the routing lock, once the routing state changed, so it sees
//!    a router's requests in the order they happened; it must not block (a `try_send`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// What the routing state tells the replicas about its own requests (invariant 1: called
/// under the routing lock, so it must not block).
pub trait LoadSink: Send + Sync + std::fmt::Debug {
    /// A request was routed to `key` with `overlap_blocks` cached.
    fn added(
        &self,
        request: &str,
        key: engine::WorkerKey,
        blocks: &[engine::SeqHash],
        input_tokens: u64,
        overlap_blocks: u32,
    );
    /// A request's first token was produced.
    fn prefilled(&self, request: &str);
    /// A request finished or was cancelled.
    fn freed(&self, request: &str);
    /// A request of session `session` in `model` was routed to `key` (sticky sessions;
    /// best effort: the default drops it).
    fn session(&self, model: &str, session: engine::SessionId, key: engine::WorkerKey) {
        let _ = (model, session, key);
    }
    /// The sync's counters, for `/metrics`.
    fn stats(&self) -> &ReplicaStats;
    /// Where the replica link stands, for `/ready`.
    fn status(&self) -> ReplicaStatus {
        let s = self.stats();
        let connected = s.connected.load(Relaxed);
        ReplicaStatus {
            load: if connected { "shared" } else { "local_only" },
            connected,
            peers: s.peers.load(Relaxed),
            outages: s.outages.load(Relaxed),
            events_dropped: s.events_dropped.load(Relaxed),
        }
    }
}

/// Counters of one replica's sync (all totals since start).
#[derive(Debug, Default)]
pub struct ReplicaStats {
    /// Whether the link to NATS is up.
    pub connected: AtomicBool,
    /// Times the link to NATS went down.
    pub outages: AtomicU64,
    /// Peers known now.
    pub peers: AtomicU64,
    /// Frames published (events and heartbeats) ...
    pub frames_sent: AtomicU64,
    /// ... and their bytes.
    pub bytes_sent: AtomicU64,
    /// Load events the hub handed to the outbox. Each is then sent or dropped: once the
    /// link has drained its queue, `events_sent + events_dropped` has caught up with it
    /// (states, sent without the outbox, add to `events_sent` beside it).
    pub events_queued: AtomicU64,
    /// Load events published.
    pub events_sent: AtomicU64,
    /// Load events not published: the link was down or the queue full. Peers get the
    /// replica's whole state instead once it can send.
    pub events_dropped: AtomicU64,
    /// Peers' frames received ...
    pub frames_received: AtomicU64,
    /// ... and their bytes.
    pub bytes_received: AtomicU64,
    /// Peers' load events applied.
    pub events_applied: AtomicU64,
    /// Peers' requests on a worker this replica does not route to (not applied).
    pub unknown_worker: AtomicU64,
    /// Peers' `Prefilled`/`Freed` for requests not active here (expired, or repeated by a
    /// resent state): nothing to do.
    pub unmatched: AtomicU64,
    /// Peers' requests refused (a bad name); logged.
    pub refused: AtomicU64,
    /// Frames and resync requests dropped for a missing or bad MAC (`--replica-secret`);
    /// logged.
    pub unauthenticated: AtomicU64,
    /// Frames that could not be decoded; logged.
    pub malformed: AtomicU64,
    /// Gaps in peers' frames (each asks for the peer's state).
    pub gaps: AtomicU64,
    /// States this replica sent (each a `Reset` and its active requests).
    pub states_sent: AtomicU64,
    /// Session assignments published.
    pub sessions_sent: AtomicU64,
    /// Session assignments not published (the link was down or its queue full): a peer
    /// then routes that session by cost once, and remembers its own choice.
    pub sessions_dropped: AtomicU64,
    /// Peers' session assignments applied.
    pub sessions_applied: AtomicU64,
    /// Peers' session assignments for a model or worker this replica does not route to.
    pub sessions_ignored: AtomicU64,
    /// Peers found dead (their load dropped).
    pub peers_expired: AtomicU64,
    /// CPU nanoseconds the link spent encoding, decoding and applying (its thread's CPU
    /// time, so waits for a CPU or the routing lock are not in it).
    pub busy_ns: AtomicU64,
    /// Snapshots put in the object store ([`crate::replicas::warm`]) ...
    pub snapshots_put: AtomicU64,
    /// ... and the puts that failed (logged).
    pub snapshot_failures: AtomicU64,
}

/// Where the replica link stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ReplicaStatus {
    /// `shared` (peers' load counts) or `local_only` (NATS unreachable).
    pub load: &'static str,
    /// Whether load is shared with peers now (false: local-only).
    pub connected: bool,
    /// Peers heard within the timeout.
    pub peers: u64,
    /// Times the link to NATS went down.
    pub outages: u64,
    /// Load events not published while the link was down or the queue full.
    pub events_dropped: u64,
}
