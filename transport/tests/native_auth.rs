//! Authentication on the native protocol, over real QUIC sockets: a connection that has not
//! said its hello by the deadline is closed, connections past the cap of unauthenticated
//! ones are refused while authenticated publishers carry on, and a token bound to some
//! workers cannot write the others.

mod common;

use engine::hash::{lora_seed, seq_hashes, tokens_hash};
use engine::{WorkerId, WorkerKey};
use std::time::{Duration, Instant};
use transport::hub::Hub;
use transport::native::frame::{FrameBuf, decode_server_frame, encode_batch, encode_client_frame};
use transport::native::server::CLOSE_HELLO_TIMEOUT;
use transport::native::{
    ClientFrame, Done, NativeBlock, NativeEvent, PROTOCOL_VERSION, Publisher, PublisherConfig,
    ServerFrame, Trust,
};
use transport::{DropReason, TransportError};

const BS: usize = 16;
/// The legacy token: any worker.
const TOKEN: &str = "any-worker-token";
/// A token bound to worker 1.
const ONE: &str = "worker-one-token";

type Env = common::QuicEnv;

fn publisher(env: &Env, worker: u64, token: &str) -> PublisherConfig {
    PublisherConfig {
        server: env.server.local_addr(),
        server_name: "localhost".into(),
        trust: Trust::Fingerprint(env.server.fingerprint().to_owned()),
        token: token.into(),
        worker_id: worker,
        dp_ranks: vec![0],
        block_size: BS as u32,
        instance: 0,
    }
}

/// A client that completes the QUIC handshake and then does only what it is told.
struct Raw {
    conn: quinn::Connection,
    stream: Option<(quinn::SendStream, quinn::RecvStream)>,
    _endpoint: quinn::Endpoint,
}

impl Raw {
    async fn connect(env: &Env) -> Result<Raw, quinn::ConnectionError> {
        let client = transport::native::quic_tls::client_config(&Trust::Fingerprint(
            env.server.fingerprint().to_owned(),
        ))
        .unwrap();
        let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = endpoint
            .connect_with(client, env.server.local_addr(), "localhost")
            .unwrap()
            .await?;
        Ok(Raw {
            conn,
            stream: None,
            _endpoint: endpoint,
        })
    }

    /// Connects and says a hello for `worker` with `token`; the server must accept it.
    async fn hello(env: &Env, worker: u64, token: &str) -> Raw {
        let mut raw = Raw::connect(env).await.unwrap();
        let mut buf = FrameBuf::new();
        encode_client_frame(
            &ClientFrame::Hello {
                version: PROTOCOL_VERSION,
                worker_id: worker,
                dp_ranks: vec![0],
                block_size: BS as u32,
                token: token.into(),
                instance: 0,
            },
            &mut buf,
        )
        .unwrap();
        raw.frame(&buf).await;
        let answer = raw.answer().await;
        assert!(matches!(answer, ServerFrame::HelloAck { .. }), "{answer:?}");
        raw
    }

    async fn bytes(&mut self, b: &[u8]) {
        if self.stream.is_none() {
            self.stream = Some(self.conn.open_bi().await.unwrap());
        }
        let (send, _) = self.stream.as_mut().unwrap();
        send.write_all(b).await.unwrap();
    }

    async fn frame(&mut self, body: &[u8]) {
        self.bytes(&(body.len() as u32).to_le_bytes()).await;
        self.bytes(body).await;
    }

    async fn answer(&mut self) -> ServerFrame {
        let (_, recv) = self.stream.as_mut().unwrap();
        let mut len = [0u8; 4];
        recv.read_exact(&mut len).await.unwrap();
        let mut body = FrameBuf::new();
        body.resize(u32::from_le_bytes(len) as usize, 0);
        recv.read_exact(&mut body).await.unwrap();
        decode_server_frame(&body).unwrap()
    }

    async fn finish(mut self) -> ServerFrame {
        self.stream.as_mut().unwrap().0.finish().unwrap();
        let answer = self.answer().await;
        self.conn.close(0u32.into(), b"");
        answer
    }
}

