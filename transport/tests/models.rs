//! Per-model routing through the hub over a real two-core engine: each model routes among
//! its own workers at its own block size, unknown models are refused, request ids are
//! unique across models, and a worker that changes model leaves its old blocks behind.

mod common;

use common::stored;
use engine::router::ModelSpec;
use engine::{DpRank, WorkerId, WorkerKey};
use std::time::Instant;
use transport::TransportError;
use transport::hub::{Hub, Registration, RouteCall};

fn key(w: u64) -> WorkerKey {
    WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(0),
    }
}

fn register(hub: &Hub, w: u64, model: &str) {
    hub.register(Registration {
        model: Some(model.into()),
        ..Registration::new(WorkerId(w))
    })
    .unwrap();
}

fn call<'a>(tokens: &'a [u32], id: &str) -> RouteCall<'a> {
    RouteCall {
        request_id: Some(id.into()),
        tokens,
        ..RouteCall::default()
    }
}

#[test]
fn each_model_routes_among_its_own_workers_at_its_block_size() {
    let (hub, runtime) = common::hub(2);
    for (name, bs) in [("small", 16), ("large", 32)] {
        hub.declare_model(&ModelSpec {
            name: name.into(),
            block_size: Some(bs),
        })
        .unwrap();
    }
    register(&hub, 1, "small");
    register(&hub, 2, "large");
    register(&hub, 3, "small");
    assert_eq!(hub.block_size_of(WorkerId(1)), 16);
    assert_eq!(hub.block_size_of(WorkerId(2)), 32);
    assert_eq!(hub.routing().block_size_in("large"), 32);

    // Workers 1 and 2 cache the same 128-token prompt, each at its model's block size.
    let prompt: Vec<u32> = (0..128).collect();
    hub.ingest(key(1), vec![stored(&prompt, 16, 100)]).unwrap();
    hub.ingest(key(2), vec![stored(&prompt, 32, 200)]).unwrap();
    hub.sync().unwrap();

    let (bs, blocks, m) = hub.overlap(Some("small"), &prompt, None).unwrap();
    assert_eq!((bs, blocks), (16, 8));
    assert_eq!(m.overlaps, vec![(key(1), 8)], "only small's workers count");
    let (bs, blocks, m) = hub.overlap(Some("large"), &prompt, None).unwrap();
    assert_eq!((bs, blocks), (32, 4));
    assert_eq!(m.overlaps, vec![(key(2), 4)]);

    let now = Instant::now();
    let r = hub.route(Some("small"), &call(&prompt, "a"), now).unwrap();
    assert_eq!(r.decision.worker, key(1));
    assert_eq!(r.decision.overlap_blocks, 8);
    let candidates: Vec<_> = r.decision.candidates.iter().map(|c| c.key).collect();
    assert_eq!(candidates, [key(1), key(3)]);
    let r = hub.route(Some("large"), &call(&prompt, "b"), now).unwrap();
    assert_eq!(r.decision.worker, key(2));
    assert_eq!((r.blocks, r.decision.overlap_blocks), (4, 4));
    assert_eq!(r.decision.candidates.len(), 1);

    // Unknown models are refused; with several models a request must name one.
    assert!(matches!(
        hub.route(Some("nope"), &call(&prompt, "c"), now),
        Err(TransportError::UnknownModel(m)) if m == "nope"
    ));
    assert!(matches!(
        hub.route(None, &call(&prompt, "c"), now),
        Err(TransportError::Invalid { name: "model", .. })
    ));
    let models: Vec<_> = hub.routing().models().into_iter().map(|(m, _)| m).collect();
    assert_eq!(models, ["large", "small"]);

    // Ids are unique across models, and found wherever they are active.
    assert!(matches!(
        hub.route(Some("large"), &call(&prompt, "a"), now),
        Err(TransportError::DuplicateRequest(_))
    ));
    assert_eq!(hub.routing().active_requests(), 2);
    hub.prefilled("a").unwrap();
    hub.finish("a").unwrap();
    hub.finish("b").unwrap();
    assert!(matches!(
        hub.finish("b"),
        Err(TransportError::UnknownRequest(_))
    ));
    assert_eq!(hub.routing().active_requests(), 0);
    let anon = RouteCall {
        request_id: None,
        tokens: &prompt,
        ..RouteCall::default()
    };
    let g1 = hub.route(Some("small"), &anon, now).unwrap().request_id;
    let g2 = hub.route(Some("large"), &anon, now).unwrap().request_id;
    assert_ne!(g1, g2, "generated ids never repeat across models");

    drop(hub);
    runtime.join().unwrap();
}

#[test]
fn a_worker_that_changes_model_leaves_its_blocks_and_pool() {
    let (hub, runtime) = common::hub(2);
    hub.declare_model(&ModelSpec {
        name: "a".into(),
        block_size: None,
    })
    .unwrap();
    register(&hub, 1, "a");
    let prompt: Vec<u32> = (0..64).collect();
    hub.ingest(key(1), vec![stored(&prompt, 16, 1)]).unwrap();
    hub.sync().unwrap();
    assert_eq!(hub.overlap(Some("a"), &prompt, None).unwrap().2.best(), 4);

    // Restarted serving another model: its cache is another model's.
    register(&hub, 1, "b");
    hub.sync().unwrap();
    assert_eq!(hub.routing().model_of(WorkerId(1)), "b");
    assert_eq!(hub.overlap(Some("b"), &prompt, None).unwrap().2.best(), 0);
    let now = Instant::now();
    assert!(
        hub.route(Some("a"), &call(&prompt, "x"), now).is_err(),
        "a has no worker"
    );
    assert_eq!(
        hub.route(Some("b"), &call(&prompt, "y"), now)
            .unwrap()
            .decision
            .worker,
        key(1)
    );
    // "a" is declared: listed (not ready) after its last worker left; "b" is learned.
    assert_eq!(
        hub.routing().models(),
        vec![("a".to_owned(), false), ("b".to_owned(), true)]
    );
    // A re-registration without a model keeps the worker's.
    hub.register(Registration::new(WorkerId(1))).unwrap();
    assert_eq!(hub.routing().model_of(WorkerId(1)), "b");
    hub.remove_worker(WorkerId(1)).unwrap();
    assert_eq!(hub.routing().models(), vec![("a".to_owned(), false)]);

    drop(hub);
    runtime.join().unwrap();
}

#[test]
fn without_named_models_every_request_routes_in_the_one_pool() {
    let (hub, runtime) = common::hub(2);
    hub.register(Registration::new(WorkerId(5))).unwrap();
    let prompt: Vec<u32> = (0..32).collect();
    let now = Instant::now();
    for (i, model) in [None, Some("whatever"), Some("")].into_iter().enumerate() {
        let r = hub
            .route(model, &call(&prompt, &i.to_string()), now)
            .unwrap();
        assert_eq!(r.decision.worker, key(5));
    }
    assert!(hub.routing().models().is_empty());
    drop(hub);
    runtime.join().unwrap();
}
