//! The indexer harness end to end on tiny workloads: generation invariants, trace loading,
//! both single-threaded indexers agreeing, and the JSON report's keys.

use engine::event::KvEvent;
use engine::kv_index::KvIndex;
use engine::sharding::choice::Sharding;
use engine::{EngineHash, WorkerKey};
use lab::driver::kv_index::KvIndexUnderTest;
use lab::driver::sharded::ShardedUnderTest;
use lab::driver::{IndexerUnderTest, MixedPlan};
use lab::harness::{RunOptions, run};
use lab::workload::{Plan, TraceAssign, TraceSpec, WorkloadKind, WorkloadSpec, trace::parse_trace};
use std::collections::HashMap;
use std::time::Duration;

fn tiny(kind: WorkloadKind) -> WorkloadSpec {
    WorkloadSpec {
        kind,
        size: 4_000,
        depth: 16,
        workers: 6,
        prefix_groups: 4,
        queries: 200,
        ..WorkloadSpec::default()
    }
}

/// Applies every phase in order to a fresh `KvIndex`, checking entries after build.
fn replay_on_kv_index(plan: &Plan) -> KvIndex {
    let mut ix = KvIndex::new();
    for (i, phase) in plan.phases_in_order().enumerate() {
        for (key, ev) in phase.iter() {
            let applied = ix.apply(*key, ev).expect("no event is refused");
            assert_eq!(applied.unknown, 0, "removal of an unheld block");
        }
        if i == 0 {
            assert_eq!(ix.stats().index.entries, plan.shape.entries_after_build);
        }
    }
    ix
}

#[test]
fn synthetic_entry_counts_prefix_once_and_removes_undo_stores() {
    for kind in [
        WorkloadKind::Uniform,
        WorkloadKind::Dynamo,
        WorkloadKind::SharedPrefix,
    ] {
        for producers in [1, 3] {
            let spec = WorkloadSpec {
                producers,
                ..tiny(kind)
            };
            let plan = Plan::generate(&spec).unwrap();
            let s = &plan.spec;
            let seqs = (s.size / s.depth) as u64;
            let p = s.prefix_blocks() as u64;
            let t = s.depth as u64 - p;
            // The sequences describe `size` (worker, block) pairs, rounded down to depth.
            assert_eq!(seqs * s.depth as u64, (s.size - s.size % s.depth) as u64);
            // Live entries: every tail, plus each (worker, group) prompt once.
            let pairs: std::collections::HashSet<(u64, u64)> = (0..seqs)
                .map(|k| (k % s.workers, k % s.prefix_groups))
                .collect();
            let want = seqs * t + if p > 0 { pairs.len() as u64 * p } else { 0 };
            assert_eq!(plan.shape.entries_after_build, want, "{kind:?}");
            assert_eq!(plan.build.stored_blocks, want);
            assert!(want <= s.size as u64);

            // Each worker stores each prompt exactly once over the whole run (and removes
            // it exactly once).
            let mut roots: HashMap<(WorkerKey, EngineHash), (u32, u32)> = HashMap::new();
            let prompt_heads: std::collections::HashSet<EngineHash> = plan
                .phases_in_order()
                .flat_map(|ph| ph.iter())
                .filter_map(|(_, ev)| match ev {
                    KvEvent::Stored {
                        parent: None,
                        blocks,
                    } if p > 0 => blocks.first().map(|b| b.engine_hash),
                    _ => None,
                })
                .collect();
            for (key, ev) in plan.phases_in_order().flat_map(|ph| ph.iter()) {
                match ev {
                    KvEvent::Stored {
                        parent: None,
                        blocks,
                    } if p > 0 => {
                        assert_eq!(blocks.len() as u64, p, "a prompt store is the prompt");
                        roots.entry((*key, blocks[0].engine_hash)).or_default().0 += 1;
                    }
                    KvEvent::Removed { blocks } => {
                        if let Some(h) = blocks.first().filter(|h| prompt_heads.contains(h)) {
                            roots.entry((*key, *h)).or_default().1 += 1;
                        }
                    }
                    _ => {}
                }
            }
            assert!(roots.values().all(|&c| c == (1, 1)), "{kind:?}: {roots:?}");
            if p > 0 {
                assert!(roots.len() >= pairs.len());
            }

            // Streams never share a worker (producer = worker mod producers).
            for ph in plan.phases_in_order() {
                assert_eq!(ph.streams.len(), producers);
                for (i, st) in ph.streams.iter().enumerate() {
                    assert!(st.iter().all(|(k, _)| k.worker.0 as usize % producers == i));
                }
            }

            let ix = replay_on_kv_index(&plan);
            assert_eq!(ix.stats().index.entries, 0, "{kind:?}");
            assert_eq!(ix.rejects().total(), 0);
        }
    }
}

