//! Sticky sessions across router replicas (issue 31) on a real NATS server: a session's
//! first turn routed by replica `a` is sticky on replica `b`, which learned it from `a`'s
//! session frame.
//!
//! Needs `nats-server` (see `lab::nats`); without one the test says why and passes, unless
//! `KVENGINE_NATS_REQUIRED=1`. Replication between processes is only observable through
//! their `/metrics` and `/ready`, so the test waits for those (a bounded wait on a stated
//! condition, as `cli_replicas.rs` does), never for a fixed time.

mod common;

use common::{Router, Sims, eventually};
use lab::nats::{NatsServer, binary_or_skip};
use std::time::Duration;

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
    let specs = sims.worker_specs();
    for w in &specs {
        args.extend(["--worker", w.as_str()]);
    }
    Router::start(&args)
}

/// A chat turn of `session` at `r`; returns (route header, worker id).
fn turn(r: &Router, session: &str, text: &str) -> (String, String) {
    let body = serde_json::json!({
        "model": "kvengine-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2
    })
    .to_string();
    let (status, head) = common::post_head(
        &r.http,
        "/v1/chat/completions",
        &format!("x-kvengine-session: {session}\r\n"),
        &body,
        Duration::from_secs(30),
    );
    assert_eq!(status, 200, "{head}");
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
    assert_eq!(sims.worker_specs().len(), 3);
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
