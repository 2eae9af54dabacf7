//! The scheduler: registered worker keys, their load, active requests, and routing calls.
//!
//! A routing call validates its overrides, lets the mode's [`Policy`] name its scope, scores
//! the scope's non-busy keys, lets the policy choose, and records the request as active on the
//! chosen key. The returned [`Decision`] carries every candidate's score, so each decision
//! explains itself.
//!
//! # Invariants
//! 1. A request is active only on a registered key: `remove_worker` frees a worker's requests
//!    before its slots can be reused.
//! 2. A call that returns an error leaves workers, loads and active requests unchanged.
//! 3. With the same seed and the same sequence of calls, the decisions are the same.
//!
//! # Concurrency
//! None: a `Scheduler` is owned by one thread (the edge's routing task) and moved, never
//! shared. Replicas exchange active requests through [`Scheduler::add_active`].

use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::error::{EngineError, Result};
use crate::ids::{RequestId, SeqHash, WorkerId, WorkerKey};
use crate::matches::Matches;
use crate::sched::active::{ActiveLoad, ActiveRequests};
use crate::sched::candidates::{CandidateScratch, Context};
use crate::sched::config::{RouteMode, RouteOverrides, SchedulerConfig, WorkerLoad, resolve};
use crate::sched::cost::{CandidateScore, CostInputs};
use crate::sched::direct::Direct;
use crate::sched::drain::{DrainClock, Predicted};
use crate::sched::kv::KvPolicy;
use crate::sched::llmd::Scorers;
use crate::sched::policy::{KeyLoad, Policy, Scope, SelectionInput};
use crate::sched::power_of_two::PowerOfTwo;
use crate::sched::random::RandomPolicy;
use crate::sched::role::{Pool, WorkerRole};
use crate::sched::round_robin::RoundRobin;
use crate::sched::sglang::CacheAware;
use crate::sched::ttft::{Prefill, TtftFit};
use crate::sched::workers::{WorkerSlot, WorkerTable};

mod shadow;
pub use shadow::{ShadowDecision, ShadowSpec};

/// One request to route.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The caller's id for the request; must not be active.
    pub id: RequestId,
    /// The seq hashes of the request's full blocks, in order.
    pub blocks: &'a [SeqHash],
    /// Prompt tokens, the trailing partial block included.
    pub input_tokens: u64,
    /// Settings for this call only.
    pub overrides: RouteOverrides,
}

/// Where a request went, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The chosen worker key.
    pub worker: WorkerKey,
    /// The mode that chose it.
    pub mode: RouteMode,
    /// The pool it was chosen from.
    pub pool: Pool,
    /// Blocks of the request the chosen key already caches.
    pub overlap_blocks: u32,
    /// The largest overlap among the candidates (what `kv` mode could have had).
    pub best_available_overlap_blocks: u32,
    /// Keys of the scope skipped as busy.
    pub busy_skipped: usize,
    /// Every candidate considered, in key order, with its cost.
    pub candidates: Vec<CandidateScore>,
}

impl Decision {
    /// The chosen candidate's score.
    pub fn chosen(&self) -> Option<&CandidateScore> {
        self.candidates
            .binary_search_by_key(&self.worker, |c| c.key)
            .ok()
            .and_then(|i| self.candidates.get(i))
    }
}

/// Queues a request's own prefill on slot `idx`'s clock; returns when it should end.
#[allow(clippy::too_many_arguments)]
fn queue_prefill(
    fits: &[TtftFit],
    clocks: &mut [DrainClock],
    now: Instant,
    idx: usize,
    block_size: u32,
    input_tokens: u64,
    overlap_blocks: u32,
    ctx_blocks: u64,
) -> Predicted {
    let cached = u64::from(overlap_blocks)
        .saturating_mul(u64::from(block_size))
        .min(input_tokens);
    let fit = fits.get(idx).unwrap_or(&TtftFit::PRIOR_FIT);
    let own_ms = fit.prefill_ms(&Prefill {
        tokens: input_tokens - cached,
        cached,
        batch_blocks: ctx_blocks,
    });
    match clocks.get_mut(idx) {
        Some(clock) => clock.push(now, own_ms),
        // Unreachable for a registered slot; a prediction of "now" only skews one sample.
        None => Predicted {
            done_at: now,
            drift_ms: 0.0,
        },
    }
}

