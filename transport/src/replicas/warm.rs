//! Warm start from peers: replicas put snapshots (the `--state-dir` file format,
//! [`crate::state`]) in a JetStream object store; a replica that starts fetches the latest
//! one, restores its cores from it, and each worker's subscription then replays from the
//! snapshot's mark, exactly as after a restart from its own state directory. So a new
//! replica serves at full accuracy within seconds, not after the caches churn.
//!
//! One object, [`SNAPSHOT_OBJECT`], in the bucket: every replica replaces it on its own
//! interval (they index the same workers, so any of them is a good start), and the object
//! store drops the chunks of the one replaced.
//!
//! # Failure
//! No bucket, no object, JetStream off or NATS unreachable: the replica starts cold and says
//! why; a snapshot taken with another core layout is not used (as for a state directory). A
//! put that fails is logged and counted, and the next interval tries again.

use crate::error::{Result, TransportError};
use crate::hub::Hub;
use crate::replicas::ReplicaStats;
use crate::state::{Loaded, encode_snapshot};
use async_nats::Client;
use async_nats::jetstream::{self, object_store};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// The object every replica replaces with its latest snapshot.
pub const SNAPSHOT_OBJECT: &str = "latest";

fn err(what: &'static str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Invalid {
        name: "replica snapshot",
        reason: format!("{what}: {e}"),
    }
}

/// Puts `bytes` as the bucket's latest snapshot (the bucket is created if missing).
pub async fn put(client: &Client, bucket: &str, bytes: &[u8]) -> Result<()> {
    let js = jetstream::new(client.clone());
    let store = js
        .create_object_store(object_store::Config {
            bucket: bucket.to_owned(),
            description: Some("kvengine router snapshots (the latest one)".into()),
            ..Default::default()
        })
        .await
        .map_err(|e| err("cannot open the bucket (is JetStream on?)", e))?;
    let mut reader = bytes;
    store
        .put(SNAPSHOT_OBJECT, &mut reader)
        .await
        .map_err(|e| err("cannot put the snapshot", e))?;
    Ok(())
}

/// Takes a snapshot of `hub` and puts it in `bucket`; returns its size. The snapshot is
/// taken on the blocking pool (it waits for every core).
pub async fn put_now(hub: &Arc<Hub>, client: &Client, bucket: &str, policy: &str) -> Result<usize> {
    let (h, p) = (hub.clone(), policy.to_owned());
    let bytes = tokio::task::spawn_blocking(move || {
        let bytes = encode_snapshot(&h, &p);
        crate::cores::request_memory_release();
        bytes
    })
    .await
    .map_err(|e| err("snapshot task", e))??;
    put(client, bucket, &bytes).await?;
    Ok(bytes.len())
}

/// Puts a snapshot every `interval` until the task is dropped; counts each outcome.
pub async fn put_every(
    hub: Arc<Hub>,
    client: Client,
    bucket: String,
    policy: String,
    interval: Duration,
    shared: Arc<crate::replicas::outbox::Shared>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        record(
            &shared.stats,
            put_now(&hub, &client, &bucket, &policy).await,
        );
    }
}

fn record(stats: &ReplicaStats, outcome: Result<usize>) {
    match outcome {
        Ok(bytes) => {
            stats.snapshots_put.fetch_add(1, Relaxed);
            tracing::info!(bytes, "snapshot put in the replicas' object store");
        }
        Err(e) => {
            stats.snapshot_failures.fetch_add(1, Relaxed);
            tracing::warn!("replica snapshot not put: {e}");
        }
    }
}

/// The bucket's latest snapshot, fetched over a connection of its own within `timeout`.
/// `Ok(None)`: there is none yet (no bucket or no object).
pub async fn fetch(url: &str, bucket: &str, timeout: Duration) -> Result<Option<(Loaded, f64)>> {
    let began = Instant::now();
    let work = async {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| err("cannot reach NATS", e))?;
        let js = jetstream::new(client);
        let Ok(store) = js.get_object_store(bucket).await else {
            return Ok(None);
        };
        let mut object = match store.get(SNAPSHOT_OBJECT).await {
            Ok(o) => o,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err("cannot get the snapshot", e)),
        };
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| err("cannot read the snapshot", e))?;
        Ok(Some(Loaded::received(&bytes)))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r.map(|o| o.map(|l| (l, began.elapsed().as_secs_f64()))),
        Err(_) => Err(err("fetch", format!("no answer within {timeout:?}"))),
    }
}
