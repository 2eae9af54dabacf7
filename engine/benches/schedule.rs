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

/// Blocks of a Mooncake-sized prompt (~10k tokens at 16 a block).
const LONG_BLOCKS: u64 = 640;
/// Requests in flight while the lifecycle bench runs: their blocks keep the active-block
/// map at ~164k entries, past the L2 cache, as a busy router's is.
const IN_FLIGHT: u64 = 256;

/// One request's life in the scheduler's load accounting: `add_active` of a long private
/// prompt on one of 4 workers, and `free` of the oldest request in flight (issue 31: the two
/// were 2.7% of the router's CPU on the Mooncake replay, a cache miss per block).
fn lifecycle(c: &mut Criterion) -> anyhow::Result<()> {
    let now = Instant::now();
    let mut s = Scheduler::new(SchedulerConfig::default())?;
    let ks = keys(4);
    for &k in &ks {
        s.add_worker(k)?;
    }
    let mut live = std::collections::VecDeque::new();
    let mut id = 0u64;
    let add = |s: &mut Scheduler, id: u64| {
        let k = ks[(id % 4) as usize];
        s.add_active(
            now,
            k,
            RequestId(id),
            &blocks(id, LONG_BLOCKS),
            LONG_BLOCKS * 16,
            0,
        )
    };
    for _ in 0..IN_FLIGHT {
        id += 1;
        add(&mut s, id)?;
        live.push_back(id);
    }
    let mut g = c.benchmark_group("schedule/lifecycle");
    g.bench_function(BenchmarkId::from_parameter(LONG_BLOCKS), |b| {
        b.iter(|| {
            id += 1;
            let added = add(&mut s, id).is_ok();
            live.push_back(id);
            let freed = live
                .pop_front()
                .is_some_and(|old| s.free(RequestId(old)).is_ok());
            added && freed
        })
    });
    g.finish();
    Ok(())
}

fn run(c: &mut Criterion) -> anyhow::Result<()> {
    lifecycle(c)?;
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