/// What removing a worker took away.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerRemoval {
    /// The worker's keys (one per data-parallel rank), sorted.
    pub keys: Vec<WorkerKey>,
    /// Active requests freed with them.
    pub freed_requests: usize,
}

/// Whether a key could take a request now ([`Scheduler::key_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// Not in routing (removed, unhealthy), or not in the call's pool.
    Gone,
    /// At `max_active_per_key`: never chosen.
    Full,
    /// Over a busy threshold: chosen only when every key is busy.
    Busy,
    /// Neither.
    Free,
}

/// Worker selection state. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    workers: WorkerTable,
    active: ActiveRequests,
    /// One cursor per pool: a disaggregated request routes its decode and prefill halves
    /// in turn, and one shared cursor would keep restarting each pool's cycle.
    round_robin: [RoundRobin; 3],
    rng: SmallRng,
    scratch: CandidateScratch,
    /// Each slot's prefill model ([`crate::sched::ttft`]), reset when the slot is reused.
    fits: Vec<TtftFit>,
    /// Each slot's prefill queue clock ([`crate::sched::drain`]), likewise.
    clocks: Vec<DrainClock>,
    /// The shadow policy's own cursors and RNG ([`Scheduler::shadow`]).
    shadow: shadow::ShadowState,
}

impl Scheduler {
    /// A scheduler with no workers. Fails if `config` is out of range.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            workers: WorkerTable::default(),
            active: ActiveRequests::new(config.block_size, config.request_timeout),
            round_robin: Default::default(),
            rng: SmallRng::seed_from_u64(config.seed),
            scratch: CandidateScratch::default(),
            fits: Vec::new(),
            clocks: Vec::new(),
            shadow: shadow::ShadowState::new(config.seed),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Registers `key` as an aggregated worker; returns false if it was already registered.
    pub fn add_worker(&mut self, key: WorkerKey) -> Result<bool> {
        self.add_worker_with_role(key, WorkerRole::Aggregated)
    }

    /// Registers `key` with `role`; returns false if it was already registered (its role then
    /// becomes `role`, for requests routed from now on).
    pub fn add_worker_with_role(&mut self, key: WorkerKey, role: WorkerRole) -> Result<bool> {
        let Some(slot) = self.workers.add(key, role)? else {
            return Ok(false);
        };
        // A reused slot starts from the prior, not from its last worker's speed and queue.
        if self.fits.len() <= slot.idx() {
            self.fits.resize(slot.idx() + 1, TtftFit::default());
            self.clocks.resize(slot.idx() + 1, DrainClock::default());
        }
        if let Some(fit) = self.fits.get_mut(slot.idx()) {
            *fit = TtftFit::default();
        }
        if let Some(clock) = self.clocks.get_mut(slot.idx()) {
            *clock = DrainClock::default();
        }
        Ok(true)
    }

    /// Registered worker keys.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Whether any key is registered with `role`.
    pub fn has_role(&self, role: WorkerRole) -> bool {
        self.workers.has_role(role)
    }

    /// The role `key` is registered with.
    pub fn role(&self, key: WorkerKey) -> Option<WorkerRole> {
        self.workers.slot(key).map(|s| self.workers.role(s))
    }

    /// Unregisters every rank of `worker`, dropping their loads and active requests.
    pub fn remove_worker(&mut self, worker: WorkerId) -> WorkerRemoval {
        let mut removal = WorkerRemoval::default();
        for (key, slot) in self.workers.remove_worker(worker) {
            removal.freed_requests += self.active.drop_slot(slot);
            removal.keys.push(key);
        }
        removal
    }

