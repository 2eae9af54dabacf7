//! Unit tests of [`SimWorker`]: hits, eviction order, events, and a randomised check that
//! the events rebuild the worker's own cache in a [`KvIndex`].

use super::*;
use engine::hash::{seq_hashes, tokens_hash};
use engine::kv_index::KvIndex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const KEY: WorkerKey = WorkerKey::new(7, 0);

fn worker(kv_blocks: u32, block_size: u32) -> SimWorker {
    SimWorker::new(
        KEY,
        WorkerConfig {
            kv_blocks,
            block_size,
        },
    )
    .unwrap()
}

fn ids(tokens: &[u32], bs: usize, lora: Option<&str>) -> Vec<EngineHash> {
    let mut buf = Vec::new();
    let mut parent = None;
    tokens
        .chunks_exact(bs)
        .map(|b| {
            let h = engine_hash(&mut buf, parent, lora_seed(lora), b);
            parent = Some(h);
            h
        })
        .collect()
}

fn serve_and_finish(w: &mut SimWorker, id: u64, tokens: &[u32]) -> Served {
    let s = w.serve(RequestId(id), tokens, None).unwrap();
    w.finish(RequestId(id)).unwrap();
    s
}

/// Whether each block of `tokens`' chain is cached: must be `true…true false…false`.
fn assert_prefix_closed(w: &SimWorker, tokens: &[u32], lora: Option<&str>) {
    let bs = w.config.block_size as usize;
    let flags: Vec<bool> = ids(tokens, bs, lora)
        .into_iter()
        .map(|h| w.pool.lookup(h).is_some())
        .collect();
    let k = flags.iter().take_while(|&&f| f).count();
    assert!(
        flags[k..].iter().all(|&f| !f),
        "not prefix-closed: {flags:?}"
    );
    assert_eq!(k as u32, w.cached_prefix(tokens, lora));
}

#[test]
fn second_request_hits_the_shared_prefix_only() {
    let mut w = worker(16, 2);
    let system = [1, 2, 3, 4];
    let a: Vec<u32> = system.iter().copied().chain([10, 11, 12]).collect();
    let b: Vec<u32> = system.iter().copied().chain([20, 21, 22, 23, 24]).collect();
    let s = serve_and_finish(&mut w, 1, &a);
    assert_eq!((s.prompt_blocks, s.hit_blocks, s.stored_blocks), (3, 0, 3));
    assert_eq!(s.prompt_tokens, 7);
    let s = serve_and_finish(&mut w, 2, &b);
    assert_eq!((s.prompt_blocks, s.hit_blocks, s.stored_blocks), (4, 2, 2));
    // The same request again hits every full block; the partial tail is never cached.
    let s = serve_and_finish(&mut w, 3, &b);
    assert_eq!((s.hit_blocks, s.stored_blocks), (4, 0));
    // Under an adapter nothing is shared with the base model.
    let s = w.serve(RequestId(4), &b, Some("adapter")).unwrap();
    assert_eq!(s.hit_blocks, 0);
    assert_eq!(w.cached_prefix(&b, Some("adapter")), 4);
    assert_eq!(w.stats().hit_tokens, 4 + 8);
}

#[test]
fn events_carry_engine_hashes_parent_and_tokens_hash() {
    let mut w = worker(16, 2);
    serve_and_finish(&mut w, 1, &[1, 2, 3, 4]);
    let first: Vec<KvEvent> = w.poll_events().collect();
    let e = ids(&[1, 2, 3, 4, 5, 6], 2, Some("x"));
    serve_and_finish(&mut w, 2, &[1, 2, 3, 4, 5, 6]);
    let second: Vec<KvEvent> = w.poll_events().collect();
    let base = ids(&[1, 2, 3, 4, 5, 6], 2, None);
    assert_eq!(
        first,
        vec![KvEvent::Stored {
            parent: None,
            blocks: vec![
                StoredBlock {
                    engine_hash: base[0],
                    tokens_hash: tokens_hash(&[1, 2], lora_seed(None)),
                },
                StoredBlock {
                    engine_hash: base[1],
                    tokens_hash: tokens_hash(&[3, 4], lora_seed(None)),
                },
            ],
        }]
    );
    assert_eq!(
        second,
        vec![KvEvent::Stored {
            parent: Some(base[1]),
            blocks: vec![StoredBlock {
                engine_hash: base[2],
                tokens_hash: tokens_hash(&[5, 6], lora_seed(None)),
            }],
        }]
    );
    assert_ne!(e[0], base[0]);
    assert!(w.poll_events().next().is_none());
}

#[test]
fn eviction_takes_least_recently_used_tail_first() {
    let (a, b, c) = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]);
    let mut w = worker(4, 2);
    serve_and_finish(&mut w, 1, &a);
    serve_and_finish(&mut w, 2, &b);
    w.poll_events().for_each(drop);
    let s = serve_and_finish(&mut w, 3, &c);
    assert_eq!((s.hit_blocks, s.stored_blocks, s.evicted_blocks), (0, 2, 2));
    let ea = ids(&a, 2, None);
    let events: Vec<KvEvent> = w.poll_events().collect();
    // `a` was released first (least recently used), its tail before its head.
    assert_eq!(
        events[0],
        KvEvent::Removed {
            blocks: vec![ea[1], ea[0]]
        }
    );
    assert!(matches!(events[1], KvEvent::Stored { parent: None, .. }));
    assert_eq!(w.cached_prefix(&a, None), 0);
    assert_eq!(w.cached_prefix(&b, None), 2);

    // Using `b` again makes `c` the least recently used.
    serve_and_finish(&mut w, 4, &b);
    serve_and_finish(&mut w, 5, &a);
    assert_eq!(w.cached_prefix(&c, None), 0);
    assert_eq!(w.cached_prefix(&b, None), 2);
    assert_eq!(w.cached_prefix(&a, None), 2);
    w.check_invariants();
}

