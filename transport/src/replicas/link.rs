//! The task that talks to NATS for one replica: publishes the hub's load events and
//! heartbeats, applies peers' frames, answers and asks for states, expires dead peers, and
//! falls back to local-only load while NATS is unreachable (see [`super`], "Failure").
//!
//! With a secret ([`super::auth`]) every frame and resync request published is sealed, and
//! every one received is opened before it is decoded: one without a valid MAC is dropped,
//! counted and logged, and nothing in it is used (not even to note a peer).
//!
//! # Concurrency
//! One tokio task owns the client and the loop below; the peers table sits behind a mutex
//! only so `/v1/replicas` can list it. Peers' events are applied under the hub's routing
//! lock, one frame per lock.

use super::apply::{apply_events, apply_sessions, forget_replica, state_events};
use super::auth::{self, Kind, ReplicaKey};
use super::outbox::{Inbox, Outbox, Shared};
use super::peers::{Heard, PeerInfo, Peers};
use super::wire::{
    self, Body, Frame, LoadEvent, MAX_FRAME_BYTES, MAX_SESSIONS_PER_FRAME, Resync,
    SESSION_WIRE_VERSION, SessionAssign, SessionFrame, WIRE_VERSION,
};
use super::{ReplicaConfig, ReplicaStats, new_replica_id};
use crate::error::{DropReason, Result, TransportError};
use crate::hub::Hub;
use async_nats::{Client, Event, Subscriber};
use engine::ReplicaId;
use futures_util::StreamExt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// A state is sent this long after the first ask, so asks from several peers coalesce.
const STATE_DELAY: Duration = Duration::from_millis(20);

/// A running replica link.
#[derive(Debug)]
pub struct ReplicaLink {
    id: ReplicaId,
    shared: Arc<Shared>,
    peers: Arc<Mutex<Peers>>,
    client: Client,
    secret: Option<super::ReplicaSecret>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl ReplicaLink {
    /// This replica's id.
    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// The counters.
    pub fn stats(&self) -> &ReplicaStats {
        &self.shared.stats
    }

    /// The peers heard within the timeout.
    pub fn peers(&self) -> Vec<PeerInfo> {
        lock(&self.peers).list(Instant::now())
    }

    /// The NATS client (the warm-start snapshots use it too).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Puts a snapshot of `hub` (sharded under `policy`) in `bucket` every `interval`, for
    /// replicas that start ([`super::warm`]), sealed if the replicas share a secret; abort
    /// the task to stop.
    pub fn put_snapshots_every(
        &self,
        hub: Arc<Hub>,
        bucket: String,
        policy: String,
        interval: Duration,
    ) -> JoinHandle<()> {
        let key = super::warm::snapshot_key(self.secret.as_ref(), &bucket);
        tokio::spawn(super::warm::put_every(
            hub,
            self.client.clone(),
            bucket,
            policy,
            interval,
            self.shared.clone(),
            key,
        ))
    }

    /// Stops the task (peers then find this replica dead after their timeout).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn nats_err(what: &'static str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Invalid {
        name: "--replica-nats",
        reason: format!("{what}: {e}"),
    }
}

