//! Unit tests of [`SimEngine`] that look inside: page references match the running
//! requests, waiting requests hold nothing, the cached set stays prefix-closed, and
//! duplicate blocks computed concurrently are stored once.

use super::*;
use crate::worker::hashing::engine_hash;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use wire::kv_events::WireEvent;

fn engine(kv_blocks: u32, block_size: u32, max_num_seqs: u32, budget: u32) -> SimEngine {
    SimEngine::new(EngineConfig {
        kv_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens: budget,
        dp_rank: 0,
        timing: TimingModel::default(),
    })
    .unwrap()
}

fn req(id: u64, prompt: &[u32], max_tokens: u32) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt: prompt.to_vec(),
        max_tokens,
        lora_name: None,
        remote_prefill: None,
    }
}

impl SimEngine {
    /// Checks the scheduler's and the cache's invariants (tests only).
    fn check_invariants(&self) {
        let s = &self.sched;
        let bs = self.config.block_size;
        s.cache.check_invariants();
        assert!(s.running.len() as u32 <= self.config.max_num_seqs);
        assert_eq!(s.running.len() + s.waiting.len(), s.requests.len());
        let mut refs = vec![0u32; s.cache.capacity() as usize];
        for id in &s.running {
            let r = &s.requests[id];
            assert!(r.computed < r.num_tokens(), "a running request has work");
            assert_eq!(r.blocks.len() as u32, r.computed.div_ceil(bs));
            assert_eq!(r.committed, r.computed / bs);
            for (i, b) in r.blocks.iter().enumerate() {
                refs[b.index()] += 1;
                // Every full page caches its block: the prefix of the chain is cached.
                if (i as u32) < r.committed {
                    assert_eq!(s.cache.prefix_hits(&r.hashes[..=i]).len(), i + 1);
                }
            }
        }
        for id in &s.waiting {
            let r = &s.requests[id];
            assert!(
                r.blocks.is_empty() && r.computed == 0,
                "waiting holds pages"
            );
        }
        assert_eq!(
            s.cache.refs(),
            refs,
            "references and running requests disagree"
        );
    }
}

#[test]
fn random_workloads_keep_the_invariants() {
    for seed in 0..40u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut e = engine(
            rng.random_range(6..40),
            rng.random_range(1..5),
            rng.random_range(1..6),
            rng.random_range(1..30),
        );
        let head: Vec<u32> = (0..6).map(|_| rng.random_range(0..20)).collect();
        let mut live = Vec::new();
        for id in 0..150u64 {
            let mut prompt = head[..rng.random_range(0..head.len())].to_vec();
            prompt.extend((0..rng.random_range(1..12)).map(|_| rng.random_range(0..20)));
            if e.add_request(req(id, &prompt, rng.random_range(1..12)))
                .is_ok()
            {
                live.push(RequestId(id));
            }
            if !live.is_empty() && rng.random_bool(0.1) {
                let victim = live.swap_remove(rng.random_range(0..live.len()));
                let _ = e.abort(victim); // may have finished already
            }
            for _ in 0..rng.random_range(0..3) {
                e.step(Duration::ZERO);
                e.check_invariants();
            }
        }
        while e.step(Duration::ZERO).is_some() {
            e.check_invariants();
        }
        assert_eq!(e.sched.cache.referenced(), 0);
    }
}

#[test]
fn concurrent_identical_prefills_store_each_block_once() {
    // Budget 4: A prefills a block per step; B, admitted behind it, hits what A has cached,
    // then both compute the rest: the later copy of each block is deduplicated.
    let mut e = engine(32, 4, 4, 6);
    let prompt: Vec<u32> = (0..17).collect();
    e.add_request(req(1, &prompt, 2)).unwrap();
    e.step(Duration::ZERO).unwrap(); // A: 6 tokens, 1 block stored
    e.add_request(req(2, &prompt, 2)).unwrap();
    while e.step(Duration::ZERO).is_some() {
        e.check_invariants();
    }
    let mut stored = Vec::new();
    while let Some(b) = e.poll_events() {
        for ev in b.events {
            if let WireEvent::Stored { block_hashes, .. } = ev {
                stored.extend(block_hashes);
            }
        }
    }
    let mut unique = stored.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), stored.len(), "a block was stored twice");
    assert_eq!(e.cached_prefix_blocks(&prompt, None), 4);
}

