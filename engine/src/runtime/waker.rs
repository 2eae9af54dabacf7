//! Waking a parked thread: a core waiting for messages, or a client waiting for a reply.
//!
//! A waiter with nothing to do spins, then parks. Whoever has just pushed a message for it
//! wakes it if it is parked (a core after a reply, a client after a request). A waiter is a
//! thread (unparked) or, for a core hosted on an async runtime's thread
//! ([`super::CoreHost`]), a task (woken through its `std::task::Waker`, which makes the
//! runtime leave its I/O poll).
//!
//! # Memory orderings
//! Dekker's pattern with fences: the waiter stores `sleeping = true`, issues a SeqCst fence,
//! then re-checks its rings; a pusher pushes (the ring's Release store), issues a SeqCst
//! fence, then loads `sleeping`. At least one of them sees the other's write, so either the
//! waiter finds the message or the pusher unparks it. Parking has a timeout too, which bounds
//! the cost of any wake-up this reasoning might miss.
//!
//! # The doorbell
//! A client that has pushed a message for a core calls [`Waker::ring`], which counts the
//! push (`rung`, a Release increment after it) and then wakes the core. A core in the middle of an event's directory work checks its doorbell at each
//! pause ([`Waker::rung_since`], an Acquire load) and scans its query rings only when the
//! count moved; seeing an increment means seeing the push before it. The doorbell is only a
//! hint: a push whose increment a pause did not see is found by the next pause or by the
//! core's round, which scans every ring whatever the count, so no message waits longer
//! than it would without it.
//!
//! # Concurrency
//! The waiter's handle sits behind a mutex because a client handle may move between threads
//! and a hosted core parks either as a task or as its thread: it re-registers before every
//! park. The mutex is taken only to park and to wake a parked waiter, never on the busy
//! path.

use crate::sync::{
    AtomicBool, AtomicU64, Mutex, Ordering, Thread, current_thread, fence, park_timeout,
};
use std::time::Duration;

/// Who to wake.
#[derive(Debug)]
enum Target {
    Thread(Thread),
    Task(std::task::Waker),
}

/// One waiter's sleep flag and thread or task.
#[derive(Debug, Default)]
pub(crate) struct Waker {
    sleeping: AtomicBool,
    /// Pushes announced by [`Waker::ring`] (see the module docs, "The doorbell").
    rung: AtomicU64,
    target: Mutex<Option<Target>>,
}

impl Waker {
    /// Records the calling thread as the one to unpark (before it may park).
    pub(crate) fn register_current(&self) {
        let mut slot = self.target.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(Target::Thread(current_thread()));
    }

    /// Records `task` as the one to wake (before it returns `Pending` to sleep).
    pub(crate) fn register_task(&self, task: &std::task::Waker) {
        let mut slot = self.target.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some(Target::Task(t)) if t.will_wake(task) => {}
            _ => *slot = Some(Target::Task(task.clone())),
        }
    }

    /// Waiter side: announce the intent to park. The caller re-checks its inboxes after this
    /// and calls [`Waker::cancel_sleep`] instead of parking if anything arrived.
    pub(crate) fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Waiter side, after [`Waker::prepare_sleep`] found nothing to do: park (at most
    /// `timeout`), then clear the flag.
    pub(crate) fn sleep(&self, timeout: Duration) {
        park_timeout(timeout);
        self.cancel_sleep();
    }

    /// Waiter side: no longer parked or about to park.
    pub(crate) fn cancel_sleep(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Pusher side, after a push: is the waiter parked or about to park? (It then does
    /// not see the push until woken.)
    #[inline]
    pub(crate) fn asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        self.sleeping.load(Ordering::Relaxed)
    }

    /// Pusher side, after a push: unpark the waiter if it is parked or about to park.
    #[inline]
    pub(crate) fn wake(&self) {
        if self.asleep() {
            self.unpark();
        }
    }

    /// Pusher side, after a client pushed a message for this core: count it on the
    /// doorbell, then [`Waker::wake`]. (Replies to clients only wake: nobody reads a
    /// client's doorbell.)
    #[inline]
    pub(crate) fn ring(&self) {
        self.rung.fetch_add(1, Ordering::Release);
        self.wake();
    }

    /// Waiter side: has anyone pushed since `seen` was last brought up to date (by this
    /// call)? A hint only (module docs, "The doorbell").
    #[inline]
    pub(crate) fn rung_since(&self, seen: &mut u64) -> bool {
        let now = self.rung.load(Ordering::Acquire);
        if now == *seen {
            return false;
        }
        *seen = now;
        true
    }

    #[cold]
    #[inline(never)]
    fn unpark(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
        let slot = self.target.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some(Target::Thread(t)) => t.unpark(),
            Some(Target::Task(t)) => t.wake_by_ref(),
            None => {}
        }
    }
}

/// loom model of the sleep/wake protocol: a message pushed while the shard decides to park
/// is never missed. loom's park has no timeout, so a lost wake-up deadlocks the model.
#[cfg(all(test, kvengine_loom))]
mod loom_tests {
    use super::*;
    use crate::ring::{PopError, ring};
    use crate::sync::Arc;

    #[test]
    fn a_push_during_prepare_sleep_is_never_lost() {
        loom::model(|| {
            let waker = Arc::new(Waker::default());
            waker.register_current();
            let (mut tx, mut rx) = ring::<u32>(2);
            let w = waker.clone();
            let producer = loom::thread::spawn(move || {
                tx.try_push(7).unwrap();
                w.wake();
            });
            // The shard's idle path: announce, re-check, park only if still empty.
            let got = loop {
                match rx.try_pop() {
                    Ok(v) => break v,
                    Err(PopError::Empty) => {
                        waker.prepare_sleep();
                        if rx.is_empty() {
                            waker.sleep(Duration::from_millis(1));
                        } else {
                            waker.cancel_sleep();
                        }
                    }
                    Err(PopError::Closed) => panic!("closed before the value arrived"),
                }
            };
            assert_eq!(got, 7);
            producer.join().unwrap();
        });
    }

    /// The doorbell: a pause that sees the count move finds the push it counted, and once
    /// the pusher is done a pause sees the count move (nothing is skipped for good).
    #[test]
    fn a_rung_doorbell_means_the_push_is_visible() {
        loom::model(|| {
            let waker = Arc::new(Waker::default());
            let (mut tx, mut rx) = ring::<u32>(2);
            let w = waker.clone();
            let producer = loom::thread::spawn(move || {
                tx.try_push(7).unwrap();
                w.ring();
            });
            let mut seen = 0;
            if waker.rung_since(&mut seen) {
                assert_eq!(rx.try_pop(), Ok(7));
            }
            producer.join().unwrap();
            if seen == 0 {
                assert!(waker.rung_since(&mut seen));
                assert_eq!(rx.try_pop(), Ok(7));
            }
            assert!(!waker.rung_since(&mut seen));
        });
    }
}
