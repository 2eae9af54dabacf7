//! Shadow decisions: what another policy would have chosen for a request, beside the
//! decision the scheduler really takes (`kvengine --shadow`).
//!
//! A shadow decision gathers and scores the candidates exactly as a routing call does
//! (same overlaps, same active load, same busy filtering), lets the shadow's policy choose,
//! and returns the choice with its overlap. It records nothing.
//!
//! # Invariants
//! 1. A shadow decision changes no active request, load, prefill clock or TTFT model, and
//!    neither the active policy's round-robin cursors nor its RNG: with or without shadow
//!    decisions in between, the scheduler's real decisions are the same (invariant 3 of
//!    the scheduler). The shadow keeps its own cursors and RNG ([`ShadowState`]).
//! 2. It may only reuse the scheduler's scratch buffers, which every call leaves zeroed.
//! 3. A refusal (no workers, a bad override, every key full) is an error and changes
//!    nothing, as for a routing call.

use super::*;
use crate::sched::config::RouterCost;
use std::fmt;
use std::str::FromStr;

/// The policy a shadow decision uses: a mode (`direct` with a worker: "beside a given
/// worker"), and for the cost-based modes optionally another cost than the configured one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowSpec {
    /// The mode ([`RouteMode::Custom`] is `kv`).
    pub mode: RouteMode,
    /// The cost, if not the configured one.
    pub cost: Option<RouterCost>,
    /// The worker of `direct` mode.
    pub worker: Option<WorkerId>,
}

impl ShadowSpec {
    /// `mode` with the configured cost.
    pub fn mode(mode: RouteMode) -> Self {
        Self {
            mode,
            cost: None,
            worker: None,
        }
    }

    /// The worker `worker` (its ranks chosen among by the configured cost).
    pub fn worker(worker: WorkerId) -> Self {
        Self {
            mode: RouteMode::Direct,
            cost: None,
            worker: Some(worker),
        }
    }
}

impl fmt::Display for ShadowSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.worker, self.cost) {
            (Some(w), _) => write!(f, "worker:{w}"),
            (None, Some(c)) => write!(f, "{}:{c}", self.mode),
            (None, None) => write!(f, "{}", self.mode),
        }
    }
}

impl FromStr for ShadowSpec {
    type Err = EngineError;

    /// `MODE` (a `--router-mode` name but `direct`), `MODE:COST` (a `--router-cost` name)
    /// or `worker:ID`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = EngineError::InvalidArgument {
            name: "shadow",
            reason: "expected MODE, MODE:COST (a --router-mode and a --router-cost) or worker:ID",
        };
        let (head, tail) = match s.split_once(':') {
            Some((h, t)) => (h, Some(t)),
            None => (s, None),
        };
        if head == "worker" {
            let id = tail.and_then(|t| t.parse::<u64>().ok()).ok_or(bad)?;
            return Ok(Self::worker(WorkerId(id)));
        }
        let mode: RouteMode = head.parse().map_err(|_| bad.clone())?;
        if mode == RouteMode::Direct {
            return Err(bad);
        }
        let cost = tail.map(|t| t.parse::<RouterCost>()).transpose()?;
        Ok(Self {
            mode,
            cost,
            worker: None,
        })
    }
}

/// What the shadow policy would have chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowDecision {
    /// The key it would have chosen.
    pub worker: WorkerKey,
    /// Blocks of the request that key caches, by the index.
    pub overlap_blocks: u32,
}

/// The shadow policy's own state (invariant 1).
#[derive(Debug)]
pub(super) struct ShadowState {
    round_robin: [RoundRobin; 3],
    rng: SmallRng,
}

impl ShadowState {
    /// A state whose RNG is seeded apart from the scheduler's (`seed`).
    pub(super) fn new(seed: u64) -> Self {
        Self {
            round_robin: Default::default(),
            rng: SmallRng::seed_from_u64(seed ^ 0x5348_4144_4f57),
        }
    }
}

