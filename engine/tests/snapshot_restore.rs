//! Snapshots against a plain model: an engine restored from a snapshot answers exactly as
//! the model of the batches its stream marks name, on 1, 2 and 3 cores, with trunk
//! promotions happening all the time (junction fanout 2).
//!
//! * `a_restored_engine_is_the_engine_it_was_taken_from`: events from one thread; a
//!   snapshot at random points; the restored engine is compared with the model, then both
//!   take the same further events and are compared again, and at the end everything is
//!   removed from the restored engine, which must be back to empty with no inconsistency
//!   (its tree is a real tree, not just one that answers queries).
//! * `a_snapshot_taken_under_concurrent_ingest_is_a_consistent_cut`: two threads publish
//!   numbered batches for their own workers while snapshots are taken; each snapshot must
//!   equal the model of exactly the batches up to each worker's mark: nothing applied
//!   without its mark (stale after a replay), nothing marked but missing (lost).

mod model;

use engine::event::KvEvent;
use engine::runtime::{IngestHandle, QueryHandle, RuntimeConfig, Started, start_from};
use engine::sharding::adaptive::Adaptive;
use engine::snapshot::{self, StreamMark};
use engine::{WorkerId, WorkerKey};
use model::{Model, Paths, event, key};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rkyv::util::AlignedVec;
use std::collections::BTreeMap;
use std::sync::Arc;

fn config() -> RuntimeConfig {
    RuntimeConfig {
        pin_cores: false,
        ring_capacity: 64,
        ..RuntimeConfig::default()
    }
}

fn policy(cores: usize) -> Adaptive {
    Adaptive::new(cores, 2).unwrap()
}

/// Encodes, decodes and restores `image` onto a fresh runtime of `cores` cores.
fn restored(cores: usize, image: &snapshot::EngineImage) -> Started<Adaptive> {
    let bytes = snapshot::encode(image, b"meta").unwrap();
    let mut buf = AlignedVec::<16>::new();
    buf.extend_from_slice(&bytes);
    let (archived, meta) = snapshot::decode(&buf).unwrap();
    assert_eq!(meta, b"meta");
    start_from(policy(cores), config(), Some(archived)).unwrap()
}

/// The restored engine answers every query on stored chains and every block count as the
/// model does.
fn check(q: &mut QueryHandle<Adaptive>, ingest: &mut IngestHandle, model: &Model, paths: &Paths) {
    for path in paths.0.values() {
        assert_eq!(
            q.find_matches(path).unwrap(),
            model.matches(path),
            "{path:?}"
        );
    }
    for w in 0..6 {
        for r in 0..2 {
            let k = key(w, r);
            let want = model.dirs.get(&k).map_or(0, |d| d.len() as u64);
            assert_eq!(ingest.cached_blocks(k).unwrap(), want, "{k:?}");
        }
    }
}

fn empty_and_consistent(started: &mut Started<Adaptive>) {
    let ingest = &mut started.ingest[0];
    for w in 0..6 {
        ingest.remove_worker(WorkerId(w)).unwrap();
    }
    ingest.settle().unwrap();
    for c in ingest.core_stats().unwrap() {
        assert_eq!(c.inconsistencies, 0, "{c:?}");
        assert_eq!((c.index.blocks, c.index.entries), (0, 0), "{c:?}");
        assert_eq!(c.directory_entries, 0, "{c:?}");
    }
}

#[test]
fn a_restored_engine_is_the_engine_it_was_taken_from() {
    for cores in [1, 2, 3] {
        for seed in 0..4u64 {
            let mut rng = SmallRng::seed_from_u64(seed * 31 + cores as u64);
            let mut a = start_from(policy(cores), config(), None).unwrap();
            let mut model = Model::default();
            let mut paths = Paths::default();
            let before = rng.random_range(50..300);
            for _ in 0..before {
                let k = key(rng.random_range(0..6), rng.random_range(0..2));
                let ev = event(&mut rng, &model, &mut paths, k);
                model.apply(k, &ev);
                a.ingest[0].apply(k, &ev).ok();
            }
            let image = a.ingest[0].snapshot().unwrap();
            assert_eq!(image.cores.len(), cores);
            let mut b = restored(cores, &image);
            check(&mut b.query[0], &mut b.ingest[0], &model, &paths);
            // Both go on with the same events (stores continuing restored blocks,
            // removals of restored blocks) and stay equal to the model.
            for _ in 0..150 {
                let k = key(rng.random_range(0..6), rng.random_range(0..2));
                let ev = event(&mut rng, &model, &mut paths, k);
                model.apply(k, &ev);
                let ra = a.ingest[0].apply(k, &ev);
                let rb = b.ingest[0].apply(k, &ev);
                assert_eq!(ra, rb, "{ev:?}");
            }
            b.ingest[0].settle().unwrap();
            check(&mut b.query[0], &mut b.ingest[0], &model, &paths);
            empty_and_consistent(&mut b);
        }
    }
}