#[test]
fn a_whole_block_prompt_recomputes_into_the_cached_page() {
    let mut e = engine(8, 4, 4, 64);
    let prompt: Vec<u32> = (0..8).collect();
    e.add_request(req(1, &prompt, 1)).unwrap();
    while e.step(Duration::ZERO).is_some() {}
    while e.poll_events().is_some() {}
    e.add_request(req(2, &prompt, 1)).unwrap();
    let s = e.step(Duration::ZERO).unwrap();
    assert_eq!(s.prefill_tokens, 4, "the last block is recomputed");
    assert!(matches!(
        s.outputs[0],
        Output::FirstToken {
            cached_tokens: 4,
            ..
        }
    ));
    assert!(
        e.poll_events().is_none(),
        "the recomputed block was already cached"
    );
    e.check_invariants();
}

#[test]
fn preemption_takes_the_newest_request_and_requeues_it_first() {
    // 6 pages of 2 tokens; two requests of 4-token prompts that generate 6 tokens each
    // need 5 pages each.
    let mut e = engine(6, 2, 4, 64);
    e.add_request(req(1, &[1, 2, 3, 4], 6)).unwrap();
    e.add_request(req(2, &[5, 6, 7, 8], 6)).unwrap();
    e.add_request(req(3, &[9, 9], 1)).unwrap();
    let mut preempted_at = None;
    let mut n = 0;
    while let Some(s) = e.step(Duration::ZERO) {
        n += 1;
        e.check_invariants();
        if s.preempted > 0 && preempted_at.is_none() {
            preempted_at = Some(n);
            assert_eq!(e.sched.running, vec![RequestId(1)]);
            assert_eq!(e.sched.waiting.front(), Some(&RequestId(2)));
        }
    }
    assert!(preempted_at.is_some());
    assert_eq!(e.stats().finished, 3);
    let hashes = {
        let mut buf = Vec::new();
        engine_hash(&mut buf, None, lora_seed(None), &[1, 2])
    };
    assert!(e.sched.cache.prefix_hits(&[hashes]).len() <= 1);
}

fn remote(id: u64, prompt: &[u32], max_tokens: u32, first_token: Option<u32>) -> NewRequest {
    NewRequest {
        remote_prefill: Some(RemotePrefill { first_token }),
        ..req(id, prompt, max_tokens)
    }
}

/// Every block hash stored by the engine's pending event batches, in order.
fn stored(e: &mut SimEngine) -> Vec<u64> {
    let mut out = Vec::new();
    while let Some(b) = e.poll_events() {
        for ev in b.events {
            if let WireEvent::Stored { block_hashes, .. } = ev {
                out.extend(block_hashes);
            }
        }
    }
    out
}

#[test]
fn a_remote_prefill_receives_the_prompt_and_computes_no_prefill() {
    // 40 tokens of 4-token blocks: 39 received (9 full blocks stored on admission), the last
    // token computed in a decode-shaped step that completes and stores block 10.
    let mut e = engine(64, 4, 4, 8);
    let prompt: Vec<u32> = (100..140).collect();
    e.add_request(remote(1, &prompt, 3, None)).unwrap();
    let s = e.step(Duration::ZERO).unwrap();
    e.check_invariants();
    assert_eq!((s.prefill_tokens, s.decode_seqs), (0, 1));
    let decode_step = TimingModel::default().step_duration(&{
        let mut shape = BatchShape::default();
        shape.add_decode(39);
        shape
    });
    assert_eq!(s.duration, decode_step, "priced as one decode");
    assert_eq!(
        s.outputs,
        vec![Output::FirstToken {
            id: RequestId(1),
            token: output_token(RequestId(1), 0),
            prompt_tokens: 40,
            cached_tokens: 0,
        }]
    );
    let hashes = stored(&mut e);
    assert_eq!(
        hashes.len(),
        10,
        "every prompt block is published as stored"
    );
    assert_eq!(e.cached_prefix_blocks(&prompt, None), 10);
    assert_eq!(e.cached_prefix_pages(&prompt, None).len(), 10);
    while e.step(Duration::ZERO).is_some() {
        e.check_invariants();
    }
    let st = e.stats();
    assert_eq!((st.prefill_tokens, st.decode_tokens), (0, 3));
    assert_eq!((st.remote_prefills, st.transferred_tokens), (1, 39));
    assert_eq!((st.finished, st.output_tokens), (1, 3));
    assert_eq!(e.sched.cache.referenced(), 0);
}

