//! End-to-end ingest of vLLM-format KV events over ZMQ on loopback: Rust publishers speak
//! vLLM's protocol (PUB, seq numbers, map-encoded msgpack batches with token ids, a replay
//! socket); kvengine's subscribers decode them, hash the tokens, fence the seqs and hand the
//! events to a real engine. Measures block events per second from the first publish until
//! every event was handed over and applied (`hub.sync()`).
//!
//! Workload: each of `workers` publishers sends `batches` batches; batch `i` stores
//! `stores_per_batch` new sequences of `blocks_per_event` blocks of 16 token ids and removes
//! the sequences batch `i - window` stored, so the index stays bounded. Batches are built and
//! encoded in the timed loop (the publisher shares the two CPUs with the router).
//!
//! PUB sockets drop messages for slow subscribers (ZMQ's high-water mark); a real vLLM would
//! then see kvengine replay. The benchmark instead paces publishers to at most
//! `max_in_flight` batches ahead of the subscribers, and fails if anything was replayed or
//! resynced, so the figure is for the clean path.
//!
//! ```text
//! cargo run --release -p kvengine-benches --example ingest_zmq -- --workers 4 --batches 2000
//! ```

use crate::ingest_quic::IngestReport;
use anyhow::{Context, Result};
use engine::WorkerId;
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use transport::hub::{HubConfig, Registration, start_engine};
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::{SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

/// What to run.
#[derive(Clone, Debug)]
pub struct ZmqBenchConfig {
    /// Engine cores (shard threads).
    pub cores: usize,
    /// Pin the engine's core threads.
    pub pin_cores: bool,
    /// Blocks shallower than this are replicated in every shard.
    pub replicate_depth: u32,
    /// Tokio worker threads (subscribers and publishers share the runtime).
    pub tokio_threads: usize,
    /// Publishers, one worker id each.
    pub workers: usize,
    /// Batches per publisher.
    pub batches: usize,
    /// New sequences stored per batch (and as many removed).
    pub stores_per_batch: usize,
    /// Blocks per stored sequence.
    pub blocks_per_event: usize,
    /// A batch removes what the batch this many before it stored.
    pub window: usize,
    /// Batches a publisher may be ahead of the subscribers (all publishers together).
    pub max_in_flight: u64,
}

impl Default for ZmqBenchConfig {
    fn default() -> Self {
        Self {
            cores: 2,
            pin_cores: false,
            replicate_depth: 32,
            tokio_threads: 2,
            workers: 4,
            batches: 1000,
            stores_per_batch: 16,
            blocks_per_event: 16,
            window: 8,
            max_in_flight: 64,
        }
    }
}

const BLOCK_SIZE: usize = 16;

#[inline]
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn batch(cfg: &ZmqBenchConfig, worker: u64, i: usize) -> WireBatch {
    let b = cfg.blocks_per_event;
    let hashes = |s: u64| -> Vec<u64> {
        (0..b as u64)
            .map(|j| mix((worker << 48) ^ (s << 8) ^ j))
            .collect()
    };
    let mut events = Vec::with_capacity(2 * cfg.stores_per_batch);
    for k in 0..cfg.stores_per_batch {
        let s = (i * cfg.stores_per_batch + k) as u64;
        let seed = mix(worker ^ (s << 20));
        events.push(WireEvent::Stored {
            block_hashes: hashes(s),
            parent: None,
            token_ids: (0..(b * BLOCK_SIZE) as u64)
                .map(|t| (mix(seed ^ t) % 150_000) as u32)
                .collect(),
            block_size: Some(BLOCK_SIZE as u32),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
        });
    }
    if i >= cfg.window {
        for k in 0..cfg.stores_per_batch {
            let s = ((i - cfg.window) * cfg.stores_per_batch + k) as u64;
            events.push(WireEvent::Removed {
                block_hashes: hashes(s),
                medium: Some("GPU".into()),
            });
        }
    }
    WireBatch {
        ts: None,
        dp_rank: Some(0),
        events,
        unknown_events: 0,
    }
}

/// Runs the benchmark (see the module docs).
pub fn run(cfg: &ZmqBenchConfig) -> Result<IngestReport> {
    anyhow::ensure!(
        cfg.workers > 0 && cfg.batches > 0 && cfg.stores_per_batch > 0 && cfg.blocks_per_event > 0,
        "workers, batches, stores and blocks must be > 0"
    );
    let scheduler = SchedulerConfig {
        block_size: BLOCK_SIZE as u32,
        ..SchedulerConfig::default()
    };
    let engine_cfg = RuntimeConfig {
        pin_cores: cfg.pin_cores,
        ingest_handles: cfg.cores.max(1),
        query_handles: 1,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(
        HubConfig { scheduler },
        cfg.cores,
        cfg.replicate_depth,
        engine_cfg,
    )
    .context("starting the engine")?;
    let hub = Arc::new(hub);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.tokio_threads.max(1))
        .enable_all()
        .build()
        .context("tokio runtime")?;

    let report = rt.block_on(async {
        let mut publishers = Vec::with_capacity(cfg.workers);
        let mut tasks = Vec::with_capacity(cfg.workers);
        for w in 0..cfg.workers {
            let worker = w as u64 + 1;
            let publisher =
                VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 4096).await?;
            let source = ZmqSource::new(
                WorkerId(worker),
                publisher.endpoint(),
                publisher.replay_endpoint(),
            )?;
            hub.register(Registration {
                zmq: Some(source.publisher.clone()),
                replay: source.replay.clone(),
                ..Registration::new(WorkerId(worker))
            })?;
            tasks.push(spawn_subscriber(
                hub.clone(),
                source,
                SubscriberConfig::default(),
            ));
            publishers.push(publisher);
        }
        // PUB/SUB drops what is sent before a subscription is up: publish clears until every
        // subscriber has handed one over.
        let probe = WireBatch {
            ts: None,
            dp_rank: Some(0),
            events: vec![WireEvent::Cleared],
            unknown_events: 0,
        };
        let connect_deadline = Instant::now() + Duration::from_secs(30);
        while hub.workers().iter().any(|w| w.events == 0) {
            anyhow::ensure!(
                Instant::now() < connect_deadline,
                "subscribers never connected"
            );
            for (p, w) in publishers.iter_mut().zip(hub.workers()) {
                if w.events == 0 {
                    p.publish(&probe).await?;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let metrics_base = hub.metrics().events_forwarded.load(Relaxed);
        let sent_batches = Arc::new(AtomicU64::new(0));
        let done_batches = Arc::new(AtomicU64::new(0));

        let start = Instant::now();
        let mut jobs = Vec::with_capacity(cfg.workers);
        for (w, mut p) in publishers.into_iter().enumerate() {
            let cfg = cfg.clone();
            let hub = hub.clone();
            let sent = sent_batches.clone();
            let done = done_batches.clone();
            let base = metrics_base;
            jobs.push(tokio::spawn(async move {
                let worker = w as u64 + 1;
                let (mut events, mut blocks) = (0u64, 0u64);
                for i in 0..cfg.batches {
                    let b = batch(&cfg, worker, i);
                    events += b.events.len() as u64;
                    blocks += (b.events.len() * cfg.blocks_per_event) as u64;
                    // Pace: at most `max_in_flight` batches not yet handed over.
                    loop {
                        let handed = hub.metrics().events_forwarded.load(Relaxed) - base;
                        let avg = (2 * cfg.stores_per_batch) as u64;
                        done.store(handed / avg.max(1), Relaxed);
                        if sent.load(Relaxed) < done.load(Relaxed) + cfg.max_in_flight {
                            break;
                        }
                        tokio::time::sleep(Duration::from_micros(50)).await;
                    }
                    p.publish(&b).await?;
                    sent.fetch_add(1, Relaxed);
                }
                Ok::<_, anyhow::Error>((p, events, blocks))
            }));
        }
        let (mut events, mut block_events) = (0u64, 0u64);
        let mut keep = Vec::new();
        for j in jobs {
            let (p, e, b) = j.await??;
            events += e;
            block_events += b;
            keep.push(p);
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while hub.metrics().events_forwarded.load(Relaxed) - metrics_base < events {
            anyhow::ensure!(Instant::now() < deadline, "events never all arrived");
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        let hub2 = hub.clone();
        tokio::task::spawn_blocking(move || hub2.sync()).await??;
        let seconds = start.elapsed().as_secs_f64();

        let m = hub.metrics();
        anyhow::ensure!(
            m.resyncs.load(Relaxed) == 0 && m.replayed_batches.load(Relaxed) == 0,
            "messages were lost on the way (replayed {}, resynced {})",
            m.replayed_batches.load(Relaxed),
            m.resyncs.load(Relaxed)
        );
        let dropped: u64 = m.drops().map(|(_, n)| n).sum();
        anyhow::ensure!(dropped == 0, "{dropped} inputs were dropped");
        let stats = hub.core_stats()?;
        let rejects: u64 = stats.iter().map(|s| s.rejects.total()).sum();
        anyhow::ensure!(rejects == 0, "the engine refused {rejects} events");
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
        drop(keep);
        Ok::<_, anyhow::Error>(IngestReport {
            transport: "zmq".into(),
            cores: cfg.cores,
            workers: cfg.workers,
            batches: (cfg.workers * cfg.batches) as u64,
            events,
            block_events,
            seconds,
            block_events_per_s: crate::report::rate(block_events, seconds),
            index_entries_after: stats.iter().map(|s| s.directory_entries as u64).sum(),
        })
    })?;
    drop(rt);
    if let Ok(hub) = Arc::try_unwrap(hub) {
        drop(hub);
        runtime.join().context("joining the engine")?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_moves_every_block_and_stays_bounded() {
        let cfg = ZmqBenchConfig {
            cores: 1,
            workers: 2,
            batches: 20,
            stores_per_batch: 2,
            blocks_per_event: 4,
            window: 4,
            ..ZmqBenchConfig::default()
        };
        let r = run(&cfg).unwrap();
        assert_eq!(r.batches, 40);
        assert_eq!(r.events, 2 * (20 * 2 + 16 * 2));
        assert_eq!(r.block_events, r.events * 4);
        assert_eq!(r.index_entries_after, 2 * 4 * 2 * 4);
    }
}
