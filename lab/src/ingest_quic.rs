//! End-to-end ingest over the native protocol: publishers serialize rkyv batches and send
//! them over QUIC on loopback to the server, which validates them in place and hands them
//! to a real engine. Measures block events per second from the first send to the moment
//! every publisher got its `Done` and the engine applied everything (`hub.sync()`).
//!
//! The workload is [`crate::ingest`]'s, with hashed blocks (the protocol's fast path).
//! Hashes are generated in the timed loop into reused event buffers, and every batch is
//! serialized in the timed loop: the publisher's cost is part of the figure.
//!
//! ```text
//! kvengine bench ingest --transport quic --batches 10000
//! ```

use crate::ingest::{IngestConfig, IngestReport, stop};
use anyhow::Result;
use engine::sched::SchedulerConfig;
use std::time::Instant;
use transport::native::{
    NativeBlock, NativeEvent, Publisher, PublisherConfig, QuicServerConfig, TlsSource, Trust,
    serve_quic,
};

/// Overwrites `events` with batch `i`'s stores and removes (buffers reused).
fn fill_batch(events: &mut Vec<NativeEvent>, cfg: &IngestConfig, worker: u64, i: usize) {
    let b = cfg.blocks_per_event;
    let (stored, removed) = cfg.sequences(i);
    let n = stored.clone().count() + removed.clone().map_or(0, |r| r.count());
    events.truncate(n);
    while events.len() < n {
        events.push(NativeEvent::Cleared);
    }
    let block = |s: u64, j: usize| {
        let h = IngestConfig::engine_hash(worker, s, j);
        NativeBlock {
            engine_hash: h,
            tokens_hash: crate::workload::mix64(h ^ 0xA5A5),
        }
    };
    let seqs = stored
        .map(|s| (true, s))
        .chain(removed.into_iter().flatten().map(|s| (false, s)));
    for (ev, (store, s)) in events.iter_mut().zip(seqs) {
        match (store, ev) {
            (true, NativeEvent::Stored { parent, blocks }) => {
                *parent = None;
                blocks.clear();
                blocks.extend((0..b).map(|j| block(s, j)));
            }
            (false, NativeEvent::Removed { blocks }) => {
                blocks.clear();
                blocks.extend((0..b).map(|j| IngestConfig::engine_hash(worker, s, j)));
            }
            (true, ev) => {
                *ev = NativeEvent::Stored {
                    parent: None,
                    blocks: (0..b).map(|j| block(s, j)).collect(),
                };
            }
            (false, ev) => {
                *ev = NativeEvent::Removed {
                    blocks: (0..b)
                        .map(|j| IngestConfig::engine_hash(worker, s, j))
                        .collect(),
                };
            }
        }
    }
}

/// Runs the benchmark (see the module docs).
pub fn run(cfg: &IngestConfig) -> Result<IngestReport> {
    let (hub, runtime, rt) = cfg.start()?;
    let block_size = SchedulerConfig::default().block_size;
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
                instance: 0,
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
        let report = cfg.report("quic", &hub, events, block_events, seconds)?;
        Ok::<_, anyhow::Error>((report, server))
    })?;
    server.close();
    rt.block_on(async {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), server.wait_idle()).await;
    });
    drop(server);
    drop(rt);
    stop(hub, runtime)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_moves_every_block_and_stays_bounded() {
        let cfg = IngestConfig {
            cores: 1,
            workers: 2,
            batches: 20,
            stores_per_batch: 2,
            blocks_per_event: 8,
            window: 4,
            ..IngestConfig::default()
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
