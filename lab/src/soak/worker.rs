//! A simulated vLLM worker the soak harness breaks: a [`crate::workers`] worker (the same
//! real-time driver `kvengine sim` runs: a [`sim::engine::SimEngine`] in sped-up real time,
//! its KV events published by a ZMQ publisher with a replay socket, an OpenAI HTTP server
//! that also serves vLLM's load gauges at `GET /metrics`), whose fault hooks
//! ([`crate::workers::faults`]) the soak drives, and whose every engine batch also updates
//! a [`CacheModel`]: the enumeration of its cached chains a checkpoint probes.
//!
//! What is the soak's own here: the model, and the synthetic bursts (chains outside the
//! engine's cache). Withholding batches, restarts on the same ports, heartbeats and the
//! HTTP failure modes are the worker's.
//!
//! # Invariants
//! 1. The model sees every engine batch with the number the publisher gives it, before it
//!    is sent or withheld, in engine order, and is cleared by a restart (the workers'
//!    fault invariants): once the worker is idle ([`SoakWorker::idle`]) its model is its
//!    engine's cache.
//! 2. A synthetic burst stores chains outside the engine's cache and removes each one in
//!    the next batch of the burst; after the burst the router's view of the worker is the
//!    same as before it, so the engine stays the reference.
//!
//! # Concurrency
//! The model is shared by the worker's driver task (its observer, holding the mutex for one
//! batch) and the harness (checkpoints, holding it for a read).

use super::model::CacheModel;
use crate::workers::{BatchObserver, SimWorkerConfig, SimWorkerHandle, spawn_worker_observed};
use anyhow::Result;
use sim::engine::EngineConfig;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use wire::kv_events::{WireBatch, WireEvent};

pub use crate::workers::{Counters, HttpMode};

/// Blocks per chain of a synthetic burst.
const BURST_CHAIN_BLOCKS: usize = 8;

/// One worker's settings.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Its worker id at the router.
    pub id: u64,
    /// The engine: cache size, block size, limits, timing.
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// Batches the publisher keeps for replay.
    pub replay_buffer: usize,
    /// Chains of removed blocks sampled between checkpoints.
    pub removed_sample: usize,
    /// Seed of the removal sampling.
    pub seed: u64,
}

/// The model, as the worker's observer.
struct Observer(Arc<Mutex<CacheModel>>);

impl BatchObserver for Observer {
    fn batch(&mut self, batch: &WireBatch, seq: u64) {
        lock(&self.0).apply(batch, seq);
    }

    fn restarted(&mut self) {
        lock(&self.0).clear();
    }
}

fn lock(m: &Mutex<CacheModel>) -> MutexGuard<'_, CacheModel> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A running worker. Dropping it stops it.
#[derive(Debug)]
pub struct SoakWorker {
    id: u64,
    worker: SimWorkerHandle,
    model: Arc<Mutex<CacheModel>>,
    block_size: u32,
    dp_rank: u32,
    /// Synthetic chains published so far (their numbering).
    serial: AtomicU64,
}

impl SoakWorker {
    /// Binds its ports (any free ones on 127.0.0.1) and starts it on the current runtime.
    pub async fn start(cfg: WorkerConfig) -> Result<Self> {
        let model = Arc::new(Mutex::new(CacheModel::new(
            cfg.engine.block_size,
            cfg.removed_sample,
            cfg.seed,
        )));
        let sim = SimWorkerConfig {
            engine: cfg.engine.clone(),
            speedup: cfg.speedup,
            replay_buffer: cfg.replay_buffer,
            vllm_metrics: true,
            ..SimWorkerConfig::default()
        };
        let observer = Box::new(Observer(model.clone()));
        let worker = spawn_worker_observed(sim, None, Some(observer)).await?;
        Ok(Self {
            id: cfg.id,
            worker,
            model,
            block_size: cfg.engine.block_size,
            dp_rank: cfg.engine.dp_rank,
            serial: AtomicU64::new(0),
        })
    }

    /// Its worker id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its HTTP base URL.
    pub fn url(&self) -> String {
        self.worker.url()
    }

    /// The router's `--worker` flag value for it.
    pub fn worker_flag(&self) -> String {
        format!(
            "id={},url={},zmq={},replay={}",
            self.id,
            self.worker.url(),
            self.worker.zmq_endpoint(),
            self.worker.replay_endpoint()
        )
    }