    /// Records the latest load `key` reported. Fails if `key` is not registered or the load
    /// is out of range.
    pub fn update_load(&mut self, key: WorkerKey, load: WorkerLoad) -> Result<()> {
        self.workers.set_load(key, load)
    }

    /// Chooses a worker key for `request` and records the request as active on it.
    ///
    /// `matches` are the request's overlaps from the index (keys not registered here are
    /// ignored); `cached_blocks(key)` is how many blocks `key` caches in total, consulted only
    /// to break ties.
    pub fn route(
        &mut self,
        now: Instant,
        request: &RouteRequest<'_>,
        matches: &Matches,
        cached_blocks: impl Fn(WorkerKey) -> u64,
    ) -> Result<Decision> {
        self.route_with(now, request, matches, &cached_blocks, None)
    }

    /// [`Scheduler::route`], with `custom` choosing instead of the mode's policy when given:
    /// everything else (validation, busy filtering, scoring, recording the request) is the
    /// same, and the decision reports the policy's mode. Overrides of the mode and worker
    /// are still validated, but a custom policy decides.
    pub fn route_with(
        &mut self,
        now: Instant,
        request: &RouteRequest<'_>,
        matches: &Matches,
        cached_blocks: &dyn Fn(WorkerKey) -> u64,
        custom: Option<&mut dyn Policy>,
    ) -> Result<Decision> {
        let eff = resolve(&self.config, &request.overrides)?;
        if self.workers.len() == 0 {
            return Err(EngineError::NoWorkers);
        }
        if self.active.contains(request.id) {
            return Err(EngineError::DuplicateRequest(request.id));
        }
        let Self {
            config,
            workers,
            active,
            round_robin,
            rng,
            scratch,
            fits,
            clocks,
            shadow: _,
        } = self;

        let mut policies = Policies::new(eff.worker);
        let policy: &mut dyn Policy = match custom {
            Some(custom) => custom,
            None => policies.of(eff.mode, &mut round_robin[request.overrides.pool.index()])?,
        };
        let mode = policy.mode();
        let picked = pick(
            policy,
            &Picking {
                config,
                workers,
                active,
                fits,
                clocks,
                cost: config.cost,
            },
            scratch,
            &eff,
            request,
            request.overrides.pool,
            matches,
            now,
            cached_blocks,
            rng,
        )?;
        let (worker, candidates) = (picked.worker, picked.gathered.candidates);
        let Some(chosen) = candidates.get(picked.chosen) else {
            return Err(EngineError::UnknownWorker {
                worker: worker.worker,
            });
        };
        let overlap_blocks = chosen.overlap_blocks;
        let not_offered = EngineError::UnknownWorker {
            worker: worker.worker,
        };
        let slot = workers.slot(worker).ok_or(not_offered)?;
        let done = queue_prefill(
            fits,
            clocks,
            now,
            slot.idx(),
            config.block_size,
            request.input_tokens,
            overlap_blocks,
            chosen.decode_blocks,
        );
        active.add(
            now,
            slot,
            request.id,
            request.blocks,
            request.input_tokens,
            overlap_blocks,
            done,
        )?;

        Ok(Decision {
            worker,
            mode,
            pool: request.overrides.pool,
            overlap_blocks,
            best_available_overlap_blocks: candidates
                .iter()
                .map(|c| c.overlap_blocks)
                .max()
                .unwrap_or(0),
            busy_skipped: picked.gathered.busy_skipped,
            candidates,
        })
    }

