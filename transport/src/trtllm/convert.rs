//! From TensorRT-LLM's events ([`TrtData`]) to the engine's [`KvEvent`]s, for one worker
//! rank (one `(worker, attention_dp_rank)`): [`RankConverter`]. Pure: no I/O, no clock, no
//! counters. The poller fences `event_id`s, counts what [`Outcome`] reports, and calls
//! [`RankConverter::reset`] when the rank's blocks are cleared.
//!
//! TensorRT-LLM's cache has levels: 0 is GPU memory, 1 host memory (the secondary pool, when
//! the server offloads). Only level-0 blocks are cache hits worth routing for, so only they
//! enter the index. A block changes level through `updated` events (offloaded to host
//! memory, brought back onto the GPU), which do not repeat its tokens: to bring a block back
//! the converter must remember what it was stored with.
//!
//! # Rules
//! * `created`: its `num_blocks_per_cache_level` is recorded (index 0, the GPU pool, is
//!   [`RankConverter::capacity`]) and reported in [`Outcome::created`]. No engine event.
//! * `stored`: an empty `blocks` list does nothing. Blocks carry `block_size` tokens
//!   (TensorRT-LLM's `tokens_per_block`, 32 by default), except that the **last** block of an
//!   event may be partial: TensorRT-LLM stores a finished sequence's partly filled last
//!   block too (partial reuse), and the router, which matches full blocks only, ignores it
//!   (its hash is kept so that its later `removed` and `updated` events are ignored too).
//!   Any other count (a block longer than `block_size`, or a short one before the last) means
//!   the router's block size is not the worker's: the whole event is dropped as
//!   [`DropReason::BlockSizeMismatch`] with [`Outcome::block_size_mismatch`] set to that
//!   count (`block_size` 0 drops every store, with no count). Block hash `h` becomes
//!   `EngineHash(h)`, the event's `parent_hash` the first block's parent; the tokens hash is
//!   [`tokens_hash_with_extras`]`(token ids, token_extra_ids, seed)` with
//!   `seed = lora_seed(lora_id as a decimal string)` (as for vLLM's `lora_id`). Blocks at
//!   `cache_level` 0 are emitted as [`KvEvent::Stored`] runs of consecutive GPU blocks, each
//!   run's parent being the block before it in the chain; blocks at other levels are not
//!   emitted (only remembered, below).
//! * `updated` with a `cache_level` change from 0 to another level (offloaded): one
//!   [`KvEvent::Removed`] of the block. From another level to 0 (brought back): if the block
//!   is remembered as off the GPU, a one-block [`KvEvent::Stored`] under its remembered parent;
//!   otherwise dropped as [`DropReason::Other`] (nothing to store it with, or it is already
//!   held). Anything else (no `cache_level`, an unchanged one, one non-GPU level to another, a
//!   priority change, a partial block): nothing.
//! * `removed`: the blocks remembered as off the GPU, and partial blocks, are forgotten
//!   (they are not in the index); all the others go in one [`KvEvent::Removed`].
//! * [`TrtData::Unknown`]: dropped as [`DropReason::Other`].
//!
//! # Memory
//! While the worker may offload (no `created` seen yet, or the last one gave a level past 0
//! a non-zero size), every stored block is remembered as `(parent, tokens hash, on GPU)`
//! under its hash until it is removed: one hash-map entry of 40 bytes, about 45 to 90 bytes
//! per block with the table's slack, for every block the worker holds on any level (a worker
//! with 1 M GPU and host blocks costs some 50-90 MB). A `created` whose levels past 0 are all
//! 0 (the server does not offload) frees that memory and stops it. The hashes of partial
//! blocks are always kept (a set of u64, at most one block per cached sequence).
//!
//! # Invariants
//! 1. [`RankConverter::convert`] never panics or fails; an event is applied whole or dropped
//!    whole, and a dropped event names its [`DropReason`] in [`Outcome::drops`].
//! 2. The engine events track the rank's GPU (level-0) blocks: a block enters the index when
//!    stored at level 0 or brought back to it, and leaves it once, when offloaded or removed.
//!    A block remembered as offloaded is never removed again, nor brought back twice.
//! 3. When in doubt the converter removes rather than stores: a block whose level it does
//!    not know is removed on `removed` and on offload, and never stored on `updated`. The
//!    index may then miss blocks the worker holds, but never claims blocks it lost.
//! 4. The memory holds only blocks the worker still holds (stored and not yet removed), so it
//!    is bounded by the worker's pool sizes while its events are complete; after lost events
//!    the poller calls [`RankConverter::reset`].
//! 5. Only full blocks enter the index; a partial block is never stored nor removed.

