//! The threaded runtime under real concurrency: several ingest and query threads at once,
//! backpressure from tiny rings, and shutdown that loses nothing.

use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::runtime::{RuntimeConfig, start};
use engine::sharding::fixed_depth::FixedDepth;
use engine::sharding::sharded::ShardedIndex;
use engine::{EngineHash, SeqHash, TokensHash, WorkerKey};

/// The chain of blocks with these token ids under `parent`, as worker `w` names them (its
/// engine hash of a block is the seq_hash xor `w`), and their seq_hashes.
fn chain(
    w: u64,
    parent: Option<SeqHash>,
    ids: impl IntoIterator<Item = u64>,
) -> (Vec<StoredBlock>, Vec<SeqHash>) {
    let mut prev = parent;
    let (mut blocks, mut seqs) = (vec![], vec![]);
    for t in ids {
        let s = seq_hash(prev, TokensHash(t));
        blocks.push(StoredBlock {
            engine_hash: EngineHash(s.0 ^ w),
            tokens_hash: TokensHash(t),
        });
        seqs.push(s);
        prev = Some(s);
    }
    (blocks, seqs)
}

/// Worker `w`'s events: 20 sequences of 12 blocks sharing a 3-block prompt (stored once),
/// then the removal of every other sequence's tail.
fn events(w: u64) -> (Vec<(WorkerKey, KvEvent)>, Vec<Vec<SeqHash>>) {
    let key = WorkerKey::new(w, (w % 2) as u32);
    let mut out = vec![];
    let mut queries = vec![];
    let chain = |parent: Option<SeqHash>, ids: &[u64]| chain(w, parent, ids.iter().copied());
    let (prompt, prompt_seqs) = chain(None, &[1, 2, 3]);
    out.push((
        key,
        KvEvent::Stored {
            parent: None,
            blocks: prompt,
        },
    ));
    let last = prompt_seqs[2];
    for i in 0..20u64 {
        let ids: Vec<u64> = (0..9).map(|j| 1000 * (w + 1) + 10 * i + j).collect();
        let (tail, tail_seqs) = chain(Some(last), &ids);
        let parent = Some(EngineHash(last.0 ^ w));
        out.push((
            key,
            KvEvent::Stored {
                parent,
                blocks: tail.clone(),
            },
        ));
        let mut q = prompt_seqs.clone();
        q.extend(&tail_seqs);
        queries.push(q);
        if i % 2 == 0 {
            let blocks = tail.iter().map(|b| b.engine_hash).collect();
            out.push((key, KvEvent::Removed { blocks }));
        }
    }
    (out, queries)
}

#[test]
fn concurrent_ingest_and_queries_end_where_one_thread_does() {
    for (shards, depth) in [(1, 0), (2, 3), (3, 1), (8, 3)] {
        let policy = FixedDepth::new(shards, depth).unwrap();
        let config = RuntimeConfig {
            ring_capacity: 4,
            pin_cores: false,
            ingest_handles: 2,
            query_handles: 2,
            ..RuntimeConfig::default()
        };
        let st = start(policy, config).unwrap();
        let mut reference = ShardedIndex::new(policy);
        let mut all_queries = vec![];
        let mut per_ingest: Vec<Vec<(WorkerKey, KvEvent)>> = vec![vec![], vec![]];
        for w in 0..6u64 {
            let (ev, q) = events(w);
            for (k, e) in &ev {
                reference.apply(*k, e).unwrap();
            }
            per_ingest[(w % 2) as usize].extend(ev);
            all_queries.extend(q);
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut ingest_threads = vec![];
        for (mut h, evs) in st.ingest.into_iter().zip(per_ingest) {
            ingest_threads.push(std::thread::spawn(move || {
                for (k, e) in &evs {
                    h.apply(*k, e).unwrap();
                }
                h.sync().unwrap();
                h
            }));
        }
        let mut query_threads = vec![];
        for mut h in st.query {
            let qs = all_queries.clone();
            let stop = stop.clone();
            query_threads.push(std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || n == 0 {
                    for q in &qs {
                        let m = h.find_matches(q).unwrap();
                        assert!(m.best() as usize <= q.len());
                        n += 1;
                    }
                }
                h
            }));
        }
        let ingest: Vec<_> = ingest_threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut query: Vec<_> = query_threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        // Both ingest handles synced: every answer now equals the single-threaded engine's.
        for q in &all_queries {
            assert_eq!(
                query[0].find_matches(q).unwrap(),
                reference.find_matches(q),
                "{shards} shards"
            );
        }
        let stats = query[1].core_stats().unwrap();
        let applied: u64 = stats.iter().map(|s| s.applied).sum();
        let want: u64 = reference.shards().iter().map(|s| s.applied()).sum();
        assert_eq!(applied, want);
        drop(ingest);
        drop(query);
        let summaries = st.runtime.join().unwrap();
        assert_eq!(summaries.len(), shards);
        assert!(summaries.iter().all(|s| s.inconsistencies == 0));
    }
}

