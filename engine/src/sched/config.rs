//! Scheduler configuration, per-call overrides and the load workers report.
//!
//! Everything here is plain data plus validation, so a rejected call is rejected before the
//! scheduler touches any state.
//!
//! # Invariants
//! 1. A [`SchedulerConfig`] accepted by [`SchedulerConfig::validate`] has `block_size > 0`, a
//!    finite non-negative `overlap_weight` and `temperature`, a `max_kv_usage` (if any)
//!    in `0..=1`, and a busy `max_active` (if any) above 0.
//! 2. `Effective` values built by `resolve` satisfy the same ranges, and name a worker iff
//!    the mode is [`RouteMode::Direct`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{EngineError, Result};
use crate::hash::DEFAULT_BLOCK_SIZE;
use crate::ids::WorkerId;
use crate::sched::role::Pool;

/// How a worker is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RouteMode {
    /// Minimise the KV cost (DESIGN.md "Choosing a worker").
    #[default]
    Kv,
    /// Cycle over the registered worker keys in key order.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// The caller names the worker; the KV cost picks among its data-parallel ranks.
    Direct,
    /// SGLang router's cache-aware policy: the least-loaded key when load is imbalanced,
    /// else the best prefix match if it covers enough of the prompt, else the key caching
    /// least ([`crate::sched::sglang`]).
    Sglang,
    /// llm-d's scheduler: a weighted sum of a prefix-cache scorer and a queue scorer
    /// ([`crate::sched::llmd`]).
    LlmD,
    /// Power of two choices: two keys at random, the one with the lower predicted TTFT
    /// ([`crate::sched::power_of_two`]).
    PowerOfTwo,
    /// A policy the embedding program passes to [`crate::sched::Scheduler::route_with`]
    /// chose (the Python package's `KvRouter(policy=...)`). Not selectable by name: it is
    /// not in [`RouteMode::ALL`] and does not parse.
    Custom,
}

impl RouteMode {
    /// Every mode selectable by name, in documentation order.
    pub const ALL: [RouteMode; 7] = [
        RouteMode::Kv,
        RouteMode::RoundRobin,
        RouteMode::Random,
        RouteMode::Direct,
        RouteMode::Sglang,
        RouteMode::LlmD,
        RouteMode::PowerOfTwo,
    ];

    /// The CLI / metric label: `kv`, `round-robin`, `random`, `direct`, `sglang`, `llm-d`
    /// or `power-of-two`.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteMode::Kv => "kv",
            RouteMode::RoundRobin => "round-robin",
            RouteMode::Random => "random",
            RouteMode::Direct => "direct",
            RouteMode::Sglang => "sglang",
            RouteMode::LlmD => "llm-d",
            RouteMode::PowerOfTwo => "power-of-two",
            RouteMode::Custom => "custom",
        }
    }
}

impl fmt::Display for RouteMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RouteMode {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        RouteMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or(EngineError::InvalidArgument {
                name: "mode",
                reason: "expected kv, round-robin, random, direct, sglang, llm-d or power-of-two",
            })
    }
}

/// What `kv` mode minimises (`--router-cost`).
///
/// Dynamo's formula stays the default: the TTFT cost wins median TTFT and hit rate on every
/// measured workload but loses the 99th percentile on some (docs/benchmarks.md, "Issue
/// 16"), and the default changes only for a cost that wins both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RouterCost {
    /// The request's predicted time to first token on the key, plus the prefill stall it
    /// causes the key's running requests ([`crate::sched::ttft`], [`crate::sched::cost`]).
    Ttft,
    /// Dynamo's formula: `overlap_weight * prefill_blocks + decode_blocks`.
    #[default]
    Dynamo,
}

impl RouterCost {
    /// Both costs, the default first.
    pub const ALL: [RouterCost; 2] = [RouterCost::Dynamo, RouterCost::Ttft];

    /// The CLI label: `ttft` or `dynamo`.
    pub fn as_str(self) -> &'static str {
        match self {
            RouterCost::Ttft => "ttft",
            RouterCost::Dynamo => "dynamo",
        }
    }
}

