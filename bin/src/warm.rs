//! `--state-dir`: starting the engine from the last snapshot, and keeping snapshots.
//! Wiring only; what a snapshot holds and what a restore keeps is `transport::state`.

use anyhow::{Context, Result};
use engine::snapshot::ArchivedEngineImage;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use transport::hub::Hub;
use transport::state::{Plan, StateDir};

/// A run with a state directory.
#[derive(Debug)]
pub struct Warm {
    /// Where snapshots go.
    pub dir: StateDir,
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

/// Starts the engine with `start`: from the snapshot in `state_dir` where there is a usable
/// one (same shard count and sharding policy), otherwise cold. A snapshot that cannot be
/// used is moved aside (`snapshot.kvs.bad`) with a warning, never half-used.
pub fn start_engine<T, E>(
    state_dir: Option<&Path>,
    interval_s: u64,
    cores: usize,
    policy: &str,
    start: impl Fn(Option<&ArchivedEngineImage>) -> std::result::Result<T, E>,
) -> Result<(T, Option<Warm>)>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let Some(path) = state_dir else {
        return Ok((start(None).context("cannot build the cores")?, None));
    };
    let dir = StateDir::open(path)?;
    let mut warm = Warm {
        dir,
        interval: (interval_s > 0).then(|| Duration::from_secs(interval_s)),
        policy: policy.to_owned(),
        plan: None,
        restore_seconds: 0.0,
    };
    let began = Instant::now();
    let loaded = match warm.dir.load() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvengine: warning: {e}; starting cold");
            None
        }
    };
    let Some(loaded) = loaded else {
        println!("kvengine: no snapshot in {}; starting cold", path.display());
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
        Ok((t, plan, entries)) => {
            warm.restore_seconds = began.elapsed().as_secs_f64();
            println!(
                "kvengine: restored {entries} index entries from {} ({} MB, read with {}) in {:.3} s",
                warm.dir.snapshot_path().display(),
                loaded.len() >> 20,
                loaded.backend.as_str(),
                warm.restore_seconds
            );
            warm.plan = Some(plan);
            Ok((t, Some(warm)))
        }
        Err(e) => {
            eprintln!(
                "kvengine: warning: snapshot {} not used: {e:#}; moved aside, starting cold",
                warm.dir.snapshot_path().display()
            );
            warm.dir.set_aside();
            Ok((start(None).context("cannot build the cores")?, Some(warm)))
        }
    }
}
