//! How busy each core thread is, published by the thread itself and read by any other, and
//! a budget of new connections each core may be handed per window: what the edge needs to
//! fill cores in order instead of spreading every connection over all of them (issue 31,
//! `transport::http::placement`).
//!
//! No clock is read here: every call takes `now`, nanoseconds since an epoch the caller
//! keeps (the same one for every call on one [`CoreLoads`]).
//!
//! # Invariants
//! 1. Core `k`'s [`CoreLoads::woke`] and [`CoreLoads::parked`] are called by core `k`'s
//!    thread only, in alternation (the runtime's unpark and park hooks); every other method
//!    may be called from any thread at any time.
//! 2. A core's busy share is the time it was awake (between a `woke` and the next `parked`)
//!    over the time of its last closed window; a window closes at the first `woke` or
//!    `parked` at least [`CoreLoads::window`] after it opened. A core awake for longer than
//!    a window without parking is busy (1.0) whatever its last window said; a parked core
//!    is reported at its last window's share.
//! 3. Whether a core is parked and since when it is awake are one atomic word, so a reader
//!    never pairs a wake time with a state it does not belong to (a core that just woke
//!    is never reported awake since its previous wake).
//! 4. At most `budget` tickets of one core are taken per window of wall time (window index
//!    `now / window`), by any number of threads (a compare-and-swap on one word holding the
//!    window index and the count). Budgets of different windows are independent.
//!
//! Invariant 3 holds by construction; the model of invariant 4 is `loom_tests` below.

use crate::sync::{AtomicU64, Ordering};
use std::time::Duration;

/// One core's figures, alone on its cache lines: its thread writes them at every park.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Load {
    /// `awake_since << 1 | parked` (invariant 3).
    state: AtomicU64,
    /// When the current window opened (written by the core's thread only).
    window_start: AtomicU64,
    /// Awake time so far in the current window (core's thread only).
    busy_in_window: AtomicU64,
    /// The last closed window's busy share, in millionths.
    share_ppm: AtomicU64,
    /// `window index << 32 | tickets taken in it` (invariant 4).
    tickets: AtomicU64,
}

/// The cores' busy shares and hand-off budgets. See the module docs.
#[derive(Debug)]
pub struct CoreLoads {
    cores: Box<[Load]>,
    window: u64,
    budget: u32,
}

const PPM: u64 = 1_000_000;

impl CoreLoads {
    /// Figures for `cores` cores, measured over windows of `window` (at least 1 ns), each
    /// core handed at most `budget` connections per window. Every core starts awake since
    /// time 0 (its thread runs before its first park) with a share of 0.
    pub fn new(cores: usize, window: Duration, budget: u32) -> Self {
        Self {
            cores: (0..cores.max(1)).map(|_| Load::default()).collect(),
            window: u64::try_from(window.as_nanos()).unwrap_or(u64::MAX).max(1),
            budget,
        }
    }

    /// Number of cores (at least 1).
    pub fn cores(&self) -> usize {
        self.cores.len()
    }

    /// The measuring window.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.window)
    }

    /// Core `core`'s thread is about to block (invariant 1): the time since it woke counts
    /// as busy. Unknown cores are ignored.
    pub fn parked(&self, core: usize, now: u64) {
        let Some(l) = self.cores.get(core) else {
            return;
        };
        let state = l.state.load(Ordering::Relaxed);
        if state & 1 == 0 {
            let busy = l.busy_in_window.load(Ordering::Relaxed) + now.saturating_sub(state >> 1);
            l.busy_in_window.store(busy, Ordering::Relaxed);
        }
        l.state.store(encode(now, true), Ordering::Release);
        self.close_window(l, now);
    }

    /// Core `core`'s thread woke (invariant 1). Unknown cores are ignored.
    pub fn woke(&self, core: usize, now: u64) {
        let Some(l) = self.cores.get(core) else {
            return;
        };
        l.state.store(encode(now, false), Ordering::Release);
        self.close_window(l, now);
    }

    /// Publishes the window's share and opens the next one, if the window is over.
    fn close_window(&self, l: &Load, now: u64) {
        let start = l.window_start.load(Ordering::Relaxed);
        let length = now.saturating_sub(start);
        if length < self.window {
            return;
        }
        // Called at a park or a wake: the window's awake time is all in `busy_in_window`.
        let busy = l.busy_in_window.load(Ordering::Relaxed).min(length);
        let share =
            u64::try_from(u128::from(busy) * u128::from(PPM) / u128::from(length)).unwrap_or(PPM);
        l.share_ppm.store(share, Ordering::Relaxed);
        l.busy_in_window.store(0, Ordering::Relaxed);
        l.window_start.store(now, Ordering::Relaxed);
    }

    /// Core `core`'s busy share, 0.0 to 1.0 (invariant 2); 1.0 for an unknown core.
    pub fn busy(&self, core: usize, now: u64) -> f64 {
        let Some(l) = self.cores.get(core) else {
            return 1.0;
        };
        let state = l.state.load(Ordering::Acquire);
        let (since, parked) = (state >> 1, state & 1 == 1);
        if !parked && now.saturating_sub(since) > self.window {
            return 1.0;
        }
        l.share_ppm.load(Ordering::Relaxed) as f64 / PPM as f64
    }

    /// Takes one of core `core`'s tickets for the window `now` falls in: `false` when the
    /// window's budget is spent, or for an unknown core (invariant 4).
    pub fn take_ticket(&self, core: usize, now: u64) -> bool {
        let Some(l) = self.cores.get(core) else {
            return false;
        };
        let window = (now / self.window) & u64::from(u32::MAX);
        let mut seen = l.tickets.load(Ordering::Relaxed);
        loop {
            let taken = if seen >> 32 == window {
                seen & u64::from(u32::MAX)
            } else {
                0
            };
            if taken >= u64::from(self.budget) {
                return false;
            }
            let next = window << 32 | (taken + 1);
            match l
                .tickets
                .compare_exchange_weak(seen, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now_seen) => seen = now_seen,
            }
        }
    }
}

