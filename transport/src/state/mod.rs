//! Warm restarts (`--state-dir`): the engine's snapshot and the API-registered workers in
//! one file, written in the background and at shutdown, restored at start.
//!
//! Taking a snapshot: the engine cuts every core consistently (`engine::snapshot`); the
//! cut carries, per worker, the number and the digest of the last batch of its ZMQ stream
//! that is in it (its *mark*). The transport adds the workers registered over the API (their
//! registrations, as JSON) and writes the file atomically ([`mod@file`], io_uring on Linux).
//!
//! Secrets stay out of snapshots (the same bytes go to peer replicas, [`crate::replicas`]):
//! the API workers' keys are written beside the snapshot, in [`KEYS_FILE`] (owner-only, like
//! the snapshot), and only this router's own file gives a restored worker its key. A worker
//! learnt from a peer's snapshot gets its key from this router's configuration (which wins
//! for any worker it names) or its own key file, or goes without one.
//!
//! Restoring: the cores are rebuilt from the image (rayon, one task per core), then
//! [`begin_restore`] and [`finish_restore`] decide, worker by worker, what may be kept:
//! * a worker that is no longer registered (neither configured nor in the snapshot's API
//!   registrations) is forgotten;
//! * a worker whose stream has a mark keeps its blocks but is not trusted from the
//!   snapshot alone: its ranks are distrusted ([`Hub::distrust`]: shown resyncing, routed
//!   as uncached) from the restore on. Its subscriber asks the publisher's replay socket for
//!   the batches from the mark on: if the first is the marked batch itself (same number,
//!   same digest), the publisher is the process the snapshot saw, the rest is catch-up and
//!   the blocks are trusted again (exact). Otherwise (another batch, none, a timeout, no
//!   replay socket, a mark without digest) the worker is cleared and counted (a restart,
//!   or a resync when the publisher's history cannot be replayed from 0), exactly as for a
//!   reconnection while running (`crate::stream`);
//! * a worker without a mark (its events came over QUIC or HTTP, whose numbering does not
//!   survive a restart) is cleared and counted: what it holds now cannot be known;
//! * a registration the snapshot holds is checked as `POST /v1/workers` checks one: its
//!   hosts against `--worker-hosts`, its fields as the hub takes them. One that fails is
//!   refused, logged and counted, and the restore goes on without it.
//!
//! So after a restart no stale entry is ever a hit, and nothing acknowledged is lost where
//! the publisher's replay buffer still holds the marked batch and what came after it.
//! Snapshots of format 1 (marks without digest) restore with every ZMQ worker cleared and
//! resynced.
//!
//! # Invariants
//! 1. A restored worker keeps its blocks only if its subscriber resumes from its mark, and
//!    they count in routing only once its stream proved continuity (a replayed batch equal
//!    to the mark) or a batch of its applied.
//! 2. [`Persisted::take_resume`] hands each worker's resume point out once: a
//!    re-subscription after a config reload starts fresh, like any new subscription.
//! 3. A snapshot's bytes never hold a worker's API key; nothing in a snapshot received from
//!    a peer sets one.
//! 4. Every count or length read from a snapshot is checked against the bytes that back it
//!    before anything is allocated or looped over for it (`engine::snapshot`, and the JSON
//!    meta parsed as it comes), so a crafted file is refused in time linear in its size.
//!
//! # Concurrency
//! [`Persisted`] is shared by every thread through the hub (a mutex per table, taken once
//! per subscription or registration, never on the per-batch path).

pub mod file;

use crate::error::{Result, TransportError};
use crate::hub::{Hub, Registration};
pub use crate::hub::{Persisted, Resume};
use engine::sched::WorkerRole;
use engine::snapshot::{self, ArchivedEngineImage};
use engine::{DpRank, WorkerId};
use rkyv::util::AlignedVec;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// The snapshot's file name inside the state directory.
pub const SNAPSHOT_FILE: &str = "snapshot.kvs";
/// The API workers' keys, beside the snapshot (invariant 3): JSON `{"version": 1, "keys":
/// {"<worker id>": "<key>"}}`, owner-only.
pub const KEYS_FILE: &str = "worker-keys.json";
/// Version of the JSON the transport keeps in a snapshot's meta bytes.
const META_VERSION: u32 = 1;