#[test]
fn shutdown_drains_everything_sent() {
    for cores in [1, 2, 3] {
        let policy = FixedDepth::new(cores, 0).unwrap();
        let config = RuntimeConfig {
            ring_capacity: 2,
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 0,
            ..RuntimeConfig::default()
        };
        let mut st = start(policy, config).unwrap();
        let mut h = st.ingest.pop().unwrap();
        let mut reference = ShardedIndex::new(policy);
        let mut all = vec![];
        for w in 0..4 {
            for (k, e) in events(w).0 {
                reference.apply(k, &e).unwrap();
                all.push((k, e));
            }
        }
        // Fire and forget, then drop without syncing: the cores must still apply every
        // operation (their own and their peers') before exiting.
        h.send(&std::sync::Arc::from(all)).unwrap();
        drop(h);
        let summaries = st.runtime.join().unwrap();
        let want: u64 = reference.shards().iter().map(|s| s.applied()).sum();
        assert_eq!(
            summaries.iter().map(|s| s.applied).sum::<u64>(),
            want,
            "{cores} cores"
        );
        assert!(summaries.iter().all(|s| s.inconsistencies == 0));
    }
}

#[test]
fn shared_slices_reach_each_workers_home_core() {
    let policy = FixedDepth::new(3, 1).unwrap();
    let config = RuntimeConfig {
        ring_capacity: 4,
        pin_cores: false,
        ingest_handles: 1,
        query_handles: 1,
        ..RuntimeConfig::default()
    };
    let mut st = start(policy, config).unwrap();
    let mut h = st.ingest.pop().unwrap();
    let mut q = st.query.pop().unwrap();
    let mut reference = ShardedIndex::new(policy);
    let mut all = vec![];
    let mut queries = vec![];
    for w in 0..9 {
        let (ev, qs) = events(w);
        for (k, e) in &ev {
            reference.apply(*k, e).unwrap();
        }
        all.extend(ev);
        queries.extend(qs);
    }
    h.send(&std::sync::Arc::from(all)).unwrap();
    h.sync().unwrap();
    for qs in &queries {
        assert_eq!(q.find_matches(qs).unwrap(), reference.find_matches(qs));
    }
    assert_eq!(h.rejects().unwrap().total(), 0);
    let dirs: usize = h
        .core_stats()
        .unwrap()
        .iter()
        .map(|s| s.directory_entries)
        .sum();
    assert_eq!(dirs, reference.stats().directory_entries);
    drop((h, q));
    st.runtime.join().unwrap();
}

#[test]
fn bad_configurations_are_refused() {
    let policy = FixedDepth::new(2, 0).unwrap();
    let none = RuntimeConfig {
        ingest_handles: 0,
        query_handles: 0,
        ..RuntimeConfig::default()
    };
    assert!(start(policy, none).is_err());
    let empty_ring = RuntimeConfig {
        ring_capacity: 0,
        ..RuntimeConfig::default()
    };
    assert!(start(policy, empty_ring).is_err());
}

