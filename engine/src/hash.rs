//! Block hashing, exactly as DESIGN.md "Vocabulary" defines it.
//!
//! * `tokens_hash` = XXH3-64 with seed 1337 over one block's token ids as little-endian u32.
//!   With a LoRA adapter the seed is `1337 + xxh3_64(adapter name)` (wrapping), so base and
//!   adapter blocks with equal tokens never collide.
//! * With per-token extra ids (TensorRT-LLM's multimodal `token_extra_id`), a block whose
//!   extras are not all 0 hashes its token ids and then its extra ids
//!   ([`tokens_hash_with_extras`]); an all-zero block hashes as plain `tokens_hash`.
//! * `seq_hash` chains: block 0's is its tokens_hash; block i's is XXH3-64 (seed 1337) of
//!   `seq_hash[i-1].to_le_bytes() ++ tokens_hash[i].to_le_bytes()`.
//! * Extra keys other than the LoRA adapter (vLLM's `cache_salt`, multimodal items, prompt
//!   embedding digests; see [`ExtraKey`]) are folded into the block's tokens_hash:
//!   `tokens_hash' = XXH3-64(seed 1337)(tokens_hash.to_le_bytes() ++ extras_digest.to_le_bytes())`
//!   where `extras_digest` is [`extras_digest`] of the block's items in order. A block without
//!   such items keeps its plain tokens_hash, so the reference vectors and LoRA seeds are
//!   unchanged. vLLM puts the salt in block 0's key only; since seq_hashes chain, every block
//!   of a salted prompt differs from the unsalted one ([`seq_hashes_salted`]).
//!
//! These match NVIDIA Dynamo's router, so Dynamo workers and kvengine agree on every hash.
//!
//! # Invariants
//! 1. Only full blocks are hashed; a trailing partial block is ignored.
//! 2. Hashing a request is one pass over its tokens with one reusable byte buffer.

use crate::ids::{SeqHash, TokensHash};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed of every block hash without a LoRA adapter.
pub const BASE_SEED: u64 = 1337;

/// Default tokens per block (must equal the engines' page size).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The seed that namespaces an adapter's blocks; `None` is the base model.
pub fn lora_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None => BASE_SEED,
        Some(name) => BASE_SEED.wrapping_add(xxh3_64(name.as_bytes())),
    }
}

/// Hash one block of token ids with `seed` (see [`lora_seed`]).
pub fn tokens_hash(tokens: &[u32], seed: u64) -> TokensHash {
    let mut buf = Vec::with_capacity(tokens.len() * 4);
    TokensHash(hash_block_into(&mut buf, tokens, seed))
}

/// The seq_hash of a block whose parent prefix is `parent` (`None` for the first block).
#[inline]
pub fn seq_hash(parent: Option<SeqHash>, block: TokensHash) -> SeqHash {
    match parent {
        None => SeqHash(block.0),
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.0.to_le_bytes());
            bytes[8..].copy_from_slice(&block.0.to_le_bytes());
            SeqHash(xxh3_64_with_seed(&bytes, BASE_SEED))
        }
    }
}

/// The tokens_hash of every full block of `tokens`.
pub fn tokens_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<TokensHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut buf = Vec::with_capacity(block_size * 4);
    tokens
        .chunks_exact(block_size)
        .map(|block| TokensHash(hash_block_into(&mut buf, block, seed)))
        .collect()
}

/// The seq_hash of every full block of `tokens`, in one pass.
///
/// A `block_size` of zero yields no blocks (callers validate the size up front).
pub fn seq_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<SeqHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_seq_hashes(&mut out, None, tokens, block_size, seed);
    out
}

/// Appends the seq_hashes of `tokens`' full blocks, chained onto `parent`, to `out`.
pub fn extend_seq_hashes(
    out: &mut Vec<SeqHash>,
    parent: Option<SeqHash>,
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) {
    if block_size == 0 {
        return;
    }
    let mut buf = Vec::with_capacity(block_size * 4);
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size) {
        let s = seq_hash(prev, TokensHash(hash_block_into(&mut buf, block, seed)));
        out.push(s);
        prev = Some(s);
    }
}