impl fmt::Display for RouterCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RouterCost {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        RouterCost::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or(EngineError::InvalidArgument {
                name: "router_cost",
                reason: "expected ttft or dynamo",
            })
    }
}

/// Load a worker key reports about itself (from its metrics endpoint or events).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerLoad {
    /// Requests queued on the engine and not yet scheduled.
    pub num_requests_waiting: u64,
    /// Fraction of the engine's KV blocks in use, `0.0..=1.0`.
    pub kv_usage: f64,
}

impl WorkerLoad {
    /// Rejects a `kv_usage` that is NaN or outside `0..=1`.
    pub fn validate(&self) -> Result<()> {
        if (0.0..=1.0).contains(&self.kv_usage) {
            Ok(())
        } else {
            Err(EngineError::InvalidArgument {
                name: "kv_usage",
                reason: "must be within 0..=1",
            })
        }
    }
}

/// When a worker key counts as busy. A busy key is skipped unless every candidate is busy
/// (and with an admission queue, a request finding every candidate busy waits: see
/// [`crate::router::admission`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyThresholds {
    /// Busy when more than this many requests are waiting (as the key last reported).
    pub max_waiting: Option<u64>,
    /// Busy when the KV usage is above this fraction (`0..=1`, as last reported).
    pub max_kv_usage: Option<f64>,
    /// Busy when the router counts at least this many active (routed, unfreed) requests
    /// on the key, peer replicas' included. Unlike the reported figures this one changes
    /// the moment a request finishes, so a queued request can be admitted then.
    pub max_active: Option<u64>,
}

impl BusyThresholds {
    /// Whether any threshold is set (if none is, nothing is ever busy).
    pub fn any(&self) -> bool {
        self.max_waiting.is_some() || self.max_kv_usage.is_some() || self.max_active.is_some()
    }

    /// Whether a key that last reported `load` (`None`: never) and carries
    /// `active_requests` routed requests is over a threshold. The reported thresholds never
    /// make a key that never reported busy.
    pub fn is_busy(&self, load: Option<&WorkerLoad>, active_requests: u64) -> bool {
        if self.max_active.is_some_and(|max| active_requests >= max) {
            return true;
        }
        let Some(load) = load else { return false };
        self.max_waiting
            .is_some_and(|max| load.num_requests_waiting > max)
            || self.max_kv_usage.is_some_and(|max| load.kv_usage > max)
    }
}

/// Everything a [`crate::sched::Scheduler`] is configured with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per block; must equal the index's and the engines' block size.
    pub block_size: u32,
    /// The mode used when a call does not override it.
    pub mode: RouteMode,
    /// Weight of prefill blocks against decode blocks in the logit (default 1.0).
    pub overlap_weight: f64,
    /// The same weight when choosing a decode worker of a disaggregated request (default
    /// 0.1): there the "prefill blocks" are blocks to transfer from the prefill worker, far
    /// cheaper than computing them, so load decides and overlap breaks near-ties.
    pub decode_overlap_weight: f64,
    /// Softmax temperature; 0 picks the minimum logit (default 0.0).
    pub temperature: f64,
    /// When a worker key is skipped as busy.
    pub busy: BusyThresholds,
    /// An active request not freed after this long is freed by `expire`.
    pub request_timeout: Duration,
    /// Seed of the scheduler's RNG (tie-breaking, sampling, random mode).
    pub seed: u64,
    /// What `kv` and `direct` mode minimise (default: Dynamo's formula).
    pub cost: RouterCost,
    /// With [`RouterCost::Ttft`]: what a millisecond of prefill stall imposed on each of a
    /// key's running requests costs, against a millisecond of this request's TTFT (default
    /// [`DEFAULT_STALL_WEIGHT`]).
    pub stall_weight: f64,
    /// What prefill that recomputes a prefix another candidate caches costs, on top of the
    /// request's own cost (see [`crate::sched::cost`]): the cluster's compute spent twice,
    /// which slows every later request. 0: the request's own cost alone decides.
    pub recompute_weight: f64,
    /// What each block a key caches beyond the least-filled candidate costs, in the unit of
    /// the cost's prefill term (see [`crate::sched::cost`]): a fuller cache evicts sooner,
    /// so new prefixes go where they live longest. 0: footprints only break exact ties.
    pub footprint_weight: f64,
    /// The most active requests one worker key may carry; a key at the limit is no
    /// candidate, and a call finding every key there fails with `AtCapacity`. `None`: no
    /// limit. The default keeps a runaway client (or requests never freed) from piling
    /// work on a worker without bound.
    pub max_active_per_key: Option<u64>,
    /// Predict-on-route: each decision is also taken as a prediction that the chosen key
    /// will hold the request's blocks, for this long after the decision (refreshed by each
    /// later decision for the same blocks), so that requests sharing a prefix that arrive
    /// before the worker's KV events find it. A key's overlap is the larger of its indexed
    /// and predicted ones (see [`crate::router`]). `None`: overlaps come from the index
    /// alone. Ignored in approximate mode, where every overlap is a prediction.
    pub predict_on_route: Option<Duration>,
}

