//! Hashing throughput: tokens per second for request hashing (one pass, chained).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use engine::hash::{BASE_SEED, seq_hashes};
use mimalloc::MiMalloc;
use std::hint::black_box;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash/seq_hashes");
    for tokens in [2_048usize, 8_192, 32_768] {
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|t| t.wrapping_mul(2_654_435_761) % 151_000)
            .collect();
        g.throughput(Throughput::Elements(tokens as u64));
        g.bench_function(format!("{tokens}_tokens/bs16"), |b| {
            b.iter(|| black_box(seq_hashes(black_box(&ids), 16, BASE_SEED)))
        });
    }
    g.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
