//! One KV-event stream's sequence fencing and continuity, written once for ZMQ, QUIC and
//! HTTP: what to do with an arriving numbered batch, and whether a stream that reconnected
//! is still the same publisher. Sans-IO: [`EventStream`] decides; the transport replays,
//! clears and applies, using [`clear_keys`] and [`skip_duplicate`] for the shared effects.
//!
//! Two layers: `fence` ([`Fence`], [`Verdict`]) classifies a batch by its number alone
//! (in order, gap, duplicate of a replay, restart); [`EventStream`], over it, adds what
//! numbers cannot tell: the batch's bytes (a retry against a restart), replays, and the
//! check of a (re)connection.
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
//! * A (re)connection, and a resume from a snapshot ([`EventStream::connected`]): the
//!   continuity of the stream is unknown (the publisher may have restarted meanwhile, and
//!   vLLM numbers from 0 in each process, so numbers alone cannot tell). The last batch
//!   applied, `(seq, digest)`, is the proof: the replay socket is asked for the batches
//!   from `seq` on, and if its first answer is that very batch (same number, same bytes),
//!   the publisher is the same process and the rest is catch-up ([`Continuity::Same`]).
//!   Anything else (another batch first, none, a failed replay) means it restarted or its
//!   buffer moved on ([`Continuity::Broken`]): the stream's ranks are cleared (a restart),
//!   then the publisher's history is replayed from 0; if it starts at 0 it is the new
//!   process's whole history (exact), otherwise the ranks are marked resyncing
//!   ([`EventStream::history_from`]). Without a replay endpoint nothing can be proven: the
//!   ranks are cleared, counted as a restart. Until the check ends the ranks are
//!   distrusted (`Hub::distrust`: routed as uncached, blocks kept).
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
//! 2. After batch `s` is accepted the next expected number is `s + 1`: numbers only move
//!    forward, except through a restart ([`Verdict::Restarted`], which the caller answers
//!    by clearing the stream's ranks) or a reset after a clear (the next batch starts
//!    afresh).
//! 3. After a replay, the live copies of the replayed batches (queued on the live socket
//!    while the replay ran) are duplicates, not a restart, until a live batch past the
//!    replayed range arrives.
//! 4. After a [`Action::Replay`], the caller feeds every replayed batch to
//!    [`EventStream::replayed`], then calls [`EventStream::replay_ended`], then offers the
//!    live batch again.
//! 5. A stream's blocks are trusted after a (re)connection only once [`EventStream::verified`]
//!    answered [`Continuity::Same`] for the last batch applied, or after a clear; never on
//!    the number of the next batch alone.
//!
//! # Concurrency
//! An [`EventStream`] (and its [`Fence`]) belongs to the one task that reads its stream;
//! only the effects ([`clear_keys`], [`skip_duplicate`]) touch the shared [`Hub`].

mod fence;

pub use fence::{Fence, Verdict};

use crate::error::{DropReason, Result};
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

/// What a stream must do when its connection to the publisher is (re)established.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnConnect {
    /// Nothing applied since the stream started afresh: nothing to check.
    Nothing,
    /// Ask the replay socket for the batches from this one's number on; the first answer
    /// goes to [`EventStream::verified`].
    Verify(BatchId),
    /// No replay socket: continuity cannot be proven; clear the ranks (a restart). The
    /// stream starts afresh.
    Clear,
}

