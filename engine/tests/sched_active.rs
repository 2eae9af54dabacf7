//! Active-request accounting through the scheduler: shared blocks, prefill, free, expiry and
//! worker removal.

use std::time::{Duration, Instant};

use engine::sched::{ActiveLoad, RouteOverrides, RouteRequest, Scheduler, SchedulerConfig};
use engine::{EngineError, Matches, RequestId, SeqHash, WorkerId, WorkerKey};

fn hs(v: &[u64]) -> Vec<SeqHash> {
    v.iter().copied().map(SeqHash).collect()
}

fn load(blocks: u64, prefill: u64, requests: u64) -> ActiveLoad {
    ActiveLoad {
        active_blocks: blocks,
        active_prefill_tokens: prefill,
        active_requests: requests,
    }
}

/// A scheduler with block size 4, a 30 s timeout and the given keys.
fn scheduler(keys: &[WorkerKey]) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 4,
        request_timeout: Duration::from_secs(30),
        ..Default::default()
    })
    .unwrap();
    for &k in keys {
        s.add_worker(k).unwrap();
    }
    s
}

/// Routes `id` directly to `worker` (rank 0 is its only rank in these tests).
fn route_to(
    s: &mut Scheduler,
    now: Instant,
    worker: u64,
    id: u64,
    blocks: &[SeqHash],
    input_tokens: u64,
    overlap: u32,
) {
    let m = Matches {
        overlaps: if overlap > 0 {
            vec![(WorkerKey::new(worker, 0), overlap)]
        } else {
            vec![]
        },
        depth_counts: vec![1; overlap as usize],
    };
    let r = RouteRequest {
        id: RequestId(id),
        blocks,
        input_tokens,
        overrides: RouteOverrides {
            worker: Some(WorkerId(worker)),
            ..Default::default()
        },
    };
    let d = s.route(now, &r, &m, |_| 0).unwrap();
    assert_eq!(d.overlap_blocks, overlap);
}

#[test]
fn a_block_shared_by_two_requests_counts_once() {
    let now = Instant::now();
    let a = WorkerKey::new(1, 0);
    let mut s = scheduler(&[a]);
    route_to(&mut s, now, 1, 1, &hs(&[1, 2, 3]), 12, 0);
    route_to(&mut s, now, 1, 2, &hs(&[1, 2, 4, 5]), 16, 0);
    assert_eq!(s.active_load(a).unwrap().active_blocks, 5);
    s.free(RequestId(1)).unwrap();
    assert_eq!(
        s.active_load(a).unwrap().active_blocks,
        4,
        "1 and 2 stay for request 2"
    );
    s.free(RequestId(2)).unwrap();
    assert_eq!(s.active_load(a).unwrap(), ActiveLoad::default());
}

#[test]
fn the_same_blocks_on_two_workers_count_on_each() {
    let now = Instant::now();
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
    let mut s = scheduler(&[a, b]);
    route_to(&mut s, now, 1, 1, &hs(&[1, 2]), 8, 0);
    route_to(&mut s, now, 2, 2, &hs(&[1, 2]), 8, 0);
    assert_eq!(s.active_load(a).unwrap().active_blocks, 2);
    assert_eq!(s.active_load(b).unwrap().active_blocks, 2);
    s.free(RequestId(1)).unwrap();
    assert_eq!(s.active_load(a).unwrap().active_blocks, 0);
    assert_eq!(s.active_load(b).unwrap().active_blocks, 2);
}

