//! Waking a parked shard thread.
//!
//! A shard with nothing to do spins, then yields, then parks. A client that has just pushed
//! a message wakes it if it is parked.
//!
//! # Memory orderings
//! Dekker's pattern with fences: the shard stores `sleeping = true`, issues a SeqCst fence,
//! then re-checks its inboxes; a client pushes (the ring's Release store), issues a SeqCst
//! fence, then loads `sleeping`. At least one of them sees the other's write, so either the
//! shard finds the message or the client unparks the shard. The shard also parks with a
//! timeout, which bounds the cost of any wake-up this reasoning might miss.

use crate::sync::{AtomicBool, Ordering, Thread, current_thread, fence, park_timeout};
use std::sync::OnceLock;
use std::time::Duration;

/// One shard thread's sleep flag and handle.
#[derive(Debug, Default)]
pub(crate) struct Waker {
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

impl Waker {
    /// Called by the shard thread once, before it may park.
    pub(crate) fn register_current(&self) {
        let _ = self.thread.set(current_thread());
    }

    /// Shard side: announce the intent to park. The caller re-checks its inboxes after this
    /// and calls [`Waker::cancel_sleep`] instead of parking if anything arrived.
    pub(crate) fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Shard side, after [`Waker::prepare_sleep`] found nothing to do: park (at most
    /// `timeout`), then clear the flag.
    pub(crate) fn sleep(&self, timeout: Duration) {
        park_timeout(timeout);
        self.cancel_sleep();
    }

    /// Shard side: no longer parked or about to park.
    pub(crate) fn cancel_sleep(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Client side, after a push: unpark the shard if it is parked or about to park.
    #[inline]
    pub(crate) fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.sleeping.store(false, Ordering::Relaxed);
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
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
}
