//! `round-robin` mode: cycle over the registered worker keys in key order.
//!
//! The cursor is the last key chosen, not a position, so adding or removing workers never
//! makes the cycle skip or repeat a surviving key: the next choice is the first candidate
//! after the cursor in key order, wrapping around.
//!
//! # Invariants
//! 1. Over `n` consecutive calls with the same `n` non-busy candidates, every candidate is
//!    chosen exactly once.

use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::WorkerKey;
use crate::sched::config::RouteMode;
use crate::sched::policy::{Policy, SelectionInput};

/// The `round-robin` policy; its cursor persists across calls.
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundRobin {
    last: Option<WorkerKey>,
}

impl Policy for RoundRobin {
    fn mode(&self) -> RouteMode {
        RouteMode::RoundRobin
    }

    fn select(&mut self, input: &SelectionInput<'_>, _rng: &mut SmallRng) -> Result<WorkerKey> {
        let c = input.candidates;
        let next = match self.last {
            Some(last) => c.partition_point(|s| s.key <= last),
            None => 0,
        };
        let key = c
            .get(next)
            .or_else(|| c.first())
            .map(|s| s.key)
            .ok_or(EngineError::NoWorkers)?;
        self.last = Some(key);
        Ok(key)
    }
}
