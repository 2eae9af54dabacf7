//! `random` mode: a uniformly random candidate from the scheduler's seeded RNG.
//!
//! # Invariants
//! 1. Every non-busy candidate is equally likely, whatever its cost.

use rand::rngs::SmallRng;

use crate::error::Result;
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::kv::uniform;
use crate::sched::policy::{Policy, SelectionInput};

/// The `random` policy.
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn mode(&self) -> RouteMode {
        RouteMode::Random
    }

    fn select(&mut self, input: &SelectionInput<'_>, rng: &mut SmallRng) -> Result<WorkerKey> {
        uniform(input.candidates, rng)
    }
}
