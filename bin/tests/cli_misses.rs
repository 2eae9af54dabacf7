//! Miss attribution and `--shadow`, end to end: a `kvengine` process with simulated vLLM
//! workers (their answers report real `cached_tokens`), driven through the OpenAI front
//! door; `/metrics` says why each request missed the cache and what the shadow policy
//! would have had.

mod common;

use common::Router;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The sum of the series of `name` whose labels contain every one of `labels`.
fn series(r: &Router, name: &str, labels: &[&str]) -> f64 {
    let (_, text) = r.call("GET", "/metrics", "");
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A completion of `prompt` (token ids), `max_tokens` 2; `extra` is merged into the body,
/// `header` added to the request. Returns the status and the answer.
fn complete(
    r: &Router,
    prompt: &[u32],
    extra: serde_json::Value,
    header: Option<&str>,
) -> (u16, String) {
    let mut body = serde_json::json!({"model": "kvengine-sim", "prompt": prompt, "max_tokens": 2});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let body = body.to_string();
    let mut s = TcpStream::connect(&r.http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let header = header.map(|h| format!("{h}\r\n")).unwrap_or_default();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         {header}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    (status, resp)
}

/// Waits until the index shows a worker holding `blocks` blocks of `prompt`; returns it.
fn indexed(r: &Router, prompt: &[u32], blocks: u64) -> u64 {
    let query = serde_json::json!({"token_ids": prompt}).to_string();
    let start = Instant::now();
    loop {
        let (_, text) = r.call("POST", "/v1/overlap", &query);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if let Some(s) = v["scores"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["overlap_blocks"] == blocks))
        {
            return s["worker_id"].as_u64().unwrap();
        }
        assert!(start.elapsed().as_secs() < 20, "never indexed: {text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Round-robin sends a prompt's second copy to the worker that does not cache it: a
/// routing miss, which the `kv` shadow would have avoided; the first copy is cold and a
/// third (back on the first worker) a hit.
#[test]
fn round_robin_misses_are_routing_and_the_kv_shadow_sees_the_cache() {
    let r = Router::start(&[
        "--sim-workers",
        "2",
        "--sim-speedup",
        "100",
        "--router-mode",
        "round-robin",
        "--shadow",
        "kv",
    ]);
    // 100 tokens at 16 a block: 6 cacheable blocks (96 tokens).
    let prompt: Vec<u32> = (1..=100).collect();
    let (status, text) = complete(&r, &prompt, serde_json::json!({}), None);
    assert_eq!(status, 200, "{text}");
    let first = indexed(&r, &prompt, 6);
    let (status, text) = complete(&r, &prompt, serde_json::json!({}), None);
    assert_eq!(status, 200, "{text}");
    assert!(
        !text.contains(&format!("x-kvengine-worker-id: {first}\r\n")),
        "round-robin moved on: {text}"
    );
    assert!(text.contains("\"cached_tokens\":0"), "{text}");
    // Streamed, with the usage asked for: attributed too. Back on the first worker: a hit.
    let stream = serde_json::json!({"stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = complete(&r, &prompt, stream, None);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"cached_tokens\":96"), "{text}");

    let m = "kvengine_cache_miss_tokens_total";
    assert_eq!(series(&r, m, &["cause=\"cold\""]), 96.0);
    assert_eq!(series(&r, m, &["cause=\"routing\""]), 96.0);
    assert_eq!(series(&r, m, &["cause=\"stale\""]), 0.0);
    assert_eq!(series(&r, "kvengine_cache_hit_tokens_total", &[]), 96.0);
    let req = "kvengine_cache_requests_total";
    for (outcome, n) in [
        ("hit", 1.0),
        ("routing", 1.0),
        ("cold", 1.0),
        ("stale", 0.0),
    ] {
        let label = format!("outcome=\"{outcome}\"");
        assert_eq!(series(&r, req, &[&label]), n, "{outcome}");
    }
    assert_eq!(
        series(&r, "kvengine_cache_unattributed_requests_total", &[]),
        0.0
    );
    // Hit ratios: 0, 0 and 0.96.
    let hist = "kvengine_cache_hit_ratio_bucket";
    assert_eq!(series(&r, hist, &["le=\"0.0\""]), 2.0);
    assert_eq!(series(&r, hist, &["le=\"0.99\""]), 3.0);
    assert_eq!(series(&r, "kvengine_cache_hit_ratio_count", &[]), 3.0);

    // The shadow: kv saw the cache on the first worker at the second request; it would
    // have had 96 tokens where round-robin's route had (and found) none.
    assert_eq!(series(&r, "kvengine_shadow_info", &["shadow=\"kv\""]), 1.0);
    assert_eq!(series(&r, "kvengine_shadow_decisions_total", &[]), 3.0);
    assert!(series(&r, "kvengine_shadow_decisions_total", &["agreed=\"false\""]) >= 1.0);
    let overlap = "kvengine_shadow_overlap_tokens_total";
    assert_eq!(series(&r, overlap, &["policy=\"active\""]), 96.0);
    assert_eq!(series(&r, overlap, &["policy=\"shadow\""]), 192.0);
    let realised = "kvengine_shadow_realised_tokens_total";
    assert_eq!(series(&r, realised, &["policy=\"active\""]), 96.0);
    assert_eq!(series(&r, realised, &["policy=\"shadow\""]), 192.0);
}

/// Blocks the index believes a worker holds but it does not (stored events that the
/// worker never had: as after an eviction whose events were lost) are a stale miss of
/// that worker; a stream without its usage is unattributed; `--shadow header` compares
/// with the worker the request's header names.
#[test]
fn phantom_blocks_are_stale_and_the_header_shadow_is_compared() {
    let r = Router::start(&[
        "--sim-workers",
        "2",
        "--sim-speedup",
        "100",
        "--shadow",
        "header",
    ]);
    let (_, workers) = r.call("GET", "/v1/workers", "");
    let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
    let ids: Vec<u64> = workers["workers"]
        .as_array()
        .or(workers.as_array())
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_u64().or(w["id"].as_u64()).unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "{workers}");
    let (phantom, other) = (ids[0], ids[1]);
    // 100 tokens; the index is told `phantom` holds the first 4 blocks.
    let prompt: Vec<u32> = (1000..1100).collect();
    let blocks: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            serde_json::json!({
                "block_hash": 9_000_000_000u64 + i,
                "token_ids": &prompt[16 * i as usize..16 * (i as usize + 1)],
            })
        })
        .collect();
    let events = serde_json::json!({
        "worker_id": phantom,
        "events": [{"type": "stored", "parent_hash": null, "blocks": blocks}],
    });
    let (status, text) = r.call("POST", "/v1/events", &events.to_string());
    assert_eq!(status, 200, "{text}");
    let header = format!("x-kvengine-shadow-worker: {other}");
    let (status, text) = complete(&r, &prompt, serde_json::json!({}), Some(&header));
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains(&format!("x-kvengine-worker-id: {phantom}\r\n")),
        "kv mode follows the index: {text}"
    );
    assert!(text.contains("\"cached_tokens\":0"), "{text}");
    let m = "kvengine_cache_miss_tokens_total";
    assert_eq!(series(&r, m, &["cause=\"stale\""]), 64.0);
    assert_eq!(series(&r, m, &["cause=\"cold\""]), 32.0);
    assert_eq!(series(&r, m, &["cause=\"routing\""]), 0.0);
    let phantom_label = format!("worker_id=\"{phantom}\"");
    assert_eq!(
        series(&r, "kvengine_worker_stale_tokens_total", &[&phantom_label]),
        64.0
    );
    assert_eq!(
        series(&r, "kvengine_cache_requests_total", &["outcome=\"stale\""]),
        1.0
    );
    // The debug view has it, newest first.
    let (status, text) = r.call("GET", "/v1/misses", "");
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["shadow"], "header", "{text}");
    let last = &v["requests"][0];
    assert_eq!(last["outcome"], "stale", "{text}");
    assert_eq!(last["worker_id"], phantom, "{text}");
    assert_eq!(
        (
            &last["predicted_blocks"],
            &last["stale_blocks"],
            &last["cold_blocks"]
        ),
        (
            &serde_json::json!(4),
            &serde_json::json!(4),
            &serde_json::json!(2)
        ),
        "{text}"
    );
    assert_eq!(last["shadow_tokens"], 0, "{text}");
    // Beside the header's worker: it had nothing; kvengine predicted 64 and found none.
    assert_eq!(
        series(&r, "kvengine_shadow_decisions_total", &["agreed=\"false\""]),
        1.0
    );
    let overlap = "kvengine_shadow_overlap_tokens_total";
    assert_eq!(series(&r, overlap, &["policy=\"active\""]), 64.0);
    assert_eq!(series(&r, overlap, &["policy=\"shadow\""]), 0.0);
    // No header, or a bad one: not shadowed, and not a failure.
    let fresh: Vec<u32> = (5000..5040).collect();
    let bad = Some("x-kvengine-shadow-worker: not-a-number");
    for header in [None, bad] {
        let (status, text) = complete(&r, &fresh, serde_json::json!({}), header);
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(series(&r, "kvengine_shadow_decisions_total", &[]), 1.0);
    // An unknown worker named: a failure, counted.
    let (status, text) = complete(
        &r,
        &fresh,
        serde_json::json!({}),
        Some("x-kvengine-shadow-worker: 999"),
    );
    assert_eq!(status, 200, "{text}");
    assert_eq!(series(&r, "kvengine_shadow_failures_total", &[]), 1.0);
    // A stream without `include_usage` has no usage: unattributed, not guessed.
    let (status, text) = complete(&r, &fresh, serde_json::json!({"stream": true}), None);
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("\"usage\":{"), "{text}");
    let un = "kvengine_cache_unattributed_requests_total";
    assert_eq!(series(&r, un, &["reason=\"no_usage\""]), 1.0);
    assert_eq!(series(&r, un, &[]), 1.0);
    // Every answered request is counted once: of 5, 4 attributed (the stale one and the
    // three whole answers for `fresh`) and the stream unattributed.
    assert_eq!(series(&r, "kvengine_cache_requests_total", &[]), 4.0);
}
