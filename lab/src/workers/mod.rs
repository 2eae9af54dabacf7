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
mod handoff;
mod http;
mod listen;

pub use bootstrap::{MAX_ROOMS, ROOM_RETENTION};
pub use cluster::{cluster_member, spawn_cluster, spawn_mixed_cluster};
pub use config::{DEFAULT_BOOTSTRAP_TIMEOUT, EventFormat, SimWorkerConfig};
pub use error::{Result, WorkerError};
pub use faults::{BatchObserver, Counters, HttpMode, Probe};
pub use role::SimRole;
pub use transfer::TransferModel;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::WorkerId;
use sim::engine::SimEngine;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use transport::hub::Registration;
use transport::openai::tokenize::PromptTokenizer;
use transport::zmq::VllmPublisher;

use driver::{Command, Driver, EventSink, Snapshot, ZmqSink};
use faults::Faults;
use tokens::Prompter;
use trtllm::TrtllmEvents;

/// The tracing target of every line the workers log (see the module docs).
const LOG_TARGET: &str = "sim::server";
/// Commands queued to a driver before senders wait.
const COMMAND_QUEUE: usize = 4096;
/// How long [`SimWorkerHandle::shutdown`] lets open HTTP connections close.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running worker. Dropping it stops the worker; see [`SimWorkerHandle::shutdown`].
#[derive(Debug)]
pub struct SimWorkerHandle {
    http: SocketAddr,
    events: EventFormat,
    /// Empty with [`EventFormat::Trtllm`].
    zmq_pub: String,
    /// Empty with [`EventFormat::Trtllm`].
    zmq_replay: String,
    /// With [`EventFormat::Trtllm`]: the buffer `/kv_cache_events` drains.
    trtllm: Option<Arc<TrtllmEvents>>,
    commands: mpsc::Sender<Command>,
    model: String,
    /// Sent by the router on the requests it forwards ([`SimWorkerHandle::registration`]).
    api_key: Option<String>,
    role: SimRole,
    engine_id: String,
    faults: Arc<Faults>,
    snapshot: watch::Receiver<Snapshot>,
    shutdown: watch::Sender<bool>,
    driver: Option<JoinHandle<()>>,
    server: Option<JoinHandle<()>>,
}

impl SimWorkerHandle {
    /// The bound HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    /// The HTTP base URL (`http://HOST:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The bound KV-event PUB endpoint; empty with [`EventFormat::Trtllm`] (no socket).
    pub fn zmq_endpoint(&self) -> &str {
        &self.zmq_pub
    }

    /// The bound replay endpoint; empty with [`EventFormat::Trtllm`] (no socket).
    pub fn replay_endpoint(&self) -> &str {
        &self.zmq_replay
    }

    /// How it hands out its KV events.
    pub fn event_format(&self) -> EventFormat {
        self.events
    }

    /// Whether it serves its KV events as TensorRT-LLM does (`POST /kv_cache_events`).
    pub fn is_trtllm(&self) -> bool {
        self.events.is_trtllm()
    }

    /// Where TensorRT-LLM's KV events are drained: `http://HOST:PORT/kv_cache_events`
    /// (answered only with [`EventFormat::Trtllm`], 404 otherwise).
    pub fn kv_events_url(&self) -> String {
        format!("{}/kv_cache_events", self.url())
    }

    /// With [`EventFormat::Trtllm`]: the events dropped so far because its buffer was full
    /// (0 otherwise).
    pub fn dropped_kv_events(&self) -> u64 {
        self.trtllm.as_ref().map_or(0, |t| t.dropped())
    }

    /// How many leading full blocks of `prompt` (token ids, base model) its engine has
    /// cached right now: what a router's index should answer for this worker.
    ///
    /// # Errors
    /// [`WorkerError::Stopped`] when the worker has stopped.
    pub async fn cached_prefix_blocks(&self, prompt: &[u32]) -> Result<u32> {
        let (ack, answer) = tokio::sync::oneshot::channel();
        let lookup = Command::Lookup {
            prompt: prompt.to_vec(),
            ack,
        };
        self.commands
            .send(lookup)
            .await
            .map_err(|_| WorkerError::Stopped)?;
        let pages = answer.await.map_err(|_| WorkerError::Stopped)?;
        Ok(pages.len() as u32)
    }

    /// The served model's name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Its role.
    pub fn role(&self) -> SimRole {
        self.role
    }

