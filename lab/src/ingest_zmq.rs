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
//! kvengine bench ingest --transport zmq --batches 3000
//! ```

use crate::ingest::{IngestConfig, IngestReport, stop};
use crate::workload::mix64;
use anyhow::Result;
use engine::WorkerId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use transport::hub::Registration;
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::{SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

/// What to run: the shared workload plus the publishers' pacing.
#[derive(Clone, Debug)]
pub struct ZmqBenchConfig {
    /// Workload and machine setup.
    pub load: IngestConfig,
    /// Batches the publishers may be ahead of the subscribers (all publishers together).
    pub max_in_flight: u64,
}

impl Default for ZmqBenchConfig {
    fn default() -> Self {
        Self {
            load: IngestConfig::default(),
            max_in_flight: 64,
        }
    }
}

/// Tokens per block: the router's default, which the stores declare.
const BLOCK_SIZE: usize = 16;

fn batch(cfg: &IngestConfig, worker: u64, i: usize) -> WireBatch {
    let b = cfg.blocks_per_event;
    let hashes = |s: u64| -> Vec<u64> {
        (0..b)
            .map(|j| IngestConfig::engine_hash(worker, s, j))
            .collect()
    };
    let (stored, removed) = cfg.sequences(i);
    let mut events = Vec::with_capacity(2 * cfg.stores_per_batch);
    for s in stored {
        let seed = mix64(worker ^ (s << 20));
        events.push(WireEvent::Stored {
            block_hashes: hashes(s),
            parent: None,
            token_ids: (0..(b * BLOCK_SIZE) as u64)
                .map(|t| (mix64(seed ^ t) % 150_000) as u32)
                .collect(),
            block_size: Some(BLOCK_SIZE as u32),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: None,
        });
    }
    for s in removed.into_iter().flatten() {
        events.push(WireEvent::Removed {
            block_hashes: hashes(s),
            medium: Some("GPU".into()),
        });
    }
    WireBatch {
        ts: None,
        dp_rank: Some(0),
        events,
        unknown_events: 0,
    }
}

/// Runs the benchmark (see the module docs).
pub fn run(bench: &ZmqBenchConfig) -> Result<IngestReport> {
    let cfg = &bench.load;
    let (hub, runtime, rt) = cfg.start()?;
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
        // A subscriber that missed the first probes replays them from 0 when it sees one:
        // the timed run is judged on its own replays.
        let replayed_base = hub.metrics().replayed_batches.load(Relaxed);
        let sent_batches = Arc::new(AtomicU64::new(0));
        let done_batches = Arc::new(AtomicU64::new(0));

        let start = Instant::now();
        let mut jobs = Vec::with_capacity(cfg.workers);
        for (w, mut p) in publishers.into_iter().enumerate() {
            let cfg = cfg.clone();
            let max_in_flight = bench.max_in_flight;
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
                        if sent.load(Relaxed) < done.load(Relaxed) + max_in_flight {
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
        let replayed = m.replayed_batches.load(Relaxed) - replayed_base;
        anyhow::ensure!(
            m.resyncs.load(Relaxed) == 0 && replayed == 0,
            "messages were lost on the way (replayed {replayed}, resynced {})",
            m.resyncs.load(Relaxed)
        );
        let dropped: u64 = m.drops().map(|(_, n)| n).sum();
        anyhow::ensure!(dropped == 0, "{dropped} inputs were dropped");
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
        drop(keep);
        cfg.report("zmq", &hub, events, block_events, seconds)
    })?;
    drop(rt);
    stop(hub, runtime)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_moves_every_block_and_stays_bounded() {
        let cfg = ZmqBenchConfig {
            load: IngestConfig {
                cores: 1,
                workers: 2,
                batches: 20,
                stores_per_batch: 2,
                blocks_per_event: 4,
                window: 4,
                ..IngestConfig::default()
            },
            ..ZmqBenchConfig::default()
        };
        let r = run(&cfg).unwrap();
        assert_eq!(r.batches, 40);
        assert_eq!(r.events, 2 * (20 * 2 + 16 * 2));
        assert_eq!(r.block_events, r.events * 4);
        assert_eq!(r.index_entries_after, 2 * 4 * 2 * 4);
    }
}
