//! Why kvengine's requests missed the cache in a peers run: its own miss attribution
//! (`kvengine_cache_*` on `GET /metrics`, docs/api.md "Why requests missed the cache"),
//! read once after the replay. The peers have no such series, so only kvengine rows carry
//! it; the workers' hit rate stays the figure every router is compared on.
//!
//! # Invariants
//! 1. Series are summed over models; a router without the series (a peer, or an answer
//!    that is not Prometheus text) gives `None`, never zeros.

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

/// Prompt tokens by how the workers served them, as kvengine attributed them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MissFigures {
    /// Cached tokens the workers reported.
    pub hit_tokens: u64,
    /// Missed because a better-cached worker existed.
    pub routing_tokens: u64,
    /// Missed on the chosen worker although the index said it held them.
    pub stale_tokens: u64,
    /// Missed because no worker held them.
    pub cold_tokens: u64,
}

impl MissFigures {
    /// Every attributed token.
    pub fn total(&self) -> u64 {
        self.hit_tokens + self.routing_tokens + self.stale_tokens + self.cold_tokens
    }
}

/// Parses the `kvengine_cache_{hit,miss}_tokens` series out of a Prometheus text page
/// (invariant 1).
pub fn parse(page: &str) -> Option<MissFigures> {
    use crate::soak::router::metric_sum_where;
    let hit = metric_sum_where(page, "kvengine_cache_hit_tokens_total", "");
    let miss = |cause: &str| {
        let label = format!("cause=\"{cause}\"");
        metric_sum_where(page, "kvengine_cache_miss_tokens_total", &label)
    };
    let (routing, stale, cold) = (miss("routing"), miss("stale"), miss("cold"));
    if [hit, routing, stale, cold].iter().all(Option::is_none) {
        return None;
    }
    let n = |v: Option<f64>| v.unwrap_or(0.0) as u64;
    Some(MissFigures {
        hit_tokens: n(hit),
        routing_tokens: n(routing),
        stale_tokens: n(stale),
        cold_tokens: n(cold),
    })
}

/// Reads `base_url/metrics` and parses it.
pub async fn scrape(base_url: &str) -> Option<MissFigures> {
    let url = format!("{}/metrics", base_url.trim_end_matches('/'));
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let resp = client.get(url.parse().ok()?).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    parse(std::str::from_utf8(&body).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_causes_over_models_and_ignores_other_series() {
        let page = "# HELP kvengine_cache_hit_tokens x\n\
            kvengine_cache_hit_tokens_total{model=\"a\"} 100\n\
            kvengine_cache_hit_tokens_total{model=\"b\"} 5\n\
            kvengine_cache_miss_tokens_total{model=\"a\",cause=\"routing\"} 7\n\
            kvengine_cache_miss_tokens_total{model=\"a\",cause=\"stale\"} 3\n\
            kvengine_cache_miss_tokens_total{model=\"b\",cause=\"cold\"} 11\n\
            kvengine_cache_requests_total{model=\"a\",outcome=\"hit\"} 99\n";
        let f = parse(page).unwrap();
        assert_eq!(
            f,
            MissFigures {
                hit_tokens: 105,
                routing_tokens: 7,
                stale_tokens: 3,
                cold_tokens: 11
            }
        );
        assert_eq!(f.total(), 126);
    }

    #[test]
    fn a_page_without_the_series_is_none() {
        assert_eq!(parse("vllm_router_requests_total 4\n"), None);
        assert_eq!(parse(""), None);
    }
}
