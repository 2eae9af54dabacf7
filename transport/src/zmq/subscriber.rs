//! One task per worker subscription: connect, verify, receive, fence, repair, decode, hand
//! to the hub.
//!
//! Fencing and the continuity rule are [`crate::stream::EventStream`]'s, as for QUIC and
//! HTTP; this task adds the connection, the replay and which keys a clear covers.
//!
//! # Connection
//! The SUB connection ([`super::zmtp`]) is made by this task: each attempt (TCP, greeting,
//! READY, subscription) is given [`CONNECT_ATTEMPT`], and a lost connection starts again at
//! once. The stream shows `connecting` in `/v1/workers` and `/ready` until the connection
//! to the publisher is up, and again from the moment it drops: a publisher that is not
//! listening (a worker given `tcp://127.0.0.1:P`, which connects out, instead of
//! `tcp://*:P`) keeps it `connecting`.
//!
//! # Hostile publishers
//! Nothing a publisher (or its replay socket) sends can make this task allocate more than
//! [`SubscriberConfig::limits`] allows or panic: a frame over the bound (checked from its
//! header, before its bytes are read), a malformed frame or greeting is counted
//! (`oversized`, `malformed_frame`, `unsupported_version`), logged, and its connection
//! closed; the subscription then reconnects as after any lost connection (invariant 5),
//! and a failed replay is handled as any failed replay (invariant 2).
//!
//! # Replay replies
//! Both shapes are read: SGLang's (and kvengine's publisher with [`super::ReplayShape::Sglang`])
//! `["", seq, payload]`, ended by `["", 0xff..ff, ""]`; vLLM's
//! `["", topic, seq, payload]`, ended by `["", "", 0xff..ff, ""]`. A bare `[seq, payload]`
//! is accepted too.
//!
//! # Invariants
//! 1. Batches are handed to the hub in seq order, each at most once: live copies of
//!    batches a replay already delivered, and retries of the last batch, are skipped.
//! 2. A gap is repaired from the worker's replay endpoint when it has one; when replay is
//!    missing, fails or cannot reach back far enough, every rank seen on this stream is
//!    cleared and marked resyncing, and the stream continues from the batch in hand.
//! 3. A live seq below the expected one (outside a replay's overlap, and not a retry) is a
//!    publisher restart: the ranks seen are cleared, then the batch applies.
//! 4. A batch that does not decode is counted and dropped, and still consumes its seq.
//! 5. From the moment the connection drops until the next connection proved continuity
//!    (the replay's first batch is the last one applied, same seq and bytes), the stream's
//!    ranks are distrusted: routed as uncached, shown resyncing, blocks kept. A broken
//!    continuity, or no replay socket, clears them (counted as a restart) before any batch
//!    of the new connection applies. A worker restored from a snapshot is verified the
//!    same way against its mark before its blocks count; a mark without digest, or no
//!    replay socket, clears and resyncs it.
//! 6. While any replay is being applied (catch-up after a verified reconnection, the
//!    history after a broken one, a gap's missed batches, a new subscription's first
//!    batches), the stream's ranks are distrusted as well: a replay's first batches are
//!    older than what the worker holds, so the index passes through states the worker has
//!    left. They are trusted again once the whole replay has been handed to the engine
//!    (what follows is ordinary ingest lag, as for any live batch; waiting for the cores
//!    from this core's thread stalled them); a ZMQ batch applying does not end the
//!    distrust by itself (the hub's invariant 7).
//! 7. Nothing here stops the subscription except the task being aborted.

use super::zmtp::{Connection, Incoming, Limits, SocketType, is_violation};
use super::{REPLAY_END, ZmqSource};
use crate::error::{DropReason, TransportError};
use crate::hub::{Feed, Hub, StreamState};
use crate::kv_events::{ConvertConfig, convert, decode_batch};
use crate::state::Resume;
use crate::stream::{
    Action, BatchId, ClearKind, Continuity, EventStream, OnConnect, clear_keys, skip_duplicate,
};
use bytes::Bytes;
use engine::{DpRank, WorkerKey};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;

/// Live batches a subscription handles before it lets the other tasks of its core thread
/// run (an event burst measured 64 ms route p99 against 2 ms quiet without it).
const YIELD_EVERY: u32 = 8;

