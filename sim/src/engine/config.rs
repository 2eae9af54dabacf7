//! The shape of one simulated engine: its KV cache, its scheduler limits and its speed.
//!
//! # Invariants
//! 1. A config that passed [`EngineConfig::validate`] has a non-empty cache of non-empty
//!    blocks, admits at least one sequence and schedules at least one token per step, so the
//!    engine always makes progress while it has work.

use super::timing::TimingModel;
use crate::error::{Result, SimError};

/// One engine (one data-parallel rank): cache shape, scheduler limits and timing.
///
/// The defaults model vLLM serving an 8B model in bf16 on one H100 80GB:
/// `gpu_memory_utilization` 0.9 leaves about 56 GB for the KV cache after the 16 GB of
/// weights; one 16-token block of Llama-3-8B's KV (32 layers x 8 KV heads x 128 dims x K and
/// V x 2 bytes = 128 KiB per token) takes 2 MiB, hence about 28,000 blocks (450k tokens).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Pages in the KV cache: `1..u32::MAX`.
    pub kv_blocks: u32,
    /// Tokens per page (vLLM's `--block-size`, the router's block size): at least 1.
    pub block_size: u32,
    /// Most requests running at once (vLLM's `--max-num-seqs`): at least 1.
    pub max_num_seqs: u32,
    /// Most tokens computed in one step, prefill and decode together (vLLM's
    /// `--max-num-batched-tokens`): at least 1.
    pub max_num_batched_tokens: u32,
    /// The data-parallel rank stamped on every published event batch.
    pub dp_rank: u32,
    /// How long a step takes.
    pub timing: TimingModel,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_blocks: 28_000,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            dp_rank: 0,
            timing: TimingModel::default(),
        }
    }
}

impl EngineConfig {
    /// Rejects a value outside its documented range.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason| Err(SimError::InvalidConfig { name, reason });
        if self.kv_blocks == 0 || self.kv_blocks == u32::MAX {
            return bad("kv_blocks", "must be within 1..4294967295");
        }
        if self.block_size == 0 {
            return bad("block_size", "must be positive");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs", "must be positive");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens", "must be positive");
        }
        Ok(())
    }

    /// Tokens the whole cache holds.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.kv_blocks) * u64::from(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_zeros_are_refused() {
        let ok = EngineConfig::default();
        ok.validate().unwrap();
        assert_eq!(ok.kv_tokens(), 448_000);
        for broken in [
            EngineConfig {
                kv_blocks: 0,
                ..ok.clone()
            },
            EngineConfig {
                kv_blocks: u32::MAX,
                ..ok.clone()
            },
            EngineConfig {
                block_size: 0,
                ..ok.clone()
            },
            EngineConfig {
                max_num_seqs: 0,
                ..ok.clone()
            },
            EngineConfig {
                max_num_batched_tokens: 0,
                ..ok.clone()
            },
        ] {
            assert!(matches!(
                broken.validate(),
                Err(SimError::InvalidConfig { .. })
            ));
        }
    }
}