/// Chains precomputed tokens hashes onto `parent`.
pub fn chain(parent: Option<SeqHash>, blocks: &[TokensHash]) -> Vec<SeqHash> {
    let mut prev = parent;
    blocks
        .iter()
        .map(|&b| {
            let s = seq_hash(prev, b);
            prev = Some(s);
            s
        })
        .collect()
}

/// One extra key of a block besides its tokens and its LoRA adapter (the adapter is in the
/// seed, [`lora_seed`]), as vLLM keys its blocks (`generate_block_hash_extra_keys`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// The request's `cache_salt` (vLLM keys only the block starting at token 0 with it).
    CacheSalt(String),
    /// A multimodal item overlapping the block: its identifier (vLLM's `mm_hash` /
    /// `identifier`) and its start offset relative to the block (may be negative in principle;
    /// vLLM writes the offset it computed).
    Multimodal {
        /// The item's identifier.
        identifier: String,
        /// Its offset as vLLM publishes it.
        offset: i64,
    },
    /// The digest of the block's prompt embeddings (vLLM: SHA-256 bytes).
    PromptEmbeds(Vec<u8>),
}

/// Tag bytes of the canonical encoding of [`ExtraKey`] items ([`extras_digest`]).
const TAG_SALT: u8 = 1;
const TAG_MM: u8 = 2;
const TAG_EMBEDS: u8 = 3;

/// Appends one item's canonical encoding: a tag byte, the byte length of its payload as u64
/// little-endian, the payload; for a multimodal item the offset follows as i64 little-endian.
fn encode_item(buf: &mut Vec<u8>, tag: u8, payload: &[u8]) {
    buf.push(tag);
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
}

fn encode_extra(buf: &mut Vec<u8>, key: &ExtraKey) {
    match key {
        ExtraKey::CacheSalt(s) => encode_item(buf, TAG_SALT, s.as_bytes()),
        ExtraKey::Multimodal { identifier, offset } => {
            encode_item(buf, TAG_MM, identifier.as_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
        }
        ExtraKey::PromptEmbeds(b) => encode_item(buf, TAG_EMBEDS, b),
    }
}

/// The digest of a block's non-LoRA extra keys: XXH3-64 (seed 0) over the concatenated
/// canonical encodings of `items`, in order. Each item is encoded as
///
/// * cache salt: `0x01`, `len(utf8) as u64 LE`, the salt's UTF-8 bytes;
/// * multimodal item: `0x02`, `len(identifier) as u64 LE`, the identifier's UTF-8 bytes,
///   `offset as i64 LE`;
/// * prompt embeds: `0x03`, `len(digest) as u64 LE`, the digest bytes.
///
/// The length prefixes make the encoding injective, so different item lists never share an
/// encoding. `None` for an empty list (such a block is not folded).
pub fn extras_digest(items: &[ExtraKey]) -> Option<u64> {
    if items.is_empty() {
        return None;
    }
    let mut buf = Vec::new();
    for item in items {
        encode_extra(&mut buf, item);
    }
    Some(xxh3_64(&buf))
}

/// Folds an extras digest into a block's tokens_hash:
/// `XXH3-64(seed 1337)(tokens_hash.to_le_bytes() ++ digest.to_le_bytes())`.
#[inline]
pub fn fold_digest(block: TokensHash, digest: u64) -> TokensHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&block.0.to_le_bytes());
    bytes[8..].copy_from_slice(&digest.to_le_bytes());
    TokensHash(xxh3_64_with_seed(&bytes, BASE_SEED))
}

/// A block's tokens_hash with its non-LoRA extra keys folded in ([`fold_digest`] of
/// [`extras_digest`]); `block` itself when `items` is empty.
pub fn fold_extras(block: TokensHash, items: &[ExtraKey]) -> TokensHash {
    match extras_digest(items) {
        None => block,
        Some(d) => fold_digest(block, d),
    }
}

/// The extras digest of a block whose only extra key is the cache salt `salt`: equal to
/// `extras_digest(&[ExtraKey::CacheSalt(salt.into())])`, without the allocation.
pub fn salt_digest(salt: &str) -> u64 {
    let mut buf = Vec::with_capacity(9 + salt.len());
    encode_item(&mut buf, TAG_SALT, salt.as_bytes());
    xxh3_64(&buf)
}

