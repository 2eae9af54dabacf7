//! What a warm restart needs from the running router ([`crate::state`] reads and writes the
//! snapshot): where each restored stream resumes, which workers were registered over the
//! API (a snapshot keeps those), and the snapshot figures.
//!
//! # Invariants
//! 1. A resume point is taken at most once ([`Persisted::take_resume`]), by the stream
//!    that resumes from it.
//!
//! # Concurrency
//! Shared through the hub; each map behind its own mutex, held for one insert, removal or
//! copy (a leaf in the hub's lock order).

use engine::{DpRank, WorkerId};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

/// Where a restored worker's stream resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The number of the last batch in the snapshot.
    pub last_seq: u64,
    /// The digest of that batch's bytes (`None`: unverifiable, e.g. a format-1 snapshot).
    pub last_digest: Option<u64>,
    /// The ranks the snapshot holds blocks of (what a clear must reach).
    pub ranks: Vec<DpRank>,
}

/// Warm-restart state shared through the hub, and its figures.
#[derive(Debug, Default)]
pub struct Persisted {
    resume: Mutex<BTreeMap<WorkerId, Resume>>,
    api: Mutex<BTreeSet<WorkerId>>,
    /// Snapshots written.
    pub snapshots: AtomicU64,
    /// Snapshots that failed (engine or disk).
    pub snapshot_failures: AtomicU64,
    /// Microseconds the last snapshot took, cut to file.
    pub last_snapshot_us: AtomicU64,
    /// Bytes of the last snapshot.
    pub last_snapshot_bytes: AtomicU64,
    /// Microseconds the restore at start took (reading, checking, rebuilding the cores).
    pub restore_us: AtomicU64,
    /// Workers whose blocks a restore kept (their streams resume from their marks and verify
    /// them before the blocks count).
    pub restored_workers: AtomicU64,
    /// Workers a restore cleared: no resumable stream, or no longer registered.
    pub restore_cleared: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Persisted {
    /// `worker` was registered over the API (a snapshot keeps its registration).
    pub fn note_api_worker(&self, worker: WorkerId) {
        lock(&self.api).insert(worker);
    }

    /// `worker` was removed.
    pub fn forget_worker(&self, worker: WorkerId) {
        lock(&self.api).remove(&worker);
        lock(&self.resume).remove(&worker);
    }

    /// Where `worker`'s restored stream resumes (a restore sets it before the worker's
    /// stream starts).
    pub fn set_resume(&self, worker: WorkerId, resume: Resume) {
        lock(&self.resume).insert(worker, resume);
    }

    /// Where `worker`'s restored stream resumes, once (`crate::state`'s invariant 2).
    pub fn take_resume(&self, worker: WorkerId) -> Option<Resume> {
        lock(&self.resume).remove(&worker)
    }

    /// The workers registered over the API.
    pub fn api_workers(&self) -> Vec<WorkerId> {
        lock(&self.api).iter().copied().collect()
    }
}