    /// Records a request routed elsewhere (by a peer replica) as active on `key`, exactly as
    /// [`Scheduler::route`] would have.
    pub fn add_active(
        &mut self,
        now: Instant,
        key: WorkerKey,
        id: RequestId,
        blocks: &[SeqHash],
        input_tokens: u64,
        overlap_blocks: u32,
    ) -> Result<()> {
        let slot = self
            .workers
            .slot(key)
            .ok_or(EngineError::UnknownWorker { worker: key.worker })?;
        if self.active.contains(id) {
            return Err(EngineError::DuplicateRequest(id));
        }
        // A peer's request queues on the worker like ours (its context is this key's
        // active blocks: close enough for the clock, which its first token cannot correct).
        let ctx = self.active.load(slot).active_blocks + blocks.len() as u64;
        let done = queue_prefill(
            &self.fits,
            &mut self.clocks,
            now,
            slot.idx(),
            self.config.block_size,
            input_tokens,
            overlap_blocks,
            ctx,
        );
        self.active
            .add(now, slot, id, blocks, input_tokens, overlap_blocks, done)
    }

    /// Marks `id` prefilled (its first token was produced). Idempotent.
    pub fn prefilled(&mut self, id: RequestId) -> Result<()> {
        let slot = self.active.get(id).map(|(slot, ..)| slot);
        self.active.prefilled(id)?;
        if let Some(slot) = slot {
            self.settle(slot);
        }
        Ok(())
    }

    /// Stops `slot`'s queue clock once nothing on it waits for a prefill.
    fn settle(&mut self, slot: crate::sched::workers::WorkerSlot) {
        if self.active.load(slot).active_prefill_tokens == 0
            && let Some(clock) = self.clocks.get_mut(slot.idx())
        {
            clock.idle();
        }
    }

    /// Marks `id` prefilled at `now`, when its first token reached the caller, and teaches
    /// its key's TTFT model how long that took. Idempotent: only the first call observes.
    /// Use it for requests routed here; [`Scheduler::prefilled`] for a peer's.
    pub fn first_token(&mut self, now: Instant, id: RequestId) -> Result<()> {
        let Some((slot, routed)) = self.active.first_token(id)? else {
            return Ok(());
        };
        if let (Some(fit), Some(clock)) = (
            self.fits.get_mut(slot.idx()),
            self.clocks.get_mut(slot.idx()),
        ) {
            let base = fit.fixed_ms(routed.prefill.batch_blocks);
            let service_ms = clock.first_token(now, routed.at, routed.done, base);
            fit.observe(&routed.prefill, service_ms);
        }
        self.settle(slot);
        Ok(())
    }

    /// `key`'s TTFT model, if `key` is registered.
    pub fn ttft_fit(&self, key: WorkerKey) -> Option<&TtftFit> {
        self.workers.slot(key).and_then(|s| self.fits.get(s.idx()))
    }

    /// Frees `id` (it completed or was cancelled).
    pub fn free(&mut self, id: RequestId) -> Result<()> {
        let slot = self.active.free(id)?;
        self.settle(slot);
        Ok(())
    }

    /// Frees `id` at `deadline` rather than `request_timeout` after it was routed, if it is
    /// still active then.
    pub fn set_deadline(&mut self, id: RequestId, deadline: Instant) -> Result<()> {
        self.active.set_deadline(id, deadline)
    }