#[test]
fn a_cleared_worker_leaves_no_stream_mark_in_the_next_snapshot() {
    for cores in [1, 2] {
        let mut rng = SmallRng::seed_from_u64(cores as u64);
        let mut e = start_from(policy(cores), config(), None).unwrap();
        let (model, mut paths) = (Model::default(), Paths::default());
        for w in [1u64, 2] {
            let k = key(w, 0);
            let batch: Arc<[(WorkerKey, KvEvent)]> =
                Arc::from(vec![(k, event(&mut rng, &model, &mut paths, k))]);
            let mark = StreamMark {
                worker: WorkerId(w),
                stream: 0,
                seq: 5,
                digest: Some(9),
            };
            e.ingest[0].send_marked(&batch, mark).unwrap();
        }
        e.ingest[0].sync().unwrap();
        let marked = |image: &snapshot::EngineImage| -> Vec<u64> {
            let mut w: Vec<u64> = image
                .cores
                .iter()
                .flat_map(|c| c.marks.iter().map(|m| m.worker))
                .collect();
            w.sort_unstable();
            w
        };
        assert_eq!(marked(&e.ingest[0].snapshot().unwrap()), vec![1, 2]);
        // Worker 1's publisher restarted: its blocks are cleared, and with them its mark
        // (a restored router would otherwise resume it from batch 5 of the old numbering).
        e.ingest[0].clear(key(1, 0)).unwrap();
        e.ingest[0].sync().unwrap();
        assert_eq!(marked(&e.ingest[0].snapshot().unwrap()), vec![2]);
    }
}

/// One publisher thread's log: per worker, its batches (key and events) in order.
type Log = BTreeMap<u64, Vec<(WorkerKey, Vec<KvEvent>)>>;

#[test]
fn a_snapshot_taken_under_concurrent_ingest_is_a_consistent_cut() {
    for cores in [1, 2, 3] {
        let cfg = RuntimeConfig {
            ingest_handles: 3,
            ..config()
        };
        let mut started = start_from(policy(cores), cfg, None).unwrap();
        let mut handles = std::mem::take(&mut started.ingest);
        let mut taker = handles.pop().unwrap();
        let publishers: Vec<_> = handles
            .into_iter()
            .enumerate()
            .map(|(t, mut h)| {
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(t as u64 + 100 * cores as u64);
                    let mut model = Model::default();
                    let mut paths = Paths::default();
                    let mut log = Log::new();
                    // Thread t owns workers t, t + 2, t + 4.
                    for _ in 0..600 {
                        let w = t as u64 + 2 * rng.random_range(0..3);
                        let k = key(w, rng.random_range(0..2));
                        // Some batches longer than a handle's send chunk (64 events): a
                        // cut must not fall between their chunks.
                        let len = if rng.random_bool(0.1) {
                            rng.random_range(65..200)
                        } else {
                            rng.random_range(1..4)
                        };
                        let batch: Vec<KvEvent> = (0..len)
                            .map(|_| {
                                let ev = event(&mut rng, &model, &mut paths, k);
                                model.apply(k, &ev);
                                ev
                            })
                            .collect();
                        let batches = log.entry(w).or_default();
                        let mark = StreamMark {
                            worker: WorkerId(w),
                            stream: 0,
                            seq: batches.len() as u64,
                            digest: Some(batches.len() as u64 ^ 0xabc),
                        };
                        let slice: Arc<[(WorkerKey, KvEvent)]> =
                            batch.iter().map(|e| (k, e.clone())).collect();
                        batches.push((k, batch));
                        h.send_marked(&slice, mark).unwrap();
                    }
                    h.sync().unwrap();
                    (log, paths)
                })
            })
            .collect();
        let mut images = Vec::new();
        while images.len() < 5 {
            images.push(taker.snapshot().unwrap());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut log = Log::new();
        let mut paths = Paths::default();
        for p in publishers {
            let (l, ps) = p.join().unwrap();
            log.extend(l);
            paths.0.extend(ps.0);
        }
        images.push(taker.snapshot().unwrap());
        let mut cut_sizes = Vec::new();
        for image in &images {
            let mut model = Model::default();
            let mut batches = 0;
            for m in image.cores.iter().flat_map(|c| &c.marks) {
                assert_eq!(m.stream, 0);
                assert_eq!(m.digest, Some(m.seq ^ 0xabc), "the mark keeps its digest");
                for (k, batch) in &log[&m.worker][..=m.seq as usize] {
                    batches += 1;
                    for ev in batch {
                        model.apply(*k, ev);
                    }
                }
            }
            cut_sizes.push(batches);
            let mut b = restored(cores, image);
            check(&mut b.query[0], &mut b.ingest[0], &model, &paths);
            empty_and_consistent(&mut b);
        }
        // The last image follows every batch; the original ends empty too.
        assert_eq!(cut_sizes.last(), Some(&1_200), "{cut_sizes:?}");
        let mut original = Started {
            ingest: vec![taker],
            ..started
        };
        empty_and_consistent(&mut original);
    }
}

