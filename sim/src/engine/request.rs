//! One request inside the engine: what the client asked for, how far it has been computed,
//! the pages it holds, and its synthetic output tokens.
//!
//! # Invariants
//! 1. `tokens` is the prompt followed by the outputs sampled so far; outputs never exceed
//!    `max_tokens`.
//! 2. `computed <= tokens.len()`, and a running request always has `computed <
//!    tokens.len()` (the last sampled token's KV is computed by the next step).
//! 3. `blocks` holds exactly the pages covering the first `computed` tokens
//!    (`ceil(computed / block_size)`); its first `committed` pages cache full blocks whose
//!    engine hashes are `hashes[..committed]`.
//! 4. `hashes[i]` is the engine hash of full block `i` of `tokens`, chained on `hashes[i -
//!    1]` ([`crate::worker::hashing::engine_hash`] in the request's LoRA namespace). Tokens
//!    never change, so hashes survive preemption.
//! 5. `remote` is set only until the request's first admission: a remote prefill is received
//!    once; a request preempted later recomputes its prompt here, as vLLM does.

use engine::{EngineHash, RequestId};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::worker::hashing::engine_hash;
use crate::worker::pool::BlockId;

/// A request as the client submits it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    /// Its id, unique among the engine's requests in flight.
    pub id: RequestId,
    /// The prompt's token ids: not empty.
    pub prompt: Vec<u32>,
    /// Tokens to generate: at least 1. The request stops after exactly this many.
    pub max_tokens: u32,
    /// The LoRA adapter (`None`: the base model). Blocks are never shared across adapters.
    pub lora_name: Option<String>,
    /// `Some`: the prompt's KV was computed by another worker (disaggregated serving) and is
    /// received at admission instead of prefilled here. `None`: an ordinary request.
    pub remote_prefill: Option<RemotePrefill>,
}

impl NewRequest {
    /// An ordinary request on the base model.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            lora_name: None,
            remote_prefill: None,
        }
    }
}

/// A prompt prefilled by another worker, whose KV this engine receives (a decode worker of a
/// disaggregated deployment).
///
/// At admission the request references its locally cached prefix, receives the KV of every
/// other prompt token but the last (its pages are allocated and its full blocks cached and
/// published as `BlockStored`, as a decode worker does when the transfer lands) without
/// computing it, and computes the last prompt token in a decode-shaped step to produce its
/// first output: no prefill work. The transfer's duration is the caller's to model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemotePrefill {
    /// The first output token when the prefill worker already chose it (TensorRT-LLM's
    /// `first_gen_tokens`); `None`: sampled here as usual ([`output_token`]).
    pub first_token: Option<u32>,
}

/// The engine's state of one request (see the module invariants).
#[derive(Debug)]
pub(super) struct Request {
    pub(super) id: RequestId,
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: u32,
    pub(super) max_tokens: u32,
    pub(super) lora_name: Option<String>,
    /// The LoRA namespace of its hashes ([`engine::hash::lora_seed`]).
    pub(super) seed: u64,
    /// Tokens whose KV is in `blocks`.
    pub(super) computed: u32,
    pub(super) blocks: Vec<BlockId>,
    /// Leading pages of `blocks` that cache a full block.
    pub(super) committed: u32,
    pub(super) hashes: Vec<EngineHash>,
    /// Prompt tokens served from the cache at its first admission; `None` before it.
    pub(super) cached_tokens: Option<u32>,
    /// Its prompt's KV is to be received at admission (see invariant 5).
    pub(super) remote: bool,
    /// Output 0, if given by a remote prefill.
    pub(super) first_token: Option<u32>,
}