impl Scheduler {
    /// What `spec`'s policy would choose for `request` now, beside the real decision
    /// (see the module docs; `request.overrides` give the pool, weight and temperature).
    /// Records nothing.
    pub fn shadow(
        &mut self,
        now: Instant,
        request: &RouteRequest<'_>,
        matches: &Matches,
        cached_blocks: &dyn Fn(WorkerKey) -> u64,
        spec: &ShadowSpec,
    ) -> Result<ShadowDecision> {
        let overrides = RouteOverrides {
            mode: Some(spec.mode),
            worker: spec.worker,
            ..request.overrides
        };
        let eff = resolve(&self.config, &overrides)?;
        if self.workers.len() == 0 {
            return Err(EngineError::NoWorkers);
        }
        let Self {
            config,
            workers,
            active,
            scratch,
            fits,
            clocks,
            shadow,
            ..
        } = self;
        let Some(round_robin) = shadow.round_robin.get_mut(overrides.pool.index()) else {
            return Err(EngineError::NoWorkers);
        };
        let mut policies = Policies::new(eff.worker);
        let policy = policies.of(eff.mode, round_robin)?;
        let picked = pick(
            policy,
            &Picking {
                config,
                workers,
                active,
                fits,
                clocks,
                cost: spec.cost.unwrap_or(config.cost),
            },
            scratch,
            &eff,
            request,
            overrides.pool,
            matches,
            now,
            cached_blocks,
            &mut shadow.rng,
        )?;
        let worker = picked.worker;
        let Some(chosen) = picked.gathered.candidates.get(picked.chosen) else {
            return Err(EngineError::UnknownWorker {
                worker: worker.worker,
            });
        };
        Ok(ShadowDecision {
            worker,
            overlap_blocks: chosen.overlap_blocks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DpRank;

    fn key(w: u64) -> WorkerKey {
        WorkerKey {
            worker: WorkerId(w),
            dp_rank: DpRank(0),
        }
    }

    fn request(id: u64, blocks: &[SeqHash]) -> RouteRequest<'_> {
        RouteRequest {
            id: RequestId(id),
            blocks,
            input_tokens: blocks.len() as u64 * 16,
            overrides: RouteOverrides::default(),
        }
    }

    fn scheduler(mode: RouteMode) -> Scheduler {
        let mut s = Scheduler::new(SchedulerConfig {
            mode,
            ..SchedulerConfig::default()
        })
        .unwrap();
        for w in 1..=3 {
            s.add_worker(key(w)).unwrap();
        }
        s
    }

    #[test]
    fn specs_parse_and_print() {
        for text in [
            "kv",
            "round-robin",
            "kv:ttft",
            "sglang",
            "worker:7",
            "llm-d:dynamo",
        ] {
            let spec: ShadowSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        for bad in ["", "direct", "kv:fast", "worker:", "worker:x", "nope"] {
            assert!(bad.parse::<ShadowSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_shadow_sees_the_caches_and_moves_nothing() {
        let blocks = [SeqHash(1), SeqHash(2), SeqHash(3)];
        let matches = Matches {
            overlaps: vec![(key(2), 3)],
            depth_counts: vec![1, 1, 1],
        };
        let none = |_| 0;
        let kv = ShadowSpec::mode(RouteMode::Kv);
        let t = Instant::now();
        // Two schedulers routing the same calls; one also takes shadow decisions, with
        // every policy, in between. The cursor and the RNG modes must not notice.
        for active in [
            RouteMode::RoundRobin,
            RouteMode::Random,
            RouteMode::PowerOfTwo,
        ] {
            let mut plain = scheduler(active);
            let mut shadowed = scheduler(active);
            for id in 0..12 {
                let r = request(id, &blocks);
                let s = shadowed.shadow(t, &r, &matches, &none, &kv).unwrap();
                assert_eq!((s.worker, s.overlap_blocks), (key(2), 3));
                for mode in [RouteMode::RoundRobin, RouteMode::Random, RouteMode::LlmD] {
                    let spec = ShadowSpec::mode(mode);
                    shadowed.shadow(t, &r, &matches, &none, &spec).unwrap();
                }
                let a = plain.route(t, &r, &matches, none).unwrap();
                let b = shadowed.route(t, &r, &matches, none).unwrap();
                assert_eq!(a, b, "{active}: call {id}");
            }
            assert_eq!(plain.active_requests(), shadowed.active_requests());
        }
        let mut shadowed = scheduler(RouteMode::Kv);
        for id in 0..6 {
            shadowed
                .route(t, &request(id, &blocks), &matches, none)
                .unwrap();
        }
        // Beside a given worker, and refusals.
        let w3 = ShadowSpec::worker(WorkerId(3));
        let s = shadowed
            .shadow(t, &request(9, &blocks), &matches, &none, &w3)
            .unwrap();
        assert_eq!((s.worker, s.overlap_blocks), (key(3), 0));
        let w9 = ShadowSpec::worker(WorkerId(9));
        assert!(
            shadowed
                .shadow(t, &request(9, &blocks), &matches, &none, &w9)
                .is_err()
        );
        assert_eq!(shadowed.active_requests(), 6);
    }
}
