//! An embedded, deterministic generator of multi-turn chat traffic with prefix sharing.
//!
//! The shape of a chat deployment's traffic, which is what makes KV-aware routing pay:
//! * a few system prompts (500-2000 tokens) that every session starts with;
//! * many sessions, each a conversation whose every turn resends the whole history: turn
//!   `k`'s prompt is turn `k-1`'s prompt, the answer to it, and a new user message, so each
//!   turn extends the previous prompt by 50-500 tokens, up to ~8k tokens;
//! * a fixed number of live sessions, interleaved: each request continues a uniformly chosen
//!   live session, and a session that ends (its turns are used up, or its next prompt would
//!   exceed `max_prompt_tokens`) is replaced by a new one;
//! * optionally a share of sessions running under a LoRA adapter.
//!
//! # Invariants
//! 1. Seeded: the same [`ChatConfig`] yields the same requests (with the locked `rand`).
//! 2. Exactly `requests` requests, each at most `max_prompt_tokens` long, with
//!    non-decreasing `arrival_ms`.
//! 3. A turn's prompt starts with the previous turn's prompt of its session, which starts
//!    with the session's system prompt.

use std::ops::RangeInclusive;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::error::{Result, SimError};
use crate::workload::{DEFAULT_VOCAB, SimRequest};

/// Everything the chat generator is configured with.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Requests to generate.
    pub requests: usize,
    /// Distinct system prompts shared by all sessions (at least 1).
    pub system_prompts: u32,
    /// Length of each system prompt, in tokens.
    pub system_prompt_tokens: RangeInclusive<u32>,
    /// Sessions in progress at any time (at least 1): how many conversations interleave.
    pub live_sessions: u32,
    /// Turns per session (at least 1).
    pub turns: RangeInclusive<u32>,
    /// A session's first user message, which often carries pasted context.
    pub first_message_tokens: RangeInclusive<u32>,
    /// Each later user message.
    pub user_tokens: RangeInclusive<u32>,
    /// Each answer (it becomes part of the next turn's prompt).
    pub answer_tokens: RangeInclusive<u32>,
    /// No prompt is longer; a session whose next turn would be ends instead.
    pub max_prompt_tokens: u32,
    /// Mean gap between arrivals (exponentially distributed), in milliseconds.
    pub mean_gap_ms: f64,
    /// Token ids are drawn from `0..vocab` (at least 1).
    pub vocab: u32,
    /// LoRA adapters sessions may run under.
    pub adapters: Vec<Arc<str>>,
    /// Fraction of sessions, `0..=1`, that run under one of `adapters` (needs one).
    pub adapter_share: f64,
}

impl Default for ChatConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            requests: 4000,
            system_prompts: 4,
            system_prompt_tokens: 500..=2000,
            live_sessions: 96,
            turns: 2..=16,
            first_message_tokens: 50..=2500,
            user_tokens: 20..=200,
            answer_tokens: 30..=300,
            max_prompt_tokens: 8192,
            mean_gap_ms: 50.0,
            vocab: DEFAULT_VOCAB,
            adapters: vec![Arc::from("support-lora")],
            adapter_share: 0.1,
        }
    }
}

