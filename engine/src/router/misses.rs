//! Miss attribution: why a routed request's prompt was not a cache hit.
//!
//! At route time the router knows, per candidate, how many of the prompt's blocks the index
//! says it holds: the chosen worker's overlap and the best any candidate had. When the
//! worker's answer arrives its usage says how many prompt tokens it really found cached
//! (`usage.prompt_tokens_details.cached_tokens`). [`attribute`] compares the three and
//! splits the prompt's cacheable blocks into what was a hit and why the rest was not:
//!
//! * **stale**: the chosen worker was predicted to hold blocks it did not (evicted, or its
//!   removal events had not reached the router yet);
//! * **routing**: another candidate held blocks beyond what the chosen worker was predicted
//!   to have and really had (the router traded them for load, or the mode ignores caches);
//! * **cold**: no candidate held them (as far as the index knew).
//!
//! # Accounting
//! All in whole blocks of the router's block size `B`, for a prompt of `P` tokens:
//!
//! * cacheable `n = floor((P - 1) / B)` (0 for an empty prompt): an engine always computes
//!   the prompt's last token, so a whole-prompt hit reports at most `P - 1` tokens, rounded
//!   down to its block (vLLM); the overlaps are capped at `n`: `c` (chosen), `b` (best,
//!   at least `c`);
//! * hit `h = min(ceil(cached / B), n)`: a partial block counts as a hit, which absorbs a
//!   token-granular engine's (or a last-block recompute's) off-by-less-than-a-block;
//! * `stale = max(0, c - h)`, `routing = max(0, b - max(c, h))`,
//!   `cold = n - max(b, h)`.
//!
//! # Invariants
//! 1. `hit + stale + routing + cold == cacheable`, every term non-negative (no underflow
//!    for any input, including `cached` larger than the prompt, which [`attribute`]
//!    refuses instead).
//! 2. A request whose worker reported at least its cacheable blocks has no miss.
//! 3. Pure: no state, no clock; the same inputs give the same answer.

/// What the router predicted for a request when it routed it, and how long the prompt is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Predicted {
    /// The router's block size, in tokens (non-zero).
    pub block_size: u32,
    /// Prompt tokens, as the router tokenized them.
    pub prompt_tokens: u64,
    /// Blocks the chosen worker held, by the index.
    pub chosen_blocks: u32,
    /// The most blocks any candidate held, by the index.
    pub best_blocks: u32,
}

/// Why a miss happened; a request can miss tokens for several causes at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MissCause {
    /// A better-cached worker existed (see the module docs).
    Routing,
    /// The chosen worker was predicted to hold blocks it did not.
    Stale,
    /// Nobody held them.
    Cold,
}

impl MissCause {
    /// Every cause, in label order.
    pub const ALL: [MissCause; 3] = [Self::Routing, Self::Stale, Self::Cold];

    /// The `/metrics` label: `routing`, `stale` or `cold`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Routing => "routing",
            Self::Stale => "stale",
            Self::Cold => "cold",
        }
    }
}

/// A request's cacheable blocks, split (the module's accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attribution {
    /// The router's block size, in tokens.
    pub block_size: u32,
    /// Blocks any engine could report cached.
    pub cacheable_blocks: u64,
    /// Blocks the worker reported cached (capped at `cacheable_blocks`).
    pub hit_blocks: u64,
    /// Blocks predicted on the chosen worker that it did not have.
    pub stale_blocks: u64,
    /// Blocks another candidate had beyond the chosen worker.
    pub routing_blocks: u64,
    /// Blocks no candidate had.
    pub cold_blocks: u64,
}

/// How one request ended up, for per-request counts: a hit, or the cause that missed the
/// most blocks (ties go to the more actionable cause: stale, then routing, then cold).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Nothing cacheable was missed.
    Hit,
    /// Some blocks were missed, most of them for this cause.
    Miss(MissCause),
}

impl Outcome {
    /// The `/metrics` label: `hit`, or the cause's.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::Miss(c) => c.as_str(),
        }
    }
}