/// A snapshot whose counts lie (a directory claiming 4 billion entries, a holder claiming
/// 4 billion copies, fewer core images than cores) restores quickly or is refused with
/// [`engine::EngineError::BadSnapshot`]: no allocation sized by a count the file cannot
/// back, no loop over one.
#[test]
fn crafted_counts_in_a_snapshot_are_refused_or_cheap() {
    use engine::snapshot::{CoreImage, EntryRec, HolderRec, KeyRec, NodeRec};
    let started = std::time::Instant::now();
    let one_core = |core: CoreImage| snapshot::EngineImage {
        shards: 1,
        policy: "p".into(),
        cores: vec![core],
        ..Default::default()
    };
    let refused = |image: &snapshot::EngineImage, cores: usize| {
        let bytes = snapshot::encode(image, b"").unwrap();
        let mut buf = AlignedVec::<16>::new();
        buf.extend_from_slice(&bytes);
        let (archived, _) = snapshot::decode(&buf).unwrap();
        match start_from(policy(cores), config(), Some(archived)) {
            Err(engine::EngineError::BadSnapshot(why)) => why,
            Err(e) => panic!("expected BadSnapshot, got {e}"),
            Ok(_) => panic!("a crafted snapshot was restored"),
        }
    };
    // A directory length past the entries left: refused before anything is reserved.
    let why = refused(
        &one_core(CoreImage {
            keys: vec![KeyRec {
                worker: 1,
                rank: 0,
                len: u32::MAX,
            }],
            entries: vec![EntryRec {
                engine: 7,
                seq: 7,
                route: 0,
                count: 1,
            }],
            ..CoreImage::default()
        }),
        1,
    );
    assert!(why.contains("4294967295 directory entries"), "{why}");
    // Fewer core images than cores.
    let two_shards = snapshot::EngineImage {
        shards: 2,
        ..one_core(CoreImage::default())
    };
    let why = refused(&two_shards, 2);
    assert!(why.contains("(1 core images), this runtime has 2"), "{why}");
    // A holder with u32::MAX copies: restored in one step (it was u32::MAX stores).
    let seq = 0xabcd;
    let mut b = restored(
        1,
        &one_core(CoreImage {
            nodes: vec![NodeRec {
                parent: 0,
                root: true,
                len: 1,
                holders: 1,
            }],
            seqs: vec![seq],
            holders: vec![HolderRec {
                worker: 1,
                rank: 0,
                count: u32::MAX,
            }],
            ..CoreImage::default()
        }),
    );
    let m = b.query[0].find_matches(&[engine::SeqHash(seq)]).unwrap();
    assert_eq!(m.overlaps, vec![(key(1, 0), 1)]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}
