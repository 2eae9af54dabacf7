//! The OpenAI proxy over real sockets: stub workers (axum servers that answer like vLLM, fail
//! before answering, or die mid-stream), a real engine behind the hub, and a plain HTTP
//! client. Checks routing by overlap, streaming, the retry, error shapes, and that every
//! routed request is freed (including when the client goes away mid-stream).

mod common;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, tokens_hash};
use engine::{DpRank, EngineHash, WorkerId, WorkerKey};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport::http::{HttpConfig, router};
use transport::hub::{Hub, Registration};
use transport::openai::fallback;
use transport::openai::proxy::{ProxyConfig, openai_router};

/// How a stub worker behaves.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// Answers: SSE chunks (`n` of them, `gap` apart) when the body asks to stream, else JSON.
    Good { n: usize, gap: Duration },
    /// 500 before any byte.
    Fails,
    /// Streams two chunks, then the connection drops.
    DiesMidStream,
}

struct Stub {
    url: String,
    hits: Arc<AtomicUsize>,
    bodies: Arc<std::sync::Mutex<Vec<Bytes>>>,
}

async fn stub(b: Behaviour) -> Stub {
    let hits = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (h, bs) = (hits.clone(), bodies.clone());
    let handler = move |body: Bytes| {
        let (h, bs) = (h.clone(), bs.clone());
        async move {
            h.fetch_add(1, SeqCst);
            bs.lock().unwrap().push(body.clone());
            let stream: bool = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["stream"].as_bool())
                .unwrap_or(false);
            match b {
                Behaviour::Fails => Response::builder()
                    .status(500)
                    .body(Body::from("boom"))
                    .unwrap(),
                Behaviour::Good { n, gap } if stream => {
                    let chunks = async_stream(n, gap, false);
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(chunks))
                        .unwrap()
                }
                Behaviour::DiesMidStream => Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(async_stream(
                        2,
                        Duration::from_millis(5),
                        true,
                    )))
                    .unwrap(),
                Behaviour::Good { .. } => Response::builder()
                    .header("content-type", "application/json")
                    .body(Body::from(
                        json!({"object": "text_completion", "choices": [{"text": "ok"}]})
                            .to_string(),
                    ))
                    .unwrap(),
            }
        }
    };
    let app = Router::new()
        .route("/v1/completions", post(handler.clone()))
        .route("/v1/chat/completions", post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Stub { url, hits, bodies }
}

/// `n` SSE events `gap` apart, then `[DONE]` (or an error after them when `die`).
fn async_stream(
    n: usize,
    gap: Duration,
    die: bool,
) -> impl futures_core::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        for i in 0..n {
            let chunk = format!(
                "data: {}\n\n",
                json!({"choices": [{"text": i.to_string()}]})
            );
            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                return;
            }
            tokio::time::sleep(gap).await;
        }
        let last = if die {
            Err(std::io::Error::other("worker died"))
        } else {
            Ok(Bytes::from_static(b"data: [DONE]\n\n"))
        };
        let _ = tx.send(last).await;
    });
    tokio_stream_from(rx)
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures_core::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

