//! What a worker's tasks say to each other: the [`Command`]s its handle and HTTP handlers
//! send the driver, the [`Delivery`]s the driver sends each request's handler, and the
//! [`Snapshot`] of the engine it keeps current for everyone; and [`LOG_TARGET`], the
//! tracing target all of them log under.
//!
//! Only types: the driver ([`super::driver`]) acts on them, the handle and the HTTP server
//! send them. They meet here, so the driver and the HTTP server need not know each other.

use std::time::Duration;

use engine::RequestId;
use sim::engine::{EngineStats, Load, RemotePrefill};
use tokio::sync::{mpsc, oneshot};
use wire::kv_events::WireBatch;

use super::error::Result;
use super::faults::Probe;

/// The tracing target of every line the workers log: `sim::server`, their home before
/// issue 30, so that `RUST_LOG` filters written for them keep working.
pub(super) const LOG_TARGET: &str = "sim::server";

/// What the driver is asked to do.
#[derive(Debug)]
pub enum Command {
    /// Queue a request (its id is assigned by the driver) and send its outputs to `out`;
    /// `ack` gets the id, or the engine's refusal.
    Add {
        /// The prompt's token ids.
        prompt: Vec<u32>,
        /// Tokens to generate.
        max_tokens: u32,
        /// `Some`: its prompt was prefilled by another worker (disaggregated decode).
        remote_prefill: Option<RemotePrefill>,
        /// Where its outputs go.
        out: mpsc::UnboundedSender<Delivery>,
        /// The id it got, or why it was refused.
        ack: oneshot::Sender<sim::Result<RequestId>>,
    },
    /// Drop a request (its client went away). Unknown ids are ignored.
    Abort(RequestId),
    /// Tell which pages hold the leading cached full blocks of `prompt` (base model), in
    /// order ([`SimEngine::cached_prefix_pages`](sim::engine::SimEngine::cached_prefix_pages)).
    Lookup {
        /// The prompt's token ids.
        prompt: Vec<u32>,
        /// The pages' indices.
        ack: oneshot::Sender<Vec<u32>>,
    },
    /// Withhold the engine's next `n` batches: numbered and kept for replay, not sent
    /// (vLLM format).
    Withhold {
        /// Batches to withhold.
        n: u64,
        /// Done, or why not.
        ack: oneshot::Sender<Result<()>>,
    },
    /// Publish batches that are not the engine's, back to back (not shown to the observer,
    /// never withheld); `ack` gets how long that took.
    PublishExtra {
        /// The batches, as they are to be sent.
        batches: Vec<WireBatch>,
        /// The time taken, or why nothing was published.
        ack: oneshot::Sender<Result<Duration>>,
    },
    /// End any withholding and publish an empty batch (so a trailing gap shows).
    Heartbeat {
        /// Done.
        ack: oneshot::Sender<()>,
    },
    /// Kill the worker's "process" and start it again after `down` (see
    /// [`super::SimWorkerHandle::restart`]).
    Restart {
        /// How long it stays down.
        down: Duration,
        /// Done, or why not.
        ack: oneshot::Sender<Result<()>>,
    },
    /// Tell whether the worker is idle, and what its engine caches.
    Probe {
        /// The answer.
        ack: oneshot::Sender<Probe>,
    },
}

/// One output of one request, as its HTTP handler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The first generated token: prefill is complete.
    First {
        /// The token id.
        token: u32,
        /// Tokens of the prompt.
        prompt_tokens: u32,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u32,
    },
    /// A later token.
    Token(u32),
    /// The request is complete.
    Finished {
        /// Tokens generated.
        output_tokens: u32,
    },
}

/// The engine's state as `/load` shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Queues and KV usage.
    pub load: Load,
    /// Counters.
    pub stats: EngineStats,
    /// Simulated time at the end of the last step.
    pub sim_time: Duration,
}