fn encode(since: u64, parked: bool) -> u64 {
    (since << 1) | u64::from(parked)
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn loads() -> CoreLoads {
        CoreLoads::new(2, Duration::from_millis(100), 2)
    }

    #[test]
    fn the_share_is_the_awake_time_of_the_last_window() {
        let l = loads();
        // Awake 0-30 ms, parked 30-80, awake 80-90, parked 90-100: 40 of 100 ms.
        l.woke(0, 0);
        l.parked(0, 30 * MS);
        l.woke(0, 80 * MS);
        l.parked(0, 90 * MS);
        assert_eq!(
            l.busy(0, 95 * MS),
            0.0,
            "the first window is not closed yet"
        );
        l.woke(0, 100 * MS);
        assert!(
            (l.busy(0, 100 * MS) - 0.4).abs() < 1e-9,
            "{}",
            l.busy(0, 100 * MS)
        );
        // The other core is untouched.
        assert_eq!(l.busy(1, 100 * MS), 0.0);
    }

    #[test]
    fn a_core_awake_longer_than_a_window_is_busy_and_a_parked_one_keeps_its_share() {
        let l = loads();
        l.woke(0, 0);
        l.parked(0, 10 * MS);
        l.woke(0, 105 * MS);
        // The window closed at 105 ms with 10 ms awake.
        assert!((l.busy(0, 150 * MS) - 10.0 / 105.0).abs() < 1e-6);
        assert_eq!(l.busy(0, 206 * MS), 1.0, "awake since 105 ms, no park");
        l.parked(0, 300 * MS);
        // 195 ms awake in a 195 ms window.
        assert_eq!(l.busy(0, 301 * MS), 1.0);
        l.woke(0, 900 * MS);
        // Parked 300-900: that window had nothing awake in it.
        assert_eq!(l.busy(0, 901 * MS), 0.0);
    }

    #[test]
    fn tickets_are_rationed_per_window() {
        let l = loads();
        assert!(l.take_ticket(1, 0));
        assert!(l.take_ticket(1, 50 * MS));
        assert!(!l.take_ticket(1, 99 * MS), "budget 2 per window");
        assert!(l.take_ticket(0, 99 * MS), "each core has its own budget");
        assert!(l.take_ticket(1, 100 * MS), "a new window, a new budget");
        assert!(!l.take_ticket(7, 0), "no such core");
        assert_eq!(l.busy(7, 0), 1.0);
        l.parked(7, 0);
        l.woke(7, 0);
    }
}

/// loom model of invariant 4.
#[cfg(all(test, kvengine_loom))]
mod loom_tests {
    use super::*;
    use crate::sync::Arc;

    /// Two threads after one ticket of a budget of 1: exactly one gets it; a later window
    /// gives another.
    #[test]
    fn one_ticket_goes_to_one_taker() {
        loom::model(|| {
            let l = Arc::new(CoreLoads::new(1, Duration::from_nanos(10), 1));
            let other = {
                let l = l.clone();
                loom::thread::spawn(move || l.take_ticket(0, 3))
            };
            let mine = l.take_ticket(0, 5);
            let theirs = other.join().unwrap_or(false);
            assert!(mine ^ theirs, "mine {mine}, theirs {theirs}");
            assert!(l.take_ticket(0, 12));
        });
    }
}
