//! Issue 12's crash test: three vLLM-format publishers (real ZMQ PUB + replay sockets, as
//! vLLM's `ZmqEventPublisher`) publish a random workload of stores and removals while the
//! router is killed with SIGKILL at random points and restarted on the same `--state-dir`.
//! At the end the router's index must equal the reference model of everything published:
//! nothing lost (every acknowledged batch is in, from the snapshot or replayed after it),
//! nothing stale (no block a worker removed, no copy counted twice).
//!
//! The check asks `/v1/overlap` for every chain ever stored and compares each worker's
//! overlap with the model's; it also asks the restarted routers' metrics that the snapshot
//! was used (workers resumed, none cleared) and that no stream had to be resynced.

use engine::hash::{BASE_SEED, seq_hash, tokens_hash};
use engine::{SeqHash, TokensHash};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
mod common;

use common::Router;
use std::time::{Duration, Instant};
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::VllmPublisher;

const BS: usize = 16;
const WORKERS: u64 = 3;

/// A router on `state` subscribed to `publishers` (worker ids 1, 2, ...).
fn start_router(state: &std::path::Path, publishers: &[(String, String)]) -> Router {
    let state = state.to_string_lossy().into_owned();
    let mut args: Vec<String> = [
        "--tokenizer",
        "stand-in",
        "--snapshot-interval-s",
        "1",
        "--state-dir",
        &state,
    ]
    .map(str::to_owned)
    .to_vec();
    for (i, (publish, replay)) in publishers.iter().enumerate() {
        args.push("--zmq-worker".into());
        args.push(format!("{}={publish},replay={replay}", i + 1));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Router::start(&args)
}

/// Each worker's overlap (blocks) with `tokens`.
fn overlaps(router: &Router, tokens: &[u32]) -> Option<BTreeMap<u64, u32>> {
    let body = format!(
        "{{\"token_ids\": [{}]}}",
        tokens
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let (status, text) = router.try_call("POST", "/v1/overlap", &body)?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(
        v["scores"]
            .as_array()?
            .iter()
            .filter_map(|s| {
                Some((
                    s["worker_id"].as_u64()?,
                    s["overlap_blocks"].as_u64()? as u32,
                ))
            })
            .filter(|&(_, o)| o > 0)
            .collect(),
    )
}

/// One worker's cache as the model sees it: engine hash -> (its token path, copies).
#[derive(Default, Clone)]
struct Cache {
    blocks: HashMap<u64, (Vec<u32>, u32)>,
    /// Engine hash -> the seqs of the batches that stored or removed it (for the failure
    /// message: which batch a missing block came from).
    history: HashMap<u64, Vec<(u64, char)>>,
}

fn block_tokens(choice: u32, depth: usize) -> Vec<u32> {
    (0..BS as u32)
        .map(|i| 1 + choice * 1_000 + depth as u32 * 16 + i)
        .collect()
}

fn seqs(path: &[u32]) -> Vec<SeqHash> {
    let mut prev = None;
    path.chunks(BS)
        .map(|b| {
            let t: TokensHash = tokens_hash(b, BASE_SEED);
            let s = seq_hash(prev, t);
            prev = Some(s);
            s
        })
        .collect()
}

/// A random batch for `cache`, applied to it.
fn next_batch(
    rng: &mut SmallRng,
    cache: &mut Cache,
    paths: &mut HashSet<Vec<u32>>,
    seq: u64,
) -> WireBatch {
    let mut events = Vec::new();
    for _ in 0..rng.random_range(1..3) {
        let held: Vec<u64> = cache.blocks.keys().copied().collect();
        if held.is_empty() || rng.random_bool(0.65) {
            let parent = (!held.is_empty() && rng.random_bool(0.6))
                .then(|| held[rng.random_range(0..held.len())]);
            let mut path = parent.map_or_else(Vec::new, |p| cache.blocks[&p].0.clone());
            let mut hashes = Vec::new();
            let mut tokens = Vec::new();
            let mut chain = Vec::new();
            for _ in 0..rng.random_range(1..4) {
                let depth = path.len() / BS;
                let t = block_tokens(rng.random_range(0..3), depth);
                path.extend_from_slice(&t);
                tokens.extend_from_slice(&t);
                let engine = seqs(&path).last().unwrap().0;
                hashes.push(engine);
                chain.push((engine, path.clone()));
                paths.insert(path.clone());
            }
            // DESIGN.md's multiset, with kvengine's one refinement: a chain from the root
            // whose every block is held already is a report (vLLM's
            // `kv_cache_report_mode: "full"`), not new copies ('P' in the history).
            let report = parent.is_none() && hashes.iter().all(|h| cache.blocks.contains_key(h));
            for (engine, path) in chain {
                if !report {
                    cache.blocks.entry(engine).or_insert((path, 0)).1 += 1;
                }
                let mark = if report { 'P' } else { 'S' };
                cache.history.entry(engine).or_default().push((seq, mark));
            }
            events.push(WireEvent::Stored {
                block_hashes: hashes,
                parent,
                token_ids: tokens,
                block_size: Some(BS as u32),
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                extra_keys: None,
            });
        } else {
            let gone: Vec<u64> = (0..rng.random_range(1..3))
                .map(|_| held[rng.random_range(0..held.len())])
                .collect();
            for g in &gone {
                cache.history.entry(*g).or_default().push((seq, 'R'));
                if let Some(e) = cache.blocks.get_mut(g) {
                    e.1 -= 1;
                    if e.1 == 0 {
                        cache.blocks.remove(g);
                    }
                }
            }
            events.push(WireEvent::Removed {
                block_hashes: gone,
                medium: Some("GPU".into()),
            });
        }
    }
    WireBatch {
        ts: None,
        dp_rank: Some(0),
        events,
        unknown_events: 0,
    }
}

/// The model's overlap of each worker with `path`.
fn expected(caches: &[Cache], path: &[u32]) -> BTreeMap<u64, u32> {
    let want = seqs(path);
    caches
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let held: HashSet<u64> = c.blocks.keys().copied().collect();
            let o = want.iter().take_while(|s| held.contains(&s.0)).count() as u32;
            (o > 0).then_some((i as u64 + 1, o))
        })
        .collect()
}

