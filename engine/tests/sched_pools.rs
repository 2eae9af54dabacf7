//! Disaggregated pools through `Scheduler::route`: prefill workers chosen by KV overlap,
//! decode workers by load, whole requests on aggregated (else decode) workers, and a random
//! sequence of registrations and calls checked against a simple model of the pools.

use std::collections::BTreeMap;
use std::time::Instant;

use engine::sched::{Pool, RouteOverrides, RouteRequest, Scheduler, SchedulerConfig, WorkerRole};
use engine::{EngineError, Matches, RequestId, SeqHash, WorkerId, WorkerKey};
use proptest::prelude::*;

fn key(worker: u64) -> WorkerKey {
    WorkerKey::new(worker, 0)
}

fn hs(n: u64) -> Vec<SeqHash> {
    (1..=n).map(SeqHash).collect()
}

fn req(id: u64, blocks: &[SeqHash], pool: Pool) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        blocks,
        input_tokens: blocks.len() as u64 * 16,
        overrides: RouteOverrides {
            pool,
            ..RouteOverrides::default()
        },
    }
}

fn with_roles(roles: &[(u64, WorkerRole)]) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig::default()).unwrap();
    for &(w, r) in roles {
        s.add_worker_with_role(key(w), r).unwrap();
    }
    s
}

/// Prefill workers 1 and 2, decode workers 3 and 4.
fn two_prefill_two_decode() -> Scheduler {
    with_roles(&[
        (1, WorkerRole::Prefill),
        (2, WorkerRole::Prefill),
        (3, WorkerRole::Decode),
        (4, WorkerRole::Decode),
    ])
}

#[test]
fn prefill_follows_overlap_and_decode_follows_load() {
    let now = Instant::now();
    let mut s = two_prefill_two_decode();
    let blocks = hs(32);
    // Prefill worker 2 holds 30 of the 32 blocks; decode worker 3 holds all 32.
    let m = Matches::from_overlaps([(key(2), 30), (key(3), 32)]);
    let d = s
        .route(now, &req(1, &blocks, Pool::Prefill), &m, |_| 0)
        .unwrap();
    assert_eq!((d.worker, d.pool), (key(2), Pool::Prefill));
    assert_eq!(d.candidates.len(), 2, "only prefill workers are candidates");

    // Decode worker 3 is busy with a large request: worker 4 gets the decode half although
    // 3 caches the prompt (load decides; overlap only breaks near-ties).
    s.add_active(now, key(3), RequestId(100), &hs(400)[100..], 6400, 0)
        .unwrap();
    let d = s
        .route(now, &req(2, &blocks, Pool::Decode), &m, |_| 0)
        .unwrap();
    assert_eq!(d.worker, key(4));
    // With equal load, the decode worker that caches the prompt wins.
    s.free(RequestId(100)).unwrap();
    s.free(RequestId(2)).unwrap();
    let d = s
        .route(now, &req(3, &blocks, Pool::Decode), &m, |_| 0)
        .unwrap();
    assert_eq!(d.worker, key(3));
}

#[test]
fn whole_requests_and_empty_pools() {
    let now = Instant::now();
    let blocks = hs(4);
    let m = Matches::default();
    let mut s = with_roles(&[(1, WorkerRole::Prefill)]);
    let err = s
        .route(now, &req(1, &blocks, Pool::Decode), &m, |_| 0)
        .unwrap_err();
    assert!(matches!(
        err,
        EngineError::NoWorkersInPool { pool: "decode" }
    ));
    // Only a prefill worker: it serves whole requests.
    assert_eq!(
        s.route(now, &req(2, &blocks, Pool::Whole), &m, |_| 0)
            .unwrap()
            .worker,
        key(1)
    );
    s.add_worker_with_role(key(2), WorkerRole::Decode).unwrap();
    assert_eq!(
        s.route(now, &req(3, &blocks, Pool::Whole), &m, |_| 0)
            .unwrap()
            .worker,
        key(2)
    );
    s.add_worker(key(3)).unwrap();
    assert_eq!(
        s.route(now, &req(4, &blocks, Pool::Whole), &m, |_| 0)
            .unwrap()
            .worker,
        key(3)
    );
    // A role change applies to calls from then on.
    s.add_worker_with_role(key(3), WorkerRole::Prefill).unwrap();
    assert_eq!(s.role(key(3)), Some(WorkerRole::Prefill));
    assert_eq!(
        s.route(now, &req(5, &blocks, Pool::Whole), &m, |_| 0)
            .unwrap()
            .worker,
        key(2)
    );
}

