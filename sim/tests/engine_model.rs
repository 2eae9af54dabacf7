//! The simulated vLLM engine ([`sim::engine::SimEngine`]) against its contract: its KV
//! events rebuild its cache in kvengine's index, the scheduler respects its limits and
//! finishes every request in order, prefix caching and batching show in the timing, and bad
//! input is refused without effect.

use std::collections::HashMap;
use std::time::Duration;

use engine::hash::{lora_seed, seq_hashes};
use engine::kv_index::KvIndex;
use engine::{RequestId, WorkerKey};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sim::SimError;
use sim::engine::{
    EngineConfig, FinishReason, NewRequest, Output, SimEngine, Step, TimingModel, output_token,
};
use transport::kv_events::{ConvertConfig, WireEvent, convert};

fn config(kv_blocks: u32, block_size: u32, max_num_seqs: u32, budget: u32) -> EngineConfig {
    EngineConfig {
        kv_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens: budget,
        dp_rank: 3,
        timing: TimingModel::default(),
    }
}

fn request(id: u64, prompt: &[u32], max_tokens: u32, lora: Option<&str>) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt: prompt.to_vec(),
        max_tokens,
        lora_name: lora.map(str::to_owned),
        remote_prefill: None,
    }
}

/// What the client side has seen of one request.
#[derive(Debug, Default)]
struct Seen {
    prompt: Vec<u32>,
    lora: Option<String>,
    max_tokens: u32,
    tokens: Vec<u32>,
    finished: bool,
    aborted: bool,
    cached_tokens: Option<u32>,
}

/// Drives the client side: checks every step's limits and every request's output order.
struct Client {
    cfg: EngineConfig,
    seen: HashMap<RequestId, Seen>,
    now: Duration,
}

impl Client {
    fn new(cfg: &EngineConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            seen: HashMap::new(),
            now: Duration::ZERO,
        }
    }

    fn submit(&mut self, e: &mut SimEngine, r: NewRequest) {
        self.try_submit(e, r).unwrap();
    }

    fn try_submit(&mut self, e: &mut SimEngine, r: NewRequest) -> sim::Result<()> {
        let seen = Seen {
            prompt: r.prompt.clone(),
            lora: r.lora_name.clone(),
            max_tokens: r.max_tokens,
            ..Seen::default()
        };
        let id = r.id;
        e.add_request(r)?;
        self.seen.insert(id, seen);
        Ok(())
    }

    fn abort(&mut self, e: &mut SimEngine, id: RequestId) {
        e.abort(id).unwrap();
        self.seen.get_mut(&id).unwrap().aborted = true;
    }

    /// Runs one step and checks it.
    fn step(&mut self, e: &mut SimEngine) -> Option<Step> {
        let step = e.step(self.now)?;
        assert!(step.start >= self.now);
        assert!(step.scheduled_tokens() <= self.cfg.max_num_batched_tokens);
        assert!(step.scheduled_seqs <= self.cfg.max_num_seqs);
        assert!(
            step.scheduled_seqs >= 1,
            "a step with work computes something"
        );
        assert!(step.duration > Duration::ZERO);
        assert!(e.load().num_requests_running <= self.cfg.max_num_seqs);
        self.now = step.end();
        for o in &step.outputs {
            let s = self
                .seen
                .get_mut(&o.id())
                .expect("output for an unknown request");
            assert!(!s.finished && !s.aborted, "output after the end: {o:?}");
            match *o {
                Output::FirstToken {
                    id,
                    token,
                    prompt_tokens,
                    cached_tokens,
                } => {
                    assert!(s.tokens.is_empty(), "FirstToken twice for {id}");
                    assert_eq!(prompt_tokens as usize, s.prompt.len());
                    assert!(cached_tokens < prompt_tokens);
                    assert_eq!(cached_tokens % self.cfg.block_size, 0);
                    s.cached_tokens = Some(cached_tokens);
                    s.tokens.push(token);
                }
                Output::Token { id, token } => {
                    assert!(!s.tokens.is_empty(), "Token before FirstToken for {id}");
                    s.tokens.push(token);
                }
                Output::Finished {
                    id,
                    output_tokens,
                    reason,
                } => {
                    assert_eq!(reason, FinishReason::Length);
                    assert_eq!(output_tokens, s.max_tokens);
                    assert_eq!(s.tokens.len(), s.max_tokens as usize);
                    let want: Vec<u32> = (0..s.max_tokens).map(|i| output_token(id, i)).collect();
                    assert_eq!(s.tokens, want, "tokens of {id}");
                    s.finished = true;
                }
            }
            assert!(s.tokens.len() <= s.max_tokens as usize);
        }
        Some(step)
    }

    /// Steps until the engine is idle; returns the steps.
    fn drain(&mut self, e: &mut SimEngine) -> Vec<Step> {
        let mut steps = Vec::new();
        while let Some(s) = self.step(e) {
            steps.push(s);
            assert!(steps.len() < 1_000_000, "no progress");
        }
        assert!(!e.has_work());
        steps
    }

    /// Asserts the end state: everything finished or aborted, nothing referenced, counters
    /// consistent.
    fn assert_done(&self, e: &SimEngine) {
        let st = e.stats();
        assert!(self.seen.values().all(|s| s.finished || s.aborted));
        let finished = self.seen.values().filter(|s| s.finished).count() as u64;
        let aborted = self.seen.values().filter(|s| s.aborted).count() as u64;
        assert_eq!(st.finished, finished);
        assert_eq!(st.aborted, aborted);
        assert_eq!(st.requests, finished + aborted);
        let outputs: u64 = self.seen.values().map(|s| s.tokens.len() as u64).sum();
        assert_eq!(st.output_tokens, outputs);
        let cached: u64 = self
            .seen
            .values()
            .filter_map(|s| s.cached_tokens)
            .map(u64::from)
            .sum();
        assert!(st.cached_tokens >= cached);
        assert_eq!(st.referenced_blocks, 0);
        assert_eq!(e.load().kv_usage, 0.0);
        assert_eq!(e.load().num_requests_running, 0);
        assert_eq!(e.load().num_requests_waiting, 0);
        assert!(st.cached_blocks <= u64::from(st.kv_blocks));
        assert_eq!(
            st.stored_blocks - st.evicted_blocks,
            st.cached_blocks,
            "stores minus evictions is what stays cached"
        );
    }
}