    /// Frees every request routed `request_timeout` or longer before `now`; returns their
    /// ids, oldest first.
    pub fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        self.active.expire(now)
    }

    /// The load `key`'s active requests put on it, if `key` is registered.
    pub fn active_load(&self, key: WorkerKey) -> Option<ActiveLoad> {
        self.workers.slot(key).map(|s| self.active.load(s))
    }

    /// The last load `key` reported, if it is registered and reported.
    pub fn reported_load(&self, key: WorkerKey) -> Option<WorkerLoad> {
        self.workers
            .slot(key)
            .and_then(|s| self.workers.load(s).copied())
    }

    /// The registered worker keys, sorted.
    pub fn workers(&self) -> impl ExactSizeIterator<Item = WorkerKey> + '_ {
        self.workers.all().iter().map(|(k, _)| *k)
    }

    /// Whether `key` could take a request of `pool` now (sessions and admission ask).
    pub fn key_state(&self, key: WorkerKey, pool: Pool) -> KeyState {
        let in_pool = self
            .workers
            .pool(pool)
            .binary_search_by_key(&key, |(k, _)| *k);
        match in_pool.ok().and_then(|i| self.workers.pool(pool).get(i)) {
            Some(&(_, slot)) => self.slot_state(slot),
            None => KeyState::Gone,
        }
    }

    /// Whether some key of `pool` is [`KeyState::Free`]: a request routed now would not
    /// have to go to a busy or full key. Always true when no busy threshold and no
    /// per-key limit is set (and false for an empty pool).
    pub fn has_room(&self, pool: Pool) -> bool {
        self.workers
            .pool(pool)
            .iter()
            .any(|&(_, slot)| self.slot_state(slot) == KeyState::Free)
    }

    fn slot_state(&self, slot: WorkerSlot) -> KeyState {
        let active = self.active.load(slot).active_requests;
        if self
            .config
            .max_active_per_key
            .is_some_and(|max| active >= max)
        {
            KeyState::Full
        } else if self.config.busy.is_busy(self.workers.load(slot), active) {
            KeyState::Busy
        } else {
            KeyState::Free
        }
    }

    /// Number of active requests over all keys.
    pub fn active_requests(&self) -> usize {
        self.active.len()
    }

    /// What `id` adds to its worker while active: its key, blocks and the prefill tokens
    /// still pending (what a peer replica needs to track it).
    pub fn active_request(&self, id: RequestId) -> Option<(WorkerKey, &[SeqHash], u64)> {
        let (slot, blocks, pending) = self.active.get(id)?;
        let key = self.workers.all().iter().find(|(_, s)| *s == slot)?.0;
        Some((key, blocks, pending))
    }

    /// Whether `id` is active.
    pub fn is_active(&self, id: RequestId) -> bool {
        self.active.contains(id)
    }

    /// Checks the scheduler's internal invariants (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.active.check_invariants();
        assert!(self.scratch.is_clean());
    }
}

/// The stateless policies one decision may use, and `direct`'s for the call's worker.
struct Policies {
    kv: KvPolicy,
    random: RandomPolicy,
    sglang: CacheAware,
    llmd: Scorers,
    power_of_two: PowerOfTwo,
    direct: Option<Direct>,
}

impl Policies {
    fn new(worker: Option<WorkerId>) -> Self {
        Self {
            kv: KvPolicy,
            random: RandomPolicy,
            sglang: CacheAware::default(),
            llmd: Scorers::default(),
            power_of_two: PowerOfTwo,
            direct: worker.map(|worker| Direct { worker }),
        }
    }

    /// `mode`'s policy (`round_robin`: the cursor a round-robin call moves).
    fn of<'a>(
        &'a mut self,
        mode: RouteMode,
        round_robin: &'a mut RoundRobin,
    ) -> Result<&'a mut dyn Policy> {
        Ok(match (mode, self.direct.as_mut()) {
            (RouteMode::Kv | RouteMode::Custom, _) => &mut self.kv,
            (RouteMode::RoundRobin, _) => round_robin,
            (RouteMode::Random, _) => &mut self.random,
            (RouteMode::Sglang, _) => &mut self.sglang,
            (RouteMode::LlmD, _) => &mut self.llmd,
            (RouteMode::PowerOfTwo, _) => &mut self.power_of_two,
            (RouteMode::Direct, Some(d)) => d,
            (RouteMode::Direct, None) => {
                return Err(EngineError::InvalidArgument {
                    name: "worker",
                    reason: "direct mode needs a worker id",
                });
            }
        })
    }
}

/// What a pick reads of the scheduler.
struct Picking<'a> {
    config: &'a SchedulerConfig,
    workers: &'a WorkerTable,
    active: &'a ActiveRequests,
    fits: &'a [TtftFit],
    clocks: &'a [DrainClock],
    /// The cost the candidates are scored with.
    cost: crate::sched::config::RouterCost,
}

