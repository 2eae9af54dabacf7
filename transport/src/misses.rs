//! Counters of miss attribution and shadow decisions, per model: what `/metrics` reports
//! as `kvengine_cache_*` and `kvengine_shadow_*` (docs/api.md, "Why requests missed the
//! cache"). The attribution itself is the engine's ([`engine::router::misses`]); the
//! front door feeds it ([`crate::openai`]'s relay), and the hub feeds the shadow decisions.
//!
//! # Invariants
//! 1. Models are the router's namespaces (configured or registered, never a client's
//!    string), workers the registered ones: label cardinality is bounded by the
//!    configuration.
//! 2. Every request with a miss probe is counted exactly once: under an outcome (`hit` or a
//!    cause) or under an unattributed reason.
//!
//! # Concurrency
//! One mutex, held for one update or one scrape's copy; never across anything else.

use engine::router::misses::{Attribution, MissCause, Outcome, Predicted};
use engine::sched::ShadowSpec;
use engine::{WorkerId, WorkerKey};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The request header naming the worker another router chose
/// ([`Shadow::Header`]).
pub const SHADOW_WORKER_HEADER: &str = "x-kvengine-shadow-worker";

/// What the shadow decisions follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shadow {
    /// A policy (or a fixed worker), for every request.
    Policy(ShadowSpec),
    /// The worker each request's [`SHADOW_WORKER_HEADER`] names.
    Header,
}

impl FromStr for Shadow {
    type Err = engine::EngineError;

    /// `header`, or a [`ShadowSpec`] (`MODE`, `MODE:COST`, `worker:ID`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "header" => Ok(Self::Header),
            spec => spec.parse().map(Self::Policy),
        }
    }
}

impl fmt::Display for Shadow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Policy(spec) => spec.fmt(f),
            Self::Header => f.write_str("header"),
        }
    }
}

/// Upper bounds of the per-request hit-ratio histogram (cached / prompt tokens).
pub const HIT_RATIO_BUCKETS: [f64; 8] = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0];

/// Why a request could not be attributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unattributed {
    /// The answer ended without a usage object (a stream without
    /// `stream_options.include_usage`).
    NoUsage,
    /// The usage had no `prompt_tokens_details.cached_tokens` (vLLM without
    /// `--enable-prompt-tokens-details`, SGLang without `--enable-cache-report`).
    NoCachedTokens,
    /// The usage was malformed (not a count, or more cached tokens than the prompt has).
    BadUsage,
    /// The answer failed or was cut short (an error status, the worker failed mid-answer,
    /// the client went away).
    Failed,
}

impl Unattributed {
    /// Every reason, in label order.
    pub const ALL: [Unattributed; 4] = [
        Self::NoUsage,
        Self::NoCachedTokens,
        Self::BadUsage,
        Self::Failed,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoUsage => "no_usage",
            Self::NoCachedTokens => "no_cached_tokens",
            Self::BadUsage => "bad_usage",
            Self::Failed => "failed",
        }
    }
}

/// One model's figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelMisses {
    /// Cacheable prompt tokens the workers reported cached.
    pub hit_tokens: u64,
    /// Cacheable prompt tokens missed, per [`MissCause::ALL`].
    pub miss_tokens: [u64; 3],
    /// Attributed requests by outcome: `hit`, then [`MissCause::ALL`].
    pub requests: [u64; 4],
    /// Unattributed requests per [`Unattributed::ALL`].
    pub unattributed: [u64; 4],
    /// Hit ratio per request: per bucket of [`HIT_RATIO_BUCKETS`] (not cumulative), then
    /// the overflow (none: ratios are at most 1).
    pub hit_ratio: [u64; HIT_RATIO_BUCKETS.len() + 1],
    /// Sum of the hit ratios.
    pub hit_ratio_sum: f64,
    /// Shadowed requests: the shadow chose the same worker key, or another.
    pub shadow_agreed: [u64; 2],
    /// Predicted overlap tokens (capped at the cacheable ones) at route time: the active
    /// decision's, the shadow's.
    pub shadow_overlap_tokens: [u64; 2],
    /// Over shadowed requests whose answers were attributed: the tokens the active route
    /// really found cached, and the tokens the shadow's choice was predicted to hold.
    pub shadow_realised_tokens: [u64; 2],
}

/// How many attributed requests [`MissCounters::recent`] keeps.
pub const RECENT: usize = 256;

/// One attributed request, as the front door hands it over.
#[derive(Clone, Copy, Debug)]
pub struct Attributed<'a> {
    /// Its namespace.
    pub model: &'a str,
    /// The worker rank it was routed to.
    pub worker: WorkerKey,
    /// What the router predicted.
    pub predicted: Predicted,
    /// The split ([`engine::router::misses::attribute`]).
    pub attribution: Attribution,
    /// What the worker reported cached.
    pub cached_tokens: u64,
    /// The shadow's predicted overlap tokens, if the request was shadowed.
    pub shadow_tokens: Option<u64>,
}

