//! The faults a simulated worker can be made to show, for harnesses that break workers on
//! purpose (the soak, `crate::soak`): its publisher withholds batches (numbered and kept
//! for replay, never sent, as a ZMQ high-water-mark overflow drops them), publishes batches
//! that are not the engine's (a synthetic burst), or is killed and re-bound on the same
//! ports numbering from 0 with an empty cache (a restarted vLLM process); its HTTP server
//! answers 500 or refuses connections ([`HttpMode`]). A [`BatchObserver`] sees every engine
//! batch with the number it is published under, so a harness can model the worker's cache.
//!
//! Workers nobody breaks pay for this with a few relaxed counters.
//!
//! # Invariants
//! 1. Faults run in the driver between steps, after the last step's batches were handed
//!    on: a fault never splits a step's batches.
//! 2. Batches given to [`SimWorkerHandle::publish_extra`] and heartbeats are not the
//!    engine's: the observer does not see them and they are never withheld.
//! 3. While a worker is down for a restart nothing is published, its HTTP port refuses
//!    connections and the connections it had are reset, and the requests it was serving are
//!    dropped (counted in [`Counters::failed`]), as a killed process's would be. It comes
//!    back with a new engine (empty cache, simulated time from 0) and a new publisher on the
//!    same endpoints numbering from 0; request ids keep counting, so an abort meant for a
//!    request of the previous life never reaches one of the new.
//! 4. [`HttpMode::Fail500`] answers 500 to completions and `GET /health` and changes
//!    nothing else; [`HttpMode::Refuse`] closes the listener and aborts every connection
//!    until the mode changes back. The HTTP server is up exactly when the mode is not
//!    `Refuse` and no restart is under way.
//!
//! # Concurrency
//! `Faults` is shared by the driver, the HTTP server and the handle. Counters and the mode
//! are relaxed atomics (read for reports and between requests, never to order other
//! memory); whether the server is up is a `watch` the accept loop waits on.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64};
use std::time::{Duration, Instant};

use sim::engine::SimEngine;
use tokio::sync::{oneshot, watch};
use transport::zmq::VllmPublisher;
use wire::kv_events::WireBatch;

use super::driver::{Command, Driver, EventSink, wall_ts};
use super::error::{Result, WorkerError};
use super::{LOG_TARGET, SimWorkerHandle};

/// How long the re-bind of a restarted worker's ports is retried.
pub(super) const REBIND_FOR: Duration = Duration::from_secs(10);

/// What a worker's HTTP server does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HttpMode {
    /// Serve normally.
    #[default]
    Serve = 0,
    /// Answer 500 to completions and health checks (a sick worker).
    Fail500 = 1,
    /// Close the listener and every connection (connections refused).
    Refuse = 2,
}

/// A worker's counters, over all its lives.
#[derive(Debug, Default)]
pub struct Counters {
    /// Engine batches sent on the live stream (vLLM format).
    pub published: AtomicU64,
    /// Engine batches numbered and kept for replay but not sent.
    pub withheld: AtomicU64,
    /// Engine batches still to withhold.
    pub withhold_pending: AtomicU64,
    /// Batches published through [`SimWorkerHandle::publish_extra`].
    pub extra: AtomicU64,
    /// Empty batches published by [`SimWorkerHandle::heartbeat`].
    pub heartbeats: AtomicU64,
    /// Completions (`/v1/completions`, `/v1/chat/completions`) answered 200.
    pub completions: AtomicU64,
    /// Completions answered 500 by [`HttpMode::Fail500`], or dropped by a restart.
    pub failed: AtomicU64,
    /// Restarts.
    pub restarts: AtomicU64,
}

/// What the driver shows a harness of every engine batch, in engine order, before the
/// batch is published or withheld (vLLM format only).
///
/// Runs on the driver's task between steps: an implementation MUST NOT block for long
/// (a short mutex is fine) and MUST NOT call back into the worker.
pub trait BatchObserver: Send + 'static {
    /// The engine's batch `batch` gets number `seq` on the worker's publisher.
    fn batch(&mut self, batch: &WireBatch, seq: u64);
    /// The worker restarted: its cache is empty and its publisher numbers from 0 again.
    fn restarted(&mut self);
}

/// The answer to [`SimWorkerHandle::probe`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// No request in flight and no engine work: no KV event can come until the next
    /// request (every batch produced so far has been handed on).
    pub idle: bool,
    /// Blocks the engine caches.
    pub cached_blocks: u64,
}

/// The fault state shared by the driver, the HTTP server and the handle.
#[derive(Debug)]
pub(super) struct Faults {
    pub(super) counters: Counters,
    mode: AtomicU8,
    restarting: AtomicBool,
    /// Whether the HTTP server is up (see invariant 4).
    up: watch::Sender<bool>,
}

impl Faults {
    pub(super) fn new() -> Self {
        Self {
            counters: Counters::default(),
            mode: AtomicU8::new(HttpMode::Serve as u8),
            restarting: AtomicBool::new(false),
            up: watch::Sender::new(true),
        }
    }

    pub(super) fn mode(&self) -> HttpMode {
        match self.mode.load(Relaxed) {
            1 => HttpMode::Fail500,
            2 => HttpMode::Refuse,
            _ => HttpMode::Serve,
        }
    }

    fn set_mode(&self, mode: HttpMode) {
        self.mode.store(mode as u8, Relaxed);
        self.refresh();
    }

    fn set_restarting(&self, restarting: bool) {
        self.restarting.store(restarting, Relaxed);
        self.refresh();
    }

    fn refresh(&self) {
        let up = self.mode() != HttpMode::Refuse && !self.restarting.load(Relaxed);
        self.up.send_if_modified(|u| std::mem::replace(u, up) != up);
    }

    /// Follows whether the HTTP server should be up.
    pub(super) fn watch_up(&self) -> watch::Receiver<bool> {
        self.up.subscribe()
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

/// The driver's side of the faults.
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

    /// See [`SimWorkerHandle::restart`] and invariant 3.
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
