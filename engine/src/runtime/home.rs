//! Which core is a worker's home: the one that holds its directories and applies its
//! events.
//!
//! A leaf of the runtime: the clients (to send a worker's events and calls to one core) and
//! the cores (to pick their own workers out of a shared event slice) both ask it.
//!
//! # Invariants
//! 1. A pure function of the worker id and the core count: every client and every core
//!    agree on a worker's home without talking to each other.
//! 2. The result is below the core count (core 0 when the count is 0).

use crate::ids::WorkerId;
use crate::sharding::ShardId;

/// The core that owns `worker`'s directories: the worker id modulo the cores.
///
/// Worker ids are usually small and sequential (`--zmq-worker 1=...`), which modulo spreads
/// exactly evenly, or random 64-bit instance ids, which it spreads as well as any hash.
/// A hash of sequential ids is uneven by about the square root of the count (measured on
/// Dynamo's 128-worker benchmark: 59 and 69 workers on 2 cores, and the busier core set
/// the removal rate). Ids strided by the core count would all share a home; that is the
/// pattern to avoid when numbering workers.
pub fn home_core(worker: WorkerId, cores: usize) -> ShardId {
    ShardId((worker.0 % cores.max(1) as u64) as u16)
}
