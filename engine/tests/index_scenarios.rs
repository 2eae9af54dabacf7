//! Scenario tests of the exact index (issue 2's list), through the public API.

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, lora_seed, seq_hash, tokens_hash};
use engine::kv_index::{Applied, KvIndex};
use engine::{EngineError, EngineHash, RejectReason, SeqHash, TokensHash, WorkerId, WorkerKey};

const W0: WorkerKey = WorkerKey::new(0, 0);
const W1: WorkerKey = WorkerKey::new(1, 0);

/// Blocks named by small ids; a block's engine hash is its seq_hash (as a prefix-chained
/// engine would produce), its tokens hash is the id itself.
fn chain(parent: Option<SeqHash>, ids: &[u64]) -> (Vec<StoredBlock>, Vec<SeqHash>) {
    let mut prev = parent;
    ids.iter()
        .map(|&id| {
            let s = seq_hash(prev, TokensHash(id));
            prev = Some(s);
            (
                StoredBlock {
                    engine_hash: EngineHash(s.0),
                    tokens_hash: TokensHash(id),
                },
                s,
            )
        })
        .unzip()
}

fn seqs(ids: &[u64]) -> Vec<SeqHash> {
    chain(None, ids).1
}

/// Sizes without heap bytes: a refused event may leave grown capacity behind, never content.
fn content(ix: &KvIndex) -> (engine::index::IndexStats, usize) {
    let s = ix.stats();
    (
        engine::index::IndexStats {
            bytes: 0,
            ..s.index
        },
        s.directory_entries,
    )
}

fn store(ix: &mut KvIndex, key: WorkerKey, ids: &[u64]) -> Vec<SeqHash> {
    let (blocks, s) = chain(None, ids);
    ix.apply(
        key,
        &KvEvent::Stored {
            parent: None,
            blocks,
        },
    )
    .unwrap();
    s
}

fn remove(ix: &mut KvIndex, key: WorkerKey, s: &[SeqHash]) -> Applied {
    let blocks = s.iter().map(|s| EngineHash(s.0)).collect();
    ix.apply(key, &KvEvent::Removed { blocks }).unwrap()
}

#[test]
fn two_workers_share_a_first_block() {
    let mut ix = KvIndex::new();
    store(&mut ix, W0, &[1, 2, 3]);
    store(&mut ix, W1, &[1, 4, 5]);
    let m = ix.find_matches(&seqs(&[1, 2, 3]));
    assert_eq!(m.overlaps, vec![(W0, 3), (W1, 1)]);
    assert_eq!(m.depth_counts, vec![2, 1, 1]);
    let m = ix.find_matches(&seqs(&[1, 2, 999]));
    assert_eq!(m.overlaps, vec![(W0, 2), (W1, 1)]);
    assert!(ix.find_matches(&seqs(&[7])).overlaps.is_empty());
    assert!(ix.find_matches(&[]).overlaps.is_empty());
}

#[test]
fn removing_last_and_mid_chain_blocks() {
    let mut ix = KvIndex::new();
    let s = store(&mut ix, W0, &[1, 2, 3, 4]);
    assert_eq!(
        remove(&mut ix, W0, &s[3..]),
        Applied {
            blocks: 1,
            unknown: 0
        }
    );
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W0, 3)]);
    remove(&mut ix, W0, &s[1..2]);
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W0, 1)]);
    // The descendants are still held: re-storing the middle block restores the overlap.
    let (blocks, _) = chain(Some(s[0]), &[2]);
    ix.apply(
        W0,
        &KvEvent::Stored {
            parent: Some(EngineHash(s[0].0)),
            blocks,
        },
    )
    .unwrap();
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W0, 3)]);
}

#[test]
fn continuation_under_a_parent_extends_the_chain() {
    let mut ix = KvIndex::new();
    let head = store(&mut ix, W0, &[1, 2]);
    let (tail, tail_seqs) = chain(Some(head[1]), &[3, 4]);
    let parent = Some(EngineHash(head[1].0));
    assert_eq!(ix.apply_stored(W0, parent, &tail), Ok(2));
    assert_eq!(tail_seqs, seqs(&[1, 2, 3, 4])[2..]);
    assert_eq!(
        ix.find_matches(&seqs(&[1, 2, 3, 4, 5])).overlaps,
        vec![(W0, 4)]
    );
    assert_eq!(ix.cached_blocks(W0), 4);
}

#[test]
fn unknown_parent_is_refused_and_changes_nothing() {
    let mut ix = KvIndex::new();
    store(&mut ix, W0, &[1, 2]);
    let before = content(&ix);
    let (blocks, _) = chain(Some(SeqHash(42)), &[3]);
    let err = ix
        .apply_stored(W0, Some(EngineHash(42)), &blocks)
        .unwrap_err();
    assert_eq!(
        err,
        EngineError::UnknownParent {
            worker: W0,
            parent: EngineHash(42)
        }
    );
    // A parent held by another worker key is unknown too: directories are per worker key.
    let (blocks, _) = chain(Some(seqs(&[1])[0]), &[3]);
    let e1 = EngineHash(seqs(&[1])[0].0);
    assert!(ix.apply_stored(W1, Some(e1), &blocks).is_err());
    assert_eq!(content(&ix), before);
    assert_eq!(ix.rejects().get(RejectReason::UnknownParent), 2);
}