/// It failed intermittently (about 1 run in 15 under load) until two causes were fixed: a
/// new subscription missed the batches its publisher sent before the SUB socket's
/// subscription took effect, and took its first batch as the stream's start (now it
/// replays from 0, `transport::stream`); and a snapshot could cut a marked batch of more
/// than 64 events between two of its chunks (now sent whole). The first showed here as one
/// worker missing the last block of a chain, with `unknown_parent` refusals; this test now
/// asserts there are none. On a failure it prints the batches that stored and removed the
/// chain's blocks and where each router life began and ended; set
/// `KVENGINE_TEST_ROUTER_LOGS` to a directory to keep the routers' logs.
#[test]
fn killed_routers_restart_from_the_snapshot_with_nothing_lost_or_stale() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let state = std::env::temp_dir().join(format!("kvengine-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let mut publishers = Vec::new();
    for _ in 0..WORKERS {
        let p = rt
            .block_on(VllmPublisher::bind(
                "tcp://127.0.0.1:0",
                Some("tcp://127.0.0.1:0"),
                100_000,
            ))
            .unwrap();
        publishers.push(p);
    }
    let endpoints: Vec<(String, String)> = publishers
        .iter()
        .map(|p| {
            (
                p.endpoint().to_owned(),
                p.replay_endpoint().unwrap().to_owned(),
            )
        })
        .collect();
    // A new workload and new kill points each run; the seed is printed to replay one.
    let seed = std::env::var("KVENGINE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("KVENGINE_CRASH_SEED={seed}");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut caches = vec![Cache::default(); WORKERS as usize];
    let mut paths = HashSet::new();
    let mut router = start_router(&state, &endpoints);
    let mut restarts = Vec::new();
    // Where each life ended and began, as each publisher's next seq (failure message).
    let mut lives: Vec<String> = Vec::new();
    let mut published = 0u64;
    for round in 0..4 {
        // Publish for a random while (the router snapshots every second), then kill it
        // mid-stream; keep publishing while it is down (the replay buffers keep it all).
        let run_for = Duration::from_millis(rng.random_range(1_200..2_600));
        let began = Instant::now();
        while began.elapsed() < run_for {
            for (w, p) in publishers.iter_mut().enumerate() {
                let b = next_batch(&mut rng, &mut caches[w], &mut paths, p.next_seq());
                rt.block_on(p.publish(&b)).unwrap();
                published += 1;
            }
            std::thread::sleep(Duration::from_millis(3));
        }
        if round == 3 {
            break;
        }
        router.kill9();
        lives.push(format!(
            "killed at {:?}",
            publishers.iter().map(|p| p.next_seq()).collect::<Vec<_>>()
        ));
        for _ in 0..rng.random_range(10..60) {
            for (w, p) in publishers.iter_mut().enumerate() {
                let b = next_batch(&mut rng, &mut caches[w], &mut paths, p.next_seq());
                rt.block_on(p.publish(&b)).unwrap();
                published += 1;
            }
        }
        lives.push(format!(
            "restarted at {:?}",
            publishers.iter().map(|p| p.next_seq()).collect::<Vec<_>>()
        ));
        router = start_router(&state, &endpoints);
        assert!(
            router.out.contains("restored"),
            "round {round}: no snapshot restored:\n{}",
            router.out
        );
        restarts.push(router.started_in);
        for l in router.out.lines().filter(|l| l.contains("restor")) {
            eprintln!("restart {round}: {l}");
        }
    }
    // Converge: empty batches keep the streams live (a batch lost in the instant between a
    // catch-up replay and the live subscription is found as a gap by the next one).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut all: Vec<Vec<u32>> = paths.into_iter().collect();
    all.sort();
    let mismatch = loop {
        for p in publishers.iter_mut() {
            let b = WireBatch {
                ts: None,
                dp_rank: Some(0),
                events: Vec::new(),
                unknown_events: 0,
            };
            rt.block_on(p.publish(&b)).unwrap();
        }
        std::thread::sleep(Duration::from_millis(200));
        let first_wrong = all.iter().find_map(|path| {
            let got = overlaps(&router, path);
            let want = expected(&caches, path);
            (got.as_ref() != Some(&want)).then_some((path.len() / BS, path.clone(), got, want))
        });
        match first_wrong {
            None => break None,
            Some(w) if Instant::now() > deadline => break Some(w),
            Some(_) => {}
        }
    };
    if let Some((_, path, got, want)) = &mismatch {
        let seqs = seqs(path);
        for (w, cache) in caches.iter().enumerate() {
            let worker = w as u64 + 1;
            let (g, m) = (got.as_ref().and_then(|g| g.get(&worker)), want.get(&worker));
            if g == m {
                continue;
            }
            eprintln!("worker {worker}: router {g:?}, model {m:?}");
            for (depth, s) in seqs.iter().enumerate() {
                eprintln!(
                    "  block {depth} ({:#x}): {:?}",
                    s.0,
                    cache.history.get(&s.0)
                );
            }
        }
        eprintln!("lives: {lives:?}");
    }
    if let Some((_, text)) = router.try_call("GET", "/metrics", "") {
        let wanted = ["resync", "replayed", "rejected", "dropped", "restore"];
        for l in text
            .lines()
            .filter(|l| wanted.iter().any(|w| l.contains(w)))
        {
            eprintln!("{l}");
        }
    }
    assert_eq!(
        mismatch.map(|(blocks, _, got, want)| (blocks, got, want)),
        None,
        "index differs from the model (blocks, router, model); {published} batches, \
         KVENGINE_CRASH_SEED={seed}"
    );
    // Every store's parent was known: no batch went missing on the way, even for a while
    // (removals may name a block twice in one event, so `unknown_block` can be legitimate).
    assert_eq!(
        router.metric("kvengine_events_rejected_total{reason=\"unknown_parent\"}"),
        Some(0.0)
    );
    assert_eq!(router.metric("kvengine_resyncs_total"), Some(0.0));
    assert_eq!(
        router.metric("kvengine_restored_workers"),
        Some(WORKERS as f64)
    );
    assert_eq!(router.metric("kvengine_restore_cleared_workers"), Some(0.0));
    assert!(
        router
            .metric("kvengine_replayed_batches_total")
            .unwrap_or(0.0)
            > 0.0
    );
    eprintln!(
        "{published} batches, {} chains checked, restarts to serving: {restarts:?}",
        all.len()
    );
    drop(router);
    let _ = std::fs::remove_dir_all(&state);
}

/// A snapshot file whose counts lie (a worker's directory claiming 4 billion entries, in a
/// file of a few hundred bytes) is refused and moved aside at start, in the time a start
/// takes: no allocation sized by the count (it aborted the process), no loop over it.
#[test]
fn a_snapshot_file_with_a_crafted_count_is_set_aside_at_start() {
    use engine::snapshot::{self, CoreImage, EngineImage, EntryRec, KeyRec};
    let state = std::env::temp_dir().join(format!("kvengine-crafted-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let dir = state.to_string_lossy().into_owned();
    let args = ["--tokenizer", "stand-in", "--state-dir", dir.as_str()];
    // A genuine snapshot (written at shutdown) gives this run's layout: its meta (JSON after
    // the archive) names the sharding policy, and the shard count is the cores'.
    drop(Router::start(&args));
    let genuine = std::fs::read(state.join("snapshot.kvs")).unwrap();
    let archive_len = u64::from_le_bytes(genuine[16..24].try_into().unwrap()) as usize;
    let meta = genuine[snapshot::HEADER_LEN + archive_len..].to_vec();
    let policy = serde_json::from_slice::<serde_json::Value>(&meta).unwrap()["policy"]
        .as_str()
        .unwrap()
        .to_owned();
    let cores: usize = std::env::var("KVENGINE_TEST_CORES").map_or(2, |c| c.parse().unwrap());
    let mut image = EngineImage {
        shards: cores as u32,
        policy,
        cores: vec![CoreImage::default(); cores],
        ..EngineImage::default()
    };
    image.cores[0].keys.push(KeyRec {
        worker: 1,
        rank: 0,
        len: u32::MAX,
    });
    image.cores[0].entries.push(EntryRec {
        engine: 7,
        seq: 7,
        route: 0,
        count: 1,
    });
    let crafted = snapshot::encode(&image, &meta).unwrap();
    assert!(crafted.len() < 4096, "{} bytes", crafted.len());
    std::fs::write(state.join("snapshot.kvs"), &crafted).unwrap();

    let r = Router::start(&args);
    assert!(
        r.started_in < Duration::from_secs(30),
        "start took {:?}",
        r.started_in
    );
    assert!(
        !r.out.contains("restored"),
        "the crafted snapshot was used: {}",
        r.out
    );
    // Peak memory (Linux): the count must not have been reserved (before the fix, a
    // directory table for 4 billion entries: gigabytes touched, and half a minute).
    if let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", r.child.id())) {
        let peak_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        eprintln!("peak RSS {} MiB", peak_kb >> 10);
        assert!(peak_kb < 1 << 20, "peak RSS {} MiB", peak_kb >> 10);
    }
    assert_eq!(
        std::fs::read(state.join("snapshot.kvs.bad")).unwrap(),
        &crafted[..],
        "moved aside for inspection"
    );
    // It serves (no worker yet: nothing to be ready for, but it answers).
    assert_eq!(r.call("GET", "/v1/workers", "").0, 200);
    drop(r);
    let _ = std::fs::remove_dir_all(&state);
}