#[test]
fn active_blocks_are_never_evicted_and_oversized_requests_cache_their_start() {
    let mut w = worker(3, 1);
    // Five blocks into a three-block cache: the first three are cached.
    let s = w.serve(RequestId(1), &[1, 2, 3, 4, 5], None).unwrap();
    assert_eq!((s.stored_blocks, s.uncached_blocks), (3, 2));
    // While request 1 holds everything, another request can cache nothing.
    let s = w.serve(RequestId(2), &[9, 9], None).unwrap();
    assert_eq!(
        (s.hit_blocks, s.stored_blocks, s.uncached_blocks),
        (0, 0, 2)
    );
    assert_eq!(w.usage(), 1.0);
    w.finish(RequestId(1)).unwrap();
    w.finish(RequestId(2)).unwrap();
    let s = serve_and_finish(&mut w, 3, &[1, 2, 3, 4, 5]);
    assert_eq!((s.hit_blocks, s.stored_blocks), (3, 0));
    // Its own hits are referenced first, so a request never evicts its own prefix.
    let s = serve_and_finish(&mut w, 4, &[1, 2, 7, 8]);
    assert_eq!((s.hit_blocks, s.stored_blocks, s.evicted_blocks), (2, 1, 1));
    assert_eq!(w.cached_prefix(&[1, 2, 7], None), 3);
    w.check_invariants();
}

#[test]
fn refused_calls_change_nothing() {
    let mut w = worker(4, 2);
    w.serve(RequestId(1), &[1, 2], None).unwrap();
    w.poll_events().for_each(drop);
    assert!(matches!(
        w.serve(RequestId(1), &[3, 4], None),
        Err(SimError::DuplicateRequest(RequestId(1)))
    ));
    assert!(w.poll_events().next().is_none());
    assert_eq!(w.cached_prefix(&[3, 4], None), 0);
    assert!(matches!(
        w.finish(RequestId(2)),
        Err(SimError::UnknownRequest(RequestId(2)))
    ));
    w.finish(RequestId(1)).unwrap();
    assert!(w.finish(RequestId(1)).is_err());
    assert!(
        SimWorker::new(
            KEY,
            WorkerConfig {
                kv_blocks: 0,
                block_size: 16
            }
        )
        .is_err()
    );
}

/// Random documents sharing prefixes; a query is a prefix of one, maybe with a new tail.
fn random_query(rng: &mut SmallRng, docs: &[Vec<u32>]) -> Vec<u32> {
    let doc = &docs[rng.random_range(0..docs.len())];
    let mut q = doc[..rng.random_range(0..=doc.len())].to_vec();
    if rng.random_bool(0.3) {
        let extra = rng.random_range(1..12);
        q.extend((0..extra).map(|_| rng.random_range(0..50u32)));
    }
    q
}

#[test]
fn replayed_events_make_the_index_agree_with_the_workers_caches() {
    const BS: usize = 4;
    let keys = [
        WorkerKey::new(1, 0),
        WorkerKey::new(1, 1),
        WorkerKey::new(2, 0),
    ];
    for seed in 0..20u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let kv_blocks = rng.random_range(1..24);
        let mut workers: Vec<SimWorker> = keys
            .iter()
            .map(|&k| {
                SimWorker::new(
                    k,
                    WorkerConfig {
                        kv_blocks,
                        block_size: BS as u32,
                    },
                )
                .unwrap()
            })
            .collect();
        // A few documents sharing a common head, so prefixes overlap at several depths.
        let head: Vec<u32> = (0..BS * 2).map(|_| rng.random_range(0..50)).collect();
        let docs: Vec<Vec<u32>> = (0..5)
            .map(|_| {
                let len = rng.random_range(0..BS * 8);
                head.iter()
                    .copied()
                    .chain((0..len).map(|_| rng.random_range(0..50)))
                    .collect()
            })
            .collect();
        let loras = [None, Some("adapter-a")];
        let mut index = KvIndex::new();
        let mut active: Vec<(usize, RequestId)> = Vec::new();
        for step in 0..300u64 {
            let w = rng.random_range(0..workers.len());
            if !active.is_empty() && (active.len() > 6 || rng.random_bool(0.4)) {
                let (w, id) = active.swap_remove(rng.random_range(0..active.len()));
                workers[w].finish(id).unwrap();
            } else {
                let q = random_query(&mut rng, &docs);
                let lora = loras[rng.random_range(0..2)];
                let before = workers[w].cached_prefix(&q, lora);
                let s = workers[w].serve(RequestId(step), &q, lora).unwrap();
                assert_eq!(s.hit_blocks, before);
                active.push((w, RequestId(step)));
            }
            for wk in &mut workers {
                let key = wk.key();
                for ev in wk.poll_events() {
                    index.apply(key, &ev).unwrap();
                }
                wk.check_invariants();
            }
            assert_eq!(index.rejects().total(), 0);
            for _ in 0..8 {
                let q = random_query(&mut rng, &docs);
                let lora = loras[rng.random_range(0..2)];
                let m = index.find_matches(&seq_hashes(&q, BS, lora_seed(lora)));
                for wk in &workers {
                    assert_prefix_closed(wk, &q, lora);
                    assert_eq!(
                        m.overlap(wk.key()),
                        wk.cached_prefix(&q, lora),
                        "seed {seed} step {step} worker {}",
                        wk.key()
                    );
                }
            }
        }
        for (k, wk) in keys.iter().zip(&workers) {
            assert_eq!(index.cached_blocks(*k), wk.stats().cached_blocks as u64);
        }
    }
}
