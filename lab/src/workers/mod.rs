//! Simulated vLLM and TensorRT-LLM workers you can run and talk to, and break: each one a
//! [`SimEngine`] (the sans-IO `sim` crate) driven in real time (or `speedup` times faster)
//! behind an OpenAI-compatible HTTP server, handing out its KV events as vLLM does
//! (published over ZMQ) or, with [`EventFormat::Trtllm`], as TensorRT-LLM's `trtllm-serve`
//! does (drained by `POST /kv_cache_events`, see below). `kvengine sim`, `kvengine
//! --sim-workers`, the replay bench and the demo run them as they are; the soak
//! (`crate::soak`) also injects faults into them ([`faults`]).
//!
//! One worker ([`spawn_worker`]) is three tasks on the current tokio runtime (two with
//! [`EventFormat::Trtllm`]):
//! * the driver ([`driver`]): owns the engine, takes requests, aborts and faults over a
//!   channel, steps the engine while it has work, sleeps each step's duration / `speedup`,
//!   delivers the outputs to each request's channel and hands the step's KV events on: to
//!   a [`VllmPublisher`] (ZMQ PUB plus the replay ROUTER), or to the TensorRT-LLM buffer;
//! * the HTTP server (`http.rs`, served by `listen.rs`): `GET /health`, `GET /v1/models`,
//!   `GET /load` (the engine's `num_requests_waiting`, `num_requests_running`, `kv_usage`,
//!   the worker's `role` and counters), `POST /v1/completions` and
//!   `POST /v1/chat/completions` ([`openai`]), whole or streamed (SSE, one chunk per token,
//!   flushed as produced), SGLang's simulated bootstrap `GET /sim/bootstrap/{room}`
//!   (`bootstrap.rs`), with [`EventFormat::Trtllm`] only (else 404)
//!   `POST /kv_cache_events`, and with [`SimWorkerConfig::vllm_metrics`] only vLLM's load
//!   gauges at `GET /metrics`. As vLLM's server does, it answers a completion naming another
//!   model than its own 404, and with an API key ([`SimWorkerConfig::api_key`]) refuses
//!   `/v1` requests without it (401);
//! * the publisher's replay task (vLLM format only).
//!
//! [`spawn_worker`] and the [`SimWorkerHandle`] it returns live in `handle.rs`. What the
//! tasks say to each other ([`driver::Command`], [`driver::Delivery`], [`driver::Snapshot`])
//! and the log target are in `command.rs`, a leaf shared by the driver, the handle and the
//! HTTP server, so that the driver and the HTTP server depend neither on each other nor on
//! the handle. This module only declares the modules and re-exports.
//!
//! # TensorRT-LLM's KV events
//! With [`EventFormat::Trtllm`] no ZMQ socket is bound (the handle's ZMQ endpoints are
//! empty and its [`SimWorkerHandle::registration`] names none). The engine's events are
//! converted to TensorRT-LLM's ([`trtllm`]: `created` first, as event 0, then `stored` and
//! `removed`, consecutive `event_id`s from 0) into a buffer of `buffer` events that drops
//! the oldest when full, and `POST /kv_cache_events` answers everything buffered since the
//! last call as a JSON array (`[]` when nothing is), emptying it: a router polls
//! [`SimWorkerHandle::kv_events_url`] (kvengine's `--trtllm-worker ID=URL`). TensorRT-LLM's
//! default `tokens_per_block` is 32 (`kvengine sim --engine trtllm` defaults to it). The
//! OpenAI API, the load report and the disaggregated hand-offs are the same in both modes.
//!
//! # Disaggregated serving
//! A worker has a [`SimRole`] and a KV [`TransferModel`]. It recognises the prefill and
//! decode requests of vLLM (`kv_transfer_params`), SGLang (`bootstrap_*`, side chosen by the
//! role) and TensorRT-LLM (`disaggregated_params`) from their bodies ([`disagg`]); a prefill
//! side generates one token and answers what the decode side needs, a decode side waits for
//! the prefill and the transfer, then holds the prompt's blocks (publishing `BlockStored`
//! for them, as the engines' decode workers do) and decodes without prefilling
//! ([`sim::engine::RemotePrefill`]). Every role also serves ordinary requests.
//!
//! Prompts are tokenized with the model's tokenizer when one is given, else with a built-in
//! deterministic fallback ([`tokens`]); a router must tokenize the same way for its prefix
//! hits to line up with the worker's cache.
//!
//! Simulated time is real time since the worker started times `speedup`; published event
//! batches carry the wall clock, as vLLM's do.
//!
//! The workers log under the target `sim::server` (their home before issue 30), so
//! `RUST_LOG` filters written for them keep working.
//!
//! # Invariants
//! 1. Nothing a client sends reaches a panic: malformed requests get OpenAI-style 400s.
//! 2. A request whose client went away is aborted; with no request in flight the engine's
//!    `kv_usage` is 0.
//! 3. Dropping a [`SimWorkerHandle`] stops its worker (without waiting);
//!    [`SimWorkerHandle::shutdown`] stops it and waits.
//! 4. A worker nobody injects a fault into behaves as if [`faults`] did not exist (its
//!    counters aside).
//!
//! [`SimEngine`]: sim::engine::SimEngine
//! [`VllmPublisher`]: transport::zmq::VllmPublisher
// What clients send reaches this code: no unwrap/expect outside tests (as in `sim`, where
// it lived until issue 30).
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
#![warn(missing_docs)]

pub mod cluster;
pub mod config;
pub mod disagg;
pub mod driver;
pub mod error;
pub mod faults;
pub mod openai;
pub mod role;
pub mod tokens;
pub mod transfer;
pub mod trtllm;

mod bootstrap;
mod command;
mod handle;
mod handoff;
mod http;
mod listen;

pub use bootstrap::{MAX_ROOMS, ROOM_RETENTION};
pub use cluster::{cluster_member, spawn_cluster, spawn_mixed_cluster};
pub use config::{DEFAULT_BOOTSTRAP_TIMEOUT, EventFormat, SimWorkerConfig};
pub use error::{Result, WorkerError};
pub use faults::{BatchObserver, Counters, HttpMode, Probe};
pub use handle::{SimWorkerHandle, spawn_worker, spawn_worker_observed};
pub use role::SimRole;
pub use transfer::TransferModel;
