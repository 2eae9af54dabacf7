//! The anchor-exact workloads (`dynamo-w1` .. `dynamo-w4`) on scaled-down sizes:
//! generation against an independent recomputation of the issue's definition, a replay
//! into `KvIndex` with no harness, the harness's self-checks and JSON on the
//! single-threaded drivers (and the runtime), a broken indexer caught by them, and the
//! flags.

use anyhow::Result;
use clap::Parser;
use engine::event::{KvEvent, StoredBlock};
use engine::kv_index::KvIndex;
use engine::sharding::choice::Sharding;
use engine::{EngineHash, Matches, SeqHash, TokensHash, WorkerKey};
use lab::anchor::report::Figures;
use lab::anchor::{self, AnchorOptions};
use lab::args::IndexerArgs;
use lab::driver::kv_index::KvIndexUnderTest;
use lab::driver::runtime::RuntimeUnderTest;
use lab::driver::sharded::ShardedUnderTest;
use lab::driver::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
};
use lab::workload::anchor::{AnchorPlan, AnchorSpec};
use lab::workload::{EventStream, Query, WorkloadKind};
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

const KINDS: [WorkloadKind; 4] = [
    WorkloadKind::DynamoW1,
    WorkloadKind::DynamoW2,
    WorkloadKind::DynamoW3,
    WorkloadKind::DynamoW4,
];

/// The anchor scaled to two base sequences per worker (W stays).
fn small(kind: WorkloadKind, queries: usize) -> AnchorSpec {
    let spec = AnchorSpec::of(kind).unwrap();
    AnchorSpec {
        size: spec.depth * spec.workers as usize * 2,
        queries,
        ..spec
    }
}

/// splitmix64, written out again from its definition.
struct SplitMix(u64);

impl SplitMix {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((u128::from(z) * u128::from(n)) >> 64) as u64
    }
}

/// The issue's hashes: xxh3(id LE, 1337), chained as DESIGN.md's seq_hash.
fn th(id: u64) -> u64 {
    xxh3_64_with_seed(&id.to_le_bytes(), 1337)
}

fn chained(parent: Option<u64>, ids: impl Iterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut prev = parent;
    ids.map(|id| {
        let t = th(id);
        let s = match prev {
            None => t,
            Some(p) => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&p.to_le_bytes());
                b[8..].copy_from_slice(&t.to_le_bytes());
                xxh3_64_with_seed(&b, 1337)
            }
        };
        prev = Some(s);
        (t, s)
    })
    .collect()
}

fn stored(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
    pairs
        .iter()
        .map(|&(t, s)| StoredBlock {
            engine_hash: EngineHash(s),
            tokens_hash: TokensHash(t),
        })
        .collect()
}

/// Everything the definition fixes, recomputed without the generator.
struct Expected {
    groups: Vec<u64>,
    prefix: Vec<Vec<(u64, u64)>>,
    tails: Vec<Vec<(u64, u64)>>,
    base: Vec<(WorkerKey, KvEvent)>,
    extra: Vec<(WorkerKey, KvEvent)>,
    remove: Vec<(WorkerKey, KvEvent)>,
    base_pairs: u64,
    hit_sequences: Vec<u64>,
    prefix_picks: Vec<u64>,
}