/// Applies every pending event batch of `e` to `index`, asserting nothing is refused.
fn replay(e: &mut SimEngine, index: &mut KvIndex, bs: u32, last_ts: &mut f64) {
    while let Some(batch) = e.poll_events() {
        let ts = batch.ts.unwrap();
        assert!(ts >= *last_ts, "batches in time order");
        *last_ts = ts;
        assert_eq!(batch.dp_rank, Some(e.config().dp_rank));
        for ev in &batch.events {
            match ev {
                WireEvent::Stored {
                    block_hashes,
                    token_ids,
                    block_size,
                    medium,
                    ..
                } => {
                    assert_eq!(*block_size, Some(bs));
                    assert_eq!(token_ids.len(), block_hashes.len() * bs as usize);
                    assert_eq!(medium.as_deref(), Some("GPU"));
                }
                WireEvent::Removed { medium, .. } => assert_eq!(medium.as_deref(), Some("GPU")),
                WireEvent::Cleared => {}
            }
        }
        let conv = convert(batch, &ConvertConfig { block_size: bs });
        assert!(conv.drops.is_empty(), "{:?}", conv.drops);
        let key = WorkerKey {
            worker: engine::WorkerId(1),
            dp_rank: conv.dp_rank,
        };
        for ev in &conv.events {
            index.apply(key, ev).unwrap();
        }
    }
    assert_eq!(index.rejects().total(), 0);
}

fn key(e: &SimEngine) -> WorkerKey {
    WorkerKey::new(1, e.config().dp_rank)
}

/// A random prompt: one of a few documents sharing a head, cut anywhere, maybe extended.
fn random_prompt(rng: &mut SmallRng, docs: &[Vec<u32>]) -> Vec<u32> {
    let d = &docs[rng.random_range(0..docs.len())];
    let cut = rng.random_range(1..=d.len());
    let mut p = d[..cut].to_vec();
    if rng.random_bool(0.3) {
        p.extend((0..rng.random_range(1..12)).map(|_| rng.random_range(0..40)));
    }
    p
}

