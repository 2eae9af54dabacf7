//! A core's bookkeeping for client syncs: when may it answer `Synced`?
//!
//! A client's `Sync` tagged `tag` goes to every core. Each core, on handling it, sends
//! `Fence { client, tag }` to every peer core (behind the operations it produced from that
//! client's earlier events, on the same ring) and records its own sync here; each fence it
//! receives from a peer is recorded here too. [`SyncBarrier`] is sans-IO: it only says
//! when the core may reply; the core sends the fences and the reply.
//!
//! # Invariants
//! 1. For each `(client, tag)`, [`SyncBarrier::own_sync`] or [`SyncBarrier::peer_fence`]
//!    returns `true` exactly once, and only after this core's own sync and a fence from
//!    each of the `peers` peers have all been recorded, in whichever order they arrive.
//!    (A client tags its calls with distinct, increasing numbers, so a `(client, tag)` is
//!    synced once; each peer sends one fence for it.)
//! 2. A completed `(client, tag)` leaves no entry behind.
//!
//! # Concurrency
//! None: each core thread owns its barrier, and nothing else touches it. The cross-core
//! ordering it relies on (a fence follows the operations before it on the same SPSC ring)
//! is the rings' (`crate::ring`), and is checked with this type by the loom model in
//! `loom-tests/tests/barrier.rs`.

use hashbrown::{HashMap, HashSet};

/// One core's outstanding syncs: fences received from peers, and its own syncs handled.
#[derive(Debug)]
pub struct SyncBarrier {
    /// Fences needed per sync: the number of other cores.
    peers: usize,
    /// Fences received, by `(client, tag)`, for syncs not yet complete.
    fences: HashMap<(usize, u64), usize>,
    /// Syncs this core has handled itself and not yet completed.
    own: HashSet<(usize, u64)>,
}

impl SyncBarrier {
    /// A barrier for a core with `peers` other cores.
    pub fn new(peers: usize) -> Self {
        Self {
            peers,
            fences: HashMap::new(),
            own: HashSet::new(),
        }
    }

    /// This core handled `client`'s `Sync` tagged `tag` (after sending its fences). `true`:
    /// the sync is now complete; reply `Synced`.
    pub fn own_sync(&mut self, client: usize, tag: u64) -> bool {
        self.own.insert((client, tag));
        self.complete(client, tag)
    }

    /// A peer's `Fence { client, tag }` arrived. `true`: the sync is now complete; reply
    /// `Synced`.
    pub fn peer_fence(&mut self, client: usize, tag: u64) -> bool {
        *self.fences.entry((client, tag)).or_insert(0) += 1;
        self.complete(client, tag)
    }

    /// Syncs begun (an own sync or a fence recorded) and not yet complete.
    #[cfg(any(test, kvengine_loom))]
    pub fn outstanding(&self) -> usize {
        let fenced_only = self
            .fences
            .keys()
            .filter(|k| !self.own.contains(*k))
            .count();
        self.own.len() + fenced_only
    }

    /// Completes `(client, tag)` if its own sync and every peer's fence are in: forgets it
    /// and returns `true`.
    fn complete(&mut self, client: usize, tag: u64) -> bool {
        let key = (client, tag);
        let fenced = self.fences.get(&key).copied().unwrap_or(0);
        if fenced == self.peers && self.own.remove(&key) {
            self.fences.remove(&key);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_sync_last_completes() {
        let mut b = SyncBarrier::new(2);
        assert!(!b.peer_fence(0, 1));
        assert!(!b.peer_fence(0, 1));
        assert!(b.own_sync(0, 1));
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn fence_last_completes() {
        let mut b = SyncBarrier::new(2);
        assert!(!b.own_sync(0, 1));
        assert!(!b.peer_fence(0, 1));
        assert!(b.peer_fence(0, 1));
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn own_sync_between_fences_completes_on_the_last_fence() {
        let mut b = SyncBarrier::new(2);
        assert!(!b.peer_fence(3, 9));
        assert!(!b.own_sync(3, 9));
        assert!(b.peer_fence(3, 9));
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn a_single_core_completes_on_its_own_sync() {
        let mut b = SyncBarrier::new(0);
        assert!(b.own_sync(0, 1));
        assert!(b.own_sync(0, 2));
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn interleaved_clients_and_tags_complete_independently() {
        let mut b = SyncBarrier::new(2);
        assert!(!b.own_sync(0, 1));
        assert!(!b.peer_fence(1, 1));
        assert!(!b.peer_fence(0, 1));
        assert!(!b.peer_fence(1, 1));
        assert!(!b.own_sync(0, 2));
        assert!(!b.peer_fence(0, 2));
        assert_eq!(b.outstanding(), 3);
        // Client 1's fences are all in; its own sync completes it.
        assert!(b.own_sync(1, 1));
        // (0, 2) has one fence of two: (0, 1)'s second fence must not complete it.
        assert!(b.peer_fence(0, 1));
        assert!(!b.own_sync(0, 2));
        assert!(b.peer_fence(0, 2));
        assert_eq!(b.outstanding(), 0);
    }

    #[test]
    fn never_completes_twice() {
        let mut b = SyncBarrier::new(1);
        assert!(!b.own_sync(0, 1));
        // A repeated own sync is the same sync.
        assert!(!b.own_sync(0, 1));
        assert!(b.peer_fence(0, 1));
        // Nothing completes (0, 1) again.
        assert!(!b.peer_fence(0, 1));
        assert!(!b.peer_fence(0, 1));
    }

    #[test]
    fn every_arrival_order_completes_exactly_once() {
        // The fences of one sync are alike, so an order is where the own sync falls among
        // them.
        let peers = 3;
        for own_at in 0..=peers {
            let mut b = SyncBarrier::new(peers);
            let done: Vec<bool> = (0..=peers)
                .map(|i| {
                    if i == own_at {
                        b.own_sync(5, 7)
                    } else {
                        b.peer_fence(5, 7)
                    }
                })
                .collect();
            let mut expect = vec![false; peers + 1];
            expect[peers] = true;
            assert_eq!(done, expect, "own sync at {own_at}");
            assert_eq!(b.outstanding(), 0);
        }
    }
}