fn recompute(spec: &AnchorSpec) -> Expected {
    let (w, d, g) = (spec.workers, spec.depth as u64, spec.groups);
    let n = spec.size as u64 / d;
    let e = n / 4;
    let p = (d as f64 * spec.prefix_ratio).round() as u64;
    let t = d - p;
    let mut rng = SplitMix(42);
    let groups: Vec<u64> = (0..n + e).map(|_| rng.below(g)).collect();
    let hit_sequences = (0..spec.queries).map(|_| rng.below(n)).collect();
    let prefix_picks = (0..spec.queries).map(|_| rng.below(n)).collect();
    let prefix: Vec<Vec<(u64, u64)>> = (0..g)
        .map(|grp| chained(None, (0..p).map(|i| 0xD00D_0000_0000_0000 | grp << 32 | i)))
        .collect();
    let (mut base, mut extra, mut remove) = (Vec::new(), Vec::new(), Vec::new());
    let mut tails = Vec::new();
    let mut first: Vec<(WorkerKey, u64)> = Vec::new();
    let mut base_pairs = 0;
    for k in 0..n + e {
        let grp = groups[k as usize];
        let key = WorkerKey::new(k % w, 0);
        let pre = &prefix[grp as usize];
        let last = pre.last().unwrap().1;
        let tail = chained(Some(last), (0..t).map(|j| 1 + k * t + j));
        let ev = if first.contains(&(key, grp)) {
            KvEvent::Stored {
                parent: Some(EngineHash(last)),
                blocks: stored(&tail),
            }
        } else {
            first.push((key, grp));
            base_pairs += u64::from(k < n);
            let mut all = pre.clone();
            all.extend_from_slice(&tail);
            KvEvent::Stored {
                parent: None,
                blocks: stored(&all),
            }
        };
        if k < n { &mut base } else { &mut extra }.push((key, ev));
        remove.push((
            key,
            KvEvent::Removed {
                blocks: tail.iter().map(|&(_, s)| EngineHash(s)).collect(),
            },
        ));
        tails.push(tail);
    }
    for &(key, grp) in &first {
        let blocks = prefix[grp as usize]
            .iter()
            .map(|&(_, s)| EngineHash(s))
            .collect();
        remove.push((key, KvEvent::Removed { blocks }));
    }
    Expected {
        groups,
        prefix,
        tails,
        base,
        extra,
        remove,
        base_pairs,
        hit_sequences,
        prefix_picks,
    }
}

fn events(stream: &[EventStream]) -> Vec<(WorkerKey, KvEvent)> {
    assert_eq!(stream.len(), 1, "the anchor has one producer stream");
    stream[0].to_vec()
}

#[test]
fn defaults_are_exactly_the_issues() {
    let of = |k| AnchorSpec::of(k).unwrap();
    let w1 = of(WorkloadKind::DynamoW1);
    assert_eq!(
        (w1.workers, w1.depth, w1.size, w1.prefix_ratio, w1.groups),
        (128, 128, 1_048_576, 0.25, 4)
    );
    assert_eq!((w1.seed, w1.queries), (42, 20_000));
    assert_eq!(
        of(WorkloadKind::DynamoW2),
        AnchorSpec {
            kind: WorkloadKind::DynamoW2,
            groups: 1,
            ..w1.clone()
        }
    );
    let w3 = of(WorkloadKind::DynamoW3);
    assert_eq!(
        (w3.workers, w3.depth, w3.size, w3.prefix_ratio, w3.groups),
        (64, 512, 2_097_152, 0.25, 4)
    );
    let w4 = of(WorkloadKind::DynamoW4);
    assert_eq!(
        (w4.prefix_ratio, w4.groups, w4.size, w4.workers),
        (0.75, 1, 1 << 20, 128)
    );
    assert_eq!(
        (
            w1.base_sequences(),
            w1.extra_sequences(),
            w1.prefix_blocks()
        ),
        (8192, 2048, 32)
    );
    assert_eq!(w3.prefix_blocks(), 128);
    assert_eq!(w4.prefix_blocks(), 96);
    assert!(AnchorSpec::of(WorkloadKind::Dynamo).is_none());
}

