//! How long one engine step takes: a linear cost model of a transformer forward pass.
//!
//! A step runs one forward pass over a batch mixing prefill chunks (many tokens of one
//! request) and decodes (one token per running request). Its duration is
//!
//! ```text
//! step_overhead                                    every step that computes anything
//! + forward_base                                   (the same steps)
//! + prefill_per_token        * prefill tokens
//! + prefill_per_token_per_1k_context * (attention pairs of the prefill chunks) / 1024
//! + decode_per_seq           * decoding sequences
//! + decode_per_context_token * context tokens the decodes attend to
//! ```
//!
//! where a chunk of `n` tokens after `c` computed tokens has `n*c + n*(n+1)/2` attention
//! pairs (causal attention: its k-th token attends to `c + k` tokens), and a decode at
//! position `c` attends to `c + 1` tokens. Cached prefix tokens are never computed, so they
//! cost nothing.
//!
//! # Defaults: an 8B model (Llama-3-8B shape) in bf16 on one H100 SXM
//! * `forward_base` 5 ms: a forward pass reads all 16 GB of weights; at the ~3.2 TB/s an
//!   H100 sustains of its 3.35 TB/s HBM3 that is 5 ms, the memory-bound floor of a decode
//!   step at small batch.
//! * `step_overhead` 1 ms: scheduling, input preparation, sampling and output processing
//!   around the GPU work (vLLM v1 with CUDA graphs). With `forward_base` a decode step at
//!   batch 1 and short context takes ~6.1 ms, the usual ~160 tokens/s of one stream.
//! * `prefill_per_token` 40 µs: a token costs 2 x 8e9 = 16 GFLOP; at ~400 TFLOP/s (40% of
//!   the 989 TFLOP/s dense bf16 peak, typical of large prefill GEMMs) that is 40 µs, i.e.
//!   ~25k prefill tokens/s.
//! * `prefill_per_token_per_1k_context` 1.5 µs: attention costs 4 x d_model x layers =
//!   4 x 4096 x 32 = 0.52 MFLOP per (query, key) pair, 0.54 GFLOP per 1024 keys, 1.3 µs at
//!   400 TFLOP/s; rounded up because attention kernels run below GEMM efficiency. An 8k
//!   prompt thus pays ~15% on top of its linear cost (~21k tokens/s overall).
//! * `decode_per_seq` 75 µs: the per-sequence work of a decode batch (activation GEMMs,
//!   sampling, bookkeeping) that makes large batches compute-bound: batch 64 ≈ 11 ms and
//!   batch 256 ≈ 25 ms per step at short context, in line with published vLLM H100
//!   measurements.
//! * `decode_per_context_token` 50 ns: each decode reads its whole KV: 128 KiB per token
//!   (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes) at ~2.6 TB/s is 50 ns. 64
//!   sequences at 2k context add ~6.5 ms.
//!
//! # Invariants
//! 1. [`TimingModel::step_duration`] is monotone: never shorter when any count of a
//!    [`BatchShape`] grows; an empty shape takes zero time.
//! 2. Integer arithmetic in nanoseconds, saturating: deterministic on every platform and
//!    never panics.

use std::time::Duration;

/// The cost constants of one engine's forward pass. Every field is a knob (CLI flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimingModel {
    /// Fixed cost of every step that computes anything (scheduling, input prep, sampling).
    pub step_overhead: Duration,
    /// Fixed GPU cost of every forward pass: reading the weights.
    pub forward_base: Duration,
    /// Cost of each prefilled (uncached) token.
    pub prefill_per_token: Duration,
    /// Attention cost of a prefilled token per 1024 tokens of context it attends to.
    pub prefill_per_token_per_1k_context: Duration,
    /// Cost of each sequence in the decode batch.
    pub decode_per_seq: Duration,
    /// Cost of each context token a decoding sequence attends to (reading its KV).
    pub decode_per_context_token: Duration,
}

impl Default for TimingModel {
    /// An 8B model on one H100 (see the module docs).
    fn default() -> Self {
        Self {
            step_overhead: Duration::from_millis(1),
            forward_base: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(40),
            prefill_per_token_per_1k_context: Duration::from_nanos(1500),
            decode_per_seq: Duration::from_micros(75),
            decode_per_context_token: Duration::from_nanos(50),
        }
    }
}