/// A registration as the snapshot keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SavedWorker {
    worker_id: u64,
    dp_ranks: Vec<u32>,
    url: Option<String>,
    zmq: Option<String>,
    replay: Option<String>,
    role: Option<String>,
    bootstrap_port: Option<u16>,
    /// Never written (invariant 3); snapshots of older builds hold it, and only this
    /// router's own file is believed ([`Plan`]).
    #[serde(default, skip_serializing)]
    api_key: Option<String>,
    model: Option<String>,
    /// A TensorRT-LLM worker's poll interval (absent in older snapshots).
    #[serde(default)]
    trtllm_poll_ms: Option<u64>,
}

impl SavedWorker {
    fn of(r: &Registration) -> Self {
        Self {
            worker_id: r.worker.0,
            dp_ranks: r.dp_ranks.iter().map(|d| d.0).collect(),
            url: r.url.clone(),
            zmq: r.zmq.clone(),
            replay: r.replay.clone(),
            role: r.role.map(|x| x.as_str().to_owned()),
            bootstrap_port: r.bootstrap_port,
            api_key: None,
            model: r.model.clone(),
            trtllm_poll_ms: r
                .trtllm_poll
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// The registration, without a key (the caller gives it the one it trusts).
    fn registration(&self) -> Result<Registration> {
        let role = match &self.role {
            None => None,
            Some(s) => Some(
                s.parse::<WorkerRole>()
                    .map_err(|e| TransportError::Invalid {
                        name: "snapshot worker role",
                        reason: e.to_string(),
                    })?,
            ),
        };
        Ok(Registration {
            worker: WorkerId(self.worker_id),
            dp_ranks: self.dp_ranks.iter().copied().map(DpRank).collect(),
            url: self.url.clone(),
            zmq: self.zmq.clone(),
            replay: self.replay.clone(),
            role,
            bootstrap_port: self.bootstrap_port,
            api_key: None,
            model: self.model.clone(),
            trtllm_poll: self.trtllm_poll_ms.map(std::time::Duration::from_millis),
        })
    }
}

/// The transport's part of a snapshot.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Meta {
    version: u32,
    /// Milliseconds since the Unix epoch when it was taken.
    taken_unix_ms: u64,
    /// The sharding policy it was taken under (routes mean something only under it).
    policy: String,
    workers: Vec<SavedWorker>,
}

/// The content of [`KEYS_FILE`].
#[derive(Debug, Default, Serialize, Deserialize)]
struct KeysFile {
    version: u32,
    keys: BTreeMap<u64, String>,
}

fn io_err(context: &str, e: std::io::Error) -> TransportError {
    TransportError::Io {
        context: context.to_owned(),
        source: e,
    }
}

/// The state directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    dir: PathBuf,
}

/// What one snapshot took.
#[derive(Clone, Copy, Debug)]
pub struct Written {
    /// File bytes.
    pub bytes: usize,
    /// Seconds from asking the engine to the file being renamed into place.
    pub seconds: f64,
    /// Which I/O path wrote it.
    pub backend: file::Backend,
}