#[test]
fn a_remote_prefill_reuses_the_local_prefix_and_takes_a_given_first_token() {
    let mut e = engine(64, 4, 4, 64);
    let prompt: Vec<u32> = (0..22).collect();
    // 12 tokens cached locally by an ordinary request.
    e.add_request(req(1, &prompt[..13], 1)).unwrap();
    while e.step(Duration::ZERO).is_some() {}
    let local = stored(&mut e);
    assert_eq!(local.len(), 3);
    e.add_request(remote(2, &prompt, 4, Some(4242))).unwrap();
    let s = e.step(Duration::ZERO).unwrap();
    assert_eq!(s.prefill_tokens, 0);
    assert!(matches!(
        s.outputs[0],
        Output::FirstToken {
            token: 4242,
            cached_tokens: 12,
            prompt_tokens: 22,
            ..
        }
    ));
    // Blocks 3 and 4 (tokens 12..20) arrive; the partial block 5 is not stored.
    assert_eq!(stored(&mut e).len(), 2);
    let mut tokens = Vec::new();
    while let Some(s) = e.step(Duration::ZERO) {
        e.check_invariants();
        tokens.extend(s.outputs.iter().filter_map(|o| match o {
            Output::Token { token, .. } => Some(*token),
            _ => None,
        }));
    }
    let later: Vec<u32> = (1..4).map(|i| output_token(RequestId(2), i)).collect();
    assert_eq!(tokens, later, "later tokens are sampled as usual");
    assert_eq!(e.stats().transferred_tokens, 21 - 12);
}

#[test]
fn a_remote_prefill_waits_for_pages_for_its_whole_prompt() {
    // 6 pages of 4 tokens: a 20-token remote prompt needs 5 at once (+1 for its outputs).
    let mut e = engine(6, 4, 4, 64);
    e.add_request(req(1, &(0..8).collect::<Vec<_>>(), 4))
        .unwrap();
    e.step(Duration::ZERO).unwrap();
    e.add_request(remote(2, &(100..120).collect::<Vec<_>>(), 2, None))
        .unwrap();
    let s = e.step(Duration::ZERO).unwrap();
    assert_eq!(s.scheduled_seqs, 1, "the remote request cannot fit yet");
    while e.step(Duration::ZERO).is_some() {
        e.check_invariants();
    }
    assert_eq!(e.stats().finished, 2);
    assert_eq!(e.stats().remote_prefills, 1);
}

#[test]
fn random_workloads_with_remote_prefills_keep_the_invariants() {
    for seed in 0..30u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut e = engine(
            rng.random_range(8..40),
            rng.random_range(1..5),
            rng.random_range(1..6),
            rng.random_range(1..30),
        );
        let head: Vec<u32> = (0..6).map(|_| rng.random_range(0..20)).collect();
        for id in 0..120u64 {
            let mut prompt = head[..rng.random_range(0..head.len())].to_vec();
            prompt.extend((0..rng.random_range(1..12)).map(|_| rng.random_range(0..20)));
            let max_tokens = rng.random_range(1..8);
            let r = if rng.random_bool(0.5) {
                remote(id, &prompt, max_tokens, rng.random_bool(0.5).then_some(7))
            } else {
                req(id, &prompt, max_tokens)
            };
            let _ = e.add_request(r);
            for _ in 0..rng.random_range(0..3) {
                if let Some(s) = e.step(Duration::ZERO) {
                    assert!(s.scheduled_tokens() <= e.config.max_num_batched_tokens);
                }
                e.check_invariants();
            }
        }
        while e.step(Duration::ZERO).is_some() {
            e.check_invariants();
        }
        assert_eq!(e.sched.cache.referenced(), 0);
        assert_eq!(e.stats().finished, e.stats().requests);
    }
}