#[test]
fn prefill_tokens_follow_prefilled_free_and_expire() {
    let t0 = Instant::now();
    let a = WorkerKey::new(1, 0);
    let mut s = scheduler(&[a]);
    // 18 tokens, 2 blocks cached: 18 - 8 = 10 to prefill.
    route_to(&mut s, t0, 1, 1, &hs(&[1, 2, 3, 4]), 18, 2);
    // 7 tokens, overlap 3 blocks = 12 tokens > 7: nothing to prefill.
    route_to(&mut s, t0, 1, 2, &hs(&[1]), 7, 3);
    // 20 tokens, nothing cached, 10 s later.
    route_to(
        &mut s,
        t0 + Duration::from_secs(10),
        1,
        3,
        &hs(&[7, 8]),
        20,
        0,
    );
    assert_eq!(s.active_load(a).unwrap(), load(6, 30, 3));

    s.prefilled(RequestId(1)).unwrap();
    assert_eq!(s.active_load(a).unwrap(), load(6, 20, 3));
    s.prefilled(RequestId(1)).unwrap();
    assert_eq!(
        s.active_load(a).unwrap(),
        load(6, 20, 3),
        "prefilled is idempotent"
    );

    s.free(RequestId(2)).unwrap();
    assert_eq!(
        s.active_load(a).unwrap(),
        load(6, 20, 2),
        "block 1 still held by request 1"
    );

    // Request 1 reaches its 30 s deadline; request 3 (10 s younger) does not.
    assert!(s.expire(t0 + Duration::from_secs(29)).is_empty());
    assert_eq!(s.expire(t0 + Duration::from_secs(30)), [RequestId(1)]);
    assert_eq!(s.active_load(a).unwrap(), load(2, 20, 1));
    assert_eq!(
        s.free(RequestId(1)),
        Err(EngineError::UnknownRequest(RequestId(1)))
    );
    assert_eq!(s.expire(t0 + Duration::from_secs(40)), [RequestId(3)]);
    assert_eq!(s.active_load(a).unwrap(), ActiveLoad::default());
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn unknown_requests_are_refused() {
    let mut s = scheduler(&[WorkerKey::new(1, 0)]);
    assert_eq!(
        s.prefilled(RequestId(5)),
        Err(EngineError::UnknownRequest(RequestId(5)))
    );
    assert_eq!(
        s.free(RequestId(5)),
        Err(EngineError::UnknownRequest(RequestId(5)))
    );
    assert!(matches!(
        s.add_active(
            Instant::now(),
            WorkerKey::new(2, 0),
            RequestId(1),
            &[],
            0,
            0
        ),
        Err(EngineError::UnknownWorker { .. })
    ));
}

#[test]
fn removing_a_worker_drops_its_ranks_and_their_requests() {
    let now = Instant::now();
    let keys = [
        WorkerKey::new(1, 0),
        WorkerKey::new(1, 1),
        WorkerKey::new(2, 0),
    ];
    let mut s = scheduler(&keys);
    let blocks = hs(&[1, 2, 3]);
    for (id, &k) in keys.iter().enumerate() {
        s.add_active(now, k, RequestId(id as u64), &blocks, 12, 0)
            .unwrap();
    }
    s.add_active(now, keys[1], RequestId(10), &hs(&[9]), 4, 0)
        .unwrap();

    let removal = s.remove_worker(WorkerId(1));
    assert_eq!(removal.keys, keys[..2]);
    assert_eq!(removal.freed_requests, 3);
    assert!(!s.is_active(RequestId(0)) && !s.is_active(RequestId(10)));
    assert_eq!(s.active_load(keys[0]), None);
    assert_eq!(
        s.active_load(keys[2]).unwrap(),
        load(3, 12, 1),
        "worker 2 untouched"
    );
    assert_eq!(s.workers().collect::<Vec<_>>(), [keys[2]]);

    // The freed ids can be routed again, and a re-added worker starts idle.
    s.add_worker(keys[0]).unwrap();
    assert_eq!(s.active_load(keys[0]).unwrap(), ActiveLoad::default());
    s.add_active(now, keys[0], RequestId(0), &blocks, 12, 0)
        .unwrap();
    assert_eq!(s.active_load(keys[0]).unwrap(), load(3, 12, 1));
    assert_eq!(s.remove_worker(WorkerId(42)), Default::default());
}