/// One of the last attributed requests (`GET /v1/misses`): no request id and no prompt.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RecentMiss {
    /// Its namespace.
    pub model: String,
    /// The worker it was routed to.
    pub worker_id: u64,
    /// The worker's rank.
    pub dp_rank: u32,
    /// The model's block size.
    pub block_size: u32,
    /// Prompt tokens, as the router tokenized them.
    pub prompt_tokens: u64,
    /// What the worker reported cached.
    pub cached_tokens: u64,
    /// The chosen worker's overlap, by the index.
    pub predicted_blocks: u32,
    /// The best overlap of any candidate, by the index.
    pub best_blocks: u32,
    /// The split of the cacheable blocks.
    pub cacheable_blocks: u64,
    /// Hit blocks.
    pub hit_blocks: u64,
    /// Stale blocks.
    pub stale_blocks: u64,
    /// Routing blocks.
    pub routing_blocks: u64,
    /// Cold blocks.
    pub cold_blocks: u64,
    /// `hit` or the main cause.
    pub outcome: &'static str,
    /// The shadow's predicted overlap tokens, if shadowed.
    pub shadow_tokens: Option<u64>,
}

/// A copy of the counters ([`MissCounters::snapshot`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MissSnapshot {
    /// Every model's figures, by name.
    pub models: Vec<(String, ModelMisses)>,
    /// Stale miss tokens per chosen worker.
    pub stale_by_worker: Vec<(WorkerId, u64)>,
    /// Shadow decisions that could not be taken.
    pub shadow_failures: u64,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct MissCounters {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    models: BTreeMap<String, ModelMisses>,
    /// Stale tokens per worker (a worker whose events lag, or that evicts unannounced).
    stale_by_worker: BTreeMap<WorkerId, u64>,
    /// Shadow decisions that could not be taken (the shadow's worker unknown, ...).
    shadow_failures: u64,
    /// The last [`RECENT`] attributed requests, oldest first.
    recent: VecDeque<RecentMiss>,
}

impl MissCounters {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one attributed request, and keeps it among the [`RECENT`] last.
    pub fn attributed(&self, r: &Attributed<'_>) {
        let a = &r.attribution;
        let (cached_tokens, prompt_tokens) = (r.cached_tokens, r.predicted.prompt_tokens);
        let mut inner = self.lock();
        let m = model_entry(&mut inner.models, r.model);
        m.hit_tokens = m.hit_tokens.saturating_add(a.hit_tokens());
        for (i, cause) in MissCause::ALL.into_iter().enumerate() {
            if let Some(t) = m.miss_tokens.get_mut(i) {
                *t = t.saturating_add(a.tokens(cause));
            }
        }
        let slot = match a.outcome() {
            Outcome::Hit => 0,
            Outcome::Miss(c) => 1 + MissCause::ALL.iter().position(|&x| x == c).unwrap_or(2),
        };
        if let Some(n) = m.requests.get_mut(slot) {
            *n += 1;
        }
        let ratio = match prompt_tokens {
            0 => 1.0,
            p => (cached_tokens as f64 / p as f64).clamp(0.0, 1.0),
        };
        let bucket = HIT_RATIO_BUCKETS.partition_point(|&b| b < ratio);
        if let Some(n) = m.hit_ratio.get_mut(bucket) {
            *n += 1;
        }
        m.hit_ratio_sum += ratio;
        if let Some(predicted) = r.shadow_tokens {
            let [active, other] = &mut m.shadow_realised_tokens;
            *active = active.saturating_add(cached_tokens);
            *other = other.saturating_add(predicted);
        }
        if inner.recent.len() >= RECENT {
            inner.recent.pop_front();
        }
        inner.recent.push_back(RecentMiss {
            model: r.model.to_owned(),
            worker_id: r.worker.worker.0,
            dp_rank: r.worker.dp_rank.0,
            block_size: r.predicted.block_size,
            prompt_tokens,
            cached_tokens,
            predicted_blocks: r.predicted.chosen_blocks,
            best_blocks: r.predicted.best_blocks,
            cacheable_blocks: a.cacheable_blocks,
            hit_blocks: a.hit_blocks,
            stale_blocks: a.stale_blocks,
            routing_blocks: a.routing_blocks,
            cold_blocks: a.cold_blocks,
            outcome: a.outcome().as_str(),
            shadow_tokens: r.shadow_tokens,
        });
        let worker = r.worker.worker;
        let stale = a.tokens(MissCause::Stale);
        if stale > 0 {
            let w = inner.stale_by_worker.entry(worker).or_insert(0);
            *w = w.saturating_add(stale);
        }
    }