    /// How a router registers it as worker `id`: its URL, KV-event endpoints (none with
    /// [`EventFormat::Trtllm`]: its events are polled from its URL) and role, its API key
    /// (if it has one, so that forwarded requests get in), and (for SGLang's hand-off) its
    /// HTTP port as the bootstrap port, where it serves its rooms.
    pub fn registration(&self, id: WorkerId) -> Registration {
        let zmq = !self.is_trtllm();
        Registration {
            url: Some(self.url()),
            zmq: zmq.then(|| self.zmq_endpoint().to_owned()),
            replay: zmq.then(|| self.replay_endpoint().to_owned()),
            role: Some(self.role),
            bootstrap_port: Some(self.http_addr().port()),
            api_key: self.api_key.clone(),
            trtllm_poll: self
                .is_trtllm()
                .then_some(transport::trtllm::DEFAULT_POLL_INTERVAL),
            ..Registration::new(id)
        }
    }

    /// Its engine id: the `remote_engine_id` of its vLLM prefill answers
    /// (`kvengine-sim-HOST:PORT`).
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The value of kvengine's `--zmq-worker` flag for this worker under id `worker`:
    /// `ID=tcp://HOST:PORT,replay=tcp://HOST:PORT` (meaningless with
    /// [`EventFormat::Trtllm`]: see [`SimWorkerHandle::trtllm_worker_flag`]).
    pub fn zmq_worker_flag(&self, worker: u64) -> String {
        format!("{worker}={},replay={}", self.zmq_pub, self.zmq_replay)
    }

    /// The value of kvengine's `--trtllm-worker` flag for this worker under id `worker`:
    /// `ID=http://HOST:PORT`.
    pub fn trtllm_worker_flag(&self, worker: u64) -> String {
        format!("{worker}={}", self.url())
    }

    /// The flag (name and value) that points kvengine at this worker's KV events under id
    /// `worker`: `--zmq-worker` or, with [`EventFormat::Trtllm`], `--trtllm-worker`.
    pub fn router_flag(&self, worker: u64) -> (&'static str, String) {
        if self.is_trtllm() {
            ("--trtllm-worker", self.trtllm_worker_flag(worker))
        } else {
            ("--zmq-worker", self.zmq_worker_flag(worker))
        }
    }

    /// The engine's load and counters after its last step or command.
    pub fn snapshot(&self) -> Snapshot {
        *self.snapshot.borrow()
    }

    /// Tells the worker to stop, without waiting (as dropping the handle does; the handle
    /// still answers for its addresses and counters).
    pub fn stop(&self) {
        self.shutdown.send_replace(true);
    }

    /// Stops the worker: the driver stops (open streams end), the HTTP server stops
    /// accepting and closes its connections (waiting at most a few seconds for them), the
    /// sockets are released.
    pub async fn shutdown(mut self) {
        self.shutdown.send_replace(true);
        if let Some(driver) = self.driver.take() {
            let _ = driver.await;
        }
        if let Some(mut server) = self.server.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut server)
                .await
                .is_err()
        {
            server.abort();
            let _ = server.await;
        }
    }
}

