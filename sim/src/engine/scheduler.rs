//! Continuous batching: which requests compute how many tokens in the next step, and what
//! the step produced.
//!
//! # Algorithm
//! vLLM v1's `Scheduler.schedule` (recompute preemption, chunked prefill, FCFS):
//! 1. Running requests, in admission order, each get the tokens they still need (1 for a
//!    decode, the rest of the prompt for a prefill in progress), capped by the step's token
//!    budget. When a request's new tokens need a page and none is free, the most recently
//!    admitted running request is preempted (its pages released, its computed tokens
//!    forgotten, itself put back at the front of the queue) until one is free; if that
//!    request is the one being scheduled, the phase ends.
//! 2. If nothing was preempted, waiting requests are admitted in FIFO order while the
//!    budget, `max_num_seqs` and free pages allow; the first that does not fit stops
//!    admission. An admitted request references its longest cached prefix, capped so at
//!    least its last token is computed (vLLM's `num_tokens - 1` rule: a step must produce
//!    logits), and prefills the rest chunk by chunk, the first chunk in this step.
//! 3. Pages are allocated and newly full blocks cached when scheduled, as vLLM does, so a
//!    request admitted later in the same step already hits them.
//! 4. A remote-prefilled request ([`super::RemotePrefill`]) is admitted like any other, but
//!    receives every prompt token but the last past its cached prefix (pages allocated, full
//!    blocks cached and published, no compute, no budget) and computes only its last prompt
//!    token, a decode-shaped step that yields its first output. It must find pages for its
//!    whole prompt at once.
//!
//! After the forward pass ([`Scheduler::complete`]) every request whose whole sequence is
//! computed samples one token; one that reached `max_tokens` finishes and frees its pages.
//!
//! # Invariants
//! 1. A step's tokens never exceed `max_num_batched_tokens`; at most `max_num_seqs`
//!    requests run.
//! 2. Progress: the oldest running request (or, with none running, the oldest waiting one)
//!    is always scheduled, since `add_request` refuses requests the whole cache cannot hold.
//! 3. Every page referenced is referenced by a request in `running`; waiting requests hold
//!    none.

use std::collections::VecDeque;

use engine::RequestId;
use hashbrown::HashMap;

use super::blocks::KvCache;
use super::request::Request;
use super::timing::BatchShape;
use super::{FinishReason, Output};

/// What one scheduled request computes in a step.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scheduled {
    pub(super) id: RequestId,
    /// Tokens computed.
    pub(super) tokens: u32,
    /// Tokens computed before this step.
    pub(super) context: u32,
    /// A decode (one token of a request that has already generated) rather than prefill.
    pub(super) decode: bool,
}

/// The decisions of one step.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) scheduled: Vec<Scheduled>,
    /// Requests preempted.
    pub(super) preempted: u32,
    /// Requests admitted for the first time, with their prompt and cached tokens.
    pub(super) first_admissions: u32,
    pub(super) new_prompt_tokens: u64,
    pub(super) new_cached_tokens: u64,
    /// Requests admitted with a remote prefill, and the prompt tokens they received.
    pub(super) remote_admissions: u32,
    pub(super) received_tokens: u64,
}

impl Plan {
    /// The cost-model view of the plan.
    pub(super) fn shape(&self) -> BatchShape {
        let mut shape = BatchShape::default();
        for s in &self.scheduled {
            if s.decode {
                shape.add_decode(u64::from(s.context));
            } else {
                shape.add_prefill(u64::from(s.tokens), u64::from(s.context));
            }
        }
        shape
    }
}

/// The request queues and the cache they share.
#[derive(Debug)]
pub(super) struct Scheduler {
    pub(super) requests: HashMap<RequestId, Request>,
    /// Waiting requests, next to admit first. Preempted requests go back to the front.
    pub(super) waiting: VecDeque<RequestId>,
    /// Running requests, in admission order (the last is preempted first).
    pub(super) running: Vec<RequestId>,
    pub(super) cache: KvCache,
    block_size: u32,
    buf: Vec<u8>,
}

/// Pages covering `tokens` tokens.
fn pages_for(tokens: u32, bs: u32) -> u32 {
    tokens.div_ceil(bs)
}

impl Scheduler {
    /// Empty queues over an empty cache.
    pub(super) fn new(kv_blocks: u32, block_size: u32) -> Self {
        Self {
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: KvCache::new(kv_blocks, block_size),
            block_size,
            buf: Vec::new(),
        }
    }

