//! Simulated GPU workers for kvengine, sans-IO: a stand-in cluster anyone can run without
//! GPUs.
//!
//! A [`worker::SimWorker`] is one inference engine (one data-parallel rank) reduced to what a
//! KV-aware router cares about: a vLLM-like paged KV cache with prefix caching and LRU
//! eviction that publishes the KV events a real worker publishes, under its own engine
//! hashes. [`workload`] generates traffic (an embedded chat generator, or a Mooncake trace),
//! and [`cluster`] closes the loop: kvengine's index and scheduler route each request, the
//! chosen worker serves it, and its events flow back into the index.
//!
//! # Components
//! * [`worker`]: the simulated engine, its block pool and its block hashes.
//! * [`engine`]: a sans-IO simulated vLLM engine over time: continuous batching, chunked
//!   prefill, preemption, a timing model and KV events in vLLM's wire shape.
//! * [`workload`]: request streams ([`workload::chat`], [`workload::mooncake`]).
//! * [`cluster`]: the closed loop and its per-mode [`cluster::ModeReport`].
//! * [`error`]: the crate's [`SimError`].
//!
//! The crate depends on `engine` and `wire` only (its events are `wire`'s batch types).
//! Running these engines in real time, behind an OpenAI-compatible HTTP server, publishing
//! their events over ZMQ or serving them as TensorRT-LLM does, with the faults a soak
//! injects, is the lab crate's `workers` module (what `kvengine sim` and
//! `kvengine --sim-workers` start).
//!
//! # Invariants
//! 1. Deterministic: with the same configuration and seed, a run makes the same decisions
//!    and counts the same hits; only measured wall times differ.
//! 2. No clock drives behaviour: simulated time comes from the workload's arrival times (or
//!    the caller's `now`). The clock is read only to measure how long routing decisions
//!    take. No I/O: nothing here opens a socket or a file other than a trace the caller
//!    names.
//! 3. No input reaches a panic: configurations and trace files are validated into
//!    [`SimError`]s.
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
#![warn(missing_docs)]

pub mod cluster;
pub mod engine;
pub mod error;
pub mod worker;
pub mod workload;

pub use error::{Result, SimError};
