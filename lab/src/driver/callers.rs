//! K concurrent query callers: [`IndexerUnderTest::query_callers`]'s shared implementation.
//!
//! Caller `c` owns one state `states[c]` (a shared `&KvIndex`, or a runtime query handle)
//! and issues `lists[c]` in order, back to back, timing each query.
//!
//! # Invariants
//! 1. One caller runs in the calling thread (no thread is spawned); K > 1 callers run on
//!    K scoped threads that start together (a barrier), so the wall time is the span from
//!    the first caller's start to the last one's end.
//! 2. Only the query call is inside a latency sample. Recording the answer's
//!    [`AnswerSummary`] (two words into a vector reserved up front) and, when asked,
//!    keeping the whole answer are inside the wall time but never in a sample. Keeping
//!    whole answers writes fresh memory (page faults, cache misses) that a router, which
//!    drops each answer, never pays: timed passes keep summaries only.
//! 3. The first error of any caller is returned; every thread is joined before.
//!
//! # Concurrency
//! Caller `c` touches only `states[c]` (by `&mut`) and `lists[c]`; `query` must be safe to
//! call from K threads at once on distinct states (`Sync`).
//!
//! [`IndexerUnderTest::query_callers`]: super::IndexerUnderTest::query_callers

use super::latency_histogram;
use crate::workload::Query;
use anyhow::{Result, anyhow, bail};
use engine::{Matches, SeqHash};
use hdrhistogram::Histogram;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// What an answer looked like, in two words: enough to check the answers of a timed pass
/// without keeping them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnswerSummary {
    /// The best overlap ([`Matches::best`]).
    pub best: u32,
    /// Worker keys with a positive overlap.
    pub holders: u32,
}

impl AnswerSummary {
    /// The summary of `m`.
    #[inline]
    pub fn of(m: &Matches) -> Self {
        Self {
            best: m.best(),
            holders: m.overlaps.len() as u32,
        }
    }
}

/// What K concurrent callers measured.
#[derive(Clone, Debug)]
pub struct CallersOutcome {
    /// From the first caller's first query to the last caller's last answer.
    pub elapsed: Duration,
    /// Per caller, the latency of each of its queries in nanoseconds.
    pub latencies_ns: Vec<Histogram<u64>>,
    /// Per caller, the summary of each answer, in list order.
    pub summaries: Vec<Vec<AnswerSummary>>,
    /// Per caller, its answers in list order (empty unless asked to keep them).
    pub answers: Vec<Vec<Matches>>,
}

impl CallersOutcome {
    /// Queries answered over all callers.
    pub fn queries(&self) -> u64 {
        self.latencies_ns.iter().map(Histogram::len).sum()
    }
}

/// One caller's run (on a thread of its own, or on a hosted core's thread).
pub(super) struct CallerRun {
    pub(super) start: Instant,
    pub(super) end: Instant,
    pub(super) hist: Histogram<u64>,
    pub(super) summaries: Vec<AnswerSummary>,
    pub(super) answers: Vec<Matches>,
}

/// The callers' runs as one outcome: elapsed from the first start to the last end.
pub(super) fn outcome(runs: Vec<CallerRun>) -> CallersOutcome {
    let start = runs.iter().map(|r| r.start).min();
    let end = runs.iter().map(|r| r.end).max();
    let elapsed = match (start, end) {
        (Some(s), Some(e)) => e.saturating_duration_since(s),
        _ => Duration::ZERO,
    };
    let mut out = CallersOutcome {
        elapsed,
        latencies_ns: Vec::with_capacity(runs.len()),
        summaries: Vec::with_capacity(runs.len()),
        answers: Vec::with_capacity(runs.len()),
    };
    for run in runs {
        out.latencies_ns.push(run.hist);
        out.summaries.push(run.summaries);
        out.answers.push(run.answers);
    }
    out
}