impl StateDir {
    /// `dir`, created if missing.
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io_err("--state-dir", e))?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// The snapshot file.
    pub fn snapshot_path(&self) -> PathBuf {
        self.dir.join(SNAPSHOT_FILE)
    }

    /// The API workers' keys file ([`KEYS_FILE`]).
    pub fn keys_path(&self) -> PathBuf {
        self.dir.join(KEYS_FILE)
    }

    /// Writes the keys of `hub`'s API workers to [`KEYS_FILE`] (atomically, owner-only);
    /// with none, removes the file.
    fn save_keys(&self, hub: &Hub) -> Result<()> {
        let api = hub.persisted().api_workers();
        let keys: BTreeMap<u64, String> = hub
            .workers()
            .into_iter()
            .filter(|w| api.contains(&w.registration.worker))
            .filter_map(|w| Some((w.registration.worker.0, w.registration.api_key?)))
            .collect();
        let path = self.keys_path();
        if keys.is_empty() {
            return match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(io_err("removing the worker keys file", e))
                }
                _ => Ok(()),
            };
        }
        let json = serde_json::to_vec(&KeysFile { version: 1, keys }).map_err(|e| {
            TransportError::Invalid {
                name: "worker keys",
                reason: e.to_string(),
            }
        })?;
        file::write_atomic(&path, json).map_err(|e| io_err("writing the worker keys", e))?;
        Ok(())
    }

    /// The API workers' keys this router saved ([`KEYS_FILE`]); none if there is no file,
    /// and none (with a warning) if it cannot be read.
    pub fn worker_keys(&self) -> BTreeMap<WorkerId, String> {
        let path = self.keys_path();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
            Err(e) => {
                tracing::warn!(
                    "cannot read {}: {e}; restored workers get no key",
                    path.display()
                );
                return BTreeMap::new();
            }
        };
        match serde_json::from_slice::<KeysFile>(&bytes) {
            Ok(f) if f.version == 1 => f.keys.into_iter().map(|(w, k)| (WorkerId(w), k)).collect(),
            Ok(f) => {
                tracing::warn!(
                    "{}: version {}; restored workers get no key",
                    path.display(),
                    f.version
                );
                BTreeMap::new()
            }
            Err(e) => {
                tracing::warn!("{}: {e}; restored workers get no key", path.display());
                BTreeMap::new()
            }
        }
    }

    /// Takes a snapshot of `hub`'s engine (taken under the sharding `policy`) and writes
    /// it. Blocking: run it on a thread that is not a core's (see
    /// [`Hub::snapshot_engine`]).
    pub fn save(&self, hub: &Hub, policy: &str) -> Result<Written> {
        let started = Instant::now();
        let result = self.save_inner(hub, policy, started);
        let p = hub.persisted();
        match &result {
            Ok(w) => {
                p.snapshots.fetch_add(1, Relaxed);
                p.last_snapshot_us.store((w.seconds * 1e6) as u64, Relaxed);
                p.last_snapshot_bytes.store(w.bytes as u64, Relaxed);
            }
            Err(e) => {
                p.snapshot_failures.fetch_add(1, Relaxed);
                tracing::warn!("snapshot failed: {e}");
            }
        }
        result
    }

    fn save_inner(&self, hub: &Hub, policy: &str, started: Instant) -> Result<Written> {
        // The keys first: a snapshot on disk never names a worker whose key was lost.
        self.save_keys(hub)?;
        let bytes = encode_snapshot(hub, policy)?;
        let len = bytes.len();
        let backend = file::write_atomic(&self.snapshot_path(), bytes)
            .map_err(|e| io_err("writing the snapshot", e))?;
        Ok(Written {
            bytes: len,
            seconds: started.elapsed().as_secs_f64(),
            backend,
        })
    }

    /// Reads the snapshot file, if there is one. A file that cannot be read is an error;
    /// its contents are checked by [`Loaded::image`].
    pub fn load(&self) -> Result<Option<Loaded>> {
        let path = self.snapshot_path();
        match file::read(&path) {
            Ok((bytes, backend)) => Ok(Some(Loaded::upgraded(bytes, backend))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("reading the snapshot", e)),
        }
    }

    /// Moves an unusable snapshot aside (kept for inspection, never read again).
    pub fn set_aside(&self) {
        let path = self.snapshot_path();
        let _ = std::fs::rename(&path, path.with_extension("kvs.bad"));
    }
}

/// A snapshot of `hub`'s engine (taken under the sharding `policy`) and its API workers, as
/// the bytes of a snapshot file (what [`StateDir::save`] writes and peer replicas put in
/// their object store). Blocking: run it on a thread that is not a core's (see
/// [`Hub::snapshot_engine`]).
pub fn encode_snapshot(hub: &Hub, policy: &str) -> Result<AlignedVec> {
    let mut image = hub.snapshot_engine()?;
    image.policy = policy.to_owned();
    let registrations = hub.workers();
    let api = hub.persisted().api_workers();
    let meta = Meta {
        version: META_VERSION,
        taken_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        policy: policy.to_owned(),
        workers: registrations
            .iter()
            .filter(|w| api.contains(&w.registration.worker))
            .map(|w| SavedWorker::of(&w.registration))
            .collect(),
    };
    let meta = serde_json::to_vec(&meta).map_err(|e| TransportError::Invalid {
        name: "snapshot meta",
        reason: e.to_string(),
    })?;
    Ok(snapshot::encode(&image, &meta)?)
}

