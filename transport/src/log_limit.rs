//! Log sampling for counted events: the counters count every event, the log shows at most
//! one line a second per slot (a kind or a reason), so a flood cannot flood the log.
//!
//! # Invariants
//! 1. [`LogLimit::allow`] answers true for slot `i` at most once per second of `now`, and
//!    always for the first call; a poisoned lock answers true (a log line too many, never
//!    a panic); a slot out of range never logs.

use std::sync::Mutex;
use std::time::Instant;

/// When each of `N` slots last logged.
#[derive(Debug)]
pub struct LogLimit<const N: usize> {
    last: Mutex<[Option<Instant>; N]>,
}

impl<const N: usize> Default for LogLimit<N> {
    fn default() -> Self {
        Self {
            last: Mutex::new([None; N]),
        }
    }
}

impl<const N: usize> LogLimit<N> {
    /// Whether slot `i` may log at `now`; if so, `now` is its last line (invariant 1).
    pub fn allow(&self, i: usize, now: Instant) -> bool {
        match self.last.lock() {
            Ok(mut last) => match last.get_mut(i) {
                Some(slot) if slot.is_none_or(|t| now.duration_since(t).as_secs() >= 1) => {
                    *slot = Some(now);
                    true
                }
                _ => false,
            },
            Err(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_line_a_second_per_slot() {
        let limit = LogLimit::<2>::default();
        let t0 = Instant::now();
        assert!(limit.allow(0, t0));
        assert!(!limit.allow(0, t0 + Duration::from_millis(999)));
        assert!(limit.allow(1, t0 + Duration::from_millis(999)));
        assert!(limit.allow(0, t0 + Duration::from_secs(1)));
        assert!(!limit.allow(2, t0));
    }
}
