//! Checkpoints: the router's index against the workers' caches.
//!
//! A checkpoint pauses the traffic, waits until no request is out and every worker is idle
//! (so no event can be produced), waits until the router has every worker back in routing,
//! then publishes an empty batch per worker (so a batch withheld last shows as a gap and is
//! replayed) until the router's `kvengine_directory_entries` equals the blocks the engines
//! cache, or stops changing for about a second, or a deadline passes. Then it asks `POST /v1/overlap` for every cached chain of
//! every worker (the leaves of its [`super::model::CacheModel`]) and for a sample of
//! chains removed since the last checkpoint, and compares each worker's overlap with what
//! its engine caches (`SimEngine::cached_prefix_blocks`, the reference):
//!
//! * **stale**: the router reports a worker holds blocks of the chain past what the worker
//!   caches. Each such block (worker, seq_hash) counts once. Exact: the engine's cache is
//!   prefix-closed, so past its overlap the worker holds none of the chain.
//! * **lost**: the router reports less than the worker caches; the blocks between the two
//!   overlaps count (the router may hold some of them past a missing one, but cannot match
//!   them: for routing they are lost). A lost block is *acknowledged* unless its chain (it
//!   or an ancestor) was stored by a batch the router says it never received: a batch
//!   before the one at which it last cleared the worker and resynced ("worker W: batches
//!   F..N not replayed: batches lost; clearing and resyncing", or "seq N" for a source
//!   without replay), when that came after the last restart it detected. A restart alone
//!   makes nothing unreceived: the router replays the new process from 0, and says so when
//!   that fails. Those are counted apart (`lost_unreceived`).
//!
//! The index's total is also compared: `kvengine_directory_entries` above the engines'
//! total means stale entries somewhere, even in chains no probe asked about; the
//! checkpoint's stale figure is the larger of the two lower bounds. A mismatch is re-probed
//! (after another heartbeat) up to [`ATTEMPTS`] times before it is counted, so only a
//! difference that outlives convergence counts.
//!
//! # Invariants
//! 1. No traffic and no fault runs during a checkpoint; the traffic resumes however it
//!    ends. A router that keeps a worker out of routing (unhealthy, or its stream not
//!    subscribed) past the deadline is reported (`all_workers_healthy: false`), and the
//!    comparison still runs.
//! 2. The harness checks itself: every leaf chain of a worker's model must be cached whole
//!    by its engine, and the model's size must equal the engine's (`model_mismatches`).

use super::report::Checkpoint;
use super::router::{Http, metric_sum};
use super::traffic::Traffic;
use super::worker::SoakWorker;
use anyhow::{Context, Result, bail};
use engine::hash::{BASE_SEED, seq_hashes};
use hyper::Method;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// Probes of a mismatching chain before its difference counts.
pub const ATTEMPTS: u32 = 3;
/// Probes in flight at once.
const PARALLEL: usize = 4;
const QUIET_TIMEOUT: Duration = Duration::from_secs(60);
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a checkpoint needs.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// The workers.
    pub workers: &'a [SoakWorker],
    /// The client.
    pub http: &'a Http,
    /// The router's `HOST:PORT`.
    pub addr: &'a str,
    /// Tokens per block.
    pub block_size: u32,
    /// The traffic to pause.
    pub traffic: &'a Traffic,
    /// The run's start.
    pub start: Instant,
    /// Where the router's logs (`router-<life>.log`) are.
    pub log_dir: &'a Path,
}