#[test]
fn conflicting_engine_hash_is_rolled_back() {
    let mut ix = KvIndex::new();
    let s = store(&mut ix, W0, &[1, 2]);
    let before = content(&ix);
    // Two new blocks, then an engine hash already mapped to block 1's prefix.
    let blocks = vec![
        StoredBlock {
            engine_hash: EngineHash(900),
            tokens_hash: TokensHash(5),
        },
        StoredBlock {
            engine_hash: EngineHash(901),
            tokens_hash: TokensHash(6),
        },
        StoredBlock {
            engine_hash: EngineHash(s[0].0),
            tokens_hash: TokensHash(7),
        },
    ];
    let err = ix.apply_stored(W0, None, &blocks).unwrap_err();
    assert_eq!(err.reason(), RejectReason::EngineHashConflict);
    assert_eq!(content(&ix), before);
    assert_eq!(ix.find_matches(&seqs(&[5])).overlaps, vec![]);
}

#[test]
fn a_block_stored_twice_needs_two_removals() {
    let mut ix = KvIndex::new();
    let s = store(&mut ix, W0, &[1, 2]);
    // Block 2 cached again under its parent (vLLM recomputing a fully cached prompt's last
    // block into a second physical block): a second copy.
    let (again, _) = chain(Some(s[0]), &[2]);
    ix.apply(
        W0,
        &KvEvent::Stored {
            parent: Some(EngineHash(s[0].0)),
            blocks: again,
        },
    )
    .unwrap();
    let last = &s[1..];
    remove(&mut ix, W0, last);
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W0, 2)]);
    remove(&mut ix, W0, last);
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W0, 1)]);
    let a = remove(&mut ix, W0, last);
    assert_eq!(
        a,
        Applied {
            blocks: 0,
            unknown: 1
        }
    );
    assert_eq!(ix.rejects().get(RejectReason::UnknownBlock), 1);
}

/// A chain from the root that the worker holds already is a report (vLLM's
/// `kv_cache_report_mode: "full"`), not a second copy: one removal drops it.
#[test]
fn a_held_root_chain_stored_again_is_a_report() {
    let mut ix = KvIndex::new();
    let s = store(&mut ix, W0, &[1, 2]);
    let (blocks, _) = chain(None, &[1, 2]);
    let a = ix
        .apply(
            W0,
            &KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
    assert_eq!(a.blocks, 0);
    remove(&mut ix, W0, &s);
    assert!(ix.find_matches(&s).overlaps.is_empty());
}

#[test]
fn cleared_is_per_rank_and_remove_worker_takes_every_rank() {
    let mut ix = KvIndex::new();
    let r0 = WorkerKey::new(3, 0);
    let r1 = WorkerKey::new(3, 1);
    let s = store(&mut ix, r0, &[1, 2]);
    store(&mut ix, r1, &[1, 2]);
    store(&mut ix, W1, &[1]);
    ix.apply(r0, &KvEvent::Cleared).unwrap();
    assert_eq!(ix.find_matches(&s).overlaps, vec![(r1, 2), (W1, 1)]);
    store(&mut ix, r0, &[1, 2]);
    assert_eq!(ix.remove_worker(WorkerId(3)), 2);
    assert_eq!(ix.find_matches(&s).overlaps, vec![(W1, 1)]);
    assert_eq!(ix.remove_worker(WorkerId(3)), 0);
}

#[test]
fn lora_and_base_blocks_never_match() {
    let mut ix = KvIndex::new();
    let tokens = [1u32, 2, 3, 4];
    let base = tokens_hash(&tokens, BASE_SEED);
    let lora = tokens_hash(&tokens, lora_seed(Some("sql-adapter")));
    let b = StoredBlock {
        engine_hash: EngineHash(1),
        tokens_hash: base,
    };
    let l = StoredBlock {
        engine_hash: EngineHash(2),
        tokens_hash: lora,
    };
    ix.apply_stored(W0, None, &[b]).unwrap();
    ix.apply_stored(W1, None, &[l]).unwrap();
    assert_eq!(
        ix.find_matches(&[seq_hash(None, base)]).overlaps,
        vec![(W0, 1)]
    );
    assert_eq!(
        ix.find_matches(&[seq_hash(None, lora)]).overlaps,
        vec![(W1, 1)]
    );
}

#[test]
fn four_workers_of_one_chain_score_by_depth() {
    let mut ix = KvIndex::new();
    let ids: Vec<u64> = (0..100).collect();
    let keys: Vec<WorkerKey> = (0..4).map(|w| WorkerKey::new(w, 0)).collect();
    for (k, n) in keys.iter().zip([100, 75, 50, 25]) {
        store(&mut ix, *k, &ids[..n]);
    }
    let m = ix.find_matches(&seqs(&ids[..60]));
    assert_eq!(
        m.overlaps,
        vec![(keys[0], 60), (keys[1], 60), (keys[2], 50), (keys[3], 25)]
    );
    assert_eq!(m.depth_counts.len(), 60);
    assert_eq!(
        (m.depth_counts[24], m.depth_counts[25], m.depth_counts[50]),
        (4, 3, 2)
    );
}

#[test]
fn memory_returns_to_empty_after_everyone_removes_everything() {
    let empty = KvIndex::new().stats();
    let mut ix = KvIndex::new();
    let mut stored = vec![];
    for w in 0..70u64 {
        let key = WorkerKey::new(w, (w % 2) as u32);
        // A shared prefix (multi-holder sets) and a private tail (single holders).
        let ids: Vec<u64> = (0..8)
            .chain((0..200).map(|i| 1000 + w * 1000 + i))
            .collect();
        stored.push((key, store(&mut ix, key, &ids)));
    }
    store(&mut ix, stored[0].0, &[0, 1]); // a second copy
    assert!(ix.stats().bytes > empty.bytes);
    assert_eq!(ix.stats().index.entries, 70 * 208);
    for (key, s) in &stored {
        remove(&mut ix, *key, s);
    }
    remove(&mut ix, stored[0].0, &seqs(&[0, 1]));
    assert_eq!(ix.stats(), empty);
}
