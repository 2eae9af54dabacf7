//! One phase's events ([`Phase`]), split into producer streams ([`EventStream`]) by a
//! [`PhaseBuilder`] so that a worker's events stay on one producer, in order (workload
//! invariant 2).

use engine::WorkerKey;
use engine::event::KvEvent;
use std::sync::Arc;

/// Everything one producer thread sends in one phase, in order. Shared, so a phase can be
/// replayed (mixed rounds) or handed to long-lived threads without copying.
pub type EventStream = Arc<[(WorkerKey, KvEvent)]>;

/// One phase's events, split into producer streams.
#[derive(Clone, Debug, Default)]
pub struct Phase {
    /// `streams[p]`: everything producer `p` sends, in order.
    pub streams: Vec<EventStream>,
    /// Events over all streams.
    pub events: u64,
    /// Blocks stored over all streams.
    pub stored_blocks: u64,
    /// Blocks removed over all streams.
    pub removed_blocks: u64,
}

impl Phase {
    /// Stored plus removed blocks.
    pub fn block_ops(&self) -> u64 {
        self.stored_blocks + self.removed_blocks
    }

    /// Every event of the phase, streams concatenated (one valid global order).
    pub fn iter(&self) -> impl Iterator<Item = &(WorkerKey, KvEvent)> {
        self.streams.iter().flat_map(|s| s.iter())
    }
}

/// Builds a [`Phase`], routing each worker's events to its producer (workload invariant 2).
#[derive(Debug)]
pub struct PhaseBuilder {
    streams: Vec<Vec<(WorkerKey, KvEvent)>>,
    events: u64,
    stored_blocks: u64,
    removed_blocks: u64,
}

impl PhaseBuilder {
    /// An empty phase for `producers` producers (at least one).
    pub fn new(producers: usize) -> Self {
        Self {
            streams: (0..producers.max(1)).map(|_| Vec::new()).collect(),
            events: 0,
            stored_blocks: 0,
            removed_blocks: 0,
        }
    }

    /// Appends `event` of `key` to its producer's stream; empty stores and removals are
    /// dropped.
    pub fn push(&mut self, key: WorkerKey, event: KvEvent) {
        match &event {
            KvEvent::Stored { blocks, .. } if blocks.is_empty() => return,
            KvEvent::Removed { blocks } if blocks.is_empty() => return,
            KvEvent::Stored { blocks, .. } => self.stored_blocks += blocks.len() as u64,
            KvEvent::Removed { blocks } => self.removed_blocks += blocks.len() as u64,
            KvEvent::Cleared => {}
        }
        self.events += 1;
        let n = self.streams.len() as u64;
        let p = (key.worker.0 % n) as usize;
        if let Some(s) = self.streams.get_mut(p) {
            s.push((key, event));
        }
    }

    /// The finished phase.
    pub fn finish(self) -> Phase {
        Phase {
            streams: self.streams.into_iter().map(Arc::from).collect(),
            events: self.events,
            stored_blocks: self.stored_blocks,
            removed_blocks: self.removed_blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_routes_workers_to_producers_and_drops_empty_events() {
        let mut b = PhaseBuilder::new(3);
        for w in 0..7u64 {
            b.push(
                WorkerKey::new(w, 0),
                KvEvent::Removed {
                    blocks: vec![engine::EngineHash(w)],
                },
            );
        }
        b.push(WorkerKey::new(1, 0), KvEvent::Removed { blocks: vec![] });
        let p = b.finish();
        assert_eq!(p.events, 7);
        assert_eq!(p.removed_blocks, 7);
        for (i, s) in p.streams.iter().enumerate() {
            assert!(s.iter().all(|(k, _)| k.worker.0 % 3 == i as u64));
        }
    }
}
