//! The native protocol end to end: real QUIC sockets on loopback, a real engine, the
//! publisher client; results checked against the single-threaded reference index.

mod common;

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, seq_hashes, tokens_hash};
use engine::kv_index::KvIndex;
use engine::{DpRank, EngineHash, WorkerId, WorkerKey};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};
use transport::hub::Hub;
use transport::native::frame::{FrameBuf, encode_client_frame};
use transport::native::{
    ClientFrame, NativeBlock, NativeEvent, PROTOCOL_VERSION, Publisher, PublisherConfig,
    ServerFrame, TlsSource, Trust,
};
use transport::{DropReason, TransportError};

const BS: usize = 16;
const TOKEN: &str = "s3cret-token";

type Env = common::QuicEnv;

async fn env_with(cores: usize, tls: TlsSource) -> Env {
    common::quic_env(cores, TOKEN, tls).await
}

async fn env(cores: usize) -> Env {
    env_with(cores, common::self_signed()).await
}

impl Env {
    fn publisher(&self, worker: u64, ranks: &[u32]) -> PublisherConfig {
        PublisherConfig {
            server: self.server.local_addr(),
            server_name: "localhost".into(),
            trust: Trust::Fingerprint(self.server.fingerprint().to_owned()),
            token: TOKEN.into(),
            worker_id: worker,
            dp_ranks: ranks.to_vec(),
            block_size: BS as u32,
            instance: 0,
        }
    }
}

fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey::new(w, r)
}

/// Prompt `p`: `blocks` blocks; the first `shared` are common to prompts of the same group.
fn prompt(p: u32, blocks: usize, shared: usize) -> Vec<u32> {
    let group = p % 3;
    (0..blocks * BS)
        .map(|i| {
            if i < shared * BS {
                10_000 * (group + 1) + i as u32
            } else {
                1_000_000 * (p + 1) + i as u32
            }
        })
        .collect()
}

/// The engine hash a worker gives block `i` of `tokens` (its seq_hash, as a stand-in).
fn ehash(tokens: &[u32], i: usize) -> u64 {
    seq_hashes(&tokens[..(i + 1) * BS], BS, lora_seed(None))[i].0 ^ 0x5555
}

fn native_store(tokens: &[u32], from: usize, to: usize) -> NativeEvent {
    NativeEvent::Stored {
        parent: (from > 0).then(|| ehash(tokens, from - 1)),
        blocks: (from..to)
            .map(|i| NativeBlock {
                engine_hash: ehash(tokens, i),
                tokens_hash: tokens_hash(&tokens[i * BS..(i + 1) * BS], lora_seed(None)).0,
            })
            .collect(),
    }
}

fn native_remove(tokens: &[u32], blocks: impl IntoIterator<Item = usize>) -> NativeEvent {
    NativeEvent::Removed {
        blocks: blocks.into_iter().map(|i| ehash(tokens, i)).collect(),
    }
}

/// The engine event the server makes of `e` (what the reference index is fed).
fn to_engine(e: &NativeEvent) -> KvEvent {
    match e {
        NativeEvent::StoredTokens {
            parent,
            engine_hashes,
            token_ids,
            lora_name,
        } => KvEvent::Stored {
            parent: parent.map(EngineHash),
            blocks: engine_hashes
                .iter()
                .zip(token_ids.chunks_exact(BS))
                .map(|(h, t)| StoredBlock {
                    engine_hash: EngineHash(*h),
                    tokens_hash: tokens_hash(t, lora_seed(lora_name.as_deref())),
                })
                .collect(),
        },
        NativeEvent::Stored { parent, blocks } => KvEvent::Stored {
            parent: parent.map(EngineHash),
            blocks: blocks
                .iter()
                .map(|b| StoredBlock {
                    engine_hash: EngineHash(b.engine_hash),
                    tokens_hash: engine::TokensHash(b.tokens_hash),
                })
                .collect(),
        },
        NativeEvent::Removed { blocks } => KvEvent::Removed {
            blocks: blocks.iter().map(|&h| EngineHash(h)).collect(),
        },
        NativeEvent::Cleared => KvEvent::Cleared,
    }
}

