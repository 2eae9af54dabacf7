//! Sticky sessions: which worker key each client session was last routed to, so a
//! multi-turn agent's requests stay on the key that caches its conversation.
//!
//! The first request of a session routes as any other (by cost); the chosen key is
//! remembered. Later requests go to that key unless it is gone (removed, unhealthy, not in
//! the call's pool), full or busy ([`crate::sched::KeyState`]); then they route by cost and
//! the session moves to the new key. A session unused for `ttl` is forgotten; past
//! `max_sessions` the least recently used one is evicted.
//!
//! # Invariants
//! 1. `by_id` and `order` hold the same sessions: `(id, e)` is in `by_id` iff
//!    `order[e.stamp] == id`; stamps are unique and grow with every touch, so `order` is
//!    least recently used first.
//! 2. `by_id.len() <= max_sessions` after every call; with sessions off (`ttl` `None`) the
//!    table stays empty.
//! 3. `last_used` never decreases along `order` (a `now` older than the latest one seen is
//!    taken as that one), so expiry stops at the first session still alive.
//! 4. Every session dropped is counted once, under exactly one of `evicted`, `expired` or
//!    `dropped`.
//!
//! # Concurrency
//! None: plain data owned by a [`super::Router`], behind its driver's lock.

use crate::error::{EngineError, Result};
use crate::ids::{SessionId, WorkerId, WorkerKey};
use crate::sched::{KeyState, Policy, Pool, RouteMode, Scheduler, SelectionInput};
use hashbrown::HashMap;
use rand::rngs::SmallRng;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The default idle lifetime of a session (`--session-ttl-secs`).
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(300);

/// The default bound on sessions remembered per model (`--max-sessions`): at about 100
/// bytes a session (its hash-map entry and its place in the use order), 10 MB.
pub const DEFAULT_MAX_SESSIONS: usize = 100_000;

/// How sessions are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// How long a session unused is remembered; `None`: sessions are off.
    pub ttl: Option<Duration>,
    /// The most sessions remembered (least recently used evicted first); 0: off.
    pub max_sessions: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            ttl: Some(DEFAULT_SESSION_TTL),
            max_sessions: DEFAULT_MAX_SESSIONS,
        }
    }
}

impl SessionConfig {
    /// Sessions off.
    pub const OFF: Self = Self {
        ttl: None,
        max_sessions: 0,
    };

    /// Whether sessions are kept at all.
    pub fn enabled(&self) -> bool {
        self.ttl.is_some_and(|t| !t.is_zero()) && self.max_sessions > 0
    }
}

/// How a request of a session was routed ([`super::Routed::session`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRoute {
    /// The session's first request (or its first since it was forgotten): routed by cost.
    New,
    /// To the session's key.
    Sticky,
    /// By cost, because the session's key could not take it; the session moved.
    Moved(MoveReason),
}

impl SessionRoute {
    /// The value of the front door's `x-kvengine-route` header and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "session_new",
            Self::Sticky => "session",
            Self::Moved(MoveReason::Busy) => "session_moved_busy",
            Self::Moved(MoveReason::Gone) => "session_moved_gone",
        }
    }
}

/// Why a session's request left its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveReason {
    /// The key is over a busy threshold or at its active-request limit.
    Busy,
    /// The key is out of routing (removed, unhealthy) or outside the call's pool.
    Gone,
}

/// What the table has done, for metrics (monotonic counters, plus `live`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Sessions remembered now.
    pub live: u64,
    /// Sessions evicted at `max_sessions` (least recently used first).
    pub evicted: u64,
    /// Sessions forgotten after `ttl` unused.
    pub expired: u64,
    /// Sessions dropped because their worker was removed.
    pub dropped: u64,
}

