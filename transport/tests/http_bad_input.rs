//! The HTTP edge on bad input: malformed JSON, wrong types, missing fields, out-of-range
//! numbers, oversized bodies and seeded random bytes. Every answer must be a 2xx or a JSON
//! error with a 4xx (or 503) status; the server must keep serving.

mod common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::sync::Arc;
use transport::DropReason;
use transport::http::HttpConfig;
use transport::hub::Hub;

const LIMIT: usize = 64 << 10;

struct Server {
    base: String,
    hub: Arc<Hub>,
    client: Client<HttpConnector, Full<Bytes>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Server {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    let cfg = HttpConfig {
        max_body_bytes: LIMIT,
        ..HttpConfig::default()
    };
    let (base, stop) = common::http_server(hub.clone(), cfg).await;
    Server {
        base,
        hub,
        client: Client::builder(TokioExecutor::new()).build_http(),
        _stop: stop,
    }
}

impl Server {
    async fn send(&self, method: Method, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, bytes.to_vec())
    }

    /// Sends `body`, checks the answer's shape, and returns the status and error code.
    async fn check(&self, path: &str, body: Vec<u8>) -> (StatusCode, String) {
        let shown = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        let (status, text) = self.send(Method::POST, path, body).await;
        assert!(
            status.is_success()
                || status.is_client_error()
                || status == StatusCode::SERVICE_UNAVAILABLE,
            "{path} {shown:?}: status {status}"
        );
        let v: Value = serde_json::from_slice(&text)
            .unwrap_or_else(|e| panic!("{path} {shown:?}: not JSON ({e}): {text:?}"));
        if status.is_success() {
            return (status, String::new());
        }
        let code = v["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("{path} {shown:?}: no error code in {v}"))
            .to_owned();
        assert!(
            code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
            "{code}"
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        (status, code)
    }

    async fn expect(&self, path: &str, body: impl Into<Vec<u8>>, status: StatusCode, code: &str) {
        let body = body.into();
        let shown = String::from_utf8_lossy(&body).into_owned();
        let got = self.check(path, body).await;
        assert_eq!(got, (status, code.to_owned()), "{path} {shown}");
    }
}

const POSTS: [&str; 6] = [
    "/v1/overlap",
    "/v1/route",
    "/v1/events",
    "/v1/workers",
    "/v1/load",
    "/v1/requests/r/prefilled",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_is_400_and_counted() {
    let s = start().await;
    let bad = StatusCode::BAD_REQUEST;
    let mut n = 0;
    for path in &POSTS[..5] {
        for body in [
            &b""[..],
            b"{",
            b"nul",
            b"[1, 2",
            b"{\"token_ids\": [1,]}",
            b"\xff\xfe",
            b"{} {}",
        ] {
            s.expect(path, body, bad, "malformed_json").await;
            n += 1;
        }
    }
    assert_eq!(s.hub.metrics().dropped(DropReason::MalformedJson), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_types_missing_fields_and_out_of_range_numbers() {
    let s = start().await;
    let bad = StatusCode::BAD_REQUEST;
    let m = "malformed_json";
    s.expect(
        "/v1/workers",
        json!({"worker_id": 1}).to_string(),
        StatusCode::CREATED,
        "",
    )
    .await;
    let cases: Vec<(&str, Value)> = vec![
        ("/v1/overlap", json!({})),
        ("/v1/overlap", json!({"token_ids": "1 2 3"})),
        ("/v1/overlap", json!({"token_ids": [1, -2]})),
        ("/v1/overlap", json!({"token_ids": [4294967296u64]})),
        ("/v1/overlap", json!({"token_ids": [1.5]})),
        ("/v1/overlap", json!({"token_ids": [null]})),
        ("/v1/overlap", json!({"token_ids": [1], "lora_name": 7})),
        ("/v1/route", json!({"token_ids": [1], "request_id": 5})),
        ("/v1/route", json!({"token_ids": [1], "worker_id": -1})),
        ("/v1/route", json!({"token_ids": [1], "worker_id": 1.0e30})),
        ("/v1/route", json!({"token_ids": [1], "temperature": "hot"})),
        ("/v1/route", json!([1, 2, 3])),
        ("/v1/events", json!({"events": []})),
        ("/v1/events", json!({"worker_id": 1})),
        ("/v1/events", json!({"worker_id": -1, "events": []})),
        (
            "/v1/events",
            json!({"worker_id": 1, "dp_rank": 4294967296u64, "events": []}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "events": [{"type": "nope"}]}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "events": [{"blocks": []}]}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "events": [{"type": "stored"}]}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "events": [{"type": "removed", "block_hashes": [-1]}]}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [4294967296u64]}]}]}),
        ),
        (
            "/v1/events",
            json!({"worker_id": 1, "seq": -1, "events": []}),
        ),
        ("/v1/workers", json!({})),
        ("/v1/workers", json!({"worker_id": "one"})),
        ("/v1/workers", json!({"worker_id": 1, "dp_ranks": [-1]})),
        ("/v1/workers", json!({"worker_id": 1, "url": 80})),
        ("/v1/load", json!({"worker_id": 1, "kv_usage": 0.5})),
        (
            "/v1/load",
            json!({"worker_id": 1, "num_requests_waiting": -1, "kv_usage": 0.5}),
        ),
        (
            "/v1/load",
            json!({"worker_id": 1, "num_requests_waiting": 0, "kv_usage": "full"}),
        ),
    ];
    for (path, body) in cases {
        s.expect(path, body.to_string(), bad, m).await;
    }
    // Duplicate keys written out by hand (json! would merge them).
    s.expect(
        "/v1/route",
        r#"{"token_ids": [1], "token_ids": [2]}"#,
        bad,
        m,
    )
    .await;
    // Huge numbers beyond u64, and exponents.
    s.expect("/v1/overlap", r#"{"token_ids": [1e400]}"#, bad, m)
        .await;
    s.expect(
        "/v1/events",
        r#"{"worker_id": 184467440737095516160, "events": []}"#,
        bad,
        m,
    )
    .await;
    // Valid JSON, invalid values.
    let inv = "invalid_argument";
    s.expect(
        "/v1/route",
        json!({"token_ids": [1], "mode": "fast"}).to_string(),
        bad,
        inv,
    )
    .await;
    s.expect(
        "/v1/route",
        json!({"token_ids": [1], "overlap_weight": -1}).to_string(),
        bad,
        inv,
    )
    .await;
    s.expect(
        "/v1/load",
        json!({"worker_id": 1, "num_requests_waiting": 0, "kv_usage": 2}).to_string(),
        bad,
        inv,
    )
    .await;
    s.expect(
        "/v1/workers",
        json!({"worker_id": 2, "url": "not a url"}).to_string(),
        bad,
        inv,
    )
    .await;
    s.expect(
        "/v1/workers",
        json!({"worker_id": 2, "zmq": ""}).to_string(),
        bad,
        inv,
    )
    .await;
    // A stored block with the wrong number of tokens, alone: nothing applied.
    s.expect(
        "/v1/events",
        json!({"worker_id": 1, "events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [1, 2]}]}]}).to_string(),
        bad,
        "nothing_applied",
    )
    .await;
    // Unknown worker and request.
    s.expect(
        "/v1/events",
        json!({"worker_id": 2, "events": []}).to_string(),
        StatusCode::NOT_FOUND,
        "unknown_worker",
    )
    .await;
    s.expect(
        "/v1/requests/zzz/prefilled",
        "",
        StatusCode::NOT_FOUND,
        "unknown_request",
    )
    .await;
    let (st, _) = s
        .send(Method::DELETE, "/v1/requests/%FF%FE", Vec::new())
        .await;
    assert!(st.is_client_error(), "{st}");
    let (st, _) = s
        .send(
            Method::DELETE,
            "/v1/workers/18446744073709551616",
            Vec::new(),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    // Token ids at the edges of u32 are fine.
    s.expect(
        "/v1/overlap",
        json!({"token_ids": [0, 4294967295u64]}).to_string(),
        StatusCode::OK,
        "",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_413() {
    let s = start().await;
    let ids: Vec<String> = (0..LIMIT / 4).map(|i| (i % 100_000).to_string()).collect();
    let big = format!("{{\"token_ids\": [{}]}}", ids.join(","));
    assert!(big.len() > LIMIT);
    // (The prefilled endpoint reads no body.)
    for path in &POSTS[..5] {
        s.expect(
            path,
            big.clone(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        )
        .await;
    }
    assert_eq!(s.hub.metrics().dropped(DropReason::Oversized), 5);
    // Just under the limit is fine.
    let ids: Vec<String> = (0..LIMIT / 8).map(|i| (i % 1000).to_string()).collect();
    let ok = format!("{{\"token_ids\": [{}]}}", ids.join(","));
    assert!(ok.len() < LIMIT);
    s.expect("/v1/overlap", ok, StatusCode::OK, "").await;
}

/// xorshift64*: a tiny seeded generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn valid_bodies() -> Vec<(&'static str, String)> {
    let block: Vec<u32> = (0..16).collect();
    vec![
        ("/v1/overlap", json!({"token_ids": (0..40).collect::<Vec<u32>>()}).to_string()),
        ("/v1/route", json!({"token_ids": (0..40).collect::<Vec<u32>>(), "mode": "kv", "temperature": 0.1}).to_string()),
        ("/v1/events", json!({"worker_id": 1, "seq": 3, "events": [{"type": "stored", "parent_hash": null, "blocks": [{"block_hash": 5, "token_ids": block}]}, {"type": "removed", "block_hashes": [5]}, {"type": "cleared"}]}).to_string()),
        ("/v1/workers", json!({"worker_id": 1, "url": "http://127.0.0.1:1", "dp_ranks": [0]}).to_string()),
        ("/v1/load", json!({"worker_id": 1, "num_requests_waiting": 1, "kv_usage": 0.5}).to_string()),
        ("/v1/requests/r/prefilled", "{}".to_owned()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_random_and_mutated_bodies_never_break_the_server() {
    let s = start().await;
    s.expect(
        "/v1/workers",
        json!({"worker_id": 1}).to_string(),
        StatusCode::CREATED,
        "",
    )
    .await;
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let valid = valid_bodies();
    let alphabet = b"{}[]\",:0123456789-+.eE \ntruefalsnul\\u";
    for round in 0..300 {
        for (path, body) in &valid {
            let mut b = body.clone().into_bytes();
            match round % 4 {
                // Random bytes.
                0 => {
                    let n = rng.below(200);
                    b = (0..n).map(|_| rng.next() as u8).collect();
                }
                // JSON-ish noise.
                1 => {
                    let n = rng.below(120);
                    b = (0..n)
                        .map(|_| alphabet[rng.below(alphabet.len())])
                        .collect();
                }
                // A few mutated bytes of a valid body.
                2 => {
                    for _ in 0..1 + rng.below(3) {
                        let i = rng.below(b.len());
                        b[i] = if rng.next() & 1 == 0 {
                            rng.next() as u8
                        } else {
                            alphabet[rng.below(alphabet.len())]
                        };
                    }
                }
                // Truncated.
                _ => b.truncate(rng.below(b.len())),
            }
            s.check(path, b).await;
        }
    }
    // Still serving.
    let (st, text) = s.send(Method::GET, "/healthz", Vec::new()).await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&text));
    let (st, _) = s.send(Method::GET, "/metrics", Vec::new()).await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_have_a_length_cap() {
    let s = start().await;
    s.expect(
        "/v1/workers",
        json!({"worker_id": 1}).to_string(),
        StatusCode::CREATED,
        "",
    )
    .await;
    let cap = engine::router::MAX_REQUEST_ID_BYTES;
    let long = json!({"token_ids": [1, 2, 3], "request_id": "x".repeat(cap + 1)});
    s.expect(
        "/v1/route",
        long.to_string(),
        StatusCode::BAD_REQUEST,
        "invalid_argument",
    )
    .await;
    assert_eq!(
        s.hub.routing().active_requests(),
        0,
        "a refused id records nothing"
    );
    let longest = json!({"token_ids": [1, 2, 3], "request_id": "x".repeat(cap)});
    s.expect("/v1/route", longest.to_string(), StatusCode::OK, "")
        .await;
    assert_eq!(s.hub.routing().active_requests(), 1);
}
