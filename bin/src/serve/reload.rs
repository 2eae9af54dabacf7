//! The config file's workers: registered at start, and again on SIGHUP or when the file
//! changes (new ones added, changed ones updated, those gone removed).

use anyhow::Result;
use engine::WorkerId;
#[cfg(unix)]
use engine::router::ModelSpec;
use std::path::Path;
#[cfg(unix)]
use std::path::PathBuf;
#[cfg(unix)]
use std::sync::Arc;
use std::time::Duration;
#[cfg(unix)]
use transport::cores::{self, Homes};
use transport::hub::{Hub, Registration};
use transport::sources::Sources;
use transport::zmq::ZmqSource;

/// Registers (or updates) the config file's workers and subscribes to their events. An
/// update keeps the worker's indexed blocks; a changed publisher replaces its subscription.
pub(super) fn register_file_workers(
    hub: &Hub,
    sources: &Sources,
    workers: &[crate::config_file::WorkerEntry],
) -> Result<()> {
    for w in workers {
        let id = WorkerId(w.id);
        let endpoints = w.endpoints()?;
        let role = w
            .role
            .as_deref()
            .map(str::parse::<engine::sched::WorkerRole>)
            .transpose()
            .map_err(|e| anyhow::anyhow!("worker {}: role: {e}", w.id))?;
        hub.register(Registration {
            url: w.url.clone(),
            zmq: endpoints.as_ref().map(|(z, _)| z.clone()),
            replay: endpoints.as_ref().and_then(|(_, r)| r.clone()),
            dp_ranks: w.dp_ranks.iter().copied().map(engine::DpRank).collect(),
            role,
            api_key: w.api_key.clone(),
            model: w.model.clone(),
            trtllm_poll: w.trtllm_source()?.map(|s| s.poll_interval),
            ..Registration::new(id)
        })?;
        if let Some(source) = w.trtllm_source()? {
            println!(
                "kvengine: worker {} from the config file, KV events polled from {}",
                w.id,
                source.events_url()
            );
            sources.stop_except(id, &source.events_url());
            sources.poll(source);
            continue;
        }
        match &endpoints {
            Some((zmq, _)) => println!(
                "kvengine: worker {} from the config file, KV events from {zmq}",
                w.id
            ),
            None => println!("kvengine: worker {} from the config file", w.id),
        }
        match endpoints {
            Some((zmq, replay)) => {
                sources.stop_except(id, &zmq);
                sources
                    .subscribe(ZmqSource::new(id, &zmq, replay.as_deref())?.with_topic(w.topic()?));
            }
            None => sources.stop(id),
        }
    }
    Ok(())
}

/// How often the config file is checked for changes (a Kubernetes ConfigMap update swaps
/// the mounted file; no signal comes with it).
pub(super) const CONFIG_POLL: Duration = Duration::from_secs(2);

/// What tells a changed config file from the one last read: its size and modification time
/// (`None` while it cannot be read).
pub(super) fn file_stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()?))
}

/// On SIGHUP, or when the file changes, reads the config file's workers and models again:
/// new models get their pools, new and changed workers are registered, those gone from the
/// file are removed; everyone else keeps its index and subscription. A file that does not
/// load changes nothing (logged). `stamp` is the file's as of before it was first read, so
/// a change made while the router was starting is not missed.
#[cfg(unix)]
#[allow(clippy::too_many_arguments)] // the reload task's whole state, moved in once
pub(super) async fn reload_on_sighup(
    path: PathBuf,
    mut stamp: Option<(u64, std::time::SystemTime)>,
    mut known: std::collections::BTreeSet<u64>,
    hub: Arc<Hub>,
    sources: Arc<Sources>,
    spawner: Homes,
    mut hup: Option<tokio::signal::unix::Signal>,
) {
    let mut poll = tokio::time::interval(CONFIG_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let signalled = async {
            match hup.as_mut() {
                Some(h) => h.recv().await.is_some(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            alive = signalled => {
                if !alive {
                    hup = None;
                    continue;
                }
                // What is read now needs no second reload when the poll sees the change.
                stamp = file_stamp(&path);
            }
            _ = poll.tick() => {
                let now = file_stamp(&path);
                if now == stamp {
                    continue;
                }
                stamp = now;
                println!("kvengine: {} changed", path.display());
            }
        }
        let workers = match crate::config_file::load(&path) {
            Ok(f) => {
                // New models get their pools now; a model's tokenizer is read at start only.
                let declared = f.models.iter().try_for_each(|m| {
                    hub.declare_model(&ModelSpec {
                        name: m.name.clone(),
                        block_size: m.block_size,
                    })
                });
                if let Err(e) = declared {
                    tracing::error!("reloading {}: {e}; workers unchanged", path.display());
                    continue;
                }
                f.workers
            }
            Err(e) => {
                tracing::error!("reloading {}: {e:#}; workers unchanged", path.display());
                continue;
            }
        };
        if let Err(e) = register_file_workers(&hub, &sources, &workers) {
            tracing::error!("reloading {}: {e:#}", path.display());
            continue;
        }
        let now: std::collections::BTreeSet<u64> = workers.iter().map(|w| w.id).collect();
        for &gone in known.difference(&now) {
            // On its home core, streams first: none of its batches lands after it
            // (transport::cores::on_home).
            let (hub, sources) = (hub.clone(), sources.clone());
            let removed = cores::on_home(Some(&spawner), WorkerId(gone), move || {
                sources.stop(WorkerId(gone));
                hub.remove_worker(WorkerId(gone))
            })
            .await;
            match removed {
                Some(Ok(_)) => println!("kvengine: worker {gone} left the config file; removed"),
                Some(Err(e)) => tracing::error!("removing worker {gone}: {e}"),
                None => tracing::error!("removing worker {gone}: the router is stopping"),
            }
        }
        println!(
            "kvengine: reloaded {} worker(s) from {}",
            now.len(),
            path.display()
        );
        known = now;
    }
}