fn overlaps(hub: &Hub, tokens: &[u32]) -> Vec<(WorkerKey, u32)> {
    let mut v = hub.overlap(None, tokens, None).unwrap().2.overlaps;
    v.sort();
    v
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_removes_and_clears_of_two_ranks_reach_the_index() {
    let env = env(2).await;
    let a = prompt(0, 8, 2);
    let b = prompt(3, 6, 2); // shares a's first two blocks (same group)
    let mut p = Publisher::connect(env.publisher(7, &[0, 1])).await.unwrap();
    assert_eq!(p.server_block_size(), BS as u32);
    assert_eq!(p.send(0, &[native_store(&a, 0, 8)]).await.unwrap(), 0);
    assert_eq!(p.send(1, &[native_store(&a, 0, 3)]).await.unwrap(), 0);
    assert_eq!(
        p.send(1, &[native_store(&b, 0, 2), native_store(&b, 2, 6)])
            .await
            .unwrap(),
        1
    );
    // Rank 0 evicts a's tail; rank 1 clears, then stores b's first 4 blocks again.
    assert_eq!(p.send(0, &[native_remove(&a, 5..8)]).await.unwrap(), 1);
    assert_eq!(
        p.send(1, &[NativeEvent::Cleared, native_store(&b, 0, 4)])
            .await
            .unwrap(),
        2
    );
    let done = p.finish().await.unwrap();
    assert_eq!(done.batches, 5);
    assert_eq!(done.events, 7);
    env.hub.sync().unwrap();

    assert_eq!(overlaps(&env.hub, &a), vec![(key(7, 0), 5), (key(7, 1), 2)]);
    assert_eq!(overlaps(&env.hub, &b), vec![(key(7, 0), 2), (key(7, 1), 4)]);
    let workers = env.hub.workers();
    assert_eq!(workers.len(), 1);
    assert_eq!(
        workers[0].registration.dp_ranks,
        vec![DpRank(0), DpRank(1)],
        "the hello registered both ranks"
    );
    assert_eq!(workers[0].events, 7);
    env.shutdown().await;
}

/// One batch of a plan: the rank and its events.
type Batch = (u32, Vec<NativeEvent>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_streams_match_the_reference_index() {
    let env = env(2).await;
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let prompts: Vec<Vec<u32>> = (0..12).map(|p| prompt(p, 10, 3)).collect();
    let mut reference = KvIndex::new();
    // Two workers, two ranks each, on two connections sending concurrently.
    let mut plans: Vec<(u64, Vec<Batch>)> = Vec::new();
    for worker in [1u64, 2] {
        let mut batches = Vec::new();
        for _ in 0..150 {
            let rank = rng.random_range(0..2u32);
            let n = rng.random_range(0..6);
            let mut events = Vec::new();
            for _ in 0..n {
                let t = &prompts[rng.random_range(0..prompts.len())];
                let ev = match rng.random_range(0..100) {
                    0..45 => {
                        let from = rng.random_range(0..10);
                        let to = rng.random_range(from + 1..=10);
                        // Stores mostly start where something is held; some have unknown
                        // parents and are refused by both indexes.
                        native_store(t, if rng.random_bool(0.7) { 0 } else { from }, to)
                    }
                    45..60 => {
                        let to = rng.random_range(1..=10);
                        NativeEvent::StoredTokens {
                            parent: None,
                            engine_hashes: (0..to).map(|i| ehash(t, i)).collect(),
                            token_ids: t[..to * BS].to_vec(),
                            lora_name: None,
                        }
                    }
                    60..97 => {
                        let from = rng.random_range(0..10);
                        native_remove(t, from..rng.random_range(from + 1..=10))
                    }
                    _ => NativeEvent::Cleared,
                };
                events.push(ev);
            }
            for e in &events {
                let _ = reference.apply(key(worker, rank), &to_engine(e));
            }
            batches.push((rank, events));
        }
        plans.push((worker, batches));
    }
    let mut tasks = Vec::new();
    for (worker, batches) in plans {
        let cfg = env.publisher(worker, &[0, 1]);
        tasks.push(tokio::spawn(async move {
            let mut p = Publisher::connect(cfg).await.unwrap();
            let mut expected_seq = [0u64; 2];
            let mut events = 0;
            for (rank, evs) in &batches {
                let seq = p.send(*rank, evs).await.unwrap();
                assert_eq!(seq, expected_seq[*rank as usize]);
                expected_seq[*rank as usize] += 1;
                events += evs.len() as u64;
            }
            let done = p.finish().await.unwrap();
            assert_eq!(done.batches, batches.len() as u64);
            assert_eq!(done.events, events);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    env.hub.sync().unwrap();
    let mut checked = 0;
    for t in &prompts {
        for blocks in 1..=10 {
            let tokens = &t[..blocks * BS];
            let seqs = seq_hashes(tokens, BS, lora_seed(None));
            let mut want = reference.find_matches(&seqs).overlaps;
            want.sort();
            assert_eq!(
                overlaps(&env.hub, tokens),
                want,
                "prompt prefix of {blocks} blocks"
            );
            checked += want.len();
        }
    }
    assert!(
        checked > 20,
        "the workload left something to compare ({checked})"
    );
    assert_eq!(env.hub.metrics().dropped(DropReason::MalformedFrame), 0);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_others_are_unaffected() {
    let env = env(1).await;
    let a = prompt(0, 4, 0);
    let mut good = Publisher::connect(env.publisher(1, &[])).await.unwrap();
    good.send(0, &[native_store(&a, 0, 2)]).await.unwrap();

    let mut cfg = env.publisher(2, &[]);
    cfg.token = "guess".into();
    let err = Publisher::connect(cfg).await.unwrap_err();
    assert!(matches!(err, TransportError::Unauthorized(_)), "{err:?}");
    assert_eq!(env.hub.metrics().dropped(DropReason::Unauthorized), 1);
    assert!(!env.hub.is_registered(WorkerId(2)));

    // The good connection carries on.
    good.send(0, &[native_store(&a, 2, 4)]).await.unwrap();
    assert_eq!(good.finish().await.unwrap().batches, 2);
    env.hub.sync().unwrap();
    assert_eq!(overlaps(&env.hub, &a), vec![(key(1, 0), 4)]);
    assert_eq!(env.hub.workers().len(), 1);
    env.shutdown().await;
}

/// Sends a raw hello and returns the server's answer.
async fn raw_hello(env: &Env, hello: &ClientFrame) -> ServerFrame {
    let client = transport::native::quic_tls::client_config(&Trust::Fingerprint(
        env.server.fingerprint().to_owned(),
    ))
    .unwrap();
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = endpoint
        .connect_with(client, env.server.local_addr(), "localhost")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut buf = FrameBuf::new();
    encode_client_frame(hello, &mut buf).unwrap();
    send.write_all(&(buf.len() as u32).to_le_bytes())
        .await
        .unwrap();
    send.write_all(&buf).await.unwrap();
    let mut len = [0u8; 4];
    recv.read_exact(&mut len).await.unwrap();
    let mut body = FrameBuf::new();
    body.resize(u32::from_le_bytes(len) as usize, 0);
    recv.read_exact(&mut body).await.unwrap();
    let frame = transport::native::frame::decode_server_frame(&body).unwrap();
    conn.close(0u32.into(), b"");
    frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_version_is_refused() {
    let env = env(1).await;
    let answer = raw_hello(
        &env,
        &ClientFrame::Hello {
            version: PROTOCOL_VERSION + 1,
            worker_id: 3,
            dp_ranks: vec![],
            block_size: BS as u32,
            token: TOKEN.into(),
            instance: 0,
        },
    )
    .await;
    let ServerFrame::Refused { reason } = answer else {
        panic!("{answer:?}")
    };
    let expected = format!("unsupported version {}", PROTOCOL_VERSION + 1);
    assert!(reason.starts_with(&expected), "{reason}");
    assert_eq!(env.hub.metrics().dropped(DropReason::UnsupportedVersion), 1);
    assert!(env.hub.workers().is_empty());
    // And a correct raw hello is acknowledged.
    let answer = raw_hello(
        &env,
        &ClientFrame::Hello {
            version: PROTOCOL_VERSION,
            worker_id: 3,
            dp_ranks: vec![],
            block_size: BS as u32,
            token: TOKEN.into(),
            instance: 0,
        },
    )
    .await;
    assert_eq!(
        answer,
        ServerFrame::HelloAck {
            version: PROTOCOL_VERSION,
            block_size: BS as u32
        }
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_block_size_is_refused_and_shown_on_the_worker() {
    let env = env(1).await;
    let mut cfg = env.publisher(9, &[]);
    cfg.block_size = 32;
    let err = Publisher::connect(cfg).await.unwrap_err();
    let TransportError::Invalid { reason, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(reason.starts_with("block size mismatch"), "{reason}");
    assert_eq!(env.hub.metrics().dropped(DropReason::BlockSizeMismatch), 1);
    let workers = env.hub.workers();
    assert_eq!(workers.len(), 1);
    assert!(
        !workers[0].healthy,
        "a refused worker is kept out of routing"
    );
    let shown = workers[0].config_error.as_deref().unwrap();
    assert!(shown.contains("32") && shown.contains("16"), "{shown}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_tokens_are_hashed_by_the_server_like_the_engine() {
    let env = env(2).await;
    let t = prompt(5, 3, 0);
    let mut p = Publisher::connect(env.publisher(4, &[])).await.unwrap();
    p.send(
        0,
        &[
            NativeEvent::StoredTokens {
                parent: None,
                engine_hashes: vec![11, 12, 13],
                token_ids: t.clone(),
                lora_name: Some("adapter-a".into()),
            },
            // Wrong token count: dropped and counted, the batch's other events apply.
            NativeEvent::StoredTokens {
                parent: None,
                engine_hashes: vec![21, 22],
                token_ids: t[..BS + 1].to_vec(),
                lora_name: None,
            },
            NativeEvent::StoredTokens {
                parent: None,
                engine_hashes: vec![31],
                token_ids: t[..BS].to_vec(),
                lora_name: None,
            },
        ],
    )
    .await
    .unwrap();
    let done = p.finish().await.unwrap();
    assert_eq!(done.events, 2);
    env.hub.sync().unwrap();
    let (_, _, m) = env.hub.overlap(None, &t, Some("adapter-a")).unwrap();
    assert_eq!(m.overlaps, vec![(key(4, 0), 3)]);
    assert_eq!(
        overlaps(&env.hub, &t),
        vec![(key(4, 0), 1)],
        "base model: block 0 only"
    );
    assert_eq!(env.hub.metrics().dropped(DropReason::TokenCountMismatch), 1);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_pinning_rejects_other_certificates_and_ca_trust_works() {
    // A certificate from files, trusted through a CA bundle (the self-signed cert itself).
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let dir = std::env::temp_dir().join(format!("kvengine-native-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, keyf) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&keyf, ck.signing_key.serialize_pem()).unwrap();
    let env = env_with(
        1,
        TlsSource::Files {
            cert: cert.clone(),
            key: keyf,
        },
    )
    .await;
    assert_eq!(
        env.server.fingerprint(),
        transport::native::quic_tls::fingerprint(ck.cert.der())
    );

    let mut cfg = env.publisher(1, &[]);
    cfg.trust = Trust::Fingerprint("00".repeat(32));
    let err = Publisher::connect(cfg).await.unwrap_err();
    assert!(matches!(err, TransportError::Io { .. }), "{err:?}");
    assert!(!env.hub.is_registered(WorkerId(1)));

    let mut cfg = env.publisher(1, &[]);
    cfg.trust = Trust::CaPem(cert.clone());
    let p = Publisher::connect(cfg).await.unwrap();
    p.finish().await.unwrap();
    // The CA path checks the name.
    let mut cfg = env.publisher(1, &[]);
    cfg.trust = Trust::CaPem(cert);
    cfg.server_name = "elsewhere".into();
    assert!(Publisher::connect(cfg).await.is_err());
    // The pinned fingerprint works.
    let p = Publisher::connect(env.publisher(1, &[])).await.unwrap();
    p.finish().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_resyncs_the_rank_and_a_lower_seq_restarts_it() {
    let env = env(2).await;
    let (a, b, c, d) = (
        prompt(0, 4, 0),
        prompt(1, 4, 0),
        prompt(2, 4, 0),
        prompt(4, 4, 0),
    );
    let mut p = Publisher::connect(env.publisher(5, &[0, 1])).await.unwrap();
    p.send(0, &[native_store(&a, 0, 4)]).await.unwrap();
    p.send(1, &[native_store(&a, 0, 4)]).await.unwrap();
    // Batches 1..5 of rank 0 are lost: the rank is cleared and marked resyncing.
    p.send_with_seq(0, 5, &[]).await.unwrap();
    let hub = env.hub.clone();
    wait_for("the resync", || {
        hub.metrics()
            .resyncs
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1
    })
    .await;
    env.hub.sync().unwrap();
    assert_eq!(env.hub.workers()[0].resyncing, vec![DpRank(0)]);
    assert_eq!(
        overlaps(&env.hub, &a),
        vec![(key(5, 1), 4)],
        "rank 1 untouched"
    );
    // The next batch applies and ends the resync.
    assert_eq!(p.send(0, &[native_store(&b, 0, 4)]).await.unwrap(), 6);
    wait_for("the next batch", || hub.workers()[0].resyncing.is_empty()).await;
    // A gap with events: cleared, then the batch applies.
    p.send_with_seq(0, 9, &[native_store(&c, 0, 2)])
        .await
        .unwrap();
    // Rank 1's publisher restarts: a lower number clears it, then the batch applies.
    p.send_with_seq(1, 0, &[native_store(&d, 0, 3)])
        .await
        .unwrap();
    let done = p.finish().await.unwrap();
    assert_eq!(done.batches, 6);
    env.hub.sync().unwrap();
    let m = env.hub.metrics();
    assert_eq!(m.resyncs.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert_eq!(m.restarts.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(overlaps(&env.hub, &a).is_empty());
    assert!(
        overlaps(&env.hub, &b).is_empty(),
        "cleared by the second gap"
    );
    assert_eq!(overlaps(&env.hub, &c), vec![(key(5, 0), 2)]);
    assert_eq!(overlaps(&env.hub, &d), vec![(key(5, 1), 3)]);
    drop(hub);
    env.shutdown().await;
}

/// Issue 12: a publisher's fences outlive its connection. The same instance reconnecting
/// goes on in order (nothing cleared); batches lost between two of its connections are a
/// gap (the rank resyncs); another instance for the worker is a restart, cleared at its
/// hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_outlive_reconnects_and_a_new_instance_is_a_restart() {
    use std::sync::atomic::Ordering::Relaxed;
    let env = env(2).await;
    let (a, b, c, d) = (
        prompt(10, 3, 0),
        prompt(11, 3, 0),
        prompt(12, 3, 0),
        prompt(13, 3, 0),
    );
    let hub = env.hub.clone();
    let mut p = Publisher::connect(env.publisher(6, &[0])).await.unwrap();
    let instance = p.instance();
    assert_ne!(instance, 0, "an instance is drawn when none is given");
    p.send(0, &[native_store(&a, 0, 3)]).await.unwrap();
    wait_for("a", || overlaps(&hub, &a) == vec![(key(6, 0), 3)]).await;
    // The connection is lost; the same process reconnects and goes on numbering.
    let mut p = p.reconnect().await.unwrap();
    assert_eq!(p.instance(), instance);
    assert_eq!(p.send(0, &[native_store(&b, 0, 3)]).await.unwrap(), 1);
    wait_for("b", || overlaps(&hub, &b) == vec![(key(6, 0), 3)]).await;
    assert_eq!(
        overlaps(&hub, &a),
        vec![(key(6, 0), 3)],
        "kept across the reconnect"
    );
    assert_eq!(hub.metrics().resyncs.load(Relaxed), 0);
    assert_eq!(hub.metrics().restarts.load(Relaxed), 0);
    // Batches 2..5 went with a lost connection: the next one shows the gap.
    let mut p = p.reconnect().await.unwrap();
    p.send_with_seq(0, 5, &[native_store(&c, 0, 3)])
        .await
        .unwrap();
    wait_for("c", || overlaps(&hub, &c) == vec![(key(6, 0), 3)]).await;
    assert_eq!(hub.metrics().resyncs.load(Relaxed), 1);
    assert!(overlaps(&hub, &a).is_empty() && overlaps(&hub, &b).is_empty());
    p.finish().await.unwrap();
    // The worker's publisher restarts: a new instance; its old blocks go at its hello.
    let mut q = Publisher::connect(env.publisher(6, &[0])).await.unwrap();
    assert_ne!(q.instance(), instance);
    assert_eq!(hub.metrics().restarts.load(Relaxed), 1);
    hub.sync().unwrap();
    assert!(
        overlaps(&hub, &c).is_empty(),
        "cleared at the new instance's hello"
    );
    assert_eq!(q.send(0, &[native_store(&d, 0, 3)]).await.unwrap(), 0);
    q.finish().await.unwrap();
    hub.sync().unwrap();
    assert_eq!(overlaps(&hub, &d), vec![(key(6, 0), 3)]);
    drop(hub);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_convert_to_native_and_back() {
    let t = prompt(0, 2, 0);
    let e = to_engine(&native_store(&t, 0, 2));
    let n = NativeEvent::from_engine(&e);
    assert_eq!(n, native_store(&t, 0, 2));
    assert_eq!(to_engine(&n), e);
    assert_eq!(
        NativeEvent::from_engine(&KvEvent::Cleared),
        NativeEvent::Cleared
    );
    let r = KvEvent::Removed {
        blocks: vec![EngineHash(4)],
    };
    assert_eq!(
        NativeEvent::from_engine(&r),
        NativeEvent::Removed { blocks: vec![4] }
    );
}
