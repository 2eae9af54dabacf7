//! The task that owns one [`SimEngine`] and drives it in real time.
//!
//! It receives [`Command`]s over a channel, runs [`SimEngine::step`] whenever there is work,
//! sleeps each step's duration divided by the speedup, then hands the step's outputs to the
//! requests' channels and publishes its KV events (over ZMQ, or into the TensorRT-LLM
//! buffer). Simulated time is elapsed real time times the speedup: while the engine stays
//! busy, steps follow each other back to back in simulated time (the driver sleeps until
//! each step's end in real time, or runs on without sleeping when it is behind, so timer
//! granularity never slows the simulation down); after an idle spell the next step starts
//! at the current simulated time.
//!
//! Commands are taken between steps, after the last step's events were handed on; the
//! fault commands ([`super::faults`]: withholding batches, publishing batches that are not
//! the engine's, restarting the worker, probing whether it is idle) run there too.
//!
//! What it is sent and sends ([`Command`], [`Delivery`], [`Snapshot`]) is defined in the
//! leaf module both sides share (`command.rs`) and re-exported here.
//!
//! # Invariants
//! 1. A request's channel receives, in order, one [`Delivery::First`], then
//!    [`Delivery::Token`]s, then [`Delivery::Finished`], unless it is aborted.
//! 2. A request whose receiver is gone (the client went away) is aborted in the engine before
//!    the next step, or as soon as a delivery to it fails.
//! 3. After every command and step the [`Snapshot`] is current.
//! 4. The driver stops when told to or when every command sender is gone; dropping it drops
//!    every request's channel (their clients see the stream end).
//! 5. Every batch the engine produces is handed on in engine order, on the publisher of the
//!    engine's life (a restart replaces both), before the driver takes its next command:
//!    shown to the [`BatchObserver`] with the number the publisher gives it, then published
//!    or, while batches are withheld, numbered and kept for replay only.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use engine::RequestId;
use sim::engine::{EngineConfig, NewRequest, Output, SimEngine};
use tokio::sync::{mpsc, watch};
use transport::zmq::VllmPublisher;
use wire::kv_events::WireBatch;

pub use super::command::{Command, Delivery, Snapshot};

use super::command::LOG_TARGET;
use super::error::{Result, WorkerError};
use super::faults::{BatchObserver, Faults, Probe, REBIND_FOR};
use super::trtllm::TrtllmEvents;

/// Where the driver hands the engine's KV events.
pub(super) enum EventSink {
    /// vLLM's: published over ZMQ.
    Zmq(ZmqSink),
    /// TensorRT-LLM's: buffered for `POST /kv_cache_events`.
    Trtllm(Arc<TrtllmEvents>),
}

/// A vLLM-format worker's publisher, and what it takes to bind it again after a restart.
pub(super) struct ZmqSink {
    /// `None` only while the worker is down for a restart.
    pub(super) publisher: Option<VllmPublisher>,
    /// The bound PUB endpoint (a restart binds the same one).
    pub(super) endpoint: String,
    /// The bound replay endpoint.
    pub(super) replay: String,
    /// Batches kept for replay.
    pub(super) buffer: usize,
}

/// The driver's state.
pub(super) struct Driver {
    pub(super) engine: SimEngine,
    /// What the engine was built from (a restart builds a new one).
    pub(super) engine_config: EngineConfig,
    pub(super) sink: EventSink,
    pub(super) speedup: f64,
    pub(super) commands: mpsc::Receiver<Command>,
    pub(super) snapshot: watch::Sender<Snapshot>,
    pub(super) shutdown: watch::Receiver<bool>,
    /// Real time at simulated time zero (of this life).
    pub(super) epoch: Instant,
    pub(super) next_id: u64,
    pub(super) requests: HashMap<RequestId, mpsc::UnboundedSender<Delivery>>,
    pub(super) last_end: Duration,
    /// Whether the engine has been stepping back to back since its last idle spell.
    pub(super) busy: bool,
    /// The engine's batches still to withhold.
    pub(super) withhold: u64,
    /// The fault state shared with the handle and the HTTP server.
    pub(super) faults: Arc<Faults>,
    /// Shown every engine batch before it is sent.
    pub(super) observer: Option<Box<dyn BatchObserver>>,
}

impl Driver {
    /// Simulated time now.
    fn sim_now(&self) -> Duration {
        Duration::try_from_secs_f64(self.epoch.elapsed().as_secs_f64() * self.speedup)
            .unwrap_or(Duration::MAX)
    }

    /// The real instant of simulated time `t`, if representable.
    fn real_instant(&self, t: Duration) -> Option<Instant> {
        let real = Duration::try_from_secs_f64(t.as_secs_f64() / self.speedup).ok()?;
        self.epoch.checked_add(real)
    }

