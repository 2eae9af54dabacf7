//! Worker-selection micro-benchmarks, on one core.
//!
//! * `schedule/decide/{workers}`: one `kv` decision (`route`) for a 128-block request, then
//!   `free` of the same request so the state stays bounded. Every key carries 4 active
//!   requests of 64 blocks that start with the same 8-block system prompt (so the request's
//!   first blocks are active on every key: the worst case of the active-block count), and a
//!   quarter of the keys have varied overlaps in the `Matches`.
//! * `schedule/decide_t1/{workers}`: the same at temperature 1 (softmax sampling).
//! * `schedule/approx/{workers}`: approximate mode's per-request work: `find_matches`, then
//!   `insert` of the request's blocks on the chosen key, with every key holding 2,048 blocks.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use engine::approx::{ApproxConfig, ApproxIndex};
use engine::sched::{RouteOverrides, RouteRequest, Scheduler, SchedulerConfig};
use engine::{Matches, RequestId, SeqHash, WorkerKey};
use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

const WORKERS: [u64; 3] = [16, 128, 1024];
const REQUEST_BLOCKS: u64 = 128;
const PROMPT_BLOCKS: u64 = 8;

/// `n` keys: `n / 2` workers with two data-parallel ranks each.
fn keys(n: u64) -> Vec<WorkerKey> {
    (0..n)
        .map(|i| WorkerKey::new(i / 2, (i % 2) as u32))
        .collect()
}

/// The shared system prompt, then blocks private to `salt`.
fn blocks(salt: u64, len: u64) -> Vec<SeqHash> {
    (0..len)
        .map(|i| {
            if i < PROMPT_BLOCKS {
                SeqHash(i)
            } else {
                SeqHash(salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i)
            }
        })
        .collect()
}

/// A quarter of the keys hold a prefix of the request, of varied length.
fn quarter_matches(keys: &[WorkerKey]) -> Matches {
    Matches::from_overlaps(
        keys.iter()
            .step_by(4)
            .enumerate()
            .map(|(i, &k)| (k, 1 + (i as u32 * 37) % REQUEST_BLOCKS as u32)),
    )
}

fn loaded_scheduler(n: u64, temperature: f64, now: Instant) -> anyhow::Result<Scheduler> {
    let mut s = Scheduler::new(SchedulerConfig {
        temperature,
        ..Default::default()
    })?;
    let mut id = 1_000_000;
    for k in keys(n) {
        s.add_worker(k)?;
        for _ in 0..4 {
            id += 1;
            s.add_active(now, k, RequestId(id), &blocks(id, 64), 64 * 16, 8)?;
        }
    }
    Ok(s)
}

fn decide(c: &mut Criterion, group: &str, temperature: f64) -> anyhow::Result<()> {
    let now = Instant::now();
    let mut g = c.benchmark_group(group);
    for n in WORKERS {
        let mut s = loaded_scheduler(n, temperature, now)?;
        let m = quarter_matches(&keys(n));
        let request = blocks(7, REQUEST_BLOCKS);
        let r = RouteRequest {
            id: RequestId(1),
            blocks: &request,
            input_tokens: REQUEST_BLOCKS * 16 + 5,
            overrides: RouteOverrides::default(),
        };
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let d = s.route(now, black_box(&r), black_box(&m), |k| k.worker.0);
                if let Ok(d) = &d {
                    black_box(d.worker);
                }
                let _ = s.free(RequestId(1));
                d.is_ok()
            })
        });
    }
    g.finish();
    Ok(())
}

fn approx(c: &mut Criterion) -> anyhow::Result<()> {
    let now = Instant::now();
    let mut g = c.benchmark_group("schedule/approx");
    for n in WORKERS {
        let mut ix = ApproxIndex::new(ApproxConfig {
            ttl: Duration::from_secs(120),
            max_blocks_per_worker: 2048,
        })?;
        let ks = keys(n);
        for (i, &k) in ks.iter().enumerate() {
            for j in 0..16u64 {
                ix.insert(now, k, &blocks(i as u64 * 100 + j, REQUEST_BLOCKS));
            }
        }
        let request = blocks(7, REQUEST_BLOCKS);
        let mut i = 0usize;
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let m = ix.find_matches(black_box(&request));
                i = (i + 1) % ks.len();
                let chosen = m.overlaps.first().map_or(ks[i], |&(k, _)| k);
                ix.insert(now, chosen, &request);
                m.depth_counts.len()
            })
        });
    }
    g.finish();
    Ok(())
}

fn run(c: &mut Criterion) -> anyhow::Result<()> {
    decide(c, "schedule/decide", 0.0)?;
    decide(c, "schedule/decide_t1", 1.0)?;
    approx(c)
}

fn benches(c: &mut Criterion) {
    if let Err(e) = run(c) {
        eprintln!("schedule bench setup failed: {e:#}");
        std::process::exit(1);
    }
}

criterion_group!(schedule, benches);
criterion_main!(schedule);