    /// Its counters.
    pub fn counters(&self) -> &Counters {
        self.worker.counters()
    }

    /// Withholds the engine's next `n` batches (numbered and kept for replay, not sent).
    pub async fn withhold(&self, n: u64) -> Result<()> {
        Ok(self.worker.withhold(n).await?)
    }

    /// Publishes `batches` synthetic batches back to back (invariant 2), then one that
    /// removes the last chain; returns how long publishing took.
    pub async fn burst(&self, batches: u32) -> Result<Duration> {
        let bs = self.block_size as usize;
        let chain_tokens = BURST_CHAIN_BLOCKS * bs;
        let batch = |events| WireBatch {
            ts: wall_ts(),
            dp_rank: Some(self.dp_rank),
            events,
            unknown_events: 0,
        };
        let removed = |block_hashes| WireEvent::Removed {
            block_hashes,
            medium: Some("GPU".into()),
        };
        let mut out = Vec::with_capacity(batches as usize + 1);
        let mut previous: Option<Vec<u64>> = None;
        for _ in 0..batches {
            let serial = self.serial.fetch_add(1, Relaxed);
            let hashes = synthetic_hashes(self.id, serial);
            let base = 3_000_000_000u32 + (serial % 4096) as u32 * chain_tokens as u32;
            let mut events = vec![WireEvent::Stored {
                block_hashes: hashes.clone(),
                parent: None,
                token_ids: (0..chain_tokens as u32).map(|t| base + t).collect(),
                block_size: Some(self.block_size),
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                extra_keys: None,
            }];
            if let Some(prev) = previous.replace(hashes) {
                events.push(removed(prev));
            }
            out.push(batch(events));
        }
        out.push(batch(previous.map(removed).into_iter().collect()));
        Ok(self.worker.publish_extra(out).await?)
    }

    /// Kills the worker's process (HTTP refused, in-flight requests dropped, publisher
    /// closed), waits `down`, and starts it again: empty cache, a new publisher on the same
    /// ports numbering from 0.
    pub async fn restart(&self, down: Duration) -> Result<()> {
        Ok(self.worker.restart(down).await?)
    }

    /// Publishes an empty batch (so a trailing gap shows), ending any withholding.
    pub async fn heartbeat(&self) -> Result<()> {
        Ok(self.worker.heartbeat().await?)
    }

    /// Sets what its HTTP server does.
    pub fn set_http(&self, mode: HttpMode) {
        self.worker.set_http(mode);
    }

    /// No request in flight and no engine work (so no event until the next request).
    pub async fn idle(&self) -> Result<bool> {
        Ok(self.worker.probe().await?.idle)
    }

    /// Blocks of `tokens` (base model) the engine caches now: the reference.
    pub async fn cached_prefix_blocks(&self, tokens: &[u32]) -> Result<u32> {
        Ok(self.worker.cached_prefix_blocks(tokens).await?)
    }

    /// Blocks the engine caches.
    pub async fn cached_blocks(&self) -> Result<u64> {
        Ok(self.worker.probe().await?.cached_blocks)
    }

    /// The model's leaf chains, the model's size, and its inconsistencies.
    pub fn leaf_paths(&self) -> (Vec<Vec<u32>>, usize, u64) {
        let m = lock(&self.model);
        (m.leaf_paths(), m.len(), m.inconsistencies)
    }

    /// Whether the held block `seq_hash`'s whole chain came from batches numbered
    /// `first_received` or later in this life (`None`: no such block held).
    pub fn chain_received(&self, seq_hash: u64, first_received: u64) -> Option<bool> {
        lock(&self.model).chain_received(seq_hash, first_received)
    }

    /// Sampled chains removed since the last call.
    pub fn take_removed(&self) -> Vec<Vec<u32>> {
        lock(&self.model).take_removed()
    }

    /// Stops it (without waiting).
    pub fn stop(&self) {
        self.worker.stop();
    }
}

fn wall_ts() -> Option<f64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}

