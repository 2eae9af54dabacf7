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