#[test]
fn odd_queries_and_events_get_answers_not_panics() {
    let policy = FixedDepth::new(3, 2).unwrap();
    let config = RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    };
    let mut st = start(policy, config).unwrap();
    let mut q = st.query.pop().unwrap();
    let mut h = st.ingest.pop().unwrap();
    // Empty and very long queries against an empty index.
    assert_eq!(q.find_matches(&[]).unwrap(), engine::Matches::default());
    let long: Vec<SeqHash> = (0..1_000_000u64).map(SeqHash).collect();
    assert_eq!(q.find_matches(&long).unwrap(), engine::Matches::default());
    // Events for a worker nobody has heard of: counted, nothing stuck.
    let unknown = WorkerKey::new(404, 0);
    let a = h
        .apply(
            unknown,
            &KvEvent::Removed {
                blocks: vec![EngineHash(1); 3],
            },
        )
        .unwrap();
    assert_eq!((a.blocks, a.unknown), (0, 3));
    assert!(
        h.apply(
            unknown,
            &KvEvent::Stored {
                parent: Some(EngineHash(9)),
                blocks: vec![StoredBlock {
                    engine_hash: EngineHash(10),
                    tokens_hash: TokensHash(1)
                }],
            }
        )
        .is_err()
    );
    assert_eq!(h.clear(unknown).unwrap(), 0);
    assert_eq!(h.remove_worker(engine::WorkerId(404)).unwrap(), 0);
    h.sync().unwrap();
    assert_eq!(h.rejects().unwrap().total(), 4);
    drop((q, h));
    assert!(
        st.runtime
            .join()
            .unwrap()
            .iter()
            .all(|s| s.inconsistencies == 0)
    );
}

/// Cores hosted on threads the test owns: each thread sends its share of the events
/// through its own core (which steps while it waits), then every thread checks every query
/// against the single-threaded engine, as do the handles for threads that are not cores.
#[test]
fn hosted_cores_answer_as_one_thread_does() {
    use engine::runtime::start_hosted;
    use std::sync::{Arc, Barrier};
    for (shards, depth) in [(1, 0), (2, 3), (3, 1)] {
        let policy = FixedDepth::new(shards, depth).unwrap();
        let config = RuntimeConfig {
            ring_capacity: 4,
            pin_cores: false,
            ..RuntimeConfig::default()
        };
        let hosted = start_hosted(policy, config).unwrap();
        let mut reference = ShardedIndex::new(policy);
        let mut all_queries = vec![];
        let mut per_core: Vec<Vec<(WorkerKey, KvEvent)>> = vec![vec![]; shards];
        for w in 0..6u64 {
            let (ev, q) = events(w);
            for (k, e) in &ev {
                reference.apply(*k, e).unwrap();
            }
            // Worker w's events enter through core (w + 1) % shards: not always its home.
            per_core[((w + 1) % shards as u64) as usize].extend(ev);
            all_queries.extend(q);
        }
        let expected: Vec<_> = all_queries
            .iter()
            .map(|q| reference.find_matches(q))
            .collect();
        let synced = Arc::new(Barrier::new(shards + 1));
        let checked = Arc::new(Barrier::new(shards + 1));
        let mut threads = vec![];
        for (mut host, evs) in hosted.cores.into_iter().zip(per_core) {
            let (queries, expected) = (all_queries.clone(), expected.clone());
            let (synced, checked) = (synced.clone(), checked.clone());
            threads.push(std::thread::spawn(move || {
                host.send(&Arc::from(evs)).unwrap();
                host.sync().unwrap();
                // Every core keeps serving while the others finish sending.
                let wait = |host: &mut engine::runtime::CoreHost<FixedDepth>, b: &Barrier| {
                    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    std::thread::scope(|s| {
                        s.spawn(|| {
                            b.wait();
                            done.store(true, std::sync::atomic::Ordering::Release);
                        });
                        while !done.load(std::sync::atomic::Ordering::Acquire) {
                            host.step();
                        }
                    });
                };
                wait(&mut host, &synced);
                for (q, want) in queries.iter().zip(&expected) {
                    assert_eq!(&host.find_matches(q).unwrap(), want);
                }
                wait(&mut host, &checked);
                host.run_to_end()
            }));
        }
        let (mut ingest, mut query) = (hosted.ingest, hosted.query);
        synced.wait();
        ingest.sync().unwrap();
        for (q, want) in all_queries.iter().zip(&expected) {
            assert_eq!(&query.find_matches(q).unwrap(), want, "{shards} shards");
        }
        checked.wait();
        drop((ingest, query));
        let summaries: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(summaries.iter().all(|s| s.inconsistencies == 0));
        let applied: u64 = summaries.iter().map(|s| s.applied).sum();
        let want: u64 = reference.shards().iter().map(|s| s.applied()).sum();
        assert_eq!(applied, want, "{shards} shards");
    }
}

