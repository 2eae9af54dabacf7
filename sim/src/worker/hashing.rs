//! The simulated worker's own block ids ("engine hashes").
//!
//! A real engine names its blocks with its own hash, which kvengine never recomputes: vLLM
//! hashes `(parent block hash, block tokens, extra keys such as the LoRA name)` with
//! sha256/xxhash over CBOR. The simulator does the same shape of thing with XXH3-64 and a seed
//! of its own, so an engine hash never equals kvengine's seq_hash for the same prefix and the
//! engine's per-worker directory (engine hash -> seq_hash) is really exercised.
//!
//! # Invariants
//! 1. An engine hash names a whole prefix: it chains the parent's engine hash, like vLLM's.
//! 2. The LoRA namespace is part of the hash, so base and adapter blocks never share an id.
//! 3. [`ENGINE_HASH_SEED`] differs from [`engine::hash::BASE_SEED`].

use engine::EngineHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the simulated engine's block hashes (not kvengine's 1337).
pub const ENGINE_HASH_SEED: u64 = 0x5eed_0f51_174b_5c00;

/// Stands in for the missing parent of a sequence's first block (vLLM's `NONE_HASH`).
const NONE_HASH: u64 = 0x6e6f_6e65_5f68_6173;

/// The engine hash of `block` (its token ids) whose parent block is `parent`, in the
/// namespace `extra` (the request's LoRA seed). `buf` is scratch space, reused across calls.
pub fn engine_hash(
    buf: &mut Vec<u8>,
    parent: Option<EngineHash>,
    extra: u64,
    block: &[u32],
) -> EngineHash {
    buf.clear();
    buf.extend_from_slice(&parent.map_or(NONE_HASH, |p| p.0).to_le_bytes());
    buf.extend_from_slice(&extra.to_le_bytes());
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    EngineHash(xxh3_64_with_seed(buf, ENGINE_HASH_SEED))
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::hash::{BASE_SEED, lora_seed, seq_hashes};

    #[test]
    fn engine_hashes_chain_and_differ_from_seq_hashes() {
        const { assert!(ENGINE_HASH_SEED != BASE_SEED) };
        let mut buf = Vec::new();
        let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let e0 = engine_hash(&mut buf, None, lora_seed(None), &tokens[..4]);
        let e1 = engine_hash(&mut buf, Some(e0), lora_seed(None), &tokens[4..]);
        let seqs = seq_hashes(&tokens, 4, BASE_SEED);
        assert_ne!(e0.0, seqs[0].0);
        assert_ne!(e1.0, seqs[1].0);
        // Same tokens, different parent or namespace: different id.
        assert_ne!(
            e1,
            engine_hash(&mut buf, None, lora_seed(None), &tokens[4..])
        );
        assert_ne!(
            e0,
            engine_hash(&mut buf, None, lora_seed(Some("a")), &tokens[..4])
        );
        assert_eq!(
            e0,
            engine_hash(&mut buf, None, lora_seed(None), &tokens[..4])
        );
    }
}
