//! The hub's lock order, written once and checked in debug builds.
//!
//! Every lock the hub's parts hold is taken through [`Level::enter`] with its level; a
//! thread may only take a lock of a higher level than every lock it holds (debug builds
//! panic on a violation, naming both locks; release builds compile the check away). The
//! order:
//!
//! | level | lock | owner |
//! |---|---|---|
//! | 1 | the worker registry (`RwLock`) | [`super::registry::Registry`] |
//! | 2 | the routing namespaces (`Mutex`) | [`super::routing::Routing`] |
//! | 3 | the unverified keys (`Mutex`) | [`super::gate::IngestGate`] |
//! | 4 | an engine handle (`Mutex`) | [`super::engine_link`] |
//!
//! Leaves outside the order (never held while taking another lock): the warm-restart maps
//! ([`super::persisted`]), the finish wake-ups ([`super::wakeups`]) and the admission
//! queue's waiters ([`super::admission`]).
//!
//! No hub lock is held across an engine call made on a hosted core (a thread blocked on
//! such a lock could be the core the call waits for): engine calls happen with at most an
//! engine handle (level 4) held.

/// A lock's place in the order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The worker registry.
    Registry = 1,
    /// The routing namespaces.
    Routing = 2,
    /// The unverified keys.
    Unverified = 3,
    /// An engine handle.
    Handle = 4,
}

#[cfg(debug_assertions)]
thread_local! {
    /// How many locks of each level this thread holds.
    static HELD: std::cell::Cell<[u16; 5]> = const { std::cell::Cell::new([0; 5]) };
}

/// Held while a lock of its level is held (drop it with the guard).
#[derive(Debug)]
#[must_use]
pub struct Entered {
    #[cfg(debug_assertions)]
    level: Level,
}

impl Level {
    /// Checks that this thread holds no lock of this level or above, and records this one.
    #[inline]
    pub fn enter(self) -> Entered {
        #[cfg(debug_assertions)]
        {
            HELD.with(|held| {
                let mut h = held.get();
                let me = self as usize;
                if let Some(above) = (me..h.len()).find(|&l| h[l] > 0) {
                    panic!(
                        "hub lock order violated: taking the {self:?} lock (level {me}) while \
                         holding a lock of level {above} (see transport/src/hub/lock_order.rs)"
                    );
                }
                h[me] += 1;
                held.set(h);
            });
            Entered { level: self }
        }
        #[cfg(not(debug_assertions))]
        Entered {}
    }
}

#[cfg(debug_assertions)]
impl Drop for Entered {
    fn drop(&mut self) {
        HELD.with(|held| {
            let mut h = held.get();
            let me = self.level as usize;
            h[me] = h[me].saturating_sub(1);
            held.set(h);
        });
    }
}

/// A guard with its level's entry: the entry is dropped with the guard.
#[derive(Debug)]
pub struct Ordered<G> {
    guard: G,
    _entered: Entered,
}

impl<G> Ordered<G> {
    /// `guard`, taken at `level` (enter the level before taking the lock).
    pub fn new(entered: Entered, guard: G) -> Self {
        Self {
            guard,
            _entered: entered,
        }
    }
}

impl<G: std::ops::Deref> std::ops::Deref for Ordered<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: std::ops::DerefMut> std::ops::DerefMut for Ordered<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

/// Locks `m` at `level` (a poisoned lock's data is plain; it is served on).
pub fn lock<T>(level: Level, m: &std::sync::Mutex<T>) -> Ordered<std::sync::MutexGuard<'_, T>> {
    let entered = level.enter();
    Ordered::new(
        entered,
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    #[test]
    fn locks_in_order_pass_and_out_of_order_panic() {
        let a = std::sync::Mutex::new(1);
        let b = std::sync::Mutex::new(2);
        {
            let _r = lock(Level::Registry, &a);
            let _h = lock(Level::Handle, &b);
        }
        {
            // Released: a lower level may be taken again.
            let _r = lock(Level::Routing, &a);
        }
        let out_of_order = std::panic::catch_unwind(|| {
            let _h = lock(Level::Handle, &b);
            let _r = lock(Level::Registry, &a);
        });
        assert!(out_of_order.is_err());
        let same_level_twice = std::panic::catch_unwind(|| {
            let _x = lock(Level::Routing, &a);
            let _y = lock(Level::Routing, &b);
        });
        assert!(same_level_twice.is_err());
    }
}