/// A policy's pick: the candidates it was offered (in key order) and which it chose.
struct Picked {
    worker: WorkerKey,
    /// `worker`'s index in `gathered.candidates`.
    chosen: usize,
    gathered: crate::sched::candidates::Gathered,
}

/// The part of a decision the real route and a shadow share: `policy`'s scope in `pool`,
/// its scored candidates, and its choice among them. Records nothing.
#[allow(clippy::too_many_arguments)]
fn pick(
    policy: &mut dyn Policy,
    at: &Picking<'_>,
    scratch: &mut CandidateScratch,
    eff: &crate::sched::config::Effective,
    request: &RouteRequest<'_>,
    pool: Pool,
    matches: &Matches,
    now: Instant,
    cached_blocks: &dyn Fn(WorkerKey) -> u64,
    rng: &mut SmallRng,
) -> Result<Picked> {
    let (config, workers, active) = (at.config, at.workers, at.active);
    let scope = match policy.scope() {
        Scope::All => match workers.pool(pool) {
            [] => {
                return Err(EngineError::NoWorkersInPool {
                    pool: pool.as_str(),
                });
            }
            keys => keys,
        },
        Scope::Worker(w) => match workers.ranks(w) {
            [] => return Err(EngineError::UnknownWorker { worker: w }),
            ranks => ranks,
        },
    };
    let mut gathered = scratch.gather(
        scope,
        &Context {
            workers,
            active,
            busy: &config.busy,
            max_active: config.max_active_per_key,
            matches,
            blocks: request.blocks,
            now,
            fits: at.fits,
            clocks: at.clocks,
            cost: CostInputs {
                block_size: config.block_size,
                cost: at.cost,
                overlap_weight: eff.overlap_weight,
                stall_weight: config.stall_weight,
                recompute_weight: config.recompute_weight,
                request_blocks: request.blocks.len() as u64,
                input_tokens: request.input_tokens,
            },
        },
    );
    charge_footprints(
        &mut gathered.candidates,
        config.footprint_weight,
        cached_blocks,
    );
    if gathered.candidates.is_empty()
        && gathered.full > 0
        && let Some(limit) = config.max_active_per_key
    {
        return Err(EngineError::AtCapacity { limit });
    }
    let load = |key: WorkerKey| match workers.slot(key) {
        Some(slot) => KeyLoad {
            active: active.load(slot),
            reported: workers.load(slot).copied(),
        },
        None => KeyLoad::default(),
    };
    let worker = policy.select(
        &SelectionInput {
            candidates: &gathered.candidates,
            temperature: eff.temperature,
            request_blocks: request.blocks.len() as u64,
            cached_blocks,
            load: &load,
        },
        rng,
    )?;
    // A policy naming a key it was not offered breaks its contract; refuse rather than
    // act on an arbitrary key.
    let chosen = gathered
        .candidates
        .binary_search_by_key(&worker, |c| c.key)
        .map_err(|_| EngineError::UnknownWorker {
            worker: worker.worker,
        })?;
    Ok(Picked {
        worker,
        chosen,
        gathered,
    })
}