    pub(super) fn stopping(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Runs until shut down or every command sender is gone.
    pub(super) async fn run(mut self) {
        loop {
            if self.stopping() {
                return;
            }
            loop {
                match self.commands.try_recv() {
                    Ok(cmd) => self.handle(cmd).await,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            self.reap_gone();
            self.publish_snapshot();
            if !self.engine.has_work() {
                self.busy = false;
                tokio::select! {
                    cmd = self.commands.recv() => match cmd {
                        Some(cmd) => self.handle(cmd).await,
                        None => return,
                    },
                    _ = self.shutdown.changed() => return,
                }
                continue;
            }
            // Busy: the next step starts where the last one ended. After an idle spell: now.
            let now = if self.busy {
                self.last_end
            } else {
                self.sim_now()
            };
            self.busy = true;
            let Some(step) = self.engine.step(now) else {
                continue;
            };
            let end = step.end();
            self.last_end = end;
            match self.real_instant(end) {
                Some(deadline) if deadline > Instant::now() => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline.into()) => {}
                        _ = self.shutdown.changed() => return,
                    }
                }
                _ => tokio::task::yield_now().await,
            }
            if let EventSink::Trtllm(events) = &self.sink {
                // Buffered before the outputs go out: a client that got its answer finds the
                // step's events in the next `/kv_cache_events` drain.
                while let Some(batch) = self.engine.poll_events() {
                    events.push_batch(&batch);
                }
            }
            for output in step.outputs {
                self.deliver(output);
            }
            while let Some(batch) = self.engine.poll_events() {
                self.engine_batch(batch).await;
            }
        }
    }

    /// Hands one engine batch on (invariant 5).
    async fn engine_batch(&mut self, mut batch: WireBatch) {
        let z = match &mut self.sink {
            EventSink::Zmq(z) => z,
            EventSink::Trtllm(events) => {
                events.push_batch(&batch);
                return;
            }
        };
        // Only while down for a restart, when the engine has no work.
        let Some(publisher) = z.publisher.as_mut() else {
            return;
        };
        // vLLM stamps batches with the wall clock (`time.time()`); routers measure ingest
        // lag against it.
        batch.ts = wall_ts();
        if let Some(observer) = &mut self.observer {
            observer.batch(&batch, publisher.next_seq());
        }
        let counters = &self.faults.counters;
        if self.withhold > 0 {
            publisher.withhold(&batch);
            self.withhold -= 1;
            counters.withheld.fetch_add(1, Relaxed);
            counters.withhold_pending.store(self.withhold, Relaxed);
            return;
        }
        if let Err(e) = publisher.publish(&batch).await {
            tracing::warn!(
                target: LOG_TARGET,
                endpoint = publisher.endpoint(),
                "cannot publish KV events: {e}"
            );
        }
        counters.published.fetch_add(1, Relaxed);
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add {
                prompt,
                max_tokens,
                remote_prefill,
                out,
                ack,
            } => {
                let id = RequestId(self.next_id);
                let added = self.engine.add_request(NewRequest {
                    id,
                    prompt,
                    max_tokens,
                    lora_name: None,
                    remote_prefill,
                });
                let reply = match added {
                    Ok(()) => {
                        self.next_id += 1;
                        self.requests.insert(id, out);
                        Ok(id)
                    }
                    Err(e) => Err(e),
                };
                if ack.send(reply).is_err() {
                    // The handler went away before hearing back.
                    self.abort(id);
                }
            }
            Command::Abort(id) => self.abort(id),
            Command::Lookup { prompt, ack } => {
                // The asker may have gone away: nothing to undo.
                let _ = ack.send(self.engine.cached_prefix_pages(&prompt, None));
            }
            Command::Withhold { n, ack } => {
                let _ = ack.send(self.start_withholding(n));
            }
            Command::PublishExtra { batches, ack } => {
                let _ = ack.send(self.publish_extra(batches).await);
            }
            Command::Heartbeat { ack } => {
                self.heartbeat().await;
                let _ = ack.send(());
            }
            Command::Restart { down, ack } => {
                let _ = ack.send(self.restart(down).await);
            }
            Command::Probe { ack } => {
                let _ = ack.send(Probe {
                    idle: self.requests.is_empty() && !self.engine.has_work(),
                    cached_blocks: self.engine.stats().cached_blocks,
                });
            }
        }
    }

    fn abort(&mut self, id: RequestId) {
        self.requests.remove(&id);
        if self.engine.is_active(id) {
            // Cannot fail: the request is in flight.
            let _ = self.engine.abort(id);
        }
    }

    /// Aborts the requests whose clients went away.
    fn reap_gone(&mut self) {
        let gone: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            tracing::debug!(target: LOG_TARGET, request = id.0, "client went away: aborting");
            self.abort(id);
        }
    }

    fn deliver(&mut self, output: Output) {
        let id = output.id();
        let (delivery, last) = match output {
            Output::FirstToken {
                token,
                prompt_tokens,
                cached_tokens,
                ..
            } => (
                Delivery::First {
                    token,
                    prompt_tokens,
                    cached_tokens,
                },
                false,
            ),
            Output::Token { token, .. } => (Delivery::Token(token), false),
            Output::Finished { output_tokens, .. } => (Delivery::Finished { output_tokens }, true),
        };
        let sent = self
            .requests
            .get(&id)
            .is_some_and(|tx| tx.send(delivery).is_ok());
        if last {
            self.requests.remove(&id);
        } else if !sent {
            self.abort(id);
        }
    }

    pub(super) fn publish_snapshot(&self) {
        self.snapshot.send_replace(Snapshot {
            load: self.engine.load(),
            stats: self.engine.stats(),
            sim_time: self.last_end,
        });
    }
}