#[test]
fn events_rebuild_the_engine_cache_in_a_kv_index_under_random_workloads() {
    const BS: u32 = 4;
    let mut preemptions = 0;
    let mut evictions = 0;
    for seed in 0..60u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let cfg = config(
            rng.random_range(12..48),
            BS,
            rng.random_range(1..8),
            rng.random_range(1..40),
        );
        let mut e = SimEngine::new(cfg.clone()).unwrap();
        let mut client = Client::new(&cfg);
        let mut index = KvIndex::new();
        let mut last_ts = 0.0;
        let head: Vec<u32> = (0..BS * 2).map(|_| rng.random_range(0..40)).collect();
        let docs: Vec<Vec<u32>> = (0..4)
            .map(|_| {
                let len = rng.random_range(0..BS * 5);
                head.iter()
                    .copied()
                    .chain((0..len).map(|_| rng.random_range(0..40)))
                    .collect()
            })
            .collect();
        let loras = [None, Some("adapter-a")];
        let mut next_id = 0u64;
        for round in 0..120 {
            // Arrivals.
            for _ in 0..rng.random_range(0..3) {
                let prompt = random_prompt(&mut rng, &docs);
                let max_tokens = rng.random_range(1..14);
                let r = request(next_id, &prompt, max_tokens, loras[rng.random_range(0..2)]);
                next_id += 1;
                match client.try_submit(&mut e, r) {
                    Ok(()) => {}
                    Err(SimError::RequestTooLarge { .. }) => {}
                    Err(err) => panic!("{err}"),
                }
            }
            // Client disconnects.
            if rng.random_bool(0.1) {
                let live: Vec<RequestId> = client
                    .seen
                    .iter()
                    .filter(|(_, s)| !s.finished && !s.aborted)
                    .map(|(&id, _)| id)
                    .collect();
                if !live.is_empty() {
                    let mut live = live;
                    live.sort();
                    client.abort(&mut e, live[rng.random_range(0..live.len())]);
                }
            }
            if round < 100 || rng.random_bool(0.5) {
                client.step(&mut e);
            }
            replay(&mut e, &mut index, BS, &mut last_ts);
            // The index agrees with the engine for the prompts seen and random queries,
            // in both namespaces, including sequences grown by their outputs.
            let mut queries: Vec<(Vec<u32>, Option<String>)> = client
                .seen
                .values()
                .map(|s| {
                    let mut q = s.prompt.clone();
                    q.extend(&s.tokens);
                    (q, s.lora.clone())
                })
                .collect();
            for _ in 0..4 {
                let lora = loras[rng.random_range(0..2)].map(str::to_owned);
                queries.push((random_prompt(&mut rng, &docs), lora));
            }
            for (q, lora) in &queries {
                let lora = lora.as_deref();
                let m = index.find_matches(&seq_hashes(q, BS as usize, lora_seed(lora)));
                assert_eq!(
                    m.overlap(key(&e)),
                    e.cached_prefix_blocks(q, lora),
                    "seed {seed} round {round}"
                );
            }
        }
        client.drain(&mut e);
        replay(&mut e, &mut index, BS, &mut last_ts);
        client.assert_done(&e);
        assert_eq!(index.cached_blocks(key(&e)), e.stats().cached_blocks);
        preemptions += e.stats().preemptions;
        evictions += e.stats().evicted_blocks;
    }
    assert!(preemptions > 0, "the workloads must exercise preemption");
    assert!(evictions > 0, "the workloads must exercise eviction");
}

