//! The exported workload format (`lab::workload::export`) on scaled-down anchors: what is
//! imported equals what was generated, event for event and query for query; the answers
//! in the files are what an exact index gives; the anchor harness passes its checks on an
//! imported plan; damaged files are errors.

use engine::event::KvEvent;
use engine::kv_index::KvIndex;
use engine::{Matches, WorkerKey};
use lab::anchor::{self, AnchorOptions};
use lab::driver::kv_index::KvIndexUnderTest;
use lab::workload::anchor::{AnchorPlan, AnchorSpec, Expected};
use lab::workload::export::{export, import};
use lab::workload::{Phase, WorkloadKind};
use std::path::PathBuf;

/// A fresh directory under the temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvengine-export-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small(kind: WorkloadKind) -> AnchorSpec {
    let spec = AnchorSpec::of(kind).unwrap();
    AnchorSpec {
        size: spec.depth * spec.workers as usize * 2,
        queries: 150,
        ..spec
    }
}

fn events(p: &Phase) -> Vec<&(WorkerKey, KvEvent)> {
    p.iter().collect()
}

fn sorted(m: &Matches) -> Expected {
    let mut v = m.overlaps.clone();
    v.sort_unstable_by_key(|p| p.0);
    v
}

#[test]
fn an_exported_workload_imports_as_generated() {
    for kind in [
        WorkloadKind::DynamoW1,
        WorkloadKind::DynamoW2,
        WorkloadKind::DynamoW3,
        WorkloadKind::DynamoW4,
    ] {
        let plan = AnchorPlan::generate(&small(kind)).unwrap();
        let dir = TempDir::new(kind.name());
        let bytes = export(&plan, &dir.0).unwrap();
        assert!(bytes > 0);
        let back = import(&dir.0).unwrap();
        assert_eq!(back.spec, plan.spec, "{}", kind.name());
        assert_eq!(back.shape, plan.shape);
        for (a, b) in [
            (&back.base, &plan.base),
            (&back.extra, &plan.extra),
            (&back.remove, &plan.remove),
        ] {
            assert_eq!(events(a), events(b));
            assert_eq!(
                (a.events, a.stored_blocks, a.removed_blocks),
                (b.events, b.stored_blocks, b.removed_blocks)
            );
        }
        assert_eq!(back.hit_queries, plan.hit_queries);
        assert_eq!(back.prefix_queries, plan.prefix_queries);
        assert_eq!(back.hit_tokens, plan.hit_tokens);
        assert_eq!(back.prefix_tokens, plan.prefix_tokens);
        // Every query expects what the generator's own rule says.
        for (i, &k) in plan.hit_sequences.iter().enumerate() {
            assert_eq!(back.answer(back.hit_answers[i]), plan.expected_hit(k));
        }
        for (i, &g) in plan.prefix_groups.iter().enumerate() {
            assert_eq!(back.answer(back.prefix_answers[i]), plan.expected_prefix(g));
        }
        assert!(back.hit_sequences.is_empty() && back.holders.is_empty());
    }
}

/// The files' answers are an exact index's: the base events replayed into `KvIndex`, every
/// query chained from its tokens hashes (as the format says) gets exactly its answer.
#[test]
fn the_files_answers_are_what_an_exact_index_gives() {
    let plan = AnchorPlan::generate(&small(WorkloadKind::DynamoW1)).unwrap();
    let dir = TempDir::new("exact");
    export(&plan, &dir.0).unwrap();
    let back = import(&dir.0).unwrap();
    let mut ix = KvIndex::new();
    for (key, ev) in back.base.iter() {
        ix.apply(*key, ev).unwrap();
    }
    let lists = [
        (&back.hit_queries, &back.hit_answers),
        (&back.prefix_queries, &back.prefix_answers),
    ];
    for (queries, answers) in lists {
        for (q, &a) in queries.iter().zip(answers.iter()) {
            assert_eq!(sorted(&ix.find_matches(q)), back.answer(a));
        }
    }
}

#[test]
fn the_harness_passes_its_checks_on_an_imported_plan() {
    let plan = AnchorPlan::generate(&small(WorkloadKind::DynamoW4)).unwrap();
    let dir = TempDir::new("harness");
    export(&plan, &dir.0).unwrap();
    let back = import(&dir.0).unwrap();
    let opts = AnchorOptions::default();
    let report = anchor::run(&mut || Ok(Box::new(KvIndexUnderTest::new())), &back, &opts).unwrap();
    assert!(report.checks_passed, "{:?}", report.problems);
    assert_eq!(report.workload, WorkloadKind::DynamoW4);
}

/// What a test does to a file's bytes.
type Damage = fn(&mut Vec<u8>);

