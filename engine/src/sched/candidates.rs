//! Gathering and scoring the candidates of one routing call.
//!
//! Per call this turns the policy's scope into scored candidates: drop busy keys (unless all
//! are busy), look up each key's overlap in the [`Matches`] and how many of the request's
//! blocks its active requests already hold, then apply the cost function. Per-slot lookups go
//! through scratch vectors indexed by [`WorkerSlot`], so scoring `n` candidates costs O(n)
//! plus O(matches + request blocks x their active holders) hash lookups, never O(n x blocks).
//!
//! # Invariants
//! 1. Between calls every entry of `overlap` and `held` is 0 and `touched` is empty: a call
//!    zeroes exactly the slots it touched before returning.
//! 2. Candidates come out in scope order, which is key order.

use crate::ids::{SeqHash, WorkerKey};
use crate::matches::Matches;
use crate::sched::active::ActiveRequests;
use crate::sched::config::BusyThresholds;
use crate::sched::cost::{CandidateScore, CostInputs};
use crate::sched::drain::DrainClock;
use crate::sched::ttft::TtftFit;
use crate::sched::workers::{WorkerSlot, WorkerTable};
use std::time::Instant;

/// The model of a slot with none yet.
const PRIOR: TtftFit = TtftFit::PRIOR_FIT;

/// Reusable per-call buffers. Owned by the scheduler.
#[derive(Debug, Default)]
pub(crate) struct CandidateScratch {
    overlap: Vec<u32>,
    held: Vec<u32>,
    touched: Vec<WorkerSlot>,
}

/// The scored candidates of one call.
#[derive(Debug)]
pub(crate) struct Gathered {
    /// Scored non-busy keys of the scope (every key if all are busy), in key order.
    pub candidates: Vec<CandidateScore>,
    /// Keys of the scope skipped as busy.
    pub busy_skipped: usize,
    /// Keys of the scope left out at their active-request limit.
    pub full: usize,
}

/// What one call is scored against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Context<'a> {
    pub workers: &'a WorkerTable,
    pub active: &'a ActiveRequests,
    pub busy: &'a BusyThresholds,
    /// Keys with this many active requests are no candidates.
    pub max_active: Option<u64>,
    pub matches: &'a Matches,
    pub blocks: &'a [SeqHash],
    /// When the call is made.
    pub now: Instant,
    /// Each slot's TTFT model (a slot past the end predicts the prior).
    pub fits: &'a [TtftFit],
    /// Each slot's prefill queue clock (a slot past the end has none queued).
    pub clocks: &'a [DrainClock],
    pub cost: CostInputs,
}

impl CandidateScratch {
    /// Scores the keys of `scope` (sorted by key, each registered in `cx.workers`).
    pub(crate) fn gather(
        &mut self,
        scope: &[(WorkerKey, WorkerSlot)],
        cx: &Context<'_>,
    ) -> Gathered {
        let bound = cx.workers.slot_bound();
        if self.overlap.len() < bound {
            self.overlap.resize(bound, 0);
            self.held.resize(bound, 0);
        }

        let is_busy = |slot: WorkerSlot| {
            cx.busy
                .is_busy(cx.workers.load(slot), cx.active.load(slot).active_requests)
        };
        let free = if cx.busy.any() {
            scope.iter().filter(|(_, s)| !is_busy(*s)).count()
        } else {
            scope.len()
        };
        // Every key busy: route anyway rather than refuse (DESIGN.md "Choosing a worker").
        let skip_busy = free > 0 && free < scope.len();

        for &(key, overlap) in &cx.matches.overlaps {
            if let Some(slot) = cx.workers.slot(key)
                && let Some(o) = self.overlap.get_mut(slot.idx())
            {
                *o = overlap;
                self.touched.push(slot);
            }
        }
        cx.active
            .count_held(cx.blocks, &mut self.held, &mut self.touched);

        // The best overlap among the keys that may be chosen: what a candidate caching less
        // recomputes is measured against it (cost invariant 3).
        let is_full = |slot: WorkerSlot| {
            cx.max_active
                .is_some_and(|max| cx.active.load(slot).active_requests >= max)
        };
        let best_overlap = scope
            .iter()
            .filter(|(_, slot)| !(skip_busy && is_busy(*slot) || is_full(*slot)))
            .filter_map(|(_, slot)| self.overlap.get(slot.idx()).copied())
            .max()
            .unwrap_or(0);
        let mut candidates = Vec::with_capacity(if skip_busy { free } else { scope.len() });
        let mut full = 0;
        for &(key, slot) in scope {
            if skip_busy && is_busy(slot) {
                continue;
            }
            // A hard limit, unlike busy: a full key is never chosen.
            if is_full(slot) {
                full += 1;
                continue;
            }
            let overlap = self.overlap.get(slot.idx()).copied().unwrap_or(0);
            let held = self.held.get(slot.idx()).copied().unwrap_or(0);
            let fit = cx.fits.get(slot.idx()).unwrap_or(&PRIOR);
            let load = cx.active.load(slot);
            let pending = load.active_prefill_tokens > 0;
            let wait_ms = cx
                .clocks
                .get(slot.idx())
                .map_or(0.0, |c| c.wait_ms(cx.now, pending));
            candidates.push(
                cx.cost
                    .score(key, overlap, best_overlap, load, held, fit, wait_ms),
            );
        }

        for slot in self.touched.drain(..) {
            if let Some(o) = self.overlap.get_mut(slot.idx()) {
                *o = 0;
            }
            if let Some(h) = self.held.get_mut(slot.idx()) {
                *h = 0;
            }
        }
        Gathered {
            candidates,
            busy_skipped: if skip_busy { scope.len() - free } else { 0 },
            full,
        }
    }

    /// Whether invariant 1 holds.
    #[cfg(test)]
    pub(crate) fn is_clean(&self) -> bool {
        self.touched.is_empty()
            && self.overlap.iter().all(|&o| o == 0)
            && self.held.iter().all(|&h| h == 0)
    }
}
