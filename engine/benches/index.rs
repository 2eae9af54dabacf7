//! Index micro-benchmarks: applying events and `find_matches`, on one core.
//!
//! Also prints the memory footprint (bytes per (block, worker) entry) at 1M live entries
//! with 64 workers; criterion does not measure memory.

mod common;

use common::Workload;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use engine::kv_index::KvIndex;
use engine::{EngineHash, SeqHash};
use mimalloc::MiMalloc;
use std::hint::black_box;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

const LIVE: usize = 1 << 20;

/// Builds Dynamo's workload shape (depth 128, prefix ratio 0.25, 4 groups) with as many
/// sequences as make 1,048,576 live (block, worker) entries: each worker stores each group's
/// 32-block prefix once, every sequence adds a 96-block tail.
fn memory_report() {
    for workers in [64u64, 128] {
        let prefix_entries = workers as usize * 4 * 32;
        let n = (LIVE - prefix_entries) / 96;
        let w = Workload::new(n, 128, workers, 0.25, 4);
        let mut ix = KvIndex::new();
        w.build(&mut ix, 0..w.sequences.len());
        let st = ix.stats();
        let e = st.index.entries as f64;
        println!(
            "memory/dynamo/{workers}w: entries {} blocks {} index {:.1} B/entry, \
             directories {:.1} B/entry, total {:.1} B/entry",
            st.index.entries,
            st.index.blocks,
            st.index.bytes as f64 / e,
            st.directory_bytes as f64 / e,
            st.bytes as f64 / e
        );
    }
}

/// Store a 96-block tail under its prefix, then remove it, with 1M entries live.
fn apply_events(c: &mut Criterion) {
    memory_report();
    let w = Workload::dynamo(LIVE + 128 * 4096, 64);
    let live_seqs = LIVE / 128;
    let mut ix = KvIndex::new();
    w.build(&mut ix, 0..live_seqs);
    // Extra sequences (not live) cycle through store + remove; their prefixes are live.
    let spare = &w.sequences[live_seqs..];
    let removes: Vec<Vec<EngineHash>> = spare
        .iter()
        .map(|s| s.tail.iter().map(|b| b.engine_hash).collect())
        .collect();
    let mut g = c.benchmark_group("index/apply");
    let ops = spare[0].tail.len() as u64 * 2;
    g.throughput(Throughput::Elements(ops));
    let mut i = 0usize;
    g.bench_function("store_remove_tail_96/1M_live/64w", |b| {
        b.iter(|| {
            let s = &spare[i % spare.len()];
            let parent = s.prefix.last().map(|b| b.engine_hash);
            black_box(ix.apply_stored(s.key, parent, &s.tail).unwrap());
            black_box(ix.apply_removed(s.key, &removes[i % spare.len()]));
            i += 1;
        })
    });
    g.finish();

    // Bulk build from empty to 1M entries (stores only).
    let mut g = c.benchmark_group("index/build");
    g.sample_size(10);
    let w = Workload::dynamo(LIVE, 64);
    g.throughput(Throughput::Elements(LIVE as u64));
    g.bench_function("1M_entries/64w", |b| {
        b.iter_with_large_drop(|| {
            let mut ix = KvIndex::new();
            w.build(&mut ix, 0..w.sequences.len());
            ix
        })
    });
    g.finish();
}

/// Hit queries: the full stored sequence, whose first quarter is shared by a prefix group.
fn find_matches(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/find_matches");
    let shapes = [
        (128usize, 128u64),
        (128, 16),
        (128, 256),
        (128, 1024),
        (512, 16),
        (512, 256),
        (512, 1024),
        (2048, 16),
        (2048, 256),
        (2048, 1024),
    ];
    for (depth, workers) in shapes {
        // About 1M live entries (at least two sequences per worker).
        let n = (LIVE / depth).max(2 * workers as usize);
        let w = Workload::new(n, depth, workers, 0.25, 4);
        let mut ix = KvIndex::new();
        w.build(&mut ix, 0..n);
        let queries: Vec<&[SeqHash]> = w.sequences.iter().map(|s| s.seqs.as_slice()).collect();
        let mut i = 0usize;
        g.throughput(Throughput::Elements(depth as u64));
        g.bench_with_input(
            BenchmarkId::new(format!("{depth}_blocks"), format!("{workers}w")),
            &(),
            |b, _| {
                b.iter(|| {
                    // Stride through the sequences so successive queries do not share cache.
                    i = i.wrapping_add(7919);
                    black_box(ix.find_matches(queries[i % queries.len()]))
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, apply_events, find_matches);
criterion_main!(benches);