/// A long slice of events is applied a bounded share per round, in order, with the core
/// usable in between: after one round of a 4,000-block slice the first sequence is
/// indexed and the last is not; stepping on applies the rest (shard_loop invariant 4).
#[test]
fn a_long_slice_is_applied_across_rounds_in_order() {
    use engine::runtime::start_hosted;
    use std::sync::Arc;
    let policy = FixedDepth::new(1, 0).unwrap();
    let config = RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    };
    let mut hosted = start_hosted(policy, config).unwrap();
    let mut host = hosted.cores.remove(0);
    let key = WorkerKey::new(3, 0);
    let mut slice = vec![];
    let mut queries = vec![];
    for s in 0..40u64 {
        let mut prev = None;
        let mut blocks = vec![];
        let mut seqs = vec![];
        for b in 0..100u64 {
            let t = TokensHash(s * 1_000 + b);
            let h = seq_hash(prev, t);
            blocks.push(StoredBlock {
                engine_hash: EngineHash(h.0),
                tokens_hash: t,
            });
            seqs.push(h);
            prev = Some(h);
        }
        slice.push((
            key,
            KvEvent::Stored {
                parent: None,
                blocks,
            },
        ));
        queries.push(seqs);
    }
    let overlap = |host: &mut engine::runtime::CoreHost<FixedDepth>, q: &[SeqHash]| {
        host.find_matches(q).unwrap().overlap(key)
    };
    host.send(&Arc::from(slice)).unwrap();
    // One core owns the only shard: queries are read in place and do not step it.
    assert_eq!(
        overlap(&mut host, &queries[0]),
        0,
        "nothing applied before a round"
    );
    host.step();
    assert_eq!(overlap(&mut host, &queries[0]), 100);
    assert_eq!(
        overlap(&mut host, &queries[39]),
        0,
        "one round took the whole slice"
    );
    while host.step() {}
    for q in &queries {
        assert_eq!(overlap(&mut host, q), 100);
    }
    drop(hosted);
    host.run_to_end();
}