impl std::ops::AddAssign for SessionStats {
    fn add_assign(&mut self, o: Self) {
        self.live += o.live;
        self.evicted += o.evicted;
        self.expired += o.expired;
        self.dropped += o.dropped;
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: WorkerKey,
    last_used: Instant,
    stamp: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Sessions {
    config: SessionConfig,
    by_id: HashMap<SessionId, Entry>,
    /// Least recently used first (invariant 1).
    order: BTreeMap<u64, SessionId>,
    next_stamp: u64,
    /// The latest `now` seen (invariant 3).
    latest: Option<Instant>,
    stats: SessionStats,
}

impl Default for Sessions {
    fn default() -> Self {
        Self::new(SessionConfig::OFF)
    }
}

impl Sessions {
    /// An empty table kept as `config` says.
    pub fn new(config: SessionConfig) -> Self {
        Self {
            config,
            by_id: HashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
            latest: None,
            stats: SessionStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> SessionConfig {
        self.config
    }

    /// Replaces the configuration (sessions over the new bound are evicted, all of them
    /// when sessions are turned off).
    pub fn set_config(&mut self, config: SessionConfig) {
        self.config = config;
        let keep = if config.enabled() {
            config.max_sessions
        } else {
            0
        };
        while self.by_id.len() > keep {
            if !self.drop_oldest() {
                break;
            }
        }
    }

    /// Whether sessions are kept.
    pub fn enabled(&self) -> bool {
        self.config.enabled()
    }

    /// Sessions remembered now.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no session is remembered.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The counters (and the live count).
    pub fn stats(&self) -> SessionStats {
        SessionStats {
            live: self.by_id.len() as u64,
            ..self.stats
        }
    }

    fn clamp(&mut self, now: Instant) -> Instant {
        let now = self.latest.map_or(now, |l| l.max(now));
        self.latest = Some(now);
        now
    }

    /// The key session `id` was last routed to, if it is remembered and not idle past the
    /// TTL at `now` (sessions idle past it are forgotten first). Does not refresh it: a
    /// request refreshes its session when it is routed ([`Sessions::assign`]).
    pub fn lookup(&mut self, now: Instant, id: SessionId) -> Option<WorkerKey> {
        if !self.enabled() {
            return None;
        }
        let now = self.clamp(now);
        self.expire(now);
        self.by_id.get(&id).map(|e| e.key)
    }

    /// The key session `id` is remembered on, without expiring anything.
    pub fn peek(&self, id: SessionId) -> Option<WorkerKey> {
        self.by_id.get(&id).map(|e| e.key)
    }

    /// Remembers that session `id` was routed to `key` at `now` (new, refreshed or moved);
    /// evicts the least recently used session past the bound. Nothing with sessions off.
    pub fn assign(&mut self, now: Instant, id: SessionId, key: WorkerKey) {
        if !self.enabled() {
            return;
        }
        let now = self.clamp(now);
        self.expire(now);
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(old) = self.by_id.insert(
            id,
            Entry {
                key,
                last_used: now,
                stamp,
            },
        ) {
            self.order.remove(&old.stamp);
        }
        self.order.insert(stamp, id);
        while self.by_id.len() > self.config.max_sessions {
            if !self.drop_oldest() {
                break;
            }
            self.stats.evicted += 1;
        }
    }

    /// Forgets every session idle for `ttl` or longer at `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let Some(ttl) = self.config.ttl else { return 0 };
        let mut n = 0;
        while let Some((&stamp, &id)) = self.order.first_key_value() {
            let alive = self
                .by_id
                .get(&id)
                .is_some_and(|e| now.saturating_duration_since(e.last_used) < ttl);
            if alive {
                break;
            }
            self.order.remove(&stamp);
            self.by_id.remove(&id);
            n += 1;
        }
        self.stats.expired += n as u64;
        n
    }

    /// Forgets every session on a rank of `worker` (it was removed); returns how many.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let before = self.by_id.len();
        let order = &mut self.order;
        self.by_id.retain(|_, e| {
            let keep = e.key.worker != worker;
            if !keep {
                order.remove(&e.stamp);
            }
            keep
        });
        let n = before - self.by_id.len();
        self.stats.dropped += n as u64;
        n
    }

    /// How a request of session `id` in `pool` routes at `now`: its outcome, and the key
    /// it sticks to (`Some` iff the outcome is [`SessionRoute::Sticky`]). A key that is
    /// busy while every key of the pool is busy or full keeps its session (moving would
    /// trade its cache for no relief).
    pub(crate) fn plan(
        &mut self,
        now: Instant,
        id: SessionId,
        scheduler: &Scheduler,
        pool: Pool,
    ) -> (SessionRoute, Option<WorkerKey>) {
        let Some(key) = self.lookup(now, id) else {
            return (SessionRoute::New, None);
        };
        match scheduler.key_state(key, pool) {
            KeyState::Free => (SessionRoute::Sticky, Some(key)),
            KeyState::Busy if !scheduler.has_room(pool) => (SessionRoute::Sticky, Some(key)),
            KeyState::Busy | KeyState::Full => (SessionRoute::Moved(MoveReason::Busy), None),
            KeyState::Gone => (SessionRoute::Moved(MoveReason::Gone), None),
        }
    }

    /// Drops the least recently used session (uncounted: callers count). False if none.
    fn drop_oldest(&mut self) -> bool {
        match self.order.pop_first() {
            Some((_, id)) => {
                self.by_id.remove(&id);
                true
            }
            None => false,
        }
    }

    /// Whether invariant 1 holds (tests).
    #[cfg(test)]
    fn consistent(&self) -> bool {
        self.by_id.len() == self.order.len()
            && self
                .by_id
                .iter()
                .all(|(id, e)| self.order.get(&e.stamp) == Some(id))
    }
}

/// The policy of a sticky request: its session's key, which the router checked is a
/// candidate ([`Sessions::plan`]). Reports the mode the request would otherwise have
/// routed with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sticky {
    pub key: WorkerKey,
    pub mode: RouteMode,
}

impl Policy for Sticky {
    fn mode(&self) -> RouteMode {
        self.mode
    }