    /// Queues a new request at the back.
    pub(super) fn push(&mut self, req: Request) {
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// Removes request `id` wherever it is and frees its pages; `false` if unknown.
    pub(super) fn remove(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        self.cache.release(&req.blocks);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        true
    }

    /// Decides the next step (see the module docs) and applies its cache changes.
    pub(super) fn schedule(&mut self, max_tokens: u32, max_seqs: u32) -> Plan {
        let mut plan = Plan::default();
        let mut budget = max_tokens;
        let bs = self.block_size;

        // 1. Running requests.
        let mut i = 0;
        'running: while budget > 0 {
            let Some(&id) = self.running.get(i) else {
                break;
            };
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (req.num_tokens() - req.computed).min(budget);
            let need = pages_for(req.computed + n, bs).saturating_sub(req.blocks.len() as u32);
            while self.cache.free_len() < need {
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                self.preempt(victim);
                plan.preempted += 1;
                if victim == id {
                    break 'running;
                }
            }
            if !self.run_chunk(id, n, false, &mut plan) {
                break;
            }
            budget -= n;
            i += 1;
        }

        // 2. Waiting requests, unless this step had to preempt.
        while plan.preempted == 0 && budget > 0 && (self.running.len() as u32) < max_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(req) = self.requests.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            // Cap the hit so at least the last token is computed.
            let full = ((req.num_tokens() - 1) / bs) as usize;
            let hashes = req.block_hashes(full, bs as usize, &mut self.buf);
            let hits = self.cache.prefix_hits(hashes);
            let computed = hits.len() as u32 * bs;
            // A remote prefill receives all but its last token and computes that one.
            let (received, n) = if req.remote {
                (req.num_tokens() - 1 - computed, 1)
            } else {
                (0, (req.num_tokens() - computed).min(budget))
            };
            let need = pages_for(computed + received + n, bs) - hits.len() as u32;
            if self.cache.free_after_touch(&hits) < need {
                break;
            }
            self.cache.touch(&hits);
            let remote = std::mem::take(&mut req.remote);
            req.committed = hits.len() as u32;
            req.blocks = hits;
            req.computed = computed;
            if req.cached_tokens.is_none() {
                req.cached_tokens = Some(computed);
                plan.first_admissions += 1;
                plan.new_prompt_tokens += u64::from(req.prompt_len);
                plan.new_cached_tokens += u64::from(computed);
            }
            self.waiting.pop_front();
            self.running.push(id);
            if remote {
                if !self.fill(id, received) {
                    break;
                }
                plan.remote_admissions += 1;
                plan.received_tokens += u64::from(received);
            }
            if !self.run_chunk(id, n, remote, &mut plan) {
                break;
            }
            budget -= n;
        }
        plan
    }

    /// Allocates the pages for `n` more tokens of `id`, marks them computed, caches the
    /// blocks they fill and records the work (`received`: the last prompt token of a remote
    /// prefill, decode-shaped). `false` (changing nothing) if the pages are not free, which
    /// the callers rule out beforehand.
    fn run_chunk(&mut self, id: RequestId, n: u32, received: bool, plan: &mut Plan) -> bool {
        let Some(context) = self.requests.get(&id).map(|r| r.computed) else {
            return false;
        };
        if !self.fill(id, n) {
            return false;
        }
        let Some(req) = self.requests.get(&id) else {
            return false;
        };
        let last = n == 1 && context + 1 == req.num_tokens();
        plan.scheduled.push(Scheduled {
            id,
            tokens: n,
            context,
            decode: last && (req.outputs() > 0 || received),
        });
        true
    }

    /// Allocates the pages for `n` more tokens of `id`, marks them computed (or received)
    /// and caches the full blocks they complete. `false` (changing nothing) if the request is
    /// unknown or the pages are not free, which the callers rule out beforehand.
    fn fill(&mut self, id: RequestId, n: u32) -> bool {
        let bs = self.block_size;
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let need = pages_for(req.computed + n, bs).saturating_sub(req.blocks.len() as u32);
        let Some(pages) = self.cache.allocate(need) else {
            debug_assert!(false, "scheduled without free pages");
            return false;
        };
        req.blocks.extend(pages);
        req.computed += n;
        let full = (req.computed / bs) as usize;
        req.block_hashes(full, bs as usize, &mut self.buf);
        for i in req.committed as usize..full {
            let (Some(&hash), Some(page), Some(tokens)) = (
                req.hashes.get(i),
                req.blocks.get_mut(i),
                req.tokens.get(i * bs as usize..(i + 1) * bs as usize),
            ) else {
                break;
            };
            let parent = i.checked_sub(1).and_then(|p| req.hashes.get(p)).copied();
            self.cache
                .commit(page, hash, parent, tokens, req.lora_name.as_deref());
            req.committed = i as u32 + 1;
        }
        true
    }

    /// Recompute preemption: frees the pages of `id` (its full blocks stay cached), forgets
    /// its computed tokens and puts it at the front of the queue.
    fn preempt(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            self.cache.release(&req.blocks);
            req.blocks.clear();
            req.computed = 0;
            req.committed = 0;
            self.waiting.push_front(id);
        }
    }

    /// After the forward pass of `plan`: samples a token for every request whose sequence is
    /// now computed, finishes those at `max_tokens`; appends the outputs in batch order and
    /// returns how many requests finished.
    pub(super) fn complete(&mut self, plan: &Plan, outputs: &mut Vec<Output>) -> u32 {
        let mut finished = 0;
        for s in &plan.scheduled {
            let Some(req) = self.requests.get_mut(&s.id) else {
                continue;
            };
            if req.computed < req.num_tokens() {
                continue; // a prefill chunk that is not the last
            }
            let first = req.outputs() == 0;
            let token = req.sample();
            outputs.push(if first {
                Output::FirstToken {
                    id: s.id,
                    token,
                    prompt_tokens: req.prompt_len,
                    cached_tokens: req.cached_tokens.unwrap_or(0),
                }
            } else {
                Output::Token { id: s.id, token }
            });
            if req.outputs() >= req.max_tokens {
                outputs.push(Output::Finished {
                    id: s.id,
                    output_tokens: req.outputs(),
                    reason: FinishReason::Length,
                });
                self.cache.release(&req.blocks);
                self.requests.remove(&s.id);
                finished += 1;
            }
        }
        // Finished requests were all running (scheduled this step): one pass removes them.
        if finished > 0 {
            let requests = &self.requests;
            self.running.retain(|id| requests.contains_key(id));
        }
        finished
    }
}
