//! The hub over a real two-core engine: registration, ingest order, routing, request ids.

mod common;

use engine::event::KvEvent;
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use engine::{DpRank, WorkerId, WorkerKey};
use std::time::Instant;
use transport::TransportError;
use transport::hub::{HubConfig, Registration, RouteCall, start_engine};

fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(r),
    }
}

/// A store of `tokens`' 16-token blocks.
fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    common::stored(tokens, 16, first_hash)
}

#[test]
fn events_route_and_requests_flow_through_the_hub() {
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(config, Sharding::adaptive(2).unwrap(), engine).unwrap();
    let prompt: Vec<u32> = (0..160).collect();

    // Unknown workers are refused.
    let err = hub.ingest(key(7, 0), vec![stored(&prompt, 1)]).unwrap_err();
    assert!(matches!(err, TransportError::UnknownWorker(7)));

    assert!(hub.register(Registration::new(WorkerId(7))).unwrap());
    assert!(hub.register(Registration::new(WorkerId(8))).unwrap());
    assert!(!hub.register(Registration::new(WorkerId(8))).unwrap());
    hub.ingest(key(7, 0), vec![stored(&prompt, 100)]).unwrap();
    // A new rank of a known worker registers itself.
    hub.ingest(key(8, 3), vec![stored(&prompt[..64], 200)])
        .unwrap();
    hub.sync().unwrap();

    let (_, blocks, m) = hub.overlap(None, &prompt, None).unwrap();
    assert_eq!(blocks, 10);
    assert_eq!(m.overlaps, vec![(key(7, 0), 10), (key(8, 3), 4)]);
    let ranks: Vec<_> = hub
        .workers()
        .iter()
        .map(|w| w.registration.dp_ranks.clone())
        .collect();
    assert_eq!(ranks, vec![vec![DpRank(0)], vec![DpRank(0), DpRank(3)]]);

    let call = RouteCall {
        request_id: Some("a".into()),
        tokens: &prompt,
        ..RouteCall::default()
    };
    let routed = hub.route(None, &call, Instant::now()).unwrap();
    assert_eq!(routed.decision.worker, key(7, 0));
    assert_eq!(routed.decision.overlap_blocks, 10);
    assert!(matches!(
        hub.route(None, &call, Instant::now()),
        Err(TransportError::DuplicateRequest(_))
    ));
    assert_eq!(hub.routing().active_requests(), 1);
    hub.prefilled("a").unwrap();
    hub.finish("a").unwrap();
    assert!(matches!(
        hub.finish("a"),
        Err(TransportError::UnknownRequest(_))
    ));
    assert_eq!(hub.routing().active_requests(), 0);

    // Generated ids are unique.
    let call = RouteCall {
        tokens: &prompt,
        ..RouteCall::default()
    };
    let a = hub.route(None, &call, Instant::now()).unwrap().request_id;
    let b = hub.route(None, &call, Instant::now()).unwrap().request_id;
    assert_ne!(a, b);

    // Removing a worker drops its blocks and its requests.
    let dropped = hub.remove_worker(WorkerId(7)).unwrap();
    assert_eq!(dropped, Some(1), "one rank held blocks");
    assert_eq!(hub.remove_worker(WorkerId(7)).unwrap(), None);
    let (_, _, m) = hub.overlap(None, &prompt, None).unwrap();
    assert_eq!(m.overlaps, vec![(key(8, 3), 4)]);
    assert_eq!(
        hub.routing().active_requests(),
        0,
        "both requests were on worker 7"
    );

    // Resync clears the rank and marks it until its next batch.
    hub.resync(key(8, 3)).unwrap();
    hub.sync().unwrap();
    assert_eq!(hub.workers()[0].resyncing, vec![DpRank(3)]);
    assert!(
        hub.overlap(None, &prompt, None)
            .unwrap()
            .2
            .overlaps
            .is_empty()
    );
    hub.ingest(key(8, 3), vec![stored(&prompt[..32], 300)])
        .unwrap();
    assert!(hub.workers()[0].resyncing.is_empty());

    drop(hub);
    runtime.join().unwrap();
}

