//! KV events from vLLM / SGLang workers over ZMQ, and a publisher that speaks the same
//! protocol (for simulated workers, tests and benchmarks).
//!
//! The wire protocol (docs/protocol.md): a worker's PUB socket sends multipart messages
//! `[topic, seq (8 bytes big-endian), msgpack batch]`; its ROUTER replay socket answers a
//! DEALER's `["", start seq]` with `["", seq, batch]` for every buffered batch from `start`
//! on and ends with seq `0xffffffffffffffff` and an empty payload.
//!
//! * [`subscriber`]: one task per worker subscription: decode, fence, replay or resync,
//!   hand to the [`crate::hub::Hub`].
//! * [`publisher`]: a vLLM-compatible publisher with a replay buffer.

pub mod publisher;
pub mod source;
pub mod subscriber;

pub use publisher::VllmPublisher;
pub use source::ZmqSource;
pub use subscriber::{SubscriberConfig, spawn_subscriber, spawn_subscriber_on};

/// The seq that ends a replay.
pub const REPLAY_END: u64 = u64::MAX;