#[test]
fn events_round_robin_across_workers() {
    let plan = Plan::generate(&tiny(WorkloadKind::Uniform)).unwrap();
    let workers: Vec<u64> = plan
        .build
        .iter()
        .map(|(k, _)| k.worker.0)
        .take(12)
        .collect();
    assert_eq!(workers, vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]);
}

#[test]
fn the_same_seed_gives_the_same_plan() {
    let a = Plan::generate(&tiny(WorkloadKind::Dynamo)).unwrap();
    let b = Plan::generate(&tiny(WorkloadKind::Dynamo)).unwrap();
    let c = Plan::generate(&WorkloadSpec {
        seed: 7,
        ..tiny(WorkloadKind::Dynamo)
    })
    .unwrap();
    let events = |p: &Plan| -> Vec<(WorkerKey, KvEvent)> {
        p.phases_in_order()
            .flat_map(|ph| ph.iter().cloned())
            .collect()
    };
    assert_eq!(events(&a), events(&b));
    assert_ne!(events(&a), events(&c));
    assert_eq!(a.hit_queries[0].seqs, b.hit_queries[0].seqs);
}

#[test]
fn absurd_inputs_are_errors_not_panics() {
    let bad = [
        WorkloadSpec {
            size: usize::MAX,
            ..tiny(WorkloadKind::Dynamo)
        },
        WorkloadSpec {
            workers: 0,
            ..tiny(WorkloadKind::Dynamo)
        },
        WorkloadSpec {
            block_size: 0,
            ..tiny(WorkloadKind::Dynamo)
        },
        WorkloadSpec {
            producers: 0,
            ..tiny(WorkloadKind::Dynamo)
        },
        WorkloadSpec {
            prefix_ratio: f64::NAN,
            ..tiny(WorkloadKind::Dynamo)
        },
        WorkloadSpec {
            prefix_groups: 0,
            ..tiny(WorkloadKind::Dynamo)
        },
    ];
    for spec in bad {
        assert!(Plan::generate(&spec).is_err(), "{spec:?}");
    }
    assert!(Sharding::configured(0, Some(4), 8).is_err());
    assert!(Sharding::adaptive(0).is_err());
}

const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [0, 1]}
{"timestamp": 40, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}
{"timestamp": 41, "input_length": 512, "output_length": 3, "hash_ids": [5]}
{"timestamp": 42, "input_length": 700, "output_length": 3, "hash_ids": [0, 7]}
{"timestamp": 43, "input_length": 900, "output_length": 3, "hash_ids": [5, 6]}
{"timestamp": 44, "input_length": 900, "output_length": 3, "hash_ids": [0, 1, 2, 3]}
{"timestamp": 45, "input_length": 900, "output_length": 3, "hash_ids": [9, 1]}
{"timestamp": 46, "input_length": 900, "output_length": 3, "hash_ids": [0, 1, 4]}
{"timestamp": 47, "input_length": 900, "output_length": 3, "hash_ids": [5, 6, 8]}"#;

fn trace_spec(path: std::path::PathBuf, assign: TraceAssign) -> WorkloadSpec {
    WorkloadSpec {
        kind: WorkloadKind::Trace,
        workers: 3,
        queries: 100,
        producers: 2,
        trace: Some(TraceSpec {
            path,
            assign,
            capacity: Some(100),
        }),
        ..WorkloadSpec::default()
    }
}

#[test]
fn trace_loads_from_a_file_and_replays_with_real_evictions() {
    assert_eq!(parse_trace(TRACE).unwrap().len(), 9);
    let path = std::env::temp_dir().join(format!("kvengine-trace-{}.jsonl", std::process::id()));
    std::fs::write(&path, TRACE).unwrap();
    for assign in [TraceAssign::RoundRobin, TraceAssign::FirstId] {
        let plan = Plan::generate(&trace_spec(path.clone(), assign)).unwrap();
        assert_eq!(plan.shape.trace_requests, Some(9));
        let removed: u64 = plan
            .phases_in_order()
            .take(3)
            .map(|p| p.removed_blocks)
            .sum();
        assert!(removed > 0, "{assign:?}: bounded caches must evict");
        let ix = replay_on_kv_index(&plan);
        assert_eq!(ix.stats().index.entries, 0);
        assert_eq!(ix.rejects().total(), 0);
    }
    std::fs::remove_file(&path).ok();
    let missing = trace_spec("/nonexistent/trace.jsonl".into(), TraceAssign::RoundRobin);
    assert!(Plan::generate(&missing).is_err());
}

