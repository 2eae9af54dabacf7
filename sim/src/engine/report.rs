//! What the engine reports: per-request outputs, per-step summaries, load and counters.

use std::time::Duration;

use engine::RequestId;

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It generated `max_tokens` tokens (OpenAI's `"length"`).
    Length,
}

/// One thing a step produced for one request, at the step's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// The request's first generated token: its prefill is complete.
    FirstToken {
        /// The request.
        id: RequestId,
        /// The token id.
        token: u32,
        /// Tokens of its prompt.
        prompt_tokens: u32,
        /// Prompt tokens served from the prefix cache at its first admission
        /// (`usage.prompt_tokens_details.cached_tokens`): whole blocks, at most
        /// `prompt_tokens - 1`.
        cached_tokens: u32,
    },
    /// A later generated token.
    Token {
        /// The request.
        id: RequestId,
        /// The token id.
        token: u32,
    },
    /// The request is complete (after its last token's output); its pages are released.
    Finished {
        /// The request.
        id: RequestId,
        /// Tokens it generated.
        output_tokens: u32,
        /// Why it stopped.
        reason: FinishReason,
    },
}

impl Output {
    /// The request this output belongs to.
    pub fn id(&self) -> RequestId {
        match *self {
            Output::FirstToken { id, .. }
            | Output::Token { id, .. }
            | Output::Finished { id, .. } => id,
        }
    }
}

/// One engine step: a forward pass over a batch, lasting `duration` from `start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// When it started (the caller's `now`, or the previous step's end if later).
    pub start: Duration,
    /// How long it takes; its outputs and events happen at `start + duration`.
    pub duration: Duration,
    /// What it produced, in batch order.
    pub outputs: Vec<Output>,
    /// Tokens prefilled (prompt chunks and recomputation); cached tokens excluded.
    pub prefill_tokens: u32,
    /// Requests that decoded one token.
    pub decode_seqs: u32,
    /// Requests that computed anything (at most `max_num_seqs`).
    pub scheduled_seqs: u32,
    /// Requests preempted to make room.
    pub preempted: u32,
}

impl Step {
    /// When it ends: the time of its outputs.
    pub fn end(&self) -> Duration {
        self.start.saturating_add(self.duration)
    }

    /// Tokens computed (at most `max_num_batched_tokens`).
    pub fn scheduled_tokens(&self) -> u32 {
        self.prefill_tokens + self.decode_seqs
    }
}

/// The engine's load, as a vLLM worker reports it to a router.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Requests queued, not running (`num_requests_waiting`).
    pub num_requests_waiting: u32,
    /// Requests running (`num_requests_running`).
    pub num_requests_running: u32,
    /// Fraction of pages referenced by requests, `0.0..=1.0` (`kv_cache_usage`); idle
    /// cached blocks do not count.
    pub kv_usage: f64,
}

/// Counters since the engine started, and current sizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests accepted by `add_request`.
    pub requests: u64,
    /// Requests admitted at least once.
    pub admitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests aborted.
    pub aborted: u64,
    /// Prompt tokens of the admitted requests.
    pub prompt_tokens: u64,
    /// Of those, tokens served from the cache at first admission.
    pub cached_tokens: u64,
    /// Tokens prefilled, recomputation after preemption included.
    pub prefill_tokens: u64,
    /// Requests admitted with a remote prefill ([`super::RemotePrefill`]).
    pub remote_prefills: u64,
    /// Prompt tokens whose KV those requests received instead of computing (their cached
    /// prefix and their last prompt token, computed here, excluded).
    pub transferred_tokens: u64,
    /// Decode tokens computed (the last prompt token of a remote prefill included).
    pub decode_tokens: u64,
    /// Tokens generated (outputs).
    pub output_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Steps run.
    pub steps: u64,
    /// Time spent in steps.
    pub busy: Duration,
    /// Blocks stored (published as `BlockStored`).
    pub stored_blocks: u64,
    /// Blocks evicted (published as `BlockRemoved`).
    pub evicted_blocks: u64,
    /// Pages holding a cached block now.
    pub cached_blocks: u64,
    /// Pages referenced by requests now.
    pub referenced_blocks: u32,
    /// Pages in the cache.
    pub kv_blocks: u32,
}
