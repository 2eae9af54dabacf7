//! A simulated TensorRT-LLM worker's KV-cache events: what `trtllm-serve` answers to
//! `POST /kv_cache_events`.
//!
//! TensorRT-LLM does not publish its KV events: it keeps them in a bounded buffer
//! (`event_buffer_max_size`, the oldest dropped when it overflows) and `trtllm-serve` hands
//! out everything buffered since the last call, a destructive drain, as a JSON array
//! ([`wire::trtllm`]). A worker in [`super::EventFormat::Trtllm`] mode does the
//! same with [`TrtllmEvents`]: the driver converts each of the engine's event batches
//! ([`convert_batch`]) into the buffer, the HTTP handler drains it.
//!
//! The conversion, per engine event:
//! * `Stored` → `stored` with the same `parent_hash`, one [`TrtBlock`] per block hash
//!   carrying its `block_size` tokens ([`TrtToken::text`]), the event's LoRA id (if any),
//!   `cache_level` 0 and `priority` 35 (TensorRT-LLM's default);
//! * `Removed` → `removed`;
//! * `Cleared` → nothing: TensorRT-LLM has no such event.
//!
//! Every event carries `window_size` [`WINDOW_SIZE`] (the simulated engine has no maximum
//! model length, so a fixed 4096 stands for it), and `attention_dp_rank` only when the
//! engine's data-parallel rank is not 0 (TensorRT-LLM leaves it out on rank 0 too).
//!
//! # Invariants
//! 1. `event_id`s are consecutive from 0 per worker; event 0, written when the worker
//!    starts, is `created` with `num_blocks_per_cache_level: [kv_blocks, 0]`.
//! 2. At most `capacity` events are buffered; an overflow drops the oldest (counted in
//!    [`TrtllmEvents::dropped`]), so a drain after an overflow starts above the last id
//!    drained + 1.
//! 3. [`TrtllmEvents::drain`] returns every buffered event, oldest first, and leaves the
//!    buffer empty.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use wire::kv_events::{WireBatch, WireEvent};
use wire::trtllm::{TrtBlock, TrtData, TrtEvent, TrtToken, WireHash};

/// [`super::EventFormat::Trtllm`]'s default buffer: TensorRT-LLM examples' usual
/// `event_buffer_max_size`.
pub const DEFAULT_EVENT_BUFFER: usize = 10_000;

/// The `window_size` every event carries (see the module docs).
pub const WINDOW_SIZE: u64 = 4096;

/// TensorRT-LLM's default block retention priority.
const DEFAULT_PRIORITY: i64 = 35;

/// The `data` of the events one engine batch becomes (see the module docs); `block_size`
/// splits a store's tokens when the event does not say its own.
pub fn convert_batch(batch: &WireBatch, block_size: u32) -> Vec<TrtData> {
    batch
        .events
        .iter()
        .filter_map(|ev| convert_event(ev, block_size))
        .collect()
}

fn convert_event(ev: &WireEvent, block_size: u32) -> Option<TrtData> {
    match ev {
        WireEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size: event_block_size,
            lora_id,
            ..
        } => {
            if block_hashes.is_empty() {
                return None;
            }
            let bs = event_block_size.unwrap_or(block_size).max(1) as usize;
            let lora_id = lora_id.and_then(|l| u64::try_from(l).ok());
            let mut chunks = token_ids.chunks(bs);
            let blocks = block_hashes
                .iter()
                .map(|&h| TrtBlock {
                    kind: Some("stored_block".into()),
                    block_hash: WireHash(h),
                    tokens: chunks
                        .next()
                        .unwrap_or_default()
                        .iter()
                        .map(|&t| TrtToken::text(t))
                        .collect(),
                    lora_id,
                    cache_level: 0,
                    priority: Some(DEFAULT_PRIORITY),
                })
                .collect();
            Some(TrtData::Stored {
                parent_hash: parent.map(WireHash),
                blocks,
            })
        }
        WireEvent::Removed { block_hashes, .. } => {
            (!block_hashes.is_empty()).then(|| TrtData::Removed {
                block_hashes: block_hashes.iter().map(|&h| WireHash(h)).collect(),
            })
        }
        WireEvent::Cleared => None,
    }
}

/// One worker's bounded event buffer, shared by its driver (writer) and its HTTP server
/// (drainer).
#[derive(Debug)]
pub struct TrtllmEvents {
    capacity: usize,
    block_size: u32,
    attention_dp_rank: Option<u32>,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    events: VecDeque<TrtEvent>,
    next_id: u64,
    dropped: u64,
}

