//! A shard whose seq_hash table is rebuilt outside its owner's write sections
//! (`Shard::with_rebuilds_outside`, what the runtime's cores use so that readers on other
//! threads never wait for a rebuild) answers exactly as a shard that rebuilds inside its
//! stores and removals: random stores and removals of chains for a few workers, the owner
//! checking before every change as `shard_loop` does, every query compared, the trees'
//! invariants validated, and both back to the empty footprint at the end.

use engine::WorkerKey;
use engine::ids::SeqHash;
use engine::sharding::ShardId;
use engine::sharding::shard::Shard;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[test]
fn rebuilding_outside_the_changes_answers_as_rebuilding_inside() {
    let mut rng = SmallRng::seed_from_u64(32);
    let mut inside = Shard::new(ShardId(0));
    let mut outside = Shard::new(ShardId(0)).with_rebuilds_outside();
    let empty = outside.stats().bytes;
    let mut chains: Vec<(WorkerKey, Vec<SeqHash>)> = Vec::new();
    let mut installed = 0;
    for round in 0..3_000 {
        let change = if chains.is_empty() || rng.random_bool(0.55) {
            let key = WorkerKey::new(rng.random_range(0..4), 0);
            let len = rng.random_range(1..200);
            let seqs: Vec<SeqHash> = (0..len).map(|_| SeqHash(rng.random())).collect();
            chains.push((key, seqs.clone()));
            Some((key, seqs, true))
        } else {
            let i = rng.random_range(0..chains.len());
            let (key, mut seqs) = chains.swap_remove(i);
            seqs.reverse();
            Some((key, seqs, false))
        };
        let Some((key, seqs, store)) = change else {
            continue;
        };
        // The owner's check before a section (shard_loop::prepare_section).
        if let Some(fresh) = outside.rebuilt_table_if_due(seqs.len()) {
            drop(outside.install_table(fresh));
            installed += 1;
        }
        for s in [&mut inside, &mut outside] {
            if store {
                s.store_seqs(key, None, &seqs);
            } else {
                s.remove_seqs(key, &seqs);
            }
        }
        if round % 100 == 0 {
            outside.validate().unwrap();
            for (_, q) in chains.iter().take(50) {
                assert_eq!(
                    outside.find_matches(q),
                    inside.find_matches(q),
                    "round {round}"
                );
            }
        }
    }
    assert!(
        installed >= 2,
        "the run grew the table and filled it with dead entries: {installed}"
    );
    for (_, q) in &chains {
        assert_eq!(outside.find_matches(q), inside.find_matches(q));
    }
    for (key, mut seqs) in std::mem::take(&mut chains) {
        seqs.reverse();
        if let Some(fresh) = outside.rebuilt_table_if_due(seqs.len()) {
            drop(outside.install_table(fresh));
        }
        inside.remove_seqs(key, &seqs);
        outside.remove_seqs(key, &seqs);
    }
    if let Some(fresh) = outside.rebuilt_table_if_due(0) {
        drop(outside.install_table(fresh));
    }
    outside.validate().unwrap();
    inside.validate().unwrap();
    assert_eq!(outside.inconsistencies() + inside.inconsistencies(), 0);
    assert_eq!(outside.stats().blocks, 0);
    assert!(
        outside.stats().bytes <= empty + 64,
        "back to the empty footprint: {} bytes, {empty} empty",
        outside.stats().bytes
    );
}
