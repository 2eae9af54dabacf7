//! Workloads to replay ([`Workload`]): a Mooncake trace expanded into token ids, or the
//! embedded chat generator, and the infinite-cache bound of a workload's prefix-cache hit
//! rate.
//!
//! # Mooncake expansion
//! Each `hash_ids` entry names one 512-token block; it is expanded into 512 token ids that
//! depend on the id alone ([`sim::workload::mooncake::MooncakeRecord::tokens`], a fixed
//! mixing function), and the prompt is cut to `input_length`. Requests with equal leading
//! ids therefore have equal leading tokens, so their engine blocks (16 tokens by default)
//! hash equal and the trace's prefix sharing survives exactly; the last block of a request
//! is partial when `input_length` is not a multiple of 512.
//!
//! # The bound (`hit_rate_bound`)
//! What one cache that never evicts and serves every request could report, counted exactly
//! as a vLLM worker counts `cached_tokens`: for request `r` with `L` prompt tokens, at most
//! its first `floor((L - 1) / block_size)` full blocks can hit (vLLM always computes the
//! last prompt token, so a prompt that is an exact multiple of the block size can never hit
//! its last block); of those, the leading run whose chained block hash appeared as a full
//! block of any earlier prompt hits. The bound is the sum of hit blocks times `block_size`
//! over the sum of prompt tokens. Output tokens are never counted (a replayed prompt never
//! contains an earlier answer's synthetic tokens).
//!
//! # The capacity-aware bound (`capacity_hit_bound`)
//! The same count with the cluster's real capacity: one LRU cache of `workers x kv_blocks`
//! blocks serving every request, as if the cluster were one worker with all its memory
//! and the router always knew where everything was. A request hits the leading run of
//! its hittable blocks that the cache holds; then all its blocks become the most recently
//! used, the least recently used falling out past the capacity. Routing cannot beat one
//! shared cache of the same size (a block cached twice takes room twice), so this is what
//! a hit rate is judged against; the infinite-cache bound is what no capacity can beat.
//!
//! # Invariants
//! 1. Deterministic: the same file and options give the same requests, token for token.
//! 2. Arrivals are non-decreasing milliseconds from the first request (trace time divided
//!    by the rate scale).
use super::spec::ReplayRequest;
use anyhow::{Context, Result, bail};
use engine::SeqHash;
use engine::hash::{lora_seed, seq_hashes};
use sim::workload::DEFAULT_VOCAB;
use sim::workload::chat::{ChatConfig, ChatWorkload};
use sim::workload::mooncake::MooncakeTrace;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

/// How a trace is turned into a workload.
#[derive(Clone, Copy, Debug)]
pub struct TraceOptions {
    /// Keep only the first this many requests (`None`: all).
    pub max_requests: Option<usize>,
    /// Multiply the trace's request rate by this (arrival times are divided by it): above 1
    /// loads the cluster harder. Finite, > 0.
    pub rate_scale: f64,
    /// The engines' block size, for the bound.
    pub block_size: u32,
}

impl Default for TraceOptions {
    fn default() -> Self {
        Self {
            max_requests: None,
            rate_scale: 1.0,
            block_size: 16,
        }
    }
}

/// The infinite-cache bound of a workload (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bound {
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Of those, tokens an infinite cache would report as cached.
    pub reusable_tokens: u64,
    /// Distinct full blocks over all prompts (what such a cache would hold).
    pub distinct_blocks: u64,
}

impl Bound {
    /// `reusable_tokens / prompt_tokens` (0 for an empty workload).
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.reusable_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// A workload to replay.
#[derive(Clone, Debug)]
pub struct Workload {
    /// What it is, for reports.
    pub name: String,
    /// The requests, by arrival.
    pub requests: Vec<ReplayRequest>,
    /// Its infinite-cache bound at the engines' block size.
    pub bound: Bound,
}

impl Workload {
    /// A workload over `requests`, its bound computed with blocks of `block_size` tokens.
    pub fn new(name: String, requests: Vec<ReplayRequest>, block_size: u32) -> Self {
        let bound = hit_rate_bound(&requests, block_size);
        Self {
            name,
            requests,
            bound,
        }
    }