/// Adds `weight` per block each candidate caches beyond the least-filled one to its logit
/// (`crate::sched::cost`, the footprint term). Nothing at weight 0 or with one candidate.
fn charge_footprints(
    candidates: &mut [CandidateScore],
    weight: f64,
    cached_blocks: &dyn Fn(WorkerKey) -> u64,
) {
    if weight == 0.0 || candidates.len() < 2 {
        return;
    }
    let Some(least) = candidates.iter().map(|c| cached_blocks(c.key)).min() else {
        return;
    };
    for c in candidates.iter_mut() {
        c.logit += weight * (cached_blocks(c.key) - least) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hs(v: &[u64]) -> Vec<SeqHash> {
        v.iter().copied().map(SeqHash).collect()
    }

    #[test]
    fn scratch_is_clean_after_every_kind_of_call() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 4,
            ..Default::default()
        })
        .unwrap();
        for w in 0..4 {
            s.add_worker(WorkerKey::new(w, 0)).unwrap();
        }
        let blocks = hs(&[1, 2, 3]);
        let m = Matches {
            overlaps: vec![(WorkerKey::new(2, 0), 2), (WorkerKey::new(99, 0), 3)],
            depth_counts: vec![2, 2, 1],
        };
        for (i, mode) in RouteMode::ALL.into_iter().enumerate() {
            let req = RouteRequest {
                id: RequestId(i as u64),
                blocks: &blocks,
                input_tokens: 12,
                overrides: RouteOverrides {
                    mode: Some(mode),
                    worker: (mode == RouteMode::Direct).then_some(WorkerId(1)),
                    ..Default::default()
                },
            };
            let d = s.route(t0, &req, &m, |_| 0).unwrap();
            assert_eq!(d.mode, mode);
            s.check_invariants();
        }
        assert_eq!(
            s.expire(t0 + Duration::from_secs(301)).len(),
            RouteMode::ALL.len()
        );
        s.check_invariants();
    }

    /// Chooses the key with the most requests waiting (as reported) and records what it saw.
    struct MostWaiting {
        seen: Vec<(WorkerKey, KeyLoad)>,
        answer: Option<WorkerKey>,
    }

    impl Policy for MostWaiting {
        fn mode(&self) -> RouteMode {
            RouteMode::Custom
        }

        fn select(&mut self, input: &SelectionInput<'_>, _: &mut SmallRng) -> Result<WorkerKey> {
            self.seen = input
                .candidates
                .iter()
                .map(|c| (c.key, (input.load)(c.key)))
                .collect();
            let best = self
                .seen
                .iter()
                .max_by_key(|(_, l)| l.reported.map_or(0, |r| r.num_requests_waiting))
                .map(|(k, _)| *k);
            Ok(self.answer.or(best).unwrap_or(WorkerKey::new(0, 0)))
        }
    }

    #[test]
    fn a_custom_policy_sees_each_candidates_load_and_its_choice_is_recorded() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 4,
            ..Default::default()
        })
        .unwrap();
        for w in 0..3 {
            s.add_worker(WorkerKey::new(w, 0)).unwrap();
        }
        let waiting = WorkerLoad {
            num_requests_waiting: 5,
            kv_usage: 0.5,
        };
        s.update_load(WorkerKey::new(2, 0), waiting).unwrap();
        let blocks = hs(&[1, 2]);
        let req = |id| RouteRequest {
            id: RequestId(id),
            blocks: &blocks,
            input_tokens: 8,
            overrides: RouteOverrides::default(),
        };
        let mut p = MostWaiting {
            seen: vec![],
            answer: None,
        };
        let d = s
            .route_with(t0, &req(0), &Matches::default(), &|_| 0, Some(&mut p))
            .unwrap();
        assert_eq!(
            (d.worker, d.mode),
            (WorkerKey::new(2, 0), RouteMode::Custom)
        );
        assert_eq!(p.seen.len(), 3);
        assert_eq!(p.seen[2].1.reported, Some(waiting));
        assert_eq!(p.seen[0].1, KeyLoad::default());
        // The request is active on the chosen key, and the next call sees it.
        let active = s.active_load(WorkerKey::new(2, 0)).unwrap();
        assert_eq!((active.active_requests, active.active_blocks), (1, 2));
        s.route_with(t0, &req(1), &Matches::default(), &|_| 0, Some(&mut p))
            .unwrap();
        assert_eq!(p.seen[2].1.active, active);

        // A key it was not offered is refused and changes nothing.
        p.answer = Some(WorkerKey::new(9, 0));
        let before = s.active_requests();
        assert_eq!(
            s.route_with(t0, &req(2), &Matches::default(), &|_| 0, Some(&mut p)),
            Err(EngineError::UnknownWorker {
                worker: WorkerId(9)
            })
        );
        assert_eq!(s.active_requests(), before);
        s.check_invariants();
    }
}
