//! A sans-IO simulated vLLM engine (one data-parallel rank): a paged KV cache with prefix
//! caching, a continuous-batching scheduler, a timing model, synthetic output tokens and
//! KV events in vLLM's wire shape.
//!
//! Where [`crate::worker::SimWorker`] only caches prompts, [`SimEngine`] runs requests over
//! time. The caller owns the clock: it submits requests ([`SimEngine::add_request`]), calls
//! [`SimEngine::step`] with the current time, and gets back how long the step takes and what
//! it produced at its end; it then drains the step's KV events
//! ([`SimEngine::poll_events`]). Like quinn-proto, nothing here does I/O, reads a clock or
//! spawns a thread.
//!
//! # Components
//! * [`config`]: [`EngineConfig`], the cache shape and scheduler limits.
//! * [`timing`]: [`TimingModel`], the cost of a step (defaults: an 8B model on one H100).
//! * `scheduler`: vLLM v1's scheduling: running requests first, then FIFO admission, chunked
//!   prefill under a token budget, recompute preemption of the newest request.
//! * `blocks`: the pages, the prefix cache ([`crate::worker`]'s block pool) and the events.
//! * [`request`]: [`NewRequest`], [`RemotePrefill`] and the synthetic output tokens
//!   ([`output_token`]).
//! * [`report`]: [`Output`], [`Step`], [`Load`], [`EngineStats`].
//!
//! # Model
//! * Prefix caching: a request reuses the cached pages of its longest cached prefix, looked
//!   up by the engine's own chained block hashes ([`crate::worker::hashing`]), namespaced by
//!   LoRA adapter; at most `prompt - 1` tokens hit, so every request computes a token.
//! * Generated tokens fill pages too: whenever a sequence (prompt + outputs so far)
//!   completes a block, the block is hashed, cached and published; the trailing partial
//!   block holds a page, uncached.
//! * Idle cached pages are evicted least recently used first, a sequence's tail before its
//!   head.
//! * A request stops after exactly `max_tokens` tokens ([`FinishReason::Length`]); output
//!   token `i` of request `id` is [`output_token`]`(id, i)`, except a first token given by a
//!   [`RemotePrefill`].
//! * Disaggregated decode: a request with a [`RemotePrefill`] receives its prompt's KV at
//!   admission (pages allocated, blocks cached and published, no prefill compute) and
//!   computes only its last prompt token; see `scheduler`.
//!
//! # Invariants
//! 1. Deterministic: the same calls with the same arguments give the same steps, outputs
//!    and events.
//! 2. No input panics; a refused call returns a [`SimError`] and changes nothing.
//! 3. Per request, outputs come in order: one [`Output::FirstToken`], then
//!    [`Output::Token`]s, then [`Output::Finished`] after exactly `max_tokens` tokens
//!    (preemption recomputes, it never repeats or skips a token); an aborted request gets
//!    no further output.
//! 4. Every step computes at most `max_num_batched_tokens` tokens for at most
//!    `max_num_seqs` requests, and a step is produced whenever [`SimEngine::has_work`].
//! 5. Replaying every batch of [`SimEngine::poll_events`] through
//!    `transport::kv_events::convert` into an [`engine::kv_index::KvIndex`] is never refused,
//!    and the index's overlap for any prompt then equals
//!    [`SimEngine::cached_prefix_blocks`].
//! 6. Pages are referenced only by running requests: with no request in flight,
//!    [`Load::kv_usage`] is 0.
//!
//! # Concurrency
//! None: an engine is owned by one thread and driven by calls.

pub mod config;
pub mod report;
pub mod request;
pub mod timing;

mod blocks;
mod scheduler;

pub use config::EngineConfig;
pub use report::{EngineStats, FinishReason, Load, Output, Step};
pub use request::{NewRequest, RemotePrefill, output_token};
pub use timing::{BatchShape, TimingModel};

