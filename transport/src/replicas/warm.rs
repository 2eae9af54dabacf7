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
//! # Trust
//! With `--replica-secret` the object is the snapshot followed by its MAC ([`super::auth`],
//! bound to the bucket's name); a fetched one is checked before any of it is read, and one
//! without a valid MAC is refused. It carries no secret ([`crate::state`]: worker API keys
//! stay in each replica's configuration), and its size is checked against the object's and
//! [`MAX_SNAPSHOT_BYTES`] while it is read, before it is kept.
//!
//! # Failure
//! No bucket, no object, JetStream off or NATS unreachable: the replica starts cold and says
//! why; a snapshot taken with another core layout is not used (as for a state directory). A
//! put that fails is logged and counted, and the next interval tries again.

use crate::error::{Result, TransportError};
use crate::hub::Hub;
use crate::replicas::ReplicaStats;
use crate::replicas::auth::{self, Kind, ReplicaKey, ReplicaSecret};
use crate::replicas::nats::NatsAccess;
use crate::state::{Loaded, encode_snapshot};
use async_nats::Client;
use async_nats::jetstream::{self, object_store};
use rkyv::util::AlignedVec;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// The object every replica replaces with its latest snapshot.
pub const SNAPSHOT_OBJECT: &str = "latest";

/// The largest snapshot a replica fetches (8 GiB; a 10 M-entry index snapshots to about
/// 280 MB): a larger object is refused before it is read, and a read that goes past the
/// object's stated size stops.
pub const MAX_SNAPSHOT_BYTES: u64 = 8 << 30;

/// The key of the snapshots in `bucket`, if there is a secret.
pub fn snapshot_key(secret: Option<&ReplicaSecret>, bucket: &str) -> Option<ReplicaKey> {
    secret.map(|s| s.key(Kind::Snapshot, bucket))
}

fn err(what: &'static str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Invalid {
        name: "replica snapshot",
        reason: format!("{what}: {e}"),
    }
}

/// Puts `bytes` as the bucket's latest snapshot (the bucket is created if missing), as they
/// are: seal them first with [`snapshot_key`] if the replicas share a secret.
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

/// Takes a snapshot of `hub`, seals it with `key` (if any) and puts it in `bucket`; returns
/// its size. The snapshot is taken on the blocking pool (it waits for every core).
pub async fn put_now(
    hub: &Arc<Hub>,
    client: &Client,
    bucket: &str,
    policy: &str,
    key: Option<&ReplicaKey>,
) -> Result<usize> {
    let (h, p, k) = (hub.clone(), policy.to_owned(), key.cloned());
    let bytes = tokio::task::spawn_blocking(move || {
        // Sealed in place: the tag after the snapshot, without another copy of it.
        let bytes = encode_snapshot(&h, &p).map(|mut b| {
            if let Some(k) = &k {
                let tag = k.tag(&b);
                b.extend_from_slice(&tag);
            }
            b
        });
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
    key: Option<ReplicaKey>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        record(
            &shared.stats,
            put_now(&hub, &client, &bucket, &policy, key.as_ref()).await,
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

/// The bucket's latest object as stored (a snapshot, followed by its MAC if the replicas
/// share a secret), fetched over a connection of its own within `timeout`, at most
/// [`MAX_SNAPSHOT_BYTES`]. `Ok(None)`: there is none yet (no bucket or no object).
pub async fn fetch_raw(
    nats: &NatsAccess,
    bucket: &str,
    timeout: Duration,
) -> Result<Option<AlignedVec>> {
    let work = async {
        let client = nats
            .options()?
            .connect(nats.servers()?)
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
        let size = object.info.size as u64;
        if size > MAX_SNAPSHOT_BYTES {
            return Err(err(
                "refused",
                format!("the object has {size} bytes, more than the {MAX_SNAPSHOT_BYTES} accepted"),
            ));
        }
        read_bounded(&mut object, size).await.map(Some)
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(err("fetch", format!("no answer within {timeout:?}"))),
    }
}

/// Reads `reader` to its end into an aligned buffer, refusing more than `size` bytes (the
/// object's stated size): memory follows the bytes that arrive, never a stated length.
async fn read_bounded(
    reader: &mut (impl tokio::io::AsyncRead + Unpin),
    size: u64,
) -> Result<AlignedVec> {
    let mut buf = AlignedVec::<16>::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = reader
            .read(&mut chunk)
            .await
            .map_err(|e| err("cannot read the snapshot", e))?;
        let Some(got) = chunk.get(..n).filter(|g| !g.is_empty()) else {
            return Ok(buf);
        };
        if (buf.len() + got.len()) as u64 > size {
            return Err(err(
                "refused",
                format!("the object sends more than the {size} bytes it says it has"),
            ));
        }
        buf.extend_from_slice(got);
    }
}

/// The bucket's latest snapshot, fetched with [`fetch_raw`] and checked against the
/// replicas' `secret` (a missing or bad MAC is [`TransportError::ReplicaMac`]) before
/// anything reads it. `Ok(None)`: there is none yet.
pub async fn fetch(
    nats: &NatsAccess,
    bucket: &str,
    secret: Option<&ReplicaSecret>,
    timeout: Duration,
) -> Result<Option<(Loaded, f64)>> {
    let began = Instant::now();
    let Some(mut bytes) = fetch_raw(nats, bucket, timeout).await? else {
        return Ok(None);
    };
    let key = snapshot_key(secret, bucket);
    let payload = auth::open(key.as_ref(), &bytes)?.len();
    // The tag (if any) is the last bytes: the snapshot is what comes before it.
    bytes.resize(payload, 0);
    Ok(Some((
        Loaded::received_aligned(bytes),
        began.elapsed().as_secs_f64(),
    )))
}
