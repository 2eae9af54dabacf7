//! Load read from the workers' own Prometheus `/metrics` pages, so busy thresholds and
//! `/v1/workers` see each engine's queue and KV-cache use without the workers calling
//! `POST /v1/load`.
//!
//! | engine | requests waiting | KV cache in use (0..=1) | rank label |
//! |---|---|---|---|
//! | vLLM (V1) | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` | `engine` |
//! | vLLM (V0) | `vllm:num_requests_waiting` | `vllm:gpu_cache_usage_perc` | `engine` |
//! | SGLang | `sglang:num_queue_reqs` | `sglang:token_usage` | `dp_rank` |
//!
//! A data-parallel vLLM server publishes one sample per engine core (`engine="0"`,
//! `engine="1"`, ...): each is that rank's load. Without a rank label the sample is rank 0.
//!
//! # Invariants
//! 1. Pure and total: any text parses; lines that are not samples of these metrics, and
//!    values that are not finite numbers, are skipped.
//! 2. A rank is reported only with both values seen, waiting rounded to a non-negative
//!    integer and usage clamped to `0..=1` (so a report always passes
//!    [`engine::sched::WorkerLoad::validate`]).

use engine::DpRank;
use engine::sched::WorkerLoad;
use std::collections::BTreeMap;

const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const USAGE: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];
const RANK_LABELS: [&str; 2] = ["engine", "dp_rank"];

/// Each rank's load on a metrics page (see the module docs).
pub fn parse_loads(page: &str) -> Vec<(DpRank, WorkerLoad)> {
    let mut seen: BTreeMap<u32, (Option<f64>, Option<f64>)> = BTreeMap::new();
    for line in page.lines() {
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        let waiting = WAITING.contains(&name);
        if !waiting && !USAGE.contains(&name) {
            continue;
        }
        let Some(rank) = rank(labels) else { continue };
        let slot = seen.entry(rank).or_default();
        match waiting {
            true => slot.0 = Some(value),
            false => slot.1 = Some(value),
        }
    }
    seen.into_iter()
        .filter_map(|(rank, (waiting, usage))| {
            let load = WorkerLoad {
                num_requests_waiting: waiting?.max(0.0).round() as u64,
                kv_usage: usage?.clamp(0.0, 1.0),
            };
            Some((DpRank(rank), load))
        })
        .collect()
}

/// `name{labels} value [timestamp]` -> (name, labels, value), for finite values.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line.get(open..)?.find('}')?;
            (
                line.get(..open)?,
                line.get(open + 1..close)?,
                line.get(close + 1..)?,
            )
        }
        None => {
            let (name, rest) = line.split_once(char::is_whitespace)?;
            (name, "", rest)
        }
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name.trim(), labels, value))
}

/// The rank a sample's labels name (0 without a rank label); `None` for a rank label that
/// is not a number.
fn rank(labels: &str) -> Option<u32> {
    for pair in labels.split(',') {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        if RANK_LABELS.contains(&k.trim()) {
            return v.trim().trim_matches('"').parse().ok();
        }
    }
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(waiting: u64, kv_usage: f64) -> WorkerLoad {
        WorkerLoad {
            num_requests_waiting: waiting,
            kv_usage,
        }
    }

    #[test]
    fn garbage_and_partial_pages_give_nothing_or_what_is_whole() {
        for page in [
            "",
            "\n\n",
            "not a metric page",
            "{{{",
            "vllm:num_requests_waiting",
            "}",
        ] {
            assert_eq!(parse_loads(page), vec![], "{page:?}");
        }
        // Waiting without usage: not reported.
        assert_eq!(parse_loads("vllm:num_requests_waiting 3\n"), vec![]);
        // NaN / Inf values are skipped; a non-numeric rank label too.
        let page = "vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc +Inf\n\
                    vllm:num_requests_waiting{engine=\"x\"} 1\nvllm:kv_cache_usage_perc{engine=\"x\"} 0.5\n";
        assert_eq!(parse_loads(page), vec![]);
        // Out of range values are brought into range.
        let page = "vllm:num_requests_waiting -2\nvllm:kv_cache_usage_perc 1.7\n";
        assert_eq!(parse_loads(page), vec![(DpRank(0), load(0, 1.0))]);
    }

    fn page(name: &str) -> String {
        let path = format!("{}/tests/data/metrics/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn pages_in_the_shapes_vllm_and_sglang_publish() {
        assert_eq!(
            parse_loads(&page("vllm_v1_dp2.txt")),
            vec![
                (DpRank(0), load(3, 0.8731501057082452)),
                (DpRank(1), load(0, 0.41289640591966175)),
            ]
        );
        assert_eq!(
            parse_loads(&page("vllm_v0.txt")),
            vec![(DpRank(0), load(11, 0.9625))]
        );
        assert_eq!(
            parse_loads(&page("sglang.txt")),
            vec![(DpRank(0), load(5, 0.56))]
        );
    }

    #[test]
    fn values_in_every_prometheus_notation() {
        let page = "vllm:num_requests_waiting{model_name=\"m\"} 4.2e+01 1700000000000\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} 5E-1\n";
        assert_eq!(parse_loads(page), vec![(DpRank(0), load(42, 0.5))]);
    }
}
