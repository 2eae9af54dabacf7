//! From a decoded [`WireBatch`] to the engine's [`KvEvent`]s for one worker.
//!
//! The router hashes the token ids itself ([`engine::hash::tokens_hash`]); the worker's
//! block hashes are kept only as opaque [`EngineHash`] ids. Nothing here fails: an event the
//! router cannot apply is dropped and counted under its [`DropReason`].

use crate::error::DropReason;
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{ExtraKey, fold_extras, lora_seed, tokens_hashes};
use engine::{DpRank, EngineHash};
use wire::kv_events::{WireBatch, WireEvent, WireExtraItem, WireExtraKeys};

/// The router's settings that decide whether an event can be applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvertConfig {
    /// Tokens per block (the engine's page size). A stored event with another block size is
    /// dropped; a zero here accepts no stores.
    pub block_size: u32,
}

/// The engine events of one batch, plus what was dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Converted {
    /// The batch's data-parallel rank (0 when the batch carries none).
    pub dp_rank: DpRank,
    /// The events to apply, in batch order.
    pub events: Vec<KvEvent>,
    /// Dropped events per reason, one entry per reason with a non-zero count. Each dropped
    /// event counts once (not once per block).
    pub drops: Vec<(DropReason, u64)>,
    /// The first foreign block size seen in this batch (a misconfigured router or worker).
    pub block_size_mismatch: Option<u32>,
}

/// Drop counters, in the order they are reported.
const REASONS: [DropReason; 5] = [
    DropReason::NonGpuMedium,
    DropReason::BlockSizeMismatch,
    DropReason::TokenCountMismatch,
    DropReason::MalformedMsgpack,
    DropReason::Other,
];