impl Drop for SimWorkerHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// Starts one worker on the current tokio runtime: binds its ZMQ (vLLM format only) and
/// HTTP sockets (port 0 allowed: the handle tells the bound ones) and spawns its tasks.
/// `tokenizer`: the model's tokenizer (`None`: the built-in fallback, see [`tokens`]).
pub async fn spawn_worker(
    cfg: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<SimWorkerHandle> {
    spawn_worker_observed(cfg, tokenizer, None).await
}

/// [`spawn_worker`], with `observer` shown every batch the engine publishes (vLLM format;
/// see [`faults`]).
pub async fn spawn_worker_observed(
    cfg: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
    observer: Option<Box<dyn BatchObserver>>,
) -> Result<SimWorkerHandle> {
    cfg.validate()?;
    let engine = SimEngine::new(cfg.engine.clone())?;
    let (sink, zmq_pub, zmq_replay, trtllm) = match cfg.events {
        EventFormat::Vllm => {
            let publisher =
                VllmPublisher::bind(&cfg.zmq_pub, Some(&cfg.zmq_replay), cfg.replay_buffer).await?;
            let zmq_pub = publisher.endpoint().to_owned();
            let zmq_replay = publisher
                .replay_endpoint()
                .unwrap_or(&cfg.zmq_replay)
                .to_owned();
            let sink = EventSink::Zmq(ZmqSink {
                publisher: Some(publisher),
                endpoint: zmq_pub.clone(),
                replay: zmq_replay.clone(),
                buffer: cfg.replay_buffer,
            });
            (sink, zmq_pub, zmq_replay, None)
        }
        EventFormat::Trtllm { buffer } => {
            let e = &cfg.engine;
            let events = Arc::new(TrtllmEvents::new(
                buffer,
                e.kv_blocks,
                e.block_size,
                e.dp_rank,
            ));
            let sink = EventSink::Trtllm(events.clone());
            (sink, String::new(), String::new(), Some(events))
        }
    };
    let listener = tokio::net::TcpListener::bind(cfg.http)
        .await
        .map_err(|source| WorkerError::Io {
            context: "cannot bind the HTTP listener",
            source,
        })?;
    let http = listener.local_addr().map_err(|source| WorkerError::Io {
        context: "cannot read the HTTP listener's address",
        source,
    })?;

    let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
    let (snapshot_tx, snapshot) = watch::channel(Snapshot::default());
    let (shutdown, shutdown_rx) = watch::channel(false);
    let faults = Arc::new(Faults::new());
    let driver = Driver {
        engine,
        engine_config: cfg.engine.clone(),
        sink,
        speedup: cfg.speedup,
        commands,
        snapshot: snapshot_tx,
        shutdown: shutdown_rx.clone(),
        epoch: Instant::now(),
        next_id: 0,
        requests: HashMap::new(),
        last_end: Duration::ZERO,
        busy: false,
        withhold: 0,
        faults: faults.clone(),
        observer,
    };
    let driver = tokio::spawn(driver.run());

    let engine_id = format!("kvengine-sim-{http}");
    let handoff = handoff::Handoff {
        transfer: cfg.transfer,
        speedup: cfg.speedup,
        block_size: cfg.engine.block_size,
        engine_id: engine_id.clone(),
        addr: http,
        rooms: (cfg.role == SimRole::Prefill)
            .then(|| Arc::new(bootstrap::Rooms::new(cfg.bootstrap_timeout))),
        client: bootstrap::client(),
        bootstrap_timeout: cfg.bootstrap_timeout,
    };
    let state = Arc::new(http::AppState {
        commands: commands_tx.clone(),
        trtllm: trtllm.clone(),
        snapshot: snapshot.clone(),
        model: cfg.model.clone(),
        api_key: cfg.api_key.clone(),
        prompter: tokenizer.map_or(Prompter::Fallback, Prompter::Model),
        role: cfg.role,
        handoff,
        faults: faults.clone(),
        dp_rank: cfg.engine.dp_rank,
    });
    let app = http::router(state, cfg.max_body_bytes, cfg.vllm_metrics);
    let server = tokio::spawn(listen::serve(
        app,
        listener,
        http,
        faults.watch_up(),
        shutdown_rx,
    ));
    tracing::info!(target: LOG_TARGET, %http, zmq = %zmq_pub, replay = %zmq_replay, role = %cfg.role,
                   trtllm = cfg.events.is_trtllm(), "simulated worker up");
    Ok(SimWorkerHandle {
        http,
        events: cfg.events,
        zmq_pub,
        zmq_replay,
        trtllm,
        commands: commands_tx,
        model: cfg.model,
        api_key: cfg.api_key,
        role: cfg.role,
        engine_id,
        faults,
        snapshot,
        shutdown,
        driver: Some(driver),
        server: Some(server),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_trtllm_worker_binds_no_zmq_and_registers_none() {
        let cfg = SimWorkerConfig {
            events: EventFormat::Trtllm { buffer: 8 },
            // Would fail to bind if it were used.
            zmq_pub: "nonsense".into(),
            ..SimWorkerConfig::default()
        };
        assert_eq!(cluster_member(&cfg, 3).unwrap().zmq_pub, "nonsense");
        let w = spawn_worker(cfg, None).await.unwrap();
        assert!(w.is_trtllm());
        assert_eq!(w.zmq_endpoint(), "");
        assert_eq!(w.replay_endpoint(), "");
        let reg = w.registration(WorkerId(4));
        assert_eq!((reg.zmq, reg.replay), (None, None));
        assert_eq!(reg.url, Some(w.url()));
        assert_eq!(w.kv_events_url(), format!("{}/kv_cache_events", w.url()));
        assert_eq!(
            w.router_flag(4),
            ("--trtllm-worker", format!("4={}", w.url()))
        );
        assert_eq!(w.cached_prefix_blocks(&[1, 2, 3]).await.unwrap(), 0);
        w.shutdown().await;
    }
}
