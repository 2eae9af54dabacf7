//! Simulated vLLM and TensorRT-LLM workers you can run and talk to: each one a [`SimEngine`]
//! driven in real time (or `speedup` times faster) behind an OpenAI-compatible HTTP server,
//! handing out its KV events as vLLM does (published over ZMQ) or, with
//! [`EventFormat::Trtllm`], as TensorRT-LLM's `trtllm-serve` does (drained by
//! `POST /kv_cache_events`, see below).
//!
//! One worker ([`spawn_worker`]) is three tasks on the current tokio runtime (two with
//! [`EventFormat::Trtllm`]):
//! * the driver ([`driver`]): owns the engine, takes requests and aborts over a channel,
//!   steps the engine while it has work, sleeps each step's duration / `speedup`, delivers
//!   the outputs to each request's channel and hands the step's KV events on: to a
//!   [`VllmPublisher`] (ZMQ PUB plus the replay ROUTER), or to the TensorRT-LLM buffer;
//! * the HTTP server (`http.rs`): `GET /health`, `GET /v1/models`, `GET /load` (the engine's
//!   `num_requests_waiting`, `num_requests_running`, `kv_usage`, the worker's `role` and
//!   counters), `POST /v1/completions` and `POST /v1/chat/completions` ([`openai`]), whole
//!   or streamed (SSE, one chunk per token, flushed as produced), SGLang's simulated
//!   bootstrap `GET /sim/bootstrap/{room}` (`bootstrap.rs`) and, with
//!   [`EventFormat::Trtllm`] only (else 404), `POST /kv_cache_events`. As vLLM's server
//!   does, it answers a completion naming another model than its own 404, and with an API
//!   key ([`SimWorkerConfig::api_key`]) refuses `/v1` requests without it (401);
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
//! ([`crate::engine::RemotePrefill`]). Every role also serves ordinary requests.
//!
//! Prompts are tokenized with the model's tokenizer when one is given, else with a built-in
//! deterministic fallback ([`tokens`]); a router must tokenize the same way for its prefix
//! hits to line up with the worker's cache.
//!
//! Simulated time is real time since the worker started times `speedup`; published event
//! batches carry the wall clock, as vLLM's do.
//!
//! # Invariants
//! 1. Nothing a client sends reaches a panic: malformed requests get OpenAI-style 400s.
//! 2. A request whose client went away is aborted; with no request in flight the engine's
//!    `kv_usage` is 0.
//! 3. Dropping a [`SimWorkerHandle`] stops its worker (without waiting);
//!    [`SimWorkerHandle::shutdown`] stops it and waits.

pub mod disagg;
pub mod driver;
pub mod openai;
pub mod role;
pub mod tokens;
pub mod transfer;
pub mod trtllm;

mod bootstrap;
mod handoff;
mod http;

pub use bootstrap::{MAX_ROOMS, ROOM_RETENTION};
pub use role::SimRole;
pub use transfer::TransferModel;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::WorkerId;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use transport::hub::Registration;
use transport::openai::tokenize::PromptTokenizer;
use transport::zmq::VllmPublisher;

use crate::engine::{EngineConfig, SimEngine};
use crate::error::{Result, SimError};
use driver::{Command, Driver, EventSink, Snapshot};
use tokens::Prompter;
use trtllm::TrtllmEvents;

/// Commands queued to a driver before senders wait.
const COMMAND_QUEUE: usize = 4096;
/// How long [`SimWorkerHandle::shutdown`] lets open HTTP connections close.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// [`SimWorkerConfig::bootstrap_timeout`]'s default.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);

/// How a worker hands out its KV events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventFormat {
    /// As vLLM: msgpack batches published over ZMQ (PUB plus the replay ROUTER).
    #[default]
    Vllm,
    /// As TensorRT-LLM: buffered and drained by `POST /kv_cache_events` ([`trtllm`]); no
    /// ZMQ socket is bound.
    Trtllm {
        /// Events kept (TensorRT-LLM's `event_buffer_max_size`): at least 1; when full the
        /// oldest is dropped.
        buffer: usize,
    },
}

