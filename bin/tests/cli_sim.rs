//! `kvengine sim` starts simulated workers, prints how to reach them, answers OpenAI
//! requests on each, and stops on a signal.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use transport::zmq::ZmqSource;

/// Starts `kvengine sim ARGS` and reads its output up to "Ctrl-C stops".
fn start(args: &[&str], env: &[(&str, &str)]) -> (Child, BufReader<ChildStdout>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvengine"));
    cmd.arg("sim")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while !text.contains("Ctrl-C stops") {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            let status = child.wait().unwrap();
            panic!("exited early ({status}): {text}");
        }
        text.push_str(&line);
    }
    (child, out, text)
}

/// `(url, --zmq-worker value)` of every worker line.
fn workers(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| l.contains("--zmq-worker"))
        .map(|l| {
            let url = l
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .unwrap()
                .to_owned();
            let flag = l.split("--zmq-worker ").nth(1).unwrap().trim().to_owned();
            (url, flag)
        })
        .collect()
}

/// One HTTP/1.1 exchange with `Connection: close`: status and body (not chunked here).
fn http(url: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let addr = url.strip_prefix("http://").unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

fn stop(mut child: Child, mut out: BufReader<ChildStdout>, signal: &str) -> (String, bool) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let ok = child.wait().unwrap().success();
    (rest, ok)
}

#[test]
fn two_workers_answer_and_stop_on_sigterm() {
    let (child, out, text) = start(&["--workers", "2", "--port", "0", "--speedup", "1000"], &[]);
    let ws = workers(&text);
    assert_eq!(ws.len(), 2, "{text}");
    for (i, (url, flag)) in ws.iter().enumerate() {
        let source: ZmqSource = flag.parse().unwrap_or_else(|e| panic!("{flag}: {e}"));
        assert_eq!(source.worker.0, i as u64);
        assert!(source.publisher.starts_with("tcp://127.0.0.1:"), "{flag}");
        assert!(source.replay.is_some(), "{flag}");
        let (status, body) = http(
            url,
            "POST",
            "/v1/completions",
            r#"{"prompt": [1, 2, 3, 4, 5], "max_tokens": 4}"#,
        );
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 5);
        assert_eq!(v["usage"]["completion_tokens"], 4);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    assert_ne!(ws[0].0, ws[1].0);
    assert_ne!(ws[0].1, ws[1].1);
    let (rest, ok) = stop(child, out, "-TERM");
    assert!(ok, "{text}{rest}");
    assert!(rest.contains("kvengine sim: stopped"), "{rest}");
}

