//! The numbers alone: what to do with the batch numbered `seq`, the lower layer of
//! [`super::EventStream`].
//!
//! Publishers number their batches (vLLM: a u64 per publisher process, from 0). A stream
//! keeps the next number it expects and classifies each arriving batch. Sans-IO: the caller
//! does the replaying, clearing and applying; [`Fence::accept`] records what it applied.
//! [`Fence`] keeps the stream module's invariants 1-3 (a batch consumes its number; numbers
//! only move forward but through a restart or a reset; live copies of a replay are
//! duplicates until the live stream is past it).

/// What to do with an arriving batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch in order (or the first one seen): apply it.
    InOrder,
    /// Batches `from..seq` are missing: replay them first (or, if replay is impossible, clear
    /// the worker and mark it resyncing), then apply this one.
    Gap {
        /// First missing number.
        from: u64,
    },
    /// Already applied (a replay overlapping the live stream): skip it.
    Duplicate,
    /// Lower than anything expected while the stream is live: the publisher restarted. Clear
    /// the worker's blocks, then apply this batch.
    Restarted,
}

/// The fencing state of one stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fence {
    next: Option<u64>,
    /// The range `from..horizon` last filled by a replay.
    replayed: Option<(u64, u64)>,
}

impl Fence {
    /// A stream that has seen nothing: any first number is in order.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number expected next, once any batch was accepted.
    pub fn next_expected(&self) -> Option<u64> {
        self.next
    }

    /// Classifies a live batch.
    pub fn check_live(&self, seq: u64) -> Verdict {
        match self.next {
            None => Verdict::InOrder,
            Some(n) if seq == n => Verdict::InOrder,
            Some(n) if seq > n => Verdict::Gap { from: n },
            Some(_) => match self.replayed {
                Some((from, horizon)) if (from..horizon).contains(&seq) => Verdict::Duplicate,
                _ => Verdict::Restarted,
            },
        }
    }

    /// Classifies a replayed batch: older ones are duplicates, never restarts.
    pub fn check_replayed(&self, seq: u64) -> Verdict {
        match self.next {
            Some(n) if seq < n => Verdict::Duplicate,
            _ => self.check_live(seq),
        }
    }

    /// Records that batch `seq` was handled (applied, or undecodable and dropped).
    pub fn accept(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    /// Records that a live batch `seq` was handled; a live batch past the replayed range
    /// ends the window in which older numbers count as duplicates.
    pub fn accept_live(&mut self, seq: u64) {
        if self.replayed.is_some_and(|(_, horizon)| seq >= horizon) {
            self.replayed = None;
        }
        self.accept(seq);
    }

    /// Records that a replay filled `from..` up to the current position.
    pub fn note_replayed(&mut self, from: u64) {
        if let Some(horizon) = self.next {
            self.replayed = Some((from, horizon));
        }
    }

    /// Forgets the position (after a clear for resync: the next batch starts afresh).
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_batch_is_in_order_whatever_its_number() {
        assert_eq!(Fence::new().check_live(41), Verdict::InOrder);
    }

    #[test]
    fn classifies_against_the_next_expected() {
        let mut f = Fence::new();
        f.accept(5);
        assert_eq!(f.next_expected(), Some(6));
        assert_eq!(f.check_live(6), Verdict::InOrder);
        assert_eq!(f.check_live(9), Verdict::Gap { from: 6 });
        assert_eq!(f.check_live(5), Verdict::Restarted);
        assert_eq!(f.check_live(0), Verdict::Restarted);
        assert_eq!(f.check_replayed(5), Verdict::Duplicate);
        assert_eq!(f.check_replayed(6), Verdict::InOrder);
        assert_eq!(f.check_replayed(8), Verdict::Gap { from: 6 });
        f.reset();
        assert_eq!(f.check_live(0), Verdict::InOrder);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_duplicates_until_the_stream_catches_up() {
        let mut f = Fence::new();
        f.accept_live(3);
        // 4..=6 were missed; live 7 arrived; the replay delivered 4..=9.
        assert_eq!(f.check_live(7), Verdict::Gap { from: 4 });
        for s in 4..=9 {
            assert_eq!(f.check_replayed(s), Verdict::InOrder);
            f.accept(s);
        }
        f.note_replayed(4);
        // Live 7 (in hand), then queued 8 and 9 are copies.
        for s in 7..=9 {
            assert_eq!(f.check_live(s), Verdict::Duplicate);
        }
        assert_eq!(f.check_live(10), Verdict::InOrder);
        f.accept_live(10);
        // After catching up, a lower number is a restart again.
        assert_eq!(f.check_live(5), Verdict::Restarted);
        assert_eq!(f.check_live(0), Verdict::Restarted);
    }

    #[test]
    fn the_last_number_does_not_overflow() {
        let mut f = Fence::new();
        f.accept(u64::MAX);
        assert_eq!(f.check_live(u64::MAX), Verdict::InOrder);
    }
}
