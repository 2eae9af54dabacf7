//! Router replicas in a replay (`--replicas N`, N > 1): one `nats-server` per cluster, a
//! replica link ([`transport::replicas`]) from each router's hub to it, and what the sync
//! cost over the replay.
//!
//! Each cluster gets its own server and a subject prefix of its own
//! (`kvengine-replay-<pid>-<n>`), so nothing a previous mode's replicas published can
//! reach the next mode's. Heartbeats are short ([`HEARTBEAT`]) so the replicas find each
//! other quickly; the peer timeout ([`PEER_TIMEOUT`]) is ten heartbeats, far longer than any
//! stall a healthy run has.
//!
//! The figures ([`SyncTotals`]) are the links' counters ([`ReplicaStats`]) summed over the
//! replicas, and the server's CPU time (`utime + stime` of `/proc/<pid>/stat`, in clock
//! ticks: 10 ms at the usual 100 per second, so short runs read coarsely).
//!
//! # Invariants
//! 1. [`ReplicaSync::start`] returns only once every link is connected and hears all its
//!    `N - 1` peers: no request of the replay is routed before its load can be shared.
//! 2. [`ReplicaSync::totals`] is what changed since [`ReplicaSync::mark`]: the setup's
//!    traffic (connection, first states, heartbeats while waiting) is left out, the
//!    heartbeats within the window are counted.
//! 3. [`ReplicaSync::shutdown`] stops the links before the server. The links hold their
//!    hubs, so they must stop before the routers do (the router module's invariant 1).
//! 4. Once the hubs have no request of their own left, [`ReplicaSync::settled`] is true
//!    only when every load event they handed their links since the mark has been
//!    published (or dropped) and every peer has taken each published one: the sync lags
//!    the routers (its links share the replay's runtime), and the totals are read only
//!    after it caught up.

use crate::nats::NatsServer;
use anyhow::{Context, Result, bail};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use transport::hub::Hub;
use transport::replicas::{ReplicaConfig, ReplicaLink, ReplicaStats};

/// Interval between each replica's heartbeats.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// A peer silent this long is dead (its load dropped).
pub const PEER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the replicas may take to connect and find each other.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// Numbers the clusters of this process, for their subjects.
static CLUSTERS: AtomicU64 = AtomicU64::new(0);

/// The sync's counters summed over the replicas (and the server's CPU), since a mark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncTotals {
    /// Router replicas.
    pub replicas: usize,
    /// Frames published (load events, states, heartbeats, resync asks).
    pub frames_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Load events published.
    pub events_sent: u64,
    /// Load events the hubs handed their links.
    pub events_queued: u64,
    /// Load events lost (link down or queue full): 0 in a healthy run.
    pub events_dropped: u64,
    /// Peers' frames received.
    pub frames_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
    /// Peers' load events applied.
    pub events_applied: u64,
    /// Peers' load events taken but not applied (unknown worker, unmatched, refused).
    pub events_unapplied: u64,
    /// Gaps found in peers' frames: 0 in a healthy run.
    pub gaps: u64,
    /// Nanoseconds the links spent encoding, decoding and applying.
    pub busy_ns: u64,
    /// The NATS server's CPU time (user + system), in nanoseconds, if `/proc` tells.
    pub nats_cpu_ns: Option<u64>,
}

impl SyncTotals {
    /// What changed from `base` to `self` (counters only grow; saturating all the same).
    pub fn since(&self, base: &SyncTotals) -> SyncTotals {
        SyncTotals {
            replicas: self.replicas,
            frames_sent: self.frames_sent.saturating_sub(base.frames_sent),
            bytes_sent: self.bytes_sent.saturating_sub(base.bytes_sent),
            events_sent: self.events_sent.saturating_sub(base.events_sent),
            events_queued: self.events_queued.saturating_sub(base.events_queued),
            events_dropped: self.events_dropped.saturating_sub(base.events_dropped),
            frames_received: self.frames_received.saturating_sub(base.frames_received),
            bytes_received: self.bytes_received.saturating_sub(base.bytes_received),
            events_applied: self.events_applied.saturating_sub(base.events_applied),
            events_unapplied: self.events_unapplied.saturating_sub(base.events_unapplied),
            gaps: self.gaps.saturating_sub(base.gaps),
            busy_ns: self.busy_ns.saturating_sub(base.busy_ns),
            nats_cpu_ns: self
                .nats_cpu_ns
                .zip(base.nats_cpu_ns)
                .map(|(now, then)| now.saturating_sub(then)),
        }
    }

