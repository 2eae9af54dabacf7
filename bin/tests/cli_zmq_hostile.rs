//! A hostile KV-event publisher against the real binary (issue 29, item 9): a frame header
//! claiming 2^62 bytes, and a frame just over `--zmq-max-message-bytes`, are refused and
//! counted (`kvengine_events_rejected_total{reason="oversized"}`), the router stays up and
//! answers, and its subscription reconnects and keeps going (the publisher sees new
//! connections).

mod common;

use common::Router;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Plays a PUB's handshake (libzmq's ZMTP 3.1 greeting, READY) on `s`.
fn handshake(s: &mut TcpStream) -> std::io::Result<()> {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    s.write_all(&g)?;
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs)?;
    let mut ready = vec![0x04, 0, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    ready[1] = (ready.len() - 2) as u8;
    s.write_all(&ready)?;
    let mut h = [0u8; 2];
    s.read_exact(&mut h)?;
    let mut body = vec![0u8; usize::from(h[1])];
    s.read_exact(&mut body)
}

#[test]
fn a_giant_zmq_frame_is_refused_counted_and_the_router_stays_up() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = connections.clone();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let n = seen.fetch_add(1, Relaxed);
            std::thread::spawn(move || {
                if handshake(&mut s).is_err() {
                    return;
                }
                // Even connections: 2^62 bytes claimed; odd: 5,000 bytes sent, one frame
                // over the router's 4,096-byte bound.
                let _ = match n % 2 {
                    0 => {
                        let mut h = vec![0x02];
                        h.extend_from_slice(&(1u64 << 62).to_be_bytes());
                        s.write_all(&h)
                    }
                    _ => {
                        let mut h = vec![0x02];
                        h.extend_from_slice(&5000u64.to_be_bytes());
                        h.extend_from_slice(&[0u8; 5000]);
                        s.write_all(&h)
                    }
                };
                // Until the router closes it.
                let mut sink = [0u8; 256];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    let worker = format!("7={endpoint}");
    let r = Router::start(&[
        "--zmq-worker",
        &worker,
        "--tokenizer",
        "stand-in",
        "--zmq-max-message-bytes",
        "4096",
    ]);
    let start = Instant::now();
    let oversized = r#"kvengine_events_rejected_total{reason="oversized"}"#;
    while r.metric(oversized).unwrap_or(0.0) < 4.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "refusals not counted: {:?} after {} connections",
            r.metric(oversized),
            connections.load(Relaxed)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        connections.load(Relaxed) >= 4,
        "the subscription did not reconnect"
    );
    let (status, _) = r.call("GET", "/health", "");
    assert_eq!(status, 200);
    let (status, body) = r.call("GET", "/v1/workers", "");
    assert_eq!(status, 200, "{body}");
}
