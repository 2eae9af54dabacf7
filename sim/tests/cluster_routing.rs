//! The closed loop end to end: an embedded chat workload routed by kvengine's index and
//! scheduler onto simulated workers, in every simulator mode.

use engine::sched::RouteMode;
use sim::SimError;
use sim::cluster::{self, Cluster, ClusterConfig, ModeReport};
use sim::worker::WorkerConfig;
use sim::workload::chat::{ChatConfig, ChatWorkload};
use sim::workload::{PrefixReuse, SimRequest};

fn workload() -> ChatConfig {
    ChatConfig {
        seed: 7,
        requests: 500,
        live_sessions: 24,
        ..ChatConfig::default()
    }
}

fn cluster(mode: RouteMode) -> ClusterConfig {
    ClusterConfig {
        workers: 4,
        dp_ranks: 1,
        worker: WorkerConfig {
            kv_blocks: 768,
            block_size: 16,
        },
        concurrency: 16,
        mode,
        ..ClusterConfig::default()
    }
}

fn run(config: ClusterConfig) -> ModeReport {
    cluster::run(config, ChatWorkload::new(workload()).unwrap()).unwrap()
}

fn assert_closed_loop_is_consistent(r: &ModeReport) {
    assert_eq!(r.events_rejected, 0, "{} refused events", r.mode);
    assert_eq!(r.index_rejects, 0, "{} refused blocks", r.mode);
    assert!(!r.has_rejects());
    assert!(r.events_applied > 0);
    // The index mirrors the workers exactly, so its prediction is the real hit.
    assert_eq!(r.prediction_agreement, 1.0, "{}", r.mode);
    assert_eq!(r.predicted_hit_tokens, r.hit_tokens, "{}", r.mode);
    assert_eq!(r.requests, 500);
    assert_eq!(r.requests_per_worker.iter().sum::<u64>(), 500);
}

#[test]
fn kv_routing_beats_round_robin_and_random_with_no_rejected_event() {
    let reuse = PrefixReuse::measure(ChatWorkload::new(workload()).unwrap(), 16);
    // The cluster cannot hold the workload: routing has to matter.
    assert!(reuse.distinct_blocks > 4 * 768 * 2, "{reuse:?}");

    let kv = run(cluster(RouteMode::Kv));
    let rr = run(cluster(RouteMode::RoundRobin));
    let random = run(cluster(RouteMode::Random));
    for r in [&kv, &rr, &random] {
        assert_closed_loop_is_consistent(r);
        assert!(
            r.hit_rate <= reuse.hit_rate() + 1e-12,
            "{} beats the bound",
            r.mode
        );
        assert!(r.blocks_evicted > 0, "{}: nothing was evicted", r.mode);
    }
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv {} <= round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
    assert!(
        kv.hit_rate > random.hit_rate,
        "kv {} <= random {}",
        kv.hit_rate,
        random.hit_rate
    );
    assert_eq!(
        rr.load_balance, 1.0,
        "round-robin spreads 500 requests evenly"
    );
    let table = cluster::report::table(&[kv, rr, random]);
    assert_eq!(table.lines().count(), 4, "{table}");
}

#[test]
fn runs_are_deterministic() {
    let a = run(cluster(RouteMode::Kv));
    let b = run(cluster(RouteMode::Kv));
    assert_eq!(
        (
            a.hit_tokens,
            a.requests_per_worker.clone(),
            a.blocks_evicted
        ),
        (
            b.hit_tokens,
            b.requests_per_worker.clone(),
            b.blocks_evicted
        )
    );
    let sampled = |seed| {
        run(ClusterConfig {
            temperature: 0.5,
            seed,
            ..cluster(RouteMode::Kv)
        })
    };
    assert_eq!(
        sampled(3).requests_per_worker,
        sampled(3).requests_per_worker
    );
}

#[test]
fn data_parallel_ranks_are_separate_caches() {
    let config = ClusterConfig {
        workers: 2,
        dp_ranks: 2,
        ..cluster(RouteMode::Kv)
    };
    let mut c = Cluster::new(config).unwrap();
    let keys: Vec<_> = c.workers().iter().map(|w| w.key()).collect();
    assert_eq!(keys.len(), 4);
    assert!(keys.windows(2).all(|w| w[0] < w[1]));
    for r in ChatWorkload::new(workload()).unwrap() {
        let o = c.handle_request(&r).unwrap();
        assert_eq!(o.predicted_blocks, o.served.hit_blocks);
        assert!(c.active_requests() <= 16);
    }
    // Each rank's directory in the index has exactly the blocks its worker caches.
    for w in c.workers() {
        assert_eq!(
            c.index().cached_blocks(w.key()),
            w.stats().cached_blocks as u64,
            "{}",
            w.key()
        );
    }
    c.finish_all().unwrap();
    assert_eq!(c.active_requests(), 0);
    assert!(c.workers().iter().all(|w| w.stats().referenced_blocks == 0));
    assert_closed_loop_is_consistent(&c.report());
}

#[test]
fn requests_larger_than_a_cache_and_empty_requests_are_served() {
    let mut c = Cluster::new(ClusterConfig {
        worker: WorkerConfig {
            kv_blocks: 4,
            block_size: 4,
        },
        concurrency: 2,
        ..cluster(RouteMode::Kv)
    })
    .unwrap();
    let big = SimRequest {
        tokens: (0..100).collect(),
        lora: None,
        output_tokens: 1,
        arrival_ms: 0,
    };
    let o = c.handle_request(&big).unwrap();
    assert_eq!((o.served.stored_blocks, o.served.uncached_blocks), (4, 21));
    let o = c.handle_request(&big).unwrap();
    assert_eq!(
        o.served.hit_blocks, 4,
        "routed to the worker holding its start"
    );
    let empty = SimRequest {
        tokens: vec![1, 2],
        ..big
    };
    let o = c.handle_request(&empty).unwrap();
    assert_eq!(o.served.prompt_blocks, 0);
    assert!(!c.report().has_rejects());
}

#[test]
fn bad_configurations_are_refused() {
    let bad = [
        ClusterConfig {
            workers: 0,
            ..cluster(RouteMode::Kv)
        },
        ClusterConfig {
            concurrency: 0,
            ..cluster(RouteMode::Kv)
        },
        ClusterConfig {
            mode: RouteMode::Direct,
            ..cluster(RouteMode::Kv)
        },
        ClusterConfig {
            worker: WorkerConfig {
                kv_blocks: 16,
                block_size: 0,
            },
            ..cluster(RouteMode::Kv)
        },
        ClusterConfig {
            workers: 4096,
            dp_ranks: 2,
            ..cluster(RouteMode::Kv)
        },
    ];
    for config in bad {
        assert!(
            matches!(Cluster::new(config), Err(SimError::InvalidConfig { .. })),
            "{config:?}"
        );
    }
    let nan = ClusterConfig {
        overlap_weight: f64::NAN,
        ..cluster(RouteMode::Kv)
    };
    assert!(matches!(Cluster::new(nan), Err(SimError::Engine(_))));
}