/// Both single-threaded indexers give identical answers on every query of the plan,
/// after build and after the store and mixed phases.
#[test]
fn kv_index_and_sharded_index_agree() {
    for kind in [WorkloadKind::Dynamo, WorkloadKind::SharedPrefix] {
        let plan = Plan::generate(&tiny(kind)).unwrap();
        let mut a = KvIndexUnderTest::new();
        let mut b = ShardedUnderTest::new(Sharding::configured(3, Some(2), 8).unwrap());
        let queries: Vec<_> = plan
            .hit_queries
            .iter()
            .chain(&plan.prefix_queries)
            .map(|q| q.seqs.clone())
            .chain(plan.mixed_queries.iter().flatten().cloned())
            .collect();
        let compare = |a: &mut KvIndexUnderTest, b: &mut ShardedUnderTest| {
            for q in &queries {
                assert_eq!(a.query(q).unwrap(), b.query(q).unwrap());
            }
            assert_eq!(
                a.stats().unwrap().live_entries,
                b.stats().unwrap().live_entries
            );
        };
        a.apply_all(&plan.build.streams).unwrap();
        b.apply_all(&plan.build.streams).unwrap();
        compare(&mut a, &mut b);
        for q in &plan.hit_queries {
            assert_eq!(a.query(&q.seqs).unwrap().best(), q.expect_best);
        }
        a.apply_all(&plan.store.streams).unwrap();
        b.apply_all(&plan.store.streams).unwrap();
        compare(&mut a, &mut b);
        let mp = MixedPlan::default();
        let oa = a
            .mixed(&plan.mixed.out.streams, &plan.mixed_queries, &mp)
            .unwrap();
        let ob = b
            .mixed(&plan.mixed.out.streams, &plan.mixed_queries, &mp)
            .unwrap();
        assert_eq!(oa.latencies_ns.len(), ob.latencies_ns.len());
        assert!(!oa.latencies_ns.is_empty());
        compare(&mut a, &mut b);
        assert_eq!(
            a.stats().unwrap().anomalies + b.stats().unwrap().anomalies,
            0
        );
        assert_eq!(b.stats().unwrap().shard_ops.len(), 3);
    }
}

#[test]
fn harness_runs_both_indexers_and_checks_itself() {
    let plan = Plan::generate(&WorkloadSpec {
        producers: 2,
        query_threads: 2,
        ..tiny(WorkloadKind::SharedPrefix)
    })
    .unwrap();
    let opts = RunOptions {
        duration: Duration::from_millis(20),
        ..RunOptions::default()
    };
    let ixs: Vec<Box<dyn IndexerUnderTest>> = vec![
        Box::new(KvIndexUnderTest::new()),
        Box::new(ShardedUnderTest::new(
            Sharding::configured(2, Some(4), 8).unwrap(),
        )),
    ];
    for mut ix in ixs {
        let r = run(ix.as_mut(), &plan, &opts).unwrap();
        assert!(r.checks.problems().is_empty(), "{:?}", r.checks.problems());
        assert_eq!(r.phases.mixed.rounds % 2, 0, "mixed rounds run in pairs");
        assert_eq!(r.live_block_entries, plan.shape.entries_after_build);
        assert_eq!(r.query_source, "mixed");
        assert!(r.shard_balance >= 1.0 && r.shard_balance <= r.cores as f64);
        assert_eq!(r.phases.hit.mean_best_overlap, plan.spec.depth as f64);
        assert_eq!(
            r.phases.prefix_only.mean_best_overlap,
            plan.spec.prefix_blocks() as f64
        );
        // Running again on a non-empty indexer is refused.
        ix.apply_all(&plan.build.streams).unwrap();
        assert!(run(ix.as_mut(), &plan, &opts).is_err());
    }
}

#[test]
fn json_report_has_every_key() {
    let plan = Plan::generate(&tiny(WorkloadKind::Dynamo)).unwrap();
    let r = run(
        &mut ShardedUnderTest::new(Sharding::configured(2, Some(4), 8).unwrap()),
        &plan,
        &RunOptions::default(),
    )
    .unwrap();
    let v = serde_json::to_value(&r).unwrap();
    for key in [
        "workload",
        "cores",
        "workers",
        "store_blocks_per_s",
        "remove_blocks_per_s",
        "block_ops_per_s",
        "queries_per_s",
        "query_p50_us",
        "query_p99_us",
        "query_p999_us",
        "live_block_entries",
        "bytes_per_block_entry",
        "shard_balance",
        "size",
        "depth",
        "block_size",
        "prefix_ratio",
        "prefix_groups",
        "seed",
        "phases",
        "checks",
        "machine",
        "date",
        "version",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["workload"], "dynamo");
    assert_eq!(v["cores"], 2);
    for phase in ["build", "hit", "prefix_only", "store", "mixed", "remove"] {
        assert!(v["phases"].get(phase).is_some(), "missing phase {phase}");
    }
    assert!(v["machine"]["nproc"].as_u64().unwrap() >= 1);
    assert!(v["store_blocks_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["query_p99_us"].as_f64().unwrap() > 0.0);
    let path = std::env::temp_dir().join(format!("kvengine-report-{}.json", std::process::id()));
    lab::write_json(&r, &path).unwrap();
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let keys =
        |j: &serde_json::Value| -> Vec<String> { j.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(keys(&back), keys(&v));
    assert_eq!(back["live_block_entries"], v["live_block_entries"]);
    std::fs::remove_file(&path).ok();
}