/// The default [`SchedulerConfig::stall_weight`]: a running request's stalled token counts
/// 3% of a waiting request's first token. Users wait for the first token; a stall in a
/// stream already flowing is felt less, but it is not free. Chosen from two A/B replays
/// each (docs/benchmarks.md, "Issue 16"): at 0.1 a long prompt's stall term, its own
/// prefill time times every request running on a worker, outweighed its own wait and sent
/// it behind longer queues (Mooncake TTFT p99 7.8-8.4 s against 6.4-6.6 s at 0.03); at 0
/// cached prefixes lost their pull on chat (TTFT p50 89 ms against 84-86 ms).
pub const DEFAULT_STALL_WEIGHT: f64 = 0.03;

/// The default [`SchedulerConfig::recompute_weight`]: with Dynamo's formula, recomputing a
/// block another worker caches costs 32 blocks of queued prefill. Chosen side by side with
/// the real peers (docs/benchmarks.md, "Issue 31"): at 8 about 0.2% of the prompt tokens
/// were still lost to moves off a cache; at 32 none were, and the Mooncake trace's TTFT
/// p99 was no worse, because the queue term still moves a request when a queue is long.
pub const DEFAULT_RECOMPUTE_WEIGHT: f64 = 32.0;

/// The default [`SchedulerConfig::footprint_weight`]: a worker caching 20,000 blocks more
/// than the emptiest candidate charges a request 1,000 blocks of prefill, about one
/// Mooncake prompt. It only matters while caches fill (once every worker is full their
/// footprints are equal) and for prefixes nobody caches (the recompute term outweighs it
/// elsewhere). Chosen side by side with sglang-router on the Mooncake trace at 131,072
/// blocks per worker, where one LRU of the cluster's size bounds the hit rate at 16.91%:
/// the medians were equal with and without it (16.88%), but without it one run in ten lost
/// a long prefix (16.46%), with it none in fifteen did (lowest 16.86%); 0.2 cost E2E p50
/// (docs/benchmarks.md, "Issue 31", eighth session).
pub const DEFAULT_FOOTPRINT_WEIGHT: f64 = 0.05;

/// The default [`SchedulerConfig::predict_on_route`]: long enough to bridge the time from a
/// decision to the worker's KV events for it (its prefill), short enough that a prediction
/// the events did not confirm lapses quickly. With the recompute term, 300 ms brought the
/// chat workload's hit rate to the infinite-cache bound (docs/benchmarks.md, "Issue 31").
pub const DEFAULT_PREDICT_ON_ROUTE: Duration = Duration::from_millis(300);

