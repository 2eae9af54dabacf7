//! End-to-end ingest over the native protocol: publishers serialize rkyv batches and send
//! them over QUIC on loopback to the server, which validates them in place and hands them
//! to a real engine. Measures block events per second from the first send to the moment
//! every publisher got its `Done` and the engine applied everything (`hub.sync()`).
//!
//! Workload: each of `workers` publishers sends `batches` batches; batch `i` stores
//! `stores_per_batch` new sequences of `blocks_per_event` blocks (distinct pseudo-random
//! hashes, no shared prefixes) and removes the sequences batch `i - window` stored, so the
//! index stays bounded (`index_entries_after` is what the last `window` batches left).
//! Hashes are generated in the timed loop into reused event buffers, and every batch is
//! serialized in the timed loop: the publisher's cost is part of the figure.
//!
//! ```text
//! cargo run --release -p kvengine-benches --example ingest_quic -- --workers 4 --batches 2000
//! ```

use anyhow::{Context, Result};
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use transport::hub::{HubConfig, start_engine};
use transport::native::{
    NativeBlock, NativeEvent, Publisher, PublisherConfig, QuicServerConfig, TlsSource, Trust,
    serve_quic,
};

/// What to run.
#[derive(Clone, Debug)]
pub struct QuicBenchConfig {
    /// Engine cores (shard threads).
    pub cores: usize,
    /// Pin the engine's core threads.
    pub pin_cores: bool,
    /// Blocks shallower than this are replicated in every shard (the server's default is 32).
    pub replicate_depth: u32,
    /// Tokio worker threads (server and publishers share the runtime).
    pub tokio_threads: usize,
    /// Publisher connections, one worker id each.
    pub workers: usize,
    /// Batches per publisher.
    pub batches: usize,
    /// New sequences stored per batch (and as many removed).
    pub stores_per_batch: usize,
    /// Blocks per stored sequence.
    pub blocks_per_event: usize,
    /// A batch removes what the batch this many before it stored.
    pub window: usize,
    /// Engine ring capacity (messages).
    pub ring_capacity: usize,
}

impl Default for QuicBenchConfig {
    fn default() -> Self {
        Self {
            cores: 2,
            pin_cores: false,
            replicate_depth: 32,
            tokio_threads: 2,
            workers: 4,
            batches: 2000,
            stores_per_batch: 16,
            blocks_per_event: 64,
            window: 8,
            ring_capacity: 1024,
        }
    }
}

/// The figures of one run.
#[derive(Clone, Debug, Serialize)]
pub struct IngestReport {
    /// `"quic"`.
    pub transport: String,
    /// Engine cores.
    pub cores: usize,
    /// Publisher connections.
    pub workers: usize,
    /// Batches sent (all publishers).
    pub batches: u64,
    /// KV events sent (stores and removes).
    pub events: u64,
    /// Blocks stored plus blocks removed.
    pub block_events: u64,
    /// Timed seconds.
    pub seconds: f64,
    /// `block_events / seconds`.
    pub block_events_per_s: f64,
    /// Live `(block, worker)` entries afterwards (directory entries over all workers).
    pub index_entries_after: u64,
}

#[inline]
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Engine hash of block `j` of sequence `s` of `worker`.
#[inline]
fn ehash(worker: u64, s: u64, j: usize) -> u64 {
    mix((worker << 48) ^ (s << 8) ^ j as u64)
}

/// Overwrites `events` with batch `i`'s stores and removes (buffers reused).
fn fill_batch(events: &mut Vec<NativeEvent>, cfg: &QuicBenchConfig, worker: u64, i: usize) {
    let s_per = cfg.stores_per_batch;
    let b = cfg.blocks_per_event;
    let removing = i >= cfg.window;
    let n = s_per + if removing { s_per } else { 0 };
    events.truncate(n);
    while events.len() < n {
        events.push(NativeEvent::Cleared);
    }
    for (k, ev) in events.iter_mut().enumerate() {
        let store = k < s_per;
        let seq_id = if store {
            (i * s_per + k) as u64
        } else {
            ((i - cfg.window) * s_per + (k - s_per)) as u64
        };
        match (store, ev) {
            (true, NativeEvent::Stored { parent, blocks }) => {
                *parent = None;
                blocks.clear();
                blocks.extend((0..b).map(|j| {
                    let h = ehash(worker, seq_id, j);
                    NativeBlock {
                        engine_hash: h,
                        tokens_hash: mix(h ^ 0xA5A5),
                    }
                }));
            }
            (false, NativeEvent::Removed { blocks }) => {
                blocks.clear();
                blocks.extend((0..b).map(|j| ehash(worker, seq_id, j)));
            }
            (true, ev) => {
                *ev = NativeEvent::Stored {
                    parent: None,
                    blocks: (0..b)
                        .map(|j| {
                            let h = ehash(worker, seq_id, j);
                            NativeBlock {
                                engine_hash: h,
                                tokens_hash: mix(h ^ 0xA5A5),
                            }
                        })
                        .collect(),
                };
            }
            (false, ev) => {
                *ev = NativeEvent::Removed {
                    blocks: (0..b).map(|j| ehash(worker, seq_id, j)).collect(),
                };
            }
        }
    }
}

