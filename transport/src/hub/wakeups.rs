//! "A request just finished on this worker": wake-ups for event sources that want to know
//! (a TensorRT-LLM worker's poller polls at once, as TensorRT-LLM's own router does after
//! each request, so the blocks it stored reach the index before the next interval tick).
//! Routing only rings the bell; which sources listen is theirs to say.
//!
//! # Invariants
//! 1. Waking a worker nobody listens to costs one atomic load while no source listens at
//!    all, and one read lock otherwise; it never blocks on a listener.
//! 2. Wake-ups coalesce: any number of them before the listener wakes make one poll
//!    ([`tokio::sync::Notify`] keeps one permit).

use engine::WorkerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use tokio::sync::Notify;

/// The listeners' wake-ups, by worker.
#[derive(Debug, Default)]
pub struct FinishWakeups {
    any: AtomicBool,
    by_worker: RwLock<HashMap<WorkerId, Arc<Notify>>>,
}

impl FinishWakeups {
    /// The wake-up of `worker`'s listener (made on first use; every listener of the worker
    /// shares it).
    pub fn register(&self, worker: WorkerId) -> Arc<Notify> {
        let mut map = self
            .by_worker
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.any.store(true, Ordering::Release);
        map.entry(worker).or_default().clone()
    }

    /// Forgets `worker`'s wake-up (its listener stopped).
    pub fn unregister(&self, worker: WorkerId) {
        let mut map = self
            .by_worker
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.remove(&worker);
        self.any.store(!map.is_empty(), Ordering::Release);
    }

    /// Whether any worker has a listener (one atomic load): callers skip finding out which
    /// worker to wake when none does.
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Wakes `worker`'s listener, if it has one.
    pub fn wake(&self, worker: WorkerId) {
        if !self.any() {
            return;
        }
        let map = self
            .by_worker
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = map.get(&worker) {
            n.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_poke_wakes_the_registered_poller_once() {
        let pokes = FinishWakeups::default();
        pokes.wake(WorkerId(1)); // nobody registered: nothing happens
        let n = pokes.register(WorkerId(1));
        pokes.wake(WorkerId(2));
        pokes.wake(WorkerId(1));
        pokes.wake(WorkerId(1));
        tokio::time::timeout(std::time::Duration::from_secs(1), n.notified())
            .await
            .unwrap();
        // Two pokes coalesced into the one permit just taken.
        let again = tokio::time::timeout(std::time::Duration::from_millis(20), n.notified()).await;
        assert!(again.is_err());
        pokes.unregister(WorkerId(1));
        pokes.wake(WorkerId(1));
        let after = tokio::time::timeout(std::time::Duration::from_millis(20), n.notified()).await;
        assert!(after.is_err());
    }
}