/// How long one connection attempt (TCP, handshake, subscription) may take before a new
/// one starts (this bounds the delay to reach a publisher that came back).
pub const CONNECT_ATTEMPT: Duration = Duration::from_millis(800);

/// The pause after a connection attempt that failed before [`CONNECT_ATTEMPT`] ran out (a
/// refused connection, a refused handshake).
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Subscription settings.
#[derive(Clone, Copy, Debug)]
pub struct SubscriberConfig {
    /// Longest wait for each replay reply before giving up on the replay.
    pub replay_timeout: Duration,
    /// What the publisher and its replay socket may send: the largest message (64 MiB and
    /// 64 KiB by default: the largest batch the decoder takes, with its topic and seq) and
    /// the handshake's deadline.
    pub limits: Limits,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            // A starting vLLM answers late (its publisher thread waits for the GIL while
            // the engine warms up): 2 s timed out on a loaded 2-core machine.
            replay_timeout: Duration::from_secs(5),
            limits: Limits::default(),
        }
    }
}

/// Starts the subscription task for `source` on the current tokio runtime. The worker must
/// be registered with the hub first (events for unknown workers are dropped).
pub fn spawn_subscriber(
    hub: Arc<Hub>,
    source: ZmqSource,
    config: SubscriberConfig,
) -> JoinHandle<()> {
    spawn_subscriber_on(&tokio::runtime::Handle::current(), hub, source, config)
}

/// Like [`spawn_subscriber`], on the runtime `on` (with the edge on the cores: the runtime
/// of the worker's home core, so its batches are decoded and applied on one thread).
pub fn spawn_subscriber_on(
    on: &tokio::runtime::Handle,
    hub: Arc<Hub>,
    source: ZmqSource,
    config: SubscriberConfig,
) -> JoinHandle<()> {
    let can_replay = source.replay.is_some();
    // A worker restored from a snapshot resumes after the last batch the snapshot holds.
    let resume = hub.persisted().take_resume(source.worker);
    on.spawn(async move {
        let mut stream = Stream {
            convert: ConvertConfig {
                block_size: hub.block_size_of(source.worker),
            },
            feed: hub.feed(source.worker),
            hub,
            source,
            config,
            stream: EventStream::new(can_replay),
            ranks: BTreeSet::new(),
            replaying: false,
        };
        stream.restore(resume);
        stream.run().await;
    })
}

struct Stream {
    hub: Arc<Hub>,
    source: ZmqSource,
    config: SubscriberConfig,
    convert: ConvertConfig,
    /// The worker as of the registry's last change: block size and ranks, so a batch
    /// visits the registry once (its count).
    feed: Feed,
    stream: EventStream,
    /// Ranks this stream has carried (what a resync or restart clears).
    ranks: BTreeSet<DpRank>,
    /// A replay is being applied: the ranks stay distrusted (a clear in the middle of it
    /// too) until it is applied, and a rank first seen in it is distrusted.
    replaying: bool,
}

/// Requests for a reconnected publisher's replay (the continuity check, then a restarted
/// one's history) before its ranks are resynced instead.
const HISTORY_ATTEMPTS: usize = 3;

fn replay_io(context: &str, e: String) -> TransportError {
    TransportError::Io {
        context: context.to_owned(),
        source: std::io::Error::other(e),
    }
}

/// `[topic, seq, payload]` or `[seq, payload]`.
fn split_live(frames: &[Bytes]) -> Option<(u64, &Bytes)> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

