//! One KV-event stream's fencing policy, written once for ZMQ, QUIC and HTTP: what to do with
//! an arriving numbered batch. Sans-IO: [`EventStream`] decides; the transport replays,
//! clears and applies, using [`clear_keys`] and [`skip_duplicate`] for the shared effects.
//!
//! # Semantics (every transport)
//! * The first batch a new subscription sees, where the source can replay (ZMQ) and the
//!   batch is not the publisher's first (seq above 0): replay from 0 first. A subscription
//!   misses the batches published before it took effect (ZMQ's slow joiner: the router
//!   starting with its workers lost their first blocks, and every store under them was
//!   refused as `unknown_parent`); the worker's replay buffer holds them. A buffer that no
//!   longer reaches back to 0 (a worker that ran long before the router) gives what it
//!   holds, with nothing to clear.
//! * The first batch otherwise, or the next number: apply.
//! * A number above the next one (a gap): replay the missing batches where the source has a
//!   replay endpoint (ZMQ); otherwise, or when the replay cannot cover the gap, clear the
//!   stream's ranks and mark them resyncing, then apply.
//! * A number below the next one:
//!   - the same number and the same bytes as the last batch applied: a retry (an HTTP client
//!     that did not see its answer, a QUIC publisher resending): skipped, counted as
//!     `duplicate_seq`;
//!   - a copy of a batch a replay just delivered, while the live stream catches up: skipped;
//!   - anything else: the publisher restarted (vLLM numbers from 0 in each process). The
//!     stream's ranks are cleared, then the batch applies; where the source can replay and
//!     the batch is not the new process's first, its earlier batches (sent while the
//!     subscription reconnected) are replayed from 0 first.
//!
//! Until this module, HTTP took only `seq == 0` for a restart and any other lower number for
//! a duplicate, so a publisher that restarted and reached seq 5 before its first batch was
//! seen kept the blocks of its previous life. A restart is now recognised the same way on
//! every transport, and a retry by its bytes rather than by its number alone.
//!
//! # Invariants
//! 1. A batch consumes its number once classified, whether or not any of its events apply
//!    (an undecodable batch is not a gap: the ZMQ subscriber reads it again from the
//!    replay buffer, or else clears and resyncs the stream's ranks).
//! 2. After a [`Action::Replay`], the caller feeds every replayed batch to
//!    [`EventStream::replayed`], then calls [`EventStream::replay_ended`], then offers the
//!    live batch again.

use crate::error::{DropReason, Result};
use crate::fence::{Fence, Verdict};
use crate::hub::Hub;
use engine::WorkerKey;
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

/// Why a stream's ranks are cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearKind {
    /// The publisher restarted: its old blocks are gone.
    Restart,
    /// Batches were lost and cannot be replayed: what is indexed may be stale; the ranks are
    /// marked resyncing until their next batch applies.
    Resync,
}

/// What to do with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Apply it.
    Apply,
    /// Skip it: already applied.
    Skip,
    /// Clear the stream's ranks, then apply it.
    ClearThenApply(ClearKind),
    /// Replay from `from` first, then offer this batch again (only for streams that can
    /// replay).
    Replay {
        /// First missing number.
        from: u64,
        /// The publisher restarted (its numbers went back): clear the stream's ranks
        /// first, then replay the new process's batches from 0 (its first ones went out
        /// while the subscription was reconnecting).
        restarted: bool,
    },
}

/// A batch as the stream sees it: its number and a digest of its bytes (to tell a retry from
/// a restart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchId {
    /// The publisher's number.
    pub seq: u64,
    /// xxh3 of the batch's bytes as received ([`BatchId::of`]).
    pub digest: u64,
}

impl BatchId {
    /// The id of batch `seq` received as `bytes`.
    pub fn of(seq: u64, bytes: &[u8]) -> Self {
        Self {
            seq,
            digest: xxhash_rust::xxh3::xxh3_64(bytes),
        }
    }
}