use std::collections::VecDeque;
use std::time::Duration;

use engine::RequestId;
use engine::hash::lora_seed;
use wire::kv_events::WireBatch;

use crate::error::{Result, SimError};
use request::Request;
use scheduler::Scheduler;

/// One simulated vLLM engine. See the module docs.
#[derive(Debug)]
pub struct SimEngine {
    config: EngineConfig,
    sched: Scheduler,
    /// Event batches not yet polled, one per step that published anything.
    batches: VecDeque<WireBatch>,
    /// End of the last step: the next one cannot start earlier.
    clock: Duration,
    stats: EngineStats,
}

impl SimEngine {
    /// An idle engine with an empty cache. Fails on an invalid `config`.
    pub fn new(config: EngineConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            sched: Scheduler::new(config.kv_blocks, config.block_size),
            batches: VecDeque::new(),
            clock: Duration::ZERO,
            stats: EngineStats {
                kv_blocks: config.kv_blocks,
                ..EngineStats::default()
            },
            config,
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request; it is admitted by a later [`SimEngine::step`].
    ///
    /// Fails, changing nothing, if its id is in flight here
    /// ([`SimError::DuplicateRequest`]), its prompt is empty or `max_tokens` is 0
    /// ([`SimError::InvalidRequest`]), or its whole sequence (`prompt + max_tokens - 1`
    /// tokens of KV) does not fit in the cache ([`SimError::RequestTooLarge`]): such a
    /// request could never finish.
    pub fn add_request(&mut self, req: NewRequest) -> Result<()> {
        let id = req.id;
        if self.sched.requests.contains_key(&id) {
            return Err(SimError::DuplicateRequest(id));
        }
        if req.prompt.is_empty() {
            return Err(SimError::InvalidRequest {
                id,
                reason: "the prompt is empty",
            });
        }
        if req.max_tokens == 0 {
            return Err(SimError::InvalidRequest {
                id,
                reason: "max_tokens is 0",
            });
        }
        let kv_tokens = req.prompt.len() as u64 + u64::from(req.max_tokens) - 1;
        let needed_blocks = kv_tokens.div_ceil(u64::from(self.config.block_size));
        let prompt_len = u32::try_from(req.prompt.len()).ok();
        let fits_u32 = kv_tokens < u64::from(u32::MAX);
        match prompt_len {
            Some(prompt_len) if fits_u32 && needed_blocks <= u64::from(self.config.kv_blocks) => {
                let seed = lora_seed(req.lora_name.as_deref());
                self.sched.push(Request::new(req, seed, prompt_len));
                self.stats.requests += 1;
                Ok(())
            }
            _ => Err(SimError::RequestTooLarge {
                id,
                needed_blocks,
                kv_blocks: self.config.kv_blocks,
            }),
        }
    }

    /// Drops request `id` (its client went away): frees its pages (their full blocks stay
    /// cached) and produces no further output for it. Fails, changing nothing, if `id` is
    /// not in flight here.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        if !self.sched.remove(id) {
            return Err(SimError::UnknownRequest(id));
        }
        self.stats.aborted += 1;
        Ok(())
    }

    /// Runs one step starting at `now` (or at the previous step's end, if later): schedules
    /// a batch, prices it, and returns what it produced at its end. `None` when there is no
    /// work.
    pub fn step(&mut self, now: Duration) -> Option<Step> {
        if !self.has_work() {
            return None;
        }
        let plan = self
            .sched
            .schedule(self.config.max_num_batched_tokens, self.config.max_num_seqs);
        debug_assert!(!plan.scheduled.is_empty(), "work but nothing scheduled");
        let shape = plan.shape();
        let start = now.max(self.clock);
        let duration = self.config.timing.step_duration(&shape);
        let end = start.saturating_add(duration);
        self.clock = end;

        let mut outputs = Vec::new();
        let finished = self.sched.complete(&plan, &mut outputs);

        let events = self.sched.cache.take_events();
        if !events.is_empty() {
            self.batches.push_back(WireBatch {
                ts: Some(end.as_secs_f64()),
                dp_rank: Some(self.config.dp_rank),
                events,
                unknown_events: 0,
            });
        }

        let s = &mut self.stats;
        s.steps += 1;
        s.busy = s.busy.saturating_add(duration);
        s.admitted += u64::from(plan.first_admissions);
        s.prompt_tokens += plan.new_prompt_tokens;
        s.cached_tokens += plan.new_cached_tokens;
        s.prefill_tokens += shape.prefill_tokens;
        s.decode_tokens += shape.decode_seqs;
        s.remote_prefills += u64::from(plan.remote_admissions);
        s.transferred_tokens += plan.received_tokens;
        s.preemptions += u64::from(plan.preempted);
        s.finished += u64::from(finished);
        s.output_tokens += outputs
            .iter()
            .filter(|o| !matches!(o, Output::Finished { .. }))
            .count() as u64;
        Some(Step {
            start,
            duration,
            outputs,
            prefill_tokens: shape.prefill_tokens as u32,
            decode_seqs: shape.decode_seqs as u32,
            scheduled_seqs: plan.scheduled.len() as u32,
            preempted: plan.preempted,
        })
    }

    /// The oldest unpolled KV-event batch: one per step that changed the cache, stamped with
    /// the step's end (`ts`, seconds on the caller's clock) and this rank.
    pub fn poll_events(&mut self) -> Option<WireBatch> {
        self.batches.pop_front()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.sched.waiting.is_empty() || !self.sched.running.is_empty()
    }

    /// Whether request `id` is in flight (waiting or running).
    pub fn is_active(&self, id: RequestId) -> bool {
        self.sched.requests.contains_key(&id)
    }

    /// Queue lengths and KV usage.
    pub fn load(&self) -> Load {
        let cache = &self.sched.cache;
        Load {
            num_requests_waiting: self.sched.waiting.len() as u32,
            num_requests_running: self.sched.running.len() as u32,
            kv_usage: f64::from(cache.referenced()) / f64::from(cache.capacity().max(1)),
        }
    }

    /// Counters and current sizes.
    pub fn stats(&self) -> EngineStats {
        let cache = &self.sched.cache;
        EngineStats {
            stored_blocks: cache.stored,
            evicted_blocks: cache.evicted,
            cached_blocks: cache.cached_len() as u64,
            referenced_blocks: cache.referenced(),
            ..self.stats
        }
    }

    /// How many leading full blocks of `prompt` (under adapter `lora`) are cached now: what
    /// a router's index should report as this engine's overlap. Changes nothing.
    pub fn cached_prefix_blocks(&self, prompt: &[u32], lora: Option<&str>) -> u32 {
        self.sched.cache.cached_prefix(prompt, lora_seed(lora))
    }

    /// The pages (their indices in the cache) holding the leading cached full blocks of
    /// `prompt` under adapter `lora`: what vLLM reports as a prefill's `remote_block_ids`.
    /// Changes nothing.
    pub fn cached_prefix_pages(&self, prompt: &[u32], lora: Option<&str>) -> Vec<u32> {
        self.sched
            .cache
            .cached_prefix_pages(prompt, lora_seed(lora))
            .into_iter()
            .map(|b| b.index() as u32)
            .collect()
    }

    /// Forgets every cached block and publishes `AllBlocksCleared` (vLLM's
    /// `reset_prefix_cache`), if no request holds pages. Returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.sched.cache.reset() {
            return false;
        }
        let events = self.sched.cache.take_events();
        self.batches.push_back(WireBatch {
            ts: Some(self.clock.as_secs_f64()),
            dp_rank: Some(self.config.dp_rank),
            events,
            unknown_events: 0,
        });
        true
    }
}

#[cfg(test)]
mod tests;
