//! What the adapters share: the concurrent mixed phase and the worker-key mapping.
//!
//! # Invariants
//! 1. [`concurrent_mixed`] returns only after `apply` returned and every query thread
//!    stopped: the harness's concurrency rule (quiescent on return).
//! 2. A query thread records one latency per answered query and stops at the first query
//!    issued after `apply` returned.

use anyhow::{Result, anyhow};
use engine::{SeqHash, WorkerKey};
use lab::driver::{MixedOutcome, latency_histogram};
use lab::workload::Query;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Runs `apply` in the calling thread while one closed-loop thread per non-empty list of
/// `queries` issues its list cyclically through `query`; the elapsed time is `apply`'s.
pub fn concurrent_mixed<Q>(
    apply: impl FnOnce() -> Result<()>,
    queries: &[Vec<Query>],
    query: Q,
) -> Result<MixedOutcome>
where
    Q: Fn(&[SeqHash]) + Sync,
{
    let done = AtomicBool::new(false);
    let (done, query) = (&done, &query);
    std::thread::scope(|s| {
        let threads: Vec<_> = queries
            .iter()
            .filter(|l| !l.is_empty())
            .map(|list| {
                s.spawn(move || {
                    let mut hist = latency_histogram();
                    for q in list.iter().cycle() {
                        if done.load(Ordering::Acquire) {
                            break;
                        }
                        let t = Instant::now();
                        query(black_box(q));
                        hist.saturating_record(t.elapsed().as_nanos() as u64);
                    }
                    hist
                })
            })
            .collect();
        let start = Instant::now();
        let applied = apply();
        let elapsed = start.elapsed();
        done.store(true, Ordering::Release);
        let mut latencies_ns = latency_histogram();
        for t in threads {
            let h = t.join().map_err(|_| anyhow!("a query thread panicked"))?;
            latencies_ns
                .add(&h)
                .map_err(|e| anyhow!("merging latency histograms: {e}"))?;
        }
        applied?;
        Ok(MixedOutcome {
            elapsed,
            latencies_ns,
        })
    })
}

/// SMG names workers by string: kvengine's worker key as `"worker/dp_rank"`.
pub fn worker_name(key: WorkerKey) -> String {
    format!("{}/{}", key.worker.0, key.dp_rank.0)
}