    fn select(&mut self, input: &SelectionInput<'_>, _rng: &mut SmallRng) -> Result<WorkerKey> {
        input
            .candidates
            .binary_search_by_key(&self.key, |c| c.key)
            .map(|_| self.key)
            .map_err(|_| EngineError::UnknownWorker {
                worker: self.key.worker,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(ttl_s: u64, max: usize) -> SessionConfig {
        SessionConfig {
            ttl: Some(Duration::from_secs(ttl_s)),
            max_sessions: max,
        }
    }

    const A: WorkerKey = WorkerKey::new(1, 0);
    const B: WorkerKey = WorkerKey::new(2, 0);

    #[test]
    fn a_session_remembers_its_last_key_until_idle_past_the_ttl() {
        let t0 = Instant::now();
        let mut s = Sessions::new(cfg(10, 100));
        let id = SessionId::of(b"agent-1");
        assert_eq!(s.lookup(t0, id), None);
        s.assign(t0, id, A);
        assert_eq!(s.lookup(t0 + Duration::from_secs(9), id), Some(A));
        // Moved: the new key wins, refreshed at 9 s.
        s.assign(t0 + Duration::from_secs(9), id, B);
        assert_eq!(s.lookup(t0 + Duration::from_secs(18), id), Some(B));
        // Idle 10 s since the last route: gone.
        assert_eq!(s.lookup(t0 + Duration::from_secs(19), id), None);
        assert_eq!(s.stats().expired, 1);
        assert_eq!(s.len(), 0);
        assert!(s.consistent());
    }

    #[test]
    fn past_the_bound_the_least_recently_used_goes_and_is_counted() {
        let t0 = Instant::now();
        let mut s = Sessions::new(cfg(300, 2));
        let (x, y, z) = (SessionId(1), SessionId(2), SessionId(3));
        s.assign(t0, x, A);
        s.assign(t0, y, A);
        s.assign(t0, x, B); // x used again: y is now the least recent
        s.assign(t0, z, A);
        assert_eq!(s.len(), 2);
        assert_eq!(s.lookup(t0, y), None);
        assert_eq!(s.lookup(t0, x), Some(B));
        assert_eq!(s.lookup(t0, z), Some(A));
        assert_eq!(
            s.stats(),
            SessionStats {
                live: 2,
                evicted: 1,
                expired: 0,
                dropped: 0
            }
        );
        assert!(s.consistent());
    }

    #[test]
    fn removing_a_worker_drops_its_sessions_only() {
        let t0 = Instant::now();
        let mut s = Sessions::new(cfg(300, 10));
        s.assign(t0, SessionId(1), A);
        s.assign(t0, SessionId(2), WorkerKey::new(1, 1));
        s.assign(t0, SessionId(3), B);
        assert_eq!(s.remove_worker(WorkerId(1)), 2);
        assert_eq!(s.lookup(t0, SessionId(3)), Some(B));
        assert_eq!(s.stats().dropped, 2);
        assert!(s.consistent());
    }

    #[test]
    fn off_keeps_nothing_and_turning_off_empties() {
        let t0 = Instant::now();
        let mut s = Sessions::new(SessionConfig {
            ttl: Some(Duration::ZERO),
            max_sessions: 10,
        });
        s.assign(t0, SessionId(1), A);
        assert!(s.is_empty());
        let mut s = Sessions::new(cfg(300, 10));
        s.assign(t0, SessionId(1), A);
        s.set_config(SessionConfig::OFF);
        assert!(s.is_empty());
        assert_eq!(s.lookup(t0, SessionId(1)), None);
    }

    #[test]
    fn a_clock_going_backwards_neither_panics_nor_reorders() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(5);
        let mut s = Sessions::new(cfg(10, 10));
        s.assign(later, SessionId(1), A);
        s.assign(t0, SessionId(2), B); // taken as `later`
        assert_eq!(
            s.lookup(later + Duration::from_secs(9), SessionId(2)),
            Some(B)
        );
        assert_eq!(s.expire(later + Duration::from_secs(10)), 2);
        assert!(s.consistent());
    }

    #[test]
    fn random_operations_match_a_naive_model() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(7);
        let t0 = Instant::now();
        let (ttl, max) = (20u64, 8usize);
        let mut s = Sessions::new(cfg(ttl, max));
        // (id, key, last_used seconds, stamp) in use order.
        let mut model: Vec<(u64, WorkerKey, u64)> = Vec::new();
        let mut t = 0u64;
        for _ in 0..5_000 {
            t += rng.random_range(0..3);
            let now = t0 + Duration::from_secs(t);
            model.retain(|&(_, _, at)| t - at < ttl);
            let id = rng.random_range(0..16u64);
            if rng.random_bool(0.5) {
                let key = WorkerKey::new(rng.random_range(1..4), 0);
                s.assign(now, SessionId(id), key);
                model.retain(|&(i, _, _)| i != id);
                model.push((id, key, t));
                if model.len() > max {
                    model.remove(0);
                }
            } else if rng.random_bool(0.05) {
                let w = rng.random_range(1..4);
                s.remove_worker(WorkerId(w));
                model.retain(|&(_, k, _)| k.worker != WorkerId(w));
            } else {
                let want = model.iter().find(|m| m.0 == id).map(|m| m.1);
                assert_eq!(s.lookup(now, SessionId(id)), want);
            }
            assert!(s.len() <= max);
            assert!(s.consistent());
        }
    }
}

#[cfg(test)]
mod router_tests {
    use super::*;
    use crate::matches::Matches;
    use crate::router::{RouteCall, Router};
    use crate::sched::{BusyThresholds, SchedulerConfig, WorkerRole};