/// A snapshot file read into memory.
#[derive(Debug)]
pub struct Loaded {
    bytes: AlignedVec,
    /// Which I/O path read it.
    pub backend: file::Backend,
}

/// A checked snapshot: the engine image (read in place) and the transport's part.
pub struct Checked<'a> {
    /// The engine image, to start the cores from.
    pub image: &'a ArchivedEngineImage,
    meta: Meta,
    /// Received from a peer replica (nothing in it sets a key, invariant 3).
    from_peer: bool,
}

impl std::fmt::Debug for Checked<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked")
            .field("cores", &self.image.cores.len())
            .field("meta", &self.meta)
            .finish()
    }
}

impl Loaded {
    /// A snapshot received whole from elsewhere (a peer replica's, from NATS, its MAC
    /// checked and removed), copied into an aligned buffer.
    pub fn received(bytes: &[u8]) -> Self {
        let mut aligned = AlignedVec::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        Self::received_aligned(aligned)
    }

    /// [`Loaded::received`], already in an aligned buffer (no copy).
    pub fn received_aligned(bytes: AlignedVec) -> Self {
        Self::upgraded(bytes, file::Backend::Network)
    }

    /// A file as read, rewritten in the current format if it is an older one (its marks
    /// then carry no digest: the workers are cleared and resynced on restore). A file that
    /// does not upgrade is kept as read, for [`Loaded::image`] to refuse.
    fn upgraded(bytes: AlignedVec, backend: file::Backend) -> Self {
        match snapshot::upgrade(&bytes) {
            Ok(Some(new)) => {
                tracing::info!(
                    "snapshot of an older format: restoring it with its streams unverified"
                );
                Self {
                    bytes: new,
                    backend,
                }
            }
            Ok(None) | Err(_) => Self { bytes, backend },
        }
    }

    /// File bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Checks the file (checksum, version, archive) and that it was taken with `shards`
    /// shards under the sharding `policy`.
    pub fn image(&self, shards: usize, policy: &str) -> Result<Checked<'_>> {
        let (image, meta) = snapshot::decode(&self.bytes)?;
        let meta: Meta = serde_json::from_slice(meta).map_err(|e| TransportError::Invalid {
            name: "snapshot meta",
            reason: e.to_string(),
        })?;
        let bad = |reason: String| TransportError::Invalid {
            name: "snapshot",
            reason,
        };
        if meta.version != META_VERSION {
            return Err(bad(format!("meta version {}", meta.version)));
        }
        if image.shards.to_native() as usize != shards || meta.policy != policy {
            return Err(bad(format!(
                "taken with {} shards and sharding \"{}\"; this run has {shards} and \"{policy}\" \
                 (start with the same --cores and sharding flags to restore it)",
                image.shards.to_native(),
                meta.policy
            )));
        }
        Ok(Checked {
            image,
            meta,
            from_peer: self.backend == file::Backend::Network,
        })
    }
}

/// What a restore keeps from a checked snapshot once the cores are rebuilt: the stream
/// marks, the ranks with blocks, and the API registrations (owned, so the file's buffer
/// can go).
#[derive(Debug, Default)]
pub struct Plan {
    marks: BTreeMap<WorkerId, (u64, Option<u64>)>,
    ranks: BTreeMap<WorkerId, BTreeSet<DpRank>>,
    workers: Vec<SavedWorker>,
    /// The keys the registrations get (this router's own, invariant 3).
    keys: BTreeMap<WorkerId, String>,
}

impl Plan {
    /// Gives the restored registrations this router's own keys ([`StateDir::worker_keys`]),
    /// over any a snapshot of an older build of its own held.
    pub fn add_keys(&mut self, keys: BTreeMap<WorkerId, String>) {
        self.keys.extend(keys);
    }
}

