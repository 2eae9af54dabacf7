//! Checking a query phase's answers, after its timed window.
//!
//! A timed pass keeps each answer's [`AnswerSummary`] only: keeping whole answers inside
//! the window would time the harness's memory writes (see [`crate::driver::callers`]).
//! After the window, [`verify`] re-runs the same lists on the same number of callers,
//! untimed, in chunks, keeping whole answers, and compares both with the plan.
//!
//! # Invariants
//! 1. A query is right only if its timed summary equals its expectation's, and its re-run
//!    answer, as a set of (worker key, overlap), equals the expectation exactly: every
//!    expected holder with its exact score, and nobody else. A missing answer is wrong.
//! 2. The index is quiet between a timed pass and its re-run, so an exact index gives
//!    both the same answer.
//! 3. A re-run holds at most [`CHUNK`] whole answers per caller at a time, so checking
//!    adds little to resident memory.

use crate::driver::{AnswerSummary, CallersOutcome, IndexerUnderTest};
use crate::workload::Query;
use anyhow::Result;
use engine::Matches;

/// Queries per caller in one re-run chunk.
pub const CHUNK: usize = 1024;

/// What the plan expects of one query: (worker key, overlap), sorted by key.
pub use crate::workload::anchor::Expected;

/// `m`'s overlaps sorted by worker key.
fn sorted(m: &Matches) -> Expected {
    let mut got = m.overlaps.clone();
    got.sort_unstable_by_key(|p| p.0);
    got
}

/// The summary an answer equal to `want` has.
fn summary_of(want: &Expected) -> AnswerSummary {
    AnswerSummary {
        best: want.iter().map(|p| p.1).max().unwrap_or(0),
        holders: want.len() as u32,
    }
}

/// Wrong queries of a timed pass (invariant 1): `lists[c]` ran on caller `c`, asking for
/// `asked[c][i]` (an answer id) whose answer should be `expect(asked[c][i])`.
pub fn verify(
    ix: &mut dyn IndexerUnderTest,
    lists: &[&[Query]],
    asked: &[&[u64]],
    timed: &CallersOutcome,
    expect: &dyn Fn(u64) -> Expected,
) -> Result<u64> {
    let mut wrong = 0u64;
    let longest = lists.iter().map(|l| l.len()).max().unwrap_or(0);
    for at in (0..longest).step_by(CHUNK) {
        let chunk: Vec<&[Query]> = lists
            .iter()
            .map(|l| l.get(at..l.len().min(at + CHUNK)).unwrap_or(&[]))
            .collect();
        let out = ix.query_callers(&chunk, true)?;
        for (c, part) in chunk.iter().enumerate() {
            for i in 0..part.len() {
                let Some(&x) = asked.get(c).and_then(|a| a.get(at + i)) else {
                    wrong += 1;
                    continue;
                };
                let want = expect(x);
                let summary = timed.summaries.get(c).and_then(|s| s.get(at + i));
                let answer = out.answers.get(c).and_then(|a| a.get(i));
                let right = summary == Some(&summary_of(&want))
                    && answer.is_some_and(|m| sorted(m) == want);
                wrong += u64::from(!right);
            }
        }
    }
    Ok(wrong)
}

/// Answers of `out` that matched anyone at all.
pub fn non_empty(out: &CallersOutcome) -> u64 {
    out.summaries
        .iter()
        .flatten()
        .filter(|s| s.holders > 0)
        .count() as u64
}
