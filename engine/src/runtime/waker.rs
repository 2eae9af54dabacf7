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

use crate::sync::{AtomicBool, Ordering, fence};
use std::sync::OnceLock;
use std::thread::Thread;

/// One shard thread's sleep flag and handle.
#[derive(Debug, Default)]
pub(crate) struct Waker {
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

impl Waker {
    /// Called by the shard thread once, before it may park.
    pub(crate) fn register_current(&self) {
        let _ = self.thread.set(std::thread::current());
    }

    /// Shard side: announce the intent to park. The caller re-checks its inboxes after this
    /// and calls [`Waker::cancel_sleep`] instead of parking if anything arrived.
    pub(crate) fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
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
