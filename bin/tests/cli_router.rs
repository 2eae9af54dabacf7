//! The router process end to end: HTTP edge, `kvengine publish` over QUIC, and refusals of
//! bad flag combinations.

mod common;

use common::Router;
use std::process::Command;

fn tokens(n: u32) -> String {
    let v: Vec<String> = (0..n).map(|t| t.to_string()).collect();
    format!("[{}]", v.join(","))
}

#[test]
fn http_edge_registers_ingests_and_routes() {
    let r = Router::start(&[]);
    assert_eq!(r.call("GET", "/healthz", "").0, 200);
    let (status, _) = r.call("POST", "/v1/workers", r#"{"worker_id": 3}"#);
    assert_eq!(status, 201);
    let (status, _) = r.call("POST", "/v1/workers", r#"{"worker_id": 4}"#);
    assert_eq!(status, 201);
    let blocks: Vec<String> = (0..4)
        .map(|b| {
            let t: Vec<String> = (b * 16..(b + 1) * 16).map(|t| t.to_string()).collect();
            format!(
                r#"{{"block_hash": {}, "token_ids": [{}]}}"#,
                100 + b,
                t.join(",")
            )
        })
        .collect();
    let events = format!(
        r#"{{"worker_id": 4, "events": [{{"type": "stored", "parent_hash": null, "blocks": [{}]}}]}}"#,
        blocks.join(",")
    );
    let (status, body) = r.call("POST", "/v1/events", &events);
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"applied":1,"rejected":0}"#)
    );
    let (status, body) = r.call(
        "POST",
        "/v1/route",
        &format!(r#"{{"token_ids": {}}}"#, tokens(80)),
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["worker_id"], 4);
    assert_eq!(v["overlap_blocks"], 4);
    let id = v["request_id"].as_str().unwrap().to_owned();
    assert_eq!(
        r.call("DELETE", &format!("/v1/requests/{id}"), "").0 / 100,
        2
    );
    let (status, body) = r.call("POST", "/v1/route", "{not json");
    assert_eq!(status, 400, "{body}");
    let (_, metrics) = r.call("GET", "/metrics", "");
    assert!(
        metrics.contains("kvengine_events_applied_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains(r#"kvengine_events_rejected_total{reason="malformed_json"} 1"#));
    assert!(r.out.contains("routing mode kv"));
}

/// The QUIC address and certificate fingerprint the router printed.
fn quic_of(r: &Router) -> (String, String) {
    let line = r
        .out
        .lines()
        .find(|l| l.contains("QUIC ingest on"))
        .unwrap();
    let addr = line
        .split("QUIC ingest on ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    let fingerprint = line.rsplit(' ').next().unwrap();
    (addr.to_owned(), fingerprint.to_owned())
}

#[test]
fn publish_sends_events_over_quic() {
    let r = Router::start(&["--quic", "127.0.0.1:0", "--ingest-token", "s3cret"]);
    let (addr, fingerprint) = quic_of(&r);
    let (addr, fingerprint) = (addr.as_str(), fingerprint.as_str());
    let dir = std::env::temp_dir().join(format!("kvengine-publish-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("events.jsonl");
    let block = |h: u32, from: u32| {
        let t: Vec<String> = (from..from + 16).map(|t| t.to_string()).collect();
        format!(r#"{{"block_hash": {h}, "token_ids": [{}]}}"#, t.join(","))
    };
    std::fs::write(
        &file,
        format!(
            "{}\n{}\n",
            format_args!(
                r#"{{"worker_id": 9, "events": [{{"type": "stored", "parent_hash": null, "blocks": [{}, {}]}}]}}"#,
                block(1, 0),
                block(2, 16)
            ),
            format_args!(
                r#"{{"worker_id": 9, "dp_rank": 1, "events": [{{"type": "stored", "parent_hash": null, "blocks": [{}]}}]}}"#,
                block(7, 0)
            )
        ),
    )
    .unwrap();
    let publish = |token: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["publish", "--quic", addr, "--events"])
            .arg(&file)
            .args(["--ingest-token", token, "--fingerprint", fingerprint])
            .output()
            .unwrap()
    };
    let bad = publish("wrong");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unauthorized"));
    let ok = publish("s3cret");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("2 events accepted"));
    // `Done` means every event was handed to the engine; the cores apply them right after.
    let want = serde_json::json!([
        {"worker_id": 9, "dp_rank": 0, "overlap_blocks": 2},
        {"worker_id": 9, "dp_rank": 1, "overlap_blocks": 1}
    ]);
    let start = std::time::Instant::now();
    loop {
        let (status, body) = r.call(
            "POST",
            "/v1/overlap",
            &format!(r#"{{"token_ids": {}}}"#, tokens(40)),
        );
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["blocks"], 2);
        if v["scores"] == want {
            break;
        }
        assert!(start.elapsed().as_secs() < 10, "never applied: {body}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn scoped_ingest_tokens_publish_only_for_their_workers() {
    let dir = std::env::temp_dir().join(format!("kvengine-scoped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "# pool a\n9 = nine-secret\n").unwrap();
    let r = Router::start(&[
        "--quic",
        "127.0.0.1:0",
        "--ingest-token-file",
        tokens.to_str().unwrap(),
        "--scoped-ingest-token",
        "10-11=ten-secret",
    ]);
    let (addr, fingerprint) = quic_of(&r);
    let events = |worker: u32| {
        let file = dir.join(format!("events-{worker}.jsonl"));
        let t: Vec<String> = (0..16).map(|t| t.to_string()).collect();
        std::fs::write(
            &file,
            format!(
                r#"{{"worker_id": {worker}, "events": [{{"type": "stored", "parent_hash": null, "blocks": [{{"block_hash": 1, "token_ids": [{}]}}]}}]}}"#,
                t.join(",")
            ),
        )
        .unwrap();
        file
    };
    let publish = |worker: u32, token: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["publish", "--quic", &addr, "--events"])
            .arg(events(worker))
            .args(["--fingerprint", &fingerprint])
            .env("KVENGINE_INGEST_TOKEN", token)
            .output()
            .unwrap()
    };
    // Worker 9's token cannot publish for worker 10, and says why.
    let bad = publish(10, "nine-secret");
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("does not cover"), "{stderr}");
    for (worker, token) in [(9, "nine-secret"), (10, "ten-secret")] {
        let ok = publish(worker, token);
        assert!(
            ok.status.success(),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
    }
    let (_, metrics) = r.call("GET", "/metrics", "");
    assert!(
        metrics.contains(r#"kvengine_events_rejected_total{reason="unauthorized"} 1"#),
        "{metrics}"
    );
    let (_, workers) = r.call("GET", "/v1/workers", "");
    let v: serde_json::Value = serde_json::from_str(&workers).unwrap();
    let mut ids: Vec<u64> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, [9, 10]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_flag_combinations_are_refused() {
    for (args, needle) in [
        (vec!["--quic", "127.0.0.1:0"], "--ingest-token"),
        (
            vec!["--no-kv-events", "--zmq-worker", "1=tcp://127.0.0.1:5557"],
            "--no-kv-events",
        ),
        (vec!["--zmq-worker", "1=udp://x:1"], "tcp://HOST:PORT"),
        (vec!["--router-mode", "fastest"], "kv, round-robin"),
        (vec!["--router-temperature=-1"], "temperature"),
        (vec!["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
        // Real workers and no tokenizer: refused unless the stand-in is named.
        (
            vec!["--zmq-worker", "1=tcp://127.0.0.1:5557"],
            "--tokenizer stand-in",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["--http-port", "0"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn zmq_worker_flags_subscribe_to_every_rank_publisher() {
    use transport::kv_events::{WireBatch, WireEvent};
    use transport::zmq::VllmPublisher;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A data-parallel worker: one publisher per rank, both under worker id 5.
    let mut publishers: Vec<VllmPublisher> = (0..2)
        .map(|_| {
            rt.block_on(VllmPublisher::bind(
                "tcp://127.0.0.1:0",
                Some("tcp://127.0.0.1:0"),
                16,
            ))
            .unwrap()
        })
        .collect();
    let flags: Vec<String> = publishers
        .iter()
        .map(|p| format!("5={},replay={}", p.endpoint(), p.replay_endpoint().unwrap()))
        .collect();
    let r = Router::start(&[
        "--zmq-worker",
        &flags[0],
        "--zmq-worker",
        &flags[1],
        "--tokenizer",
        "stand-in",
    ]);
    assert_eq!(
        r.out.matches("subscribing to worker 5=").count(),
        2,
        "{}",
        r.out
    );
    let store = |rank: u32, blocks: u64| WireBatch {
        ts: None,
        dp_rank: Some(rank),
        events: vec![WireEvent::Stored {
            block_hashes: (0..blocks).map(|b| 10 + b).collect(),
            parent: None,
            token_ids: (0..16 * blocks as u32).collect(),
            block_size: Some(16),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: None,
        }],
        unknown_events: 0,
    };
    // PUB/SUB loses what is sent before a subscription is up: a repeated store only adds a
    // copy, so send until both ranks show.
    let query = format!(r#"{{"token_ids": {}}}"#, tokens(64));
    let want = serde_json::json!([
        {"worker_id": 5, "dp_rank": 0, "overlap_blocks": 3},
        {"worker_id": 5, "dp_rank": 1, "overlap_blocks": 2}
    ]);
    let start = std::time::Instant::now();
    loop {
        for (rank, (p, blocks)) in publishers.iter_mut().zip([3, 2]).enumerate() {
            rt.block_on(p.publish(&store(rank as u32, blocks))).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (_, body) = r.call("POST", "/v1/overlap", &query);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["scores"] == want {
            break;
        }
        assert!(
            start.elapsed().as_secs() < 20,
            "stores never indexed: {body}"
        );
    }
}

#[test]
fn sim_workers_answer_openai_requests_through_the_front_door() {
    let r = Router::start(&["--sim-workers", "2", "--sim-speedup", "100"]);
    assert_eq!(r.out.matches("simulated worker").count(), 2, "{}", r.out);
    let system = "you are a careful assistant who explains every step of the answer in detail ";
    let body = serde_json::json!({
        "model": "kvengine-sim",
        "messages": [
            {"role": "system", "content": system.repeat(3)},
            {"role": "user", "content": "what is a kv cache"}
        ],
        "max_tokens": 4
    })
    .to_string();
    let (status, first) = r.call("POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{first}");
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The worker's KV events reach the index over ZMQ; the same prompt then goes back to
    // it and hits its cache.
    let start = std::time::Instant::now();
    loop {
        let (status, text) = r.call("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0) {
            break;
        }
        assert!(start.elapsed().as_secs() < 20, "never a cache hit: {text}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (_, metrics) = r.call("GET", "/metrics", "");
    assert!(metrics.contains("kvengine_active_requests 0"), "{metrics}");
    let (status, text) = r.call("POST", "/v1/chat/completions", r#"{"messages": 5}"#);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("invalid_request_error"), "{text}");
}

#[test]
fn sim_trtllm_workers_are_polled_and_routed_by_their_caches() {
    let r = Router::start(&[
        "--sim-workers",
        "2",
        "--sim-engine",
        "trtllm",
        "--sim-speedup",
        "100",
    ]);
    assert_eq!(r.out.matches("simulated worker").count(), 2, "{}", r.out);
    // Three blocks at TensorRT-LLM's default 32 tokens, plus a partial one.
    let prompt: Vec<u32> = (1..=100).collect();
    let body =
        serde_json::json!({"model": "kvengine-sim", "prompt": prompt, "max_tokens": 2}).to_string();
    let (status, text) = r.call("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    // The worker's stored blocks reach the index at its next poll (the finished request
    // asks for one at once).
    let query = serde_json::json!({"token_ids": prompt}).to_string();
    let start = std::time::Instant::now();
    let first = loop {
        let (_, text) = r.call("POST", "/v1/overlap", &query);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["block_size"], 32, "{text}");
        if let Some(s) = v["scores"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["overlap_blocks"] == 3))
        {
            break s["worker_id"].as_u64().unwrap();
        }
        assert!(start.elapsed().as_secs() < 20, "never indexed: {text}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // The same prompt goes back to the worker that caches it, and hits its cache.
    let (status, text) = r.call("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "{text}"
    );
    let (_, workers) = r.call("GET", "/v1/workers", "");
    let w: serde_json::Value = serde_json::from_str(&workers).unwrap();
    for w in w["workers"].as_array().unwrap() {
        assert_eq!(w["stream"], "subscribed", "{workers}");
        assert!(
            w["loads"][0]["kv_capacity_blocks"].as_u64() > Some(0),
            "{workers}"
        );
        if w["worker_id"] == first {
            assert!(w["events"].as_u64() > Some(0), "{workers}");
        }
    }
    let (_, metrics) = r.call("GET", "/metrics", "");
    assert!(metrics.contains("kvengine_active_requests 0"), "{metrics}");
}