/// The driver's side of the faults ([`super::faults`]): the fault commands, run between
/// steps (the faults' invariant 1).
impl Driver {
    pub(super) fn start_withholding(&mut self, n: u64) -> Result<()> {
        if !matches!(self.sink, EventSink::Zmq(_)) {
            return Err(WorkerError::Unsupported("withholding batches"));
        }
        self.withhold = n;
        self.faults.counters.withhold_pending.store(n, Relaxed);
        Ok(())
    }

    pub(super) async fn publish_extra(&mut self, batches: Vec<WireBatch>) -> Result<Duration> {
        let began = Instant::now();
        let n = batches.len() as u64;
        match &mut self.sink {
            EventSink::Trtllm(events) => batches.iter().for_each(|b| events.push_batch(b)),
            EventSink::Zmq(z) => {
                let Some(p) = z.publisher.as_mut() else {
                    return Err(WorkerError::Stopped);
                };
                for b in &batches {
                    if let Err(e) = p.publish(b).await {
                        tracing::warn!(target: LOG_TARGET, endpoint = p.endpoint(),
                                       "cannot publish an extra batch: {e}");
                    }
                }
            }
        }
        self.faults.counters.extra.fetch_add(n, Relaxed);
        Ok(began.elapsed())
    }

    pub(super) async fn heartbeat(&mut self) {
        // A heartbeat closes any withholding that found no batch to withhold.
        self.withhold = 0;
        self.faults.counters.withhold_pending.store(0, Relaxed);
        let EventSink::Zmq(z) = &mut self.sink else {
            return;
        };
        let Some(p) = z.publisher.as_mut() else {
            return;
        };
        let empty = WireBatch {
            ts: wall_ts(),
            dp_rank: Some(self.engine_config.dp_rank),
            events: Vec::new(),
            unknown_events: 0,
        };
        if let Err(e) = p.publish(&empty).await {
            tracing::warn!(target: LOG_TARGET, endpoint = p.endpoint(),
                           "cannot publish a heartbeat: {e}");
        }
        self.faults.counters.heartbeats.fetch_add(1, Relaxed);
    }

    /// See [`super::SimWorkerHandle::restart`] and the faults' invariant 3 ([`super::faults`]).
    pub(super) async fn restart(&mut self, down: Duration) -> Result<()> {
        let EventSink::Zmq(z) = &mut self.sink else {
            return Err(WorkerError::Unsupported("a restart"));
        };
        z.publisher = None;
        let (endpoint, replay, buffer) = (z.endpoint.clone(), z.replay.clone(), z.buffer);
        self.faults.set_restarting(true);
        self.withhold = 0;
        let counters = &self.faults.counters;
        counters.withhold_pending.store(0, Relaxed);
        counters
            .failed
            .fetch_add(self.requests.len() as u64, Relaxed);
        self.requests.clear();
        tokio::select! {
            () = tokio::time::sleep(down) => {}
            _ = self.shutdown.changed() => return Err(WorkerError::Stopped),
        }
        // The configuration was validated when the worker started.
        self.engine = SimEngine::new(self.engine_config.clone())?;
        if let Some(observer) = &mut self.observer {
            observer.restarted();
        }
        self.epoch = Instant::now();
        self.busy = false;
        self.last_end = Duration::ZERO;
        self.publish_snapshot();
        let began = Instant::now();
        let publisher = loop {
            match VllmPublisher::bind(&endpoint, Some(&replay), buffer).await {
                Ok(p) => break p,
                Err(_) if began.elapsed() < REBIND_FOR && !self.stopping() => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        if let EventSink::Zmq(z) = &mut self.sink {
            z.publisher = Some(publisher);
        }
        self.faults.counters.restarts.fetch_add(1, Relaxed);
        self.faults.set_restarting(false);
        tracing::info!(target: LOG_TARGET, %endpoint, "simulated worker restarted");
        Ok(())
    }
}

/// The wall clock in seconds since the epoch, as vLLM stamps its batches (`time.time()`).
pub(super) fn wall_ts() -> Option<f64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}
