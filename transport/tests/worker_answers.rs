//! What the router reads back from workers is bounded, over real sockets: fake workers
//! answer `/health`, `/metrics`, `/v1/models` and a disaggregated prefill with 100 MiB
//! (streamed from one static 64 KiB chunk, never whole in memory), or trickle a byte at a
//! time forever. The router refuses each within its deadline, counts it under
//! `kvengine_worker_answers_refused_total{kind,reason}`, reads only a small part of what
//! was offered, and stays up.

mod common;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use engine::WorkerId;
use engine::sched::{SplitConfig, WorkerRole};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};
use transport::http::health::health_loop;
use transport::http::{HttpConfig, router};
use transport::hub::{Hub, Registration};
use transport::openai::disagg::{DisaggConfig, Protocol};
use transport::openai::proxy::{ProxyConfig, openai_router};

/// What the fake workers offer when asked for a lot.
const HUGE: u64 = 100 << 20;
/// More than any cap plus what loopback socket buffers can hold: a router that read less
/// than this did not read the answer whole.
const READ_LESS_THAN: u64 = 48 << 20;

static CHUNK: [u8; 64 << 10] = [b'x'; 64 << 10];

/// How one path of a fake worker answers.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// 200 with this body.
    Small(&'static str),
    /// 200 with `HUGE` bytes, announced in `Content-Length` or chunked; `json` wraps them
    /// in a valid JSON object with vLLM's prefill fields.
    Huge { length: bool, json: bool },
    /// 200, then one byte every 50 ms, forever.
    Trickle,
}

/// The most bytes one streamed answer of a fake worker handed to its connection.
type Sent = Arc<AtomicU64>;

fn answer(a: Answer, most: &Sent) -> Response {
    let (most, sent) = (most.clone(), AtomicU64::new(0));
    let sent = move |n: u64| {
        most.fetch_max(sent.fetch_add(n, Relaxed) + n, Relaxed);
    };
    match a {
        Answer::Small(text) => Response::new(Body::from(text)),
        Answer::Huge { length, json } => {
            let (head, tail): (&[u8], &[u8]) = match json {
                true => (
                    br#"{"choices":[{"text":"x"}],"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]},"pad":""#,
                    br#""}"#,
                ),
                false => (b"", b""),
            };
            let chunks = (HUGE / CHUNK.len() as u64) as usize;
            let parts = std::iter::once(Bytes::from_static(head))
                .chain(std::iter::repeat_n(Bytes::from_static(&CHUNK), chunks))
                .chain(std::iter::once(Bytes::from_static(tail)));
            let total = head.len() as u64 + HUGE + tail.len() as u64;
            let stream = futures_util::stream::iter(parts.map(move |b| {
                sent(b.len() as u64);
                Ok::<_, std::io::Error>(b)
            }));
            let mut r = Response::new(Body::from_stream(stream));
            r.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            if length {
                r.headers_mut()
                    .insert("content-length", total.to_string().parse().unwrap());
            }
            r
        }
        Answer::Trickle => {
            let stream = futures_util::stream::unfold(sent, |sent| async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                sent(1);
                Some((Ok::<_, std::io::Error>(Bytes::from_static(b" ")), sent))
            });
            Response::new(Body::from_stream(stream))
        }
    }
}

struct Fake {
    url: String,
    sent: Sent,
    requests: Arc<std::sync::Mutex<Vec<Value>>>,
}

/// A worker answering `/health`, `/metrics`, `/v1/models` and `/v1/completions` as told.
async fn fake(health: Answer, metrics: Answer, models: Answer, completions: Answer) -> Fake {
    let sent: Sent = Arc::default();
    let requests: Arc<std::sync::Mutex<Vec<Value>>> = Arc::default();
    let at = |a: Answer| {
        let sent = sent.clone();
        move || {
            let sent = sent.clone();
            async move { answer(a, &sent) }
        }
    };
    let (s, seen) = (sent.clone(), requests.clone());
    let complete = move |body: Bytes| {
        let (s, seen) = (s.clone(), seen.clone());
        async move {
            seen.lock()
                .unwrap()
                .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
            answer(completions, &s)
        }
    };
    let app = Router::new()
        .route("/health", get(at(health)))
        .route("/metrics", get(at(metrics)))
        .route("/v1/models", get(at(models)))
        .route("/v1/completions", post(complete));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Fake {
        url,
        sent,
        requests,
    }
}

fn register(hub: &Hub, id: u64, w: &Fake, role: Option<WorkerRole>) {
    hub.register(Registration {
        url: Some(w.url.clone()),
        role,
        ..Registration::new(WorkerId(id))
    })
    .unwrap();
}