#[test]
fn generation_matches_an_independent_recomputation() {
    for kind in [WorkloadKind::DynamoW1, WorkloadKind::DynamoW4] {
        let spec = small(kind, 300);
        let plan = AnchorPlan::generate(&spec).unwrap();
        let x = recompute(&spec);
        let (n, e) = (x.base.len() as u64, x.extra.len() as u64);
        let (p, t) = (x.prefix[0].len() as u64, x.tails[0].len() as u64);
        assert_eq!(
            (n, e, p),
            (
                256,
                64,
                if kind == WorkloadKind::DynamoW4 {
                    96
                } else {
                    32
                }
            )
        );

        // Group draws for seed 42, prefix ids and hashes.
        assert_eq!(plan.groups, x.groups, "{kind:?}: group draws");
        let drawn: BTreeSet<u64> = x.groups.iter().copied().collect();
        assert_eq!(drawn.len() as u64, spec.groups, "every group is drawn");
        // Every event: full store on a worker's first sequence of a group, tail-only with
        // the prefix's last block as parent afterwards; tails per sequence, then prefixes.
        assert_eq!(events(&plan.base.streams), x.base, "{kind:?}: base events");
        assert_eq!(
            events(&plan.extra.streams),
            x.extra,
            "{kind:?}: extra events"
        );
        assert_eq!(
            events(&plan.remove.streams),
            x.remove,
            "{kind:?}: remove events"
        );
        for (k, (key, ev)) in x.base.iter().chain(&x.extra).enumerate() {
            assert_eq!(*key, plan.owner(k as u64));
            let KvEvent::Stored { parent, blocks } = ev else {
                panic!("{ev:?}")
            };
            match parent {
                None => {
                    assert_eq!(blocks.len() as u64, p + t);
                    let g = x.groups[k];
                    assert_eq!(blocks[0].tokens_hash.0, th(0xD00D_0000_0000_0000 | g << 32));
                }
                Some(h) => {
                    assert_eq!(blocks.len() as u64, t);
                    assert_eq!(h.0, x.prefix[x.groups[k] as usize].last().unwrap().1);
                    assert_eq!(blocks[0].tokens_hash.0, th(1 + k as u64 * t));
                }
            }
        }

        // Event and block counts per phase, and live entries after phase 1.
        let all_pairs = x.remove.len() as u64 - n - e;
        assert_eq!((plan.base.events, plan.extra.events), (n, e));
        assert_eq!(plan.remove.events, n + e + all_pairs);
        assert_eq!(plan.base.stored_blocks, n * t + x.base_pairs * p);
        assert_eq!(
            plan.extra.stored_blocks,
            e * t + (all_pairs - x.base_pairs) * p
        );
        assert_eq!(plan.remove.removed_blocks, (n + e) * t + all_pairs * p);
        assert_eq!(plan.shape.entries_after_base, n * t + x.base_pairs * p);
        assert_eq!(
            (plan.shape.base_pairs, plan.shape.all_pairs),
            (x.base_pairs, all_pairs)
        );

        // Queries: full-depth base sequences; prefix plus fresh blocks nobody holds.
        assert_eq!(plan.hit_sequences, x.hit_sequences);
        for (q, &k) in plan.hit_queries.iter().zip(&x.hit_sequences) {
            let want: Vec<u64> = x.prefix[x.groups[k as usize] as usize]
                .iter()
                .chain(&x.tails[k as usize])
                .map(|&(_, s)| s)
                .collect();
            assert_eq!(q.iter().map(|s| s.0).collect::<Vec<_>>(), want);
        }
        let mut fresh = 1 + (n + e) * t;
        for (i, q) in plan.prefix_queries.iter().enumerate() {
            let g = x.groups[x.prefix_picks[i] as usize];
            assert_eq!(plan.prefix_groups[i], g);
            let pre = &x.prefix[g as usize];
            let more = chained(Some(pre.last().unwrap().1), fresh..fresh + t);
            fresh += t;
            let want: Vec<u64> = pre.iter().chain(&more).map(|&(_, s)| s).collect();
            assert_eq!(q.iter().map(|s| s.0).collect::<Vec<_>>(), want);
        }

        // Deterministic.
        let again = AnchorPlan::generate(&spec).unwrap();
        assert_eq!(events(&again.base.streams), x.base);
        assert_eq!(again.prefix_queries, plan.prefix_queries);
    }
}

