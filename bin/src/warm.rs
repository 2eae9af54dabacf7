//! Starting the engine from a snapshot: a peer replica's (`--replica-nats`, fetched from
//! their object store) or the last one in `--state-dir`; and keeping snapshots there.
//! Wiring only; what a snapshot holds and what a restore keeps is `transport::state`.

use anyhow::{Context, Result};
use engine::snapshot::ArchivedEngineImage;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use transport::hub::Hub;
use transport::state::{Loaded, Plan, StateDir};

/// A run with a state directory.
#[derive(Debug)]
pub struct Warm {
    /// Where snapshots go (`None`: started from a peer's, without a state directory).
    pub dir: Option<StateDir>,
    /// How often one is taken (`None`: only at shutdown).
    pub interval: Option<Duration>,
    /// The sharding policy snapshots are taken under.
    pub policy: String,
    /// What the restore keeps, if the engine started from a snapshot.
    pub plan: Option<Plan>,
    restore_seconds: f64,
}

impl Warm {
    /// Records the restore's figures on the hub's metrics.
    pub fn record(&self, hub: &Hub) {
        if self.plan.is_some() {
            hub.persisted()
                .restore_us
                .store((self.restore_seconds * 1e6) as u64, Relaxed);
        }
    }
}

/// Starts the engine with `start`: from `peer`'s snapshot (a replica's, fetched from NATS:
/// the cluster's latest) or else the one in `state_dir`, where one is usable (same shard
/// count and sharding policy), otherwise cold. A snapshot that cannot be used is never
/// half-used: a file is moved aside (`snapshot.kvs.bad`), a peer's is dropped, each with a
/// warning.
pub fn start_engine<T, E>(
    peer: Option<(Loaded, f64)>,
    state_dir: Option<&Path>,
    interval_s: u64,
    cores: usize,
    policy: &str,
    start: impl Fn(Option<&ArchivedEngineImage>) -> std::result::Result<T, E>,
) -> Result<(T, Option<Warm>)>
where
    E: std::error::Error + Send + Sync + 'static,
{
    if state_dir.is_none() && peer.is_none() {
        return Ok((start(None).context("cannot build the cores")?, None));
    }
    let mut warm = Warm {
        dir: state_dir.map(StateDir::open).transpose()?,
        interval: (interval_s > 0).then(|| Duration::from_secs(interval_s)),
        policy: policy.to_owned(),
        plan: None,
        restore_seconds: 0.0,
    };
    let began = Instant::now();
    let (loaded, source, fetch_seconds) = match (peer, &warm.dir) {
        (Some((l, s)), _) => (Some(l), "a peer replica's snapshot".to_owned(), s),
        (None, Some(dir)) => {
            let l = match dir.load() {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("kvengine: warning: {e}; starting cold");
                    None
                }
            };
            (l, dir.snapshot_path().display().to_string(), 0.0)
        }
        (None, None) => (None, String::new(), 0.0),
    };
    let Some(loaded) = loaded else {
        if let Some(path) = state_dir {
            println!("kvengine: no snapshot in {}; starting cold", path.display());
        }
        return Ok((start(None).context("cannot build the cores")?, Some(warm)));
    };
    let restored = loaded
        .image(cores, policy)
        .map_err(anyhow::Error::from)
        .and_then(|checked| {
            let t = start(Some(checked.image)).map_err(anyhow::Error::from)?;
            Ok((t, checked.plan(), checked.entries()))
        });
    match restored {
        Ok((t, mut plan, entries)) => {
            // Keys come from this router's own files only (a peer's snapshot carries none).
            if let Some(dir) = &warm.dir {
                plan.add_keys(dir.worker_keys());
            }
            warm.restore_seconds = began.elapsed().as_secs_f64() + fetch_seconds;
            println!(
                "kvengine: restored {entries} index entries from {source} ({} MB, read with {}) in {:.3} s",
                loaded.len() >> 20,
                loaded.backend.as_str(),
                warm.restore_seconds
            );
            warm.plan = Some(plan);
            Ok((t, Some(warm)))
        }
        Err(e) => {
            match &warm.dir {
                Some(dir) if loaded.backend != transport::state::file::Backend::Network => {
                    eprintln!(
                        "kvengine: warning: snapshot {source} not used: {e:#}; moved aside, \
                         starting cold"
                    );
                    dir.set_aside();
                }
                _ => eprintln!("kvengine: warning: {source} not used: {e:#}; starting cold"),
            }
            Ok((start(None).context("cannot build the cores")?, Some(warm)))
        }
    }
}