/// Events far longer than a core's apply chunk (`QUERY_CHUNK_BLOCKS`, 128): 300-block
/// chains, 200-block tails under a block in the middle of one, removals of 190 blocks. A
/// core applies them a chunk at a time, answering queries between chunks (shard_loop
/// invariant 4); once synced, every answer and the applied count equal the
/// single-threaded engine's, on one shard and across shards.
#[test]
fn long_events_applied_in_chunks_answer_as_one_thread_does() {
    let mut events = vec![];
    let mut queries = vec![];
    for w in 0..4u64 {
        let key = WorkerKey::new(w, 0);
        // Workers 0 and 1 share their root chain's tokens, so shards see shared blocks.
        let (root, root_seqs) = chain(w, None, 0..300);
        events.push((
            key,
            KvEvent::Stored {
                parent: None,
                blocks: root,
            },
        ));
        queries.push(root_seqs.clone());
        let fork = root_seqs[149];
        for t in 0..3u64 {
            let base = 10_000 * (w + 1) + 1_000 * t;
            let (tail, tail_seqs) = chain(w, Some(fork), base..base + 200);
            let mut q = root_seqs[..150].to_vec();
            q.extend(&tail_seqs);
            queries.push(q);
            events.push((
                key,
                KvEvent::Stored {
                    parent: Some(EngineHash(fork.0 ^ w)),
                    blocks: tail.clone(),
                },
            ));
            if t == 1 {
                // The tail's last 190 blocks, deepest first (as vLLM evicts).
                let blocks = tail[10..].iter().rev().map(|b| b.engine_hash).collect();
                events.push((key, KvEvent::Removed { blocks }));
            }
        }
    }
    for (shards, depth) in [(1, 0), (2, 3), (3, 160)] {
        let policy = FixedDepth::new(shards, depth).unwrap();
        let mut reference = ShardedIndex::new(policy);
        for (k, e) in &events {
            reference.apply(*k, e).unwrap();
        }
        let config = RuntimeConfig {
            pin_cores: false,
            ..RuntimeConfig::default()
        };
        let mut st = start(policy, config).unwrap();
        let mut ingest = st.ingest.remove(0);
        // As a transport's decoder delivers them: one shared slice (the chunked path).
        ingest.send(&std::sync::Arc::from(events.clone())).unwrap();
        ingest.sync().unwrap();
        let query = &mut st.query[0];
        for q in &queries {
            let want = reference.find_matches(q);
            assert!(want.best() > 128, "the queries reach past one chunk");
            assert_eq!(query.find_matches(q).unwrap(), want, "{shards} shards");
        }
        let applied: u64 = query.core_stats().unwrap().iter().map(|s| s.applied).sum();
        let want: u64 = reference.shards().iter().map(|s| s.applied()).sum();
        assert_eq!(applied, want, "{shards} shards");
        drop(ingest);
        drop(st.query);
        let summaries = st.runtime.join().unwrap();
        assert!(summaries.iter().all(|s| s.inconsistencies == 0));
    }
}

/// Operations for a parked hosted core do not wake it until its ring is half full
/// (shard_loop invariant 10), and a read in place on that core still sees them:
/// `CoreHost` steps a parked core that has peer messages before it reads. Two hosted cores
/// on the test's thread, rings of 4 messages; the worker is homed on core 0 and its chains
/// live in shard 1.
#[test]
fn a_parked_core_is_not_woken_by_operations_and_its_reads_in_place_see_them() {
    use engine::runtime::start_hosted;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    let policy = FixedDepth::new(2, 0).unwrap();
    let config = RuntimeConfig {
        pin_cores: false,
        ring_capacity: 4,
        ..RuntimeConfig::default()
    };
    let mut hosted = start_hosted(policy, config).unwrap();
    let (key, chains) = homed_on_0_stored_in_1(policy);
    let mut host1 = hosted.cores.pop().unwrap();
    let mut host0 = hosted.cores.pop().unwrap();
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let task = Waker::from(count.clone());
    assert!(host1.sleep_as(&task), "nothing is queued for core 1 yet");
    let store = |host: &mut engine::runtime::CoreHost<FixedDepth>, blocks: &[StoredBlock]| {
        let event = KvEvent::Stored {
            parent: None,
            blocks: blocks.to_vec(),
        };
        host.apply(key, &event).unwrap();
    };
    store(&mut host0, &chains[0].0);
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        0,
        "one message on a ring of 4 did not wake core 1"
    );
    store(&mut host0, &chains[1].0);
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "a half-full ring woke core 1"
    );
    for (_, seqs) in &chains {
        assert_eq!(
            host1.find_matches(seqs).unwrap().overlap(key),
            5,
            "the read in place applied them first"
        );
    }
    host1.awake();
    drop(hosted);
    let ends = std::thread::spawn(move || host1.run_to_end());
    let s0 = host0.run_to_end();
    let s1 = ends.join().unwrap();
    assert_eq!(s0.inconsistencies + s1.inconsistencies, 0);
}