impl Checked<'_> {
    /// `(block, worker key)` entries in the image's shards (trunk blocks once per shard).
    pub fn entries(&self) -> u64 {
        self.image
            .cores
            .iter()
            .flat_map(|c| c.nodes.iter())
            .map(|n| u64::from(n.len.to_native()) * u64::from(n.holders.to_native()))
            .fold(0u64, u64::saturating_add)
    }

    /// What [`begin_restore`] and [`finish_restore`] need.
    pub fn plan(&self) -> Plan {
        let mut plan = Plan {
            workers: self.meta.workers.clone(),
            ..Plan::default()
        };
        if !self.from_peer {
            // This router's own file, written by an older build: its keys are its own.
            for w in &plan.workers {
                if let Some(k) = &w.api_key {
                    plan.keys.insert(WorkerId(w.worker_id), k.clone());
                }
            }
        }
        for core in self.image.cores.iter() {
            for m in core.marks.iter() {
                if m.stream.to_native() == 0 {
                    let digest = m.digest.as_ref().map(|d| d.to_native());
                    plan.marks
                        .insert(WorkerId(m.worker.to_native()), (m.seq.to_native(), digest));
                }
            }
            for k in core.keys.iter() {
                plan.ranks
                    .entry(WorkerId(k.worker.to_native()))
                    .or_default()
                    .insert(DpRank(k.rank.to_native()));
            }
        }
        plan
    }
}

/// What a restore did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// API registrations re-registered.
    pub registered: usize,
    /// Workers whose blocks are kept (their streams resume from their marks).
    pub kept: usize,
    /// Workers cleared (no resumable stream, or not registered).
    pub cleared: usize,
    /// Registrations the snapshot held that were refused (a host outside `--worker-hosts`,
    /// or a registration the hub does not take); logged.
    pub refused: usize,
}

/// First half of a restore, right after the cores were started from the snapshot and
/// before any subscription starts (or anything routes): every worker without a mark is
/// cleared (its blocks came over QUIC or HTTP, whose numbering does not survive a
/// restart), and every marked worker gets its resume point and its ranks are distrusted
/// until its stream proves continuity (invariant 1).
pub fn begin_restore(hub: &Hub, plan: &Plan) -> Result<Restored> {
    let mut out = Restored::default();
    for &worker in plan.ranks.keys() {
        if plan.marks.contains_key(&worker) {
            continue;
        }
        hub.forget_index(worker)?;
        out.cleared += 1;
        tracing::info!(worker = %worker,
            "restored blocks dropped: its events do not come over a stream that can resume (ZMQ)");
    }
    for (&worker, &(last_seq, last_digest)) in &plan.marks {
        let ranks: Vec<DpRank> = plan
            .ranks
            .get(&worker)
            .map_or_else(Vec::new, |r| r.iter().copied().collect());
        for &dp_rank in &ranks {
            hub.distrust(engine::WorkerKey { worker, dp_rank });
        }
        hub.persisted().set_resume(
            worker,
            Resume {
                last_seq,
                last_digest,
                ranks,
            },
        );
    }
    Ok(out)
}

/// Whether the addresses of `reg` (`url`, `zmq`, `replay`) are all allowed by `allowed`
/// (`--worker-hosts`), checked as `POST /v1/workers` checks them
/// ([`crate::outbound::check_field`]); the reason if not.
fn check_registration_hosts(
    allowed: &[String],
    reg: &Registration,
) -> std::result::Result<(), String> {
    for (field, addr) in [
        ("url", &reg.url),
        ("zmq", &reg.zmq),
        ("replay", &reg.replay),
    ] {
        if let Some(a) = addr {
            crate::outbound::check_field(allowed, field, a).map_err(|r| r.to_string())?;
        }
    }
    Ok(())
}

