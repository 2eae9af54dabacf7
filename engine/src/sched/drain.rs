//! Each worker key's prefill queue as a clock: when the prefills routed to it so far are
//! predicted to be done, corrected by every first token that arrives.
//!
//! Counting queued tokens alone would charge a key for the whole of a long prefill until
//! its first token, even when it is nearly done; the clock lets the wait shrink as time
//! passes. Engines prefill first come, first served (vLLM and SGLang schedule running
//! prefills before waiting ones), so:
//!
//! * routing a request with `own_ms` of prefill to the key moves the clock to
//!   `max(clock, now) + own_ms`, and that is when the request's prefill should end;
//! * its first token at `t` says its prefill really ended at `t - base` (the model's fixed
//!   part: network, tokenisation, the first decode step). Every prefill queued after it
//!   moves by the same error, so the clock does too;
//! * its prefill *service* time is `t - max(routed, previous first token on the key)`:
//!   the time since it could start, which is what the throughput model
//!   ([`crate::sched::ttft`]) learns from, without the queue it waited in;
//! * a key with no prefill pending has an empty queue: the clock stops;
//! * a key whose clock ran out while a prefill is still pending is *overdue*: the model
//!   underestimated it. Its wait is then taken as long as it has been overdue so far
//!   (prefill times are heavy-tailed: what has run long tends to run longer), never 0,
//!   which would send the next request straight behind it.
//!
//! # Invariants
//! 1. `wait_ms` is finite and non-negative.
//! 2. Pure: every time-dependent call takes `now`.

use std::time::{Duration, Instant};

/// One key's prefill queue clock.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DrainClock {
    /// When the queued prefills should be done (`None`: nothing queued).
    busy_until: Option<Instant>,
    /// The key's last first token: the earliest a prefill queued before it could start.
    last_first_token: Option<Instant>,
    /// Every correction so far, summed (ms, signed): a prediction made when this was `d0`
    /// has moved by `drift - d0` since.
    drift_ms: f64,
}

/// When a queued prefill should end, as [`DrainClock::push`] predicted it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Predicted {
    /// The predicted end.
    pub done_at: Instant,
    /// The clock's drift at the prediction.
    pub drift_ms: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn from_ms(ms: f64) -> Duration {
    Duration::try_from_secs_f64(ms.max(0.0) / 1000.0).unwrap_or(Duration::ZERO)
}

/// `t` moved by `delta_ms` either way (unchanged where it would leave `Instant`'s range).
fn shifted(t: Instant, delta_ms: f64) -> Instant {
    if delta_ms >= 0.0 {
        t.checked_add(from_ms(delta_ms))
    } else {
        t.checked_sub(from_ms(-delta_ms))
    }
    .unwrap_or(t)
}

impl DrainClock {
    /// Milliseconds until the key's queued prefills are done; `pending` says whether any
    /// is still waiting for its first token (see the module docs for an overdue queue).
    pub fn wait_ms(&self, now: Instant, pending: bool) -> f64 {
        match self.busy_until {
            Some(b) if b > now => ms(b - now),
            Some(b) if pending => ms(now - b),
            _ => 0.0,
        }
    }

    /// Queues a prefill of `own_ms` at `now`; returns when it should end.
    pub fn push(&mut self, now: Instant, own_ms: f64) -> Predicted {
        let start = self.busy_until.map_or(now, |b| b.max(now));
        let done_at = shifted(start, own_ms);
        self.busy_until = Some(done_at);
        Predicted {
            done_at,
            drift_ms: self.drift_ms,
        }
    }

    /// A first token at `now` of a request routed at `routed` with prediction `p`, on a
    /// key whose requests pay `base_ms` besides the prefill. Returns the request's service
    /// time in ms (see the module docs).
    pub fn first_token(
        &mut self,
        now: Instant,
        routed: Instant,
        p: Predicted,
        base_ms: f64,
    ) -> f64 {
        let start = self.last_first_token.map_or(routed, |l| l.max(routed));
        let service = ms(now.saturating_duration_since(start));
        self.last_first_token = Some(now);
        // Where the prediction stands now, after the corrections since it was made.
        let expected = shifted(p.done_at, self.drift_ms - p.drift_ms);
        let ended = now.checked_sub(from_ms(base_ms)).unwrap_or(now);
        let error_ms = if ended >= expected {
            ms(ended - expected)
        } else {
            -ms(expected - ended)
        };
        if let Some(b) = self.busy_until {
            self.busy_until = Some(shifted(b, error_ms));
            self.drift_ms += error_ms;
        }
        service
    }

    /// Nothing is queued any more.
    pub fn idle(&mut self) {
        self.busy_until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_shift_with_first_tokens_and_stop_when_idle() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = DrainClock::default();
        assert_eq!(c.wait_ms(t0, false), 0.0);
        // Two requests of 100 ms each at t0: the second ends at 200.
        let p1 = c.push(t0, 100.0);
        let p2 = c.push(t0, 100.0);
        assert_eq!((p1.done_at, p2.done_at), (at(100), at(200)));
        assert!((c.wait_ms(at(50), true) - 150.0).abs() < 1e-6);
        // The first's token comes at 130 with base 10: it ended at 120, 20 ms late, and
        // so will the second (now expected at 220); its service was 130 ms.
        let service = c.first_token(at(130), t0, p1, 10.0);
        assert!((service - 130.0).abs() < 1e-6);
        assert!((c.wait_ms(at(130), true) - 90.0).abs() < 1e-6);
        // Still pending 40 ms past the clock: overdue by 40, so 40 more are expected.
        assert!((c.wait_ms(at(260), true) - 40.0).abs() < 1e-6);
        // The second's token at 200 (ended 190, 30 early against 220): its service
        // started at the first's token, 70 ms before, and the clock is back at 190.
        let service = c.first_token(at(200), t0, p2, 10.0);
        assert!((service - 70.0).abs() < 1e-6);
        assert_eq!(c.wait_ms(at(200), false), 0.0);
        assert!((c.wait_ms(at(195), true) - 5.0).abs() < 1e-6);
        c.idle();
        assert_eq!(c.wait_ms(at(200), true), 0.0);
        // Pushed after a gap, a prefill starts now, not at the old clock.
        assert_eq!(c.push(at(1000), 5.0).done_at, at(1005));
    }
}