impl Request {
    /// A request that was never scheduled.
    pub(super) fn new(req: NewRequest, seed: u64, prompt_len: u32) -> Self {
        Self {
            id: req.id,
            tokens: req.prompt,
            prompt_len,
            max_tokens: req.max_tokens,
            lora_name: req.lora_name,
            seed,
            computed: 0,
            blocks: Vec::new(),
            committed: 0,
            hashes: Vec::new(),
            cached_tokens: None,
            remote: req.remote_prefill.is_some(),
            first_token: req.remote_prefill.and_then(|r| r.first_token),
        }
    }

    /// Prompt plus outputs so far.
    pub(super) fn num_tokens(&self) -> u32 {
        // Fits: add_request refuses sequences longer than u32::MAX tokens.
        self.tokens.len() as u32
    }

    /// Outputs sampled so far.
    pub(super) fn outputs(&self) -> u32 {
        self.num_tokens().saturating_sub(self.prompt_len)
    }

    /// The engine hashes of the first `n` full blocks (fewer if the sequence is shorter),
    /// computing the missing ones.
    pub(super) fn block_hashes(&mut self, n: usize, bs: usize, buf: &mut Vec<u8>) -> &[EngineHash] {
        let n = n.min(self.tokens.len() / bs.max(1));
        while self.hashes.len() < n {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied();
            let Some(block) = self.tokens.get(i * bs..(i + 1) * bs) else {
                break;
            };
            self.hashes.push(engine_hash(buf, parent, self.seed, block));
        }
        self.hashes.get(..n).unwrap_or(&self.hashes)
    }

    /// Samples the next output token and appends it.
    pub(super) fn sample(&mut self) -> u32 {
        let position = self.outputs();
        let token = match self.first_token {
            Some(t) if position == 0 => t,
            _ => output_token(self.id, position),
        };
        self.tokens.push(token);
        token
    }
}

/// Seed of the synthetic output tokens.
const TOKEN_SEED: u64 = 0x70_6b65_6e73;
/// Lowest synthetic token id: skips the special and byte tokens at the bottom of a vocabulary.
const TOKEN_BASE: u32 = 1000;
/// Synthetic tokens fall in `TOKEN_BASE..TOKEN_BASE + TOKEN_SPAN`, inside any 32k+ vocabulary.
const TOKEN_SPAN: u64 = 31_000;

/// The `position`-th output token of request `id`: a pure function of both, so a run is
/// reproducible and a recomputed (preempted) request regenerates the same text.
pub fn output_token(id: RequestId, position: u32) -> u32 {
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&id.0.to_le_bytes());
    key[8..].copy_from_slice(&position.to_le_bytes());
    TOKEN_BASE + (xxh3_64_with_seed(&key, TOKEN_SEED) % TOKEN_SPAN) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::hash::lora_seed;

    #[test]
    fn output_tokens_are_deterministic_and_in_range() {
        let a: Vec<u32> = (0..50).map(|p| output_token(RequestId(1), p)).collect();
        let b: Vec<u32> = (0..50).map(|p| output_token(RequestId(1), p)).collect();
        let c: Vec<u32> = (0..50).map(|p| output_token(RequestId(2), p)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().chain(&c).all(|t| (1000..32_000).contains(t)));
    }

    #[test]
    fn block_hashes_chain_and_stop_at_the_sequence_end() {
        let prompt: Vec<u32> = (0..10).collect();
        let new = NewRequest::new(RequestId(3), prompt.clone(), 4);
        let mut r = Request::new(new, lora_seed(None), 10);
        let mut buf = Vec::new();
        assert_eq!(r.block_hashes(10, 4, &mut buf).len(), 2);
        let h0 = engine_hash(&mut buf, None, lora_seed(None), &prompt[..4]);
        let h1 = engine_hash(&mut buf, Some(h0), lora_seed(None), &prompt[4..8]);
        assert_eq!(r.hashes, vec![h0, h1]);
        r.sample();
        r.sample();
        assert_eq!(r.outputs(), 2);
        assert_eq!(r.block_hashes(3, 4, &mut buf).len(), 3);
        assert_eq!(r.block_hashes(1, 4, &mut buf), &[h0]);
    }
}