#[test]
fn round_robin_cycles_each_pool_even_when_calls_alternate() {
    let now = Instant::now();
    let mut s = two_prefill_two_decode();
    let blocks = hs(2);
    let rr = |pool| RouteOverrides {
        pool,
        mode: Some(engine::sched::RouteMode::RoundRobin),
        ..RouteOverrides::default()
    };
    let mut seen = Vec::new();
    for i in 0..4u64 {
        for (j, pool) in [Pool::Decode, Pool::Prefill].into_iter().enumerate() {
            let mut r = req(i * 2 + j as u64, &blocks, pool);
            r.overrides = rr(pool);
            seen.push(
                s.route(now, &r, &Matches::default(), |_| 0)
                    .unwrap()
                    .worker
                    .worker
                    .0,
            );
        }
    }
    assert_eq!(seen, [3, 1, 4, 2, 3, 1, 4, 2]);
}

#[derive(Clone, Debug)]
enum Op {
    Add(u64, WorkerRole),
    Remove(u64),
    Route(Pool),
}

fn op() -> impl Strategy<Value = Op> {
    let role = prop_oneof![
        Just(WorkerRole::Aggregated),
        Just(WorkerRole::Prefill),
        Just(WorkerRole::Decode)
    ];
    let pool = prop_oneof![Just(Pool::Whole), Just(Pool::Prefill), Just(Pool::Decode)];
    prop_oneof![
        3 => (0..6u64, role).prop_map(|(w, r)| Op::Add(w, r)),
        1 => (0..6u64).prop_map(Op::Remove),
        4 => pool.prop_map(Op::Route),
    ]
}

proptest! {
    #[test]
    fn routes_stay_inside_their_pool(ops in proptest::collection::vec(op(), 1..60)) {
        let now = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig::default()).unwrap();
        let mut model: BTreeMap<u64, WorkerRole> = BTreeMap::new();
        let blocks = hs(3);
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Add(w, r) => {
                    s.add_worker_with_role(key(w), r).unwrap();
                    model.insert(w, r);
                }
                Op::Remove(w) => {
                    s.remove_worker(WorkerId(w));
                    model.remove(&w);
                }
                Op::Route(pool) => {
                    let eligible: Vec<u64> = pool
                        .roles()
                        .iter()
                        .map(|r| model.iter().filter(|(_, m)| *m == r).map(|(w, _)| *w).collect::<Vec<_>>())
                        .find(|l| !l.is_empty())
                        .unwrap_or_default();
                    let got = s.route(now, &req(i as u64, &blocks, pool), &Matches::default(), |_| 0);
                    match got {
                        Ok(d) => {
                            prop_assert!(eligible.contains(&d.worker.worker.0), "{pool:?} chose {:?}, eligible {eligible:?}", d.worker);
                            let offered: Vec<u64> = d.candidates.iter().map(|c| c.key.worker.0).collect();
                            prop_assert_eq!(offered, eligible);
                            s.free(RequestId(i as u64)).unwrap();
                        }
                        Err(EngineError::NoWorkers) => prop_assert!(model.is_empty()),
                        Err(EngineError::NoWorkersInPool { .. }) => prop_assert!(eligible.is_empty() && !model.is_empty()),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
            }
        }
    }
}