/// Connects to NATS (in the background: an unreachable server is an outage, not an error)
/// and starts sharing `hub`'s load with the replicas on `config.subject`.
pub async fn start(hub: Arc<Hub>, config: ReplicaConfig) -> Result<ReplicaLink> {
    let id = new_replica_id();
    let shared = Arc::new(Shared::default());
    let (outbox, inbox) = Outbox::new(shared.clone());
    if !hub.routing().set_replicas(Arc::new(outbox)) {
        return Err(nats_err(
            "replica sync",
            "this router already has a replica link",
        ));
    }
    let (events_tx, events_rx) = mpsc::channel(64);
    let servers = config.nats.servers()?;
    let client = config
        .nats
        .options()?
        .name(format!("kvengine {}", config.name))
        .retry_on_initial_connect()
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((100 * attempts as u64).clamp(100, 1000))
        })
        .event_callback(move |event| {
            let tx = events_tx.clone();
            async move {
                let _ = tx.send(event).await;
            }
        })
        .connect(servers)
        .await
        .map_err(|e| nats_err("cannot use the NATS address", e))?;
    let load = client
        .subscribe(config.load_subject())
        .await
        .map_err(|e| nats_err("cannot subscribe", e))?;
    let resync = client
        .subscribe(config.resync_subject())
        .await
        .map_err(|e| nats_err("cannot subscribe", e))?;
    let sessions = client
        .subscribe(config.sessions_subject())
        .await
        .map_err(|e| nats_err("cannot subscribe", e))?;
    let peers = Arc::new(Mutex::new(Peers::new(config.peer_timeout)));
    let (stop, stop_rx) = watch::channel(false);
    tracing::info!(replica = %id, name = %config.name, url = %config.nats.redacted(),
        authenticated = config.secret.is_some(), "replica sync starting");
    let keys = config.secret.as_ref().map(|s| {
        (
            s.key(Kind::Frame, &config.subject),
            s.key(Kind::Resync, &config.subject),
        )
    });
    let session_key = config
        .secret
        .as_ref()
        .map(|s| s.key(Kind::Sessions, &config.subject));
    let secret = config.secret.clone();
    let link = Link {
        hub,
        keys,
        session_key,
        sessions_subject: config.sessions_subject(),
        load_subject: config.load_subject(),
        resync_subject: config.resync_subject(),
        config,
        id,
        client: client.clone(),
        shared: shared.clone(),
        peers: peers.clone(),
        seq: 0,
        connected: false,
        state_due: None,
    };
    let subs = Subscriptions {
        load,
        resync,
        sessions,
    };
    let task = tokio::spawn(link.run(inbox, events_rx, subs, stop_rx));
    Ok(ReplicaLink {
        id,
        shared,
        peers,
        client,
        secret,
        stop,
        task,
    })
}

/// CPU time of the calling thread, in nanoseconds: what the link's work costs, without the
/// time it waited for a CPU or a lock (wall time overstated it several times over on a busy
/// machine). 0 where the clock is not available.
#[cfg(target_os = "linux")]
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration, and
    // CLOCK_THREAD_CPUTIME_ID is a clock every Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_ns() -> u64 {
    0
}

/// What the link listens to on NATS.
struct Subscriptions {
    load: Subscriber,
    resync: Subscriber,
    sessions: Subscriber,
}

struct Link {
    hub: Arc<Hub>,
    /// The keys of load frames and resync requests (`None`: no `--replica-secret`).
    keys: Option<(ReplicaKey, ReplicaKey)>,
    /// The key of session frames.
    session_key: Option<ReplicaKey>,
    sessions_subject: String,
    config: ReplicaConfig,
    load_subject: String,
    resync_subject: String,
    id: ReplicaId,
    client: Client,
    shared: Arc<Shared>,
    peers: Arc<Mutex<Peers>>,
    /// The last event frame's number (invariant 2 of [`wire`]).
    seq: u64,
    connected: bool,
    state_due: Option<tokio::time::Instant>,
}

impl Link {
    async fn run(
        mut self,
        inbox: Inbox,
        mut events: mpsc::Receiver<Event>,
        subs: Subscriptions,
        mut stop: watch::Receiver<bool>,
    ) {
        let Inbox {
            events: mut rx,
            sessions: mut srx,
        } = inbox;
        let Subscriptions {
            mut load,
            mut resync,
            mut sessions,
        } = subs;
        let mut tick = tokio::time::interval(self.config.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let state_at = self.state_due;
            tokio::select! {
                _ = stop.changed() => break,
                Some(event) = events.recv() => self.on_connection(event).await,
                Some(first) = rx.recv() => self.publish_events(first, &mut rx).await,
                Some(msg) = load.next() => self.on_frame(&msg.payload).await,
                Some(msg) = resync.next() => self.on_resync(&msg.payload),
                Some(first) = srx.recv() => self.publish_sessions(first, &mut srx).await,
                Some(msg) = sessions.next() => self.on_sessions(&msg.payload),
                _ = async { tokio::time::sleep_until(state_at.unwrap_or_else(tokio::time::Instant::now)).await }, if state_at.is_some() => {
                    self.send_state(&mut rx).await;
                }
                _ = tick.tick() => self.on_tick(&mut rx).await,
            }
        }
        tracing::info!(replica = %self.id, "replica sync stopped");
    }

    fn stats(&self) -> &ReplicaStats {
        &self.shared.stats
    }

