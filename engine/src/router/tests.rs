//! Tests of [`super::Router`]: names, workers, remote requests, predictions.

use super::*;
use crate::sched::{RouteMode, WorkerRole};

/// A round-robin router over worker 1, without predict-on-route (on by default): these
/// tests count loads and overlaps that a prediction would change.
fn router() -> Router {
    let config = SchedulerConfig {
        mode: RouteMode::RoundRobin,
        predict_on_route: None,
        ..SchedulerConfig::default()
    };
    let mut r = Router::new(config, None).unwrap();
    r.add_worker(WorkerKey::new(1, 0), WorkerRole::default())
        .unwrap();
    r
}

#[test]
fn names_are_interned_while_active_and_generated_ones_never_repeat() {
    let mut r = router();
    let now = Instant::now();
    let call = RouteCall {
        request_id: Some("a".into()),
        tokens: &[1; 32],
        ..RouteCall::default()
    };
    let routed = r.route(now, &call, &[], &Matches::default()).unwrap();
    assert_eq!(routed.request_id, "a");
    assert_eq!(
        r.route(now, &call, &[], &Matches::default()),
        Err(RouteError::Name(NameError::Duplicate("a".into())))
    );
    // A router routes named requests only (the namespaces name the others).
    let anon = RouteCall {
        tokens: &[1; 32],
        ..RouteCall::default()
    };
    assert_eq!(
        r.route(now, &anon, &[], &Matches::default()),
        Err(RouteError::Name(NameError::Missing))
    );
    for name in ["g1", "g2"] {
        let named = RouteCall {
            request_id: Some(name.into()),
            ..anon.clone()
        };
        r.route(now, &named, &[], &Matches::default()).unwrap();
    }
    assert_eq!(r.active_requests(), 3);
    r.finish("a").unwrap();
    assert_eq!(
        r.finish("a"),
        Err(RouteError::Name(NameError::Unknown("a".into())))
    );
    // The name is free again once finished.
    r.route(now, &call, &[], &Matches::default()).unwrap();
    // Ids have a length cap; the refusal records nothing.
    let before = r.active_requests();
    let long = RouteCall {
        request_id: Some("x".repeat(MAX_REQUEST_ID_BYTES + 1)),
        tokens: &[1; 32],
        ..RouteCall::default()
    };
    assert_eq!(
        r.route(now, &long, &[], &Matches::default()),
        Err(RouteError::Name(NameError::TooLong(
            MAX_REQUEST_ID_BYTES + 1
        )))
    );
    assert_eq!(r.active_requests(), before);
    let longest = RouteCall {
        request_id: Some("x".repeat(MAX_REQUEST_ID_BYTES)),
        ..long.clone()
    };
    r.route(now, &longest, &[], &Matches::default()).unwrap();
    // Control characters are refused wherever an id is named; printable Unicode is not.
    for (bad, at) in [("a\nb", 1), ("\u{7f}", 0), ("x\u{85}", 1), ("\0", 0)] {
        let call = RouteCall {
            request_id: Some(bad.into()),
            ..long.clone()
        };
        let refused = Err(RouteError::Name(NameError::ControlCharacter(at)));
        assert_eq!(r.route(now, &call, &[], &Matches::default()), refused);
        assert_eq!(
            r.finish(bad),
            Err(RouteError::Name(NameError::ControlCharacter(at)))
        );
        assert_eq!(
            r.prefilled(now, bad),
            Err(RouteError::Name(NameError::ControlCharacter(at)))
        );
    }
    assert_eq!(r.active_requests(), before + 1);
    assert_eq!(
        r.finish(&"y".repeat(MAX_REQUEST_ID_BYTES + 1)),
        Err(RouteError::Name(NameError::TooLong(
            MAX_REQUEST_ID_BYTES + 1
        )))
    );
    let unicode = RouteCall {
        request_id: Some("r\u{e9}q \u{1f600}".into()),
        ..long
    };
    r.route(now, &unicode, &[], &Matches::default()).unwrap();
    r.finish("r\u{e9}q \u{1f600}").unwrap();
    // Removing the worker forgets its requests.
    r.remove_worker(WorkerId(1), true);
    assert_eq!(r.active_requests(), 0);
    assert!(r.prefilled(Instant::now(), "a").is_err());
}

fn remote<'a>(
    replica: ReplicaId,
    name: &'a str,
    key: WorkerKey,
    blocks: &'a [SeqHash],
    input_tokens: u64,
) -> RemoteRequest<'a> {
    RemoteRequest {
        replica,
        name,
        key,
        blocks,
        input_tokens,
        overlap_blocks: 0,
    }
}

