//! One TensorRT-LLM worker's event pages, fenced and applied: per attention-DP rank, an
//! [`EventStream`] over the events' ids and a [`RankConverter`]. No I/O besides handing
//! events to the hub; the poller ([`super::poller`]) fetches the pages.
//!
//! # Semantics
//! * Each event is its own numbered batch: `event_id` is the number, per rank
//!   (`attention_dp_rank`, absent: 0). The first event a rank shows applies; then each must
//!   be the next number.
//! * A number above the next one: events were lost (another client drained them, or the
//!   server's buffer overflowed between polls). The drain cannot be replayed, so the rank
//!   is cleared, marked resyncing and counted, and the stream goes on from this event.
//! * A number below the next one: the server restarted (ids start from 0 in each
//!   process). The rank is cleared and counted as a restart, then the event applies. The
//!   same event again, byte for byte, is a re-sent copy: skipped, counted as
//!   `duplicate_seq`.
//! * An element that does not decode: its changes are unknown, so every rank seen is
//!   cleared and resynced (counted under `malformed_json`), and every rank starts afresh.
//! * After a clear, a rank's converter forgets its offload memory: nothing it knew is held.
//! * With several attention windows (`window_size`), only the largest window's events are
//!   converted (each window's pool reports the same blocks); the others still consume
//!   their ids. Likewise with several layer groups (`layer_group_id`, newer servers): only
//!   the lowest group's.
//!
//! # Invariants
//! 1. Events of one rank reach the hub in id order, in one hand-over per run of applied
//!    events, each with its id as the stream mark (a snapshot holds an event exactly when
//!    it holds its id).
//! 2. Nothing here panics on any page: every refusal is counted and logged.

use super::convert::RankConverter;
use super::{PageEntry, TrtEvent};
use crate::error::DropReason;
use crate::hub::Hub;
use crate::stream::{Action, BatchId, ClearKind, EventStream, clear_keys, skip_duplicate};
use engine::event::KvEvent;
use engine::{DpRank, WorkerId, WorkerKey};
use std::collections::BTreeMap;

/// One rank's position and conversion state.
#[derive(Debug, Default)]
struct Rank {
    stream: EventStream,
    convert: RankConverter,
    /// Converted events not yet handed over, and the id of the last one.
    pending: Vec<KvEvent>,
    last_id: Option<u64>,
    /// The largest attention window seen: only its events are applied.
    window: Option<u64>,
    /// The lowest layer group seen: only its events are applied.
    group: Option<u64>,
}

/// One worker's ranks (see the module docs).
#[derive(Debug)]
pub struct WorkerEvents {
    worker: WorkerId,
    ranks: BTreeMap<DpRank, Rank>,
}

