//! Worker selection through `Scheduler::route`: the cost function, every mode, tie-breaks,
//! sampling, busy filtering and override validation. The cost tests pin Dynamo's formula
//! (`RouterCost::Dynamo`), whose numbers they check by hand; the TTFT cost has its own
//! tests at the end.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use engine::sched::{
    BusyThresholds, RouteMode, RouteOverrides, RouteRequest, RouterCost, Scheduler,
    SchedulerConfig, WorkerLoad,
};
use engine::{EngineError, Matches, RequestId, SeqHash, WorkerId, WorkerKey};

fn key(worker: u64, rank: u32) -> WorkerKey {
    WorkerKey::new(worker, rank)
}

fn hs(v: &[u64]) -> Vec<SeqHash> {
    v.iter().copied().map(SeqHash).collect()
}

/// A `Matches` as the index would build it from per-key overlaps.
fn matches(pairs: &[(WorkerKey, u32)]) -> Matches {
    Matches::from_overlaps(pairs.iter().copied())
}

/// A scheduler on Dynamo's formula (whatever `cfg.cost` says) with `keys` registered.
fn scheduler(cfg: SchedulerConfig, keys: &[WorkerKey]) -> Scheduler {
    with_cost(
        SchedulerConfig {
            cost: RouterCost::Dynamo,
            ..cfg
        },
        keys,
    )
}

fn with_cost(cfg: SchedulerConfig, keys: &[WorkerKey]) -> Scheduler {
    let mut s = Scheduler::new(cfg).unwrap();
    for &k in keys {
        assert!(s.add_worker(k).unwrap());
    }
    s
}

fn req(id: u64, blocks: &[SeqHash], input_tokens: u64) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        blocks,
        input_tokens,
        overrides: RouteOverrides::default(),
    }
}

