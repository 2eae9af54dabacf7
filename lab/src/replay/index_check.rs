//! After a run: the router's index against what each simulated worker caches.
//!
//! For a sample of the workload's prompts (every distinct prompt up to [`MAX_PROMPTS`],
//! evenly spaced beyond), each worker's overlap in the router (`Hub::overlap`, what routing
//! sees) is compared with the number of leading prompt blocks the worker's engine caches
//! (`SimWorkerHandle::cached_prefix_blocks`, the reference). Events may still be on their
//! way (ZMQ delivery, a TensorRT-LLM worker's next poll), so a mismatch is checked again
//! until none is left or [`SETTLE`] passes; what remains is reported.
//!
//! # Invariants
//! 1. Run only on an idle cluster (no request out): an idle engine produces no events, so
//!    the two sides can agree exactly.
//! 2. Exact, not a bound: a worker's cache is prefix-closed, and so is a prompt's overlap.

use super::cluster::Cluster;
use super::spec::ReplayRequest;
use anyhow::{Context, Result};
use engine::WorkerKey;
use serde::Serialize;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// The most prompts probed per run.
pub const MAX_PROMPTS: usize = 256;
/// How long mismatches may take to settle.
pub const SETTLE: Duration = Duration::from_secs(5);

/// The outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexCheck {
    /// Prompts probed (each on every worker).
    pub prompts: usize,
    /// (prompt, worker) pairs where the router's overlap differs from the worker's cache.
    pub mismatches: usize,
    /// Prompt blocks the workers cache, summed over the probes (what agreeing means).
    pub cached_blocks: u64,
    /// The first mismatch, described.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first: Option<String>,
}

/// Probes `requests`' prompts on every worker of `cluster` (see the module docs).
pub async fn check(cluster: &Cluster, requests: &[ReplayRequest]) -> Result<IndexCheck> {
    let prompts = sample(requests);
    let deadline = Instant::now() + SETTLE;
    loop {
        let outcome = probe(cluster, &prompts).await?;
        if outcome.mismatches == 0 || Instant::now() >= deadline {
            return Ok(outcome);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Distinct prompts, at most [`MAX_PROMPTS`], spread over the workload.
fn sample(requests: &[ReplayRequest]) -> Vec<&[u32]> {
    let mut seen = HashSet::new();
    let distinct: Vec<&[u32]> = requests
        .iter()
        .map(|r| &r.tokens[..])
        .filter(|t| seen.insert(*t))
        .collect();
    let step = distinct.len().div_ceil(MAX_PROMPTS).max(1);
    distinct.into_iter().step_by(step).collect()
}

async fn probe(cluster: &Cluster, prompts: &[&[u32]]) -> Result<IndexCheck> {
    let hub = cluster.hub();
    let ids = cluster.worker_ids();
    let mut out = IndexCheck {
        prompts: prompts.len(),
        ..IndexCheck::default()
    };
    for prompt in prompts {
        let (_, _, matches) = hub
            .overlap(None, prompt, None)
            .context("the router's overlap")?;
        for (w, &id) in cluster.workers().iter().zip(&ids) {
            let want = w
                .cached_prefix_blocks(prompt)
                .await
                .context("a worker's cache")?;
            let got = matches
                .overlaps
                .iter()
                .filter(|(k, _)| {
                    *k == WorkerKey {
                        worker: id,
                        dp_rank: engine::DpRank(0),
                    }
                })
                .map(|&(_, n)| n)
                .max()
                .unwrap_or(0);
            out.cached_blocks += u64::from(want);
            if got != want {
                out.mismatches += 1;
                if out.first.is_none() {
                    out.first = Some(format!(
                        "worker {id}: the router sees {got} of a {}-token prompt's blocks \
                         cached, the worker caches {want}",
                        prompt.len()
                    ));
                }
            }
        }
    }
    Ok(out)
}
