//! KV events from vLLM / SGLang workers over ZMQ, and a publisher that speaks the same
//! protocol (for simulated workers, tests and benchmarks).
//!
//! The wire protocol (docs/protocol.md): a worker's PUB socket sends multipart messages
//! `[topic, seq (8 bytes big-endian), msgpack batch]`; its ROUTER replay socket answers a
//! DEALER's `["", start seq]` with one reply per buffered batch from `start` on, then an
//! end marker whose seq is `0xffffffffffffffff` and whose payload is empty. Two reply
//! shapes exist and both are read:
//! * vLLM (`ZmqEventPublisher`): `["", topic, seq, batch]`, ended by `["", "", END, ""]`
//!   (recorded from vLLM 0.32 in `transport/tests/data/vllm-0.32.0/`);
//! * SGLang: `["", seq, batch]`, ended by `["", END, ""]`.
//!
//! Publishers number batches from 0 in every process, so a restarted worker reuses the
//! numbers of its previous life: continuity after a reconnection is proven by the replay
//! giving back the last batch applied, byte for byte (`crate::stream`).
//!
//! * [`subscriber`]: one task per worker subscription: decode, fence, replay or resync,
//!   hand to the [`crate::hub::Hub`].
//! * [`publisher`]: a vLLM-compatible publisher with a replay buffer.
//! * [`zmtp`]: the ZMTP 3.x sockets both speak, bounded against hostile peers (and why
//!   kvengine has its own rather than the `zeromq` crate's).

pub mod publisher;
pub mod source;
pub mod subscriber;
pub mod zmtp;

pub use publisher::{ReplayShape, VllmPublisher};
pub use source::ZmqSource;
pub use subscriber::{SubscriberConfig, spawn_subscriber, spawn_subscriber_on};

/// The seq that ends a replay.
pub const REPLAY_END: u64 = u64::MAX;
