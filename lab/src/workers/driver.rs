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
use sim::engine::{EngineConfig, EngineStats, Load, NewRequest, Output, RemotePrefill, SimEngine};
use tokio::sync::{mpsc, oneshot, watch};
use transport::zmq::VllmPublisher;
use wire::kv_events::WireBatch;

use super::LOG_TARGET;
use super::faults::{BatchObserver, Faults, Probe};
use super::trtllm::TrtllmEvents;

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
    /// order ([`SimEngine::cached_prefix_pages`]).
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
        ack: oneshot::Sender<super::Result<()>>,
    },
    /// Publish batches that are not the engine's, back to back (not shown to the observer,
    /// never withheld); `ack` gets how long that took.
    PublishExtra {
        /// The batches, as they are to be sent.
        batches: Vec<WireBatch>,
        /// The time taken, or why nothing was published.
        ack: oneshot::Sender<super::Result<Duration>>,
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
        ack: oneshot::Sender<super::Result<()>>,
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

/// The wall clock in seconds since the epoch, as vLLM stamps its batches (`time.time()`).
pub(super) fn wall_ts() -> Option<f64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}