/// Issues `list` in order with `state`, timing each query, and calls `between` after each
/// (untimed: a hosted core steps there).
pub(super) fn one_caller<H>(
    state: &mut H,
    list: &[Query],
    keep: bool,
    query: &impl Fn(&mut H, &[SeqHash]) -> Result<Matches>,
    between: &impl Fn(&mut H),
) -> Result<CallerRun> {
    let mut hist = latency_histogram();
    let mut summaries = Vec::with_capacity(list.len());
    let mut answers = Vec::with_capacity(if keep { list.len() } else { 0 });
    let start = Instant::now();
    for q in list {
        let t = Instant::now();
        let m = query(state, q)?;
        hist.saturating_record(t.elapsed().as_nanos() as u64);
        summaries.push(AnswerSummary::of(&m));
        if keep {
            answers.push(m);
        } else {
            drop(black_box(m));
        }
        between(state);
    }
    Ok(CallerRun {
        start,
        end: Instant::now(),
        hist,
        summaries,
        answers,
    })
}

/// Runs `lists[c]` on caller `c` with `states[c]`, all callers at once (invariant 1).
pub fn run_callers<H: Send>(
    states: &mut [H],
    lists: &[&[Query]],
    keep: bool,
    query: impl Fn(&mut H, &[SeqHash]) -> Result<Matches> + Sync,
) -> Result<CallersOutcome> {
    if lists.len() > states.len() {
        bail!("{} callers but {} query states", lists.len(), states.len());
    }
    let runs: Vec<CallerRun> = match (states, lists) {
        (_, []) => Vec::new(),
        ([state, ..], [list]) => vec![one_caller(state, list, keep, &query, &|_| {})?],
        (states, lists) => {
            let barrier = Barrier::new(lists.len());
            let (barrier, query) = (&barrier, &query);
            std::thread::scope(|s| {
                let threads: Vec<_> = states
                    .iter_mut()
                    .zip(lists)
                    .map(|(state, list)| {
                        s.spawn(move || {
                            barrier.wait();
                            one_caller(state, list, keep, query, &|_| {})
                        })
                    })
                    .collect();
                let mut runs = Vec::with_capacity(threads.len());
                let mut first_err = None;
                for t in threads {
                    match t.join() {
                        Ok(Ok(run)) => runs.push(run),
                        Ok(Err(e)) => first_err = first_err.or(Some(e)),
                        Err(_) => first_err = first_err.or(Some(anyhow!("a caller panicked"))),
                    }
                }
                match first_err {
                    Some(e) => Err(e),
                    None => Ok(runs),
                }
            })?
        }
    };
    Ok(outcome(runs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::WorkerKey;
    use std::sync::Arc;

    fn echo(_: &mut (), q: &[SeqHash]) -> Result<Matches> {
        let len = q.len() as u32;
        Ok(Matches::from_overlaps([(WorkerKey::new(0, 0), len)]))
    }

    #[test]
    fn every_caller_answers_its_own_list_in_order() {
        let list = |lens: &[usize]| -> Vec<Query> {
            lens.iter()
                .map(|&n| Arc::from(vec![SeqHash(1); n]))
                .collect()
        };
        let (a, b) = (list(&[1, 2, 3]), list(&[4, 5]));
        let mut states = [(), (), ()];
        for lists in [vec![&a[..]], vec![&a[..], &b[..]]] {
            let out = run_callers(&mut states, &lists, true, echo).unwrap();
            assert_eq!(out.answers.len(), lists.len());
            assert_eq!(
                out.queries(),
                lists.iter().map(|l| l.len() as u64).sum::<u64>()
            );
            for ((answers, summaries), list) in out.answers.iter().zip(&out.summaries).zip(&lists) {
                let got: Vec<u32> = answers.iter().map(Matches::best).collect();
                let want: Vec<u32> = list.iter().map(|q| q.len() as u32).collect();
                assert_eq!(got, want);
                let best: Vec<u32> = summaries.iter().map(|s| s.best).collect();
                assert_eq!(best, want);
                assert!(summaries.iter().all(|s| s.holders == 1));
            }
        }
        let out = run_callers(&mut states, &[&a[..]], false, echo).unwrap();
        assert!(out.answers.iter().all(Vec::is_empty));
        assert_eq!(out.summaries[0].len(), a.len());
        assert!(run_callers(&mut states[..1], &[&a[..], &b[..]], false, echo).is_err());
    }
}