use super::{TrtBlock, TrtData, WireHash};
use crate::error::DropReason;
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, tokens_hash_with_extras};
use engine::{EngineHash, TokensHash};
use std::collections::{HashMap, HashSet};

/// What converting one event did, besides the engine events it appended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Outcome {
    /// Dropped events per reason (as the vLLM converter reports them). One event is applied
    /// or dropped whole, so this holds at most one entry, with a count of 1.
    pub drops: Vec<(DropReason, u64)>,
    /// A stored block's token count that differs from the router's block size (a
    /// misconfigured router: TensorRT-LLM's `tokens_per_block` defaults to 32).
    pub block_size_mismatch: Option<u32>,
    /// A `created` event's blocks per cache level (GPU first, then host memory).
    pub created: Option<Vec<u64>>,
}

impl Outcome {
    /// Counts the event as dropped for `reason`.
    fn count_drop(&mut self, reason: DropReason) {
        self.drops.push((reason, 1));
    }

    /// The reason the event was dropped, if it was.
    pub fn dropped(&self) -> Option<DropReason> {
        self.drops.first().map(|&(r, _)| r)
    }
}

/// A block stored while the worker may offload.
#[derive(Clone, Copy, Debug)]
struct Remembered {
    /// The hash of the block before it in its chain (`None`: a sequence start).
    parent: Option<u64>,
    /// Its tokens hash.
    tokens_hash: TokensHash,
    /// Whether it is on the GPU (so in the index).
    on_gpu: bool,
}

/// The converter of one worker rank: what its last `created` said, and the blocks it may
/// bring back onto the GPU (see the module docs).
#[derive(Debug)]
pub struct RankConverter {
    /// Blocks per cache level from the last `created` (empty: none seen).
    levels: Vec<u64>,
    /// Whether stored blocks are remembered (the worker may offload).
    remember: bool,
    /// Remembered blocks by TensorRT-LLM hash.
    blocks: HashMap<u64, Remembered>,
    /// Partial blocks the worker holds (never in the index).
    partial: HashSet<u64>,
    /// Scratch: one block's token ids.
    ids: Vec<u32>,
    /// Scratch: one block's extra ids.
    extras: Vec<u64>,
}

impl Default for RankConverter {
    fn default() -> Self {
        Self::new()
    }
}

impl RankConverter {
    /// A converter that has seen nothing: it remembers stored blocks until a `created` says
    /// the worker does not offload.
    pub fn new() -> Self {
        Self {
            levels: Vec::new(),
            remember: true,
            blocks: HashMap::new(),
            partial: HashSet::new(),
            ids: Vec::new(),
            extras: Vec::new(),
        }
    }