/// Runs the benchmark (see the module docs).
pub fn run(cfg: &QuicBenchConfig) -> Result<IngestReport> {
    anyhow::ensure!(
        cfg.workers > 0 && cfg.batches > 0,
        "workers and batches must be > 0"
    );
    anyhow::ensure!(
        cfg.stores_per_batch > 0 && cfg.blocks_per_event > 0,
        "empty batches"
    );
    let scheduler = SchedulerConfig::default();
    let block_size = scheduler.block_size;
    let engine_cfg = RuntimeConfig {
        ring_capacity: cfg.ring_capacity,
        pin_cores: cfg.pin_cores,
        ingest_handles: cfg.cores.max(1),
        query_handles: 1,
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

    let (report, server) = rt.block_on(async {
        let token = "bench-token".to_string();
        let tls = TlsSource::SelfSigned {
            names: vec!["localhost".into()],
        };
        let server_cfg = QuicServerConfig::new("127.0.0.1:0".parse()?, token.clone(), tls);
        let server = serve_quic(hub.clone(), server_cfg).await?;
        let mut publishers = Vec::with_capacity(cfg.workers);
        for w in 0..cfg.workers {
            let p = Publisher::connect(PublisherConfig {
                server: server.local_addr(),
                server_name: "localhost".into(),
                trust: Trust::Fingerprint(server.fingerprint().to_owned()),
                token: token.clone(),
                worker_id: w as u64 + 1,
                dp_ranks: vec![0],
                block_size,
            })
            .await?;
            publishers.push(p);
        }

        let start = Instant::now();
        let mut tasks = Vec::with_capacity(cfg.workers);
        for (w, mut p) in publishers.into_iter().enumerate() {
            let cfg = cfg.clone();
            tasks.push(tokio::spawn(async move {
                let worker = w as u64 + 1;
                let mut events = Vec::new();
                let (mut sent_events, mut blocks) = (0u64, 0u64);
                for i in 0..cfg.batches {
                    fill_batch(&mut events, &cfg, worker, i);
                    sent_events += events.len() as u64;
                    blocks += events.iter().map(|e| e.block_count() as u64).sum::<u64>();
                    p.send(0, &events).await?;
                }
                let done = p.finish().await?;
                anyhow::ensure!(
                    done.events == sent_events,
                    "server handled {} of {sent_events} events",
                    done.events
                );
                Ok::<_, anyhow::Error>((sent_events, blocks))
            }));
        }
        let (mut events, mut block_events) = (0u64, 0u64);
        for t in tasks {
            let (e, b) = t.await??;
            events += e;
            block_events += b;
        }
        let hub2 = hub.clone();
        tokio::task::spawn_blocking(move || hub2.sync()).await??;
        let seconds = start.elapsed().as_secs_f64();

        let stats = hub.core_stats()?;
        let index_entries_after = stats.iter().map(|s| s.directory_entries as u64).sum();
        let rejects: u64 = stats
            .iter()
            .flat_map(|s| engine::RejectReason::ALL.map(|r| s.rejects.get(r)))
            .sum();
        anyhow::ensure!(rejects == 0, "the engine refused {rejects} events");
        let report = IngestReport {
            transport: "quic".into(),
            cores: cfg.cores,
            workers: cfg.workers,
            batches: (cfg.workers * cfg.batches) as u64,
            events,
            block_events,
            seconds,
            block_events_per_s: crate::report::rate(block_events, seconds),
            index_entries_after,
        };
        Ok::<_, anyhow::Error>((report, server))
    })?;
    server.close();
    rt.block_on(async {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), server.wait_idle()).await;
    });
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
        let cfg = QuicBenchConfig {
            cores: 1,
            workers: 2,
            batches: 20,
            stores_per_batch: 2,
            blocks_per_event: 8,
            window: 4,
            ..QuicBenchConfig::default()
        };
        let r = run(&cfg).unwrap();
        assert_eq!(r.batches, 40);
        // 20 batches of 2 stores, 16 of them also with 2 removes; 8 blocks each.
        assert_eq!(r.events, 2 * (20 * 2 + 16 * 2));
        assert_eq!(r.block_events, r.events * 8);
        assert_eq!(r.index_entries_after, 2 * 4 * 2 * 8);
        assert!(r.block_events_per_s > 0.0);
    }
}