impl EventFormat {
    /// TensorRT-LLM's format with the default buffer ([`trtllm::DEFAULT_EVENT_BUFFER`]).
    pub const fn trtllm() -> Self {
        Self::Trtllm {
            buffer: trtllm::DEFAULT_EVENT_BUFFER,
        }
    }

    /// Whether it is TensorRT-LLM's.
    pub const fn is_trtllm(self) -> bool {
        matches!(self, Self::Trtllm { .. })
    }
}

/// One simulated worker's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SimWorkerConfig {
    /// The engine: cache shape, scheduler limits, timing model and the data-parallel rank
    /// stamped on its event batches (`engine.dp_rank`).
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time: finite, > 0.
    pub speedup: f64,
    /// The model name `/v1/models` reports and answers carry; a completion asking for
    /// another model is answered 404, as vLLM does.
    pub model: String,
    /// vLLM's `--api-key`: when set, every request whose path starts with `/v1` must carry
    /// `Authorization: Bearer KEY` (else 401); `/health`, `/load` and `/sim/...` stay open.
    /// Printable ASCII without spaces, as kvengine's worker registration requires.
    pub api_key: Option<String>,
    /// Where the HTTP server listens (port 0: any free port).
    pub http: SocketAddr,
    /// How KV events are handed out: vLLM's ZMQ (the default) or TensorRT-LLM's
    /// `POST /kv_cache_events`.
    pub events: EventFormat,
    /// Where KV events are published: `tcp://HOST:PORT` (port 0: any free port). Unused
    /// with [`EventFormat::Trtllm`].
    pub zmq_pub: String,
    /// The replay (ROUTER) endpoint: `tcp://HOST:PORT` (port 0: any free port). Unused
    /// with [`EventFormat::Trtllm`].
    pub zmq_replay: String,
    /// Event batches kept for replay (vLLM format).
    pub replay_buffer: usize,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: usize,
    /// Which side of disaggregated requests it serves (SGLang's side comes from it).
    pub role: SimRole,
    /// How long receiving a prompt's KV from a prefill worker takes.
    pub transfer: TransferModel,
    /// How long SGLang's bootstrap (`GET /sim/bootstrap/{room}`, on prefill workers) waits
    /// for a room's prefill before answering 404: at least 1 ms, at most a day.
    pub bootstrap_timeout: Duration,
}

impl Default for SimWorkerConfig {
    fn default() -> Self {
        Self {
            engine: EngineConfig::default(),
            speedup: 1.0,
            model: "kvengine-sim".into(),
            api_key: None,
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            events: EventFormat::Vllm,
            zmq_pub: "tcp://127.0.0.1:0".into(),
            zmq_replay: "tcp://127.0.0.1:0".into(),
            replay_buffer: 4096,
            max_body_bytes: 64 << 20,
            role: SimRole::Aggregated,
            transfer: TransferModel::default(),
            bootstrap_timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
        }
    }
}