/// The engine hashes of synthetic chain `serial` of `worker`: high bit set, distinct.
fn synthetic_hashes(worker: u64, serial: u64) -> Vec<u64> {
    (0..BURST_CHAIN_BLOCKS as u64)
        .map(|j| {
            let mut bytes = [0u8; 24];
            bytes[..8].copy_from_slice(&worker.to_le_bytes());
            bytes[8..16].copy_from_slice(&serial.to_le_bytes());
            bytes[16..].copy_from_slice(&j.to_le_bytes());
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x50a4) | (1 << 63)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::router::Http;
    use hyper::Method;

    async fn complete(http: &Http, w: &SoakWorker, first: u32) -> u16 {
        let prompt: Vec<String> = (first..first + 40).map(|t| t.to_string()).collect();
        let body = format!(r#"{{"prompt":[{}],"max_tokens":3}}"#, prompt.join(","));
        let url = format!("{}/v1/completions", w.url());
        http.call(Method::POST, &url, Some(body), Duration::from_secs(10))
            .await
            .map_or(0, |(status, _)| status)
    }

    async fn idle(w: &SoakWorker) {
        while !w.idle().await.unwrap() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_fails_and_restarts_on_the_same_ports() {
        let w = SoakWorker::start(WorkerConfig {
            id: 7,
            engine: EngineConfig {
                kv_blocks: 64,
                ..EngineConfig::default()
            },
            speedup: 1000.0,
            replay_buffer: 64,
            removed_sample: 4,
            seed: 0,
        })
        .await
        .unwrap();
        let http = Http::new();
        assert_eq!(complete(&http, &w, 1).await, 200);
        idle(&w).await;
        // 40 prompt tokens and 3 generated: 2 full blocks of 16.
        assert_eq!(w.cached_blocks().await.unwrap(), 2);
        let (leaves, len, bad) = w.leaf_paths();
        assert_eq!((leaves.len(), len, bad), (1, 2, 0));
        assert_eq!(w.cached_prefix_blocks(&leaves[0]).await.unwrap(), 2);
        assert!(w.counters().published.load(Relaxed) > 0);
        assert_eq!(w.counters().completions.load(Relaxed), 1);
        let url = format!("{}/metrics", w.url());
        let (status, page) = http
            .call(Method::GET, &url, None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert!(
            String::from_utf8_lossy(&page).contains("vllm:num_requests_waiting{engine=\"0\"} 0")
        );

        w.withhold(1).await.unwrap();
        assert_eq!(complete(&http, &w, 100).await, 200);
        idle(&w).await;
        w.heartbeat().await.unwrap();
        assert_eq!(w.counters().withheld.load(Relaxed), 1);
        assert_eq!(w.counters().heartbeats.load(Relaxed), 1);
        assert_eq!(w.burst(3).await.map(|_| ()).ok(), Some(()));
        assert_eq!(w.counters().extra.load(Relaxed), 4);
        // The burst left the model (and the engine) as they were.
        assert_eq!(w.leaf_paths().1 as u64, w.cached_blocks().await.unwrap());

        let flag = w.worker_flag();
        w.restart(Duration::from_millis(20)).await.unwrap();
        assert_eq!(w.worker_flag(), flag);
        assert_eq!(w.cached_blocks().await.unwrap(), 0);
        assert_eq!(w.leaf_paths().1, 0);
        assert_eq!(w.counters().restarts.load(Relaxed), 1);
        // The listener is back once `restart` returns, but a loaded machine may take a
        // moment to accept: retry briefly (the failure seen in CI was a refused connect).
        assert_eq!(
            complete_until_ok(&http, &w, Duration::from_secs(2)).await,
            200,
            "HTTP back on the same port"
        );

        w.set_http(HttpMode::Fail500);
        let failed = w.counters().failed.load(Relaxed);
        assert_eq!(complete(&http, &w, 1).await, 500);
        assert_eq!(w.counters().failed.load(Relaxed), failed + 1);
        w.set_http(HttpMode::Refuse);
        assert_eq!(
            complete_until_refused(&http, &w, Duration::from_secs(2)).await,
            0
        );
        w.set_http(HttpMode::Serve);
        assert_eq!(
            complete_until_ok(&http, &w, Duration::from_secs(2)).await,
            200
        );
    }

    /// Completes a 1-token request until it answers 200 or `within` passes; the last status.
    async fn complete_until_ok(http: &Http, w: &SoakWorker, within: Duration) -> u16 {
        let end = std::time::Instant::now() + within;
        loop {
            let status = complete(http, w, 1).await;
            if status == 200 || std::time::Instant::now() > end {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Completes until no answer comes (the listener closed) or `within` passes.
    async fn complete_until_refused(http: &Http, w: &SoakWorker, within: Duration) -> u16 {
        let end = std::time::Instant::now() + within;
        loop {
            let status = complete(http, w, 1).await;
            if status == 0 || std::time::Instant::now() > end {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