#[test]
fn without_kv_events_decisions_predict_the_caches_and_events_are_refused() {
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(config, Sharding::adaptive(1).unwrap(), engine).unwrap();
    let hub = hub
        .without_kv_events(engine::approx::ApproxConfig::default())
        .unwrap();
    assert!(!hub.kv_events());
    for w in 1..=4 {
        hub.register(Registration::new(WorkerId(w))).unwrap();
    }
    let prompt: Vec<u32> = (0..96).collect();
    let call = RouteCall {
        tokens: &prompt,
        ..RouteCall::default()
    };
    let first = hub.route(None, &call, Instant::now()).unwrap();
    assert_eq!(first.decision.overlap_blocks, 0);
    let id = first.request_id.clone();
    hub.finish(&id).unwrap();
    // The first decision is now a prediction: the same prompt goes back with its overlap.
    let second = hub.route(None, &call, Instant::now()).unwrap();
    assert_eq!(second.decision.worker, first.decision.worker);
    assert_eq!(second.decision.overlap_blocks, 6);
    let (_, _, m) = hub.overlap(None, &prompt, None).unwrap();
    assert_eq!(m.overlaps, vec![(first.decision.worker, 6)]);
    assert!(matches!(
        hub.ingest(key(1, 0), vec![stored(&prompt, 1)]),
        Err(TransportError::Invalid { .. })
    ));
    drop(hub);
    runtime.join().unwrap();
}

/// Ranks: a worker's events may add ranks (vLLM's data-parallel ranks publish separately),
/// up to a cap; a load report never adds one.
#[test]
fn load_reports_need_known_ranks_and_event_ranks_are_capped() {
    use engine::sched::WorkerLoad;
    use transport::hub::MAX_RANKS_PER_WORKER;
    let (hub, runtime) = common::hub(1);
    hub.register(Registration::new(WorkerId(4))).unwrap();
    let load = WorkerLoad {
        num_requests_waiting: 1,
        kv_usage: 0.5,
    };
    hub.update_load(key(4, 0), load).unwrap();
    assert!(matches!(
        hub.update_load(key(4, 3), load),
        Err(TransportError::UnknownRank {
            worker: 4,
            dp_rank: 3
        })
    ));
    assert!(matches!(
        hub.update_load(key(5, 0), load),
        Err(TransportError::UnknownWorker(5))
    ));
    assert_eq!(hub.workers()[0].registration.dp_ranks, vec![DpRank(0)]);
    // Events bring ranks in, up to the cap.
    for r in 1..MAX_RANKS_PER_WORKER as u32 {
        hub.ingest(key(4, r), vec![KvEvent::Cleared]).unwrap();
    }
    hub.update_load(key(4, 3), load).unwrap();
    let over = MAX_RANKS_PER_WORKER as u32;
    assert!(matches!(
        hub.ingest(key(4, over), vec![KvEvent::Cleared]),
        Err(TransportError::TooManyRanks { worker: 4, .. })
    ));
    assert_eq!(
        hub.workers()[0].registration.dp_ranks.len(),
        MAX_RANKS_PER_WORKER
    );
    drop(hub);
    runtime.join().unwrap();
}

/// A source's feed admits its worker's batches without a registry visit while nothing
/// changed, and follows every change: a new rank, a model with another block size, the
/// worker's removal.
#[test]
fn a_feed_follows_the_registry() {
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(config, Sharding::adaptive(2).unwrap(), engine).unwrap();
    let prompt: Vec<u32> = (0..64).collect();
    let mut feed = hub.feed(WorkerId(3));
    let events = || vec![stored(&prompt, 10)];
    // Not registered: refused, as through `ingest`.
    let err = hub
        .ingest_fed(&mut feed, DpRank(0), events(), 0, None)
        .unwrap_err();
    assert!(matches!(err, TransportError::UnknownWorker(3)));
    hub.register(Registration::new(WorkerId(3))).unwrap();
    hub.ingest_fed(&mut feed, DpRank(0), events(), 1, None)
        .unwrap();
    // A rank the feed does not know registers itself, as through `ingest`.
    hub.ingest_fed(&mut feed, DpRank(2), events(), 2, None)
        .unwrap();
    hub.sync().unwrap();
    let (_, _, m) = hub.overlap(None, &prompt, None).unwrap();
    assert_eq!(m.overlaps, vec![(key(3, 0), 4), (key(3, 2), 4)]);
    // A model with its own block size: the feed converts at it from the next batch on.
    hub.declare_model(&engine::router::ModelSpec {
        name: "m".into(),
        block_size: Some(32),
    })
    .unwrap();
    assert_eq!(feed.block_size(), 16);
    hub.register(Registration {
        model: Some("m".into()),
        ..Registration::new(WorkerId(3))
    })
    .unwrap();
    hub.refresh_feed(&mut feed);
    assert_eq!(feed.block_size(), 32);
    // Removed: refused again.
    hub.remove_worker(WorkerId(3)).unwrap();
    let err = hub
        .ingest_fed(&mut feed, DpRank(0), events(), 3, None)
        .unwrap_err();
    assert!(matches!(err, TransportError::UnknownWorker(3)));
    drop(hub);
    runtime.join().unwrap();
}