#[test]
fn env_vars_configure_the_workers_and_sigint_stops_them() {
    let env = [
        ("KVENGINE_SIM_PORT", "0"),
        ("KVENGINE_SIM_MODEL", "tiny-sim"),
        ("KVENGINE_SIM_SPEEDUP", "1000"),
        ("KVENGINE_SIM_KV_BLOCKS", "4"),
        ("KVENGINE_SIM_FIRST_WORKER_ID", "7"),
    ];
    let (child, out, text) = start(&[], &env);
    let ws = workers(&text);
    assert_eq!(ws.len(), 1, "{text}");
    assert!(ws[0].1.starts_with("7=tcp://"), "{text}");
    let (status, body) = http(&ws[0].0, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert!(body.contains("\"tiny-sim\""), "{body}");
    // 4 blocks of 16 tokens: a 100-token prompt can never fit.
    let prompt: Vec<u32> = (0..100).collect();
    let (status, body) = http(
        &ws[0].0,
        "POST",
        "/v1/completions",
        &serde_json::json!({"prompt": prompt}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");
    let (rest, ok) = stop(child, out, "-INT");
    assert!(ok, "{text}{rest}");
}

#[test]
fn bad_flags_exit_non_zero() {
    for (args, flag) in [
        (&["sim", "--speedup", "0"][..], "speedup"),
        (&["sim", "--workers", "0"][..], "--workers"),
        (
            &["sim", "--decode-per-seq-us", "nan"][..],
            "--decode-per-seq-us",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn trtllm_workers_print_their_http_flag_and_serve_kv_cache_events() {
    let (child, out, text) = start(
        &[
            "--engine",
            "trtllm",
            "--workers",
            "2",
            "--port",
            "0",
            "--speedup",
            "1000",
            "--first-worker-id",
            "3",
        ],
        &[("KVENGINE_SIM_EVENT_BUFFER", "100")],
    );
    assert!(!text.contains("--zmq-worker"), "{text}");
    assert!(text.contains("block size 32"), "{text}");
    let flags: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kvengine sim: worker "))
        .filter_map(|l| l.split("--trtllm-worker ").nth(1))
        .map(str::trim)
        .collect();
    assert_eq!(flags.len(), 2, "{text}");
    for (i, flag) in flags.iter().enumerate() {
        let (id, url) = flag.split_once('=').unwrap();
        assert_eq!(id, (3 + i).to_string(), "{flag}");
        assert!(url.starts_with("http://127.0.0.1:"), "{flag}");
        let (status, body) = http(url, "POST", "/kv_cache_events", "");
        assert_eq!(status, 200, "{body}");
        let events: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(events[0]["event_id"], 0, "{body}");
        assert_eq!(events[0]["data"]["type"], "created", "{body}");
        // 64 tokens: two 32-token blocks stored.
        let prompt: Vec<u32> = (1000..1064).collect();
        let (status, body) = http(
            url,
            "POST",
            "/v1/completions",
            &serde_json::json!({"prompt": prompt, "max_tokens": 1}).to_string(),
        );
        assert_eq!(status, 200, "{body}");
        let (_, body) = http(url, "POST", "/kv_cache_events", "");
        let events: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(events[0]["event_id"], 1, "{body}");
        assert_eq!(events[0]["data"]["type"], "stored", "{body}");
        assert_eq!(
            events[0]["data"]["blocks"][0]["tokens"]
                .as_array()
                .unwrap()
                .len(),
            32
        );
    }
    let (rest, ok) = stop(child, out, "-TERM");
    assert!(ok, "{text}{rest}");
}

#[test]
fn a_trtllm_worker_registered_over_http_is_polled() {
    let (child, out, text) = start(
        &[
            "--engine",
            "trtllm",
            "--workers",
            "1",
            "--port",
            "0",
            "--speedup",
            "1000",
        ],
        &[],
    );
    let url = text
        .lines()
        .find_map(|l| l.split("--trtllm-worker ").nth(1))
        .and_then(|f| f.trim().split_once('='))
        .map(|(_, u)| u.to_owned())
        .unwrap_or_else(|| panic!("no worker flag: {text}"));
    // Workers registered over the API bring no block size: the router is told TensorRT-LLM's.
    let r = common::Router::start(&["--kv-cache-block-size", "32", "--tokenizer", "stand-in"]);
    let (status, body) = r.call(
        "POST",
        "/v1/workers",
        &serde_json::json!({"worker_id": 7, "url": url, "events": "trtllm", "poll_ms": 20})
            .to_string(),
    );
    assert_eq!(status, 201, "{body}");
    let prompt: Vec<u32> = (500..596).collect();
    let (status, body) = r.call(
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": "kvengine-sim", "prompt": prompt, "max_tokens": 1})
            .to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let query = serde_json::json!({"token_ids": prompt}).to_string();
    let start = std::time::Instant::now();
    loop {
        let (_, body) = r.call("POST", "/v1/overlap", &query);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["scores"] == serde_json::json!([{"worker_id": 7, "dp_rank": 0, "overlap_blocks": 3}]) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never indexed: {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, body) = r.call("GET", "/v1/workers", "");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["workers"][0]["stream"], "subscribed", "{body}");
    assert_eq!(v["workers"][0]["event_source"], "trtllm", "{body}");
    drop(r);
    let (rest, ok) = stop(child, out, "-TERM");
    assert!(ok, "{text}{rest}");
}

/// The command `kvengine sim` prints starts a router that finds the workers' caches: its
/// stand-in tokenizer agrees with theirs (the issue: the old hint, "run kvengine without
/// --tokenizer", left kv routing refusing to start with real-looking workers).
#[test]
fn the_printed_router_command_routes_text_prompts_onto_the_cache() {
    let (child, out, text) = start(&["--workers", "2", "--port", "0", "--speedup", "1000"], &[]);
    let line = text
        .lines()
        .find_map(|l| l.split("route to them with: kvengine ").nth(1))
        .unwrap_or_else(|| panic!("no router command: {text}"));
    let args: Vec<&str> = line.split_whitespace().collect();
    assert!(args.contains(&"stand-in"), "{line}");
    let router = common::Router::start(&args);
    let deadline = Instant::now() + Duration::from_secs(30);
    while router.try_call("GET", "/ready", "").map(|r| r.0) != Some(200) {
        assert!(Instant::now() < deadline, "never ready: {}", router.out);
        std::thread::sleep(Duration::from_millis(50));
    }
    // 64 words: four 16-token blocks. Once the first answer's KV events reached the router,
    // the same prompt is routed onto those blocks (the overlap metric counts them).
    let words: Vec<String> = (0..64).map(|i| format!("w{i}")).collect();
    let body =
        serde_json::json!({"model": "kvengine-sim", "prompt": words.join(" "), "max_tokens": 2})
            .to_string();
    let mut cached = 0;
    while router.metric_sum("kvengine_route_overlap_blocks_sum") < 3.0 {
        assert!(
            Instant::now() < deadline,
            "the router never found the prompt's blocks ({cached} cached tokens last): {}",
            router.out
        );
        let (status, answer) = router.call("POST", "/v1/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 64, "{answer}");
        cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    drop(router);
    let (rest, ok) = stop(child, out, "-TERM");
    assert!(ok, "{text}{rest}");
}
