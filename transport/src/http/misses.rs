//! The miss-attribution and shadow series of `GET /metrics` (`kvengine_cache_*`,
//! `kvengine_worker_stale_tokens_total`, `kvengine_shadow_*`), from
//! [`crate::misses::MissCounters`], and `GET /v1/misses`, the last attributed requests;
//! docs/api.md, "Why requests missed the cache".
//!
//! # Invariants
//! 1. Every model that has counted anything has every series of its family (zeros
//!    included), so ratios between them never miss a term.

use super::api_error::json;
use super::shared::AppState;
use crate::hub::Hub;
use crate::misses::RecentMiss;
use crate::misses::{HIT_RATIO_BUCKETS, ModelMisses, Unattributed};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use engine::router::misses::MissCause;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

type Labels1 = [(&'static str, String); 1];
type Labels2 = [(&'static str, String); 2];

/// Per-model hit-ratio histograms, encoded as one family.
#[derive(Debug)]
struct HitRatios(Vec<(Labels1, ModelMisses)>);

impl TypedMetric for HitRatios {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for HitRatios {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, m) in &self.0 {
            let buckets: Vec<(f64, u64)> = HIT_RATIO_BUCKETS
                .iter()
                .copied()
                .chain([f64::INFINITY])
                .zip(m.hit_ratio.iter().copied())
                .collect();
            let count = m.hit_ratio.iter().sum();
            encoder
                .encode_family(labels)?
                .encode_histogram::<NoLabelSet>(m.hit_ratio_sum, count, &buckets, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

fn add(family: &Family<Labels2, Counter>, labels: [(&'static str, String); 2], v: u64) {
    family.get_or_create(&labels).inc_by(v);
}

/// Registers the series in `reg`.
pub(super) fn register(reg: &mut Registry, hub: &Hub) {
    let crate::misses::MissSnapshot {
        models,
        stale_by_worker,
        shadow_failures,
    } = hub.metrics().misses.snapshot();
    let hits = Family::<Labels1, Counter>::default();
    let misses = Family::<Labels2, Counter>::default();
    let requests = Family::<Labels2, Counter>::default();
    let unattributed = Family::<Labels2, Counter>::default();
    let agreed = Family::<Labels2, Counter>::default();
    let overlap = Family::<Labels2, Counter>::default();
    let realised = Family::<Labels2, Counter>::default();
    let model = |m: &str| ("model", m.to_owned());
    for (name, m) in &models {
        hits.get_or_create(&[model(name)]).inc_by(m.hit_tokens);
        for (cause, &n) in MissCause::ALL.iter().zip(&m.miss_tokens) {
            add(&misses, [model(name), ("cause", cause.as_str().into())], n);
        }
        let outcomes = ["hit"]
            .into_iter()
            .chain(MissCause::ALL.iter().map(|c| c.as_str()));
        for (outcome, &n) in outcomes.zip(&m.requests) {
            add(&requests, [model(name), ("outcome", outcome.into())], n);
        }
        for (why, &n) in Unattributed::ALL.iter().zip(&m.unattributed) {
            add(
                &unattributed,
                [model(name), ("reason", why.as_str().into())],
                n,
            );
        }
        if hub.shadow().is_some() {
            for (value, &n) in ["true", "false"].iter().zip(&m.shadow_agreed) {
                add(&agreed, [model(name), ("agreed", (*value).into())], n);
            }
            for (policy, i) in [("active", 0), ("shadow", 1)] {
                let labels = [model(name), ("policy", policy.into())];
                add(&overlap, labels.clone(), m.shadow_overlap_tokens[i]);
                add(&realised, labels, m.shadow_realised_tokens[i]);
            }
        }
    }
    reg.register(
        "kvengine_cache_hit_tokens",
        "Front door: cacheable prompt tokens the workers reported cached (usage cached_tokens, \
         in whole blocks)",
        hits,
    );
    reg.register(
        "kvengine_cache_miss_tokens",
        "Front door: cacheable prompt tokens missed, by cause: routing (a better-cached worker \
         existed), stale (predicted on the chosen worker, not there), cold (nobody had them)",
        misses,
    );
    reg.register(
        "kvengine_cache_requests",
        "Front door: attributed requests by outcome: hit (nothing cacheable missed), or the \
         cause that missed the most blocks",
        requests,
    );
    reg.register(
        "kvengine_cache_unattributed_requests",
        "Front door: answered requests that could not be attributed, by reason",
        unattributed,
    );
    reg.register(
        "kvengine_cache_hit_ratio",
        "Front door: per request, cached prompt tokens over prompt tokens",
        HitRatios(
            models
                .iter()
                .map(|(n, m)| ([model(n)], m.clone()))
                .collect(),
        ),
    );
    let stale = Family::<Labels1, Counter>::default();
    for (w, n) in stale_by_worker {
        stale
            .get_or_create(&[("worker_id", w.to_string())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_worker_stale_tokens",
        "Front door: stale miss tokens per chosen worker (its events lag, or it evicts \
         unannounced)",
        stale,
    );
    let Some(shadow) = hub.shadow() else {
        return;
    };
    let info = Family::<Labels1, Gauge>::default();
    info.get_or_create(&[("shadow", shadow.to_string())]).set(1);
    reg.register("kvengine_shadow_info", "The --shadow policy", info);
    reg.register(
        "kvengine_shadow_decisions",
        "Routing decisions with a shadow decision beside them, by whether it chose the same \
         worker rank",
        agreed,
    );
    reg.register(
        "kvengine_shadow_overlap_tokens",
        "Predicted overlap tokens (cacheable) of the active decision and of the shadow's",
        overlap,
    );
    reg.register(
        "kvengine_shadow_realised_tokens",
        "Over shadowed front-door requests attributed: the tokens the active route found \
         cached (active), and those the shadow's choice was predicted to hold (shadow)",
        realised,
    );
    let failures = Counter::<u64>::default();
    failures.inc_by(shadow_failures);
    reg.register(
        "kvengine_shadow_failures",
        "Shadow decisions that could not be taken (an unknown worker named, no candidate)",
        failures,
    );
}

/// `GET /v1/misses`' answer.
#[derive(serde::Serialize)]
struct Recent {
    /// How many requests are kept.
    capacity: usize,
    /// The shadow policy, if any.
    shadow: Option<String>,
    /// The last attributed requests, newest first.
    requests: Vec<RecentMiss>,
}

/// `GET /v1/misses`: the last [`crate::misses::RECENT`] attributed requests, newest
/// first.
pub(super) async fn recent(State(st): State<AppState>) -> Response {
    let body = Recent {
        capacity: crate::misses::RECENT,
        shadow: st.hub.shadow().map(|s| s.to_string()),
        requests: st.hub.metrics().misses.recent(),
    };
    json(StatusCode::OK, &body)
}
