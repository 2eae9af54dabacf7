//! The admission queue's wake-ups: one oneshot per request waiting in a model's queue
//! ([`engine::router::admission`], kept in the namespaces under the routing lock). The
//! routing state admits a waiter under its lock and wakes it here after releasing the lock;
//! the waiter routes, then hands the pass back ([`super::routing::Routing`]).
//!
//! # Invariants
//! 1. A waiter's sender is registered before its id enters an engine queue and removed
//!    when the waiter leaves (admitted and routed, timed out, or its client gone): `live`
//!    counts the registered senders, so no wake-up work happens while nobody waits.
//! 2. Waking an id whose waiter already left does nothing; the waiter's own exit returned
//!    whatever it held (see [`super::routing`]).
//!
//! # Concurrency
//! `senders` is a leaf lock outside the hub's order ([`super::lock_order`]): never held
//! while another lock is taken. A waiter registers under the routing lock (so a pump
//! that admits it finds its sender); wake-ups happen with the routing lock released.

use engine::WaiterId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use tokio::sync::oneshot;

/// See the module docs.
#[derive(Debug, Default)]
pub struct Waiters {
    /// The next waiter id (ids are never reused).
    next: AtomicU64,
    /// Registered senders (invariant 1); written under `senders`, read lock-free by
    /// [`Waiters::idle`] (Relaxed: a stale zero only skips a pump that a later event
    /// repeats, a stale non-zero costs one lock).
    live: AtomicUsize,
    senders: Mutex<HashMap<WaiterId, oneshot::Sender<()>>>,
}

impl Waiters {
    /// A fresh waiter id (never reused).
    pub(crate) fn next_id(&self) -> WaiterId {
        WaiterId(self.next.fetch_add(1, Relaxed))
    }

    /// Registers waiter `id`: what it awaits.
    pub(crate) fn register(&self, id: WaiterId) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut s = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.insert(id, tx);
        self.live.store(s.len(), Relaxed);
        rx
    }

    /// Forgets `id`'s sender (it left).
    pub(crate) fn forget(&self, id: WaiterId) {
        let mut s = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.remove(&id);
        self.live.store(s.len(), Relaxed);
    }

    /// Wakes `id` (admitted); false if it left already.
    pub(crate) fn wake(&self, id: WaiterId) -> bool {
        let tx = {
            let mut s = self
                .senders
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let tx = s.remove(&id);
            self.live.store(s.len(), Relaxed);
            tx
        };
        tx.is_some_and(|tx| tx.send(()).is_ok())
    }

    /// Whether nobody waits (no admission work to do).
    pub(crate) fn idle(&self) -> bool {
        self.live.load(Relaxed) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_woken_waiter_receives_once_and_a_gone_one_is_skipped() {
        let w = Waiters::default();
        assert!(w.idle());
        let (a, b) = (w.next_id(), w.next_id());
        let (rx_a, rx_b) = (w.register(a), w.register(b));
        assert_ne!(a, b);
        assert!(!w.idle());
        drop(rx_b);
        assert!(!w.wake(b), "its receiver is gone");
        assert!(w.wake(a));
        assert!(rx_a.await.is_ok());
        assert!(!w.wake(a), "woken once");
        assert!(w.idle());
    }
}
