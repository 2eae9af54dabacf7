//! Hostile input on the native protocol: garbage, truncated archives, random bytes and an
//! oversized length through a raw QUIC connection. Bad frames are counted and skipped, the
//! stream stays usable and nothing valid is lost; an oversized frame closes the connection.

mod common;

use engine::event::KvEvent;
use engine::hash::{lora_seed, seq_hashes, tokens_hash};
use engine::{WorkerId, WorkerKey};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;
use transport::DropReason;
use transport::hub::Hub;
use transport::native::frame::{
    FrameBuf, MAX_FRAME_BYTES, decode_client_frame, decode_server_frame, encode_batch,
    encode_client_frame,
};
use transport::native::server::{CLOSE_FRAME_TOO_LARGE, CLOSE_REFUSED};
use transport::native::{
    ClientFrame, NativeBlock, NativeEvent, PROTOCOL_VERSION, ServerFrame, Trust,
};

const BS: usize = 16;
const TOKEN: &str = "t0ken";

type Env = common::QuicEnv;

async fn env() -> Env {
    common::quic_env(1, TOKEN, common::self_signed()).await
}

/// A minimal client that writes whatever bytes it is given.
struct Raw {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    _endpoint: quinn::Endpoint,
}

impl Raw {
    async fn connect(env: &Env) -> Raw {
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
        let (send, recv) = conn.open_bi().await.unwrap();
        Raw {
            conn,
            send,
            recv,
            _endpoint: endpoint,
        }
    }

    /// Connects and says a valid hello for `worker`.
    async fn hello(env: &Env, worker: u64) -> Raw {
        let mut raw = Raw::connect(env).await;
        let mut buf = FrameBuf::new();
        encode_client_frame(
            &ClientFrame::Hello {
                version: PROTOCOL_VERSION,
                worker_id: worker,
                dp_ranks: vec![0],
                block_size: BS as u32,
                token: TOKEN.into(),
                instance: 0,
            },
            &mut buf,
        )
        .unwrap();
        raw.frame(&buf).await;
        assert!(matches!(raw.answer().await, ServerFrame::HelloAck { .. }));
        raw
    }

    async fn bytes(&mut self, b: &[u8]) {
        self.send.write_all(b).await.unwrap();
    }

    async fn frame(&mut self, body: &[u8]) {
        self.bytes(&(body.len() as u32).to_le_bytes()).await;
        self.bytes(body).await;
    }

    async fn answer(&mut self) -> ServerFrame {
        let mut len = [0u8; 4];
        self.recv.read_exact(&mut len).await.unwrap();
        let mut body = FrameBuf::new();
        body.resize(u32::from_le_bytes(len) as usize, 0);
        self.recv.read_exact(&mut body).await.unwrap();
        decode_server_frame(&body).unwrap()
    }

    async fn finish(mut self) -> ServerFrame {
        self.send.finish().unwrap();
        let answer = self.answer().await;
        self.conn.close(0u32.into(), b"");
        answer
    }
}

fn prompt(p: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|i| 1_000 * p + i).collect()
}

fn store(tokens: &[u32]) -> NativeEvent {
    let seqs = seq_hashes(tokens, BS, lora_seed(None));
    NativeEvent::Stored {
        parent: None,
        blocks: tokens
            .chunks_exact(BS)
            .zip(&seqs)
            .map(|(t, s)| NativeBlock {
                engine_hash: s.0,
                tokens_hash: tokens_hash(t, lora_seed(None)).0,
            })
            .collect(),
    }
}

fn batch(worker: u64, seq: u64, events: &[NativeEvent]) -> Vec<u8> {
    let mut buf = FrameBuf::new();
    encode_batch(worker, 0, seq, events, &mut buf).unwrap();
    buf.to_vec()
}

