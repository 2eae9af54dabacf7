//! Request streams to drive simulated clusters with.
//!
//! * [`chat`]: an embedded, seeded generator of multi-turn chat traffic with prefix sharing
//!   (shared system prompts, growing sessions, interleaved). Needs no data file.
//! * [`mooncake`]: a loader for Mooncake-format JSONL traces (`hash_ids` of 512-token
//!   blocks), expanded into deterministic synthetic token ids.
//!
//! Both yield [`SimRequest`]s lazily, so a long workload never holds every prompt at once.
//! [`PrefixReuse`] measures what any cache could make of a workload (the routing-free bound).
//!
//! # Invariants
//! 1. Deterministic: the same configuration (seed included) or the same trace file yields
//!    the same requests, token for token.
//! 2. Equal prefixes mean equal tokens: two requests share their first `n` tokens exactly
//!    when the workload says they share a prefix that long (session history, system prompt,
//!    or equal trace `hash_ids`).

pub mod chat;
pub mod mooncake;

use std::sync::Arc;

use engine::hash::{lora_seed, seq_hashes};

/// Token ids are drawn below this (a typical tokenizer's vocabulary size).
pub const DEFAULT_VOCAB: u32 = 32_000;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// The LoRA adapter the request runs under (`None`: the base model).
    pub lora: Option<Arc<str>>,
    /// Tokens the answer has.
    pub output_tokens: u32,
    /// Arrival time, in milliseconds since the workload started (non-decreasing).
    pub arrival_ms: u64,
}

impl SimRequest {
    /// The adapter name, as the hashing functions take it.
    pub fn lora(&self) -> Option<&str> {
        self.lora.as_deref()
    }
}

/// SplitMix64's finaliser: a cheap, well-mixed bijection of `u64`, stable across versions
/// (unlike `rand`'s generators), for token ids that must never change.
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How much of a workload any cache could serve: the hit rate of one cache that holds every
/// block forever, whatever the routing. An upper bound for every mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixReuse {
    /// Requests seen.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Distinct blocks over all prompts (what a cache would need to hold everything).
    pub distinct_blocks: u64,
    /// Prompt tokens in leading blocks that an earlier request already had.
    pub reusable_tokens: u64,
}

impl PrefixReuse {
    /// Measures `requests` with blocks of `block_size` tokens (0 counts no block).
    pub fn measure(requests: impl IntoIterator<Item = SimRequest>, block_size: u32) -> Self {
        let mut seen = hashbrown::HashSet::new();
        let mut out = Self::default();
        for r in requests {
            let seqs = seq_hashes(&r.tokens, block_size as usize, lora_seed(r.lora()));
            let hit = seqs.iter().take_while(|s| seen.contains(*s)).count();
            seen.extend(seqs);
            out.requests += 1;
            out.prompt_tokens += r.tokens.len() as u64;
            out.reusable_tokens += hit as u64 * u64::from(block_size);
        }
        out.distinct_blocks = seen.len() as u64;
        out
    }

    /// `reusable_tokens / prompt_tokens` (0 for an empty workload).
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.reusable_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tokens: &[u32], lora: Option<&str>) -> SimRequest {
        SimRequest {
            tokens: tokens.to_vec(),
            lora: lora.map(Arc::from),
            output_tokens: 1,
            arrival_ms: 0,
        }
    }

    #[test]
    fn prefix_reuse_counts_leading_blocks_seen_before() {
        let r = PrefixReuse::measure(
            [
                req(&[1, 2, 3, 4, 5], None),
                req(&[1, 2, 3, 4, 9, 9], None),
                req(&[1, 2, 3, 4], Some("a")),
                req(&[7, 7, 3, 4], None),
            ],
            2,
        );
        assert_eq!(r.requests, 4);
        assert_eq!(r.prompt_tokens, 19);
        // [1,2][3,4] reused once; the adapter and the new first block share nothing.
        assert_eq!(r.reusable_tokens, 4);
        // [1,2] [3,4] | [9,9] | adapter [1,2] [3,4] | [7,7] [3,4]
        assert_eq!(r.distinct_blocks, 7);
        assert!((r.hit_rate() - 4.0 / 19.0).abs() < 1e-12);
        assert_eq!(PrefixReuse::default().hit_rate(), 0.0);
    }
}