#[test]
fn every_request_finishes_in_order_within_the_limits_and_counters_add_up() {
    const BS: u32 = 16;
    // A cache big enough that nothing is preempted: the accounting is then exact.
    let cfg = config(4096, BS, 8, 512);
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    let mut client = Client::new(&cfg);
    let mut rng = SmallRng::seed_from_u64(7);
    let system: Vec<u32> = (0..100).collect();
    for id in 0..60 {
        let mut prompt = system.clone();
        prompt.extend((0..rng.random_range(1..900)).map(|_| rng.random_range(0..50_000)));
        client.submit(&mut e, request(id, &prompt, rng.random_range(1..60), None));
    }
    let steps = client.drain(&mut e);
    client.assert_done(&e);
    let st = e.stats();
    assert_eq!(st.preemptions, 0);
    assert_eq!(st.admitted, 60);
    let prompt_tokens: u64 = client.seen.values().map(|s| s.prompt.len() as u64).sum();
    let max_tokens: u64 = client.seen.values().map(|s| u64::from(s.max_tokens)).sum();
    assert_eq!(st.prompt_tokens, prompt_tokens);
    assert_eq!(st.output_tokens, max_tokens);
    // Every prompt token is either cached or prefilled once; every output but the last
    // of each request is decoded once.
    assert_eq!(st.prefill_tokens, st.prompt_tokens - st.cached_tokens);
    assert_eq!(st.decode_tokens, st.output_tokens - st.finished);
    let per_step: u64 = steps
        .iter()
        .map(|s| u64::from(s.prefill_tokens + s.decode_seqs))
        .sum();
    assert_eq!(per_step, st.prefill_tokens + st.decode_tokens);
    assert_eq!(st.steps, steps.len() as u64);
    assert_eq!(st.busy, steps.iter().map(|s| s.duration).sum::<Duration>());
    // The shared system prompt is cached for everyone but the first.
    assert!(st.cached_tokens >= 59 * 96, "{}", st.cached_tokens);
    // Decodes fill blocks too: more blocks were stored than prompts alone hold.
    let prompt_blocks: u64 = client
        .seen
        .values()
        .map(|s| s.prompt.len() as u64 / 16)
        .sum();
    assert!(st.stored_blocks > prompt_blocks - 59 * 6);
    // Chunked prefill kept many steps at the budget; max_num_seqs bounded the batch.
    assert!(steps.iter().any(|s| s.scheduled_tokens() == 512));
    assert!(steps.iter().any(|s| s.scheduled_seqs == 8));
}

#[test]
fn a_repeated_prompt_hits_its_full_blocks_and_reaches_its_first_token_sooner() {
    let cfg = config(1024, 16, 256, 8192);
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    let mut client = Client::new(&cfg);
    let prompt: Vec<u32> = (0..1000).map(|i| 7 + i * 3).collect(); // 62 full blocks + 8
    let first_token_step = |client: &mut Client, e: &mut SimEngine, id: u64| {
        client.submit(e, request(id, &prompt, 3, None));
        let mut ttft = Duration::ZERO;
        for s in client.drain(e) {
            if s.outputs
                .iter()
                .any(|o| matches!(o, Output::FirstToken { .. }))
            {
                ttft = s.duration;
            }
        }
        (ttft, client.seen[&RequestId(id)].cached_tokens.unwrap())
    };
    let (cold, cached) = first_token_step(&mut client, &mut e, 1);
    assert_eq!(cached, 0);
    assert_eq!(e.cached_prefix_blocks(&prompt, None), 62);
    let (warm, cached) = first_token_step(&mut client, &mut e, 2);
    assert_eq!(cached, 62 * 16);
    assert!(warm * 5 < cold, "warm {warm:?} cold {cold:?}");
    // Another adapter shares nothing.
    client.submit(&mut e, request(3, &prompt, 1, Some("lora-x")));
    client.drain(&mut e);
    assert_eq!(client.seen[&RequestId(3)].cached_tokens, Some(0));

    // A prompt of whole blocks recomputes its last token: the last block is not a hit.
    let whole: Vec<u32> = (0..64).collect();
    client.submit(&mut e, request(4, &whole, 1, None));
    client.drain(&mut e);
    client.submit(&mut e, request(5, &whole, 1, None));
    client.drain(&mut e);
    assert_eq!(client.seen[&RequestId(5)].cached_tokens, Some(48));
    assert_eq!(e.cached_prefix_blocks(&whole, None), 4);
    client.assert_done(&e);
}

/// Duration of the first step of a fresh engine given `requests`.
fn first_step(cfg: &EngineConfig, requests: &[NewRequest]) -> Step {
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    for r in requests {
        e.add_request(r.clone()).unwrap();
    }
    e.step(Duration::ZERO).unwrap()
}