/// Second half, once the configured workers are registered and subscribed: the snapshot's
/// API workers that the configuration does not name are registered again (`sources` start
/// their event sources; they take their resume points), each checked first as
/// `POST /v1/workers` checks one (`worker_hosts`: `--worker-hosts`); a refused one is
/// logged, counted and left out. Marked workers that nobody registers any more are
/// forgotten.
pub fn finish_restore(
    hub: &Hub,
    plan: &Plan,
    mut done: Restored,
    worker_hosts: &[String],
    sources: &crate::sources::Sources,
) -> Result<Restored> {
    for w in &plan.workers {
        let worker = WorkerId(w.worker_id);
        if hub.is_registered(worker) {
            // The configuration names it now: its settings (and key) win.
            continue;
        }
        let checked = w.registration().and_then(|mut reg| {
            check_registration_hosts(worker_hosts, &reg).map_err(|reason| {
                TransportError::Invalid {
                    name: "snapshot worker",
                    reason,
                }
            })?;
            reg.api_key = plan.keys.get(&worker).cloned();
            hub.register(reg.clone())?;
            Ok(reg)
        });
        match checked {
            Ok(reg) => {
                hub.persisted().note_api_worker(reg.worker);
                sources.start(&reg);
                done.registered += 1;
            }
            Err(e) => {
                done.refused += 1;
                tracing::warn!(worker = %worker, "a registration in the snapshot is refused: {e}");
            }
        }
    }
    for &worker in plan.marks.keys() {
        if hub.is_registered(worker) {
            if plan.ranks.contains_key(&worker) {
                done.kept += 1;
            }
            continue;
        }
        hub.persisted().take_resume(worker);
        if plan.ranks.contains_key(&worker) {
            hub.forget_index(worker)?;
            done.cleared += 1;
            tracing::info!(worker = %worker, "restored blocks dropped: no longer registered");
        }
    }
    let p = hub.persisted();
    p.restored_workers.store(done.kept as u64, Relaxed);
    p.restore_cleared.store(done.cleared as u64, Relaxed);
    Ok(done)
}

/// Takes a snapshot every `interval` until the task is dropped (on a thread of the
/// blocking pool: see [`StateDir::save`]).
pub async fn snapshot_every(
    hub: std::sync::Arc<Hub>,
    dir: StateDir,
    policy: String,
    interval: std::time::Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let _ = save_now(&hub, &dir, &policy).await;
    }
}

/// Takes one snapshot now, off the async threads; logs the outcome and says whether it
/// was written.
pub async fn save_now(hub: &std::sync::Arc<Hub>, dir: &StateDir, policy: &str) -> bool {
    let (hub, dir, policy) = (hub.clone(), dir.clone(), policy.to_owned());
    let saved = tokio::task::spawn_blocking(move || {
        let saved = dir.save(&hub, &policy);
        // The image's buffers were allocated on this pool thread and freed by it and by the
        // cores; the allocator keeps such pages (and a pool thread that exits abandons
        // them) until asked. Every core releases once when next idle, this thread now: a
        // process that snapshots every few seconds then stays at its working set.
        crate::cores::request_memory_release();
        saved
    });
    match saved.await {
        Ok(Ok(w)) => {
            tracing::info!(
                bytes = w.bytes,
                seconds = w.seconds,
                io = w.backend.as_str(),
                "snapshot written"
            );
            true
        }
        Ok(Err(_)) => false, // logged and counted by `save`
        Err(e) => {
            tracing::warn!("snapshot task failed: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_workers_round_trip_without_their_keys() {
        let reg = Registration {
            dp_ranks: vec![DpRank(0), DpRank(3)],
            url: Some("http://w:8000".into()),
            zmq: Some("tcp://w:5557".into()),
            replay: Some("tcp://w:5558".into()),
            role: Some(WorkerRole::Prefill),
            bootstrap_port: Some(8998),
            api_key: Some("the-worker-key".into()),
            model: Some("m".into()),
            ..Registration::new(WorkerId(7))
        };
        let saved = SavedWorker::of(&reg);
        let json = serde_json::to_string(&saved).unwrap();
        assert!(!json.contains("the-worker-key"), "{json}");
        assert!(!json.contains("api_key"), "{json}");
        let back: SavedWorker = serde_json::from_str(&json).unwrap();
        let want = Registration {
            api_key: None,
            ..reg
        };
        assert_eq!(back.registration().unwrap(), want);
        // An older build's snapshot holds keys: they are read (for the router's own file
        // only, see `Checked::plan`), never given by `registration`.
        let old = json.replacen('{', r#"{"api_key":"old-key","#, 1);
        let back: SavedWorker = serde_json::from_str(&old).unwrap();
        assert_eq!(back.api_key.as_deref(), Some("old-key"));
        assert_eq!(back.registration().unwrap().api_key, None);
    }

    #[test]
    fn resume_points_are_handed_out_once() {
        let p = Persisted::default();
        p.set_resume(
            WorkerId(1),
            Resume {
                last_seq: 9,
                last_digest: Some(3),
                ranks: vec![DpRank(0)],
            },
        );
        assert_eq!(p.take_resume(WorkerId(1)).map(|r| r.last_seq), Some(9));
        assert_eq!(p.take_resume(WorkerId(1)), None);
    }
}
