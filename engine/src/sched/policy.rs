//! The interface every routing mode implements.
//!
//! The scheduler does everything modes share (validation, busy filtering, scoring, recording
//! the request as active); a [`Policy`] only says which keys it may choose among and picks
//! one of the scored candidates. One policy per file: [`kv`](super::kv),
//! [`round_robin`](super::round_robin), [`random`](super::random), [`direct`](super::direct).
//!
//! # Invariants
//! 1. A policy never sees an empty candidate list from the scheduler, and the key it returns
//!    is one of the candidates'.
//! 2. All randomness comes from the `rng` argument, so a scheduler with a fixed seed makes
//!    the same decisions for the same calls.

use std::fmt;

use rand::rngs::SmallRng;

use crate::error::Result;
use crate::ids::{WorkerId, WorkerKey};
use crate::sched::active::ActiveLoad;
use crate::sched::config::{RouteMode, WorkerLoad};
use crate::sched::cost::CandidateScore;

/// Which registered worker keys a policy may choose among.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every registered key.
    All,
    /// The data-parallel ranks of one worker.
    Worker(WorkerId),
}

/// What a candidate key carries now, for a policy that weighs load its own way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KeyLoad {
    /// The load the router's active requests put on the key.
    pub active: ActiveLoad,
    /// What the key last reported about itself (scraped metrics), if it ever did.
    pub reported: Option<WorkerLoad>,
}

/// What a policy chooses from.
pub struct SelectionInput<'a> {
    /// Scored candidates: non-empty, sorted by key, each key once.
    pub candidates: &'a [CandidateScore],
    /// Softmax temperature: finite and non-negative.
    pub temperature: f64,
    /// Full blocks in the request (what an overlap is a share of).
    pub request_blocks: u64,
    /// Blocks each key caches in total (tie-break: fewer is better). Pure; may be called
    /// more than once per key.
    pub cached_blocks: &'a dyn Fn(WorkerKey) -> u64,
    /// Each candidate's current load (the built-in modes read it through the scores).
    pub load: &'a dyn Fn(WorkerKey) -> KeyLoad,
}

impl fmt::Debug for SelectionInput<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SelectionInput")
            .field("candidates", &self.candidates)
            .field("temperature", &self.temperature)
            .finish_non_exhaustive()
    }
}

/// A routing mode.
pub trait Policy {
    /// The mode this policy implements (reported in every decision).
    fn mode(&self) -> RouteMode;

    /// The keys the scheduler should score for this policy.
    ///
    /// The scheduler guarantees that if the scope names a worker with no registered rank,
    /// the call fails with `UnknownWorker` before [`Policy::select`] runs.
    fn scope(&self) -> Scope {
        Scope::All
    }

    /// Chooses one candidate.
    ///
    /// The caller guarantees `input.candidates` is non-empty, sorted by key with each key
    /// once, that every logit is finite, and that the temperature is finite and >= 0; busy
    /// keys are already filtered out.
    ///
    /// The implementation MUST return the key of one of `input.candidates`, MUST draw any
    /// randomness from `rng` only, and MUST NOT block or allocate per candidate: it runs
    /// once per routed request.
    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey>;
}

/// A candidate with the given overlap and predicted TTFT and every other field 0, for the
/// policies' tests.
#[cfg(test)]
pub(crate) fn test_candidate(worker: u64, overlap_blocks: u32, ttft_ms: f64) -> CandidateScore {
    CandidateScore {
        key: WorkerKey::new(worker, 0),
        overlap_blocks,
        prefill_blocks: 0.0,
        decode_blocks: 0,
        predicted_ttft_ms: ttft_ms,
        logit: 0.0,
    }
}
