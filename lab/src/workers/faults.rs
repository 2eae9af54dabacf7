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
//! This module holds what the faults' three parties share: the state ([`Counters`], the
//! HTTP mode, whether the server is up), the observer and probe types. Each party's side
//! lives with it: the handle's fault methods ([`SimWorkerHandle::withhold`],
//! [`SimWorkerHandle::restart`], ..) in `handle.rs`, the driver's (the fault commands it
//! runs) in [`super::driver`], the HTTP server's (500s, refusals) in `http.rs` and
//! `listen.rs`.
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
//!
//! [`SimWorkerHandle::publish_extra`]: super::SimWorkerHandle::publish_extra
//! [`SimWorkerHandle::withhold`]: super::SimWorkerHandle::withhold
//! [`SimWorkerHandle::restart`]: super::SimWorkerHandle::restart

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64};
use std::time::Duration;

use tokio::sync::watch;
use wire::kv_events::WireBatch;

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
    /// Batches published through
    /// [`SimWorkerHandle::publish_extra`](super::SimWorkerHandle::publish_extra).
    pub extra: AtomicU64,
    /// Empty batches published by
    /// [`SimWorkerHandle::heartbeat`](super::SimWorkerHandle::heartbeat).
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

/// The answer to [`SimWorkerHandle::probe`](super::SimWorkerHandle::probe).
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

    pub(super) fn set_mode(&self, mode: HttpMode) {
        self.mode.store(mode as u8, Relaxed);
        self.refresh();
    }

    pub(super) fn set_restarting(&self, restarting: bool) {
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
