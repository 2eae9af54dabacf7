//! Sequence fencing for one event stream: what to do with the batch numbered `seq`.
//!
//! Publishers number their batches (vLLM: a u64 per publisher process, from 0). A stream
//! keeps the next number it expects and classifies each arriving batch. Sans-IO: the caller
//! does the replaying, clearing and applying; [`Fence::accept`] records what it applied.
//!
//! # Invariants
//! 1. After `accept(s)`, the next expected number is `s + 1`; numbers only move forward
//!    except through [`Verdict::Restarted`], which the caller answers by clearing the worker.
//! 2. A batch that could not be decoded is still accepted (it consumes its number), so it is
//!    never reported as a gap.

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
            Some(_) => Verdict::Restarted,
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

    /// Forgets the position (after a clear for resync: the next batch starts afresh).
    pub fn reset(&mut self) {
        self.next = None;
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
    fn the_last_number_does_not_overflow() {
        let mut f = Fence::new();
        f.accept(u64::MAX);
        assert_eq!(f.check_live(u64::MAX), Verdict::InOrder);
    }
}
