//! "Poll this worker now": how the front door tells a TensorRT-LLM worker's poller that a
//! request just finished there (TensorRT-LLM's own router polls after each request too),
//! so the blocks it stored reach the index before the next interval tick.
//!
//! # Invariants
//! 1. Poking a worker without a poller costs one atomic load when no TensorRT-LLM worker
//!    is registered, and one read lock otherwise; it never blocks on a poller.
//! 2. Pokes coalesce: any number of them before the poller wakes make one poll
//!    ([`tokio::sync::Notify`] keeps one permit).

use engine::WorkerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use tokio::sync::Notify;

/// The pollers' wake-ups, by worker.
#[derive(Debug, Default)]
pub struct Pokes {
    any: AtomicBool,
    by_worker: RwLock<HashMap<WorkerId, Arc<Notify>>>,
}

impl Pokes {
    /// The wake-up of `worker`'s poller (made on first use; every poller of the worker
    /// shares it).
    pub fn register(&self, worker: WorkerId) -> Arc<Notify> {
        let mut map = self
            .by_worker
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.any.store(true, Ordering::Release);
        map.entry(worker).or_default().clone()
    }

    /// Forgets `worker`'s wake-up (its poller stopped).
    pub fn unregister(&self, worker: WorkerId) {
        let mut map = self
            .by_worker
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.remove(&worker);
        self.any.store(!map.is_empty(), Ordering::Release);
    }

    /// Whether any worker has a poller (one atomic load): callers skip finding out which
    /// worker to poke when none does.
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Wakes `worker`'s poller, if it has one.
    pub fn poke(&self, worker: WorkerId) {
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
        let pokes = Pokes::default();
        pokes.poke(WorkerId(1)); // nobody registered: nothing happens
        let n = pokes.register(WorkerId(1));
        pokes.poke(WorkerId(2));
        pokes.poke(WorkerId(1));
        pokes.poke(WorkerId(1));
        tokio::time::timeout(std::time::Duration::from_secs(1), n.notified())
            .await
            .unwrap();
        // Two pokes coalesced into the one permit just taken.
        let again = tokio::time::timeout(std::time::Duration::from_millis(20), n.notified()).await;
        assert!(again.is_err());
        pokes.unregister(WorkerId(1));
        pokes.poke(WorkerId(1));
        let after = tokio::time::timeout(std::time::Duration::from_millis(20), n.notified()).await;
        assert!(after.is_err());
    }
}