/// What one step computes, in the units the cost model charges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Tokens prefilled (prompt chunks and recomputation after preemption).
    pub prefill_tokens: u64,
    /// Causal attention pairs of those tokens: see the module docs.
    pub prefill_pairs: u64,
    /// Sequences decoding one token.
    pub decode_seqs: u64,
    /// Context tokens the decodes attend to, summed.
    pub decode_context: u64,
}

impl BatchShape {
    /// Adds a prefill chunk of `tokens` tokens following `context` computed tokens.
    pub fn add_prefill(&mut self, tokens: u64, context: u64) {
        let pairs = tokens
            .saturating_mul(context)
            .saturating_add(tokens.saturating_mul(tokens.saturating_add(1)) / 2);
        self.prefill_tokens = self.prefill_tokens.saturating_add(tokens);
        self.prefill_pairs = self.prefill_pairs.saturating_add(pairs);
    }

    /// Adds a decode of the token at position `context` (attending to `context + 1` tokens).
    pub fn add_decode(&mut self, context: u64) {
        self.decode_seqs = self.decode_seqs.saturating_add(1);
        self.decode_context = self
            .decode_context
            .saturating_add(context.saturating_add(1));
    }

    /// Whether the step computes nothing.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

impl TimingModel {
    /// How long a step computing `shape` takes (see the module docs).
    pub fn step_duration(&self, shape: &BatchShape) -> Duration {
        if shape.is_empty() {
            return Duration::ZERO;
        }
        let ns = |d: Duration| d.as_nanos();
        let mul = |d: Duration, n: u64| ns(d).saturating_mul(u128::from(n));
        let total = ns(self.step_overhead)
            .saturating_add(ns(self.forward_base))
            .saturating_add(mul(self.prefill_per_token, shape.prefill_tokens))
            .saturating_add(mul(self.prefill_per_token_per_1k_context, shape.prefill_pairs) / 1024)
            .saturating_add(mul(self.decode_per_seq, shape.decode_seqs))
            .saturating_add(mul(self.decode_per_context_token, shape.decode_context));
        Duration::from_nanos(u64::try_from(total).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(tokens: u64, context: u64) -> BatchShape {
        let mut s = BatchShape::default();
        s.add_prefill(tokens, context);
        s
    }

    #[test]
    fn defaults_match_the_documented_figures() {
        let t = TimingModel::default();
        // Decode at batch 1, short context: ~6.1 ms.
        let mut one = BatchShape::default();
        one.add_decode(100);
        let d = t.step_duration(&one);
        assert!(
            d > Duration::from_millis(6) && d < Duration::from_millis(7),
            "{d:?}"
        );
        // Batch 256 at short context: ~25 ms.
        let mut big = BatchShape::default();
        for _ in 0..256 {
            big.add_decode(100);
        }
        let d = t.step_duration(&big);
        assert!(
            d > Duration::from_millis(23) && d < Duration::from_millis(28),
            "{d:?}"
        );
        // An 8192-token prefill: ~22-25k tokens/s.
        let d = t.step_duration(&prefill(8192, 0));
        let rate = 8192.0 / d.as_secs_f64();
        assert!((20_000.0..26_000.0).contains(&rate), "{rate}");
    }

    #[test]
    fn empty_is_free_and_costs_are_monotone() {
        let t = TimingModel::default();
        assert_eq!(t.step_duration(&BatchShape::default()), Duration::ZERO);
        let mut last = Duration::ZERO;
        for n in [1, 2, 16, 100, 1000, 8192] {
            let d = t.step_duration(&prefill(n, 0));
            assert!(d > last);
            last = d;
            assert!(t.step_duration(&prefill(n, 4096)) > d, "context costs");
        }
        let mut shape = BatchShape::default();
        let mut last = Duration::ZERO;
        for _ in 0..300 {
            shape.add_decode(500);
            let d = t.step_duration(&shape);
            assert!(d > last);
            last = d;
        }
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        let t = TimingModel {
            prefill_per_token: Duration::MAX,
            ..TimingModel::default()
        };
        let s = prefill(u64::MAX, u64::MAX);
        assert_eq!(t.step_duration(&s), Duration::from_nanos(u64::MAX));
    }
}
