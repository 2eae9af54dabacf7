//! Decoding `/v1/route` bodies: the hand-written `token_ids` scanner against plain serde.
//!
//! `cargo bench -p kvengine-transport --bench json_route`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use mimalloc::MiMalloc;
use std::hint::black_box;
use transport::http::route_body::{parse_prompt, parse_prompt_serde};

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// A route body with `n` token ids below `vocab`, ids separated by `sep`.
fn body(n: usize, vocab: u32, sep: &str) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let ids: Vec<String> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % u64::from(vocab)) as u32).to_string()
        })
        .collect();
    format!(
        r#"{{"token_ids": [{}], "request_id": "req-123456", "mode": "kv"}}"#,
        ids.join(sep)
    )
    .into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_body_8000_tokens");
    for (name, sep) in [("compact", ","), ("python", ", ")] {
        let b = body(8000, 152_000, sep);
        g.throughput(Throughput::Bytes(b.len() as u64));
        let mut tokens = Vec::new();
        g.bench_function(format!("scanner/{name}"), |bench| {
            bench.iter(|| {
                parse_prompt(black_box(&b), &mut tokens).ok();
                black_box(tokens.len())
            })
        });
        g.bench_function(format!("serde/{name}"), |bench| {
            bench.iter(|| {
                let mut t = Vec::new();
                parse_prompt_serde(black_box(&b), &mut t).ok();
                black_box(t.len())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