fn with(mut r: RouteRequest<'_>, overrides: RouteOverrides) -> RouteRequest<'_> {
    r.overrides = overrides;
    r
}

#[test]
fn cost_matches_a_hand_computed_example() {
    let now = Instant::now();
    let (a, b, c) = (key(1, 0), key(2, 0), key(3, 0));
    // Dynamo's formula as DESIGN.md writes it: no recompute term (cost.rs tests that).
    let dynamo = SchedulerConfig {
        recompute_weight: 0.0,
        ..SchedulerConfig::default()
    };
    let mut s = scheduler(dynamo, &[a, b, c]);
    // A: 3 active blocks, 48 - 1 * 16 = 32 tokens still to prefill.
    s.add_active(now, a, RequestId(100), &hs(&[10, 11, 12]), 48, 1)
        .unwrap();
    // B: 3 active blocks (two of them shared with the new request), already prefilled.
    s.add_active(now, b, RequestId(101), &hs(&[1, 2, 20]), 40, 0)
        .unwrap();
    s.prefilled(RequestId(101)).unwrap();

    // 6 full blocks, 100 tokens; A caches 4 of them, B 2, C none.
    let blocks = hs(&[1, 2, 3, 4, 5, 6]);
    let m = matches(&[(a, 4), (b, 2)]);
    let overrides = RouteOverrides {
        overlap_weight: Some(2.0),
        ..Default::default()
    };
    let d = s
        .route(now, &with(req(1, &blocks, 100), overrides), &m, |_| 0)
        .unwrap();

    let got: Vec<_> = d
        .candidates
        .iter()
        .map(|c| {
            (
                c.key,
                c.overlap_blocks,
                c.prefill_blocks,
                c.decode_blocks,
                c.logit,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            // (32 + 100 - 64) / 16 = 4.25; 3 + 6 = 9; 2 * 4.25 + 9.
            (a, 4, 4.25, 9, 17.5),
            // (0 + 100 - 32) / 16 = 4.25; 3 + (6 - 2 already active) = 7.
            (b, 2, 4.25, 7, 15.5),
            // 100 / 16 = 6.25; 0 + 6.
            (c, 0, 6.25, 6, 18.5),
        ]
    );
    assert_eq!(d.worker, b);
    assert_eq!(d.mode, RouteMode::Kv);
    assert_eq!(d.overlap_blocks, 2);
    assert_eq!(d.best_available_overlap_blocks, 4);
    assert_eq!(d.chosen().unwrap().logit, 15.5);

    // The decision predicted B's load: its decode blocks, and 68 more prefill tokens.
    let load = s.active_load(b).unwrap();
    assert_eq!(load.active_blocks, 7);
    assert_eq!(load.active_prefill_tokens, 68);
    assert_eq!(load.active_requests, 2);

    // With prefill weightless, only decode blocks count: C (6) beats B (7 + 6 = 13 now).
    let overrides = RouteOverrides {
        overlap_weight: Some(0.0),
        ..Default::default()
    };
    let d = s
        .route(now, &with(req(2, &blocks, 100), overrides), &m, |_| 0)
        .unwrap();
    assert_eq!(d.worker, c);
}

#[test]
fn temperature_zero_picks_the_minimum_for_every_seed() {
    let now = Instant::now();
    let keys = [key(1, 0), key(2, 0), key(3, 0), key(4, 0)];
    let blocks = hs(&[1, 2, 3, 4]);
    let m = matches(&[(keys[0], 1), (keys[2], 3), (keys[3], 2)]);
    for seed in 0..32 {
        let mut s = scheduler(
            SchedulerConfig {
                seed,
                ..Default::default()
            },
            &keys,
        );
        let d = s.route(now, &req(1, &blocks, 64), &m, |_| 0).unwrap();
        assert_eq!(d.worker, keys[2]);
        let min = d
            .candidates
            .iter()
            .map(|c| c.logit)
            .fold(f64::MAX, f64::min);
        assert_eq!(d.chosen().unwrap().logit, min);
    }
}

#[test]
fn ties_go_to_fewer_cached_blocks() {
    let now = Instant::now();
    let keys = [key(1, 0), key(2, 0), key(3, 0)];
    let blocks = hs(&[1, 2]);
    let cached = |k: WorkerKey| match k.worker.0 {
        1 => 10,
        2 => 3,
        _ => 7,
    };
    for seed in 0..32 {
        // The footprint term off: the totals only break the tie.
        let mut s = scheduler(
            SchedulerConfig {
                seed,
                footprint_weight: 0.0,
                ..Default::default()
            },
            &keys,
        );
        let d = s
            .route(now, &req(1, &blocks, 32), &Matches::default(), cached)
            .unwrap();
        assert!(d.candidates.iter().all(|c| c.logit == 4.0));
        assert_eq!(d.worker, key(2, 0));
    }
}

#[test]
fn the_footprint_term_charges_blocks_beyond_the_least_filled_candidate() {
    let now = Instant::now();
    let (a, b) = (key(1, 0), key(2, 0));
    // A cold request of 2 blocks (32 tokens); B carries one prefilled block of another
    // request, so its logit is 1 above A's (2 + 2 against 2 + 2 + 1).
    let blocks = hs(&[1, 2]);
    // A caches 1,000 blocks more than B.
    let cached = |k: WorkerKey| if k == a { 1_500 } else { 500 };
    let route = |weight: f64| {
        let mut s = scheduler(
            SchedulerConfig {
                footprint_weight: weight,
                ..Default::default()
            },
            &[a, b],
        );
        s.add_active(now, b, RequestId(9), &hs(&[99]), 16, 1)
            .unwrap();
        s.prefilled(RequestId(9)).unwrap();
        s.route(now, &req(1, &blocks, 32), &Matches::default(), cached)
            .unwrap()
    };
    // Weight 0: the load alone decides (A, 4 against 5).
    let d = route(0.0);
    let logits: Vec<_> = d.candidates.iter().map(|c| (c.key, c.logit)).collect();
    assert_eq!(logits, vec![(a, 4.0), (b, 5.0)]);
    assert_eq!(d.worker, a);
    // 0.0005 per block: A pays 0.5 more, still below B's 5.
    let d = route(0.0005);
    let logits: Vec<_> = d.candidates.iter().map(|c| (c.key, c.logit)).collect();
    assert_eq!(logits, vec![(a, 4.5), (b, 5.0)]);
    assert_eq!(d.worker, a);
    // 0.002 per block: A pays 2 more (6 against 5): the emptier cache wins.
    let d = route(0.002);
    let logits: Vec<_> = d.candidates.iter().map(|c| (c.key, c.logit)).collect();
    assert_eq!(logits, vec![(a, 6.0), (b, 5.0)]);
    assert_eq!(d.worker, b);
    // The weight is validated like every other.
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let cfg = SchedulerConfig {
            footprint_weight: bad,
            ..Default::default()
        };
        assert!(Scheduler::new(cfg).is_err(), "{bad}");
    }
}

#[test]
fn full_ties_are_random_but_reproducible_per_seed() {
    let now = Instant::now();
    let keys = [key(1, 0), key(2, 0)];
    let blocks = hs(&[1]);
    let pick = |seed| {
        let mut s = scheduler(
            SchedulerConfig {
                seed,
                ..Default::default()
            },
            &keys,
        );
        s.route(now, &req(1, &blocks, 16), &Matches::default(), |_| 5)
            .unwrap()
            .worker
    };
    let mut seen = BTreeSet::new();
    for seed in 0..64 {
        let first = pick(seed);
        assert_eq!(first, pick(seed), "seed {seed} must replay");
        seen.insert(first);
    }
    assert_eq!(seen.len(), 2, "both tied workers are chosen over seeds");
}

#[test]
fn positive_temperature_samples_the_softmax() {
    let now = Instant::now();
    let (a, b, c) = (key(1, 0), key(2, 0), key(3, 0));
    let mut s = scheduler(
        SchedulerConfig {
            temperature: 1.0,
            seed: 9,
            recompute_weight: 0.0,
            ..Default::default()
        },
        &[a, b, c],
    );
    // C carries one prefilled block of someone else's: logits A 1, B 2, C 3.
    s.add_active(now, c, RequestId(1_000_000), &hs(&[99]), 16, 1)
        .unwrap();
    let blocks = hs(&[1]);
    let m = matches(&[(a, 1)]);
    let n = 20_000u64;
    let mut hits = [0u64; 3];
    for id in 0..n {
        let d = s.route(now, &req(id, &blocks, 16), &m, |_| 0).unwrap();
        let logits: Vec<f64> = d.candidates.iter().map(|c| c.logit).collect();
        assert_eq!(logits, [1.0, 2.0, 3.0]);
        hits[(d.worker.worker.0 - 1) as usize] += 1;
        s.free(RequestId(id)).unwrap();
    }
    // softmax(-(l - 1) / (2 * 1)): e^0, e^-0.5, e^-1.
    let w = [1.0f64, (-0.5f64).exp(), (-1.0f64).exp()];
    let total: f64 = w.iter().sum();
    for i in 0..3 {
        let want = w[i] / total;
        let got = hits[i] as f64 / n as f64;
        assert!(
            (got - want).abs() < 0.015,
            "worker {}: {got} vs {want}",
            i + 1
        );
    }
}

#[test]
fn busy_workers_are_skipped_unless_all_are_busy() {
    let now = Instant::now();
    let (a, b) = (key(1, 0), key(2, 0));
    let mut s = scheduler(
        SchedulerConfig {
            busy: BusyThresholds {
                max_waiting: Some(5),
                max_kv_usage: Some(0.9),
                max_active: None,
            },
            ..Default::default()
        },
        &[a, b],
    );
    let blocks = hs(&[1, 2, 3]);
    let m = matches(&[(a, 3)]);
    let busy = WorkerLoad {
        num_requests_waiting: 6,
        kv_usage: 0.1,
    };
    s.update_load(a, busy).unwrap();
    let d = s.route(now, &req(1, &blocks, 48), &m, |_| 0).unwrap();
    assert_eq!(d.worker, b, "A has the cache but is busy");
    assert_eq!(d.busy_skipped, 1);
    assert_eq!(d.candidates.len(), 1);
    assert_eq!(d.best_available_overlap_blocks, 0);

    let full = WorkerLoad {
        num_requests_waiting: 0,
        kv_usage: 0.95,
    };
    s.update_load(b, full).unwrap();
    let d = s.route(now, &req(2, &blocks, 48), &m, |_| 0).unwrap();
    assert_eq!(d.worker, a, "all busy: fall back to the cost over everyone");
    assert_eq!(d.busy_skipped, 0);
    assert_eq!(d.candidates.len(), 2);

    // At the threshold is not over it.
    s.update_load(
        a,
        WorkerLoad {
            num_requests_waiting: 5,
            kv_usage: 0.9,
        },
    )
    .unwrap();
    let d = s.route(now, &req(3, &blocks, 48), &m, |_| 0).unwrap();
    assert_eq!((d.worker, d.busy_skipped), (a, 1));
}

#[test]
fn round_robin_cycles_in_key_order_across_membership_changes() {
    let now = Instant::now();
    let keys = [key(3, 0), key(1, 1), key(1, 0), key(2, 0)];
    let mut s = scheduler(
        SchedulerConfig {
            mode: RouteMode::RoundRobin,
            ..Default::default()
        },
        &keys,
    );
    let blocks = hs(&[1]);
    let mut order = Vec::new();
    for id in 0..8 {
        let d = s
            .route(now, &req(id, &blocks, 16), &Matches::default(), |_| 0)
            .unwrap();
        assert_eq!(d.mode, RouteMode::RoundRobin);
        order.push(d.worker);
    }
    let cycle = [key(1, 0), key(1, 1), key(2, 0), key(3, 0)];
    assert_eq!(order[..4], cycle);
    assert_eq!(order[4..], cycle);

    // Last chosen was (3, 0); removing worker 1 continues with the next key after it.
    s.remove_worker(WorkerId(1));
    s.add_worker(key(4, 0)).unwrap();
    let next: Vec<_> = (8..11)
        .map(|id| {
            s.route(now, &req(id, &blocks, 16), &Matches::default(), |_| 0)
                .unwrap()
                .worker
        })
        .collect();
    assert_eq!(next, [key(4, 0), key(2, 0), key(3, 0)]);
}

#[test]
fn random_mode_is_uniform_and_seeded() {
    let now = Instant::now();
    let keys = [key(1, 0), key(2, 0), key(3, 0), key(4, 0)];
    let blocks = hs(&[1]);
    // A huge overlap on one key must not bias random mode.
    let m = matches(&[(keys[0], 1)]);
    let run = |seed| {
        let mut s = scheduler(
            SchedulerConfig {
                mode: RouteMode::Random,
                seed,
                ..Default::default()
            },
            &keys,
        );
        (0..4000)
            .map(|id| {
                let w = s
                    .route(now, &req(id, &blocks, 16), &m, |_| 0)
                    .unwrap()
                    .worker;
                s.free(RequestId(id)).unwrap();
                w
            })
            .collect::<Vec<_>>()
    };
    let picks = run(3);
    assert_eq!(picks, run(3));
    for k in keys {
        let n = picks.iter().filter(|&&p| p == k).count();
        assert!((850..1150).contains(&n), "{k}: {n}");
    }
}

#[test]
fn direct_chooses_among_the_named_workers_ranks() {
    let now = Instant::now();
    let keys = [key(1, 0), key(2, 0), key(2, 1)];
    let mut s = scheduler(SchedulerConfig::default(), &keys);
    let blocks = hs(&[1, 2, 3]);
    let m = matches(&[(key(1, 0), 3), (key(2, 1), 2)]);
    let direct = RouteOverrides {
        worker: Some(WorkerId(2)),
        ..Default::default()
    };
    let d = s
        .route(now, &with(req(1, &blocks, 48), direct), &m, |_| 0)
        .unwrap();
    assert_eq!(d.mode, RouteMode::Direct);
    assert_eq!(d.worker, key(2, 1), "the rank with the cache");
    assert_eq!(
        d.candidates.iter().map(|c| c.key).collect::<Vec<_>>(),
        [key(2, 0), key(2, 1)]
    );
    assert_eq!(d.best_available_overlap_blocks, 2);

    let unknown = RouteOverrides {
        mode: Some(RouteMode::Direct),
        worker: Some(WorkerId(7)),
        ..Default::default()
    };
    assert_eq!(
        s.route(now, &with(req(2, &blocks, 48), unknown), &m, |_| 0),
        Err(EngineError::UnknownWorker {
            worker: WorkerId(7)
        })
    );
    assert!(!s.is_active(RequestId(2)));
}

#[test]
fn bad_overrides_are_rejected_and_change_nothing() {
    let now = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[key(1, 0)]);
    let blocks = hs(&[1]);
    let bad = [
        RouteOverrides {
            overlap_weight: Some(-1.0),
            ..Default::default()
        },
        RouteOverrides {
            overlap_weight: Some(f64::NAN),
            ..Default::default()
        },
        RouteOverrides {
            temperature: Some(-0.1),
            ..Default::default()
        },
        RouteOverrides {
            temperature: Some(f64::NAN),
            ..Default::default()
        },
        RouteOverrides {
            temperature: Some(f64::INFINITY),
            ..Default::default()
        },
        RouteOverrides {
            mode: Some(RouteMode::Direct),
            ..Default::default()
        },
        RouteOverrides {
            mode: Some(RouteMode::Kv),
            worker: Some(WorkerId(1)),
            ..Default::default()
        },
    ];
    for o in bad {
        let r = s.route(
            now,
            &with(req(1, &blocks, 16), o),
            &Matches::default(),
            |_| 0,
        );
        assert!(
            matches!(r, Err(EngineError::InvalidArgument { .. })),
            "{o:?}: {r:?}"
        );
        assert_eq!(s.active_requests(), 0);
    }
    assert!(
        Scheduler::new(SchedulerConfig {
            overlap_weight: -2.0,
            ..Default::default()
        })
        .is_err()
    );
}