fn sorted(m: &Matches) -> Vec<(WorkerKey, u32)> {
    let mut v = m.overlaps.clone();
    v.sort_unstable();
    v
}

#[test]
fn every_phase_replays_into_kv_index_and_leaves_it_empty() {
    for kind in KINDS {
        let spec = small(kind, 200);
        let plan = AnchorPlan::generate(&spec).unwrap();
        let mut ix = KvIndex::new();
        let apply = |ix: &mut KvIndex, phase: &[EventStream]| {
            for (key, ev) in events(phase) {
                let applied = ix.apply(key, &ev).expect("no event is refused");
                assert_eq!(applied.unknown, 0, "{kind:?}: removal of an unheld block");
            }
        };
        apply(&mut ix, &plan.base.streams);
        assert_eq!(ix.stats().index.entries, plan.shape.entries_after_base);

        // Holders of each group's prefix, from the draws alone.
        let (d, p) = (spec.depth as u32, spec.prefix_blocks() as u32);
        let n = spec.base_sequences() as u64;
        let holders = |g: u64| -> BTreeSet<WorkerKey> {
            (0..n)
                .filter(|&k| plan.groups[k as usize] == g)
                .map(|k| WorkerKey::new(k % spec.workers, 0))
                .collect()
        };
        for (q, &k) in plan.hit_queries.iter().zip(&plan.hit_sequences).take(50) {
            let owner = WorkerKey::new(k % spec.workers, 0);
            let want: Vec<(WorkerKey, u32)> = holders(plan.groups[k as usize])
                .into_iter()
                .map(|w| (w, if w == owner { d } else { p }))
                .collect();
            assert_eq!(sorted(&ix.find_matches(q)), want, "{kind:?}: hit {k}");
        }
        for (q, &g) in plan.prefix_queries.iter().zip(&plan.prefix_groups).take(50) {
            let want: Vec<(WorkerKey, u32)> = holders(g).into_iter().map(|w| (w, p)).collect();
            assert_eq!(sorted(&ix.find_matches(q)), want, "{kind:?}: prefix of {g}");
        }

        apply(&mut ix, &plan.extra.streams);
        apply(&mut ix, &plan.remove.streams);
        let st = ix.stats();
        assert_eq!((st.index.entries, st.directory_entries), (0, 0), "{kind:?}");
        assert_eq!(ix.rejects().total(), 0);
        assert!(
            plan.hit_queries
                .iter()
                .all(|q| ix.find_matches(q).overlaps.is_empty())
        );
    }
}

fn run_anchor(
    plan: &AnchorPlan,
    repeat: usize,
    mut make: impl FnMut() -> Result<Box<dyn IndexerUnderTest>>,
) -> serde_json::Value {
    // One warm-up run when there are two timed ones: its figures are reported apart.
    let opts = AnchorOptions {
        warmup: usize::from(repeat > 1),
        repeat,
        progress: false,
        release_memory: None,
    };
    let report = anchor::run(&mut make, plan, &opts).unwrap();
    assert!(report.checks_passed, "{:?}", report.problems);
    serde_json::to_value(&report).unwrap()
}

