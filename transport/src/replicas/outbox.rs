//! The hub's side of replica sync: its load events queued for the link task.
//!
//! Called under the hub's routing lock, so it never waits: a full queue (the link is
//! stalled, or NATS is down and the link is dropping) loses the event, counts it, and asks
//! the link to send the replica's whole state once it can, which supersedes every event
//! lost.

use super::wire::{LoadEvent, SessionAssign};
use super::{LoadSink, ReplicaStats};
use engine::{SeqHash, WorkerKey};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use tokio::sync::mpsc;

/// Events the queue holds before it drops (a few seconds of a busy router's routes).
pub const QUEUE_EVENTS: usize = 65_536;

/// Session assignments the queue holds before it drops (best effort: a dropped one costs a
/// peer one routing by cost).
pub const QUEUE_SESSIONS: usize = 16_384;

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
    sessions: mpsc::Sender<SessionAssign>,
    shared: Arc<Shared>,
}

/// The link task's ends of the outbox.
#[derive(Debug)]
pub struct Inbox {
    /// Load events.
    pub events: mpsc::Receiver<LoadEvent>,
    /// Session assignments.
    pub sessions: mpsc::Receiver<SessionAssign>,
}

impl Outbox {
    /// An outbox and the receiving ends for the link task.
    pub fn new(shared: Arc<Shared>) -> (Self, Inbox) {
        let (tx, events) = mpsc::channel(QUEUE_EVENTS);
        let (stx, sessions) = mpsc::channel(QUEUE_SESSIONS);
        (
            Self {
                tx,
                sessions: stx,
                shared,
            },
            Inbox { events, sessions },
        )
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

    fn session(&self, model: &str, session: engine::SessionId, key: WorkerKey) {
        let assign = SessionAssign {
            model: model.to_owned(),
            session: session.0,
            worker: key.worker.0,
            dp_rank: key.dp_rank.0,
        };
        if self.sessions.try_send(assign).is_err() {
            self.shared.stats.sessions_dropped.fetch_add(1, Relaxed);
        }
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
        let (outbox, inbox) = Outbox::new(shared.clone());
        let mut rx = inbox.events;
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

    #[test]
    fn session_assignments_queue_apart_and_a_full_queue_drops_them_counted() {
        let shared = Arc::new(Shared::default());
        let (outbox, mut inbox) = Outbox::new(shared.clone());
        let key = WorkerKey::new(3, 1);
        outbox.session("m", engine::SessionId(7), key);
        assert_eq!(
            inbox.sessions.try_recv().unwrap(),
            SessionAssign {
                model: "m".into(),
                session: 7,
                worker: 3,
                dp_rank: 1
            }
        );
        assert!(inbox.events.try_recv().is_err(), "not a load event");
        for _ in 0..=QUEUE_SESSIONS {
            outbox.session("m", engine::SessionId(7), key);
        }
        assert_eq!(shared.stats.sessions_dropped.load(Relaxed), 1);
        assert!(!shared.need_state.load(Relaxed), "sessions need no state");
    }
}