#[test]
fn no_workers_duplicates_and_unregistered_matches() {
    let now = Instant::now();
    let blocks = hs(&[1, 2]);
    let mut s = scheduler(SchedulerConfig::default(), &[]);
    assert_eq!(
        s.route(now, &req(1, &blocks, 32), &Matches::default(), |_| 0),
        Err(EngineError::NoWorkers)
    );
    s.add_worker(key(1, 0)).unwrap();
    assert!(!s.add_worker(key(1, 0)).unwrap(), "second add is a no-op");
    // Key 9 is in the index but not registered here: ignored, not chosen.
    let m = matches(&[(key(9, 0), 2)]);
    let d = s.route(now, &req(1, &blocks, 32), &m, |_| 0).unwrap();
    assert_eq!((d.worker, d.best_available_overlap_blocks), (key(1, 0), 0));
    assert_eq!(
        s.route(now, &req(1, &blocks, 32), &m, |_| 0),
        Err(EngineError::DuplicateRequest(RequestId(1)))
    );
    assert_eq!(s.active_requests(), 1);
    assert!(matches!(
        s.update_load(key(9, 0), WorkerLoad::default()),
        Err(EngineError::UnknownWorker { .. })
    ));
}

#[test]
fn keys_at_their_active_limit_are_no_candidates_and_all_full_is_at_capacity() {
    let now = Instant::now();
    let (a, b) = (key(1, 0), key(2, 0));
    let mut s = scheduler(
        SchedulerConfig {
            max_active_per_key: Some(2),
            ..Default::default()
        },
        &[a, b],
    );
    let blocks = hs(&[1, 2, 3]);
    // A holds the prompt, so kv mode prefers it until it is full.
    let m = matches(&[(a, 3)]);
    let chosen: Vec<WorkerKey> = (0..4)
        .map(|i| {
            s.route(now, &req(i, &blocks, 48), &m, |_| 0)
                .unwrap()
                .worker
        })
        .collect();
    assert_eq!(chosen, vec![a, a, b, b]);
    // Full everywhere: refused, nothing recorded.
    assert_eq!(
        s.route(now, &req(9, &blocks, 48), &m, |_| 0),
        Err(EngineError::AtCapacity { limit: 2 })
    );
    assert_eq!(s.active_requests(), 4);
    // Direct mode names a worker, but its limit holds too.
    let direct = RouteOverrides {
        worker: Some(WorkerId(1)),
        ..Default::default()
    };
    assert_eq!(
        s.route(now, &with(req(10, &blocks, 48), direct), &m, |_| 0),
        Err(EngineError::AtCapacity { limit: 2 })
    );
    // A freed request makes room on its key.
    s.free(RequestId(0)).unwrap();
    let d = s.route(now, &req(11, &blocks, 48), &m, |_| 0).unwrap();
    assert_eq!(d.worker, a);
    // No limit: no refusal.
    let mut unlimited = scheduler(
        SchedulerConfig {
            max_active_per_key: None,
            ..Default::default()
        },
        &[a],
    );
    for i in 0..10 {
        unlimited
            .route(now, &req(i, &blocks, 48), &m, |_| 0)
            .unwrap();
    }
}