    async fn on_connection(&mut self, event: Event) {
        match event {
            Event::Connected => {
                self.connected = true;
                self.stats().connected.store(true, Relaxed);
                tracing::info!(replica = %self.id, "replica sync connected to NATS");
                // Peers may have missed this replica's events meanwhile, and it theirs.
                self.state_due = Some(tokio::time::Instant::now());
                let ask = Resync {
                    version: WIRE_VERSION,
                    from: self.id.0,
                    target: 0,
                };
                self.publish_resync(&ask).await;
            }
            Event::Disconnected => {
                self.connected = false;
                self.stats().connected.store(false, Relaxed);
                self.stats().outages.fetch_add(1, Relaxed);
                let gone = lock(&self.peers).clear();
                let freed: usize = self
                    .hub
                    .routing()
                    .with_lock(|routing| gone.iter().map(|&r| forget_replica(routing, r)).sum());
                self.stats().peers.store(0, Relaxed);
                tracing::warn!(
                    replica = %self.id,
                    peers = gone.len(),
                    freed,
                    "replica sync lost NATS: routing on this replica's own load until it is back"
                );
            }
            Event::SlowConsumer(_) => {
                // The server dropped messages to us: every peer's view may have holes.
                tracing::warn!(replica = %self.id, "NATS says this replica is a slow consumer");
                self.stats().gaps.fetch_add(1, Relaxed);
                self.ask(0).await;
            }
            other => tracing::debug!(replica = %self.id, "NATS: {other}"),
        }
    }

    /// Publishes `first` and every event already queued behind it, in frames.
    async fn publish_events(&mut self, first: LoadEvent, rx: &mut mpsc::Receiver<LoadEvent>) {
        let mut batch = vec![first];
        let mut weight = batch.iter().map(LoadEvent::weight).sum::<usize>();
        while weight < MAX_FRAME_BYTES {
            match rx.try_recv() {
                Ok(e) => {
                    weight += e.weight();
                    batch.push(e);
                }
                Err(_) => break,
            }
        }
        self.publish_batch(batch).await;
    }

    async fn publish_batch(&mut self, batch: Vec<LoadEvent>) {
        let n = batch.len() as u64;
        self.seq += 1;
        let frame = Frame {
            version: WIRE_VERSION,
            replica: self.id.0,
            seq: self.seq,
            body: Body::Events(batch),
        };
        if self.publish_frame(&frame).await {
            self.stats().events_sent.fetch_add(n, Relaxed);
        } else {
            self.stats().events_dropped.fetch_add(n, Relaxed);
            self.shared.need_state.store(true, Relaxed);
        }
    }

