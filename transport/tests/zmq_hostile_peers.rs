//! Hostile ZMQ peers over real TCP sockets (issue 29, item 9): a publisher that sends a
//! frame header claiming 2^62 bytes (and the variants: a long frame with the MORE flag and
//! a length of 2^64 - 1, a giant frame after a good one, a giant command, a giant READY, a
//! truncated greeting, a garbage greeting, silence), and clients that do the same to
//! kvengine's own publisher (its PUB and ROUTER sockets; and a flood of subscriptions). No
//! byte sequence may abort or panic the process: the frame is refused and counted, the
//! connection closed, the subscriber reconnects and works with a good publisher
//! afterwards, and the publisher keeps serving its other subscribers.

mod common;

use engine::{DpRank, WorkerId, WorkerKey};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use transport::DropReason;
use transport::hub::{Hub, Registration};
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::{SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

const BS: usize = common::WIRE_BS;
const GIANT: u64 = 1 << 62;

use common::wire_store as store;

fn batch(events: Vec<WireEvent>) -> WireBatch {
    common::wire_batch(0, events)
}

fn prompt(p: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| p * 100_000 + t).collect()
}

fn overlap(hub: &Hub, p: u32, blocks: usize) -> Vec<(WorkerKey, u32)> {
    hub.sync().unwrap();
    hub.overlap(None, &prompt(p, blocks), None)
        .unwrap()
        .2
        .overlaps
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Publishes stores of prompt `p` until worker `w` has them (PUB drops what it sends
/// before a subscription is up).
async fn publish_until_seen(hub: &Hub, publisher: &mut VllmPublisher, w: u64, p: u32) {
    let start = Instant::now();
    let want = WorkerKey {
        worker: WorkerId(w),
        dp_rank: DpRank(0),
    };
    while !overlap(hub, p, 2).iter().any(|(k, _)| *k == want) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "prompt {p} never reached worker {w}"
        );
        publisher.publish(&batch(vec![store(p, 2)])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A ZMTP 3.1 greeting as libzmq sends it (NULL mechanism, not as-server).
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command frame naming `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend_from_slice(&body);
    frame
}

/// A long frame header: `flags` (long bit set by the caller) and a length.
fn long_header(flags: u8, len: u64) -> Vec<u8> {
    let mut h = vec![flags];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

/// Reads the peer's greeting and its READY command (a short command frame).
async fn read_handshake(s: &mut TcpStream) -> std::io::Result<()> {
    let mut g = [0u8; 64];
    s.read_exact(&mut g).await?;
    let mut h = [0u8; 2];
    s.read_exact(&mut h).await?;
    let mut body = vec![0u8; usize::from(h[1])];
    s.read_exact(&mut body).await?;
    Ok(())
}

/// What a hostile peer sends.
#[derive(Clone, Copy, Debug)]
enum Attack {
    /// A data frame whose long header claims 2^62 bytes.
    GiantFrame,
    /// A long frame with the MORE flag claiming 2^64 - 1 bytes.
    GiantMoreFrame,
    /// A good topic frame (MORE), then a frame claiming 2^62 bytes.
    GiantAfterTopic,
    /// A command frame claiming 2^62 bytes, after the handshake.
    GiantCommand,
    /// A READY command frame claiming 2^62 bytes, in place of the real one.
    GiantReady,
    /// The first 20 bytes of a greeting, then the connection closes.
    TruncatedGreeting,
    /// 64 bytes that are no greeting.
    GarbageGreeting,
    /// Nothing at all: the connection stays open and silent.
    Silent,
    /// 2,000 subscriptions (a publisher keeps 1,024 at most).
    SubscriptionFlood,
}

impl Attack {
    /// The reason a refusal is counted under (`None`: a stall, closed but not counted).
    fn counted_as(self) -> Option<DropReason> {
        match self {
            Attack::TruncatedGreeting | Attack::GarbageGreeting | Attack::SubscriptionFlood => {
                Some(DropReason::MalformedFrame)
            }
            Attack::Silent => None,
            _ => Some(DropReason::Oversized),
        }
    }
}

/// Plays `attack` as a peer of type `me` on `s`, then waits for the other side to close the
/// connection; true if it did (within 10 s).
async fn play(mut s: TcpStream, attack: Attack, me: &str) -> bool {
    let sent = async {
        match attack {
            Attack::TruncatedGreeting => {
                s.write_all(&greeting()[..20]).await?;
                s.shutdown().await?;
                return Ok(());
            }
            Attack::Silent => return Ok(()),
            Attack::GarbageGreeting => {
                let mut junk = *b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                junk[0] = b'H';
                let mut g = [b' '; 64];
                g[..junk.len()].copy_from_slice(&junk);
                s.write_all(&g).await?;
                return Ok(());
            }
            _ => {}
        }
        s.write_all(&greeting()).await?;
        if let Attack::GiantReady = attack {
            s.write_all(&long_header(0x06, GIANT)).await?;
            return Ok(());
        }
        s.write_all(&ready(me)).await?;
        read_handshake(&mut s).await?;
        match attack {
            Attack::GiantFrame => s.write_all(&long_header(0x02, GIANT)).await,
            Attack::GiantMoreFrame => s.write_all(&long_header(0x03, u64::MAX)).await,
            Attack::GiantAfterTopic => {
                s.write_all(&[0x01, 9]).await?;
                s.write_all(b"kv-events").await?;
                s.write_all(&long_header(0x02, GIANT)).await
            }
            Attack::GiantCommand => s.write_all(&long_header(0x06, GIANT)).await,
            Attack::SubscriptionFlood => {
                for i in 0..2000u32 {
                    let topic = format!("\x01topic-{i}");
                    s.write_all(&[0x00, topic.len() as u8]).await?;
                    s.write_all(topic.as_bytes()).await?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    };
    let sent: std::io::Result<()> = sent.await;
    if sent.is_err() {
        // Closed on us already.
        return true;
    }
    let mut sink = [0u8; 4096];
    let closed = async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .is_ok()
}

/// A listener whose first `times` connections meet a hostile peer of type `me`; later ones
/// are relayed to `target` (the good publisher behind it).
struct Hostile {
    addr: String,
    /// Attacks played so far.
    played: Arc<AtomicUsize>,
    /// Attacks after which the other side closed the connection.
    closed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Hostile {
    async fn new(target: &str, attack: Attack, me: &'static str, times: usize) -> Self {
        let target: std::net::SocketAddr = target.trim_start_matches("tcp://").parse().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let played = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (p, c) = (played.clone(), closed.clone());
        let task = tokio::spawn(async move {
            let mut n = 0;
            while let Ok((mut inbound, _)) = listener.accept().await {
                n += 1;
                if n <= times {
                    let (p, c) = (p.clone(), c.clone());
                    tokio::spawn(async move {
                        let was_closed = play(inbound, attack, me).await;
                        p.fetch_add(1, Relaxed);
                        if was_closed {
                            c.fetch_add(1, Relaxed);
                        }
                    });
                    continue;
                }
                let Ok(mut outbound) = TcpStream::connect(target).await else {
                    continue;
                };
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
        Self {
            addr,
            played,
            closed,
            task,
        }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A subscriber whose publisher endpoint (or replay endpoint, with `on_replay`) is a
/// hostile peer for its first `times` connections: each attack is refused, counted and its
/// connection closed; then the subscriber works with the good publisher behind it.
async fn subscriber_survives(attack: Attack, times: usize, on_replay: bool) {
    let worker = 40;
    let (hub, runtime) = common::hub(2);
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap();
    let me = if on_replay { "ROUTER" } else { "PUB" };
    let target = match on_replay {
        true => publisher.replay_endpoint().unwrap().to_owned(),
        false => publisher.endpoint().to_owned(),
    };
    let hostile = Hostile::new(&target, attack, me, times).await;
    let (live, replay) = match on_replay {
        true => (publisher.endpoint().to_owned(), hostile.addr.clone()),
        false => (
            hostile.addr.clone(),
            publisher.replay_endpoint().unwrap().to_owned(),
        ),
    };
    let source = ZmqSource::new(WorkerId(worker), &live, Some(&replay)).unwrap();
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(worker))
    })
    .unwrap();
    let task = spawn_subscriber(
        hub.clone(),
        source,
        SubscriberConfig {
            replay_timeout: Duration::from_secs(2),
            ..SubscriberConfig::default()
        },
    );
    if on_replay {
        // Replays happen on demand: lose batches on the live stream until the subscriber
        // has asked the hostile replay socket `times` times.
        let start = Instant::now();
        let mut p = 1000;
        while hostile.played.load(Relaxed) < times {
            assert!(start.elapsed() < Duration::from_secs(20), "no replay asked");
            publisher.withhold(&batch(vec![store(p, 2)]));
            publisher
                .publish(&batch(vec![store(p + 1, 2)]))
                .await
                .unwrap();
            p += 2;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    wait_for("the attacks", || hostile.played.load(Relaxed) >= times).await;
    if let Some(reason) = attack.counted_as() {
        wait_for("the refusals counted", || {
            hub.metrics().dropped(reason) >= times as u64
        })
        .await;
    }
    assert_eq!(
        hostile.closed.load(Relaxed),
        times,
        "{attack:?}: the subscriber did not close the hostile connection"
    );
    // The good publisher behind: live batches apply, and (on the replay side) a lost batch
    // is repaired from the replay socket.
    publish_until_seen(&hub, &mut publisher, worker, 1).await;
    let replayed = hub.metrics().replayed_batches.load(Relaxed);
    publisher.withhold(&batch(vec![store(2, 2)]));
    publisher.publish(&batch(vec![store(3, 2)])).await.unwrap();
    wait_for("the gap repaired", || {
        !overlap(&hub, 2, 2).is_empty() && !overlap(&hub, 3, 2).is_empty()
    })
    .await;
    assert!(hub.metrics().replayed_batches.load(Relaxed) > replayed);
    task.abort();
    let _ = task.await;
    drop(hostile);
    drop(publisher);
    drop(hub);
    runtime.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_claiming_2_pow_62_bytes_is_refused_and_the_subscriber_reconnects() {
    subscriber_survives(Attack::GiantFrame, 2, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_more_frame_claiming_2_pow_64_bytes_is_refused() {
    subscriber_survives(Attack::GiantMoreFrame, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_frame_after_a_good_one_is_refused() {
    subscriber_survives(Attack::GiantAfterTopic, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_command_is_refused() {
    subscriber_survives(Attack::GiantCommand, 1, false).await;
    subscriber_survives(Attack::GiantReady, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_or_garbage_greeting_is_refused() {
    subscriber_survives(Attack::TruncatedGreeting, 2, false).await;
    subscriber_survives(Attack::GarbageGreeting, 2, false).await;
}

/// A publisher that accepts and says nothing: the connection attempt times out (0.8 s),
/// and the next one reaches the good publisher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_publisher_is_given_up_on() {
    subscriber_survives(Attack::Silent, 2, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_giant_frame_from_the_replay_socket_is_refused() {
    subscriber_survives(Attack::GiantFrame, 1, true).await;
    subscriber_survives(Attack::GiantReady, 1, true).await;
}

/// Connects to kvengine's publisher at `endpoint` as a peer of type `me` and plays
/// `attack`; true if the publisher closed the connection.
async fn attack_publisher(endpoint: &str, attack: Attack, me: &str) -> bool {
    let s = TcpStream::connect(endpoint.trim_start_matches("tcp://"))
        .await
        .unwrap();
    play(s, attack, me).await
}

/// Clients send kvengine's own publisher (PUB and ROUTER) giant frames and garbage: each
/// connection is refused and closed; the publisher keeps serving the subscriber it had, a
/// new one, and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_refuses_giant_frames_and_keeps_serving() {
    let (hub, runtime) = common::hub(2);
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap();
    let (pub_ep, replay_ep) = (
        publisher.endpoint().to_owned(),
        publisher.replay_endpoint().unwrap().to_owned(),
    );
    let subscribe = |worker: u64| {
        let source = ZmqSource::new(WorkerId(worker), &pub_ep, Some(&replay_ep)).unwrap();
        hub.register(Registration {
            zmq: Some(source.publisher.clone()),
            replay: source.replay.clone(),
            ..Registration::new(WorkerId(worker))
        })
        .unwrap();
        spawn_subscriber(hub.clone(), source, SubscriberConfig::default())
    };
    let first = subscribe(50);
    publish_until_seen(&hub, &mut publisher, 50, 1).await;
    let attacks = [
        Attack::GiantFrame,
        Attack::GiantMoreFrame,
        Attack::GiantCommand,
        Attack::GiantReady,
        Attack::GarbageGreeting,
    ];
    for attack in attacks {
        assert!(
            attack_publisher(&pub_ep, attack, "SUB").await,
            "PUB: {attack:?} left open"
        );
        assert!(
            attack_publisher(&replay_ep, attack, "DEALER").await,
            "ROUTER: {attack:?} left open"
        );
    }
    assert!(attack_publisher(&pub_ep, Attack::GiantAfterTopic, "SUB").await);
    assert!(attack_publisher(&replay_ep, Attack::GiantAfterTopic, "DEALER").await);
    assert!(attack_publisher(&pub_ep, Attack::SubscriptionFlood, "SUB").await);
    assert_eq!(publisher.refused_peers(), 2 * attacks.len() as u64 + 3);
    // The subscriber it had still gets batches, a new one connects, and replays work.
    publish_until_seen(&hub, &mut publisher, 50, 2).await;
    let second = subscribe(51);
    publish_until_seen(&hub, &mut publisher, 51, 3).await;
    let replayed = hub.metrics().replayed_batches.load(Relaxed);
    publisher.withhold(&batch(vec![store(4, 2)]));
    publisher.publish(&batch(vec![store(5, 2)])).await.unwrap();
    wait_for("both gaps repaired", || overlap(&hub, 4, 2).len() == 2).await;
    assert!(hub.metrics().replayed_batches.load(Relaxed) >= replayed + 2);
    for t in [first, second] {
        t.abort();
        let _ = t.await;
    }
    drop(publisher);
    drop(hub);
    runtime.join().unwrap();
}