/// The TTFT cost learns each worker's speed from first tokens and routes to the one that
/// answers first: away from a slow worker, and back to it once the fast one's queue is
/// longer than the difference.
#[test]
fn ttft_cost_learns_a_slow_worker_and_weighs_it_against_the_queue() {
    let (slow, fast) = (key(1, 0), key(2, 0));
    let mut s = with_cost(
        SchedulerConfig {
            cost: RouterCost::Ttft,
            stall_weight: 0.0,
            ..Default::default()
        },
        &[slow, fast],
    );
    let t0 = Instant::now();
    let mut now = t0;
    let blocks: Vec<SeqHash> = Vec::new();
    // 60 requests of 4,000 tokens sent to each worker in turn, one at a time: the slow one
    // answers in 400 ms, the fast one in 100.
    for i in 0..60u64 {
        let (worker, took) = if i % 2 == 0 { (1, 400) } else { (2, 100) };
        let r = with(
            req(i, &blocks, 4000),
            RouteOverrides {
                worker: Some(WorkerId(worker)),
                ..Default::default()
            },
        );
        s.route(now, &r, &Matches::default(), |_| 0).unwrap();
        now += Duration::from_millis(took);
        s.first_token(now, RequestId(i)).unwrap();
        s.free(RequestId(i)).unwrap();
        now += Duration::from_millis(10);
    }
    let (a, b) = (s.ttft_fit(slow).unwrap(), s.ttft_fit(fast).unwrap());
    let predict = |f: &engine::sched::ttft::TtftFit| {
        f.predict_ms(&engine::sched::ttft::Prefill {
            tokens: 4000,
            cached: 0,
            batch_blocks: 0,
        })
    };
    assert!((predict(a) - 400.0).abs() < 20.0, "{:?}", a.coefficients());
    assert!((predict(b) - 100.0).abs() < 10.0, "{:?}", b.coefficients());

    // Idle workers: the fast one, predicted 4x sooner.
    let d = s
        .route(now, &req(100, &blocks, 4000), &Matches::default(), |_| 0)
        .unwrap();
    assert_eq!(d.worker, fast);
    let ttft = |d: &engine::sched::Decision, k| {
        d.candidates
            .iter()
            .find(|c| c.key == k)
            .unwrap()
            .predicted_ttft_ms
    };
    assert!(ttft(&d, slow) > 3.0 * ttft(&d, fast), "{d:?}");
    // Two more queue behind it on the fast worker (100, 200, then 300 ms of wait)...
    for id in [101, 102] {
        let d = s
            .route(now, &req(id, &blocks, 4000), &Matches::default(), |_| 0)
            .unwrap();
        assert_eq!(d.worker, fast, "{d:?}");
    }
    // ...and then its queue (300 ms) plus its service (100) reach the slow one's 400.
    let d = s
        .route(now, &req(103, &blocks, 4000), &Matches::default(), |_| 0)
        .unwrap();
    let (q_fast, q_slow) = (ttft(&d, fast), ttft(&d, slow));
    assert!(
        (q_fast - 400.0).abs() < 15.0 && (q_slow - 400.0).abs() < 25.0,
        "{d:?}"
    );
    // The fast worker's first token comes early: its queue moves up, and it is chosen.
    s.first_token(now + Duration::from_millis(50), RequestId(100))
        .unwrap();
    let d = s
        .route(
            now + Duration::from_millis(50),
            &req(104, &blocks, 4000),
            &Matches::default(),
            |_| 0,
        )
        .unwrap();
    assert_eq!(d.worker, fast, "{d:?}");
}