    /// The longest request's KV footprint, in blocks (prompt plus output).
    pub fn max_blocks(&self, block_size: u32) -> u64 {
        let bs = u64::from(block_size.max(1));
        self.requests
            .iter()
            .map(|r| (r.tokens.len() as u64 + u64::from(r.output_tokens)).div_ceil(bs))
            .max()
            .unwrap_or(0)
    }

    /// Simulated seconds from the first arrival to the last.
    pub fn span_s(&self) -> f64 {
        self.requests.last().map_or(0.0, |r| r.arrival_ms / 1000.0)
    }
}

/// The full blocks of a prompt of `tokens` tokens that a cache holding `cached` would
/// report as hits: the leading run of its hittable blocks (vLLM's counting, module docs).
fn hit_blocks(
    seqs: &[SeqHash],
    tokens: usize,
    bs: usize,
    cached: impl Fn(&SeqHash) -> bool,
) -> usize {
    let hittable = tokens.saturating_sub(1) / bs;
    seqs.iter().take(hittable).take_while(|s| cached(s)).count()
}

/// The bound of `requests` (in order) with blocks of `block_size` tokens.
pub fn hit_rate_bound(requests: &[ReplayRequest], block_size: u32) -> Bound {
    let bs = block_size.max(1) as usize;
    let mut seen = HashSet::new();
    let mut out = Bound::default();
    for r in requests {
        let seqs = seq_hashes(&r.tokens, bs, lora_seed(None));
        let hit = hit_blocks(&seqs, r.tokens.len(), bs, |s| seen.contains(s));
        out.prompt_tokens += r.tokens.len() as u64;
        out.reusable_tokens += (hit * bs) as u64;
        seen.extend(seqs);
    }
    out.distinct_blocks = seen.len() as u64;
    out
}

/// The capacity-aware bound of `requests` (in order): the hit rate of one LRU cache of
/// `capacity_blocks` blocks of `block_size` tokens (see the module docs).
pub fn capacity_hit_bound(
    requests: &[ReplayRequest],
    block_size: u32,
    capacity_blocks: u64,
) -> f64 {
    let bs = block_size.max(1) as usize;
    // Block -> its last use; last use -> block: the oldest entry is the one to evict.
    let mut stamp_of: HashMap<u64, u64> = HashMap::new();
    let mut by_stamp: BTreeMap<u64, u64> = BTreeMap::new();
    let mut clock = 0u64;
    let (mut prompt, mut hit_tokens) = (0u64, 0u64);
    for r in requests {
        let seqs = seq_hashes(&r.tokens, bs, lora_seed(None));
        let hit = hit_blocks(&seqs, r.tokens.len(), bs, |s| stamp_of.contains_key(&s.0));
        prompt += r.tokens.len() as u64;
        hit_tokens += (hit * bs) as u64;
        for s in &seqs {
            clock += 1;
            if let Some(old) = stamp_of.insert(s.0, clock) {
                by_stamp.remove(&old);
            }
            by_stamp.insert(clock, s.0);
        }
        while stamp_of.len() as u64 > capacity_blocks {
            let Some((_, victim)) = by_stamp.pop_first() else {
                break;
            };
            stamp_of.remove(&victim);
        }
    }
    if prompt == 0 {
        0.0
    } else {
        hit_tokens as f64 / prompt as f64
    }
}

/// Token ids of a trace request: each 512-token `hash_ids` entry expanded from the id
/// alone, cut to `input_length` (see the module docs).
pub fn expand(hash_ids: &[u64], input_length: u32) -> Vec<u32> {
    sim::workload::mooncake::MooncakeRecord {
        timestamp_ms: 0,
        input_length,
        output_length: 0,
        hash_ids: hash_ids.into(),
    }
    .tokens(DEFAULT_VOCAB)
}

fn check_rate(rate_scale: f64) -> Result<()> {
    if !(rate_scale.is_finite() && rate_scale > 0.0) {
        bail!("the rate scale must be a finite number above 0, not {rate_scale}");
    }
    Ok(())
}

/// A workload from Mooncake JSONL text (`name` describes it).
pub fn parse_trace(text: &str, name: &str, opts: &TraceOptions) -> Result<Workload> {
    check_rate(opts.rate_scale)?;
    let trace = MooncakeTrace::parse(text).context("reading the trace")?;
    let keep = opts.max_requests.unwrap_or(usize::MAX);
    let first = trace.records().first().map_or(0, |r| r.timestamp_ms);
    let mut requests = Vec::with_capacity(trace.len().min(keep));
    let mut last = 0.0f64;
    for r in trace.records().iter().take(keep) {
        let mut tokens = r.tokens(DEFAULT_VOCAB);
        if tokens.is_empty() {
            // An empty prompt cannot be sent; one token stands for it.
            tokens.push(0);
        }
        let at = r.timestamp_ms.saturating_sub(first) as f64 / opts.rate_scale;
        last = last.max(at);
        requests.push(ReplayRequest {
            arrival_ms: last,
            tokens: Arc::from(tokens),
            output_tokens: r.output_length.max(1),
        });
    }
    Ok(Workload::new(name.to_owned(), requests, opts.block_size))
}

/// A workload from the Mooncake JSONL trace at `path`.
pub fn load_trace(path: &Path, opts: &TraceOptions) -> Result<Workload> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the trace {}", path.display()))?;
    let name = format!(
        "mooncake {}",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into()
        )
    );
    parse_trace(&text, &name, opts).with_context(|| path.display().to_string())
}