/// The default [`SchedulerConfig::max_active_per_key`].
pub const DEFAULT_MAX_ACTIVE_PER_KEY: u64 = 4096;

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE as u32,
            mode: RouteMode::Kv,
            overlap_weight: 1.0,
            decode_overlap_weight: 0.1,
            temperature: 0.0,
            busy: BusyThresholds::default(),
            request_timeout: Duration::from_secs(300),
            seed: 0,
            cost: RouterCost::default(),
            stall_weight: DEFAULT_STALL_WEIGHT,
            recompute_weight: DEFAULT_RECOMPUTE_WEIGHT,
            footprint_weight: DEFAULT_FOOTPRINT_WEIGHT,
            max_active_per_key: Some(DEFAULT_MAX_ACTIVE_PER_KEY),
            predict_on_route: Some(DEFAULT_PREDICT_ON_ROUTE),
        }
    }
}

impl SchedulerConfig {
    /// Checks every range in invariant 1.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(EngineError::InvalidArgument {
                name: "block_size",
                reason: "must be positive",
            });
        }
        check_weight(self.overlap_weight)?;
        check_weight(self.decode_overlap_weight)?;
        if !(self.stall_weight.is_finite() && self.stall_weight >= 0.0) {
            return Err(EngineError::InvalidArgument {
                name: "stall_weight",
                reason: "must be finite and non-negative",
            });
        }
        if !(self.recompute_weight.is_finite() && self.recompute_weight >= 0.0) {
            return Err(EngineError::InvalidArgument {
                name: "recompute_weight",
                reason: "must be finite and non-negative",
            });
        }
        if !(self.footprint_weight.is_finite() && self.footprint_weight >= 0.0) {
            return Err(EngineError::InvalidArgument {
                name: "footprint_weight",
                reason: "must be finite and non-negative",
            });
        }
        check_temperature(self.temperature)?;
        if self.busy.max_active == Some(0) {
            return Err(EngineError::InvalidArgument {
                name: "busy_max_active",
                reason: "must be positive (at 0 every worker is always busy)",
            });
        }
        if self.predict_on_route.is_some_and(|ttl| ttl.is_zero()) {
            return Err(EngineError::InvalidArgument {
                name: "predict_on_route",
                reason: "must be positive (None turns it off)",
            });
        }
        if let Some(max) = self.busy.max_kv_usage
            && !(0.0..=1.0).contains(&max)
        {
            return Err(EngineError::InvalidArgument {
                name: "max_kv_usage",
                reason: "must be within 0..=1",
            });
        }
        Ok(())
    }
}

/// Per-call overrides of the configuration; `None` keeps the configured value.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouteOverrides {
    /// Routing mode for this call. Naming a `worker` without a mode implies `Direct`.
    pub mode: Option<RouteMode>,
    /// The worker for `Direct` mode.
    pub worker: Option<WorkerId>,
    /// Overlap weight for this call.
    pub overlap_weight: Option<f64>,
    /// Temperature for this call.
    pub temperature: Option<f64>,
    /// The workers this call chooses among (default: those serving whole requests).
    pub pool: Pool,
}

/// The settings one routing call runs with, after overrides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Effective {
    pub mode: RouteMode,
    pub worker: Option<WorkerId>,
    pub overlap_weight: f64,
    pub temperature: f64,
}

/// Applies `overrides` to `config`, rejecting values outside invariant 2.
pub(crate) fn resolve(config: &SchedulerConfig, overrides: &RouteOverrides) -> Result<Effective> {
    let configured = match overrides.pool {
        Pool::Decode => config.decode_overlap_weight,
        Pool::Whole | Pool::Prefill => config.overlap_weight,
    };
    let overlap_weight = overrides.overlap_weight.unwrap_or(configured);
    check_weight(overlap_weight)?;
    let temperature = overrides.temperature.unwrap_or(config.temperature);
    check_temperature(temperature)?;
    let mode = match (overrides.mode, overrides.worker) {
        (Some(mode), _) => mode,
        // Naming a worker is a request to route there; anything else would ignore it.
        (None, Some(_)) => RouteMode::Direct,
        (None, None) => config.mode,
    };
    match (mode, overrides.worker) {
        (RouteMode::Direct, None) => Err(EngineError::InvalidArgument {
            name: "worker",
            reason: "direct mode needs a worker id",
        }),
        (
            RouteMode::Kv
            | RouteMode::RoundRobin
            | RouteMode::Random
            | RouteMode::Sglang
            | RouteMode::LlmD
            | RouteMode::PowerOfTwo
            | RouteMode::Custom,
            Some(_),
        ) => Err(EngineError::InvalidArgument {
            name: "worker",
            reason: "only direct mode takes a worker id",
        }),
        (mode, worker) => Ok(Effective {
            mode,
            worker,
            overlap_weight,
            temperature,
        }),
    }
}

