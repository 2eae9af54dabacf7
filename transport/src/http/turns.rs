//! How many times a served connection's task has been polled: lets a response body tell a
//! new turn of its connection's task from a second poll inside the same turn.
//!
//! hyper polls a response body again within one poll of the connection (it loops while it
//! can write), so a body that returns `Pending` and wakes itself, to let another task run
//! first, is polled again before that task ran. The connection's guard
//! (`super::conn::serve`) bumps [`ConnTurns`] at every poll of the connection's task and
//! hands it to the handlers as a request extension; a body that remembers the count when it
//! yielded knows the scheduler has gone round once the count moves.
//!
//! # Invariants
//! 1. The count only grows, by one per poll of the connection's task.
//! 2. It is touched only from that task (and read by the bodies it polls), so `Relaxed` is
//!    enough: the counter orders nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The poll count of one served connection's task (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct ConnTurns(Arc<AtomicU64>);

impl ConnTurns {
    /// The count now.
    pub fn now(&self) -> u64 {
        self.0.load(Relaxed)
    }

    /// One more poll of the connection's task.
    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_count() {
        let a = ConnTurns::default();
        let b = a.clone();
        assert_eq!(b.now(), 0);
        a.bump();
        a.bump();
        assert_eq!(b.now(), 2);
    }
}