/// The router's `/metrics` value of `kvengine_worker_answers_refused_total{kind,reason}`.
async fn refused(base: &str, kind: &str, reason: &str) -> f64 {
    let (_, _, text) = common::raw_request(base, "GET", "/metrics", "", "").await;
    let series =
        format!("kvengine_worker_answers_refused_total{{kind=\"{kind}\",reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn worker(hub: &Hub, id: u64) -> transport::hub::WorkerInfo {
    hub.workers()
        .into_iter()
        .find(|w| w.registration.worker == WorkerId(id))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_or_endless_answers_are_refused_within_their_deadlines_and_counted() {
    let ok = Answer::Small("ok");
    let huge = |length| Answer::Huge {
        length,
        json: false,
    };
    // 1: a 100 MiB health answer (announced); 2: an endless one; 3: healthy, with a 100 MiB
    // metrics page and model list (chunked); 4: healthy, with endless ones.
    let w1 = fake(huge(true), ok, ok, ok).await;
    let w2 = fake(Answer::Trickle, ok, ok, ok).await;
    let w3 = fake(ok, huge(false), huge(false), ok).await;
    let w4 = fake(ok, Answer::Trickle, Answer::Trickle, ok).await;
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    for (id, w) in [(1, &w1), (2, &w2), (3, &w3), (4, &w4)] {
        register(&hub, id, w, None);
    }
    let app = router(hub.clone(), HttpConfig::default())
        .merge(openai_router(hub.clone(), ProxyConfig::default()));
    let (addr, _stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    let base = format!("http://{addr}");
    let timeout = Duration::from_secs(1);
    let checks = tokio::spawn(health_loop(
        hub.clone(),
        Duration::from_millis(100),
        timeout,
        1,
        Default::default(),
    ));

    let began = Instant::now();
    loop {
        let (a, b) = (worker(&hub, 1), worker(&hub, 2));
        let scraped = hub.metrics().load_scrape_failures.load(Relaxed) >= 4;
        if !a.healthy && !b.healthy && scraped {
            let (ea, eb) = (a.health_error.unwrap(), b.health_error.unwrap());
            assert!(ea.contains("over the cap"), "{ea}");
            assert!(eb.contains(&format!("{timeout:?}")), "{eb}");
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "workers 1 and 2 still healthy, or no metrics refused: {:?} {:?}",
            (a.healthy, a.health_error),
            (b.healthy, b.health_error)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(worker(&hub, 3).healthy && worker(&hub, 4).healthy);

    // The model list: worker 3's is too large, worker 4's never ends; the router gives up
    // on each within its deadline and answers.
    let began = Instant::now();
    let (status, _, text) = common::raw_request(&base, "GET", "/v1/models", "", "").await;
    let took = began.elapsed();
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["data"],
        json!([])
    );
    assert!(took < Duration::from_secs(10), "/v1/models took {took:?}");

    for (kind, reason) in [
        ("health", "too_large"),
        ("health", "too_slow"),
        ("metrics", "too_large"),
        ("metrics", "too_slow"),
        ("models", "too_large"),
        ("models", "too_slow"),
    ] {
        let n = refused(&base, kind, reason).await;
        assert!(n >= 1.0, "{kind}/{reason} refusals: {n}");
    }
    for (w, what) in [(&w1, "health"), (&w3, "metrics and models")] {
        let sent = w.sent.load(Relaxed);
        assert!(
            sent < READ_LESS_THAN,
            "the router read {sent} bytes of one answer ({what})"
        );
    }
    // Still serving.
    let (status, _, _) = common::raw_request(&base, "GET", "/live", "", "").await;
    assert_eq!(status, 200);
    checks.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prefill_answer_is_refused_and_the_decode_worker_prefills() {
    let ok = Answer::Small("ok");
    let prefill = fake(
        ok,
        ok,
        ok,
        Answer::Huge {
            length: false,
            json: true,
        },
    )
    .await;
    let decode = fake(
        ok,
        ok,
        ok,
        Answer::Small(r#"{"object":"text_completion","choices":[{"text":"decoded"}]}"#),
    )
    .await;
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    register(&hub, 1, &prefill, Some(WorkerRole::Prefill));
    register(&hub, 2, &decode, Some(WorkerRole::Decode));
    let cfg = ProxyConfig {
        disagg: DisaggConfig {
            protocol: Protocol::Vllm,
            split: SplitConfig {
                min_prefill_tokens: 1,
                ..SplitConfig::default()
            },
        },
        ..ProxyConfig::default()
    };
    let app = router(hub.clone(), HttpConfig::default()).merge(openai_router(hub.clone(), cfg));
    let (addr, _stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    let base = format!("http://{addr}");
    let body = json!({"model": "m", "prompt": "one two three four five", "max_tokens": 4});
    let ct = "Content-Type: application/json\r\n";
    let (status, head, text) =
        common::raw_request(&base, "POST", "/v1/completions", ct, &body.to_string()).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("decoded"), "{text}");
    // Served by the decode worker alone: the prefill answer was refused, not used.
    assert!(!head.contains("x-kvengine-prefill-worker-id"), "{head}");
    let seen = decode.requests.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].get("kv_transfer_params").is_none(), "{}", seen[0]);
    assert_eq!(prefill.requests.lock().unwrap().len(), 1);
    let sent = prefill.sent.load(Relaxed);
    assert!(sent < READ_LESS_THAN, "the router read {sent} bytes");
    assert!(refused(&base, "prefill", "too_large").await >= 1.0);
}
