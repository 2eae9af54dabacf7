//! Every adapter through the anchor harness on a small W1-like plan: its answers and entry
//! counts must pass the harness's own checks, as kvengine's do.

use anchors::{ANCHORS, Prepared, build};
use lab::anchor::{self, AnchorOptions};
use lab::workload::WorkloadKind;
use lab::workload::anchor::{AnchorPlan, AnchorSpec};

fn small(kind: WorkloadKind) -> AnchorPlan {
    let mut spec = AnchorSpec::of(kind).expect("an anchor workload");
    spec.workers = 6;
    spec.depth = 32;
    spec.size = 6 * 32 * 20;
    spec.queries = 300;
    spec.validate().expect("a valid small spec");
    AnchorPlan::generate(&spec).expect("the plan")
}

fn passes(name: &str, kind: WorkloadKind) {
    passes_on(name, &small(kind));
}

fn passes_on(name: &str, plan: &AnchorPlan) {
    let kind = plan.spec.kind;
    let prepared = Prepared::new(plan, [name]);
    let report = anchor::run(
        &mut || build(name, 2, &prepared),
        plan,
        &AnchorOptions {
            repeat: 2,
            ..AnchorOptions::default()
        },
    )
    .expect("the harness runs");
    assert!(
        report.checks_passed,
        "{name} on {}: {:?}",
        kind.name(),
        report.problems
    );
    let checks = &report.runs[0].checks;
    assert_eq!(checks.entries_after_base, plan.shape.entries_after_base);
    assert_eq!(checks.final_live_entries, 0);
}

#[test]
fn every_anchor_passes_the_harness_checks_on_w1() {
    for name in ANCHORS {
        passes(name, WorkloadKind::DynamoW1);
    }
}

#[test]
fn every_anchor_passes_the_harness_checks_on_w4() {
    for name in ANCHORS {
        passes(name, WorkloadKind::DynamoW4);
    }
}

/// The anchors time and pass their checks on a workload read back from the neutral file
/// format (`kvengine bench indexer --export` / `--import`), W2 here.
#[test]
fn every_anchor_passes_the_harness_checks_on_an_imported_workload() {
    let dir = std::env::temp_dir().join(format!("kvengine-anchors-import-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    lab::workload::export::export(&small(WorkloadKind::DynamoW2), &dir).expect("exported");
    let plan = lab::workload::export::import(&dir).expect("imported");
    assert!(
        plan.hit_sequences.is_empty(),
        "the files' answers, not the generator's"
    );
    for name in ANCHORS {
        passes_on(name, &plan);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_anchors_are_refused() {
    let plan = small(WorkloadKind::DynamoW1);
    let prepared = Prepared::new(&plan, ANCHORS.iter().copied());
    assert!(build("dynamo-nothing", 2, &prepared).is_err());
}