    /// Publishes `frame`; false if it could not be (NATS down: peers find the gap).
    async fn publish_frame(&mut self, frame: &Frame) -> bool {
        if !self.connected {
            return false;
        }
        let began = thread_cpu_ns();
        let bytes = match wire::encode_frame(frame) {
            Ok(b) => auth::seal(self.keys.as_ref().map(|k| &k.0), b),
            Err(e) => {
                tracing::warn!("cannot encode a replica frame: {e}");
                return false;
            }
        };
        self.busy(began);
        let len = bytes.len() as u64;
        match self.client.publish(self.load_subject.clone(), bytes).await {
            Ok(()) => {
                self.stats().frames_sent.fetch_add(1, Relaxed);
                self.stats().bytes_sent.fetch_add(len, Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!("cannot publish a replica frame: {e}");
                false
            }
        }
    }

    async fn publish_resync(&mut self, ask: &Resync) {
        if !self.connected {
            return;
        }
        if let Ok(bytes) = wire::encode_resync(ask) {
            let bytes = auth::seal(self.keys.as_ref().map(|k| &k.1), bytes);
            let len = bytes.len() as u64;
            if self
                .client
                .publish(self.resync_subject.clone(), bytes)
                .await
                .is_ok()
            {
                self.stats().frames_sent.fetch_add(1, Relaxed);
                self.stats().bytes_sent.fetch_add(len, Relaxed);
            }
        }
    }

    /// Asks `target` (0: everyone) for its state.
    async fn ask(&mut self, target: u64) {
        let ask = Resync {
            version: WIRE_VERSION,
            from: self.id.0,
            target,
        };
        self.publish_resync(&ask).await;
    }

    /// Adds the CPU this thread spent since `since` (a [`thread_cpu_ns`] reading).
    fn busy(&self, since: u64) {
        let ns = thread_cpu_ns().saturating_sub(since);
        self.stats().busy_ns.fetch_add(ns, Relaxed);
    }

    /// Counts and logs a message refused for its MAC.
    #[cold]
    fn unauthenticated(&self, e: &TransportError) {
        self.stats().unauthenticated.fetch_add(1, Relaxed);
        self.hub
            .metrics()
            .drop_input(DropReason::Unauthorized, 1, e);
    }

    async fn on_frame(&mut self, message: &[u8]) {
        let began = thread_cpu_ns();
        let payload = match auth::open(self.keys.as_ref().map(|k| &k.0), message) {
            Ok(p) => p,
            Err(e) => {
                self.unauthenticated(&e);
                return;
            }
        };
        let frame = match wire::decode_frame(payload) {
            Ok(f) => f,
            Err(e) => {
                self.stats().malformed.fetch_add(1, Relaxed);
                tracing::warn!(
                    "dropped a replica frame that could not be decoded: {e}{}",
                    self.unsigned_hint()
                );
                return;
            }
        };
        let peer = ReplicaId(frame.replica);
        // Our own, echoed; or heard from the buffer after the link dropped, when peers'
        // load is not trusted (their states come again when it is back).
        if peer == self.id || !self.connected {
            return;
        }
        self.stats().frames_received.fetch_add(1, Relaxed);
        self.stats()
            .bytes_received
            .fetch_add(message.len() as u64, Relaxed);
        let now = Instant::now();
        let heard = match &frame.body {
            Body::Heartbeat { name, active } => {
                lock(&self.peers).heard_heartbeat(now, peer, frame.seq, name, *active)
            }
            Body::Events(events) => {
                let resets = matches!(events.first(), Some(LoadEvent::Reset));
                let heard = lock(&self.peers).heard_events(now, peer, frame.seq, resets);
                if heard != Heard::Old {
                    let stats = &self.shared.stats;
                    self.hub
                        .routing()
                        .with_lock(|routing| apply_events(routing, peer, events, now, stats));
                }
                heard
            }
        };
        self.stats()
            .peers
            .store(lock(&self.peers).len() as u64, Relaxed);
        self.busy(began);
        if let Heard::Incomplete { missed } = heard {
            if missed > 0 {
                self.stats().gaps.fetch_add(1, Relaxed);
                tracing::warn!(replica = %peer, missed, "frames from a peer replica were lost; asking for its state");
            }
            if lock(&self.peers).should_ask(now, peer) {
                self.ask(peer.0).await;
            }
        }
    }

    /// Publishes `first` and the session assignments queued behind it, in one frame (best
    /// effort: with NATS down they are dropped, counted).
    async fn publish_sessions(
        &mut self,
        first: SessionAssign,
        rx: &mut mpsc::Receiver<SessionAssign>,
    ) {
        let mut sessions = vec![first];
        while sessions.len() < MAX_SESSIONS_PER_FRAME {
            match rx.try_recv() {
                Ok(a) => sessions.push(a),
                Err(_) => break,
            }
        }
        let n = sessions.len() as u64;
        if !self.connected {
            self.stats().sessions_dropped.fetch_add(n, Relaxed);
            return;
        }
        let frame = SessionFrame {
            version: SESSION_WIRE_VERSION,
            replica: self.id.0,
            sessions,
        };
        let began = thread_cpu_ns();
        let bytes = match wire::encode_sessions(&frame) {
            Ok(b) => auth::seal(self.session_key.as_ref(), b),
            Err(e) => {
                tracing::warn!("cannot encode a session frame: {e}");
                self.stats().sessions_dropped.fetch_add(n, Relaxed);
                return;
            }
        };
        self.busy(began);
        let len = bytes.len() as u64;
        match self
            .client
            .publish(self.sessions_subject.clone(), bytes)
            .await
        {
            Ok(()) => {
                self.stats().frames_sent.fetch_add(1, Relaxed);
                self.stats().bytes_sent.fetch_add(len, Relaxed);
                self.stats().sessions_sent.fetch_add(n, Relaxed);
            }
            Err(e) => {
                tracing::warn!("cannot publish a session frame: {e}");
                self.stats().sessions_dropped.fetch_add(n, Relaxed);
            }
        }
    }

    /// Applies a peer's session assignments (its own, echoed, and any heard while the link
    /// is down are skipped).
    fn on_sessions(&mut self, message: &[u8]) {
        let began = thread_cpu_ns();
        let payload = match auth::open(self.session_key.as_ref(), message) {
            Ok(p) => p,
            Err(e) => {
                self.unauthenticated(&e);
                return;
            }
        };
        let frame = match wire::decode_sessions(payload) {
            Ok(f) => f,
            Err(e) => {
                self.stats().malformed.fetch_add(1, Relaxed);
                tracing::warn!("dropped a session frame that could not be decoded: {e}");
                return;
            }
        };
        if frame.replica == self.id.0 || !self.connected {
            return;
        }
        self.stats().frames_received.fetch_add(1, Relaxed);
        self.stats()
            .bytes_received
            .fetch_add(message.len() as u64, Relaxed);
        let stats = &self.shared.stats;
        let now = Instant::now();
        self.hub
            .routing()
            .with_lock(|routing| apply_sessions(routing, &frame.sessions, now, stats));
        self.busy(began);
    }

    /// Why a frame may not decode here: peers that sign with a secret this replica lacks.
    fn unsigned_hint(&self) -> &'static str {
        if self.keys.is_none() {
            " (peers started with --replica-secret send signed frames: give this replica the \
             same secret)"
        } else {
            ""
        }
    }

