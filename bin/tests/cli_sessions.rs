//! Sticky sessions and the admission queue through the `kvengine` binary: its flags and
//! environment variables reach the front door (simulated workers answer).

mod common;

use common::Router;
use std::time::Duration;

/// A chat completion with `headers` (whole lines); returns status and the lowercased head.
fn chat(r: &Router, headers: &str, text: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": "kvengine-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2
    })
    .to_string();
    common::post_head(
        &r.http,
        "/v1/chat/completions",
        headers,
        &body,
        Duration::from_secs(30),
    )
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

#[test]
fn sessions_stick_through_the_binary_and_its_flags_bound_them() {
    let r = Router::start(&[
        "--sim-workers",
        "3",
        "--sim-speedup",
        "100",
        "--max-sessions",
        "2",
        "--busy-max-active",
        "8",
        "--admission-queue",
        "16",
        "--admission-timeout-ms",
        "5000",
    ]);
    let (status, head) = chat(&r, "X-Dynamo-Session-ID: agent-1\r\n", "first turn");
    assert_eq!(status, 200, "{head}");
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));
    let home = header(&head, "x-kvengine-worker-id").unwrap().to_owned();
    for turn in 0..4 {
        let (status, head) = chat(
            &r,
            "x-kvengine-session: agent-1\r\n",
            &format!("turn {turn} with different words"),
        );
        assert_eq!(status, 200);
        assert_eq!(header(&head, "x-kvengine-route"), Some("session"));
        assert_eq!(header(&head, "x-kvengine-worker-id"), Some(home.as_str()));
    }
    for s in ["agent-2", "agent-3"] {
        let (status, _) = chat(&r, &format!("x-kvengine-session: {s}\r\n"), "hello");
        assert_eq!(status, 200);
    }
    // --max-sessions 2: agent-1, the least recently used, was evicted.
    assert_eq!(r.metric("kvengine_sessions"), Some(2.0));
    assert_eq!(r.metric_sum("kvengine_sessions_removed_total"), 1.0);
    assert_eq!(r.metric_sum("kvengine_session_requests_total"), 7.0);
    // Nothing was busy at 8 active: nobody queued.
    assert_eq!(r.metric("kvengine_admission_queued_total"), Some(0.0));
    assert_eq!(r.metric("kvengine_admission_queue_depth"), Some(0.0));
    let (status, _) = chat(&r, "x-kvengine-priority: soon\r\n", "hello");
    assert_eq!(status, 400);
}

#[test]
fn a_zero_ttl_from_the_environment_turns_sessions_off() {
    let r = Router::start_with_env(
        &["--sim-workers", "2", "--sim-speedup", "100"],
        &[("KVENGINE_SESSION_TTL_SECS", "0")],
    );
    let (status, head) = chat(&r, "x-kvengine-session: agent-1\r\n", "hello");
    assert_eq!(status, 200);
    assert_eq!(header(&head, "x-kvengine-route"), None);
    assert_eq!(r.metric("kvengine_sessions"), Some(0.0));
}
