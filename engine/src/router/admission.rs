//! The admission queue of one model: requests that found every candidate worker busy wait
//! here instead of piling onto a busy worker, and are let in one at a time as room appears.
//!
//! Policy: the highest priority first, first come first served within a priority. One
//! waiter at a time holds the *pass*: it was admitted and is being routed; nobody else is
//! admitted until it hands the pass back ([`AdmissionQueue::done`] once routed, or
//! [`AdmissionQueue::cancel`] if it gives up), so one freed slot admits one request, not
//! every waiter at once. While anyone waits or holds the pass, newcomers queue behind them
//! ([`AdmissionQueue::must_wait`]) instead of overtaking.
//!
//! The driver (the transport) decides when there is room (the scheduler's
//! [`crate::sched::Scheduler::has_room`]) and calls [`AdmissionQueue::admit_next`] then; it
//! wakes the admitted waiter and enforces each waiter's deadline, cancelling it on
//! timeout or when its client goes away. Nothing here reads a clock: deadlines are given
//! and [`AdmissionQueue::expire`] takes `now`.
//!
//! # Invariants
//! 1. `waiting` and `by_id` hold the same waiters; at most `capacity` of them.
//! 2. The pass holder is never in `waiting`; a waiter is admitted at most once.
//! 3. `admit_next` hands out the pass only when none is out, to the first waiter in
//!    (priority descending, arrival ascending) order.
//!
//! # Concurrency
//! None: plain data owned by a namespace, behind its driver's lock.

use crate::error::{EngineError, Result};
use crate::ids::WaiterId;
use hashbrown::HashMap;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The default `--admission-queue`: waiters per model. Enough for a few seconds of a busy
/// cluster's arrivals; past it the router answers 429 at once rather than hold more.
pub const DEFAULT_ADMISSION_QUEUE: usize = 1024;

/// The default `--admission-timeout-ms`: how long a request waits before it is answered
/// 503. Well under client libraries' own timeouts (OpenAI's Python client: 600 s).
pub const DEFAULT_ADMISSION_TIMEOUT: Duration = Duration::from_secs(30);

/// How a model's queue is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// The most waiters; 0: no queue (requests route at once, busy workers or not).
    pub capacity: usize,
    /// How long a waiter waits for room before it is refused.
    pub timeout: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            capacity: DEFAULT_ADMISSION_QUEUE,
            timeout: DEFAULT_ADMISSION_TIMEOUT,
        }
    }
}

impl AdmissionConfig {
    /// No queue.
    pub const OFF: Self = Self {
        capacity: 0,
        timeout: Duration::ZERO,
    };
}

/// What [`AdmissionQueue::cancel`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// It was waiting: removed, never admitted.
    Waiting,
    /// It held the pass: the pass is back (the driver should admit the next).
    Admitted,
    /// Neither (already done or cancelled).
    Unknown,
}

type Order = (Reverse<i64>, u64);

#[derive(Clone, Copy, Debug)]
struct Waiter {
    id: WaiterId,
    deadline: Instant,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct AdmissionQueue {
    capacity: usize,
    waiting: BTreeMap<Order, Waiter>,
    by_id: HashMap<WaiterId, Order>,
    pass: Option<WaiterId>,
    arrivals: u64,
}

impl AdmissionQueue {
    /// An empty queue of at most `capacity` waiters.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Whether a queue is kept at all (capacity above 0).
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Its capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Waiters now (the pass holder excluded).
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Whether a newcomer must queue even if there is room: someone waits or holds the
    /// pass (overtaking them would take the room they wait for).
    pub fn must_wait(&self) -> bool {
        !self.waiting.is_empty() || self.pass.is_some()
    }

    /// Whether a waiter holds the pass.
    pub fn pass_out(&self) -> bool {
        self.pass.is_some()
    }

    /// Queues `id` with `priority` (higher first) until `deadline`. Refused with
    /// [`EngineError::QueueFull`] at capacity (or with no queue); an id already queued
    /// keeps its place.
    pub fn push(&mut self, id: WaiterId, priority: i64, deadline: Instant) -> Result<()> {
        if self.by_id.contains_key(&id) || self.pass == Some(id) {
            return Ok(());
        }
        if self.waiting.len() >= self.capacity {
            return Err(EngineError::QueueFull {
                capacity: self.capacity,
            });
        }
        let order = (Reverse(priority), self.arrivals);
        self.arrivals += 1;
        self.waiting.insert(order, Waiter { id, deadline });
        self.by_id.insert(id, order);
        Ok(())
    }

    /// Admits the next waiter if the pass is free (the driver saw room): it gets the pass.
    pub fn admit_next(&mut self) -> Option<WaiterId> {
        if self.pass.is_some() {
            return None;
        }
        let (_, w) = self.waiting.pop_first()?;
        self.by_id.remove(&w.id);
        self.pass = Some(w.id);
        Some(w.id)
    }

    /// The admitted waiter `id` was routed (or failed to be): the pass is back. False if
    /// `id` did not hold it.
    pub fn done(&mut self, id: WaiterId) -> bool {
        if self.pass == Some(id) {
            self.pass = None;
            true
        } else {
            false
        }
    }

    /// `id` gives up (timed out, client gone).
    pub fn cancel(&mut self, id: WaiterId) -> Cancelled {
        if self.done(id) {
            return Cancelled::Admitted;
        }
        match self.by_id.remove(&id) {
            Some(order) => {
                self.waiting.remove(&order);
                Cancelled::Waiting
            }
            None => Cancelled::Unknown,
        }
    }