/// The application code and reason `conn` was closed with (waits at most 10 s).
async fn closed_with(conn: &quinn::Connection) -> (u64, Vec<u8>) {
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
        .await
        .expect("the server never closed the connection");
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => {
            (c.error_code.into_inner(), c.reason.to_vec())
        }
        other => panic!("closed with {other:?}"),
    }
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn prompt(p: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32)
        .map(|i| 1_000_000 * p + i)
        .collect()
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

fn key(worker: u64) -> WorkerKey {
    WorkerKey::new(worker, 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_says_its_hello_is_closed_at_the_deadline() {
    let env = common::quic_env_with(1, TOKEN, common::self_signed(), |c| {
        // Short, yet long enough for a debug build's handshake on a busy machine.
        c.hello_timeout = Duration::from_secs(2);
    })
    .await;
    // Authenticated before the deadline: not subject to it.
    let mut p = Publisher::connect(publisher(&env, 1, TOKEN)).await.unwrap();

    // One connection only shakes hands; one sends half a hello and stops.
    let silent = Raw::connect(&env).await.unwrap();
    let mut half = Raw::connect(&env).await.unwrap();
    half.bytes(&100u32.to_le_bytes()).await;
    half.bytes(&[0u8; 10]).await;
    for raw in [&silent, &half] {
        let (code, reason) = closed_with(&raw.conn).await;
        assert_eq!(code, u64::from(CLOSE_HELLO_TIMEOUT));
        assert_eq!(reason, b"hello timeout");
    }
    assert_eq!(env.hub.metrics().dropped(DropReason::HelloTimeout), 2);
    wait_for("their places to be freed", || {
        env.server.unauthenticated() == 0
    })
    .await;

    // The publisher outlived them, and sends a batch far larger than the window an
    // unauthenticated connection gets.
    let a = prompt(1, 8192);
    p.send(0, &[store(&a)]).await.unwrap();
    assert_eq!(
        p.finish().await.unwrap(),
        Done {
            batches: 1,
            events: 1
        }
    );
    env.hub.sync().unwrap();
    assert_eq!(overlap(&env.hub, &a[..4 * BS]), vec![(key(1), 4)]);
    assert_eq!(env.hub.metrics().dropped(DropReason::HelloTimeout), 2);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_unauthenticated_cap_connections_are_refused_and_publishers_still_work() {
    let env = common::quic_env_with(1, TOKEN, common::self_signed(), |c| {
        c.max_unauthenticated = 3;
        c.hello_timeout = Duration::from_secs(60);
    })
    .await;
    let (a, b, c) = (prompt(1, 2), prompt(2, 3), prompt(3, 4));
    let mut p = Publisher::connect(publisher(&env, 1, TOKEN)).await.unwrap();
    p.send(0, &[store(&a)]).await.unwrap();
    assert_eq!(
        env.server.unauthenticated(),
        0,
        "an accepted hello frees its place"
    );

    // Three connections that never say a hello fill the cap (each is counted from its first
    // packet, before its handshake completes).
    let mut squatters = Vec::new();
    for _ in 0..3 {
        squatters.push(Raw::connect(&env).await.unwrap());
    }
    assert_eq!(env.server.unauthenticated(), 3);
    // The next ones are refused at once, before any handshake.
    match Raw::connect(&env).await {
        Err(quinn::ConnectionError::ConnectionClosed(c))
            if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED => {}
        Err(e) => panic!("refused with {e:?}"),
        Ok(_) => panic!("a connection past the cap was accepted"),
    }
    let err = Publisher::connect(publisher(&env, 2, TOKEN))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Io { .. }), "{err:?}");
    assert_eq!(
        env.hub
            .metrics()
            .dropped(DropReason::TooManyUnauthenticated),
        2
    );
    assert!(!env.hub.is_registered(WorkerId(2)));

    // The authenticated publisher is not counted against the cap and carries on.
    p.send(0, &[store(&b)]).await.unwrap();
    assert_eq!(
        p.finish().await.unwrap(),
        Done {
            batches: 2,
            events: 2
        }
    );

    // Once the squatters leave, their places are free again.
    for s in &squatters {
        s.conn.close(0u32.into(), b"bye");
    }
    wait_for("the squatters' places to be freed", || {
        env.server.unauthenticated() == 0
    })
    .await;
    let mut q = Publisher::connect(publisher(&env, 2, TOKEN)).await.unwrap();
    q.send(0, &[store(&c)]).await.unwrap();
    assert_eq!(q.finish().await.unwrap().events, 1);
    env.hub.sync().unwrap();
    assert_eq!(overlap(&env.hub, &a), vec![(key(1), 2)]);
    assert_eq!(overlap(&env.hub, &b), vec![(key(1), 3)]);
    assert_eq!(overlap(&env.hub, &c), vec![(key(2), 4)]);
    assert_eq!(
        env.hub
            .metrics()
            .dropped(DropReason::TooManyUnauthenticated),
        2
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bound_to_worker_1_cannot_write_worker_2() {
    let env = common::quic_env_with(1, TOKEN, common::self_signed(), |c| {
        c.credentials
            .insert(format!("1={ONE}").parse().unwrap())
            .unwrap();
    })
    .await;
    let unauthorized = || env.hub.metrics().dropped(DropReason::Unauthorized);
    let (a, b, c, d) = (prompt(1, 2), prompt(2, 3), prompt(3, 4), prompt(4, 5));

    // Worker 2 publishes with the legacy any-worker token: that still works.
    let mut w2 = Publisher::connect(publisher(&env, 2, TOKEN)).await.unwrap();
    w2.send(0, &[store(&b)]).await.unwrap();
    assert_eq!(w2.finish().await.unwrap().events, 1);
    env.hub.sync().unwrap();
    assert_eq!(overlap(&env.hub, &b), vec![(key(2), 3)]);

    // Worker 1's token in a hello for worker 2 (a new publisher instance, which would clear
    // worker 2's ranks): refused, and the publisher is told why.
    let err = Publisher::connect(publisher(&env, 2, ONE))
        .await
        .unwrap_err();
    let TransportError::Unauthorized(why) = &err else {
        panic!("{err:?}")
    };
    assert!(why.contains("does not cover"), "{why}");
    assert_eq!(unauthorized(), 1);

    // Its own worker: accepted. A batch naming worker 2 on that connection is refused and
    // counted; the connection carries on.
    let mut raw = Raw::hello(&env, 1, ONE).await;
    raw.frame(&batch(2, 0, &[store(&c)])).await;
    raw.frame(&batch(1, 0, &[store(&a)])).await;
    assert_eq!(
        raw.finish().await,
        ServerFrame::Done {
            batches: 1,
            events: 1
        }
    );
    assert_eq!(unauthorized(), 2);
    // And through the publisher.
    let mut w1 = Publisher::connect(publisher(&env, 1, ONE)).await.unwrap();
    w1.send(0, &[store(&d)]).await.unwrap();
    assert_eq!(w1.finish().await.unwrap().events, 1);

    env.hub.sync().unwrap();
    assert_eq!(overlap(&env.hub, &a), vec![(key(1), 2)]);
    assert_eq!(overlap(&env.hub, &d), vec![(key(1), 5)]);
    // Worker 2's index is as its own publisher left it.
    assert_eq!(overlap(&env.hub, &b), vec![(key(2), 3)]);
    assert!(overlap(&env.hub, &c).is_empty());
    assert_eq!(env.hub.workers().len(), 2);

    // A token nobody configured is refused as before.
    let err = Publisher::connect(publisher(&env, 1, "guess"))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Unauthorized(_)), "{err:?}");
    assert_eq!(unauthorized(), 3);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_without_a_token_or_with_zero_limits_refuse_to_start() {
    let (hub, runtime) = common::hub(1);
    let base = || {
        transport::native::QuicServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            TOKEN,
            common::self_signed(),
        )
    };
    for cfg in [
        transport::native::QuicServerConfig {
            credentials: Default::default(),
            ..base()
        },
        transport::native::QuicServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            "",
            common::self_signed(),
        ),
        transport::native::QuicServerConfig {
            hello_timeout: Duration::ZERO,
            ..base()
        },
        transport::native::QuicServerConfig {
            hello_timeout: Duration::MAX,
            ..base()
        },
        transport::native::QuicServerConfig {
            max_unauthenticated: 0,
            ..base()
        },
    ] {
        let err = transport::native::serve_quic(hub.clone(), cfg)
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Invalid { .. }), "{err:?}");
    }
    drop(hub);
    runtime.join().unwrap();
}
