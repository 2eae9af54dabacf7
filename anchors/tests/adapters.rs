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
    let plan = small(kind);
    let prepared = Prepared::new(&plan, [name]);
    let report = anchor::run(
        &mut || build(name, 2, &prepared),
        &plan,
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

#[test]
fn unknown_anchors_are_refused() {
    let plan = small(WorkloadKind::DynamoW1);
    let prepared = Prepared::new(&plan, ANCHORS.iter().copied());
    assert!(build("dynamo-nothing", 2, &prepared).is_err());
}