/// One stream's position. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct EventStream {
    fence: Fence,
    can_replay: bool,
    last: Option<BatchId>,
    /// A new subscription that has classified nothing yet (its first batch may ask for a
    /// replay from 0). Never set again: after a clear the stream starts afresh without one.
    fresh: bool,
}

impl EventStream {
    /// A stream that has seen nothing; `can_replay`: its source answers replay requests.
    pub fn new(can_replay: bool) -> Self {
        Self {
            can_replay,
            fresh: can_replay,
            ..Self::default()
        }
    }

    /// A stream restored from a snapshot that holds every batch up to `last`: the next
    /// number is `last + 1`, and anything else is a gap or a restart.
    pub fn resume(can_replay: bool, last: u64) -> Self {
        let mut s = Self::new(can_replay);
        s.fresh = false;
        s.fence.accept(last);
        s
    }

    /// A catch-up replay from `from` ran to its end: live copies of what it delivered
    /// (queued meanwhile) are duplicates, not a restart.
    pub fn caught_up(&mut self, from: u64) {
        self.fence.note_replayed(from);
    }

    /// The number expected next, once any batch was taken.
    pub fn next_expected(&self) -> Option<u64> {
        self.fence.next_expected()
    }

    /// Classifies a live batch and, unless the answer is [`Action::Replay`], takes its
    /// number.
    pub fn live(&mut self, batch: BatchId) -> Action {
        if std::mem::take(&mut self.fresh) && batch.seq > 0 && self.fence.next_expected().is_none()
        {
            // Its earlier batches went out before the subscription took effect.
            return Action::Replay {
                from: 0,
                restarted: false,
            };
        }
        let action = match self.fence.check_live(batch.seq) {
            Verdict::InOrder => Action::Apply,
            Verdict::Duplicate => Action::Skip,
            Verdict::Restarted if self.last == Some(batch) => Action::Skip,
            Verdict::Restarted if self.can_replay && batch.seq > 0 => {
                self.fence.reset();
                self.last = None;
                return Action::Replay {
                    from: 0,
                    restarted: true,
                };
            }
            Verdict::Restarted => {
                self.fence.reset();
                Action::ClearThenApply(ClearKind::Restart)
            }
            Verdict::Gap { from } if self.can_replay => {
                return Action::Replay {
                    from,
                    restarted: false,
                };
            }
            Verdict::Gap { .. } => Action::ClearThenApply(ClearKind::Resync),
        };
        if action != Action::Skip {
            self.fence.accept_live(batch.seq);
            self.last = Some(batch);
        }
        action
    }

    /// Classifies a batch delivered by a replay and takes its number: older ones are
    /// duplicates; one past a gap means the replay cannot reach back far enough.
    pub fn replayed(&mut self, batch: BatchId) -> Action {
        let action = match self.fence.check_replayed(batch.seq) {
            Verdict::Duplicate => return Action::Skip,
            Verdict::InOrder | Verdict::Restarted => Action::Apply,
            Verdict::Gap { .. } => Action::ClearThenApply(ClearKind::Resync),
        };
        self.fence.accept(batch.seq);
        self.last = Some(batch);
        action
    }

    /// Ends a replay that started at `from` for the live batch `live`: `delivered` is
    /// whether it ran to its end. Returns the clear needed when it did not bring the stream
    /// up to the live batch (the batches between are lost).
    pub fn replay_ended(&mut self, from: u64, live: u64, delivered: bool) -> Option<ClearKind> {
        let caught_up = self.fence.next_expected().is_some_and(|n| n >= live);
        if delivered && caught_up {
            self.fence.note_replayed(from);
            return None;
        }
        self.fence.reset();
        self.last = None;
        Some(ClearKind::Resync)
    }
}