    fn on_resync(&mut self, message: &[u8]) {
        let payload = match auth::open(self.keys.as_ref().map(|k| &k.1), message) {
            Ok(p) => p,
            Err(e) => {
                self.unauthenticated(&e);
                return;
            }
        };
        match wire::decode_resync(payload) {
            Ok(r) if r.from != self.id.0 && (r.target == 0 || r.target == self.id.0) => {
                if self.state_due.is_none() {
                    self.state_due = Some(tokio::time::Instant::now() + STATE_DELAY);
                }
            }
            Ok(_) => {}
            Err(e) => {
                self.stats().malformed.fetch_add(1, Relaxed);
                tracing::warn!("dropped a resync request that could not be decoded: {e}");
            }
        }
    }

    /// Sends this replica's whole state, after every event queued before it.
    async fn send_state(&mut self, rx: &mut mpsc::Receiver<LoadEvent>) {
        self.state_due = None;
        if !self.connected {
            self.shared.need_state.store(true, Relaxed);
            return;
        }
        while let Ok(first) = rx.try_recv() {
            self.publish_events(first, rx).await;
        }
        self.shared.need_state.store(false, Relaxed);
        let began = thread_cpu_ns();
        let events = self
            .hub
            .routing()
            .with_lock(|routing| state_events(routing));
        self.busy(began);
        let mut batch = Vec::new();
        let mut weight = 0;
        for e in events {
            weight += e.weight();
            batch.push(e);
            if weight >= MAX_FRAME_BYTES / 2 {
                self.publish_batch(std::mem::take(&mut batch)).await;
                weight = 0;
            }
        }
        if !batch.is_empty() {
            self.publish_batch(batch).await;
        }
        self.stats().states_sent.fetch_add(1, Relaxed);
    }

    async fn on_tick(&mut self, rx: &mut mpsc::Receiver<LoadEvent>) {
        let now = Instant::now();
        let dead = lock(&self.peers).expire(now);
        if !dead.is_empty() {
            let freed: usize = self
                .hub
                .routing()
                .with_lock(|routing| dead.iter().map(|&r| forget_replica(routing, r)).sum());
            self.stats()
                .peers_expired
                .fetch_add(dead.len() as u64, Relaxed);
            for r in &dead {
                tracing::warn!(replica = %r, freed, "a peer replica went silent; its load is dropped");
            }
        }
        self.stats()
            .peers
            .store(lock(&self.peers).len() as u64, Relaxed);
        if self.shared.need_state.load(Relaxed) && self.state_due.is_none() {
            self.send_state(rx).await;
        }
        let active = self.hub.routing().with_lock(|r| r.routed_requests()) as u64;
        let beat = Frame {
            version: WIRE_VERSION,
            replica: self.id.0,
            seq: self.seq,
            body: Body::Heartbeat {
                name: self.config.name.clone(),
                active,
            },
        };
        self.publish_frame(&beat).await;
    }
}