impl WorkerEvents {
    /// A worker whose events were never seen.
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            ranks: BTreeMap::new(),
        }
    }

    /// A worker restored from a snapshot that holds its events up to `last_id` on `ranks`.
    /// With one rank the stream resumes after `last_id` (the server kept what came after
    /// in its buffer, unless it overflowed: then the gap shows). Several ranks share one
    /// snapshot mark, which cannot tell their ids apart: they are cleared and start afresh.
    pub fn resume(hub: &Hub, worker: WorkerId, last_id: u64, ranks: &[DpRank]) -> Self {
        let mut me = Self::new(worker);
        match ranks {
            [rank] => {
                me.ranks.insert(
                    *rank,
                    Rank {
                        stream: EventStream::resume(false, last_id),
                        ..Rank::default()
                    },
                );
            }
            _ => {
                let keys = ranks.iter().map(|&dp_rank| WorkerKey { worker, dp_rank });
                let why = format_args!(
                    "worker {worker}: restored {} attention-DP ranks from one snapshot mark",
                    ranks.len()
                );
                let _ = clear_keys(hub, keys, ClearKind::Resync, &why);
            }
        }
        me
    }

    /// Fences, converts and applies one page, oldest event first.
    pub fn apply_page(&mut self, hub: &Hub, page: Vec<PageEntry>) {
        let block_size = hub.block_size_of(self.worker);
        for entry in page {
            match entry {
                PageEntry::Event { event, digest } => {
                    let dp_rank = DpRank(event.attention_dp_rank.unwrap_or(0));
                    let id = BatchId {
                        seq: event.event_id,
                        digest,
                    };
                    self.apply_event(hub, dp_rank, id, event, block_size);
                }
                PageEntry::Unreadable { event_id, error } => {
                    self.flush(hub);
                    let worker = self.worker;
                    hub.metrics().drop_input(
                        DropReason::MalformedJson,
                        1,
                        &format_args!(
                            "worker {worker}: TensorRT-LLM event {}: {error}",
                            event_id.map_or_else(|| "without an id".to_owned(), |i| i.to_string())
                        ),
                    );
                    let keys: Vec<WorkerKey> = self
                        .ranks
                        .keys()
                        .map(|&dp_rank| WorkerKey { worker, dp_rank })
                        .collect();
                    let why = format_args!("worker {worker}: an event could not be read");
                    let _ = clear_keys(hub, keys, ClearKind::Resync, &why);
                    // Every rank starts afresh: the next event of each applies.
                    self.ranks.clear();
                }
            }
        }
        self.flush(hub);
    }

    fn apply_event(
        &mut self,
        hub: &Hub,
        dp_rank: DpRank,
        id: BatchId,
        event: TrtEvent,
        block_size: u32,
    ) {
        let worker = self.worker;
        let key = WorkerKey { worker, dp_rank };
        let rank = self.ranks.entry(dp_rank).or_default();
        match rank.stream.live(id) {
            Action::Apply => {}
            Action::Skip => {
                let why = format_args!(
                    "worker {worker} rank {dp_rank}: TensorRT-LLM event {} again",
                    id.seq
                );
                skip_duplicate(hub, 1, &why);
                return;
            }
            // No replay for a drained stream: a gap clears (Replay cannot come from a
            // stream made without replay; it is handled as the gap it is).
            action @ (Action::ClearThenApply(_) | Action::Replay { .. }) => {
                let kind = match action {
                    Action::ClearThenApply(kind) => kind,
                    _ => ClearKind::Resync,
                };
                hand_over(hub, key, rank);
                let why = match kind {
                    ClearKind::Restart => format!(
                        "worker {worker} rank {dp_rank}: TensorRT-LLM event ids went back to {}",
                        id.seq
                    ),
                    ClearKind::Resync => format!(
                        "worker {worker} rank {dp_rank}: TensorRT-LLM events before {} lost \
                         (drained by another client, or the server's event buffer overflowed)",
                        id.seq
                    ),
                };
                let _ = clear_keys(hub, [key], kind, &why);
                rank.convert.reset();
                if kind == ClearKind::Restart {
                    // A new process may serve another model, with other windows and groups.
                    rank.window = None;
                    rank.group = None;
                }
            }
        }
        rank.last_id = Some(id.seq);
        // A model with several attention windows (variable sliding window) has one pool per
        // window, and each pool reports the same blocks: the largest window's events are
        // the ones that decide a prefix hit (as Dynamo's TensorRT-LLM publisher keeps).
        if let Some(w) = event.window_size {
            match rank.window {
                Some(max) if w < max => return,
                _ => rank.window = Some(w),
            }
        }
        // Likewise one pool per layer group (newer servers): each reports the same blocks.
        if let Some(g) = event.layer_group_id {
            match rank.group {
                Some(min) if g > min => return,
                _ => rank.group = Some(g),
            }
        }
        let outcome = rank
            .convert
            .convert(event.data, block_size, &mut rank.pending);
        for &(reason, n) in &outcome.drops {
            hub.metrics().drop_input(
                reason,
                n,
                &format_args!(
                    "worker {worker} rank {dp_rank}: TensorRT-LLM event {}: {n} dropped",
                    id.seq
                ),
            );
        }
        if let Some(got) = outcome.block_size_mismatch {
            let message = format!(
                "worker stores blocks of {got} tokens; this router hashes {block_size} \
                 (TensorRT-LLM's tokens_per_block defaults to 32: set the model's block_size \
                 or --kv-cache-block-size to match)"
            );
            if hub.registry().note_config_error(worker, message.clone()) {
                tracing::error!(worker = %worker, "{message}");
            }
        }
        if let Some(levels) = outcome.created {
            if let Some(&gpu) = levels.first() {
                hub.registry().note_kv_capacity(key, gpu);
            }
            tracing::info!(worker = %worker, rank = %dp_rank, ?levels,
                "TensorRT-LLM KV cache created (blocks per cache level)");
        }
    }

    /// Hands every rank's pending events to the hub.
    fn flush(&mut self, hub: &Hub) {
        let worker = self.worker;
        for (&dp_rank, rank) in &mut self.ranks {
            hand_over(hub, WorkerKey { worker, dp_rank }, rank);
        }
    }
}

/// Hands `rank`'s pending events to the hub, marked with the last event's id.
fn hand_over(hub: &Hub, key: WorkerKey, rank: &mut Rank) {
    let Some(last) = rank.last_id.take() else {
        return;
    };
    let events = std::mem::take(&mut rank.pending);
    let n = events.len() as u64;
    if let Err(e) = hub.ingest_marked(key, events, last, None) {
        hub.metrics()
            .drop_input(e.reason(), n, &format_args!("worker {}: {e}", key.worker));
    }
}