impl ChatConfig {
    /// Rejects values outside their documented ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason| Err(SimError::InvalidConfig { name, reason });
        let ranges = [
            ("system_prompt_tokens", &self.system_prompt_tokens),
            ("turns", &self.turns),
            ("first_message_tokens", &self.first_message_tokens),
            ("user_tokens", &self.user_tokens),
            ("answer_tokens", &self.answer_tokens),
        ];
        for (name, r) in ranges {
            if r.is_empty() {
                return bad(name, "range is empty");
            }
        }
        if self.system_prompts == 0 {
            return bad("system_prompts", "must be positive");
        }
        if self.live_sessions == 0 {
            return bad("live_sessions", "must be positive");
        }
        if *self.turns.start() == 0 {
            return bad("turns", "a session has at least one turn");
        }
        if self.vocab == 0 {
            return bad("vocab", "must be positive");
        }
        if !(self.mean_gap_ms.is_finite() && self.mean_gap_ms >= 0.0) {
            return bad("mean_gap_ms", "must be finite and non-negative");
        }
        if !(0.0..=1.0).contains(&self.adapter_share) {
            return bad("adapter_share", "must be within 0..=1");
        }
        if self.adapter_share > 0.0 && self.adapters.is_empty() {
            return bad("adapters", "a positive adapter_share needs an adapter");
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Session {
    /// History so far: the last prompt and its answer (initially the system prompt).
    context: Vec<u32>,
    /// Turns taken.
    turn: u32,
    /// Turns this session will take.
    turns: u32,
    lora: Option<Arc<str>>,
}

/// The generator: an iterator over [`SimRequest`]s. See the module docs.
#[derive(Debug)]
pub struct ChatWorkload {
    config: ChatConfig,
    rng: SmallRng,
    system: Vec<Vec<u32>>,
    live: Vec<Session>,
    emitted: usize,
    clock_ms: f64,
}

impl ChatWorkload {
    /// A generator for `config`. Fails if the configuration is out of range.
    pub fn new(config: ChatConfig) -> Result<Self> {
        config.validate()?;
        let mut rng = SmallRng::seed_from_u64(config.seed);
        let system = (0..config.system_prompts)
            .map(|_| {
                let len = rng.random_range(config.system_prompt_tokens.clone());
                random_tokens(&mut rng, config.vocab, len)
            })
            .collect();
        let mut w = Self {
            config,
            rng,
            system,
            live: Vec::new(),
            emitted: 0,
            clock_ms: 0.0,
        };
        w.live = (0..w.config.live_sessions)
            .map(|_| w.new_session())
            .collect();
        Ok(w)
    }

    /// The configuration.
    pub fn config(&self) -> &ChatConfig {
        &self.config
    }

    fn new_session(&mut self) -> Session {
        let c = &self.config;
        let pick = self.rng.random_range(0..self.system.len().max(1));
        let context = self.system.get(pick).cloned().unwrap_or_default();
        let turns = self.rng.random_range(c.turns.clone());
        let lora = if c.adapter_share > 0.0 && self.rng.random_bool(c.adapter_share) {
            let pick = self.rng.random_range(0..c.adapters.len().max(1));
            c.adapters.get(pick).cloned()
        } else {
            None
        };
        Session {
            context,
            turn: 0,
            turns,
            lora,
        }
    }

    /// The next turn of live session `i`, or `None` if that session is over.
    fn next_turn(&mut self, i: usize) -> Option<SimRequest> {
        let c = &self.config;
        let rng = &mut self.rng;
        let s = self.live.get_mut(i)?;
        if s.turn >= s.turns {
            return None;
        }
        let range = if s.turn == 0 {
            c.first_message_tokens.clone()
        } else {
            c.user_tokens.clone()
        };
        let room = (c.max_prompt_tokens as usize).saturating_sub(s.context.len()) as u32;
        let mut user = rng.random_range(range);
        if user > room {
            if s.turn > 0 {
                return None;
            }
            // A fresh session always gets a first turn, however long its system prompt.
            user = room;
        }
        s.context
            .extend((0..user).map(|_| rng.random_range(0..c.vocab)));
        s.context.truncate(c.max_prompt_tokens as usize);
        let tokens = s.context.clone();
        let answer = rng.random_range(c.answer_tokens.clone());
        s.context
            .extend((0..answer).map(|_| rng.random_range(0..c.vocab)));
        s.turn += 1;
        // Exponential gaps: -mean * ln(1 - u), u in [0, 1).
        self.clock_ms += -c.mean_gap_ms * (1.0 - rng.random::<f64>()).ln();
        Some(SimRequest {
            tokens,
            lora: s.lora.clone(),
            output_tokens: answer,
            arrival_ms: self.clock_ms as u64,
        })
    }
}

impl Iterator for ChatWorkload {
    type Item = SimRequest;

    fn next(&mut self) -> Option<SimRequest> {
        if self.emitted >= self.config.requests || self.live.is_empty() {
            return None;
        }
        let i = self.rng.random_range(0..self.live.len());
        let request = match self.next_turn(i) {
            Some(r) => r,
            None => {
                let fresh = self.new_session();
                if let Some(slot) = self.live.get_mut(i) {
                    *slot = fresh;
                }
                self.next_turn(i)?
            }
        };
        self.emitted += 1;
        Some(request)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.config.requests.saturating_sub(self.emitted);
        (left, Some(left))
    }
}

fn random_tokens(rng: &mut SmallRng, vocab: u32, len: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(0..vocab)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(requests: usize) -> ChatConfig {
        ChatConfig {
            requests,
            ..ChatConfig::default()
        }
    }

    #[test]
    fn deterministic_and_exact_count() {
        let a: Vec<SimRequest> = ChatWorkload::new(small(300)).unwrap().collect();
        let b: Vec<SimRequest> = ChatWorkload::new(small(300)).unwrap().collect();
        assert_eq!(a.len(), 300);
        assert_eq!(a, b);
        let other: Vec<SimRequest> = ChatWorkload::new(ChatConfig {
            seed: 1,
            ..small(300)
        })
        .unwrap()
        .collect();
        assert_ne!(a, other);
    }

    #[test]
    fn lengths_sharing_and_arrivals_are_realistic() {
        let cfg = small(2000);
        let reqs: Vec<SimRequest> = ChatWorkload::new(cfg.clone()).unwrap().collect();
        let w = ChatWorkload::new(cfg.clone()).unwrap();
        let mut last = 0;
        for r in &reqs {
            assert!(r.tokens.len() <= cfg.max_prompt_tokens as usize);
            assert!(r.arrival_ms >= last);
            last = r.arrival_ms;
            // Every prompt starts with one of the system prompts.
            assert!(w.system.iter().any(|s| r.tokens.starts_with(s)));
        }
        let mean = reqs.iter().map(|r| r.tokens.len()).sum::<usize>() / reqs.len();
        let max = reqs.iter().map(|r| r.tokens.len()).max().unwrap();
        assert!((1500..6000).contains(&mean), "mean prompt {mean}");
        assert!(max > 6000, "longest prompt {max}");
        // Most requests continue an earlier one: their prompt extends an earlier prompt.
        let continued = reqs
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                reqs[..*i].iter().rev().take(400).any(|p| {
                    p.lora == r.lora && p.tokens.len() > 2100 && r.tokens.starts_with(&p.tokens)
                })
            })
            .count();
        assert!(continued * 2 > reqs.len(), "{continued} of {}", reqs.len());
        let adapted = reqs.iter().filter(|r| r.lora.is_some()).count();
        assert!(adapted > 0 && adapted * 4 < reqs.len(), "{adapted}");
    }

    #[test]
    fn bad_configs_are_refused() {
        let bad = [
            ChatConfig {
                system_prompts: 0,
                ..ChatConfig::default()
            },
            ChatConfig {
                turns: 0..=3,
                ..ChatConfig::default()
            },
            #[allow(clippy::reversed_empty_ranges)]
            ChatConfig {
                user_tokens: 5..=1,
                ..ChatConfig::default()
            },
            ChatConfig {
                adapter_share: 0.5,
                adapters: vec![],
                ..ChatConfig::default()
            },
            ChatConfig {
                mean_gap_ms: f64::NAN,
                ..ChatConfig::default()
            },
        ];
        for c in bad {
            assert!(ChatWorkload::new(c.clone()).is_err(), "{c:?}");
        }
    }

    #[test]
    fn tiny_prompt_cap_still_terminates() {
        let cfg = ChatConfig {
            max_prompt_tokens: 10,
            ..small(50)
        };
        let reqs: Vec<SimRequest> = ChatWorkload::new(cfg).unwrap().collect();
        assert_eq!(reqs.len(), 50);
        assert!(reqs.iter().all(|r| r.tokens.len() <= 10));
    }
}