struct Router2 {
    base: String,
    hub: Arc<Hub>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn router_with(workers: &[(u64, &Stub)]) -> Router2 {
    router_with_config(workers, ProxyConfig::default()).await
}

async fn router_with_config(workers: &[(u64, &Stub)], cfg: ProxyConfig) -> Router2 {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    for (id, s) in workers {
        hub.register(Registration {
            url: Some(s.url.clone()),
            ..Registration::new(WorkerId(*id))
        })
        .unwrap();
    }
    let app = router(hub.clone(), HttpConfig::default()).merge(openai_router(hub.clone(), cfg));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    Router2 {
        base: format!("http://{addr}"),
        hub,
        _stop: stop,
    }
}

/// A raw HTTP/1.1 POST; returns (status, body text).
async fn post_raw(base: &str, path: &str, body: &str) -> (u16, String) {
    let ct = "Content-Type: application/json\r\n";
    let (status, _, body) = common::raw_request(base, "POST", path, ct, body).await;
    (status, body)
}

/// A raw POST; returns (status, response head).
async fn post_head(base: &str, path: &str, body: &str) -> (u16, String) {
    let (status, head, _) = common::raw_request(base, "POST", path, "", body).await;
    (status, head)
}

/// Stores `tokens`' full blocks on `worker` (rank 0).
fn cache(hub: &Hub, worker: u64, tokens: &[u32]) {
    let blocks = tokens
        .chunks_exact(16)
        .enumerate()
        .map(|(i, c)| StoredBlock {
            engine_hash: EngineHash(worker << 32 | i as u64),
            tokens_hash: tokens_hash(c, lora_seed(None)),
        })
        .collect();
    let key = WorkerKey {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
    };
    hub.ingest(
        key,
        vec![KvEvent::Stored {
            parent: None,
            blocks,
        }],
    )
    .unwrap();
    hub.sync().unwrap();
}

async fn idle(hub: &Hub) {
    let start = Instant::now();
    while hub.routing().active_requests() != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "requests leaked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn long_text(words: usize, salt: &str) -> String {
    (0..words).map(|i| format!("{salt}{i} ")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_worker_holding_their_prefix_and_stream_back() {
    let good = Behaviour::Good {
        n: 5,
        gap: Duration::from_millis(2),
    };
    let (a, b) = (stub(good).await, stub(good).await);
    let r = router_with(&[(1, &a), (2, &b)]).await;
    let system = long_text(64, "sys");
    let messages =
        json!([{"role": "system", "content": system}, {"role": "user", "content": "hello"}]);
    let parsed: Vec<transport::openai::tokenize::ChatMessage> =
        serde_json::from_value(messages.clone()).unwrap();
    let tokens = fallback::chat_token_ids(&parsed);
    cache(&r.hub, 2, &tokens[..64]);

    let body = json!({"model": "m", "messages": messages, "stream": true}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(b.hits.load(SeqCst), 1, "the worker with the cached prefix");
    assert_eq!(a.hits.load(SeqCst), 0);
    for i in 0..5 {
        assert!(text.contains(&format!(r#""text":"{i}""#)), "{text}");
    }
    assert!(text.contains("[DONE]"));
    // The body reached the worker unchanged.
    assert_eq!(b.bodies.lock().unwrap()[0], Bytes::from(body));
    idle(&r.hub).await;

    // Completions with token ids, not streamed.
    let body = json!({"prompt": tokens, "max_tokens": 4}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(b.hits.load(SeqCst), 2);
    assert!(text.contains("text_completion"));
    idle(&r.hub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_retried_once_on_the_next_best() {
    let broken = stub(Behaviour::Fails).await;
    let good = stub(Behaviour::Good {
        n: 1,
        gap: Duration::ZERO,
    })
    .await;
    let r = router_with(&[(1, &broken), (2, &good)]).await;
    let prompt: Vec<u32> = (0..64).collect();
    cache(&r.hub, 1, &prompt);
    let body = json!({"prompt": prompt}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(broken.hits.load(SeqCst), 1);
    assert_eq!(good.hits.load(SeqCst), 1);
    let (_, head) = post_head(&r.base, "/v1/completions", &body).await;
    assert!(head.contains("x-kvengine-worker-id: 2"), "{head}");
    idle(&r.hub).await;

    // Both failing: a clear OpenAI error, nothing leaked.
    let broken2 = stub(Behaviour::Fails).await;
    let r = router_with(&[(1, &broken), (2, &broken2)]).await;
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 502, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "upstream_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("failed"));
    idle(&r.hub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let dying = stub(Behaviour::DiesMidStream).await;
    let r = router_with(&[(1, &dying)]).await;
    let body = json!({"prompt": "a b c d", "stream": true}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert!(text.contains(r#""text":"0""#), "{text}");
    assert!(text.contains("upstream_error"), "{text}");
    assert!(!text.contains("[DONE]"));
    idle(&r.hub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_frees_its_request() {
    let slow = stub(Behaviour::Good {
        n: 200,
        gap: Duration::from_millis(20),
    })
    .await;
    let r = router_with(&[(1, &slow)]).await;
    let addr = r.base.trim_start_matches("http://").to_owned();
    let body = json!({"prompt": "x y z", "stream": true}).to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).await.unwrap();
    assert!(n > 0);
    assert_eq!(r.hub.routing().active_requests(), 1);
    drop(s);
    idle(&r.hub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_openai_errors_and_are_not_forwarded() {
    let w = stub(Behaviour::Good {
        n: 1,
        gap: Duration::ZERO,
    })
    .await;
    let r = router_with(&[(1, &w)]).await;
    for (path, body, param) in [
        ("/v1/completions", "{", Value::Null),
        ("/v1/completions", r#"{"prompt": 7}"#, json!("prompt")),
        ("/v1/completions", r#"{"max_tokens": 3}"#, json!("prompt")),
        (
            "/v1/completions",
            r#"{"prompt": ["a", "b"]}"#,
            json!("prompt"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            json!("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"content": "no role"}]}"#,
            Value::Null,
        ),
        ("/v1/chat/completions", "[]", Value::Null),
    ] {
        let (status, text) = post_raw(&r.base, path, body).await;
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(v["error"]["param"], param, "{body}");
        assert!(v["error"]["message"].is_string());
    }
    assert_eq!(w.hits.load(SeqCst), 0);
    assert_eq!(r.hub.routing().active_requests(), 0);

    // No worker at all: 503.
    let r = router_with(&[]).await;
    let (status, text) = post_raw(&r.base, "/v1/completions", r#"{"prompt": [1, 2]}"#).await;
    assert_eq!(status, 503, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_models_tokenizer_chats_route_on_the_templated_token_ids() {
    use transport::openai::tokenize::{ChatMessage, PromptTokenizer};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/llama3");
    let tokenizer = Arc::new(PromptTokenizer::from_path(&dir).unwrap());
    let good = Behaviour::Good {
        n: 1,
        gap: Duration::ZERO,
    };
    let (a, b) = (stub(good).await, stub(good).await);
    let cfg = ProxyConfig {
        tokenizer: Some(tokenizer.clone()),
        ..ProxyConfig::default()
    };
    let r = router_with_config(&[(1, &a), (2, &b)], cfg).await;
    let system = "You are a helpful assistant . ".repeat(8);
    let messages = vec![
        ChatMessage::text("system", system.clone()),
        ChatMessage::text("user", "What is the weather in Paris ?"),
    ];
    let tokens = tokenizer.chat_token_ids(&messages).unwrap();
    assert!(tokens.len() >= 32, "{}", tokens.len());
    // Worker 2 holds the templated prompt's first two blocks; the stand-in tokenizer's ids
    // would share nothing with them, and a tie goes to worker 1.
    cache(&r.hub, 2, &tokens[..32]);
    let body = json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the weather in Paris ?"}
    ]})
    .to_string();
    let (status, text) = post_raw(&r.base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!((a.hits.load(SeqCst), b.hits.load(SeqCst)), (0, 1));
    // A template that cannot render this chat is the client's error.
    let (status, text) = post_raw(
        &r.base,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
    )
    .await;
    assert_eq!(status, 400, "{text}");
    idle(&r.hub).await;
}

/// The front door's own metrics: answers by status, time to first chunk, gaps between
/// chunks and end to end, measured at the proxy; upstream failures and retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_measures_what_it_forwards() {
    use std::sync::atomic::Ordering::Relaxed;
    let broken = stub(Behaviour::Fails).await;
    let good = stub(Behaviour::Good {
        n: 4,
        gap: Duration::from_millis(20),
    })
    .await;
    let r = router_with(&[(1, &broken), (2, &good)]).await;
    let prompt: Vec<u32> = (0..64).collect();
    cache(&r.hub, 1, &prompt);
    // Streamed: the broken worker holds the prompt, fails, and the good one answers.
    let body = json!({"prompt": prompt, "stream": true}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = post_raw(&r.base, "/v1/completions", "{not json").await;
    assert_eq!(status, 400);
    let m = r.hub.metrics();
    assert_eq!(m.answers(), vec![(200, 1), (400, 1)]);
    // The answer routed in the unnamed pool is labelled "", the malformed one "(none)".
    assert_eq!(
        m.answers_by_model(),
        vec![(("".to_owned(), 200), 1), (("(none)".to_owned(), 400), 1)]
    );
    assert_eq!(
        (m.upstream_errors.load(Relaxed), m.retries.load(Relaxed)),
        (1, 1)
    );
    let (_, ttft_n, ttft_s) = m.ttft.snapshot();
    let (_, e2e_n, e2e_s) = m.end_to_end.snapshot();
    let (_, gaps, _) = m.inter_chunk.snapshot();
    assert_eq!((ttft_n, e2e_n), (1, 1));
    // Four events and [DONE], 20 ms apart: at least three gaps, and the answer took 60 ms+.
    assert!(gaps >= 3, "{gaps}");
    assert!(e2e_s >= 0.06 && e2e_s >= ttft_s, "{e2e_s} {ttft_s}");
    let text = metrics_page(&r.base).await;
    for series in [
        "kvengine_frontdoor_requests_total{model=\"\",status=\"200\"} 1",
        "kvengine_frontdoor_requests_total{model=\"(none)\",status=\"400\"} 1",
        "kvengine_frontdoor_ttft_seconds_count 1",
        "kvengine_frontdoor_retries_total 1",
        "kvengine_frontdoor_upstream_errors_total 1",
    ] {
        assert!(text.contains(series), "no {series} in\n{text}");
    }
}

async fn metrics_page(base: &str) -> String {
    common::raw_request(base, "GET", "/metrics", "", "").await.2
}

/// Stores `tokens`' full blocks on `worker` (rank 0) as vLLM keys them for a request with
/// `cache_salt`: the salt folded into block 0 (what a `BlockStored` with the salt in its
/// `extra_keys` converts to).
fn cache_salted(hub: &Hub, worker: u64, tokens: &[u32], salt: &str) {
    use engine::hash::{ExtraKey, fold_extras};
    let blocks = tokens
        .chunks_exact(16)
        .enumerate()
        .map(|(i, c)| {
            let plain = tokens_hash(c, lora_seed(None));
            let salted = fold_extras(plain, &[ExtraKey::CacheSalt(salt.into())]);
            StoredBlock {
                engine_hash: EngineHash(worker << 32 | i as u64),
                tokens_hash: if i == 0 { salted } else { plain },
            }
        })
        .collect();
    let key = WorkerKey {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
    };
    hub.ingest(
        key,
        vec![KvEvent::Stored {
            parent: None,
            blocks,
        }],
    )
    .unwrap();
    hub.sync().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_request_routes_only_on_blocks_of_its_salt() {
    let good = Behaviour::Good {
        n: 1,
        gap: Duration::from_millis(1),
    };
    let (a, b) = (stub(good).await, stub(good).await);
    let r = router_with(&[(1, &a), (2, &b)]).await;
    let tokens: Vec<u32> = (0..64).map(|t| 1000 + t).collect();
    cache(&r.hub, 1, &tokens);
    cache_salted(&r.hub, 2, &tokens, "tenant-a");

    // The salted request goes to the worker holding its salt's blocks, body unchanged.
    let body = json!({"prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-a"}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!((a.hits.load(SeqCst), b.hits.load(SeqCst)), (0, 1));
    assert_eq!(b.bodies.lock().unwrap()[0], Bytes::from(body));
    idle(&r.hub).await;

    // Unsalted (absent or empty salt): the unsalted blocks only.
    for body in [
        json!({"prompt": tokens, "max_tokens": 1}),
        json!({"prompt": tokens, "max_tokens": 1, "cache_salt": ""}),
    ] {
        let (status, text) = post_raw(&r.base, "/v1/completions", &body.to_string()).await;
        assert_eq!(status, 200, "{text}");
        idle(&r.hub).await;
    }
    assert_eq!((a.hits.load(SeqCst), b.hits.load(SeqCst)), (2, 1));

    // Another tenant's salt matches nothing; `/v1/overlap` shows the same keying.
    let overlap = |salt: Option<&str>| {
        let mut v = json!({"token_ids": tokens});
        if let Some(s) = salt {
            v["cache_salt"] = s.into();
        }
        v.to_string()
    };
    for (salt, want) in [
        (
            None,
            json!([{"worker_id": 1, "dp_rank": 0, "overlap_blocks": 4}]),
        ),
        (
            Some("tenant-a"),
            json!([{"worker_id": 2, "dp_rank": 0, "overlap_blocks": 4}]),
        ),
        (Some("tenant-b"), json!([])),
    ] {
        let (status, text) = post_raw(&r.base, "/v1/overlap", &overlap(salt)).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["scores"], want, "{salt:?}");
    }

    // A salt that is not a string is refused, as vLLM refuses it, and not forwarded.
    let body = json!({"prompt": tokens, "cache_salt": 5}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("cache_salt"), "{text}");
    assert_eq!((a.hits.load(SeqCst), b.hits.load(SeqCst)), (2, 1));
}

/// The chunks of an answer that reach the router together go out to the client in one
/// write (relay invariant 4), in order and whole; nothing waits for a chunk not yet arrived.
#[tokio::test(flavor = "current_thread")]
async fn chunks_that_arrive_together_go_out_in_one_write() {
    use std::sync::atomic::Ordering::Relaxed;
    // A worker that writes 40 events at once (its stream yields them without a gap, so its
    // HTTP server puts several in each write), then, after a pause, 3 more one by one.
    let app = Router::new().route(
        "/v1/completions",
        post(|| async {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
            for i in 0..40 {
                let chunk = format!(
                    "data: {}\n\n",
                    json!({"choices": [{"text": i.to_string()}]})
                );
                tx.try_send(Ok(Bytes::from(chunk))).unwrap();
            }
            tokio::spawn(async move {
                for i in 40..43 {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let chunk = format!(
                        "data: {}\n\n",
                        json!({"choices": [{"text": i.to_string()}]})
                    );
                    let _ = tx.send(Ok(Bytes::from(chunk))).await;
                }
                let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(tokio_stream_from(rx)))
                .unwrap()
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let worker = Stub {
        url,
        hits: Arc::new(AtomicUsize::new(0)),
        bodies: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let r = router_with(&[(1, &worker)]).await;
    let body = json!({"prompt": "a b c", "stream": true}).to_string();
    let (status, text) = post_raw(&r.base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    // Every event, in order, then [DONE].
    let texts: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].to_string())
        .collect();
    let want: Vec<String> = (0..43).map(|i| format!("\"{i}\"")).collect();
    assert_eq!(texts, want);
    let done = text.find("data: [DONE]").expect("[DONE]");
    assert!(done > text.find("{\"text\":\"42\"}").unwrap(), "{text}");
    // 44 chunks relayed: the 40 sent together took a few writes, the last 4 one each.
    let writes = r.hub.metrics().answer_writes.load(Relaxed);
    let (_, gaps, _) = r.hub.metrics().inter_chunk.snapshot();
    assert_eq!(gaps, 43, "every chunk is still measured");
    assert!(
        (4..=20).contains(&writes),
        "{writes} writes for 44 chunks, 40 of them sent together"
    );
    idle(&r.hub).await;
}