/// A hosted query for another core's shard is read in place (hosted invariant 3): it is
/// answered at once, without that core taking a step, and sees what that core applied;
/// operations still on the ring of a running core are seen after its next round; and a
/// parked core that holds this host's operations is asked over the ring instead, which
/// answers after applying them. Two hosted cores on the test's thread; the worker is homed
/// on core 0 and its chains live in shard 1.
#[test]
fn a_query_for_another_cores_shard_is_read_in_place_unless_that_core_is_parked_behind_our_operations()
 {
    use engine::runtime::{Lookup, start_hosted};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    struct Nobody;
    impl Wake for Nobody {
        fn wake(self: Arc<Self>) {}
    }

    let policy = FixedDepth::new(2, 0).unwrap();
    let config = RuntimeConfig {
        pin_cores: false,
        ..RuntimeConfig::default()
    };
    let mut hosted = start_hosted(policy, config).unwrap();
    let (key, chains) = homed_on_0_stored_in_1(policy);
    let mut host1 = hosted.cores.pop().unwrap();
    let mut host0 = hosted.cores.pop().unwrap();
    let store = |host: &mut engine::runtime::CoreHost<FixedDepth>, blocks: &[StoredBlock]| {
        let event = KvEvent::Stored {
            parent: None,
            blocks: blocks.to_vec(),
        };
        host.apply(key, &event).unwrap();
    };
    let overlap = |l: Lookup| match l {
        Lookup::Done(m) => Some(m.unwrap().overlap(key)),
        Lookup::Sent(_) => None,
    };

    // Parked behind our operations: asked, and it answers once it has applied them.
    let task = Waker::from(Arc::new(Nobody));
    assert!(host1.sleep_as(&task), "nothing is queued for core 1 yet");
    store(&mut host0, &chains[0].0);
    let sent = match host0.start_query(&chains[0].1) {
        Lookup::Sent(s) => s,
        Lookup::Done(_) => {
            panic!("read in place on a parked core that has not taken our operations")
        }
    };
    assert_eq!(sent.core(), 1);
    host1.awake();
    let mut answer = None;
    for _ in 0..1_000 {
        host1.step();
        answer = host0.poll_query(&sent);
        if answer.is_some() {
            break;
        }
    }
    let answer = answer.expect("core 1 answered within 1,000 of its rounds");
    assert_eq!(
        answer.unwrap().overlap(key),
        5,
        "answered after our operations"
    );

    // Running, everything taken: read in place, with no step of core 1.
    assert_eq!(overlap(host0.start_query(&chains[0].1)), Some(5));
    assert_eq!(host0.find_matches(&chains[0].1).unwrap().overlap(key), 5);

    // Running, our operations on its ring: read in place, and seen after its next round.
    store(&mut host0, &chains[1].0);
    assert_eq!(overlap(host0.start_query(&chains[1].1)), Some(0));
    host1.step();
    assert_eq!(overlap(host0.start_query(&chains[1].1)), Some(5));

    let queries_of = |s: &engine::runtime::CoreSummary| s.queries;
    drop(hosted);
    let ends = std::thread::spawn(move || host1.run_to_end());
    let s0 = host0.run_to_end();
    let s1 = ends.join().unwrap();
    assert_eq!(s0.inconsistencies + s1.inconsistencies, 0);
    assert_eq!(
        (queries_of(&s0), queries_of(&s1)),
        (4, 1),
        "core 0 answered the reads in place, core 1 the one it was asked"
    );
}

/// A chain's blocks as a worker sends them, and its seq_hashes.
type Chain = (Vec<StoredBlock>, Vec<SeqHash>);

/// A worker homed on core 0 of 2, and two 5-block root chains of it that live in shard 1
/// (root seq_hashes are the tokens' hashes: spread them over the shards).
fn homed_on_0_stored_in_1(policy: FixedDepth) -> (WorkerKey, Vec<Chain>) {
    use engine::runtime::home_core;
    use engine::sharding::ShardPolicy;
    let w = (0..1_000u64)
        .find(|&w| home_core(engine::WorkerId(w), 2).idx() == 0)
        .unwrap();
    let chains: Vec<_> = (1..1_000u64)
        .map(|t| {
            let first = t.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            chain(w, None, first..first + 5)
        })
        .filter(|(_, seqs)| policy.query_shard(seqs).idx() == 1)
        .take(2)
        .collect();
    assert_eq!(chains.len(), 2);
    (WorkerKey::new(w, 0), chains)
}