fn check_report(r: &serde_json::Value, plan: &AnchorPlan, repeat: usize) {
    // Resident-memory figures come from the first run in the process (the warm-up when
    // there is one); every other top-level figure is the timed runs' median.
    let first = r["warmup"]
        .as_array()
        .and_then(|w| w.first())
        .unwrap_or(&r["runs"][0]);
    let memory = [
        "bytes_per_block",
        "rss_before_bytes",
        "rss_built_bytes",
        "rss_after_remove_bytes",
        "residual_after_remove",
    ];
    for &key in Figures::KEYS {
        assert!(r[key].is_number(), "missing {key}");
        let range = r["range"][key].as_array().unwrap();
        let v: Vec<f64> = range.iter().map(|x| x.as_f64().unwrap()).collect();
        assert!(v.len() == 3 && v[0] <= v[1] && v[1] <= v[2], "{key}: {v:?}");
        let want = if memory.contains(&key) {
            first[key].as_f64().unwrap()
        } else {
            v[1]
        };
        assert_eq!(r[key].as_f64().unwrap(), want, "{key}");
    }
    assert_eq!(
        r["warmup"].as_array().unwrap().len() as u64,
        r["warmup_runs"].as_u64().unwrap()
    );
    for key in ["store_blocks_per_s", "hit_qps_1", "hit_qps_2", "hit_p50_us"] {
        assert!(r[key].as_f64().unwrap() > 0.0, "{key}");
    }
    for size in ["1MB", "4MB", "16MB", "128MB"] {
        assert!(r["mem_latency_ns"][size].as_f64().unwrap() > 0.0, "{size}");
    }
    let runs = r["runs"].as_array().unwrap();
    assert_eq!(runs.len(), repeat);
    for run in runs {
        for &key in Figures::KEYS {
            assert!(run[key].is_number(), "run: missing {key}");
        }
        assert!(run["mem_latency_ns"]["16MB"].as_f64().unwrap() > 0.0);
        let c = &run["checks"];
        assert_eq!(c["entries_after_base"], plan.shape.entries_after_base);
        for key in [
            "hit_mismatches",
            "prefix_mismatches",
            "hit_2_mismatches",
            "matches_after_remove",
            "final_live_entries",
            "anomalies",
        ] {
            assert_eq!(c[key], 0, "{key}");
        }
        let d = &run["details"];
        assert_eq!(d["store_blocks"], plan.base.stored_blocks);
        assert_eq!(d["remove_blocks"], plan.remove.removed_blocks);
        assert!(d["mixed_queries"].as_u64().unwrap() > 0);
    }
    let params = &r["params"];
    assert_eq!(params["W"], plan.spec.workers);
    assert_eq!(params["D"], plan.spec.depth as u64);
    assert_eq!(params["S"], plan.spec.size as u64);
    assert_eq!(params["G"], plan.spec.groups);
    assert_eq!(params["N"], plan.shape.base_sequences);
    assert_eq!(params["E"], plan.shape.extra_sequences);
    assert_eq!(params["P"], plan.shape.prefix_blocks);
    assert_eq!(r["repeat"], repeat as u64);
    for key in ["machine", "date", "version", "indexer", "cores", "workload"] {
        assert!(r.get(key).is_some(), "missing {key}");
    }
}

#[test]
fn harness_self_checks_pass_on_kv_index_and_sharded() {
    for kind in [WorkloadKind::DynamoW1, WorkloadKind::DynamoW4] {
        let plan = AnchorPlan::generate(&small(kind, 300)).unwrap();
        let r = run_anchor(&plan, 2, || Ok(Box::new(KvIndexUnderTest::new())));
        check_report(&r, &plan, 2);
        assert_eq!(r["workload"], kind.name());
        assert_eq!(r["indexer"], "kv-index");
        assert_eq!(r["mixed_mode"], "interleaved");
        assert_eq!(r["shard_balance"], 1.0);

        let r = run_anchor(&plan, 2, || {
            Ok(Box::new(ShardedUnderTest::new(Sharding::adaptive(2)?)))
        });
        check_report(&r, &plan, 2);
        assert_eq!(r["cores"], 2);
        let ops = r["runs"][0]["details"]["shard_ops"].as_array().unwrap();
        assert_eq!(ops.len(), 2);
    }
}