    /// Converts one event for a router with `block_size` tokens per block, appending the
    /// engine events to `out` (see the module docs for the rules).
    pub fn convert(&mut self, data: TrtData, block_size: u32, out: &mut Vec<KvEvent>) -> Outcome {
        let mut outcome = Outcome::default();
        match data {
            TrtData::Created {
                num_blocks_per_cache_level,
            } => {
                self.remember = num_blocks_per_cache_level.iter().skip(1).any(|&n| n > 0);
                if !self.remember {
                    self.blocks = HashMap::new();
                }
                self.levels.clone_from(&num_blocks_per_cache_level);
                outcome.created = Some(num_blocks_per_cache_level);
            }
            TrtData::Stored {
                parent_hash,
                blocks,
            } => self.stored(parent_hash, &blocks, block_size, out, &mut outcome),
            TrtData::Removed { block_hashes } => {
                let gpu: Vec<EngineHash> = block_hashes
                    .iter()
                    .filter(|h| {
                        let partial = self.partial.remove(&h.0);
                        let offloaded = matches!(self.blocks.remove(&h.0), Some(r) if !r.on_gpu);
                        !partial && !offloaded
                    })
                    .map(|h| EngineHash(h.0))
                    .collect();
                if !gpu.is_empty() {
                    out.push(KvEvent::Removed { blocks: gpu });
                }
            }
            TrtData::Updated {
                block_hash,
                cache_level,
                ..
            } => {
                let Some(level) = cache_level else {
                    return outcome;
                };
                let h = block_hash.0;
                if self.partial.contains(&h) {
                    return outcome;
                }
                match (level.old_value == 0, level.new_value == 0) {
                    (true, false) => {
                        if let Some(r) = self.blocks.get_mut(&h) {
                            r.on_gpu = false;
                        }
                        out.push(KvEvent::Removed {
                            blocks: vec![EngineHash(h)],
                        });
                    }
                    (false, true) => match self.blocks.get_mut(&h) {
                        Some(r) if !r.on_gpu => {
                            r.on_gpu = true;
                            out.push(KvEvent::Stored {
                                parent: r.parent.map(EngineHash),
                                blocks: vec![StoredBlock {
                                    engine_hash: EngineHash(h),
                                    tokens_hash: r.tokens_hash,
                                }],
                            });
                        }
                        _ => outcome.count_drop(DropReason::Other),
                    },
                    _ => {}
                }
            }
            TrtData::Unknown => outcome.count_drop(DropReason::Other),
        }
        outcome
    }

    /// Forgets the remembered blocks (after the rank's blocks were cleared: a server restart
    /// or lost events). The last `created` is kept: pool sizes do not change while a server
    /// runs, and a restarted one sends a new `created` first.
    pub fn reset(&mut self) {
        self.blocks.clear();
        self.partial.clear();
    }

    /// The GPU pool's size in blocks, from the last `created` (`None` before one).
    pub fn capacity(&self) -> Option<u64> {
        self.levels.first().copied()
    }

    /// A `stored` event (see the module docs).
    fn stored(
        &mut self,
        parent: Option<WireHash>,
        blocks: &[TrtBlock],
        block_size: u32,
        out: &mut Vec<KvEvent>,
        outcome: &mut Outcome,
    ) {
        let Some((last, full)) = blocks.split_last() else {
            return;
        };
        if block_size == 0 {
            outcome.count_drop(DropReason::BlockSizeMismatch);
            return;
        }
        let bs = block_size as usize;
        // Every block but the last must be full; the last may be partial, not longer.
        let foreign = full
            .iter()
            .map(|b| b.tokens.len())
            .find(|&n| n != bs)
            .or((last.tokens.len() > bs).then_some(last.tokens.len()));
        if let Some(n) = foreign {
            outcome.count_drop(DropReason::BlockSizeMismatch);
            outcome.block_size_mismatch = Some(u32::try_from(n).unwrap_or(u32::MAX));
            return;
        }
        let blocks = if last.tokens.len() < bs {
            let h = last.block_hash.0;
            self.partial.insert(h);
            // A hash is one block: a partial one is not also a remembered full one.
            self.blocks.remove(&h);
            full
        } else {
            blocks
        };
        let mut prev = parent.map(|h| h.0);
        // The current run of GPU blocks: its parent and blocks.
        let mut run: Option<(Option<u64>, Vec<StoredBlock>)> = None;
        for b in blocks {
            let h = b.block_hash.0;
            let tokens_hash = self.tokens_hash(b);
            let on_gpu = b.cache_level == 0;
            if on_gpu {
                let block = StoredBlock {
                    engine_hash: EngineHash(h),
                    tokens_hash,
                };
                run.get_or_insert_with(|| (prev, Vec::new())).1.push(block);
            } else if let Some(r) = run.take() {
                push_run(out, r);
            }
            self.partial.remove(&h);
            if self.remember {
                self.blocks.insert(
                    h,
                    Remembered {
                        parent: prev,
                        tokens_hash,
                        on_gpu,
                    },
                );
            }
            prev = Some(h);
        }
        if let Some(r) = run {
            push_run(out, r);
        }
    }