/// `["", seq, payload]` (SGLang), `["", topic, seq, payload]` (vLLM: its end marker has an
/// empty topic) or `[seq, payload]`.
fn split_replay(frames: &[Bytes]) -> Option<(u64, &Bytes)> {
    let (seq, payload) = match frames {
        [empty, seq, payload] | [empty, _, seq, payload] if empty.is_empty() => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

impl Stream {
    /// Takes a snapshot's resume point: the ranks it restored, distrusted until the first
    /// connection verifies the mark; cleared and resynced at once when it cannot be
    /// verified (invariant 5).
    fn restore(&mut self, resume: Option<Resume>) {
        let Some(r) = resume else {
            return;
        };
        self.ranks = r.ranks.iter().copied().collect();
        match (r.last_digest, self.source.replay.is_some()) {
            (Some(digest), true) => {
                let last = BatchId {
                    seq: r.last_seq,
                    digest,
                };
                self.stream = EventStream::resume_from(true, last);
                self.distrust_ranks();
            }
            (digest, _) => {
                let why = match digest {
                    None => "its snapshot mark has no digest (an older snapshot)",
                    Some(_) => "it has no replay socket",
                };
                self.clear_ranks(
                    ClearKind::Resync,
                    &format_args!(
                        "restored from the snapshot up to seq {}, which cannot be verified: {why}",
                        r.last_seq
                    ),
                );
            }
        }
    }

    async fn run(&mut self) {
        let mut handled = 0u32;
        loop {
            self.hub
                .registry()
                .note_stream(self.source.worker, StreamState::Connecting);
            let mut socket = self.connect().await;
            tracing::info!(worker = %self.source.worker, endpoint = %self.source.publisher,
                "subscribed to KV events");
            self.hub
                .registry()
                .note_stream(self.source.worker, StreamState::Subscribed);
            self.on_connected().await;
            self.receive(&mut socket, &mut handled).await;
            self.hub
                .registry()
                .note_stream(self.source.worker, StreamState::Connecting);
            tracing::warn!(worker = %self.source.worker, endpoint = %self.source.publisher,
                "connection to the KV event publisher lost; reconnecting (its blocks are not \
                 routed on until the stream proves continuity)");
            self.distrust_ranks();
        }
    }

    /// A SUB connection to the publisher, subscribed; retries (a new connection every
    /// [`CONNECT_ATTEMPT`]) until the publisher accepts.
    async fn connect(&self) -> Connection {
        let mut attempts = 0u64;
        loop {
            let topic = Bytes::from(self.source.topic.clone().into_bytes());
            let endpoint = &self.source.publisher;
            let limits = self.config.limits;
            let attempt = tokio::time::timeout(CONNECT_ATTEMPT, async {
                let mut conn = Connection::connect(endpoint, SocketType::Sub, &limits).await?;
                // The publisher filters by this prefix (vLLM's `topic`; "" takes all), as a
                // ZMTP 3.0 subscription message.
                let mut subscribe = Vec::with_capacity(1 + topic.len());
                subscribe.push(1);
                subscribe.extend_from_slice(&topic);
                conn.send(&[Bytes::from(subscribe)]).await?;
                Ok::<_, TransportError>(conn)
            })
            .await;
            let failure = match attempt {
                Ok(Ok(conn)) => return conn,
                Ok(Err(e)) => {
                    self.refused(&e, "publisher");
                    Some(e.to_string())
                }
                Err(_) => None,
            };
            attempts += 1;
            // Once, then every minute or so (an attempt takes 0.2 to 0.8 s).
            if attempts == 1 || attempts.is_multiple_of(150) {
                let why = failure
                    .as_deref()
                    .unwrap_or("nothing accepts connections there");
                tracing::warn!(worker = %self.source.worker, endpoint = %self.source.publisher,
                    "cannot connect to the KV event publisher, retrying: {why} (is the \
                     worker's endpoint bound, tcp://*:PORT?)");
            }
            if failure.is_some() {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }

    /// Counts `e` if it is the peer's fault (a frame or greeting refused: the connection
    /// is closed by the caller).
    fn refused(&self, e: &TransportError, socket: &str) {
        if is_violation(e) {
            self.hub.metrics().drop_input(
                e.reason(),
                1,
                &format_args!(
                    "worker {}: its {socket} sent {e}; connection closed",
                    self.source.worker
                ),
            );
        }
    }

    /// Receives live batches until the connection drops (or the publisher breaks a bound:
    /// counted, and the connection closed).
    async fn receive(&mut self, socket: &mut Connection, handled: &mut u32) {
        let topic = self.source.topic.clone();
        loop {
            let frames = match socket.recv().await {
                Ok(Incoming::Message(frames)) => frames,
                // Subscriptions are a publisher's business.
                Ok(Incoming::Subscribe(_) | Incoming::Cancel(_)) => continue,
                Err(e) => {
                    self.refused(&e, "publisher");
                    tracing::warn!(worker = %self.source.worker, "receive failed: {e}");
                    return;
                }
            };
            // As a libzmq SUB: only the subscribed prefix (a publisher filters it already).
            if !frames
                .first()
                .is_some_and(|f| f.starts_with(topic.as_bytes()))
            {
                continue;
            }
            self.on_message(&frames).await;
            // A backlog of buffered batches never makes the socket wait, so this task would
            // keep the core thread from its HTTP connections until the backlog is gone: let
            // them run between batches now and then.
            *handled = handled.wrapping_add(1);
            if handled.is_multiple_of(YIELD_EVERY) {
                tokio::task::yield_now().await;
            }
        }
    }

    async fn on_message(&mut self, frames: &[Bytes]) {
        match split_live(frames) {
            Some((seq, payload)) => self.on_live(seq, payload).await,
            None => self.hub.metrics().drop_input(
                DropReason::MalformedMsgpack,
                1,
                &format_args!(
                    "worker {}: a message of {} frames is not [topic, seq, batch]",
                    self.source.worker,
                    frames.len()
                ),
            ),
        }
    }

    /// The connection is up (again): checks continuity before any live batch of it
    /// (invariant 5).
    async fn on_connected(&mut self) {
        match self.stream.connected() {
            // Nothing applied since the stream started afresh: nothing held to doubt.
            OnConnect::Nothing => self.trust_ranks(),
            OnConnect::Clear => self.clear_ranks(
                ClearKind::Restart,
                &"reconnected to a publisher without a replay socket: what it holds now \
                  cannot be verified",
            ),
            OnConnect::Verify(last) => self.verify(last).await,
        }
    }

    /// Asks the replay socket for the batches from `last` on: the same publisher process
    /// answers with `last` itself first; the rest is catch-up. Anything else clears the
    /// ranks and replays the publisher's history from 0.
    async fn verify(&mut self, last: BatchId) {
        self.distrust_ranks();
        self.replaying = true;
        self.verify_replay(last).await;
        self.replaying = false;
    }

    /// [`Stream::verify`]'s replay, with the ranks distrusted.
    async fn verify_replay(&mut self, last: BatchId) {
        let worker = self.source.worker;
        let Some(endpoint) = self.source.replay.clone() else {
            return;
        };
        let mut opened = self.replay_first(&endpoint, last.seq).await;
        for _ in 1..HISTORY_ATTEMPTS {
            let Err(e) = &opened else { break };
            // The same slow start as for the history (see `replay_history`): ask again
            // before giving up on the continuity (a resync drops everything the worker
            // holds from routing).
            tracing::info!(worker = %worker, from = last.seq, "replay failed ({e}); asking again");
            opened = self.replay_first(&endpoint, last.seq).await;
        }
        let (mut dealer, first) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                tracing::warn!(worker = %worker, from = last.seq, "replay failed: {e}");
                self.stream.start_afresh();
                self.clear_ranks(
                    ClearKind::Resync,
                    &format_args!("continuity after seq {} cannot be verified", last.seq),
                );
                return;
            }
        };
        let first_id = first.as_ref().map(|(seq, p)| BatchId::of(*seq, p));
        match self.stream.verified(first_id) {
            Continuity::Same => {
                if let Some((seq, payload)) = first {
                    self.apply_replayed(seq, &payload);
                }
                let rest = self.replay_rest(&mut dealer).await;
                // What was applied continues the verified batch; a replay cut short leaves
                // a gap the next live batch reveals (and repairs).
                self.trust_ranks();
                match rest {
                    Ok(()) => {
                        self.stream.caught_up(last.seq);
                        tracing::info!(worker = %worker, seq = last.seq,
                            "the publisher still has the last batch applied: continuity \
                             verified, caught up");
                    }
                    Err(e) => tracing::warn!(worker = %worker, "catch-up replay failed: {e}"),
                }
            }
            Continuity::Broken => {
                let found = match first_id {
                    Some(b) if b.seq == last.seq => format!("seq {} with other bytes", b.seq),
                    Some(b) => format!("seq {} first", b.seq),
                    None => "no batch that far".to_owned(),
                };
                self.clear_ranks(
                    ClearKind::Restart,
                    &format_args!(
                        "its replay of seq {} gave {found} (restarted, or its buffer moved on)",
                        last.seq
                    ),
                );
                drop(dealer);
                // The history replays the publisher's past: routed as uncached until all of
                // it is applied (`replaying` keeps the cleared ranks distrusted).
                self.replay_history(&endpoint).await;
                self.trust_ranks();
            }
        }
    }

    /// After a broken continuity (ranks cleared): the publisher's history from 0. All of it
    /// from 0 is exact; a history that starts later resyncs the ranks.
    async fn replay_history(&mut self, endpoint: &str) {
        let worker = self.source.worker;
        let mut result = self.history_attempt(endpoint).await;
        for _ in 1..HISTORY_ATTEMPTS {
            let Err(e) = &result else { break };
            // A publisher that just started may be slow to answer (vLLM's publisher thread
            // shares the GIL with the engine warming up). Asking again is safe: the fence
            // skips what an attempt applied, and the ranks stay distrusted meanwhile.
            tracing::info!(worker = %worker, "history replay failed ({e}); asking again");
            result = self.history_attempt(endpoint).await;
        }
        match result {
            Ok(()) => {
                self.stream.caught_up(0);
                tracing::info!(worker = %worker, "replayed the publisher's history");
            }
            Err(e) => {
                tracing::warn!(worker = %worker, "history replay failed: {e}");
                self.stream.start_afresh();
                self.clear_ranks(
                    ClearKind::Resync,
                    &"the publisher's history could not be replayed",
                );
            }
        }
    }

    /// One replay of the publisher's history from 0, applied through the fence.
    async fn history_attempt(&mut self, endpoint: &str) -> Result<(), TransportError> {
        match self.replay_first(endpoint, 0).await {
            Ok((mut dealer, first)) => {
                if let Some(kind) = self.stream.history_from(first.as_ref().map(|f| f.0)) {
                    self.clear_ranks(
                        kind,
                        &format_args!(
                            "the publisher's history starts at seq {}",
                            first.as_ref().map_or(0, |f| f.0)
                        ),
                    );
                }
                match first {
                    Some((seq, payload)) => {
                        self.apply_replayed(seq, &payload);
                        self.replay_rest(&mut dealer).await
                    }
                    // The end marker came first: the publisher has published nothing yet,
                    // and the replay is over (waiting for a second marker timed out).
                    None => Ok(()),
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn on_live(&mut self, seq: u64, payload: &Bytes) {
        let batch = BatchId::of(seq, payload);
        let mut action = self.stream.live(batch);
        let mut replayed = false;
        if let Action::Replay { from, restarted } = action {
            if restarted {
                self.clear_ranks(ClearKind::Restart, &format_args!("seq {seq}"));
            }
            replayed = true;
            // While the missed batches are applied the index is behind the worker: its
            // ranks are routed as uncached until the replay is applied.
            self.replaying = true;
            self.distrust_ranks();
            let delivered = match self.source.replay.clone() {
                Some(endpoint) => match self.replay(&endpoint, from).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(worker = %self.source.worker, from, "replay failed: {e}");
                        false
                    }
                },
                None => false,
            };
            self.replaying = false;
            if let Some(kind) = self.stream.replay_ended(from, seq, delivered) {
                self.clear_ranks(kind, &format_args!("batches {from}..{seq} not replayed"));
            }
            self.trust_ranks();
            action = self.stream.live(batch);
        }
        match action {
            Action::Apply => {}
            // The replay just delivered this very batch: nothing to count.
            Action::Skip if replayed => return,
            Action::Skip => {
                let why = format_args!("worker {}: seq {seq} already applied", self.source.worker);
                skip_duplicate(&self.hub, 1, &why);
                return;
            }
            Action::ClearThenApply(kind) => self.clear_ranks(kind, &format_args!("seq {seq}")),
            // After a replay the stream is caught up or starts afresh: never a second one.
            Action::Replay { from, .. } => {
                self.clear_ranks(ClearKind::Resync, &format_args!("batches {from}..{seq}"));
            }
        }
        if self.process(batch, payload).is_err() {
            self.recover(seq).await;
        }
    }

    /// A live batch that could not be decoded: its events are unknown, so the index may now
    /// be stale. Its copy in the publisher's replay buffer is asked for (the live copy may
    /// be what was damaged) and applied if it decodes; otherwise the stream's ranks are
    /// cleared and resynced. Never a silent skip.
    async fn recover(&mut self, seq: u64) {
        let copy = match self.source.replay.clone() {
            Some(endpoint) => match self.fetch_one(&endpoint, seq).await {
                Ok(copy) => copy,
                Err(e) => {
                    tracing::warn!(worker = %self.source.worker, seq, "replay failed: {e}");
                    None
                }
            },
            None => None,
        };
        if let Some(payload) = copy
            && self.process(BatchId::of(seq, &payload), &payload).is_ok()
        {
            self.hub.metrics().replayed_batches.fetch_add(1, Relaxed);
            tracing::info!(worker = %self.source.worker, seq,
                "an undecodable batch was read again from the replay buffer");
            return;
        }
        self.clear_ranks(
            ClearKind::Resync,
            &format_args!("seq {seq} could not be decoded, nor replayed"),
        );
    }

    /// Batch `seq` from the replay socket at `endpoint`, if its buffer still holds it.
    async fn fetch_one(&self, endpoint: &str, seq: u64) -> Result<Option<Bytes>, TransportError> {
        let mut dealer = self.open_replay(endpoint, seq).await?;
        loop {
            let (got, payload) = self.next_replayed(&mut dealer).await?;
            if got == seq {
                return Ok(Some(payload));
            }
            if got == REPLAY_END || got > seq {
                return Ok(None);
            }
        }
    }

    /// A replay connection asked for every batch from `from` on.
    async fn open_replay(&self, endpoint: &str, from: u64) -> Result<Connection, TransportError> {
        let timeout = self.config.replay_timeout;
        let limits = self.config.limits;
        let opened = tokio::time::timeout(timeout, async {
            let mut dealer = Connection::connect(endpoint, SocketType::Dealer, &limits).await?;
            dealer
                .send(&[Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
                .await?;
            Ok::<_, TransportError>(dealer)
        })
        .await
        .map_err(|_| replay_io("replay connect", "timed out".into()))?;
        opened.inspect_err(|e| self.refused(e, "replay socket"))
    }

    /// A replay from `from` and its first batch (`None`: the replay ended at once).
    async fn replay_first(
        &self,
        endpoint: &str,
        from: u64,
    ) -> Result<(Connection, Option<(u64, Bytes)>), TransportError> {
        let mut dealer = self.open_replay(endpoint, from).await?;
        let (seq, payload) = self.next_replayed(&mut dealer).await?;
        let first = (seq != REPLAY_END).then_some((seq, payload));
        Ok((dealer, first))
    }

    /// The next `(seq, payload)` a replay connection sends ([`REPLAY_END`] ends it). On an
    /// error the caller drops the connection.
    async fn next_replayed(&self, dealer: &mut Connection) -> Result<(u64, Bytes), TransportError> {
        let reply = loop {
            let received = tokio::time::timeout(self.config.replay_timeout, dealer.recv())
                .await
                .map_err(|_| replay_io("replay", "timed out".into()))?;
            match received {
                Ok(Incoming::Message(frames)) => break frames,
                Ok(_) => continue,
                Err(e) => {
                    self.refused(&e, "replay socket");
                    return Err(e);
                }
            }
        };
        match split_replay(&reply) {
            Some((seq, payload)) => Ok((seq, payload.clone())),
            None => Err(TransportError::MalformedMsgpack(format!(
                "replay reply of {} frames",
                reply.len()
            ))),
        }
    }

    async fn replay(&mut self, endpoint: &str, from: u64) -> Result<(), TransportError> {
        let mut dealer = self.open_replay(endpoint, from).await?;
        tracing::info!(worker = %self.source.worker, from, "replaying missed batches");
        self.replay_rest(&mut dealer).await
    }

    /// Applies what `dealer` replays until its end.
    async fn replay_rest(&mut self, dealer: &mut Connection) -> Result<(), TransportError> {
        loop {
            let (seq, payload) = self.next_replayed(dealer).await?;
            if seq == REPLAY_END {
                return Ok(());
            }
            self.apply_replayed(seq, &payload);
        }
    }

    /// Fences and applies one replayed batch.
    fn apply_replayed(&mut self, seq: u64, payload: &Bytes) {
        let batch = BatchId::of(seq, payload);
        match self.stream.replayed(batch) {
            Action::Skip => return,
            Action::Apply | Action::Replay { .. } => {}
            Action::ClearThenApply(kind) => {
                // The worker's buffer no longer reaches back far enough.
                self.clear_ranks(kind, &format_args!("replay starts at {seq}"));
            }
        }
        self.hub.metrics().replayed_batches.fetch_add(1, Relaxed);
        if self.process(batch, payload).is_err() {
            // Unreadable in the buffer too: what it changed is unknown.
            self.clear_ranks(
                ClearKind::Resync,
                &format_args!("replayed seq {seq} could not be decoded"),
            );
        }
    }

    /// Routes this stream's ranks as uncached, blocks kept, until verified.
    fn distrust_ranks(&self) {
        let worker = self.source.worker;
        for &dp_rank in &self.ranks {
            self.hub.distrust(WorkerKey { worker, dp_rank });
        }
    }

    /// This stream's ranks proved continuity.
    fn trust_ranks(&self) {
        let worker = self.source.worker;
        for &dp_rank in &self.ranks {
            self.hub.trust(WorkerKey { worker, dp_rank });
        }
    }

    /// Clears every rank this stream carried.
    fn clear_ranks(&mut self, kind: ClearKind, why: &dyn std::fmt::Display) {
        let worker = self.source.worker;
        let keys = self
            .ranks
            .iter()
            .map(|&dp_rank| WorkerKey { worker, dp_rank });
        // A failed clear is logged by `clear_keys`; the stream goes on (the worker is then
        // marked resyncing or its engine is gone).
        let _ = clear_keys(
            &self.hub,
            keys,
            kind,
            &format_args!("worker {worker}: {why}"),
        );
        if self.replaying {
            // What the rest of the replay applies is the past until it ends.
            self.distrust_ranks();
        }
    }

    /// Decodes and applies one batch; `Err` (counted and logged) if it does not decode.
    fn process(&mut self, batch_id: BatchId, payload: &[u8]) -> Result<(), ()> {
        let (seq, worker) = (batch_id.seq, self.source.worker);
        let metrics = self.hub.metrics();
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                metrics.drop_input(
                    e.reason(),
                    1,
                    &format_args!("worker {worker}: seq {seq}: {e}"),
                );
                return Err(());
            }
        };
        if let Some(ts) = batch.ts
            && let Ok(now) = SystemTime::now().duration_since(UNIX_EPOCH)
        {
            let lag = now.as_secs_f64() - ts;
            if lag.is_finite() && lag >= 0.0 {
                metrics.ingest_lag.observe(lag);
            }
        }
        // The worker's model (so its block size) can change with a re-registration.
        self.hub.refresh_feed(&mut self.feed);
        self.convert.block_size = self.feed.block_size();
        let converted = convert(batch, &self.convert);
        for &(reason, n) in &converted.drops {
            metrics.drop_input(
                reason,
                n,
                &format_args!("worker {worker}: seq {seq}: {} event(s) dropped", n),
            );
        }
        if let Some(got) = converted.block_size_mismatch {
            let message = format!(
                "worker publishes blocks of {got} tokens; this router uses {} \
                 (set --kv-cache-block-size to match)",
                self.convert.block_size
            );
            if self
                .hub
                .registry()
                .note_config_error(worker, message.clone())
            {
                tracing::error!(worker = %worker, "{message}");
            }
        }
        let key = WorkerKey {
            worker,
            dp_rank: converted.dp_rank,
        };
        if self.ranks.insert(converted.dp_rank) && self.replaying {
            // A rank first seen in a replay is as far behind as the others.
            self.hub.distrust(key);
        }
        let n = converted.events.len() as u64;
        if let Err(e) = self.hub.ingest_fed(
            &mut self.feed,
            converted.dp_rank,
            converted.events,
            seq,
            Some(batch_id.digest),
        ) {
            metrics.drop_input(e.reason(), n, &format_args!("worker {worker}: {e}"));
        }
        Ok(())
    }
}
