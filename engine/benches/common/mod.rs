//! Workload shared by the engine's micro-benchmarks: Dynamo's indexer-benchmark shape.
//!
//! `size` (worker, block) entries in sequences of `depth` blocks; sequence `k` belongs to
//! worker `k mod W` and prefix group `k mod G`; its first `depth * prefix_ratio` blocks are
//! the group's common prompt, which a worker stores once; later sequences send only their
//! tail with a parent link. Events carry engine hashes and precomputed tokens hashes.
#![allow(dead_code)]

use engine::event::StoredBlock;
use engine::hash::seq_hash;
use engine::kv_index::KvIndex;
use engine::{EngineHash, SeqHash, TokensHash, WorkerKey};
use std::collections::HashSet;

/// One sequence of the workload.
pub struct Sequence {
    pub key: WorkerKey,
    /// The group's prefix (stored once per worker).
    pub prefix: Vec<StoredBlock>,
    /// The private tail, stored under the prefix's last engine hash.
    pub tail: Vec<StoredBlock>,
    /// Every seq_hash of the full sequence (what a hit query sends).
    pub seqs: Vec<SeqHash>,
}

pub struct Workload {
    pub sequences: Vec<Sequence>,
    pub workers: u64,
}

fn mix(a: u64, b: u64) -> u64 {
    xxhash_rust_free_mix(a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b)
}

fn xxhash_rust_free_mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl Workload {
    /// `sequences` sequences of `depth` blocks over `workers` workers.
    pub fn new(
        sequences: usize,
        depth: usize,
        workers: u64,
        prefix_ratio: f64,
        groups: u64,
    ) -> Self {
        let prefix_len = (depth as f64 * prefix_ratio) as usize;
        let sequences = (0..sequences as u64)
            .map(|k| {
                let key = WorkerKey::new(k % workers, 0);
                let group = k % groups.max(1);
                let mut prev = None;
                let mut blocks = Vec::with_capacity(depth);
                let mut seqs = Vec::with_capacity(depth);
                for j in 0..depth as u64 {
                    let t = if (j as usize) < prefix_len {
                        mix(group, j)
                    } else {
                        mix(k + 1_000_000, j)
                    };
                    let s = seq_hash(prev, TokensHash(t));
                    blocks.push(StoredBlock {
                        engine_hash: EngineHash(s.0),
                        tokens_hash: TokensHash(t),
                    });
                    seqs.push(s);
                    prev = Some(s);
                }
                let tail = blocks.split_off(prefix_len);
                Sequence {
                    key,
                    prefix: blocks,
                    tail,
                    seqs,
                }
            })
            .collect();
        Self { sequences, workers }
    }

    /// Dynamo's defaults scaled to `size` entries: depth 128, prefix ratio 0.25, 4 groups.
    pub fn dynamo(size: usize, workers: u64) -> Self {
        Self::new(size / 128, 128, workers, 0.25, 4)
    }

    /// Stores sequences `range` into `ix`, each prefix once per worker.
    pub fn build(&self, ix: &mut KvIndex, range: std::ops::Range<usize>) {
        let mut have: HashSet<(WorkerKey, u64)> = HashSet::new();
        for s in &self.sequences[range] {
            let first = s.prefix.first().map_or(0, |b| b.engine_hash.0);
            if !s.prefix.is_empty() && have.insert((s.key, first)) {
                ix.apply_stored(s.key, None, &s.prefix).unwrap();
            }
            ix.apply_stored(s.key, s.prefix.last().map(|b| b.engine_hash), &s.tail)
                .unwrap();
        }
    }
}
