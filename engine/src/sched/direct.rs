//! `direct` mode: the caller names the worker; the KV cost chooses among its ranks.
//!
//! Each data-parallel rank is its own engine with its own cache and queue, so naming a worker
//! still leaves a real choice, made exactly as in `kv` mode.
//!
//! # Invariants
//! 1. The chosen key's worker is the named worker; an unregistered worker is refused with
//!    `UnknownWorker` by the scheduler (see [`Policy::scope`]).

use rand::rngs::SmallRng;

use crate::error::Result;
use crate::ids::{WorkerId, WorkerKey};
use crate::sched::config::RouteMode;
use crate::sched::kv::select_by_cost;
use crate::sched::policy::{Policy, Scope, SelectionInput};

/// The `direct` policy for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Direct {
    /// The worker the caller named.
    pub worker: WorkerId,
}

impl Policy for Direct {
    fn mode(&self) -> RouteMode {
        RouteMode::Direct
    }

    fn scope(&self) -> Scope {
        Scope::Worker(self.worker)
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        select_by_cost(input, rng)
    }
}
