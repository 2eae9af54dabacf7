//! The KV-event wire schemas kvengine reads (and, for its simulated workers, tests and
//! benchmarks, writes): pure data and codecs, no I/O, no runtime, no router policy.
//!
//! * [`kv_events`]: vLLM / SGLang KV-event batches as msgpack: [`WireBatch`] and its events,
//!   decoded by [`decode_batch`] and encoded (as vLLM publishes them) by [`encode_batch`].
//! * [`trtllm`]: TensorRT-LLM's KV-cache events as the JSON pages `trtllm-serve` answers to
//!   `POST /kv_cache_events`: [`trtllm::TrtEvent`] and its body, decoded by
//!   [`trtllm::decode_page`].
//! * [`error`]: the crate's [`WireError`].
//!
//! What a router does with these events (fencing, turning them into engine events, counting
//! what it drops) is not here: `kvengine-transport` does that and re-exports these types.
//!
//! # Invariants
//! 1. No input reaches a panic, and nothing is allocated out of proportion to the input:
//!    every decoder bounds its input ([`kv_events::MAX_BATCH_BYTES`],
//!    [`trtllm::MAX_PAGE_BYTES`]) and checks declared lengths against the bytes left. Each
//!    decoder is fuzzed (`fuzz/fuzz_targets/msgpack_batch.rs`, `trtllm_events.rs`).
//! 2. Encoding then decoding a batch gives it back, up to the defaults the encoder writes
//!    for absent fields ([`kv_events`], invariant 5).
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
#![warn(missing_docs)]

pub mod error;
pub mod kv_events;
pub mod trtllm;

pub use error::{Result, WireError};
pub use kv_events::{
    WireBatch, WireEvent, WireExtraItem, WireExtraKeys, decode_batch, encode_batch,
};