    /// Whether every event handed over was published or dropped, and every published one
    /// was taken by each of the `replicas - 1` peers (invariant 4).
    pub fn caught_up(&self) -> bool {
        let peers = self.replicas.saturating_sub(1) as u64;
        self.events_sent + self.events_dropped >= self.events_queued
            && self.events_applied + self.events_unapplied >= self.events_sent.saturating_mul(peers)
    }

    fn add(&mut self, s: &ReplicaStats) {
        let get = |a: &AtomicU64| a.load(Relaxed);
        self.frames_sent += get(&s.frames_sent);
        self.bytes_sent += get(&s.bytes_sent);
        self.events_sent += get(&s.events_sent);
        self.events_queued += get(&s.events_queued);
        self.events_dropped += get(&s.events_dropped);
        self.frames_received += get(&s.frames_received);
        self.bytes_received += get(&s.bytes_received);
        self.events_applied += get(&s.events_applied);
        self.events_unapplied += get(&s.unknown_worker) + get(&s.unmatched) + get(&s.refused);
        self.gaps += get(&s.gaps);
        self.busy_ns += get(&s.busy_ns);
    }
}

/// A running NATS server and the replicas' links to it. Stop it with
/// [`ReplicaSync::shutdown`].
#[derive(Debug)]
pub struct ReplicaSync {
    nats: NatsServer,
    links: Vec<ReplicaLink>,
    subject: String,
    mark: SyncTotals,
}

impl ReplicaSync {
    /// Starts a NATS server and links `hubs` (one per replica, none linked yet) through it;
    /// returns once they all hear each other (invariant 1).
    pub async fn start(hubs: &[&Arc<Hub>]) -> Result<Self> {
        let nats = tokio::task::spawn_blocking(NatsServer::start)
            .await
            .context("starting nats-server")??;
        let subject = format!(
            "kvengine-replay-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Relaxed)
        );
        let mut sync = Self {
            nats,
            links: Vec::with_capacity(hubs.len()),
            subject,
            mark: SyncTotals::default(),
        };
        for (i, hub) in hubs.iter().enumerate() {
            let mut config = ReplicaConfig::new(sync.nats.url());
            config.subject = sync.subject.clone();
            config.name = format!("replay-replica-{i}");
            config.heartbeat = HEARTBEAT;
            config.peer_timeout = PEER_TIMEOUT;
            match transport::replicas::start(Arc::clone(hub), config).await {
                Ok(link) => sync.links.push(link),
                Err(e) => {
                    sync.shutdown().await;
                    return Err(e).with_context(|| format!("replica {i}'s link to NATS"));
                }
            }
        }
        if let Err(e) = sync.wait_ready().await {
            sync.shutdown().await;
            return Err(e);
        }
        sync.mark();
        Ok(sync)
    }