    /// Whether `id` waits (queued, not admitted).
    pub fn is_waiting(&self, id: WaiterId) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Whether `id` holds the pass.
    pub fn pass_of(&self, id: WaiterId) -> bool {
        self.pass == Some(id)
    }

    /// Removes and returns every waiter whose deadline is at or before `now` (a driver
    /// without per-waiter timers calls this).
    pub fn expire(&mut self, now: Instant) -> Vec<WaiterId> {
        let gone: Vec<(Order, WaiterId)> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(o, w)| (*o, w.id))
            .collect();
        for (order, id) in &gone {
            self.waiting.remove(order);
            self.by_id.remove(id);
        }
        gone.into_iter().map(|(_, id)| id).collect()
    }

    /// The earliest deadline of a waiter.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.values().map(|w| w.deadline).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: u64) -> WaiterId {
        WaiterId(n)
    }

    #[test]
    fn higher_priority_first_then_arrival_order() {
        let t = Instant::now();
        let mut q = AdmissionQueue::new(10);
        q.push(w(1), 0, t).unwrap();
        q.push(w(2), 5, t).unwrap();
        q.push(w(3), 0, t).unwrap();
        q.push(w(4), -3, t).unwrap();
        q.push(w(5), 5, t).unwrap();
        let mut order = Vec::new();
        while let Some(id) = q.admit_next() {
            order.push(id.0);
            assert!(q.done(id));
        }
        assert_eq!(order, [2, 5, 1, 3, 4]);
    }

    #[test]
    fn one_pass_at_a_time_and_newcomers_queue_behind_it() {
        let t = Instant::now();
        let mut q = AdmissionQueue::new(10);
        assert!(!q.must_wait());
        q.push(w(1), 0, t).unwrap();
        q.push(w(2), 0, t).unwrap();
        assert_eq!(q.admit_next(), Some(w(1)));
        assert_eq!(q.admit_next(), None, "the pass is out");
        assert!(q.must_wait());
        assert!(!q.done(w(2)), "only the holder returns the pass");
        assert!(q.done(w(1)));
        assert_eq!(q.admit_next(), Some(w(2)));
        assert!(q.must_wait(), "a pass out still makes newcomers wait");
        assert_eq!(q.cancel(w(2)), Cancelled::Admitted);
        assert!(!q.must_wait());
    }

    #[test]
    fn bounded_and_off() {
        let t = Instant::now();
        let mut q = AdmissionQueue::new(2);
        q.push(w(1), 0, t).unwrap();
        q.push(w(2), 0, t).unwrap();
        q.push(w(1), 9, t).unwrap(); // already queued: keeps its place, no new entry
        assert_eq!(
            q.push(w(3), 9, t),
            Err(EngineError::QueueFull { capacity: 2 })
        );
        assert_eq!(q.len(), 2);
        // The pass holder does not count: one more may wait.
        assert_eq!(q.admit_next(), Some(w(1)));
        q.push(w(3), 0, t).unwrap();
        let mut off = AdmissionQueue::new(0);
        assert!(!off.enabled());
        assert!(off.push(w(1), 0, t).is_err());
    }

    #[test]
    fn cancel_and_expire_remove_waiters() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let mut q = AdmissionQueue::new(10);
        q.push(w(1), 0, t + s).unwrap();
        q.push(w(2), 0, t + 3 * s).unwrap();
        q.push(w(3), 1, t + 2 * s).unwrap();
        assert_eq!(q.next_deadline(), Some(t + s));
        assert_eq!(q.cancel(w(2)), Cancelled::Waiting);
        assert_eq!(q.cancel(w(2)), Cancelled::Unknown);
        assert_eq!(q.expire(t + 2 * s), [w(3), w(1)]);
        assert!(q.is_empty());
        assert_eq!(q.admit_next(), None);
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(3);
        let t = Instant::now();
        let mut q = AdmissionQueue::new(5);
        // Reference: (priority, arrival, id) of the waiting ones.
        let mut model: Vec<(i64, u64, u64)> = Vec::new();
        let mut pass: Option<u64> = None;
        let mut arrival = 0;
        for n in 0..10_000u64 {
            match rng.random_range(0..4) {
                0 => {
                    let p = rng.random_range(-2..3);
                    let r = q.push(w(n), p, t);
                    assert_eq!(r.is_ok(), model.len() < 5);
                    if r.is_ok() {
                        model.push((p, arrival, n));
                        arrival += 1;
                    }
                }
                1 => {
                    let want = if pass.is_none() {
                        model.sort_by_key(|&(p, a, _)| (Reverse(p), a));
                        (!model.is_empty()).then(|| model.remove(0).2)
                    } else {
                        None
                    };
                    let got = q.admit_next().map(|i| i.0);
                    assert_eq!(got, want);
                    if got.is_some() {
                        pass = got;
                    }
                }
                2 => {
                    if let Some(p) = pass.take() {
                        assert!(q.done(w(p)));
                    }
                }
                _ => {
                    if let Some(i) = (!model.is_empty()).then(|| rng.random_range(0..model.len())) {
                        let (_, _, id) = model.remove(i);
                        assert_eq!(q.cancel(w(id)), Cancelled::Waiting);
                    }
                }
            }
            assert_eq!(q.len(), model.len());
            assert_eq!(q.must_wait(), !model.is_empty() || pass.is_some());
        }
    }
}