impl SimWorkerConfig {
    /// Rejects a value outside its documented range.
    pub fn validate(&self) -> Result<()> {
        self.engine.validate()?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimError::InvalidConfig {
                name: "speedup",
                reason: "must be a finite number above 0",
            });
        }
        if self.model.is_empty() {
            return Err(SimError::InvalidConfig {
                name: "model",
                reason: "must not be empty",
            });
        }
        if let Some(key) = &self.api_key
            && (key.is_empty() || !key.bytes().all(|c| c.is_ascii_graphic()))
        {
            // A key a client (or kvengine's registration) cannot send would lock the worker.
            return Err(SimError::InvalidConfig {
                name: "api_key",
                reason: "must be printable ASCII without spaces, and not empty",
            });
        }
        if let EventFormat::Trtllm { buffer: 0 } = self.events {
            return Err(SimError::InvalidConfig {
                name: "events.buffer",
                reason: "must be at least 1",
            });
        }
        self.transfer.validate()?;
        let timeout = Duration::from_millis(1)..=Duration::from_secs(86_400);
        if !timeout.contains(&self.bootstrap_timeout) {
            return Err(SimError::InvalidConfig {
                name: "bootstrap_timeout",
                reason: "must be within 1 ms and a day",
            });
        }
        Ok(())
    }
}

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
    /// [`SimError::Stopped`] when the worker has stopped.
    pub async fn cached_prefix_blocks(&self, prompt: &[u32]) -> Result<u32> {
        let (ack, answer) = tokio::sync::oneshot::channel();
        let lookup = Command::Lookup {
            prompt: prompt.to_vec(),
            ack,
        };
        self.commands
            .send(lookup)
            .await
            .map_err(|_| SimError::Stopped)?;
        let pages = answer.await.map_err(|_| SimError::Stopped)?;
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
            (EventSink::Zmq(publisher), zmq_pub, zmq_replay, None)
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
        .map_err(|source| SimError::Io {
            context: "cannot bind the HTTP listener",
            source,
        })?;
    let http = listener.local_addr().map_err(|source| SimError::Io {
        context: "cannot read the HTTP listener's address",
        source,
    })?;

    let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
    let (snapshot_tx, snapshot) = watch::channel(Snapshot::default());
    let (shutdown, shutdown_rx) = watch::channel(false);
    let driver = Driver {
        engine,
        sink,
        speedup: cfg.speedup,
        commands,
        snapshot: snapshot_tx,
        shutdown: shutdown_rx.clone(),
        epoch: Instant::now(),
        next_id: 0,
        requests: HashMap::new(),
        last_end: Duration::ZERO,
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
    });
    let app = http::router(state, cfg.max_body_bytes);
    let mut stop = shutdown_rx;
    let server = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                // Also ends when the handle is gone.
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!("simulated worker HTTP server failed: {e}");
        }
    });
    tracing::info!(%http, zmq = %zmq_pub, replay = %zmq_replay, role = %cfg.role,
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
        snapshot,
        shutdown,
        driver: Some(driver),
        server: Some(server),
    })
}

/// `port + by`, or 0 if `port` is 0 (any free port).
fn offset_port(port: u16, by: usize, name: &'static str) -> Result<u16> {
    if port == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(port).saturating_add(by)).map_err(|_| SimError::InvalidConfig {
        name,
        reason: "the workers' ports would run past 65535",
    })
}

/// `tcp://HOST:PORT` with its port moved by `by` (unless it is 0).
fn offset_endpoint(endpoint: &str, by: usize, name: &'static str) -> Result<String> {
    let bad = SimError::InvalidConfig {
        name,
        reason: "must be tcp://HOST:PORT",
    };
    let Some((head, port)) = endpoint.rsplit_once(':') else {
        return Err(bad);
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(bad);
    };
    Ok(format!("{head}:{}", offset_port(port, by, name)?))
}

/// The configuration of worker `i` of a cluster built from `base`: HTTP port `base + i`,
/// PUB port `base + 2i`, replay port `base + 2i` (ports 0 stay 0: any free port; the ZMQ
/// endpoints are left as they are with [`EventFormat::Trtllm`], which binds none).
pub fn cluster_member(base: &SimWorkerConfig, i: usize) -> Result<SimWorkerConfig> {
    let mut cfg = base.clone();
    cfg.http
        .set_port(offset_port(base.http.port(), i, "http port")?);
    if cfg.events.is_trtllm() {
        return Ok(cfg);
    }
    let twice = i.saturating_mul(2);
    cfg.zmq_pub = offset_endpoint(&base.zmq_pub, twice, "zmq_pub")?;
    cfg.zmq_replay = offset_endpoint(&base.zmq_replay, twice, "zmq_replay")?;
    Ok(cfg)
}

/// Starts `n` workers of `base`'s role (see [`cluster_member`] for their ports), sharing one
/// tokenizer. On a failure the workers already started are stopped.
pub async fn spawn_cluster(
    n: usize,
    base: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    let roles = vec![base.role; n];
    spawn_mixed_cluster(&roles, base, tokenizer).await
}