#[test]
fn step_time_grows_with_uncached_tokens_and_with_batch_size() {
    let cfg = config(4096, 16, 256, 8192);
    // Prefill: longer uncached prompts take longer.
    let mut last = Duration::ZERO;
    for n in [1u32, 10, 100, 1000, 4000, 8192] {
        let p: Vec<u32> = (0..n).collect();
        let s = first_step(&cfg, &[request(1, &p, 1, None)]);
        assert_eq!(s.prefill_tokens, n);
        assert!(s.duration > last, "{n}: {:?} <= {last:?}", s.duration);
        last = s.duration;
    }
    // Decode: a bigger batch takes longer. Admit k one-token prompts, then time the
    // all-decode second step.
    let mut last = Duration::ZERO;
    for k in [1u64, 2, 8, 32, 128, 256] {
        let mut e = SimEngine::new(cfg.clone()).unwrap();
        for id in 0..k {
            e.add_request(request(id, &[id as u32 + 1], 2, None))
                .unwrap();
        }
        e.step(Duration::ZERO).unwrap();
        let s = e.step(Duration::ZERO).unwrap();
        assert_eq!((s.decode_seqs, s.prefill_tokens), (k as u32, 0));
        assert!(s.duration > last, "{k}: {:?} <= {last:?}", s.duration);
        last = s.duration;
    }
    // Cached tokens are free: the same prompt's prefill step is cheaper when warm.
    let p: Vec<u32> = (0..2000).collect();
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    e.add_request(request(1, &p, 1, None)).unwrap();
    let cold = e.step(Duration::ZERO).unwrap();
    e.add_request(request(2, &p, 1, None)).unwrap();
    let warm = e.step(Duration::ZERO).unwrap();
    assert_eq!(warm.prefill_tokens, 2000 - 1984);
    assert!(warm.duration < cold.duration);
}

#[test]
fn a_tiny_cache_preempts_and_still_completes_every_request_in_order() {
    // 4 requests of 8 prompt tokens and 20 outputs need 7 pages each; the cache has 10.
    let cfg = config(10, 4, 4, 64);
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    let mut client = Client::new(&cfg);
    let mut index = KvIndex::new();
    let mut last_ts = 0.0;
    for id in 0..4 {
        let prompt: Vec<u32> = (0..8).map(|t| t + 100 * id as u32).collect();
        client.submit(&mut e, request(id, &prompt, 20, None));
    }
    let mut preempted_in_steps = 0;
    while let Some(s) = client.step(&mut e) {
        preempted_in_steps += s.preempted;
        assert!(e.load().kv_usage <= 1.0);
        replay(&mut e, &mut index, 4, &mut last_ts);
        for s in client.seen.values() {
            let mut q = s.prompt.clone();
            q.extend(&s.tokens);
            let m = index.find_matches(&seq_hashes(&q, 4, lora_seed(None)));
            assert_eq!(m.overlap(key(&e)), e.cached_prefix_blocks(&q, None));
        }
    }
    let st = e.stats();
    assert!(st.preemptions > 0);
    assert_eq!(u64::from(preempted_in_steps), st.preemptions);
    assert!(
        st.prefill_tokens > st.prompt_tokens - st.cached_tokens,
        "recomputation"
    );
    client.assert_done(&e);
}

#[test]
fn abort_frees_pages_and_silences_the_request() {
    let cfg = config(64, 4, 8, 64);
    let mut e = SimEngine::new(cfg.clone()).unwrap();
    let mut client = Client::new(&cfg);
    let prompt: Vec<u32> = (0..30).collect();
    client.submit(&mut e, request(1, &prompt, 50, None));
    client.submit(&mut e, request(2, &prompt, 5, None));
    client.step(&mut e).unwrap();
    client.step(&mut e).unwrap();
    assert!(e.load().kv_usage > 0.0);
    client.abort(&mut e, RequestId(1));
    assert!(!e.is_active(RequestId(1)));
    // Client::step panics on any output for the aborted request.
    client.drain(&mut e);
    client.assert_done(&e);
    // Its blocks stay cached.
    assert_eq!(e.cached_prefix_blocks(&prompt, None), 7);
    // Aborting a waiting request works too.
    client.submit(&mut e, request(3, &prompt, 5, None));
    client.abort(&mut e, RequestId(3));
    assert!(!e.has_work());
    assert!(e.step(Duration::ZERO).is_none());
    client.assert_done(&e);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    assert!(matches!(
        SimEngine::new(config(0, 16, 1, 1)),
        Err(SimError::InvalidConfig {
            name: "kv_blocks",
            ..
        })
    ));
    assert!(matches!(
        SimEngine::new(config(8, 16, 0, 1)),
        Err(SimError::InvalidConfig { .. })
    ));
    let cfg = config(8, 4, 4, 64); // 32 tokens of KV
    let mut e = SimEngine::new(cfg).unwrap();
    e.add_request(request(1, &[1, 2, 3, 4, 5], 3, None))
        .unwrap();
    let before = (e.stats(), e.load());
    let refused = [
        request(1, &[9, 9], 1, None),
        request(2, &[], 1, None),
        request(3, &[1, 2], 0, None),
        request(4, &[0; 33], 1, None),
        request(5, &[0; 30], 4, None), // 33 tokens of KV with its outputs
    ];
    for r in refused {
        let id = r.id;
        let err = e.add_request(r).unwrap_err();
        match id.0 {
            1 => assert!(matches!(err, SimError::DuplicateRequest(_))),
            2 | 3 => assert!(matches!(err, SimError::InvalidRequest { .. })),
            _ => assert!(matches!(
                err,
                SimError::RequestTooLarge {
                    kv_blocks: 8,
                    needed_blocks: 9,
                    ..
                }
            )),
        }
        assert!(!e.is_active(id) || id.0 == 1);
    }
    assert!(matches!(
        e.abort(RequestId(42)),
        Err(SimError::UnknownRequest(RequestId(42)))
    ));
    assert_eq!((e.stats(), e.load()), before);
    assert!(e.poll_events().is_none());
    // Exactly the cache: accepted, and it finishes.
    e.add_request(request(6, &[0; 30], 3, None)).unwrap();
    while e.step(Duration::ZERO).is_some() {}
    assert_eq!(e.stats().finished, 2);
}