/// A request's cache salt as vLLM applies it: an empty salt is no salt (vLLM tests the salt's
/// truthiness).
#[inline]
pub fn effective_salt(cache_salt: Option<&str>) -> Option<&str> {
    cache_salt.filter(|s| !s.is_empty())
}

/// The seq_hash of every full block of a request's `tokens` with its `cache_salt` (see
/// [`effective_salt`]): block 0's tokens_hash is folded with [`salt_digest`], later blocks
/// are plain and differ through the chain. Without a salt this is [`seq_hashes`].
pub fn seq_hashes_salted(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    cache_salt: Option<&str>,
) -> Vec<SeqHash> {
    let Some(salt) = effective_salt(cache_salt) else {
        return seq_hashes(tokens, block_size, seed);
    };
    if block_size == 0 || tokens.len() < block_size {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let (head, rest) = tokens.split_at(block_size);
    let first = SeqHash(fold_digest(tokens_hash(head, seed), salt_digest(salt)).0);
    out.push(first);
    extend_seq_hashes(&mut out, Some(first), rest, block_size, seed);
    out
}

#[inline]
fn hash_block_into(buf: &mut Vec<u8>, block: &[u32], seed: u64) -> u64 {
    buf.clear();
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, seed)
}

/// Hash one block of token ids together with their extra ids (TensorRT-LLM's
/// `token_extra_id`, non-zero for multimodal placeholder tokens), with `seed` (see
/// [`lora_seed`]).
///
/// When every extra id is 0 (or `extras` is empty) this is exactly [`tokens_hash`], so a
/// text-only block hashes the same whatever engine reported it. Otherwise it is XXH3-64 with
/// `seed` over the token ids as little-endian u32 followed by the extra ids as little-endian
/// u64: a multimodal block never matches a text-only block with the same placeholder ids
/// (two images behind the same placeholder tokens differ in their extra ids). Callers pass one
/// extra id per token; the bytes hashed are `tokens` then `extras`, whatever their lengths.
pub fn tokens_hash_with_extras(tokens: &[u32], extras: &[u64], seed: u64) -> TokensHash {
    if extras.iter().all(|&e| e == 0) {
        return tokens_hash(tokens, seed);
    }
    let mut buf = Vec::with_capacity(tokens.len() * 4 + extras.len() * 8);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    for e in extras {
        buf.extend_from_slice(&e.to_le_bytes());
    }
    TokensHash(xxh3_64_with_seed(&buf, seed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_reference_vectors() {
        let t0 = tokens_hash(&[1, 2, 3, 4], BASE_SEED);
        let t1 = tokens_hash(&[5, 6, 7, 8], BASE_SEED);
        assert_eq!(t0, TokensHash(14643705804678351452));
        assert_eq!(t1, TokensHash(16777012769546811212));
        assert_eq!(
            seq_hash(Some(SeqHash(t0.0)), t1),
            SeqHash(4945711292740353085)
        );
        assert_eq!(
            seq_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, BASE_SEED),
            vec![SeqHash(t0.0), SeqHash(4945711292740353085)]
        );
    }

    #[test]
    fn shared_fixture_vectors_when_present() {
        // ../shared is not part of the product; the check runs only where the fixture exists.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/data/kv_events/hash_vectors.json"
        );
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<u32> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let bs = v["block_size"].as_u64().unwrap() as usize;
        let local: Vec<u64> = tokens_hashes(&tokens, bs, BASE_SEED)
            .iter()
            .map(|h| h.0)
            .collect();
        let want_local: Vec<u64> = v["dynamo"]["local_block_hash_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(local, want_local);
        let seq: Vec<u64> = seq_hashes(&tokens, bs, BASE_SEED)
            .iter()
            .map(|h| h.0)
            .collect();
        let want_seq: Vec<u64> = v["dynamo"]["sequence_hash_u64_seed1337"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(seq, want_seq);
    }

    #[test]
    fn partial_trailing_block_is_ignored() {
        let full = seq_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, BASE_SEED);
        let partial = seq_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, BASE_SEED);
        assert_eq!(full, partial);
        assert!(seq_hashes(&[1, 2, 3], 4, BASE_SEED).is_empty());
        assert!(seq_hashes(&[1, 2, 3], 0, BASE_SEED).is_empty());
    }

    #[test]
    fn lora_blocks_differ_from_base() {
        let base = seq_hashes(&[1, 2, 3, 4], 4, lora_seed(None));
        let lora = seq_hashes(&[1, 2, 3, 4], 4, lora_seed(Some("adapter-a")));
        let other = seq_hashes(&[1, 2, 3, 4], 4, lora_seed(Some("adapter-b")));
        assert_ne!(base, lora);
        assert_ne!(lora, other);
        assert_eq!(lora_seed(Some("x")), BASE_SEED.wrapping_add(xxh3_64(b"x")));
    }

    #[test]
    fn chain_matches_one_pass_hashing() {
        let tokens: Vec<u32> = (0..64).collect();
        let th = tokens_hashes(&tokens, 16, BASE_SEED);
        assert_eq!(chain(None, &th), seq_hashes(&tokens, 16, BASE_SEED));
        let mut out = vec![];
        let head = seq_hashes(&tokens[..32], 16, BASE_SEED);
        extend_seq_hashes(&mut out, head.last().copied(), &tokens[32..], 16, BASE_SEED);
        assert_eq!(out, seq_hashes(&tokens, 16, BASE_SEED)[2..]);
    }

    #[test]
    fn salted_prompt_differs_in_every_block() {
        let tokens: Vec<u32> = (0..64).collect();
        let plain = seq_hashes(&tokens, 16, BASE_SEED);
        let a = seq_hashes_salted(&tokens, 16, BASE_SEED, Some("tenant-a"));
        let b = seq_hashes_salted(&tokens, 16, BASE_SEED, Some("tenant-b"));
        assert_eq!(a.len(), 4);
        for i in 0..4 {
            assert_ne!(a[i], plain[i], "block {i}");
            assert_ne!(a[i], b[i], "block {i}");
        }
        // Blocks 1.. are plain tokens hashes chained onto the salted block 0.
        let th = tokens_hashes(&tokens, 16, BASE_SEED);
        let salted0 = fold_extras(th[0], &[ExtraKey::CacheSalt("tenant-a".into())]);
        let mut blocks = th.clone();
        blocks[0] = salted0;
        assert_eq!(chain(None, &blocks), a);
        // Same salt, same hashes; an empty salt is no salt.
        assert_eq!(
            seq_hashes_salted(&tokens, 16, BASE_SEED, Some("tenant-a")),
            a
        );
        assert_eq!(seq_hashes_salted(&tokens, 16, BASE_SEED, Some("")), plain);
        assert_eq!(seq_hashes_salted(&tokens, 16, BASE_SEED, None), plain);
        // Partial blocks and a zero block size behave as in `seq_hashes`.
        assert!(seq_hashes_salted(&tokens[..15], 16, BASE_SEED, Some("s")).is_empty());
        assert!(seq_hashes_salted(&tokens, 0, BASE_SEED, Some("s")).is_empty());
        assert_eq!(
            seq_hashes_salted(&tokens[..20], 16, BASE_SEED, Some("tenant-a")),
            a[..1]
        );
    }

    #[test]
    fn salt_folding_follows_the_definition() {
        // Spelled out from the documented encoding: 0x01, len as u64 LE, UTF-8 bytes.
        let mut enc = vec![1u8];
        enc.extend_from_slice(&5u64.to_le_bytes());
        enc.extend_from_slice(b"salty");
        let digest = xxh3_64(&enc);
        assert_eq!(salt_digest("salty"), digest);
        assert_eq!(
            extras_digest(&[ExtraKey::CacheSalt("salty".into())]),
            Some(digest)
        );
        let t0 = tokens_hash(&[1, 2, 3, 4], BASE_SEED);
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&t0.0.to_le_bytes());
        bytes.extend_from_slice(&digest.to_le_bytes());
        let want = xxh3_64_with_seed(&bytes, BASE_SEED);
        assert_eq!(
            seq_hashes_salted(&[1, 2, 3, 4], 4, BASE_SEED, Some("salty")),
            vec![SeqHash(want)]
        );
        assert_eq!(extras_digest(&[]), None);
        assert_eq!(fold_extras(t0, &[]), t0);
    }

    #[test]
    fn extra_key_kinds_and_order_are_distinct() {
        let t = tokens_hash(&[9, 9, 9, 9], BASE_SEED);
        let salt = ExtraKey::CacheSalt("x".into());
        let mm = ExtraKey::Multimodal {
            identifier: "x".into(),
            offset: 0,
        };
        let mm4 = ExtraKey::Multimodal {
            identifier: "x".into(),
            offset: 4,
        };
        let emb = ExtraKey::PromptEmbeds(b"x".to_vec());
        let all = [
            fold_extras(t, std::slice::from_ref(&salt)),
            fold_extras(t, std::slice::from_ref(&mm)),
            fold_extras(t, std::slice::from_ref(&mm4)),
            fold_extras(t, std::slice::from_ref(&emb)),
            fold_extras(t, &[mm.clone(), salt.clone()]),
            fold_extras(t, &[salt, mm]),
            t,
        ];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "{i} vs {j}");
            }
        }
        // Length prefixes: ("ab") and ("a", "b") encode differently.
        assert_ne!(
            extras_digest(&[ExtraKey::CacheSalt("ab".into())]),
            extras_digest(&[
                ExtraKey::CacheSalt("a".into()),
                ExtraKey::CacheSalt("b".into())
            ])
        );
    }

    #[test]
    fn lora_and_salt_compose_and_lora_alone_is_unchanged() {
        let tokens: Vec<u32> = (0..32).collect();
        let seed = lora_seed(Some("adapter"));
        assert_eq!(
            seq_hashes_salted(&tokens, 16, seed, None),
            seq_hashes(&tokens, 16, seed)
        );
        let both = seq_hashes_salted(&tokens, 16, seed, Some("s"));
        assert_ne!(both, seq_hashes_salted(&tokens, 16, BASE_SEED, Some("s")));
        assert_ne!(both, seq_hashes(&tokens, 16, seed));
        let th = tokens_hashes(&tokens, 16, seed);
        assert_eq!(
            both[0],
            SeqHash(fold_extras(th[0], &[ExtraKey::CacheSalt("s".into())]).0)
        );
    }

    #[test]
    fn extras_all_zero_hash_as_plain_tokens() {
        let tokens: Vec<u32> = (100..132).collect();
        let seed = lora_seed(Some("3"));
        assert_eq!(
            tokens_hash_with_extras(&tokens, &[0; 32], seed),
            tokens_hash(&tokens, seed)
        );
        assert_eq!(
            tokens_hash_with_extras(&tokens, &[], BASE_SEED),
            tokens_hash(&tokens, BASE_SEED)
        );
    }

    #[test]
    fn one_non_zero_extra_changes_the_hash() {
        let tokens = [7u32; 4];
        let text = tokens_hash_with_extras(&tokens, &[0, 0, 0, 0], BASE_SEED);
        let image_a = tokens_hash_with_extras(&tokens, &[0, 0, 0, 1], BASE_SEED);
        let image_b = tokens_hash_with_extras(&tokens, &[0, 0, 0, 2], BASE_SEED);
        assert_ne!(text, image_a);
        assert_ne!(image_a, image_b);
        assert_ne!(
            image_a,
            tokens_hash_with_extras(&tokens, &[0, 0, 0, 1], lora_seed(Some("a")))
        );
    }

    #[test]
    fn extras_fixed_vector_from_the_definition() {
        // The definition, spelled out with xxhash_rust: u32 LE token ids, then u64 LE extras.
        let tokens = [1u32, 2, 3, 4];
        let extras = [0u64, 0xdead_beef, 0, 1 << 40];
        let mut bytes = Vec::new();
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        for e in extras {
            bytes.extend_from_slice(&e.to_le_bytes());
        }
        assert_eq!(bytes.len(), 4 * 4 + 4 * 8);
        let want = xxh3_64_with_seed(&bytes, BASE_SEED);
        // Pinned once from the line above, so a change to xxhash_rust itself shows too.
        assert_eq!(want, 7794040231365195869);
        assert_eq!(
            tokens_hash_with_extras(&tokens, &extras, BASE_SEED),
            TokensHash(want)
        );
        assert_ne!(want, tokens_hash(&tokens, BASE_SEED).0);
    }
}
