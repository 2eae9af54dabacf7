//! A publisher that speaks vLLM's KV-event protocol: PUB socket, per-message sequence
//! numbers, map-encoded events (vLLM after PR #42892), and a ROUTER replay socket backed by a
//! bounded buffer of recent batches. Simulated workers, tests and the ingest benchmark use
//! it; kvengine's subscriber cannot tell it from a real vLLM. Its replay socket answers in
//! vLLM's shape (`["", topic, seq, payload]`, ended by `["", "", 0xff..ff, ""]`) or, with
//! [`ReplayShape::Sglang`], in SGLang's (`["", seq, payload]`, ended by `["", 0xff..ff, ""]`).
//!
//! Its sockets are [`super::zmtp`]'s: what a peer sends them is bounded
//! ([`super::zmtp::server::PEER_LIMITS`]); a peer that breaks a bound is refused, counted
//! ([`VllmPublisher::refused_peers`]) and disconnected, and the others are served on.
//!
//! # Concurrency
//! The publisher is owned by one task. The replay socket's peer tasks share only the
//! buffer (a mutex held for a copy of the matching entries).

use super::REPLAY_END;
use super::zmtp::server::Handler;
use super::zmtp::{PubSocket, Refusals, RouterSocket};
use crate::error::Result;
use crate::kv_events::WireBatch;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Batches are encoded as vLLM publishes them by the `wire` crate (re-exported here, where
/// tests and benchmarks have always found it).
pub use wire::kv_events::encode_batch;

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// How the replay socket frames its answers (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplayShape {
    /// vLLM's `ZmqEventPublisher`: `["", topic, seq, payload]`, then `["", "", END, ""]`.
    #[default]
    Vllm,
    /// SGLang's: `["", seq, payload]`, then `["", END, ""]`.
    Sglang,
}

/// See the module docs.
pub struct VllmPublisher {
    socket: PubSocket,
    topic: Bytes,
    next_seq: u64,
    buffer: Buffer,
    capacity: usize,
    replay: Option<RouterSocket>,
    refusals: Arc<Refusals>,
}

impl VllmPublisher {
    /// Binds the PUB socket (and the replay socket, if given) and keeps the last `buffer`
    /// batches for replay. Endpoints may use port 0; [`Self::endpoint`] tells the bound one.
    pub async fn bind(publish: &str, replay: Option<&str>, buffer: usize) -> Result<Self> {
        Self::bind_shaped(publish, replay, buffer, ReplayShape::default()).await
    }

    /// Like [`Self::bind`], its replay socket answering in `shape`.
    pub async fn bind_shaped(
        publish: &str,
        replay: Option<&str>,
        buffer: usize,
        shape: ReplayShape,
    ) -> Result<Self> {
        let topic = Bytes::from_static(b"kv-events");
        let refusals = Arc::new(Refusals::default());
        let socket = PubSocket::bind(publish, refusals.clone()).await?;
        let buffer_store: Buffer = Arc::new(Mutex::new(VecDeque::with_capacity(buffer)));
        let replay = match replay {
            Some(r) => {
                let (buffer, topic) = (buffer_store.clone(), topic.clone());
                let handler: Handler =
                    Arc::new(move |request| replay_replies(&request, &buffer, shape, &topic));
                Some(RouterSocket::bind(r, handler, refusals.clone()).await?)
            }
            None => None,
        };
        Ok(Self {
            socket,
            topic,
            next_seq: 0,
            buffer: buffer_store,
            capacity: buffer.max(1),
            replay,
            refusals,
        })
    }

    /// The bound PUB endpoint.
    pub fn endpoint(&self) -> &str {
        self.socket.endpoint()
    }

    /// The bound replay endpoint.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay.as_ref().map(RouterSocket::endpoint)
    }

    /// Peers of either socket refused so far for what they sent (an oversized or
    /// malformed frame, a bad greeting): each was disconnected.
    pub fn refused_peers(&self) -> u64 {
        self.refusals.count()
    }

    /// The seq the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Numbers the next batch `seq` (a restarted publisher starts again from 0).
    pub fn set_next_seq(&mut self, seq: u64) {
        self.next_seq = seq;
    }

    fn remember(&mut self, payload: Bytes) -> u64 {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let mut buf = self
            .buffer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if buf.len() >= self.capacity {
            buf.pop_front();
        }
        buf.push_back((seq, payload));
        seq
    }

    /// Encodes, numbers, buffers and publishes one batch; returns its seq.
    pub async fn publish(&mut self, batch: &WireBatch) -> Result<u64> {
        self.publish_payload(Bytes::from(encode_batch(batch))).await
    }

    /// Numbers, buffers and publishes an already encoded batch; returns its seq.
    pub async fn publish_payload(&mut self, payload: Bytes) -> Result<u64> {
        let seq = self.remember(payload.clone());
        self.send(seq, payload);
        Ok(seq)
    }

    /// Sends `[topic, seq, payload]` on the live stream (to the subscribers whose
    /// subscription prefixes the topic; one whose queue is full misses it, as on any PUB).
    fn send(&mut self, seq: u64, payload: Bytes) {
        self.socket.send(vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
    }

    /// Numbers and buffers a batch, but sends a damaged copy (cut in half) on the live
    /// stream: the replay buffer holds the readable one (tests of decode recovery use this).
    pub async fn publish_damaged(&mut self, batch: &WireBatch) -> Result<u64> {
        let good = Bytes::from(encode_batch(batch));
        let seq = self.remember(good.clone());
        self.send(seq, good.slice(..good.len() / 2));
        Ok(seq)
    }

    /// Numbers and buffers a batch without sending it: the message is "lost" on the live
    /// stream but replayable (tests of gap repair use this).
    pub fn withhold(&mut self, batch: &WireBatch) -> u64 {
        self.remember(Bytes::from(encode_batch(batch)))
    }
}

impl std::fmt::Debug for VllmPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmPublisher")
            .field("endpoint", &self.endpoint())
            .field("replay_endpoint", &self.replay_endpoint())
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

/// The replies to one replay request `["", start seq]` (a missing delimiter tolerated):
/// every buffered batch from `start` on, then the end marker, in `shape`. A request
/// without an 8-byte seq last gets no reply.
fn replay_replies(
    request: &[Bytes],
    buffer: &Buffer,
    shape: ReplayShape,
    topic: &Bytes,
) -> Vec<Vec<Bytes>> {
    let Some(start) = request
        .last()
        .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
        .map(u64::from_be_bytes)
    else {
        return Vec::new();
    };
    let entries: Vec<(u64, Bytes)> = buffer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|(s, _)| *s >= start)
        .cloned()
        .collect();
    entries
        .into_iter()
        .chain(std::iter::once((REPLAY_END, Bytes::new())))
        .map(|(seq, payload)| {
            let mut frames = Vec::with_capacity(4);
            frames.push(Bytes::new());
            if shape == ReplayShape::Vllm {
                // vLLM's end marker has an empty topic.
                frames.push(match seq {
                    REPLAY_END => Bytes::new(),
                    _ => topic.clone(),
                });
            }
            frames.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
            frames.push(payload);
            frames
        })
        .collect()
}
