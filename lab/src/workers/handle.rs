//! One simulated worker: [`spawn_worker`] starts its tasks (the driver, the HTTP server
//! and, in vLLM format, the publisher's replay task; see the workers module), and the
//! [`SimWorkerHandle`] it returns is how the worker is found, asked, broken (the fault
//! methods, [`super::faults`]) and stopped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::WorkerId;
use sim::engine::SimEngine;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use transport::hub::Registration;
use transport::openai::tokenize::PromptTokenizer;
use transport::zmq::VllmPublisher;
use wire::kv_events::WireBatch;

use super::command::{Command, LOG_TARGET, Snapshot};
use super::config::{EventFormat, SimWorkerConfig};
use super::driver::{Driver, EventSink, ZmqSink};
use super::error::{Result, WorkerError};
use super::faults::{BatchObserver, Counters, Faults, HttpMode, Probe};
use super::role::SimRole;
use super::tokens::Prompter;
use super::trtllm::TrtllmEvents;
use super::{bootstrap, handoff, http, listen};

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

impl SimWorkerHandle {
    /// Its counters (over all its lives).
    pub fn counters(&self) -> &Counters {
        &self.faults.counters
    }

    /// Sets what its HTTP server does from now on.
    pub fn set_http(&self, mode: HttpMode) {
        self.faults.set_mode(mode);
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T> {
        let (ack, answer) = oneshot::channel();
        self.commands
            .send(make(ack))
            .await
            .map_err(|_| WorkerError::Stopped)?;
        answer.await.map_err(|_| WorkerError::Stopped)
    }

    /// Withholds the engine's next `n` batches: numbered and kept for replay, not sent (a
    /// seq gap a subscriber sees at the next batch sent).
    ///
    /// # Errors
    /// [`WorkerError::Stopped`]; [`WorkerError::Unsupported`] for a TensorRT-LLM-format
    /// worker.
    pub async fn withhold(&self, n: u64) -> Result<()> {
        self.ask(|ack| Command::Withhold { n, ack }).await?
    }

    /// Publishes `batches` (not the engine's: a synthetic burst) back to back, after every
    /// batch the engine produced so far; returns how long publishing took. A
    /// TensorRT-LLM-format worker buffers their events instead.
    ///
    /// # Errors
    /// [`WorkerError::Stopped`].
    pub async fn publish_extra(&self, batches: Vec<WireBatch>) -> Result<Duration> {
        self.ask(|ack| Command::PublishExtra { batches, ack })
            .await?
    }

    /// Ends any withholding and publishes an empty batch, so that a gap left by the last
    /// batches shows to a subscriber.
    ///
    /// # Errors
    /// [`WorkerError::Stopped`].
    pub async fn heartbeat(&self) -> Result<()> {
        self.ask(|ack| Command::Heartbeat { ack }).await
    }

    /// Kills the worker's "process" (HTTP refused and its connections reset, requests in
    /// flight dropped, publisher closed), waits `down`, and starts it again: an empty
    /// cache, a new publisher on the same endpoints numbering from 0, HTTP on the same port
    /// (unless [`HttpMode::Refuse`] is set). Returns once it is back.
    ///
    /// # Errors
    /// [`WorkerError::Stopped`]; [`WorkerError::Unsupported`] for a TensorRT-LLM-format
    /// worker; [`WorkerError::Transport`] when its ports could not be bound again within
    /// 10 s (it then stays down).
    pub async fn restart(&self, down: Duration) -> Result<()> {
        self.ask(|ack| Command::Restart { down, ack }).await?
    }

    /// Whether the worker is idle, and what its engine caches, as of now (every command
    /// sent before this one has been handled).
    ///
    /// # Errors
    /// [`WorkerError::Stopped`].
    pub async fn probe(&self) -> Result<Probe> {
        self.ask(|ack| Command::Probe { ack }).await
    }
}

/// Starts one worker on the current tokio runtime: binds its ZMQ (vLLM format only) and
/// HTTP sockets (port 0 allowed: the handle tells the bound ones) and spawns its tasks.
/// `tokenizer`: the model's tokenizer (`None`: the built-in fallback, see [`super::tokens`]).
pub async fn spawn_worker(
    cfg: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<SimWorkerHandle> {
    spawn_worker_observed(cfg, tokenizer, None).await
}

/// [`spawn_worker`], with `observer` shown every batch the engine publishes (vLLM format;
/// see [`super::faults`]).
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
    use crate::workers::cluster_member;

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