/// Damage to any file is an error naming it, never a panic or a wrong plan.
#[test]
fn damaged_files_are_errors() {
    let plan = AnchorPlan::generate(&small(WorkloadKind::DynamoW1)).unwrap();
    let dir = TempDir::new("damaged");
    export(&plan, &dir.0).unwrap();
    let cases: [(&str, Damage); 5] = [
        ("base.events", |b| b.truncate(b.len() - 3)),
        ("remove.events", |b| b.push(0)),
        ("hit.queries", |b| b[0] = b'X'),
        ("answers.bin", |b| b.truncate(20)),
        ("manifest.json", |b| {
            let s = String::from_utf8_lossy(b).replace("\"version\": 1", "\"version\": 2");
            *b = s.into_bytes();
        }),
    ];
    for (file, damage) in cases {
        let path = dir.0.join(file);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        damage(&mut bad);
        std::fs::write(&path, &bad).unwrap();
        let err = import(&dir.0).map(|_| ()).unwrap_err();
        assert!(format!("{err:#}").contains(file), "{file}: {err:#}");
        std::fs::write(&path, &good).unwrap();
    }
    assert!(import(&dir.0).is_ok(), "restored");
}

/// A small Mooncake trace, generated here: 60 requests over 8 prompt families, so
/// prefixes repeat and bounded caches evict.
fn small_trace() -> String {
    (0..60u64)
        .map(|i| {
            let family = i % 8;
            let ids: Vec<String> = (0..2 + i % 5)
                .map(|j| (family * 100 + j * (1 + (j > 2) as u64 * i)).to_string())
                .collect();
            format!(
                "{{\"timestamp\": {}, \"input_length\": 2000, \"output_length\": 4, \"hash_ids\": [{}]}}\n",
                i * 10,
                ids.join(", ")
            )
        })
        .collect()
}

/// The trace replay as an anchor plan (`lab::workload::trace_anchor`): its engine hashes
/// are renamed to seq_hashes consistently (the exact index refuses nothing and ends
/// empty), its answers are the exact index's, it round-trips through the files, and the
/// harness passes its checks on it.
#[test]
fn the_trace_replay_becomes_an_anchor_plan_that_round_trips() {
    use lab::workload::{TraceAssign, TraceSpec, WorkloadSpec};
    let dir = TempDir::new("trace");
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("trace.jsonl");
    std::fs::write(&path, small_trace()).unwrap();
    let spec = WorkloadSpec {
        kind: WorkloadKind::Trace,
        workers: 3,
        queries: 50,
        trace: Some(TraceSpec {
            path,
            assign: TraceAssign::RoundRobin,
            capacity: Some(200),
        }),
        ..WorkloadSpec::default()
    };
    let plan = lab::workload::trace_anchor::anchor_plan(&spec).unwrap();
    assert!(
        plan.base.removed_blocks > 0,
        "bounded caches evict during base"
    );
    assert!(!plan.hit_queries.is_empty() && plan.prefix_queries.len() == 50);
    // Renamed consistently: every event applies, the index ends empty, the engine hash of
    // every stored block is its seq_hash.
    let mut ix = KvIndex::new();
    for phase in [&plan.base, &plan.extra, &plan.remove] {
        for (key, ev) in phase.iter() {
            ix.apply(*key, ev).unwrap();
        }
    }
    assert_eq!(ix.stats().index.entries, 0);
    assert_eq!(ix.rejects().total(), 0);
    let mut ix = KvIndex::new();
    for (key, ev) in plan.base.iter() {
        ix.apply(*key, ev).unwrap();
    }
    assert_eq!(ix.stats().index.entries, plan.shape.entries_after_base);
    for (q, &a) in plan.hit_queries.iter().zip(&plan.hit_answers) {
        let want = plan.answer(a);
        assert_eq!(sorted(&ix.find_matches(q)), want);
        assert!(!want.is_empty(), "a hit query is held by someone");
    }
    for (q, t) in plan.prefix_queries.iter().zip(&plan.prefix_tokens) {
        assert_eq!(q.len(), t.len());
    }
    let out = TempDir::new("trace-out");
    export(&plan, &out.0).unwrap();
    let back = import(&out.0).unwrap();
    assert_eq!(back.spec.kind, WorkloadKind::Trace);
    assert_eq!(events(&back.base), events(&plan.base));
    assert_eq!(back.hit_queries, plan.hit_queries);
    assert_eq!(back.prefix_queries, plan.prefix_queries);
    let report = anchor::run(
        &mut || Ok(Box::new(KvIndexUnderTest::new())),
        &back,
        &AnchorOptions::default(),
    )
    .unwrap();
    assert!(report.checks_passed, "{:?}", report.problems);
}