fn overlap(hub: &Hub, tokens: &[u32]) -> Vec<(WorkerKey, u32)> {
    hub.overlap(None, tokens, None).unwrap().2.overlaps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_counted_and_skipped_and_valid_batches_still_apply() {
    let env = env().await;
    let mut raw = Raw::hello(&env, 1).await;
    let (a, b) = (prompt(1, 4), prompt(2, 5));
    let valid = batch(1, 0, &[store(&a)]);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut garbage = 0u64;

    // Fixed shapes: empty, one byte, all-ones, a valid batch cut short at every length.
    for body in [vec![], vec![0u8], vec![0xff; 64]] {
        raw.frame(&body).await;
        garbage += 1;
    }
    for cut in (0..valid.len()).step_by(3) {
        raw.frame(&valid[..cut]).await;
        garbage += 1;
    }
    // Random bytes of random lengths.
    for _ in 0..300 {
        let n = rng.random_range(0..512);
        let body: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        raw.frame(&body).await;
        garbage += 1;
    }
    // A valid batch after all that, and a batch for another worker (dropped, counted).
    raw.frame(&valid).await;
    raw.frame(&batch(2, 0, &[store(&b)])).await;
    raw.frame(&batch(1, 1, &[store(&b)])).await;
    let done = raw.finish().await;
    assert_eq!(
        done,
        ServerFrame::Done {
            batches: 2,
            events: 2
        }
    );
    env.hub.sync().unwrap();
    let m = env.hub.metrics();
    assert_eq!(m.dropped(DropReason::MalformedFrame), garbage);
    assert_eq!(m.dropped(DropReason::UnknownWorker), 1);
    assert_eq!(overlap(&env.hub, &a), vec![(WorkerKey::new(1, 0), 4)]);
    assert_eq!(overlap(&env.hub, &b), vec![(WorkerKey::new(1, 0), 5)]);
    assert!(!env.hub.is_registered(WorkerId(2)));
    env.shutdown().await;
}

async fn closed_with(conn: &quinn::Connection) -> (u64, Vec<u8>) {
    match tokio::time::timeout(Duration::from_secs(10), conn.closed())
        .await
        .unwrap()
    {
        quinn::ConnectionError::ApplicationClosed(c) => {
            (c.error_code.into_inner(), c.reason.to_vec())
        }
        other => panic!("closed with {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_closes_the_connection_with_a_reason() {
    let env = env().await;
    let mut raw = Raw::hello(&env, 1).await;
    let a = prompt(1, 2);
    raw.frame(&batch(1, 0, &[store(&a)])).await;
    raw.bytes(&((MAX_FRAME_BYTES + 1) as u32).to_le_bytes())
        .await;
    raw.bytes(&[0u8; 100]).await;
    let (code, reason) = closed_with(&raw.conn).await;
    assert_eq!(code, u64::from(CLOSE_FRAME_TOO_LARGE));
    assert_eq!(reason, b"frame too large");
    assert_eq!(env.hub.metrics().dropped(DropReason::Oversized), 1);
    // What came before it was applied; other connections still work.
    env.hub.sync().unwrap();
    assert_eq!(overlap(&env.hub, &a), vec![(WorkerKey::new(1, 0), 2)]);
    let raw = Raw::hello(&env, 2).await;
    assert!(matches!(
        raw.finish().await,
        ServerFrame::Done { batches: 0, .. }
    ));
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_the_hello_is_refused_and_closes() {
    let env = env().await;
    let mut raw = Raw::connect(&env).await;
    raw.frame(&[1, 2, 3, 4, 5, 6, 7, 8]).await;
    let ServerFrame::Refused { reason } = raw.answer().await else {
        panic!("expected a refusal")
    };
    assert!(reason.starts_with("malformed hello"), "{reason}");
    raw.conn.close(0u32.into(), b"");
    // A batch as the first frame is refused too (no hello, no ingest).
    let mut raw = Raw::connect(&env).await;
    raw.frame(&batch(1, 0, &[store(&prompt(1, 2))])).await;
    assert!(matches!(raw.answer().await, ServerFrame::Refused { .. }));
    let (code, _) = closed_with(&raw.conn).await;
    assert_eq!(code, u64::from(CLOSE_REFUSED));
    assert!(env.hub.workers().is_empty());
    assert_eq!(env.hub.metrics().dropped(DropReason::MalformedFrame), 2);
    // A hello that declares more than the pre-authentication limit is closed at once.
    let mut raw = Raw::connect(&env).await;
    raw.bytes(&(1u32 << 20).to_le_bytes()).await;
    let (code, reason) = closed_with(&raw.conn).await;
    assert_eq!(code, u64::from(CLOSE_FRAME_TOO_LARGE));
    assert_eq!(reason, b"frame too large");
    env.shutdown().await;
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = decode_client_frame(&bytes);
    }

    #[test]
    fn valid_frames_with_flipped_bytes_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
    ) {
        let t = prompt(3, 3);
        let mut bytes = batch(1, 9, &[store(&t), NativeEvent::Removed { blocks: vec![1, 2] }, NativeEvent::StoredTokens {
            parent: Some(4), engine_hashes: vec![5], token_ids: t[..BS].to_vec(), lora_name: Some("x".into()),
        }]);
        for (i, v) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= v;
        }
        if let Ok(ClientFrame::Batch(b)) = decode_client_frame(&bytes) {
            // Whatever validates converts without panicking.
            for e in &b.events {
                let _ = e.block_count();
            }
        }
        let _: Option<KvEvent> = None;
    }
}