#[test]
fn steps_follow_the_callers_clock_and_events_carry_the_step_end() {
    let cfg = config(64, 4, 8, 64);
    let mut e = SimEngine::new(cfg).unwrap();
    e.add_request(request(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 2, None))
        .unwrap();
    let s1 = e.step(Duration::from_secs(100)).unwrap();
    assert_eq!(s1.start, Duration::from_secs(100));
    let batch = e.poll_events().unwrap();
    assert_eq!(batch.ts, Some(s1.end().as_secs_f64()));
    assert_eq!(batch.dp_rank, Some(3));
    // A `now` before the previous step's end starts at that end.
    let s2 = e.step(Duration::from_secs(1)).unwrap();
    assert_eq!(s2.start, s1.end());
    assert!(e.step(Duration::from_secs(200)).is_none());
    // Reset publishes Cleared and empties the cache; refused while pages are held.
    assert!(e.reset_prefix_cache());
    let batch = e.poll_events().unwrap();
    assert_eq!(batch.events, vec![WireEvent::Cleared]);
    assert_eq!(e.cached_prefix_blocks(&[1, 2, 3, 4], None), 0);
    e.add_request(request(2, &[1; 9], 4, None)).unwrap();
    e.step(Duration::ZERO).unwrap();
    assert!(!e.reset_prefix_cache());
}

#[test]
fn decode_tokens_fill_and_publish_blocks_chained_onto_the_prompt() {
    let cfg = config(64, 4, 8, 64);
    let mut e = SimEngine::new(cfg).unwrap();
    let prompt = [1, 2, 3, 4, 5, 6];
    e.add_request(request(9, &prompt, 8, Some("tuned")))
        .unwrap();
    /// One published store: hashes, parent, tokens.
    struct Store {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    }
    let mut stored = Vec::new();
    while e.step(Duration::ZERO).is_some() {
        while let Some(b) = e.poll_events() {
            for ev in b.events {
                if let WireEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    lora_name,
                    lora_id,
                    ..
                } = ev
                {
                    assert_eq!(lora_id, None);
                    assert_eq!(lora_name.as_deref(), Some("tuned"));
                    stored.push(Store {
                        hashes: block_hashes,
                        parent,
                        tokens: token_ids,
                    });
                }
            }
        }
    }
    // KV of 6 + 7 = 13 tokens: 3 full blocks, the first from the prompt.
    let outputs: Vec<u32> = (0..8).map(|i| output_token(RequestId(9), i)).collect();
    let seq: Vec<u32> = prompt.iter().copied().chain(outputs).collect();
    let all_tokens: Vec<u32> = stored.iter().flat_map(|s| s.tokens.clone()).collect();
    assert_eq!(all_tokens, seq[..12]);
    assert_eq!(stored[0].parent, None);
    for w in stored.windows(2) {
        assert_eq!(
            w[1].parent,
            w[0].hashes.last().copied(),
            "each store chains on the last"
        );
    }
    assert_eq!(e.cached_prefix_blocks(&seq, Some("tuned")), 3);
    assert_eq!(e.cached_prefix_blocks(&seq, None), 0);
}
