//! One task per worker subscription: receive, fence, repair, decode, hand to the hub.
//!
//! Fencing is [`crate::stream::EventStream`]'s, as for QUIC and HTTP; this task adds the
//! replay and which keys a clear covers.
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
//! 5. Nothing here stops the subscription except the task being aborted; the ZMQ socket
//!    reconnects by itself.

use super::{REPLAY_END, ZmqSource};
use crate::error::{DropReason, TransportError};
use crate::hub::{Hub, StreamState};
use crate::kv_events::{ConvertConfig, convert, decode_batch};
use crate::stream::{Action, BatchId, ClearKind, EventStream, clear_keys, skip_duplicate};
use bytes::Bytes;
use engine::{DpRank, WorkerKey};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Live batches a subscription handles before it lets the other tasks of its core thread
/// run (an event burst measured 64 ms route p99 against 2 ms quiet without it).
const YIELD_EVERY: u32 = 8;

/// Subscription settings.
#[derive(Clone, Copy, Debug)]
pub struct SubscriberConfig {
    /// Longest wait for each replay reply before giving up on the replay.
    pub replay_timeout: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            replay_timeout: Duration::from_secs(2),
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
        let (events, ranks) = match &resume {
            Some(r) => (
                EventStream::resume(can_replay, r.last_seq),
                r.ranks.iter().copied().collect(),
            ),
            None => (EventStream::new(can_replay), BTreeSet::new()),
        };
        let mut stream = Stream {
            convert: ConvertConfig {
                block_size: hub.block_size_of(source.worker),
            },
            hub,
            source,
            config,
            stream: events,
            ranks,
        };
        stream.run(resume.map(|r| r.last_seq)).await;
    })
}

struct Stream {
    hub: Arc<Hub>,
    source: ZmqSource,
    config: SubscriberConfig,
    convert: ConvertConfig,
    stream: EventStream,
    /// Ranks this stream has carried (what a resync or restart clears).
    ranks: BTreeSet<DpRank>,
}

/// `[topic, seq, payload]` or `[seq, payload]`.
fn replay_io(context: &str, e: String) -> TransportError {
    TransportError::Io {
        context: context.to_owned(),
        source: std::io::Error::other(e),
    }
}

fn split_live(frames: &[Bytes]) -> Option<(u64, &Bytes)> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