fn check_weight(w: f64) -> Result<()> {
    // `is_finite` also rejects NaN; an infinite weight would turn a zero prefill into NaN.
    if w.is_finite() && w >= 0.0 {
        Ok(())
    } else {
        Err(EngineError::InvalidArgument {
            name: "overlap_weight",
            reason: "must be finite and non-negative",
        })
    }
}

fn check_temperature(t: f64) -> Result<()> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(EngineError::InvalidArgument {
            name: "temperature",
            reason: "must be finite and non-negative",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_labels_round_trip() {
        for m in RouteMode::ALL {
            assert_eq!(m.as_str().parse::<RouteMode>().unwrap(), m);
        }
        assert!("least-loaded".parse::<RouteMode>().is_err());
    }

    #[test]
    fn router_cost_labels_round_trip() {
        for c in RouterCost::ALL {
            assert_eq!(c.as_str().parse::<RouterCost>().unwrap(), c);
        }
        assert!("ttft2".parse::<RouterCost>().is_err());
    }

    #[test]
    fn worker_implies_direct_and_direct_needs_worker() {
        let cfg = SchedulerConfig::default();
        let o = RouteOverrides {
            worker: Some(WorkerId(3)),
            ..Default::default()
        };
        assert_eq!(resolve(&cfg, &o).unwrap().mode, RouteMode::Direct);
        let o = RouteOverrides {
            mode: Some(RouteMode::Direct),
            ..Default::default()
        };
        assert!(resolve(&cfg, &o).is_err());
        let o = RouteOverrides {
            mode: Some(RouteMode::Random),
            worker: Some(WorkerId(3)),
            ..Default::default()
        };
        assert!(resolve(&cfg, &o).is_err());
    }

    #[test]
    fn config_ranges() {
        assert!(SchedulerConfig::default().validate().is_ok());
        let bad = [
            SchedulerConfig {
                block_size: 0,
                ..Default::default()
            },
            SchedulerConfig {
                overlap_weight: f64::INFINITY,
                ..Default::default()
            },
            SchedulerConfig {
                temperature: -0.5,
                ..Default::default()
            },
            SchedulerConfig {
                busy: BusyThresholds {
                    max_kv_usage: Some(1.5),
                    ..Default::default()
                },
                ..Default::default()
            },
            SchedulerConfig {
                busy: BusyThresholds {
                    max_active: Some(0),
                    ..Default::default()
                },
                ..Default::default()
            },
        ];
        for cfg in bad {
            assert!(cfg.validate().is_err(), "{cfg:?}");
        }
    }

    #[test]
    fn busy_is_strictly_over_threshold() {
        let t = BusyThresholds {
            max_waiting: Some(2),
            max_kv_usage: Some(0.9),
            max_active: None,
        };
        let load = |w, u| WorkerLoad {
            num_requests_waiting: w,
            kv_usage: u,
        };
        assert!(!t.is_busy(None, 1_000));
        assert!(!t.is_busy(Some(&load(2, 0.9)), 0));
        assert!(t.is_busy(Some(&load(3, 0.0)), 0));
        assert!(t.is_busy(Some(&load(0, 0.95)), 0));
        assert!(!BusyThresholds::default().is_busy(Some(&load(u64::MAX, 1.0)), u64::MAX));
    }

    #[test]
    fn busy_at_the_active_threshold_reported_or_not() {
        let t = BusyThresholds {
            max_active: Some(2),
            ..Default::default()
        };
        assert!(t.any());
        assert!(!t.is_busy(None, 1));
        assert!(t.is_busy(None, 2));
        assert!(t.is_busy(None, 3));
    }
}