#[test]
fn peer_requests_have_their_own_names_and_leave_with_their_replica_or_worker() {
    let mut r = router();
    let now = Instant::now();
    let key = WorkerKey::new(1, 0);
    let (a, b) = (ReplicaId(10), ReplicaId(11));
    let blocks = [SeqHash(1), SeqHash(2)];
    assert_eq!(
        r.add_remote(now, &remote(a, "x", key, &blocks, 32)),
        Ok(true)
    );
    assert_eq!(
        r.add_remote(now, &remote(a, "x", key, &blocks, 32)),
        Ok(false)
    );
    assert_eq!(
        r.add_remote(now, &remote(b, "x", key, &blocks[..1], 16)),
        Ok(true)
    );
    // A peer's name neither blocks nor answers to a local one.
    let call = RouteCall {
        request_id: Some("x".into()),
        tokens: &[1; 32],
        ..RouteCall::default()
    };
    r.route(now, &call, &blocks, &Matches::default()).unwrap();
    assert_eq!(r.active_requests(), 3);
    assert_eq!((r.routed_requests(), r.remote_requests()), (1, 2));
    let load = r.active_load(key).unwrap();
    assert_eq!(load.active_blocks, 2, "shared blocks count once");
    assert_eq!(load.active_prefill_tokens, 32 + 16 + 32);
    r.prefilled_remote(a, "x").unwrap();
    assert_eq!(r.active_load(key).unwrap().active_prefill_tokens, 48);
    r.finish("x").unwrap();
    assert!(r.is_remote_active(a, "x") && r.is_remote_active(b, "x"));
    assert_eq!(
        r.local_requests(),
        vec![],
        "only this router's requests are its state"
    );
    // Unknown workers and names are refused, not recorded.
    assert!(matches!(
        r.add_remote(now, &remote(a, "y", WorkerKey::new(9, 0), &blocks, 1)),
        Err(RouteError::Engine(EngineError::UnknownWorker { .. }))
    ));
    assert!(matches!(
        r.add_remote(now, &remote(a, "bad\n", key, &blocks, 1)),
        Err(RouteError::Name(NameError::ControlCharacter(3)))
    ));
    assert_eq!(
        r.finish_remote(a, "nope"),
        Err(RouteError::Name(NameError::Unknown("nope".into())))
    );
    assert_eq!(r.forget_replica(a), 1);
    assert_eq!(r.remote_requests(), 1);
    // A worker that leaves takes the peers' requests on it along.
    r.remove_worker(WorkerId(1), false);
    assert_eq!((r.active_requests(), r.remote_requests()), (0, 0));
}

#[test]
fn peer_requests_expire_like_local_ones() {
    let config = SchedulerConfig {
        mode: RouteMode::RoundRobin,
        request_timeout: std::time::Duration::from_secs(5),
        predict_on_route: None,
        ..SchedulerConfig::default()
    };
    let mut r = Router::new(config, None).unwrap();
    let key = WorkerKey::new(1, 0);
    r.add_worker(key, WorkerRole::default()).unwrap();
    let now = Instant::now();
    r.add_remote(now, &remote(ReplicaId(1), "x", key, &[SeqHash(1)], 16))
        .unwrap();
    let call = RouteCall {
        request_id: Some("kvr-local".into()),
        tokens: &[1; 16],
        ..RouteCall::default()
    };
    let routed = r
        .route(now, &call, &[SeqHash(1)], &Matches::default())
        .unwrap();
    assert_eq!(
        r.local_requests(),
        vec![LocalRequest {
            name: routed.request_id,
            key,
            blocks: vec![SeqHash(1)],
            pending_prefill_tokens: 16,
        }]
    );
    r.expire(now + std::time::Duration::from_secs(5));
    assert_eq!(r.active_requests(), 0);
    assert!(!r.is_remote_active(ReplicaId(1), "x"));
    assert!(r.local_requests().is_empty());
}

#[test]
fn approximate_mode_predicts_what_it_routed() {
    let config = SchedulerConfig::default();
    let mut r = Router::new(config, Some(ApproxConfig::default())).unwrap();
    r.add_worker(WorkerKey::new(7, 0), WorkerRole::default())
        .unwrap();
    let now = Instant::now();
    let seqs = [SeqHash(1), SeqHash(2)];
    assert_eq!(r.predicted_matches(now, &seqs).unwrap().best(), 0);
    let call = RouteCall {
        request_id: Some("p".into()),
        tokens: &[0; 32],
        ..RouteCall::default()
    };
    let m = r.predicted_matches(now, &seqs).unwrap();
    r.route(now, &call, &seqs, &m).unwrap();
    let m = r.predicted_matches(now, &seqs).unwrap();
    assert_eq!(m.overlap(WorkerKey::new(7, 0)), 2);
    // A peer replica's decision predicts as much.
    r.add_worker(WorkerKey::new(8, 0), WorkerRole::default())
        .unwrap();
    let theirs = [SeqHash(1), SeqHash(2), SeqHash(3)];
    let peer = remote(ReplicaId(5), "p", WorkerKey::new(8, 0), &theirs, 48);
    r.add_remote(now, &peer).unwrap();
    let m = r.predicted_matches(now, &theirs).unwrap();
    assert_eq!(m.overlap(WorkerKey::new(8, 0)), 3);
}

