//! The hub's side of replica sync: its load events queued for the link task.
//!
//! Called under the hub's routing lock, so it never waits: a full queue (the link is
//! stalled, or NATS is down and the link is dropping) loses the event, counts it, and asks
//! the link to send the replica's whole state once it can, which supersedes every event
//! lost.

use super::wire::LoadEvent;
use super::{LoadSink, ReplicaStats};
use engine::{SeqHash, WorkerKey};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use tokio::sync::mpsc;

/// Events the queue holds before it drops (a few seconds of a busy router's routes).
pub const QUEUE_EVENTS: usize = 65_536;

/// What the outbox and the link task share.
#[derive(Debug, Default)]
pub struct Shared {
    /// The counters.
    pub stats: ReplicaStats,
    /// Set when peers cannot know this replica's state from its events alone.
    pub need_state: AtomicBool,
}

/// See the module docs.
#[derive(Debug)]
pub struct Outbox {
    tx: mpsc::Sender<LoadEvent>,
    shared: Arc<Shared>,
}

impl Outbox {
    /// An outbox and the receiving end for the link task.
    pub fn new(shared: Arc<Shared>) -> (Self, mpsc::Receiver<LoadEvent>) {
        let (tx, rx) = mpsc::channel(QUEUE_EVENTS);
        (Self { tx, shared }, rx)
    }

    fn push(&self, event: LoadEvent) {
        self.shared.stats.events_queued.fetch_add(1, Relaxed);
        if self.tx.try_send(event).is_err() {
            self.shared.stats.events_dropped.fetch_add(1, Relaxed);
            self.shared.need_state.store(true, Relaxed);
        }
    }
}

impl LoadSink for Outbox {
    fn added(
        &self,
        request: &str,
        key: WorkerKey,
        blocks: &[SeqHash],
        input_tokens: u64,
        overlap_blocks: u32,
    ) {
        self.push(LoadEvent::Added {
            request: request.to_owned(),
            worker: key.worker.0,
            dp_rank: key.dp_rank.0,
            input_tokens,
            overlap_blocks,
            blocks: blocks.iter().map(|h| h.0).collect(),
        });
    }

    fn prefilled(&self, request: &str) {
        self.push(LoadEvent::Prefilled {
            request: request.to_owned(),
        });
    }

    fn freed(&self, request: &str) {
        self.push(LoadEvent::Freed {
            request: request.to_owned(),
        });
    }

    fn stats(&self) -> &ReplicaStats {
        &self.shared.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_counts_the_loss_and_asks_for_a_state() {
        let shared = Arc::new(Shared::default());
        let (outbox, mut rx) = Outbox::new(shared.clone());
        outbox.added("a", WorkerKey::new(1, 0), &[SeqHash(5)], 16, 0);
        assert_eq!(
            rx.try_recv().unwrap(),
            LoadEvent::Added {
                request: "a".into(),
                worker: 1,
                dp_rank: 0,
                input_tokens: 16,
                overlap_blocks: 0,
                blocks: vec![5],
            }
        );
        assert!(!shared.need_state.load(Relaxed));
        for _ in 0..QUEUE_EVENTS {
            outbox.freed("a");
        }
        outbox.prefilled("a");
        assert_eq!(shared.stats.events_dropped.load(Relaxed), 1);
        let handed = QUEUE_EVENTS as u64 + 2;
        assert_eq!(shared.stats.events_queued.load(Relaxed), handed);
        assert!(shared.need_state.load(Relaxed));
        assert_eq!(outbox.status().events_dropped, 1);
    }
}