    /// Waits until every link is connected and hears every peer, then until no load
    /// event moved for a heartbeat: the states the replicas sent each other on connecting
    /// are out and taken, so none straddles the measured window's start. (They cannot be
    /// matched sent for taken: a state sent before a peer subscribed never reaches it.)
    async fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        self.wait_peers(deadline).await?;
        let events = |t: SyncTotals| (t.events_sent, t.events_applied + t.events_unapplied);
        let mut before = events(self.now());
        loop {
            tokio::time::sleep(HEARTBEAT).await;
            let after = events(self.now());
            if after == before {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the router replicas' first states did not settle within {READY_WITHIN:?} \
                     ({:?})",
                    self.now()
                );
            }
            before = after;
        }
    }

    /// Waits until every link is connected and hears every peer.
    async fn wait_peers(&self, deadline: Instant) -> Result<()> {
        let peers = self.links.len().saturating_sub(1) as u64;
        loop {
            let heard: Vec<(bool, u64)> = self
                .links
                .iter()
                .map(|l| {
                    (
                        l.stats().connected.load(Relaxed),
                        l.stats().peers.load(Relaxed),
                    )
                })
                .collect();
            if heard.iter().all(|&(up, n)| up && n >= peers) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the router replicas did not all find each other on NATS {} within {:?} \
                     (connected, peers heard per replica: {heard:?}; {peers} expected); \
                     nats-server's log ends:\n{}",
                    self.nats.url(),
                    READY_WITHIN,
                    self.nats.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The NATS server's URL.
    pub fn url(&self) -> String {
        self.nats.url()
    }

    /// The subject prefix the replicas share.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The counters now, summed over the replicas, since the process started.
    fn now(&self) -> SyncTotals {
        let mut t = SyncTotals {
            replicas: self.links.len(),
            nats_cpu_ns: self.nats.pid().and_then(process_cpu_ns),
            ..SyncTotals::default()
        };
        for link in &self.links {
            t.add(link.stats());
        }
        t
    }

    /// Whether the sync has caught up with the hubs since the mark (invariant 4; call it
    /// once they have no request of their own left).
    pub fn settled(&self) -> bool {
        self.totals().caught_up()
    }

    /// Starts the measured window (invariant 2).
    pub fn mark(&mut self) {
        self.mark = self.now();
    }

    /// What the sync did since [`Self::mark`].
    pub fn totals(&self) -> SyncTotals {
        self.now().since(&self.mark)
    }

    /// Stops the links, then the server (invariant 3).
    pub async fn shutdown(self) {
        drop(self.stop_links().await);
    }

    /// Stops the links and hands back the server, for the caller to stop (drop) once
    /// it has stopped what else uses it.
    pub async fn stop_links(self) -> NatsServer {
        let Self { nats, links, .. } = self;
        for link in links {
            link.shutdown().await;
        }
        nats
    }
}

/// Process `pid`'s CPU time (user + system) in nanoseconds, where `/proc` has it.
fn process_cpu_ns(pid: u32) -> Option<u64> {
    transport::http::process::cpu_seconds(pid).map(|s| (s * 1e9) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_a_cpu_time() {
        let busy = std::time::Instant::now();
        let mut x = 0u64;
        while busy.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(31).wrapping_add(1);
        }
        assert_ne!(x, 1);
        assert!(process_cpu_ns(std::process::id()).is_some_and(|ns| ns > 0));
    }

    #[test]
    fn caught_up_once_every_event_is_out_and_taken_by_every_peer() {
        let t = SyncTotals {
            replicas: 3,
            events_queued: 10,
            events_sent: 9,
            events_dropped: 1,
            events_applied: 17,
            events_unapplied: 1,
            ..SyncTotals::default()
        };
        assert!(t.caught_up());
        // One still queued; one not yet taken by a peer.
        assert!(
            !SyncTotals {
                events_queued: 11,
                ..t
            }
            .caught_up()
        );
        assert!(
            !SyncTotals {
                events_applied: 16,
                ..t
            }
            .caught_up()
        );
        assert!(SyncTotals::default().caught_up());
    }

    #[test]
    fn totals_since_a_mark_subtract_every_counter() {
        let base = SyncTotals {
            replicas: 3,
            frames_sent: 10,
            bytes_sent: 1000,
            busy_ns: 5,
            nats_cpu_ns: Some(7),
            ..SyncTotals::default()
        };
        let now = SyncTotals {
            frames_sent: 25,
            bytes_sent: 4000,
            events_sent: 9,
            busy_ns: 50,
            nats_cpu_ns: Some(10),
            ..base
        };
        let d = now.since(&base);
        assert_eq!(
            (
                d.replicas,
                d.frames_sent,
                d.bytes_sent,
                d.events_sent,
                d.busy_ns
            ),
            (3, 15, 3000, 9, 45)
        );
        assert_eq!(d.nats_cpu_ns, Some(3));
        let unknown = SyncTotals {
            nats_cpu_ns: None,
            ..now
        };
        assert_eq!(unknown.since(&base).nats_cpu_ns, None);
    }
}