/// Why [`attribute`] could not attribute a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unattributable {
    /// The block size was 0.
    NoBlockSize,
    /// The worker reported more cached tokens than the prompt has.
    CachedBeyondPrompt,
}

impl Attribution {
    /// Blocks of `cause`.
    pub fn blocks(&self, cause: MissCause) -> u64 {
        match cause {
            MissCause::Routing => self.routing_blocks,
            MissCause::Stale => self.stale_blocks,
            MissCause::Cold => self.cold_blocks,
        }
    }

    /// Tokens of `cause` (blocks times the block size).
    pub fn tokens(&self, cause: MissCause) -> u64 {
        self.blocks(cause)
            .saturating_mul(u64::from(self.block_size))
    }

    /// Hit tokens (hit blocks times the block size).
    pub fn hit_tokens(&self) -> u64 {
        self.hit_blocks.saturating_mul(u64::from(self.block_size))
    }

    /// Blocks missed, whatever the cause.
    pub fn missed_blocks(&self) -> u64 {
        self.cacheable_blocks.saturating_sub(self.hit_blocks)
    }

    /// The request's outcome (see [`Outcome`]).
    pub fn outcome(&self) -> Outcome {
        if self.missed_blocks() == 0 {
            return Outcome::Hit;
        }
        // Ties go to the earlier entry: stale, routing, cold.
        let mut best = (MissCause::Stale, self.stale_blocks);
        for cause in [MissCause::Routing, MissCause::Cold] {
            if self.blocks(cause) > best.1 {
                best = (cause, self.blocks(cause));
            }
        }
        Outcome::Miss(best.0)
    }
}

/// The prompt blocks of a `prompt_tokens`-token prompt any engine could report cached at
/// `block_size` (the module's `n`; 0 for a block size of 0).
pub fn cacheable_blocks(prompt_tokens: u64, block_size: u32) -> u64 {
    prompt_tokens
        .saturating_sub(1)
        .checked_div(u64::from(block_size))
        .unwrap_or(0)
}