#[test]
fn harness_runs_the_runtime_with_concurrent_callers() {
    let plan = AnchorPlan::generate(&small(WorkloadKind::DynamoW1, 200)).unwrap();
    let r = run_anchor(&plan, 1, || {
        Ok(Box::new(RuntimeUnderTest::new(
            Sharding::adaptive(2)?,
            1,
            1,
            false,
        )?))
    });
    check_report(&r, &plan, 1);
    assert_eq!(r["mixed_mode"], "concurrent");
}

/// `KvIndexUnderTest` that loses the last event of its first `apply_all`.
struct Lossy {
    inner: KvIndexUnderTest,
    lost: bool,
}

impl IndexerUnderTest for Lossy {
    fn name(&self) -> String {
        "lossy".into()
    }
    fn cores(&self) -> usize {
        1
    }
    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        if std::mem::replace(&mut self.lost, true) {
            return self.inner.apply_all(streams);
        }
        let all = streams[0].to_vec();
        let kept: EventStream = Arc::from(&all[..all.len() - 1]);
        self.inner.apply_all(&[kept])
    }
    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        self.inner.query(seqs)
    }
    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        self.inner.mixed(streams, queries, plan)
    }
    fn mixed_mode(&self) -> MixedMode {
        self.inner.mixed_mode()
    }
    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        self.inner.query_callers(lists, keep)
    }
    fn max_callers(&self) -> usize {
        self.inner.max_callers()
    }
    fn stats(&mut self) -> Result<IndexerStats> {
        self.inner.stats()
    }
}

#[test]
fn a_lost_store_fails_the_self_checks() {
    let plan = AnchorPlan::generate(&small(WorkloadKind::DynamoW1, 2000)).unwrap();
    let mut make = || -> Result<Box<dyn IndexerUnderTest>> {
        Ok(Box::new(Lossy {
            inner: KvIndexUnderTest::new(),
            lost: false,
        }))
    };
    let report = anchor::run(&mut make, &plan, &AnchorOptions::default()).unwrap();
    assert!(!report.checks_passed);
    let c = &report.runs[0].checks;
    assert!(c.entries_after_base < c.expected_entries_after_base);
    assert!(c.hit_mismatches > 0 && c.hit_2_mismatches > 0, "{c:?}");
    assert!(
        c.anomalies > 0,
        "removing the lost blocks is an anomaly: {c:?}"
    );
    assert!(!report.problems.is_empty());
}

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: IndexerArgs,
}

fn parse(flags: &str) -> IndexerArgs {
    Cli::try_parse_from(std::iter::once("x").chain(flags.split_whitespace()))
        .unwrap()
        .args
}

#[test]
fn flags_scale_anchors_and_refuse_what_they_fix() {
    let spec = parse("--workload dynamo-w3")
        .anchor_spec()
        .unwrap()
        .unwrap();
    assert_eq!(spec, AnchorSpec::of(WorkloadKind::DynamoW3).unwrap());
    let spec = parse("--workload dynamo-w1 --anchor-size 32768 --anchor-queries 10 --repeat 3");
    assert_eq!(spec.anchor_options().repeat, 3);
    let spec = spec.anchor_spec().unwrap().unwrap();
    assert_eq!((spec.size, spec.queries, spec.workers), (32768, 10, 128));
    for bad in [
        "--workload dynamo-w1 --workers 16",
        "--workload dynamo-w2 --size 4096",
        "--workload dynamo-w4 --prefix-ratio 0.5",
        "--workload dynamo-w1 --anchor-size 10",
        "--workload dynamo-w1 --anchor-queries 0",
        "--workload dynamo --repeat 2",
        "--workload dynamo --anchor-size 4096",
    ] {
        assert!(parse(bad).anchor_spec().is_err(), "{bad}");
    }
    assert!(parse("--workload dynamo").anchor_spec().unwrap().is_none());
    let seen: HashSet<&str> = KINDS.iter().map(|k| k.name()).collect();
    assert_eq!(seen.len(), 4);
    for k in KINDS {
        assert_eq!(parse(&format!("--workload {}", k.name())).workload, k);
    }
}