    const A: WorkerKey = WorkerKey::new(1, 0);
    const B: WorkerKey = WorkerKey::new(2, 0);

    fn router(max_active: Option<u64>) -> Router {
        let config = SchedulerConfig {
            busy: BusyThresholds {
                max_active,
                ..Default::default()
            },
            ..SchedulerConfig::default()
        };
        let mut r = Router::new(config, None).unwrap();
        r.add_worker(A, WorkerRole::default()).unwrap();
        r.add_worker(B, WorkerRole::default()).unwrap();
        r.set_sessions(SessionConfig::default());
        r
    }

    fn route(
        r: &mut Router,
        now: Instant,
        name: &str,
        session: Option<u64>,
    ) -> (WorkerKey, Option<SessionRoute>) {
        let call = RouteCall {
            request_id: Some(name.into()),
            tokens: &[1; 32],
            session: session.map(SessionId),
            ..RouteCall::default()
        };
        let routed = r.route(now, &call, &[], &Matches::default()).unwrap();
        (routed.decision.worker, routed.session)
    }

    #[test]
    fn a_session_sticks_against_load_until_its_key_is_busy_then_moves() {
        let now = Instant::now();
        let mut r = router(Some(3));
        let (first, how) = route(&mut r, now, "s1", Some(7));
        assert_eq!(how, Some(SessionRoute::New));
        let other = if first == A { B } else { A };
        // Load alone would alternate; the session stays on its key.
        for i in 0..2 {
            assert_eq!(
                route(&mut r, now, &format!("s{}", i + 2), Some(7)),
                (first, Some(SessionRoute::Sticky))
            );
        }
        // Its key now carries 3 (busy at 3) and the other is free: it moves, for good.
        assert_eq!(
            route(&mut r, now, "s4", Some(7)),
            (other, Some(SessionRoute::Moved(MoveReason::Busy)))
        );
        assert_eq!(r.sessions().peek(SessionId(7)), Some(other));
        // Without a session the same call is load-balanced and reports nothing.
        assert_eq!(route(&mut r, now, "n1", None).1, None);
    }

    #[test]
    fn an_unhealthy_key_moves_its_sessions_and_a_removed_one_drops_them() {
        let now = Instant::now();
        let mut r = router(None);
        let (first, _) = route(&mut r, now, "a", Some(1));
        r.remove_worker(first.worker, false); // unhealthy: the session is kept
        assert_eq!(r.sessions().len(), 1);
        let (second, how) = route(&mut r, now, "b", Some(1));
        assert_ne!(second, first);
        assert_eq!(how, Some(SessionRoute::Moved(MoveReason::Gone)));
        r.remove_worker(second.worker, true); // gone for good: its sessions too
        assert!(r.sessions().is_empty());
        assert_eq!(r.sessions().stats().dropped, 1);
    }

    #[test]
    fn naming_a_worker_overrides_the_session() {
        let now = Instant::now();
        let mut r = router(None);
        let (first, _) = route(&mut r, now, "a", Some(1));
        let other = if first == A { B } else { A };
        let call = RouteCall {
            request_id: Some("d".into()),
            tokens: &[1; 32],
            session: Some(SessionId(1)),
            overrides: crate::sched::RouteOverrides {
                worker: Some(other.worker),
                ..Default::default()
            },
            ..RouteCall::default()
        };
        let routed = r.route(now, &call, &[], &Matches::default()).unwrap();
        assert_eq!((routed.decision.worker, routed.session), (other, None));
        // The session follows where its request went.
        assert_eq!(r.sessions().peek(SessionId(1)), Some(other));
    }
}