/// Per worker, the first batch number of its current process from which the router holds
/// everything, from the routers' logs: 0 unless the router cleared and resynced the worker
/// after the last restart it detected (see the module docs).
pub fn first_received(log_dir: &Path, workers: &[SoakWorker]) -> BTreeMap<u64, u64> {
    let mut logs: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(log_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let life = name.strip_prefix("router-")?.strip_suffix(".log")?;
                    Some((life.parse().ok()?, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    logs.sort();
    let mut first: BTreeMap<u64, u64> = workers.iter().map(|w| (w.id(), 0)).collect();
    for (_, path) in logs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for (worker, from) in text.lines().filter_map(clear_in_log) {
            if let Some(f) = first.get_mut(&worker) {
                *f = from;
            }
        }
    }
    first
}

/// A router log line that clears a worker: `(worker, the first batch the router holds
/// after it)`. A restart: 0 (the new process is replayed from 0, or a resync line
/// follows). A resync at batch N: N, or N + 1 when batch N itself could not be read.
fn clear_in_log(line: &str) -> Option<(u64, u64)> {
    let (restart, resync) = (
        line.contains("the publisher restarted"),
        line.contains("clearing and resyncing"),
    );
    if !restart && !resync {
        return None;
    }
    let rest = line.split("worker ").nth(1)?;
    let (id, rest) = rest.split_once(": ")?;
    let worker = id.trim().parse().ok()?;
    if restart {
        return Some((worker, 0));
    }
    // "seq N..." or "batches F..N..."
    let number = |s: &str| -> Option<u64> {
        let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    let n = if let Some(s) = rest.strip_prefix("seq ") {
        number(s)?
    } else {
        let s = rest.strip_prefix("batches ")?;
        number(s.split_once("..")?.1)?
    };
    let unread = rest.contains("could not be decoded");
    Some((worker, n + u64::from(unread)))
}

/// Runs one checkpoint (see the module docs); the traffic is paused meanwhile.
pub async fn checkpoint(ctx: &Ctx<'_>, index: usize) -> Result<Checkpoint> {
    ctx.traffic.pause();
    let r = run(ctx, index).await;
    ctx.traffic.resume();
    r
}

/// Waits until every worker is idle (each asked in turn; a stopped worker is an error).
async fn wait_for_idle(workers: &[SoakWorker]) -> Result<()> {
    let began = Instant::now();
    'wait: loop {
        for w in workers {
            if !w.idle().await? {
                if began.elapsed() > QUIET_TIMEOUT {
                    bail!("checkpoint: idle workers not reached within {QUIET_TIMEOUT:?}");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue 'wait;
            }
        }
        return Ok(());
    }
}

async fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Result<()> {
    let began = Instant::now();
    while !done() {
        if began.elapsed() > timeout {
            bail!("checkpoint: {what} not reached within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

async fn metrics(ctx: &Ctx<'_>) -> Result<String> {
    let url = format!("http://{}/metrics", ctx.addr);
    let (status, body) = ctx
        .http
        .call(Method::GET, &url, None, Duration::from_secs(5))
        .await?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Whether the router has every worker healthy.
async fn all_healthy(ctx: &Ctx<'_>) -> bool {
    let url = format!("http://{}/v1/workers", ctx.addr);
    let Ok((200, body)) = ctx
        .http
        .call(Method::GET, &url, None, Duration::from_secs(5))
        .await
    else {
        return false;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return false;
    };
    v["workers"].as_array().is_some_and(|ws| {
        ws.len() == ctx.workers.len()
            && ws
                .iter()
                .all(|w| w["healthy"] == true && w["stream"] == "subscribed")
    })
}

async fn run(ctx: &Ctx<'_>, index: usize) -> Result<Checkpoint> {
    let began = Instant::now();
    let traffic = ctx.traffic;
    wait_for("no request in flight", QUIET_TIMEOUT, || {
        traffic.in_flight() == 0
    })
    .await?;
    wait_for_idle(ctx.workers).await?;
    // A worker the router keeps out of routing is a finding, not a reason to stop.
    let healthy_by = Instant::now() + CONVERGE_TIMEOUT;
    let mut all_back = all_healthy(ctx).await;
    while !all_back && Instant::now() < healthy_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
        all_back = all_healthy(ctx).await;
    }
    let drained_in = began.elapsed();

    // Converge: heartbeats until the router's directories hold what the engines cache.
    let mut reference = 0u64;
    for w in ctx.workers {
        reference += w.cached_blocks().await?;
    }
    let converge = Instant::now();
    let mut directory = f64::NAN;
    let mut unchanged = 0;
    while converge.elapsed() < CONVERGE_TIMEOUT {
        for w in ctx.workers {
            w.heartbeat().await?;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let page = metrics(ctx).await?;
        let now = metric_sum(&page, "kvengine_directory_entries").unwrap_or(f64::NAN);
        unchanged = if now == directory { unchanged + 1 } else { 0 };
        directory = now;
        // Equal, or settled elsewhere (a difference the probes will locate).
        if directory == reference as f64 || unchanged >= 6 {
            break;
        }
    }
    let converged_in = converge.elapsed();

    // The chains to ask about, and the harness's self-check.
    let mut probes: HashSet<Vec<u32>> = HashSet::new();
    let mut model_mismatches = 0u64;
    let mut removed_probes = 0usize;
    let bs = ctx.block_size as usize;
    for w in ctx.workers {
        let (leaves, model_len, inconsistencies) = w.leaf_paths();
        model_mismatches += inconsistencies;
        if model_len as u64 != w.cached_blocks().await? {
            model_mismatches += 1;
        }
        for path in leaves {
            if w.cached_prefix_blocks(&path).await? as usize != path.len() / bs {
                model_mismatches += 1;
            }
            probes.insert(path);
        }
        for path in w.take_removed() {
            removed_probes += usize::from(probes.insert(path));
        }
    }
    let mut todo: Vec<Vec<u32>> = probes.into_iter().collect();
    let probed = todo.len();
    let mut attempts = 0;
    let (mut stale, mut lost, mut probe_errors);
    loop {
        attempts += 1;
        let answers = overlaps(ctx, &todo).await;
        (stale, lost, probe_errors) = (HashSet::new(), HashSet::new(), 0u64);
        let mut wrong = Vec::new();
        for (path, got) in todo.into_iter().zip(answers) {
            let Some(got) = got else {
                probe_errors += 1;
                continue;
            };
            if compare(ctx, &path, &got, &mut stale, &mut lost).await? {
                wrong.push(path);
            }
        }
        if wrong.is_empty() || attempts >= ATTEMPTS {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        for w in ctx.workers {
            w.heartbeat().await?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        todo = wrong;
    }
    let first = first_received(ctx.log_dir, ctx.workers);
    let (mut lost_n, mut unreceived) = (0u64, 0u64);
    let mut lost_by_worker: BTreeMap<u64, u64> = BTreeMap::new();
    for &(w, sh) in &lost {
        let from = first.get(&w).copied().unwrap_or(0);
        let received = ctx
            .workers
            .iter()
            .find(|x| x.id() == w)
            .and_then(|x| x.chain_received(sh, from));
        match received {
            Some(false) => unreceived += 1,
            _ => {
                lost_n += 1;
                *lost_by_worker.entry(w).or_default() += 1;
            }
        }
    }
    let mut stale_by_worker: BTreeMap<u64, u64> = BTreeMap::new();
    for &(w, _) in &stale {
        *stale_by_worker.entry(w).or_default() += 1;
    }
    let page = metrics(ctx).await?;
    let directory_after = metric_sum(&page, "kvengine_directory_entries").unwrap_or(directory);
    let excess = (directory_after - reference as f64).max(0.0) as u64;
    let stale_n = (stale.len() as u64).max(excess);
    Ok(Checkpoint {
        index,
        t_s: ctx.start.elapsed().as_secs_f64(),
        chains_probed: probed,
        removed_chains_probed: removed_probes,
        reference_blocks: reference,
        router_directory_entries: directory_after,
        stale: stale_n,
        lost: lost_n,
        lost_unreceived: unreceived,
        stale_by_worker,
        lost_by_worker,
        first_received: first,
        probe_errors,
        accuracy: 1.0 - (stale_n + lost_n + unreceived) as f64 / (reference.max(1)) as f64,
        drain_ms: drained_in.as_millis() as u64,
        converged_ms: converged_in.as_millis() as u64,
        attempts,
        all_workers_healthy: all_back,
        model_mismatches,
        took_ms: began.elapsed().as_millis() as u64,
    })
}

/// Compares the router's overlaps `got` for `path` with every worker's engine; records the
/// differing blocks. Whether anything differed.
async fn compare(
    ctx: &Ctx<'_>,
    path: &[u32],
    got: &BTreeMap<u64, u32>,
    stale: &mut HashSet<(u64, u64)>,
    lost: &mut HashSet<(u64, u64)>,
) -> Result<bool> {
    let seqs = seq_hashes(path, ctx.block_size as usize, BASE_SEED);
    let mut differs = false;
    for w in ctx.workers {
        let want = w.cached_prefix_blocks(path).await? as usize;
        let have = got.get(&w.id()).copied().unwrap_or(0) as usize;
        let (lo, hi, into) = match have.cmp(&want) {
            std::cmp::Ordering::Equal => continue,
            std::cmp::Ordering::Greater => (want, have, &mut *stale),
            std::cmp::Ordering::Less => (have, want, &mut *lost),
        };
        differs = true;
        for s in seqs.get(lo..hi.min(seqs.len())).unwrap_or_default() {
            into.insert((w.id(), s.0));
        }
    }
    Ok(differs)
}

/// The router's overlap per worker for each of `paths` (`None`: no usable answer).
async fn overlaps(ctx: &Ctx<'_>, paths: &[Vec<u32>]) -> Vec<Option<BTreeMap<u64, u32>>> {
    let mut out = vec![None; paths.len()];
    let chunk = paths.len().div_ceil(PARALLEL).max(1);
    let mut tasks = tokio::task::JoinSet::new();
    for (c, part) in paths.chunks(chunk).enumerate() {
        let part = part.to_vec();
        let http = ctx.http.clone();
        let url = format!("http://{}/v1/overlap", ctx.addr);
        tasks.spawn(async move {
            let mut answers = Vec::with_capacity(part.len());
            for path in part {
                answers.push(overlap(&http, &url, &path).await.ok());
            }
            (c, answers)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok((c, answers)) = joined {
            for (i, a) in answers.into_iter().enumerate() {
                if let Some(slot) = out.get_mut(c * chunk + i) {
                    *slot = a;
                }
            }
        }
    }
    out
}

async fn overlap(http: &Http, url: &str, path: &[u32]) -> Result<BTreeMap<u64, u32>> {
    let ids: Vec<String> = path.iter().map(u32::to_string).collect();
    let body = format!(r#"{{"token_ids":[{}]}}"#, ids.join(","));
    let (status, bytes) = http
        .call(Method::POST, url, Some(body), Duration::from_secs(10))
        .await?;
    if status != 200 {
        bail!("/v1/overlap answered {status}");
    }
    let v: serde_json::Value = serde_json::from_slice(&bytes)?;
    let scores = v["scores"].as_array().context("no scores")?;
    let mut out = BTreeMap::new();
    for s in scores {
        let (Some(w), Some(o)) = (s["worker_id"].as_u64(), s["overlap_blocks"].as_u64()) else {
            continue;
        };
        let o = u32::try_from(o).unwrap_or(u32::MAX);
        let e = out.entry(w).or_insert(0);
        *e = (*e).max(o);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::clear_in_log;

    #[test]
    fn log_lines_that_clear_a_worker_name_what_the_router_still_holds() {
        let at = "2026-11-24T18:42:53.219589Z  WARN transport::stream: ";
        let cases = [
            // A restart is replayed from 0.
            (
                "worker 1: seq 5: the publisher restarted; clearing its blocks",
                Some((1, 0)),
            ),
            (
                "worker 12: batches 0..17 not replayed: batches lost; clearing and resyncing",
                Some((12, 17)),
            ),
            (
                "worker 3: batches 4..9: batches lost; clearing and resyncing",
                Some((3, 9)),
            ),
            // The unreadable batch itself is unreceived.
            (
                "worker 3: seq 8 could not be decoded, nor replayed: batches lost; clearing and \
                 resyncing",
                Some((3, 9)),
            ),
            (
                "worker 2: seq 40: batches lost; clearing and resyncing",
                Some((2, 40)),
            ),
            ("worker 2: seq 40 already applied", None),
        ];
        for (msg, want) in cases {
            assert_eq!(clear_in_log(&format!("{at}{msg}")), want, "{msg}");
        }
        assert_eq!(clear_in_log("garbage: the publisher restarted"), None);
    }
}