/// Starts one worker per entry of `roles`, worker `i` with role `roles[i]` (a disaggregated
/// deployment, e.g. `[Prefill, Prefill, Decode, Decode]`); otherwise as [`spawn_cluster`].
pub async fn spawn_mixed_cluster(
    roles: &[SimRole],
    base: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    if roles.is_empty() {
        return Err(SimError::InvalidConfig {
            name: "workers",
            reason: "must be at least 1",
        });
    }
    base.validate()?;
    let mut workers = Vec::with_capacity(roles.len());
    for (i, &role) in roles.iter().enumerate() {
        let started = match cluster_member(&base, i) {
            Ok(cfg) => spawn_worker(SimWorkerConfig { role, ..cfg }, tokenizer.clone()).await,
            Err(e) => Err(e),
        };
        match started {
            Ok(w) => workers.push(w),
            Err(e) => {
                for w in workers {
                    w.shutdown().await;
                }
                return Err(e);
            }
        }
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ports_step_by_one_and_two() {
        let base = SimWorkerConfig {
            http: "127.0.0.1:8100".parse().unwrap(),
            zmq_pub: "tcp://127.0.0.1:9100".into(),
            zmq_replay: "tcp://127.0.0.1:9101".into(),
            ..SimWorkerConfig::default()
        };
        let m = cluster_member(&base, 2).unwrap();
        assert_eq!(m.http.port(), 8102);
        assert_eq!(m.zmq_pub, "tcp://127.0.0.1:9104");
        assert_eq!(m.zmq_replay, "tcp://127.0.0.1:9105");
        let any = cluster_member(&SimWorkerConfig::default(), 3).unwrap();
        assert_eq!(any, SimWorkerConfig::default());
        let high = SimWorkerConfig {
            http: "127.0.0.1:65535".parse().unwrap(),
            ..SimWorkerConfig::default()
        };
        assert!(cluster_member(&high, 1).is_err());
        let bad = SimWorkerConfig {
            zmq_pub: "nonsense".into(),
            ..SimWorkerConfig::default()
        };
        assert!(cluster_member(&bad, 0).is_err());
    }

    #[test]
    fn transfer_and_bootstrap_timeout_are_validated() {
        let bad_link = SimWorkerConfig {
            transfer: TransferModel {
                link_gbps: 0.0,
                ..TransferModel::default()
            },
            ..SimWorkerConfig::default()
        };
        assert!(bad_link.validate().is_err());
        for t in [Duration::ZERO, Duration::from_secs(86_401)] {
            let cfg = SimWorkerConfig {
                bootstrap_timeout: t,
                ..SimWorkerConfig::default()
            };
            assert!(cfg.validate().is_err());
        }
        SimWorkerConfig::default().validate().unwrap();
        let empty = SimWorkerConfig {
            events: EventFormat::Trtllm { buffer: 0 },
            ..SimWorkerConfig::default()
        };
        assert!(empty.validate().is_err());
        let trt = SimWorkerConfig {
            events: EventFormat::trtllm(),
            ..SimWorkerConfig::default()
        };
        trt.validate().unwrap();
    }

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

    #[tokio::test]
    async fn a_mixed_cluster_gives_each_worker_its_role() {
        let roles = [SimRole::Prefill, SimRole::Decode, SimRole::Aggregated];
        let ws = spawn_mixed_cluster(&roles, SimWorkerConfig::default(), None)
            .await
            .unwrap();
        assert_eq!(ws.iter().map(|w| w.role()).collect::<Vec<_>>(), roles);
        assert_ne!(ws[0].engine_id(), ws[1].engine_id());
        for w in ws {
            w.shutdown().await;
        }
        assert!(
            spawn_mixed_cluster(&[], SimWorkerConfig::default(), None)
                .await
                .is_err()
        );
    }

    #[test]
    fn speedup_must_be_positive_and_finite() {
        for speedup in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = SimWorkerConfig {
                speedup,
                ..SimWorkerConfig::default()
            };
            assert!(cfg.validate().is_err());
        }
    }
}