/// The built-in chat workload: `requests` turns of multi-turn conversations over a few
/// shared system prompts ([`sim::workload::chat`]), on the base model.
pub fn chat_workload(config: ChatConfig, block_size: u32) -> Result<Workload> {
    let config = ChatConfig {
        adapter_share: 0.0,
        ..config
    };
    let name = format!(
        "chat: {} requests, {} live sessions, {} system prompts, seed {}",
        config.requests, config.live_sessions, config.system_prompts, config.seed
    );
    let requests = ChatWorkload::new(config)
        .context("the chat workload")?
        .map(|r| ReplayRequest {
            arrival_ms: r.arrival_ms as f64,
            tokens: Arc::from(r.tokens),
            output_tokens: r.output_tokens.max(1),
        })
        .collect();
    Ok(Workload::new(name, requests, block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(tokens: Vec<u32>) -> ReplayRequest {
        ReplayRequest {
            arrival_ms: 0.0,
            tokens: Arc::from(tokens),
            output_tokens: 1,
        }
    }

    /// The reference: an LRU as a list, most recent last, searched linearly.
    fn reference(requests: &[ReplayRequest], bs: usize, capacity: usize) -> f64 {
        let mut lru: Vec<SeqHashValue> = Vec::new();
        let (mut prompt, mut hit) = (0usize, 0usize);
        for r in requests {
            let seqs: Vec<u64> = seq_hashes(&r.tokens, bs, lora_seed(None))
                .iter()
                .map(|s| s.0)
                .collect();
            let hittable = r.tokens.len().saturating_sub(1) / bs;
            hit += bs
                * seqs
                    .iter()
                    .take(hittable)
                    .take_while(|s| lru.contains(s))
                    .count();
            prompt += r.tokens.len();
            for s in seqs {
                lru.retain(|x| *x != s);
                lru.push(s);
            }
            while lru.len() > capacity {
                lru.remove(0);
            }
        }
        hit as f64 / prompt as f64
    }
    type SeqHashValue = u64;

    #[test]
    fn capacity_bound_matches_a_list_lru_and_the_infinite_bound_when_big() {
        // Prompts over 4 shared prefixes of 3 blocks, each with a private tail of 2 blocks.
        let bs = 4;
        let mut requests = Vec::new();
        for i in 0..60u32 {
            let prefix = (i * 7) % 4;
            let mut t: Vec<u32> = (0..12).map(|k| prefix * 1000 + k).collect();
            t.extend((0..9).map(|k| 100_000 + i * 100 + k));
            requests.push(request(t));
        }
        let infinite = hit_rate_bound(&requests, bs as u32).hit_rate();
        assert!(infinite > 0.3, "{infinite}");
        for capacity in [1usize, 5, 8, 13, 30, 400] {
            let got = capacity_hit_bound(&requests, bs as u32, capacity as u64);
            let want = reference(&requests, bs, capacity);
            assert!(
                (got - want).abs() < 1e-12,
                "capacity {capacity}: {got} vs {want}"
            );
            assert!(got <= infinite + 1e-12);
        }
        assert!((capacity_hit_bound(&requests, bs as u32, 400) - infinite).abs() < 1e-12);
        assert!(capacity_hit_bound(&requests, bs as u32, 5) < infinite);
    }
}
