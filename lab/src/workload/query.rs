//! Queries: a request's seq_hashes hashed before timing ([`Query`]), those whose answer is
//! known ([`CheckedQuery`], workload invariant 5), and the helpers the generators build
//! them with.

use super::rng::Rng;
use engine::SeqHash;
use std::sync::Arc;

/// One query: a request's seq_hashes, hashed before timing.
pub type Query = Arc<[SeqHash]>;

/// A query whose answer is known: the best overlap an exact index returns (workload
/// invariant 5).
#[derive(Clone, Debug)]
pub struct CheckedQuery {
    /// The request's seq_hashes.
    pub seqs: Query,
    /// Expected [`engine::Matches::best`].
    pub expect_best: u32,
}

/// `count` seq_hashes chained onto `parent` from random tokens hashes: a continuation no
/// worker stores.
pub(crate) fn random_continuation(
    rng: &mut Rng,
    parent: Option<SeqHash>,
    count: usize,
    out: &mut Vec<SeqHash>,
) {
    let mut prev = parent;
    for _ in 0..count {
        let s = engine::hash::seq_hash(prev, engine::TokensHash(rng.next_u64()));
        out.push(s);
        prev = Some(s);
    }
}

/// Deals `pool` round-robin into `threads` lists of `per_thread` queries each, picking
/// randomly.
pub(crate) fn deal_queries(
    rng: &mut Rng,
    pool: &[Query],
    threads: usize,
    per_thread: usize,
) -> Vec<Vec<Query>> {
    if pool.is_empty() {
        return vec![Vec::new(); threads];
    }
    (0..threads)
        .map(|_| {
            (0..per_thread)
                .map(|_| Arc::clone(&pool[rng.below(pool.len())]))
                .collect()
        })
        .collect()
}
