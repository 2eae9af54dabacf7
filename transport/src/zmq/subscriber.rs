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
    on.spawn(async move {
        let mut stream = Stream {
            convert: ConvertConfig {
                block_size: hub.block_size_of(source.worker),
            },
            hub,
            source,
            config,
            stream: EventStream::new(can_replay),
            ranks: BTreeSet::new(),
        };
        stream.run().await;
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
    async fn run(&mut self) {
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
    }

    async fn on_live(&mut self, seq: u64, payload: &Bytes) {
        let batch = BatchId::of(seq, payload);
        let mut action = self.stream.live(batch);
        if let Action::Replay { from } = action {
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
            Action::Skip => {
                let why = format_args!("worker {}: seq {seq} already applied", self.source.worker);
                skip_duplicate(&self.hub, 1, &why);
                return;
            }
            Action::ClearThenApply(kind) => self.clear_ranks(kind, &format_args!("seq {seq}")),
            // After a replay the stream is caught up or starts afresh: never a second one.
            Action::Replay { from } => {
                self.clear_ranks(ClearKind::Resync, &format_args!("batches {from}..{seq}"));
            }
        }
        self.process(seq, payload);
    }

    async fn replay(&mut self, endpoint: &str, from: u64) -> Result<(), TransportError> {
        let io = |context: &str, e: String| TransportError::Io {
            context: context.to_owned(),
            source: std::io::Error::other(e),
        };
        let timeout = self.config.replay_timeout;
        let mut dealer = DealerSocket::new();
        tokio::time::timeout(timeout, dealer.connect(endpoint))
            .await
            .map_err(|_| io("replay connect", "timed out".into()))?
            .map_err(|e| io("replay connect", e.to_string()))?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| io("replay request", e.to_string()))?;
        dealer
            .send(request)
            .await
            .map_err(|e| io("replay request", e.to_string()))?;
        tracing::info!(worker = %self.source.worker, from, "replaying missed batches");
        loop {
            let reply = tokio::time::timeout(timeout, dealer.recv())
                .await
                .map_err(|_| io("replay", "timed out".into()))?
                .map_err(|e| io("replay", e.to_string()))?
                .into_vec();
            let Some((seq, payload)) = split_replay(&reply) else {
                return Err(TransportError::MalformedMsgpack(format!(
                    "replay reply of {} frames",
                    reply.len()
                )));
            };
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
            self.process(seq, payload);
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

    fn process(&mut self, seq: u64, payload: &[u8]) {
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
                return;
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
        if let Err(e) = self.hub.ingest(key, converted.events) {
            metrics.drop_input(e.reason(), n, &format_args!("worker {worker}: {e}"));
        }
    }
}