impl TrtllmEvents {
    /// A buffer of at most `capacity` (at least 1) events for an engine of `kv_blocks`
    /// pages of `block_size` tokens at data-parallel rank `dp_rank`, holding its `created`
    /// event (id 0).
    pub fn new(capacity: usize, kv_blocks: u32, block_size: u32, dp_rank: u32) -> Self {
        let capacity = capacity.max(1);
        let this = Self {
            capacity,
            block_size,
            attention_dp_rank: (dp_rank != 0).then_some(dp_rank),
            inner: Mutex::new(Inner {
                events: VecDeque::with_capacity(capacity.min(1024)),
                next_id: 0,
                dropped: 0,
            }),
        };
        this.push(
            &mut this.lock(),
            TrtData::Created {
                num_blocks_per_cache_level: vec![u64::from(kv_blocks), 0],
            },
        );
        this
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere cannot leave the buffer half-written: keep serving it.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, inner: &mut Inner, data: TrtData) {
        if inner.events.len() >= self.capacity {
            inner.events.pop_front();
            inner.dropped += 1;
        }
        let event_id = inner.next_id;
        inner.next_id += 1;
        inner.events.push_back(TrtEvent {
            event_id,
            data,
            window_size: Some(WINDOW_SIZE),
            attention_dp_rank: self.attention_dp_rank,
            layer_group_id: None,
        });
    }

    /// Appends the events of one engine batch ([`convert_batch`]).
    pub fn push_batch(&self, batch: &WireBatch) {
        let converted = convert_batch(batch, self.block_size);
        if converted.is_empty() {
            return;
        }
        let mut inner = self.lock();
        for data in converted {
            self.push(&mut inner, data);
        }
    }

    /// Takes every buffered event, oldest first.
    pub fn drain(&self) -> Vec<TrtEvent> {
        self.lock().events.drain(..).collect()
    }

    /// Events dropped so far because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// The buffer's capacity in events.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(events: Vec<WireEvent>) -> WireBatch {
        WireBatch {
            ts: Some(1.0),
            dp_rank: Some(0),
            events,
            unknown_events: 0,
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> WireEvent {
        WireEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: Some(2),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: None,
        }
    }

    fn block(hash: u64, tokens: &[u32], lora_id: Option<u64>) -> TrtBlock {
        TrtBlock {
            kind: Some("stored_block".into()),
            block_hash: WireHash(hash),
            tokens: tokens.iter().map(|&t| TrtToken::text(t)).collect(),
            lora_id,
            cache_level: 0,
            priority: Some(35),
        }
    }

    #[test]
    fn a_batch_becomes_stored_and_removed_and_drops_cleared() {
        let mut lora = stored(&[9], Some(8), vec![5, 6]);
        if let WireEvent::Stored { lora_id, .. } = &mut lora {
            *lora_id = Some(3);
        }
        let b = batch(vec![
            stored(&[1, 2], None, vec![10, 11, 12, 13]),
            WireEvent::Removed {
                block_hashes: vec![7, u64::MAX],
                medium: None,
            },
            WireEvent::Cleared,
            lora,
            WireEvent::Removed {
                block_hashes: vec![],
                medium: None,
            },
        ]);
        assert_eq!(
            convert_batch(&b, 16),
            vec![
                TrtData::Stored {
                    parent_hash: None,
                    blocks: vec![block(1, &[10, 11], None), block(2, &[12, 13], None)],
                },
                TrtData::Removed {
                    block_hashes: vec![WireHash(7), WireHash(u64::MAX)],
                },
                TrtData::Stored {
                    parent_hash: Some(WireHash(8)),
                    blocks: vec![block(9, &[5, 6], Some(3))],
                },
            ]
        );
        // Without its own block size an event is split by the engine's.
        let mut plain = stored(&[4], Some(1), vec![1, 2, 3]);
        if let WireEvent::Stored { block_size, .. } = &mut plain {
            *block_size = None;
        }
        assert_eq!(
            convert_batch(&batch(vec![plain]), 3),
            vec![TrtData::Stored {
                parent_hash: Some(WireHash(1)),
                blocks: vec![block(4, &[1, 2, 3], None)],
            }]
        );
    }

    #[test]
    fn the_buffer_numbers_from_created_and_drops_the_oldest() {
        let buf = TrtllmEvents::new(3, 64, 2, 0);
        let first = buf.drain();
        assert_eq!(
            first,
            vec![TrtEvent {
                event_id: 0,
                data: TrtData::Created {
                    num_blocks_per_cache_level: vec![64, 0],
                },
                window_size: Some(WINDOW_SIZE),
                attention_dp_rank: None,
                layer_group_id: None,
            }]
        );
        assert!(buf.drain().is_empty());
        for i in 0..5 {
            buf.push_batch(&batch(vec![stored(&[i], None, vec![1, 2])]));
        }
        // Cleared alone writes nothing and takes no id.
        buf.push_batch(&batch(vec![WireEvent::Cleared]));
        let got = buf.drain();
        assert_eq!(
            got.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert_eq!(buf.dropped(), 2);
        let ranked = TrtllmEvents::new(1, 8, 2, 3);
        assert_eq!(ranked.drain()[0].attention_dp_rank, Some(3));
        // Serializes to trtllm-serve's shape, which the router's decoder reads back.
        let text = serde_json::to_vec(&got).unwrap();
        let page = wire::trtllm::decode_page(&text).unwrap();
        assert_eq!(page.len(), 3);
    }
}