/// Splits `predicted`'s cacheable blocks by what the worker reported cached
/// (`cached_tokens`), per the module's accounting.
pub fn attribute(predicted: &Predicted, cached_tokens: u64) -> Result<Attribution, Unattributable> {
    let bs = u64::from(predicted.block_size);
    if bs == 0 {
        return Err(Unattributable::NoBlockSize);
    }
    if cached_tokens > predicted.prompt_tokens {
        return Err(Unattributable::CachedBeyondPrompt);
    }
    let n = cacheable_blocks(predicted.prompt_tokens, predicted.block_size);
    let c = u64::from(predicted.chosen_blocks).min(n);
    let b = u64::from(predicted.best_blocks).min(n).max(c);
    let h = cached_tokens.div_ceil(bs).min(n);
    Ok(Attribution {
        block_size: predicted.block_size,
        cacheable_blocks: n,
        hit_blocks: h,
        stale_blocks: c.saturating_sub(h),
        routing_blocks: b.saturating_sub(c.max(h)),
        cold_blocks: n.saturating_sub(b.max(h)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(prompt: u64, chosen: u32, best: u32) -> Predicted {
        Predicted {
            block_size: 16,
            prompt_tokens: prompt,
            chosen_blocks: chosen,
            best_blocks: best,
        }
    }

    #[test]
    fn the_three_causes_and_a_hit() {
        // 100 tokens: 6 cacheable blocks. The chosen worker had them all and said so.
        let a = attribute(&p(100, 6, 6), 96).unwrap();
        assert_eq!((a.hit_blocks, a.missed_blocks()), (6, 0));
        assert_eq!(a.outcome(), Outcome::Hit);
        // Another worker had 4 blocks; the chosen one none: routing.
        let a = attribute(&p(100, 0, 4), 0).unwrap();
        assert_eq!((a.routing_blocks, a.cold_blocks, a.stale_blocks), (4, 2, 0));
        assert_eq!(a.outcome(), Outcome::Miss(MissCause::Routing));
        assert_eq!(a.tokens(MissCause::Routing), 64);
        // Predicted 5 on the chosen one, it had 1: stale.
        let a = attribute(&p(100, 5, 5), 16).unwrap();
        assert_eq!((a.hit_blocks, a.stale_blocks, a.cold_blocks), (1, 4, 1));
        assert_eq!(a.outcome(), Outcome::Miss(MissCause::Stale));
        // Nobody had anything: cold.
        let a = attribute(&p(100, 0, 0), 0).unwrap();
        assert_eq!(a.cold_blocks, 6);
        assert_eq!(a.outcome(), Outcome::Miss(MissCause::Cold));
    }

    #[test]
    fn the_engines_last_token_and_partial_blocks_are_tolerated() {
        // 64 tokens = 4 whole blocks, all predicted; vLLM recomputes the last token, so a
        // whole-prompt hit reports 48: no miss.
        let a = attribute(&p(64, 4, 4), 48).unwrap();
        assert_eq!((a.cacheable_blocks, a.missed_blocks()), (3, 0));
        // A token-granular engine reporting 63 of 64: no miss either.
        assert_eq!(attribute(&p(64, 4, 4), 63).unwrap().missed_blocks(), 0);
        // 40 cached of 3 predicted blocks (48): the partial third block counts.
        assert_eq!(attribute(&p(100, 3, 3), 40).unwrap().stale_blocks, 0);
        // More than predicted (the index lagged a store): a hit, nothing stale.
        let a = attribute(&p(100, 2, 2), 96).unwrap();
        assert_eq!((a.hit_blocks, a.stale_blocks), (6, 0));
    }

    #[test]
    fn bad_input_is_refused_not_panicked_on() {
        let zero = Predicted {
            block_size: 0,
            ..p(10, 0, 0)
        };
        assert_eq!(attribute(&zero, 0), Err(Unattributable::NoBlockSize));
        assert_eq!(
            attribute(&p(10, 0, 0), 11),
            Err(Unattributable::CachedBeyondPrompt)
        );
        // Overlaps beyond the prompt, best below chosen, an empty prompt: still sums.
        let a = attribute(&p(20, u32::MAX, 0), 0).unwrap();
        assert_eq!((a.cacheable_blocks, a.stale_blocks), (1, 1));
        let a = attribute(&p(0, 3, 3), 0).unwrap();
        assert_eq!(a.cacheable_blocks, 0);
        assert_eq!(a.outcome(), Outcome::Hit);
        let a = attribute(&p(u64::MAX, u32::MAX, u32::MAX), u64::MAX).unwrap();
        assert_eq!(a.missed_blocks(), 0);
    }

    /// A block-by-block reference: block `i` (of the cacheable ones) is a hit if the worker
    /// reported it (in part), else stale if the chosen worker was predicted to hold it, else
    /// routing if some candidate was, else cold.
    fn reference(pr: &Predicted, cached: u64) -> [u64; 4] {
        let bs = u64::from(pr.block_size);
        let n = pr.prompt_tokens.saturating_sub(1) / bs;
        let best = pr.best_blocks.max(pr.chosen_blocks);
        let mut out = [0; 4];
        for i in 0..n {
            let k = if i * bs < cached {
                0
            } else if i < u64::from(pr.chosen_blocks) {
                1
            } else if i < u64::from(best) {
                2
            } else {
                3
            };
            out[k] += 1;
        }
        out
    }

    proptest! {
        #[test]
        fn agrees_with_a_block_by_block_reference(
            bs in 1u32..40,
            prompt in 0u64..600,
            chosen in 0u32..50,
            best in 0u32..50,
            cached_frac in 0u64..=100,
        ) {
            let pr = Predicted {
                block_size: bs,
                prompt_tokens: prompt,
                chosen_blocks: chosen,
                best_blocks: best,
            };
            let cached = prompt * cached_frac / 100;
            let a = attribute(&pr, cached).unwrap();
            let got = [a.hit_blocks, a.stale_blocks, a.routing_blocks, a.cold_blocks];
            prop_assert_eq!(got, reference(&pr, cached));
            prop_assert_eq!(got.iter().sum::<u64>(), a.cacheable_blocks);
        }
    }
}