/// `["", seq, payload]` or `[seq, payload]`.
fn split_replay(frames: &[Bytes]) -> Option<(u64, &Bytes)> {
    let (seq, payload) = match frames {
        [empty, seq, payload] if empty.is_empty() => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

impl Stream {
    /// `resumed`: the last batch a restored snapshot holds (the stream catches up from the
    /// batch after it before taking live batches).
    async fn run(&mut self, resumed: Option<u64>) {
        let mut socket = SubSocket::new();
        // The publisher filters by this prefix (vLLM's `topic`; "" takes everything).
        if let Err(e) = socket.subscribe(&self.source.topic).await {
            tracing::error!(worker = %self.source.worker, "cannot subscribe: {e}");
            return;
        }
        // `connect` retries until the publisher is up; after that the socket reconnects
        // by itself.
        self.hub
            .note_stream(self.source.worker, StreamState::Connecting);
        loop {
            match socket.connect(&self.source.publisher).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(worker = %self.source.worker, endpoint = %self.source.publisher,
                        "cannot connect, retrying: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        tracing::info!(worker = %self.source.worker, endpoint = %self.source.publisher,
            "subscribed to KV events");
        self.hub
            .note_stream(self.source.worker, StreamState::Subscribed);
        if let Some(last) = resumed {
            self.catch_up(last.saturating_add(1)).await;
        }
        let mut handled = 0u32;
        loop {
            let frames = match socket.recv().await {
                Ok(m) => m.into_vec(),
                Err(e) => {
                    tracing::warn!(worker = %self.source.worker, "receive failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            match split_live(&frames) {
                Some((seq, payload)) => {
                    self.on_live(seq, payload).await;
                    // A backlog of buffered batches never makes the socket wait, so this
                    // task would keep the core thread from its HTTP connections until the
                    // backlog is gone: let them run between batches now and then.
                    handled = handled.wrapping_add(1);
                    if handled.is_multiple_of(YIELD_EVERY) {
                        tokio::task::yield_now().await;
                    }
                }
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
            if let Some(kind) = self.stream.replay_ended(from, seq, delivered) {
                self.clear_ranks(kind, &format_args!("batches {from}..{seq} not replayed"));
            }
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
        if self.process(seq, payload).is_err() {
            self.recover(seq).await;
        }
    }

    /// After a restart from a snapshot: asks the replay socket for every batch from `from`
    /// on (the publisher's buffer keeps its recent batches) before any live batch. A
    /// buffer that no longer reaches back to `from` clears and resyncs the worker (as a gap
    /// does while running); without a replay socket, or if the replay fails, the next live
    /// batch tells: the next number applies, anything else is a gap or a restart.
    async fn catch_up(&mut self, from: u64) {
        let Some(endpoint) = self.source.replay.clone() else {
            return;
        };
        match self.replay(&endpoint, from).await {
            Ok(()) => {
                self.stream.caught_up(from);
                tracing::info!(worker = %self.source.worker, from,
                    "resumed from the snapshot: replayed what came after it");
            }
            Err(e) => tracing::warn!(worker = %self.source.worker, from,
                "resuming from the snapshot: replay failed ({e}); the next live batch decides"),
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
            && self.process(seq, &payload).is_ok()
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

    /// A replay socket asked for every batch from `from` on.
    async fn open_replay(&self, endpoint: &str, from: u64) -> Result<DealerSocket, TransportError> {
        let timeout = self.config.replay_timeout;
        let mut dealer = DealerSocket::new();
        tokio::time::timeout(timeout, dealer.connect(endpoint))
            .await
            .map_err(|_| replay_io("replay connect", "timed out".into()))?
            .map_err(|e| replay_io("replay connect", e.to_string()))?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| replay_io("replay request", e.to_string()))?;
        dealer
            .send(request)
            .await
            .map_err(|e| replay_io("replay request", e.to_string()))?;
        Ok(dealer)
    }

    /// The next `(seq, payload)` a replay socket sends ([`REPLAY_END`] ends it).
    async fn next_replayed(
        &self,
        dealer: &mut DealerSocket,
    ) -> Result<(u64, Bytes), TransportError> {
        let reply = tokio::time::timeout(self.config.replay_timeout, dealer.recv())
            .await
            .map_err(|_| replay_io("replay", "timed out".into()))?
            .map_err(|e| replay_io("replay", e.to_string()))?
            .into_vec();
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
        loop {
            let (seq, payload) = self.next_replayed(&mut dealer).await?;
            let payload = &payload;
            if seq == REPLAY_END {
                return Ok(());
            }
            match self.stream.replayed(BatchId::of(seq, payload)) {
                Action::Skip => continue,
                Action::Apply | Action::Replay { .. } => {}
                Action::ClearThenApply(kind) => {
                    // The worker's buffer no longer reaches back far enough.
                    self.clear_ranks(kind, &format_args!("replay starts at {seq}"));
                }
            }
            self.hub.metrics().replayed_batches.fetch_add(1, Relaxed);
            if self.process(seq, payload).is_err() {
                // Unreadable in the buffer too: what it changed is unknown.
                self.clear_ranks(
                    ClearKind::Resync,
                    &format_args!("replayed seq {seq} could not be decoded"),
                );
            }
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
    }

    /// Decodes and applies one batch; `Err` (counted and logged) if it does not decode.
    fn process(&mut self, seq: u64, payload: &[u8]) -> Result<(), ()> {
        let worker = self.source.worker;
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
        self.convert.block_size = self.hub.block_size_of(self.source.worker);
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
            if self.hub.note_config_error(worker, message.clone()) {
                tracing::error!(worker = %worker, "{message}");
            }
        }
        let key = WorkerKey {
            worker,
            dp_rank: converted.dp_rank,
        };
        self.ranks.insert(converted.dp_rank);
        let n = converted.events.len() as u64;
        if let Err(e) = self.hub.ingest_marked(key, converted.events, seq) {
            metrics.drop_input(e.reason(), n, &format_args!("worker {worker}: {e}"));
        }
        Ok(())
    }
}
