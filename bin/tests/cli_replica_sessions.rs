//! Sticky sessions across router replicas (issue 31) on a real NATS server: a session's
//! first turn routed by replica `a` is sticky on replica `b`, which learned it from `a`'s
//! session frame.
//!
//! Needs `nats-server` (see `lab::nats`); without one the test says why and passes, unless
//! `KVENGINE_NATS_REQUIRED=1`. Replication between processes is only observable through
//! their `/metrics` and `/ready`, so the test waits for those (a bounded wait on a stated
//! condition, as `cli_replicas.rs` does), never for a fixed time.

mod common;

use common::Router;
use lab::nats::{NatsServer, binary_or_skip};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `kvengine sim` and one `--worker` flag per worker (its URL and event sockets).
struct Sims {
    child: Child,
    workers: Vec<String>,
}

impl Sims {
    fn start(n: usize) -> Sims {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["sim", "--workers", &n.to_string(), "--port", "0"])
            .args(["--speedup", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut text = String::new();
        while !text.contains("Ctrl-C stops") {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "sim exited: {text}");
            text.push_str(&line);
        }
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = out.read_to_string(&mut sink);
        });
        // "worker 0: http://H:P  --zmq-worker 0=tcp://H:P,replay=tcp://H:P"
        let workers = text
            .lines()
            .filter_map(|l| {
                let url = l.split_whitespace().find(|w| w.starts_with("http://"))?;
                let (id, zmq) = l.split("--zmq-worker ").nth(1)?.trim().split_once('=')?;
                Some(format!("id={id},url={url},zmq={zmq}"))
            })
            .collect();
        Sims { child, workers }
    }
}

impl Drop for Sims {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replica(nats: &str, name: &str, sims: &Sims) -> Router {
    let mut args = vec![
        "--replica-nats",
        nats,
        "--replica-name",
        name,
        "--replica-heartbeat-ms",
        "100",
        "--replica-timeout-ms",
        "2000",
        // The simulated workers tokenize with the stand-in too.
        "--tokenizer",
        "stand-in",
    ];
    for w in &sims.workers {
        args.extend(["--worker", w.as_str()]);
    }
    Router::start(&args)
}

/// Waits up to `secs` for `check`; panics with `what` and the last state otherwise.
fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match check() {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A chat turn of `session` at `r`; returns (route header, worker id).
fn turn(r: &Router, session: &str, text: &str) -> (String, String) {
    let body = serde_json::json!({
        "model": "kvengine-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2
    })
    .to_string();
    let mut s = TcpStream::connect(&r.http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\
         x-kvengine-session: {session}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert_eq!(&resp[9..12], "200", "{resp}");
    let head = resp.split_once("\r\n\r\n").unwrap().0.to_ascii_lowercase();
    let get = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or("")
            .trim()
            .to_owned()
    };
    (get("x-kvengine-route"), get("x-kvengine-worker-id"))
}

#[test]
fn a_session_routed_by_one_replica_is_sticky_on_the_other() {
    if binary_or_skip("the replica session test").is_none() {
        return;
    }
    let nats = NatsServer::start().unwrap();
    let url = nats.url();
    let sims = Sims::start(3);
    assert_eq!(sims.workers.len(), 3);
    let a = replica(&url, "a", &sims);
    let b = replica(&url, "b", &sims);
    eventually(20, "both replicas connected, each with its peer", || {
        for r in [&a, &b] {
            let (_, body) = r.call("GET", "/ready", "");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if v["replicas"]["peers"] != 1 {
                return Err(v["replicas"].to_string());
            }
        }
        Ok(())
    });

    let sessions = ["agent-1", "agent-2", "agent-3", "agent-4"];
    let mut homes = Vec::new();
    for s in sessions {
        let (route, worker) = turn(&a, s, &format!("{s} first turn"));
        assert_eq!(route, "session_new");
        homes.push(worker);
    }
    eventually(20, "b applied a's session assignments", || {
        let applied = b.metric("kvengine_replica_sessions_applied_total");
        match applied {
            Some(n) if n >= sessions.len() as f64 => Ok(()),
            other => Err(format!("{other:?} applied")),
        }
    });
    for (s, home) in sessions.iter().zip(&homes) {
        let (route, worker) = turn(&b, s, &format!("{s} second turn, other words"));
        assert_eq!((route.as_str(), &worker), ("session", home), "{s}");
    }
    assert_eq!(
        a.metric("kvengine_replica_sessions_sent_total"),
        Some(sessions.len() as f64)
    );
    // And back: b's turns went out too, and a agrees.
    let (route, worker) = turn(&a, sessions[0], "third turn");
    assert_eq!((route.as_str(), &worker), ("session", &homes[0]));
}
