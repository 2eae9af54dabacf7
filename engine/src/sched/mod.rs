//! Worker selection: active-request tracking, the cost function and the routing modes.
//!
//! A [`Scheduler`] owns the registered worker keys, the load they report, the requests routed
//! to them and not finished yet, and a seeded RNG. [`Scheduler::route`] scores each candidate
//! key with the cost of DESIGN.md "Choosing a worker", lets the mode's [`Policy`] choose, and
//! returns a [`Decision`] that lists every candidate's score.
//!
//! # Components
//! * [`config`]: configuration, per-call overrides, reported load, busy thresholds.
//! * `workers`: registered keys with dense slot numbers (crate-private).
//! * `active`: active requests and the load they put on each key (crate-private).
//! * [`cost`]: the cost of one request on one key (Dynamo's formula or predicted TTFT).
//! * [`ttft`]: each key's prefill model, fitted online from observed TTFTs.
//! * [`drain`]: each key's prefill queue as a clock, corrected by first tokens.
//! * `candidates`: gathering and scoring one call's candidates (crate-private).
//! * [`policy`]: the trait every mode implements; one mode per file: [`kv`],
//!   [`round_robin`], [`random`], [`direct`], and the peers' policies, measured beside
//!   ours: [`sglang`], [`llmd`], [`power_of_two`].
//! * [`disagg`]: conditional disaggregation (prefill remotely or on the decode worker).
//! * [`role`]: worker roles of a disaggregated deployment and the pool a call chooses from.
//! * [`transfer`]: the KV-transfer time model shared with the simulated workers.
//! * [`scheduler`]: the [`Scheduler`] tying them together.
//!
//! # Invariants
//! 1. Sans-IO: no clock reads (every time-dependent call takes `now`), no I/O, no threads.
//! 2. No input reaches a panic: every refusal is an [`crate::EngineError`] and changes nothing.
//! 3. Everything is per worker key; removing a worker removes all its ranks and their
//!    requests.

mod active;
mod candidates;
pub mod config;
pub mod cost;
pub mod direct;
pub mod disagg;
pub mod drain;
pub mod kv;
pub mod llmd;
pub mod policy;
pub mod power_of_two;
pub mod random;
pub mod role;
pub mod round_robin;
pub mod scheduler;
pub mod sglang;
pub mod transfer;
pub mod ttft;
mod workers;

pub use active::ActiveLoad;
pub use config::{
    BusyThresholds, RouteMode, RouteOverrides, RouterCost, SchedulerConfig, WorkerLoad,
};
pub use cost::CandidateScore;
pub use disagg::{Split, SplitConfig, SplitMode};
pub use policy::{KeyLoad, Policy, Scope, SelectionInput};
pub use role::{Pool, WorkerRole};
pub use scheduler::{
    Decision, KeyState, RouteRequest, Scheduler, ShadowDecision, ShadowSpec, WorkerRemoval,
};
pub use transfer::TransferModel;