    /// Counts one request of `model` that could not be attributed.
    pub fn unattributed(&self, model: &str, why: Unattributed) {
        let mut inner = self.lock();
        let m = model_entry(&mut inner.models, model);
        if let Some(n) = m.unattributed.get_mut(why as usize) {
            *n += 1;
        }
    }

    /// Counts one shadowed decision of `model`: whether the shadow agreed, and both
    /// predicted overlaps in tokens.
    pub fn shadowed(&self, model: &str, agreed: bool, active_tokens: u64, shadow_tokens: u64) {
        let mut inner = self.lock();
        let m = model_entry(&mut inner.models, model);
        if let Some(n) = m.shadow_agreed.get_mut(usize::from(!agreed)) {
            *n += 1;
        }
        let [a, s] = &mut m.shadow_overlap_tokens;
        *a = a.saturating_add(active_tokens);
        *s = s.saturating_add(shadow_tokens);
    }

    /// Counts a shadow decision that could not be taken.
    pub fn shadow_failed(&self) {
        self.lock().shadow_failures += 1;
    }

    /// The last [`RECENT`] attributed requests, newest first.
    pub fn recent(&self) -> Vec<RecentMiss> {
        self.lock().recent.iter().rev().cloned().collect()
    }

    /// A copy of every figure.
    pub fn snapshot(&self) -> MissSnapshot {
        let inner = self.lock();
        MissSnapshot {
            models: inner
                .models
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            stale_by_worker: inner
                .stale_by_worker
                .iter()
                .map(|(&w, &n)| (w, n))
                .collect(),
            shadow_failures: inner.shadow_failures,
        }
    }
}

fn model_entry<'a>(
    models: &'a mut BTreeMap<String, ModelMisses>,
    model: &str,
) -> &'a mut ModelMisses {
    models.entry(model.to_owned()).or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::router::misses::{Predicted, attribute};

    #[test]
    fn shadows_parse() {
        assert_eq!("header".parse::<Shadow>().unwrap(), Shadow::Header);
        for text in ["kv", "kv:ttft", "worker:3", "round-robin"] {
            let s: Shadow = text.parse().unwrap();
            assert_eq!(s.to_string(), text);
            assert!(matches!(s, Shadow::Policy(_)));
        }
        assert!("headers".parse::<Shadow>().is_err());
    }

    #[test]
    fn counts_add_up_per_model_and_worker() {
        let c = MissCounters::default();
        let p = Predicted {
            block_size: 16,
            prompt_tokens: 100,
            chosen_blocks: 5,
            best_blocks: 6,
        };
        let a = attribute(&p, 16).unwrap();
        c.attributed(&Attributed {
            model: "m",
            worker: WorkerKey {
                worker: WorkerId(2),
                dp_rank: engine::DpRank(0),
            },
            predicted: p,
            attribution: a,
            cached_tokens: 16,
            shadow_tokens: Some(96),
        });
        c.unattributed("m", Unattributed::NoUsage);
        c.shadowed("m", false, 80, 96);
        let MissSnapshot {
            models,
            stale_by_worker: stale,
            shadow_failures: failures,
        } = c.snapshot();
        let (name, m) = &models[0];
        assert_eq!(name, "m");
        assert_eq!(m.hit_tokens, 16);
        // 4 stale blocks (5 predicted, 1 had), 1 routing (6 elsewhere), 0 cold.
        assert_eq!(m.miss_tokens, [16, 64, 0]);
        assert_eq!(m.requests, [0, 0, 1, 0]);
        assert_eq!(m.unattributed, [1, 0, 0, 0]);
        assert_eq!(m.hit_ratio.iter().sum::<u64>(), 1);
        assert_eq!(m.hit_ratio[2], 1, "0.16 is in the 0.25 bucket");
        assert_eq!(m.shadow_agreed, [0, 1]);
        assert_eq!(m.shadow_overlap_tokens, [80, 96]);
        assert_eq!(m.shadow_realised_tokens, [16, 96]);
        assert_eq!(stale, [(WorkerId(2), 64)]);
        assert_eq!(failures, 0);
        let recent = c.recent();
        assert_eq!(recent.len(), 1);
        assert_eq!((recent[0].outcome, recent[0].stale_blocks), ("stale", 4));
        for _ in 0..RECENT + 5 {
            c.attributed(&Attributed {
                model: "m",
                worker: WorkerKey {
                    worker: WorkerId(3),
                    dp_rank: engine::DpRank(0),
                },
                predicted: p,
                attribution: a,
                cached_tokens: 16,
                shadow_tokens: None,
            });
        }
        let recent = c.recent();
        assert_eq!(recent.len(), RECENT, "bounded");
        assert!(
            recent.iter().all(|r| r.worker_id == 3),
            "the oldest went first"
        );
    }
}