/// Converts one batch for one worker. Consumes the batch; never fails.
///
/// Per event, in this order:
/// * `Stored` / `Removed` with no block hashes: no event, nothing counted.
/// * `medium` present and not `"GPU"` (ASCII case-insensitive): dropped as
///   [`DropReason::NonGpuMedium`] (blocks offloaded to CPU or disk are not GPU cache hits).
/// * `Stored` with a `block_size` that differs from `cfg.block_size` (or any store when
///   `cfg.block_size` is 0): dropped as [`DropReason::BlockSizeMismatch`];
///   [`Converted::block_size_mismatch`] records the first such size.
/// * `Stored` whose token count is not `block_hashes.len() * cfg.block_size`: dropped as
///   [`DropReason::TokenCountMismatch`].
/// * `Stored` whose `extra_keys` is malformed (not one nil-or-list entry per block, or, with
///   `lora_name` set, a non-nil entry that does not start with that name): dropped as
///   [`DropReason::MalformedMsgpack`].
/// * Otherwise block `i` gets engine hash `block_hashes[i]` and tokens hash
///   `tokens_hash(token_ids[i*bs..(i+1)*bs], lora_seed(name))`, where `name` is `lora_name`,
///   or, when only a non-null `lora_id` is sent, that id's decimal string (so two adapters
///   with different ids never share blocks even without names). When `extra_keys[i]` holds
///   items besides the LoRA name (already in the seed, so not folded twice), they are folded
///   in with [`fold_extras`]: a bare string is the `cache_salt`
///   ([`ExtraKey::CacheSalt`]), an `[identifier, offset]` pair a multimodal item, a bin a
///   prompt-embeds digest, in the order sent. A request with the same salt hashes block 0
///   the same way ([`engine::hash::seq_hashes_salted`]).
///
/// The batch's unknown events are counted as [`DropReason::Other`].
pub fn convert(batch: WireBatch, cfg: &ConvertConfig) -> Converted {
    let mut counts = [0u64; REASONS.len()];
    let mut out = Converted {
        dp_rank: DpRank(batch.dp_rank.unwrap_or(0)),
        events: Vec::with_capacity(batch.events.len()),
        drops: Vec::new(),
        block_size_mismatch: None,
    };
    counts[4] = u64::from(batch.unknown_events);
    let bs = cfg.block_size as usize;
    for ev in batch.events {
        match ev {
            WireEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                medium,
                extra_keys,
            } => {
                if block_hashes.is_empty() {
                    continue;
                }
                if !is_gpu(medium.as_deref()) {
                    counts[0] += 1;
                    continue;
                }
                let foreign = block_size.filter(|&b| b != cfg.block_size);
                if foreign.is_some() || bs == 0 {
                    counts[1] += 1;
                    if out.block_size_mismatch.is_none() {
                        out.block_size_mismatch = foreign;
                    }
                    continue;
                }
                if block_hashes.len().checked_mul(bs) != Some(token_ids.len()) {
                    counts[2] += 1;
                    continue;
                }
                let extras =
                    match block_extras(extra_keys, block_hashes.len(), lora_name.as_deref()) {
                        Some(e) => e,
                        None => {
                            counts[3] += 1;
                            continue;
                        }
                    };
                let seed = match (lora_name, lora_id) {
                    (Some(name), _) => lora_seed(Some(&name)),
                    (None, Some(id)) => lora_seed(Some(&id.to_string())),
                    (None, None) => lora_seed(None),
                };
                let mut hashes = tokens_hashes(&token_ids, bs, seed);
                for (t, items) in hashes.iter_mut().zip(&extras) {
                    *t = fold_extras(*t, items);
                }
                let blocks = block_hashes
                    .iter()
                    .zip(hashes)
                    .map(|(&h, t)| StoredBlock {
                        engine_hash: EngineHash(h),
                        tokens_hash: t,
                    })
                    .collect();
                out.events.push(KvEvent::Stored {
                    parent: parent.map(EngineHash),
                    blocks,
                });
            }
            WireEvent::Removed {
                block_hashes,
                medium,
            } => {
                if block_hashes.is_empty() {
                    continue;
                }
                if !is_gpu(medium.as_deref()) {
                    counts[0] += 1;
                    continue;
                }
                out.events.push(KvEvent::Removed {
                    blocks: block_hashes.into_iter().map(EngineHash).collect(),
                });
            }
            WireEvent::Cleared => out.events.push(KvEvent::Cleared),
        }
    }
    out.drops = REASONS
        .iter()
        .zip(counts)
        .filter(|&(_, c)| c > 0)
        .map(|(&r, c)| (r, c))
        .collect();
    out
}

/// The non-LoRA extra keys of each of `blocks` blocks (empty lists when `extra_keys` is
/// absent); `None` when the list is malformed: a wrong length, or with `lora_name` set an
/// entry that does not start with that name.
fn block_extras(
    extra_keys: Option<WireExtraKeys>,
    blocks: usize,
    lora_name: Option<&str>,
) -> Option<Vec<Vec<ExtraKey>>> {
    let entries = match extra_keys {
        None => return Some(Vec::new()),
        Some(WireExtraKeys::Malformed) => return None,
        Some(WireExtraKeys::Blocks(e)) => e,
    };
    if entries.len() != blocks {
        return None;
    }
    entries
        .into_iter()
        .map(|entry| {
            let Some(items) = entry else {
                return Some(Vec::new());
            };
            let mut items = items.into_iter();
            if let Some(name) = lora_name {
                // vLLM lists the adapter's name first on every block of a LoRA request.
                match items.next() {
                    Some(WireExtraItem::Str(s)) if s == name => {}
                    _ => return None,
                }
            }
            Some(
                items
                    .map(|item| match item {
                        WireExtraItem::Str(s) => ExtraKey::CacheSalt(s),
                        WireExtraItem::Mm(identifier, offset) => {
                            ExtraKey::Multimodal { identifier, offset }
                        }
                        WireExtraItem::Bin(b) => ExtraKey::PromptEmbeds(b),
                    })
                    .collect(),
            )
        })
        .collect()
}

/// Whether a medium names GPU memory (absent means GPU: older publishers only report GPU).
fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}