    /// One block's tokens hash: its token and extra ids, under its LoRA id's seed.
    fn tokens_hash(&mut self, b: &TrtBlock) -> TokensHash {
        self.ids.clear();
        self.extras.clear();
        for t in &b.tokens {
            self.ids.push(t.token_id);
            self.extras.push(t.token_extra_id);
        }
        let seed = lora_seed(b.lora_id.map(|id| id.to_string()).as_deref());
        tokens_hash_with_extras(&self.ids, &self.extras, seed)
    }
}

/// Appends one run of GPU blocks as a store.
fn push_run(out: &mut Vec<KvEvent>, (parent, blocks): (Option<u64>, Vec<StoredBlock>)) {
    out.push(KvEvent::Stored {
        parent: parent.map(EngineHash),
        blocks,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trtllm::{Diff, TrtToken};
    use engine::hash::{BASE_SEED, tokens_hash};

    const BS: u32 = 4;

    fn ids(first: u32) -> Vec<u32> {
        (first..first + BS).collect()
    }

    fn block(hash: u64, first: u32, cache_level: u32) -> TrtBlock {
        TrtBlock {
            kind: Some("stored_block".into()),
            block_hash: WireHash(hash),
            tokens: ids(first).into_iter().map(TrtToken::text).collect(),
            lora_id: None,
            cache_level,
            priority: Some(35),
        }
    }

    fn stored(parent: Option<u64>, blocks: Vec<TrtBlock>) -> TrtData {
        TrtData::Stored {
            parent_hash: parent.map(WireHash),
            blocks,
        }
    }

    fn level(hash: u64, old_value: i64, new_value: i64) -> TrtData {
        TrtData::Updated {
            block_hash: WireHash(hash),
            cache_level: Some(Diff {
                new_value,
                old_value,
            }),
            priority: None,
        }
    }

    fn removed(hashes: &[u64]) -> TrtData {
        TrtData::Removed {
            block_hashes: hashes.iter().copied().map(WireHash).collect(),
        }
    }

    fn sb(hash: u64, first: u32) -> StoredBlock {
        StoredBlock {
            engine_hash: EngineHash(hash),
            tokens_hash: tokens_hash(&ids(first), BASE_SEED),
        }
    }

    fn gone(hashes: &[u64]) -> KvEvent {
        KvEvent::Removed {
            blocks: hashes.iter().copied().map(EngineHash).collect(),
        }
    }

    /// Converts one event, returning its engine events and outcome.
    fn run(c: &mut RankConverter, data: TrtData) -> (Vec<KvEvent>, Outcome) {
        let mut out = Vec::new();
        let o = c.convert(data, BS, &mut out);
        (out, o)
    }

    #[test]
    fn created_records_capacity_and_emits_nothing() {
        let mut c = RankConverter::new();
        assert_eq!(c.capacity(), None);
        let (ev, o) = run(
            &mut c,
            TrtData::Created {
                num_blocks_per_cache_level: vec![8192, 1024],
            },
        );
        assert!(ev.is_empty());
        assert_eq!(o.created, Some(vec![8192, 1024]));
        assert_eq!(o.dropped(), None);
        assert_eq!(c.capacity(), Some(8192));
        assert!(c.remember);
    }

    #[test]
    fn stored_chain_under_a_parent() {
        let mut c = RankConverter::new();
        let (ev, o) = run(&mut c, stored(None, vec![block(11, 0, 0), block(12, 4, 0)]));
        assert_eq!(o, Outcome::default());
        assert_eq!(
            ev,
            vec![KvEvent::Stored {
                parent: None,
                blocks: vec![sb(11, 0), sb(12, 4)],
            }]
        );
        let (ev, _) = run(&mut c, stored(Some(12), vec![block(13, 8, 0)]));
        assert_eq!(
            ev,
            vec![KvEvent::Stored {
                parent: Some(EngineHash(12)),
                blocks: vec![sb(13, 8)],
            }]
        );
    }

    #[test]
    fn empty_stores_and_removals_do_nothing() {
        let mut c = RankConverter::new();
        assert_eq!(
            run(&mut c, stored(Some(1), vec![])),
            (vec![], Outcome::default())
        );
        assert_eq!(run(&mut c, removed(&[])), (vec![], Outcome::default()));
    }

    #[test]
    fn block_size_mismatch_drops_the_whole_event() {
        let mut c = RankConverter::new();
        // A short block before the last: the worker's blocks are smaller than the router's.
        let mut short = block(11, 0, 0);
        short.tokens.pop();
        let (ev, o) = run(&mut c, stored(None, vec![short, block(12, 4, 0)]));
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::BlockSizeMismatch));
        assert_eq!(o.block_size_mismatch, Some(BS - 1));
        // Nothing was remembered either: the block cannot be brought back.
        let (ev, o) = run(&mut c, level(12, 1, 0));
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::Other));
        // A long block anywhere, the last one included.
        let mut long = block(13, 4, 0);
        long.tokens.push(TrtToken::text(9));
        let (ev, o) = run(&mut c, stored(None, vec![block(11, 0, 0), long]));
        assert!(ev.is_empty());
        assert_eq!(o.block_size_mismatch, Some(BS + 1));

        let mut out = Vec::new();
        let o = c.convert(stored(None, vec![block(11, 0, 0)]), 0, &mut out);
        assert!(out.is_empty());
        assert_eq!(
            (o.dropped(), o.block_size_mismatch),
            (Some(DropReason::BlockSizeMismatch), None)
        );
        // The router's block size is what counts: a worker's 4-token blocks at 8 are foreign
        // (seen as soon as a chain has two), at 2 too.
        let two = || stored(None, vec![block(11, 0, 0), block(12, 4, 0)]);
        let o = c.convert(two(), 2 * BS, &mut out);
        assert_eq!(o.block_size_mismatch, Some(BS));
        let o = c.convert(two(), BS / 2, &mut out);
        assert_eq!(o.block_size_mismatch, Some(BS));
        assert!(out.is_empty());
    }

    #[test]
    fn a_partial_last_block_is_ignored_with_its_later_events() {
        let mut c = RankConverter::new();
        let mut partial = block(3, 8, 0);
        partial.tokens.truncate(1);
        let (ev, o) = run(
            &mut c,
            stored(None, vec![block(1, 0, 0), block(2, 4, 0), partial]),
        );
        assert_eq!(o, Outcome::default());
        assert_eq!(
            ev,
            vec![KvEvent::Stored {
                parent: None,
                blocks: vec![sb(1, 0), sb(2, 4)],
            }]
        );
        // Its level changes and its removal name no block of the index.
        assert_eq!(run(&mut c, level(3, 0, 1)), (vec![], Outcome::default()));
        assert_eq!(run(&mut c, level(3, 1, 0)), (vec![], Outcome::default()));
        assert_eq!(
            run(&mut c, removed(&[2, 3])),
            (vec![gone(&[2])], Outcome::default())
        );
        // Forgotten once removed: the hash is an ordinary one again.
        assert!(c.partial.is_empty());
        // A chain of one partial block stores nothing.
        let mut partial = block(4, 0, 0);
        partial.tokens.truncate(BS as usize - 1);
        assert_eq!(
            run(&mut c, stored(Some(1), vec![partial])),
            (vec![], Outcome::default())
        );
        c.reset();
        assert!(c.partial.is_empty());
    }

    #[test]
    fn mixed_levels_split_the_chain_into_gpu_runs() {
        let mut c = RankConverter::new();
        let chain = vec![
            block(1, 0, 0),
            block(2, 4, 1),
            block(3, 8, 0),
            block(4, 12, 0),
            block(5, 16, 1),
        ];
        let (ev, o) = run(&mut c, stored(Some(99), chain));
        assert_eq!(o, Outcome::default());
        assert_eq!(
            ev,
            vec![
                KvEvent::Stored {
                    parent: Some(EngineHash(99)),
                    blocks: vec![sb(1, 0)],
                },
                KvEvent::Stored {
                    parent: Some(EngineHash(2)),
                    blocks: vec![sb(3, 8), sb(4, 12)],
                },
            ]
        );
        // The host blocks were remembered: 5 comes back under 4.
        let (ev, _) = run(&mut c, level(5, 1, 0));
        assert_eq!(
            ev,
            vec![KvEvent::Stored {
                parent: Some(EngineHash(4)),
                blocks: vec![sb(5, 16)],
            }]
        );
        // A chain entirely off the GPU stores nothing.
        let (ev, o) = run(&mut c, stored(None, vec![block(6, 0, 1), block(7, 4, 1)]));
        assert!(ev.is_empty());
        assert_eq!(o, Outcome::default());
    }

    #[test]
    fn offload_then_onboard_round_trip() {
        let mut c = RankConverter::new();
        let _ = run(
            &mut c,
            stored(Some(7), vec![block(8, 0, 0), block(9, 4, 0)]),
        );
        let (ev, o) = run(&mut c, level(9, 0, 1));
        assert_eq!((ev, o), (vec![gone(&[9])], Outcome::default()));
        let (ev, o) = run(&mut c, level(9, 1, 0));
        assert_eq!(o, Outcome::default());
        assert_eq!(
            ev,
            vec![KvEvent::Stored {
                parent: Some(EngineHash(8)),
                blocks: vec![sb(9, 4)],
            }]
        );
        // Already on the GPU: brought back twice is an inconsistency, not a second copy.
        let (ev, o) = run(&mut c, level(9, 1, 0));
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::Other));
    }

    #[test]
    fn onboarding_an_unknown_block_is_dropped() {
        let mut c = RankConverter::new();
        let (ev, o) = run(&mut c, level(42, 1, 0));
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::Other));
        // Offloading an unknown block still removes it (the index must not keep it).
        let (ev, o) = run(&mut c, level(42, 0, 1));
        assert_eq!((ev, o.dropped()), (vec![gone(&[42])], None));
    }

    #[test]
    fn priority_only_and_non_gpu_moves_do_nothing() {
        let mut c = RankConverter::new();
        let _ = run(&mut c, stored(None, vec![block(1, 0, 0)]));
        let priority = TrtData::Updated {
            block_hash: WireHash(1),
            cache_level: None,
            priority: Some(Diff {
                new_value: 90,
                old_value: 35,
            }),
        };
        for data in [priority, level(1, 0, 0), level(1, 1, 2), level(1, 2, 1)] {
            assert_eq!(run(&mut c, data), (vec![], Outcome::default()));
        }
    }

    #[test]
    fn removed_skips_offloaded_blocks() {
        let mut c = RankConverter::new();
        let _ = run(
            &mut c,
            stored(None, vec![block(1, 0, 0), block(2, 4, 0), block(3, 8, 1)]),
        );
        let _ = run(&mut c, level(2, 0, 1));
        // 1 is on the GPU, 2 and 3 on the host, 77 unknown (removed: never kept wrongly).
        let (ev, o) = run(&mut c, removed(&[1, 2, 3, 77]));
        assert_eq!((ev, o), (vec![gone(&[1, 77])], Outcome::default()));
        // Host-only removals emit nothing.
        let _ = run(&mut c, stored(None, vec![block(4, 0, 1)]));
        assert_eq!(run(&mut c, removed(&[4])), (vec![], Outcome::default()));
        // Forgotten: they cannot come back.
        let (_, o) = run(&mut c, level(2, 1, 0));
        assert_eq!(o.dropped(), Some(DropReason::Other));
        assert!(c.blocks.is_empty());
    }

    #[test]
    fn lora_id_and_extra_ids_change_the_tokens_hash() {
        let mut c = RankConverter::new();
        let mut lora = block(1, 0, 0);
        lora.lora_id = Some(3);
        let mut image = block(2, 0, 0);
        image.tokens[1].token_extra_id = 0xfeed;
        let (ev, _) = run(&mut c, stored(None, vec![lora, image, block(3, 0, 0)]));
        let KvEvent::Stored { blocks, .. } = &ev[0] else {
            panic!("{ev:?}")
        };
        let t = ids(0);
        assert_eq!(blocks[0].tokens_hash, tokens_hash(&t, lora_seed(Some("3"))));
        assert_eq!(
            blocks[1].tokens_hash,
            tokens_hash_with_extras(&t, &[0, 0xfeed, 0, 0], BASE_SEED)
        );
        assert_eq!(blocks[2].tokens_hash, tokens_hash(&t, BASE_SEED));
        assert_ne!(blocks[0].tokens_hash, blocks[2].tokens_hash);
        assert_ne!(blocks[1].tokens_hash, blocks[2].tokens_hash);
    }

    #[test]
    fn unknown_events_are_dropped_as_other() {
        let mut c = RankConverter::new();
        let (ev, o) = run(&mut c, TrtData::Unknown);
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::Other));
    }

    #[test]
    fn no_secondary_level_stops_remembering() {
        let mut c = RankConverter::new();
        let _ = run(&mut c, stored(None, vec![block(1, 0, 0)]));
        assert_eq!(c.blocks.len(), 1);
        let (_, o) = run(
            &mut c,
            TrtData::Created {
                num_blocks_per_cache_level: vec![4096, 0],
            },
        );
        assert_eq!(o.created, Some(vec![4096, 0]));
        assert!(c.blocks.is_empty() && !c.remember);
        let (ev, _) = run(&mut c, stored(None, vec![block(2, 0, 0)]));
        assert_eq!(ev.len(), 1);
        assert!(c.blocks.is_empty());
        // Without memory every removal is a GPU removal, and nothing can come back.
        assert_eq!(run(&mut c, level(2, 0, 1)).0, vec![gone(&[2])]);
        assert_eq!(
            run(&mut c, level(2, 1, 0)).1.dropped(),
            Some(DropReason::Other)
        );
        assert_eq!(run(&mut c, removed(&[1])).0, vec![gone(&[1])]);
        // GPU-only `created` without a host entry at all: the same.
        let (_, o) = run(
            &mut c,
            TrtData::Created {
                num_blocks_per_cache_level: vec![4096],
            },
        );
        assert_eq!(o.created, Some(vec![4096]));
        assert!(!c.remember);
        // A server that offloads turns memory back on.
        let _ = run(
            &mut c,
            TrtData::Created {
                num_blocks_per_cache_level: vec![4096, 2048],
            },
        );
        let _ = run(&mut c, stored(None, vec![block(3, 0, 0)]));
        assert_eq!(c.blocks.len(), 1);
    }

    #[test]
    fn reset_forgets_blocks_but_keeps_capacity() {
        let mut c = RankConverter::new();
        let _ = run(
            &mut c,
            TrtData::Created {
                num_blocks_per_cache_level: vec![100, 50],
            },
        );
        let _ = run(&mut c, stored(None, vec![block(1, 0, 1)]));
        c.reset();
        assert_eq!(c.capacity(), Some(100));
        let (ev, o) = run(&mut c, level(1, 1, 0));
        assert!(ev.is_empty());
        assert_eq!(o.dropped(), Some(DropReason::Other));
        // Not remembered as offloaded any more: a removal is passed on.
        assert_eq!(run(&mut c, removed(&[1])).0, vec![gone(&[1])]);
    }

    #[test]
    fn remembered_entry_size() {
        // The module docs quote this size for the memory cost.
        assert_eq!(
            std::mem::size_of::<(u64, Remembered)>(),
            40,
            "update the module docs' memory cost"
        );
    }
}
