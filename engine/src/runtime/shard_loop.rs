//! The body of a shard thread.
//!
//! # Invariants
//! 1. Messages of one client are handled in the order the client sent them, so a client's
//!    `Sync(n)` is answered only after everything it sent before is applied.
//! 2. Clients are served round-robin: query clients first, up to [`QUERY_BURST`] messages
//!    each, then ingest clients, up to [`INGEST_BURST`] each. An ingest message carries up to
//!    a few thousand block operations, so a query waits behind at most a couple of them.
//! 3. The thread exits only when every inbox is closed and drained: nothing a client sent
//!    is lost on shutdown.
//! 4. A panic in this thread aborts the process (a shard that died would otherwise leave
//!    its partition silently missing from every answer).
//!
//! # Concurrency
//! The [`Shard`] is owned by this thread alone; the only shared state is the rings and the
//! waker.

use super::msg::{FromShard, ShardSummary, ToShard};
use super::waker::Waker;
use crate::ring::{Consumer, PopError, Producer};
use crate::sharding::shard::Shard;
use std::sync::Arc;
use std::time::Duration;

/// Messages taken from one query client before moving to the next (each is one query).
const QUERY_BURST: usize = 64;
/// Messages taken from one ingest client before moving to the next (each is an operation
/// batch of up to `FLUSH_OPS` blocks, see `client.rs`).
const INGEST_BURST: usize = 2;
/// Idle rounds spent spinning, then yielding, before parking.
const SPIN_ROUNDS: u32 = 64;
const YIELD_ROUNDS: u32 = 1_064;
/// Longest park: bounds the cost of a missed wake-up.
const PARK: Duration = Duration::from_millis(1);

/// Aborts the process if the shard thread unwinds.
struct AbortOnPanic(usize);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "kvengine: shard {} panicked; aborting rather than serving wrong answers",
                self.0
            );
            std::process::abort();
        }
    }
}

pub(crate) struct ShardThread {
    pub shard: Shard,
    pub inboxes: Vec<Consumer<ToShard>>,
    pub replies: Vec<Producer<FromShard>>,
    pub waker: Arc<Waker>,
    pub pinned_core: Option<usize>,
    /// Inboxes `0..ingest_clients` belong to ingest handles, the rest to query handles.
    pub ingest_clients: usize,
}

impl ShardThread {
    pub(crate) fn run(mut self) -> ShardSummary {
        let _guard = AbortOnPanic(self.shard.id().idx());
        self.waker.register_current();
        let mut queries = 0u64;
        let mut open: Vec<bool> = vec![true; self.inboxes.len()];
        let mut idle = 0u32;
        loop {
            let mut progressed = false;
            let ingest = self.ingest_clients;
            let n = self.inboxes.len();
            // Query clients first, then ingest clients.
            for i in (ingest..n).chain(0..ingest.min(n)) {
                let burst = if i < ingest {
                    INGEST_BURST
                } else {
                    QUERY_BURST
                };
                let Some(inbox) = self.inboxes.get_mut(i) else {
                    continue;
                };
                for _ in 0..burst {
                    match inbox.try_pop() {
                        Ok(msg) => {
                            progressed = true;
                            let reply =
                                handle(&mut self.shard, msg, &mut queries, self.pinned_core);
                            if let (Some(r), Some(out)) = (reply, self.replies.get_mut(i)) {
                                // A client that is gone no longer needs its answer.
                                let _ = out.push(r);
                            }
                        }
                        Err(PopError::Empty) => break,
                        Err(PopError::Closed) => {
                            if let Some(o) = open.get_mut(i) {
                                *o = false;
                            }
                            break;
                        }
                    }
                }
            }
            if progressed {
                idle = 0;
                continue;
            }
            if open.iter().all(|o| !o) {
                break;
            }
            idle = idle.saturating_add(1);
            if idle < SPIN_ROUNDS {
                std::hint::spin_loop();
            } else if idle < YIELD_ROUNDS {
                std::thread::yield_now();
            } else {
                self.waker.prepare_sleep();
                if self.inboxes.iter().all(|c| c.is_empty()) {
                    self.waker.sleep(PARK);
                } else {
                    self.waker.cancel_sleep();
                }
            }
        }
        summary(&self.shard, queries, self.pinned_core)
    }
}

fn handle(
    shard: &mut Shard,
    msg: ToShard,
    queries: &mut u64,
    pinned_core: Option<usize>,
) -> Option<FromShard> {
    match msg {
        ToShard::Ops(batches) => {
            for b in &batches {
                shard.apply(b);
            }
            None
        }
        ToShard::Query(seqs) => {
            *queries += 1;
            Some(FromShard::Matches(shard.find_matches(&seqs)))
        }
        ToShard::Sync(n) => Some(FromShard::Synced(n)),
        ToShard::Stats => Some(FromShard::Stats(summary(shard, *queries, pinned_core))),
    }
}

fn summary(shard: &Shard, queries: u64, pinned_core: Option<usize>) -> ShardSummary {
    ShardSummary {
        shard: shard.id(),
        applied: shard.applied(),
        inconsistencies: shard.inconsistencies(),
        queries,
        index: shard.stats(),
        pinned_core,
    }
}