/// A call named `name` with prompt `tokens`.
fn named<'a>(name: &str, tokens: &'a [u32]) -> RouteCall<'a> {
    RouteCall {
        request_id: Some(name.into()),
        tokens,
        ..RouteCall::default()
    }
}

#[test]
fn predict_on_route_lends_a_decision_to_the_next_request_until_it_expires() {
    use std::time::Duration;
    let ttl = Duration::from_secs(2);
    let config = SchedulerConfig {
        predict_on_route: Some(ttl),
        ..SchedulerConfig::default()
    };
    let mut r = Router::new(config, None).unwrap();
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
    for k in [a, b] {
        r.add_worker(k, WorkerRole::default()).unwrap();
    }
    let seqs: Vec<SeqHash> = (1..=8).map(SeqHash).collect();
    let tokens = [7u32; 128];
    let call = |name: &str| named(name, &tokens);
    let t0 = Instant::now();
    let first = r
        .route(t0, &call("r1"), &seqs, &Matches::default())
        .unwrap();
    let warm = first.decision.worker;
    let cold = if warm == a { b } else { a };
    // Before any event: the prediction is the only overlap, and it wins the request.
    let second = r
        .route(t0 + ttl / 2, &call("r2"), &seqs, &Matches::default())
        .unwrap();
    assert_eq!(second.decision.worker, warm);
    assert_eq!(second.decision.overlap_blocks, 8);
    // The index is never overruled downwards: a deeper indexed overlap elsewhere counts.
    let indexed = Matches::from_overlaps([(cold, 8)]);
    let third = r.route(t0 + ttl / 2, &call("r3"), &seqs, &indexed).unwrap();
    assert_eq!(third.decision.best_available_overlap_blocks, 8);
    // Past its time (the r2/r3 refreshes included) the prediction is gone.
    for n in ["r1", "r2", "r3"] {
        r.finish(n).unwrap();
    }
    let late = r
        .route(t0 + ttl * 3, &call("r4"), &seqs, &Matches::default())
        .unwrap();
    assert_eq!(late.decision.overlap_blocks, 0);
    assert_eq!(late.decision.best_available_overlap_blocks, 0);
    // A removed worker's predictions go with it.
    let again = r
        .route(t0 + ttl * 3, &call("r5"), &seqs, &Matches::default())
        .unwrap();
    r.remove_worker(again.decision.worker.worker, true);
    let after = r
        .route(t0 + ttl * 3, &call("r6"), &seqs, &Matches::default())
        .unwrap();
    assert_eq!(after.decision.overlap_blocks, 0);
}

#[test]
fn cached_totals_grow_by_what_each_route_will_store_until_the_next_refresh() {
    let mut r = router();
    let k = WorkerKey::new(1, 0);
    let seqs: Vec<SeqHash> = (1..=8).map(SeqHash).collect();
    let tokens = [7u32; 128];
    let call = |name: &str| named(name, &tokens);
    let t0 = Instant::now();
    // Never refreshed: the routes alone count (8 new blocks).
    r.route(t0, &call("r0"), &seqs, &Matches::default())
        .unwrap();
    assert_eq!(r.cached_blocks(k), 8);
    r.set_cached_blocks([(k, 100)]);
    // 3 of the 8 blocks cached already: 5 more to store.
    let three = Matches::from_overlaps([(k, 3)]);
    r.route(t0, &call("r1"), &seqs, &three).unwrap();
    assert_eq!(r.cached_blocks(k), 105);
    // All cached: nothing to store.
    let all = Matches::from_overlaps([(k, 8)]);
    r.route(t0, &call("r2"), &seqs, &all).unwrap();
    assert_eq!(r.cached_blocks(k), 105);
    // The next refresh replaces the estimate with the index's count.
    r.set_cached_blocks([(k, 90)]);
    assert_eq!(r.cached_blocks(k), 90);
}

#[test]
fn predict_on_route_off_leaves_overlaps_to_the_index() {
    let mut r = router();
    let seqs: Vec<SeqHash> = (1..=4).map(SeqHash).collect();
    let now = Instant::now();
    for name in ["x", "y"] {
        let call = RouteCall {
            request_id: Some(name.into()),
            tokens: &[1; 64],
            ..RouteCall::default()
        };
        let routed = r.route(now, &call, &seqs, &Matches::default()).unwrap();
        assert_eq!(routed.decision.overlap_blocks, 0);
    }
}