/// What the first batch of a verification replay says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// The last batch applied, byte for byte: the same publisher process; the rest of the
    /// replay is catch-up.
    Same,
    /// Anything else: the publisher restarted, or its buffer no longer reaches back. The
    /// caller clears the ranks (a restart) and replays the history from 0; the stream has
    /// started afresh.
    Broken,
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

    /// A stream restored from a snapshot that holds every batch up to `last` (a source
    /// without digests: TensorRT-LLM's event ids): the next number is `last + 1`, and
    /// anything else is a gap or a restart.
    pub fn resume(can_replay: bool, last: u64) -> Self {
        let mut s = Self::new(can_replay);
        s.fresh = false;
        s.fence.accept(last);
        s
    }

    /// Like [`EventStream::resume`] with the last batch's digest: its first connection
    /// verifies that the publisher still has that very batch ([`EventStream::connected`]).
    pub fn resume_from(can_replay: bool, last: BatchId) -> Self {
        let mut s = Self::resume(can_replay, last.seq);
        s.last = Some(last);
        s
    }

    /// The last batch applied (or restored), if any since the stream started afresh.
    pub fn last(&self) -> Option<BatchId> {
        self.last
    }

    /// The connection to the publisher is up (again): what to check before trusting the
    /// blocks (module docs).
    pub fn connected(&mut self) -> OnConnect {
        match self.last {
            None => {
                // Its first batches may have gone out before this connection took effect.
                self.fresh = self.can_replay;
                OnConnect::Nothing
            }
            Some(last) if self.can_replay => OnConnect::Verify(last),
            Some(_) => {
                self.start_afresh();
                OnConnect::Clear
            }
        }
    }

    /// The first answer of the replay asked for by [`OnConnect::Verify`] (`None`: no batch
    /// at or after the last one, or the replay failed).
    pub fn verified(&mut self, first: Option<BatchId>) -> Continuity {
        match first {
            Some(b) if Some(b) == self.last => Continuity::Same,
            _ => {
                self.start_afresh();
                Continuity::Broken
            }
        }
    }

    /// After [`Continuity::Broken`] (and the clear): the history replay from 0 starts with
    /// batch `first` (`None`: the publisher has published nothing yet). The clear still
    /// needed: none when it starts at 0 (the new process's whole history: exact), else a
    /// resync (its first batches are gone).
    pub fn history_from(&self, first: Option<u64>) -> Option<ClearKind> {
        match first {
            None | Some(0) => None,
            Some(_) => Some(ClearKind::Resync),
        }
    }

    /// Forgets the position: the next batch starts the stream (and, where the source can
    /// replay and that batch is not a publisher's first, the batches before it are asked
    /// for first).
    pub fn start_afresh(&mut self) {
        self.fence.reset();
        self.last = None;
        self.fresh = self.can_replay;
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
        assert_eq!(
            EventStream::resume_from(true, id(3, 3)).live(id(4, 4)),
            Action::Apply
        );
    }

    #[test]
    fn a_reconnection_verifies_the_last_batch_before_trusting_anything() {
        // Same process: the replay from the last batch starts with that very batch.
        let mut s = EventStream::new(true);
        for seq in 0..5 {
            assert_eq!(s.live(id(seq, seq)), Action::Apply);
        }
        assert_eq!(s.connected(), OnConnect::Verify(id(4, 4)));
        assert_eq!(s.verified(Some(id(4, 4))), Continuity::Same);
        // The rest of that replay is catch-up: the verified batch is not applied twice.
        assert_eq!(s.replayed(id(4, 4)), Action::Skip);
        assert_eq!(s.replayed(id(5, 5)), Action::Apply);
        s.caught_up(4);
        assert_eq!(
            s.live(id(5, 5)),
            Action::Skip,
            "a live copy of the catch-up"
        );
        assert_eq!(s.live(id(6, 6)), Action::Apply);

        // A restarted process: same number, other bytes; or no batch that far; or another
        // number first (the buffer moved on): broken, the stream starts afresh.
        for first in [Some(id(6, 99)), None, Some(id(9, 9))] {
            let mut s = EventStream::new(true);
            for seq in 0..=6 {
                s.live(id(seq, seq));
            }
            assert_eq!(s.connected(), OnConnect::Verify(id(6, 6)));
            assert_eq!(s.verified(first), Continuity::Broken, "{first:?}");
            assert_eq!(s.last(), None);
            assert_eq!(s.next_expected(), None);
            // The history replay from 0 then applies in order.
            assert_eq!(s.replayed(id(0, 100)), Action::Apply);
            assert_eq!(s.replayed(id(1, 101)), Action::Apply);
            s.caught_up(0);
            assert_eq!(s.live(id(1, 101)), Action::Skip);
            assert_eq!(s.live(id(2, 102)), Action::Apply);
        }
        let s = EventStream::new(true);
        assert_eq!(s.history_from(None), None, "nothing published yet: exact");
        assert_eq!(s.history_from(Some(0)), None, "the whole history: exact");
        assert_eq!(s.history_from(Some(3)), Some(ClearKind::Resync));

        // Without a replay socket nothing can be proven: clear, then start afresh.
        let mut s = EventStream::new(false);
        s.live(id(7, 7));
        assert_eq!(s.connected(), OnConnect::Clear);
        assert_eq!(s.last(), None);
        assert_eq!(s.live(id(0, 0)), Action::Apply);

        // Nothing applied yet: nothing to verify; a replay source asks for its history
        // at the first batch past 0.
        let mut s = EventStream::new(true);
        assert_eq!(s.connected(), OnConnect::Nothing);
        assert_eq!(
            s.live(id(3, 3)),
            Action::Replay {
                from: 0,
                restarted: false
            }
        );
        // Resumed from a snapshot: its mark is verified like any last batch.
        let mut s = EventStream::resume_from(true, id(41, 7));
        assert_eq!(s.last(), Some(id(41, 7)));
        assert_eq!(s.connected(), OnConnect::Verify(id(41, 7)));
        assert_eq!(s.verified(Some(id(41, 8))), Continuity::Broken);
    }

    #[test]
    fn the_digest_is_of_the_bytes() {
        assert_eq!(BatchId::of(1, b"abc"), BatchId::of(1, b"abc"));
        assert_ne!(BatchId::of(1, b"abc"), BatchId::of(1, b"abd"));
    }
}