/// Clears `keys` (the ranks a stream carried) for `kind`, logging and counting it once.
/// Every key is tried; the first failure is returned (the caller decides whether the batch
/// may still apply: QUIC and ZMQ log it, HTTP answers with it).
pub fn clear_keys(
    hub: &Hub,
    keys: impl IntoIterator<Item = WorkerKey>,
    kind: ClearKind,
    why: &dyn fmt::Display,
) -> Result<()> {
    match kind {
        ClearKind::Restart => {
            tracing::warn!("{why}: the publisher restarted; clearing its blocks");
            hub.metrics().restarts.fetch_add(1, Relaxed);
        }
        ClearKind::Resync => {
            tracing::warn!("{why}: batches lost; clearing and resyncing");
        }
    }
    let mut first = Ok(());
    for key in keys {
        let r = match kind {
            ClearKind::Restart => hub.clear(key),
            ClearKind::Resync => hub.resync(key),
        };
        if let Err(e) = r {
            tracing::warn!(worker = %key, "cannot clear: {e}");
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// Counts and logs a skipped batch of `events` events.
pub fn skip_duplicate(hub: &Hub, events: u64, why: &dyn fmt::Display) {
    hub.metrics()
        .drop_input(DropReason::DuplicateSeq, events.max(1), why);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seq: u64, digest: u64) -> BatchId {
        BatchId { seq, digest }
    }

    #[test]
    fn in_order_then_retry_then_restart() {
        let mut s = EventStream::new(false);
        assert_eq!(s.live(id(4, 1)), Action::Apply);
        assert_eq!(s.live(id(5, 2)), Action::Apply);
        // The same batch again: a retry.
        assert_eq!(s.live(id(5, 2)), Action::Skip);
        assert_eq!(s.next_expected(), Some(6));
        // The same number with other bytes, or an older number: a restart.
        assert_eq!(s.live(id(5, 3)), Action::ClearThenApply(ClearKind::Restart));
        assert_eq!(s.live(id(6, 4)), Action::Apply);
        assert_eq!(s.live(id(2, 5)), Action::ClearThenApply(ClearKind::Restart));
        assert_eq!(s.live(id(3, 6)), Action::Apply);
    }

    #[test]
    fn a_restart_past_its_first_batch_replays_the_new_process_from_zero() {
        let mut s = EventStream::new(true);
        for seq in 0..10 {
            assert_eq!(s.live(id(seq, seq)), Action::Apply);
        }
        // The new process's batch 4 (0..4 went out while the subscription reconnected).
        let restart = Action::Replay {
            from: 0,
            restarted: true,
        };
        assert_eq!(s.live(id(4, 100)), restart);
        for seq in 0..=4 {
            assert_eq!(s.replayed(id(seq, 100 + seq)), Action::Apply);
        }
        assert_eq!(s.replay_ended(0, 4, true), None);
        // The live copy the replay delivered is skipped; the stream goes on.
        assert_eq!(s.live(id(4, 100)), Action::Skip);
        assert_eq!(s.live(id(5, 105)), Action::Apply);
        // Its very first batch needs no replay.
        assert_eq!(
            s.live(id(0, 200)),
            Action::ClearThenApply(ClearKind::Restart)
        );
    }

    #[test]
    fn a_gap_resyncs_without_replay_and_replays_with_it() {
        let mut s = EventStream::new(false);
        s.live(id(0, 0));
        assert_eq!(s.live(id(3, 3)), Action::ClearThenApply(ClearKind::Resync));
        assert_eq!(s.next_expected(), Some(4));

        let mut s = EventStream::new(true);
        s.live(id(0, 0));
        assert_eq!(
            s.live(id(3, 3)),
            Action::Replay {
                from: 1,
                restarted: false
            }
        );
        assert_eq!(
            s.next_expected(),
            Some(1),
            "a replay request takes no number"
        );
        for seq in 1..=4 {
            assert_eq!(s.replayed(id(seq, seq)), Action::Apply);
        }
        assert_eq!(s.replayed(id(2, 2)), Action::Skip);
        assert_eq!(s.replay_ended(1, 3, true), None);
        // The live copies of 3 and 4 are skipped; 5 applies.
        assert_eq!(s.live(id(3, 3)), Action::Skip);
        assert_eq!(s.live(id(4, 4)), Action::Skip);
        assert_eq!(s.live(id(5, 5)), Action::Apply);
    }

    #[test]
    fn a_replay_that_falls_short_or_starts_late_resyncs() {
        let mut s = EventStream::new(true);
        s.live(id(0, 0));
        assert_eq!(
            s.live(id(9, 9)),
            Action::Replay {
                from: 1,
                restarted: false
            }
        );
        assert_eq!(s.replayed(id(1, 1)), Action::Apply);
        assert_eq!(s.replay_ended(1, 9, true), Some(ClearKind::Resync));
        assert_eq!(s.live(id(9, 9)), Action::Apply);

        let mut s = EventStream::new(true);
        s.live(id(0, 0));
        assert_eq!(
            s.live(id(9, 9)),
            Action::Replay {
                from: 1,
                restarted: false
            }
        );
        // The worker's buffer starts at 5: 1..5 are lost.
        assert_eq!(
            s.replayed(id(5, 5)),
            Action::ClearThenApply(ClearKind::Resync)
        );
        for seq in 6..=9 {
            assert_eq!(s.replayed(id(seq, seq)), Action::Apply);
        }
        assert_eq!(s.replay_ended(1, 9, true), None);
        assert_eq!(s.live(id(9, 9)), Action::Skip);

        let mut s = EventStream::new(true);
        s.live(id(0, 0));
        assert_eq!(
            s.live(id(3, 3)),
            Action::Replay {
                from: 1,
                restarted: false
            }
        );
        assert_eq!(s.replay_ended(1, 3, false), Some(ClearKind::Resync));
        assert_eq!(s.live(id(3, 3)), Action::Apply);
    }

    #[test]
    fn a_new_subscription_replays_what_went_out_before_it_took_effect() {
        let first = Action::Replay {
            from: 0,
            restarted: false,
        };
        // The buffer holds everything: 0..=6 replayed, the live 4..=6 are copies.
        let mut s = EventStream::new(true);
        assert_eq!(s.live(id(4, 4)), first);
        for seq in 0..=6 {
            assert_eq!(s.replayed(id(seq, seq)), Action::Apply);
        }
        assert_eq!(s.replay_ended(0, 4, true), None);
        for seq in 4..=6 {
            assert_eq!(s.live(id(seq, seq)), Action::Skip);
        }
        assert_eq!(s.live(id(7, 7)), Action::Apply);

        // A worker that ran long before: its buffer starts at 900; nothing to clear.
        let mut s = EventStream::new(true);
        assert_eq!(s.live(id(1_000, 1_000)), first);
        for seq in 900..=1_000 {
            assert_eq!(s.replayed(id(seq, seq)), Action::Apply);
        }
        assert_eq!(s.replay_ended(0, 1_000, true), None);
        assert_eq!(s.live(id(1_000, 1_000)), Action::Skip);
        assert_eq!(s.live(id(1_001, 1_001)), Action::Apply);

        // The replay fails: the stream starts from the live batch and never asks again.
        let mut s = EventStream::new(true);
        assert_eq!(s.live(id(4, 4)), first);
        assert_eq!(s.replay_ended(0, 4, false), Some(ClearKind::Resync));
        assert_eq!(s.live(id(4, 4)), Action::Apply);
        assert_eq!(s.live(id(5, 5)), Action::Apply);

        // The publisher's first batch, a source without replay, a resumed stream: no replay.
        assert_eq!(EventStream::new(true).live(id(0, 0)), Action::Apply);
        assert_eq!(EventStream::new(false).live(id(4, 4)), Action::Apply);
        assert_eq!(EventStream::resume(true, 3).live(id(4, 4)), Action::Apply);
    }

    #[test]
    fn the_digest_is_of_the_bytes() {
        assert_eq!(BatchId::of(1, b"abc"), BatchId::of(1, b"abc"));
        assert_ne!(BatchId::of(1, b"abc"), BatchId::of(1, b"abd"));
    }
}
