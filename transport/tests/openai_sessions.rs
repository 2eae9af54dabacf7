//! Sticky sessions and the admission queue of the OpenAI front door, over real sockets: a
//! real engine behind the hub, stub workers (axum servers; the gated ones hold each request
//! until the test lets it answer), the real HTTP edge and hand-written HTTP/1.1 requests.
//! Waits are on events (a stub's arrivals, the queue's tally), never on sleeps, except
//! where time passing is the behaviour under test (a session's TTL, a queue timeout).

mod common;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use engine::WorkerId;
use engine::router::SessionConfig;
use engine::router::admission::AdmissionConfig;
use engine::runtime::RuntimeConfig;
use engine::sched::{BusyThresholds, SchedulerConfig};
use engine::sharding::choice::Sharding;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use transport::bounds::Limits;
use transport::http::{HttpConfig, router};
use transport::hub::{Hub, HubConfig, QueueTally, Registration};
use transport::openai::proxy::{ProxyConfig, openai_router};

/// A request a gated stub holds: its body, and the sender that lets it answer.
type Held = (Value, oneshot::Sender<()>);

struct Stub {
    url: String,
    /// Gated stubs: each request as it arrives.
    arrivals: Option<mpsc::UnboundedReceiver<Held>>,
}

/// A worker that answers at once (`gated` false) or holds each request until released.
async fn stub(gated: bool) -> Stub {
    let (tx, rx) = mpsc::unbounded_channel::<Held>();
    let handler = move |body: Bytes| {
        let tx = tx.clone();
        async move {
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if gated {
                let (go, wait) = oneshot::channel();
                if tx.send((v, go)).is_ok() {
                    let _ = wait.await;
                }
            }
            axum::Json(json!({"object": "text_completion", "choices": [{"text": "ok"}]}))
        }
    };
    let app = Router::new().route("/v1/completions", post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Stub {
        url,
        arrivals: gated.then_some(rx),
    }
}

struct Front {
    base: String,
    hub: Arc<Hub>,
    _stop: oneshot::Sender<()>,
}

/// The front door over `workers` (ids 1, 2, ...), with `busy` and `limits`.
async fn front(workers: &[&Stub], busy: BusyThresholds, limits: Limits) -> Front {
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let config = HubConfig {
        scheduler: SchedulerConfig {
            busy,
            ..SchedulerConfig::default()
        },
    };
    let (hub, runtime) =
        transport::hub::start_engine_from(config, Sharding::adaptive(1).unwrap(), engine, None)
            .unwrap();
    std::mem::forget(runtime);
    let hub = Arc::new(hub.with_limits(limits));
    for (i, s) in workers.iter().enumerate() {
        hub.register(Registration {
            url: Some(s.url.clone()),
            ..Registration::new(WorkerId(i as u64 + 1))
        })
        .unwrap();
    }
    let app = router(hub.clone(), HttpConfig::default())
        .merge(openai_router(hub.clone(), ProxyConfig::default()));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    Front {
        base: format!("http://{addr}"),
        hub,
        _stop: stop,
    }
}

fn sessions(ttl: Duration, max: usize) -> Limits {
    Limits {
        sessions: Some(SessionConfig {
            ttl: Some(ttl),
            max_sessions: max,
        }),
        ..Limits::default()
    }
}

/// A completion of prompt `text` with `headers` (whole lines); returns status, head
/// (lowercased) and body.
async fn complete(base: &str, text: &str, headers: &str) -> (u16, String, String) {
    let body = json!({"model": "m", "prompt": text}).to_string();
    common::raw_request(base, "POST", "/v1/completions", headers, &body).await
}

/// The value of header `name` (lowercase) in a lowercased head.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

fn worker_of(head: &str) -> u64 {
    header(head, "x-kvengine-worker-id")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no worker id in {head}"))
}

async fn metrics(base: &str) -> String {
    common::raw_request(base, "GET", "/metrics", "", "").await.2
}

/// The value of the sample line starting with `series ` in a metrics page.
fn sample(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{page}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_its_worker_under_any_of_its_header_names() {
    let (a, b) = (stub(false).await, stub(false).await);
    let f = front(
        &[&a, &b],
        BusyThresholds::default(),
        sessions(Duration::from_secs(300), 100),
    )
    .await;
    let (status, head, body) = complete(&f.base, "turn one", "x-kvengine-session: s1\r\n").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));
    let home = worker_of(&head);
    // Different prompts, each a later turn: the session stays on its worker under
    // every header name (the same value is the same session).
    for (i, name) in [
        "x-kvengine-session",
        "X-Dynamo-Session-ID",
        "x-smg-routing-key",
        "x-sgl-routing-key",
    ]
    .iter()
    .enumerate()
    {
        let (status, head, _) = complete(
            &f.base,
            &format!("turn {i} other words"),
            &format!("{name}: s1\r\n"),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(header(&head, "x-kvengine-route"), Some("session"), "{name}");
        assert_eq!(worker_of(&head), home, "{name}");
    }
    // No session: no route header.
    let (_, head, _) = complete(&f.base, "free", "").await;
    assert_eq!(header(&head, "x-kvengine-route"), None);

    // Its worker leaves routing (failed health checks): the session moves, and stays moved.
    f.hub.set_healthy(WorkerId(home), false).unwrap();
    let (status, head, _) = complete(&f.base, "turn five", "x-kvengine-session: s1\r\n").await;
    assert_eq!(status, 200);
    assert_eq!(
        header(&head, "x-kvengine-route"),
        Some("session_moved_gone")
    );
    let moved = worker_of(&head);
    assert_ne!(moved, home);
    f.hub.set_healthy(WorkerId(home), true).unwrap();
    let (_, head, _) = complete(&f.base, "turn six", "x-kvengine-session: s1\r\n").await;
    assert_eq!(
        (header(&head, "x-kvengine-route"), worker_of(&head)),
        (Some("session"), moved)
    );
    // Removed for good: its sessions are dropped, the next turn starts over.
    f.hub.remove_worker(WorkerId(moved)).unwrap();
    let (_, head, _) = complete(&f.base, "turn seven", "x-kvengine-session: s1\r\n").await;
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));

    let page = metrics(&f.base).await;
    assert_eq!(
        sample(&page, r#"kvengine_session_requests_total{route="sticky"}"#),
        5.0
    );
    assert_eq!(
        sample(&page, r#"kvengine_session_requests_total{route="new"}"#),
        2.0
    );
    assert_eq!(
        sample(
            &page,
            r#"kvengine_session_requests_total{route="moved_gone"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &page,
            r#"kvengine_sessions_removed_total{reason="worker_removed"}"#
        ),
        1.0
    );
    assert_eq!(sample(&page, "kvengine_sessions"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_moves_its_session_to_a_free_one() {
    let (a, b) = (stub(false).await, stub(false).await);
    let busy = BusyThresholds {
        max_waiting: Some(4),
        ..BusyThresholds::default()
    };
    let f = front(&[&a, &b], busy, sessions(Duration::from_secs(300), 100)).await;
    let load = |waiting| engine::sched::WorkerLoad {
        num_requests_waiting: waiting,
        kv_usage: 0.1,
    };
    let (_, head, _) = complete(&f.base, "turn one", "x-kvengine-session: s2\r\n").await;
    let home = worker_of(&head);
    let other = 3 - home;
    // Its worker reports a queue over the threshold while the other is free: moved.
    f.hub
        .update_load(engine::WorkerKey::new(home, 0), load(10))
        .unwrap();
    let (_, head, _) = complete(&f.base, "turn two", "x-kvengine-session: s2\r\n").await;
    assert_eq!(
        (header(&head, "x-kvengine-route"), worker_of(&head)),
        (Some("session_moved_busy"), other)
    );
    // Both busy: moving buys nothing, the session stays where its cache is.
    f.hub
        .update_load(engine::WorkerKey::new(other, 0), load(10))
        .unwrap();
    let (_, head, _) = complete(&f.base, "turn three", "x-kvengine-session: s2\r\n").await;
    assert_eq!(
        (header(&head, "x-kvengine-route"), worker_of(&head)),
        (Some("session"), other)
    );
    let page = metrics(&f.base).await;
    assert_eq!(
        sample(
            &page,
            r#"kvengine_session_requests_total{route="moved_busy"}"#
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_table_is_bounded_and_sessions_expire() {
    let (a, b) = (stub(false).await, stub(false).await);
    let f = front(
        &[&a, &b],
        BusyThresholds::default(),
        sessions(Duration::from_secs(300), 2),
    )
    .await;
    for s in ["a", "b", "c"] {
        let (status, head, _) =
            complete(&f.base, "hi", &format!("x-kvengine-session: {s}\r\n")).await;
        assert_eq!(
            (status, header(&head, "x-kvengine-route")),
            (200, Some("session_new"))
        );
    }
    let page = metrics(&f.base).await;
    assert_eq!(sample(&page, "kvengine_sessions"), 2.0);
    assert_eq!(
        sample(
            &page,
            r#"kvengine_sessions_removed_total{reason="evicted"}"#
        ),
        1.0
    );
    // "a" was the least recently used: evicted, so it starts over; "c" is remembered.
    let (_, head, _) = complete(&f.base, "hi", "x-kvengine-session: a\r\n").await;
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));
    let (_, head, _) = complete(&f.base, "hi", "x-kvengine-session: c\r\n").await;
    assert_eq!(header(&head, "x-kvengine-route"), Some("session"));

    // A short TTL: once it has passed unused, the session is forgotten.
    let ttl = Duration::from_millis(50);
    let g = front(&[&a, &b], BusyThresholds::default(), sessions(ttl, 10)).await;
    let (_, head, _) = complete(&g.base, "hi", "x-kvengine-session: t\r\n").await;
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));
    tokio::time::sleep(ttl * 2).await; // the behaviour under test is time passing
    let (_, head, _) = complete(&g.base, "hi", "x-kvengine-session: t\r\n").await;
    assert_eq!(header(&head, "x-kvengine-route"), Some("session_new"));
    let page = metrics(&g.base).await;
    assert_eq!(
        sample(
            &page,
            r#"kvengine_sessions_removed_total{reason="expired"}"#
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_session_and_priority_headers_are_refused_and_counted() {
    let a = stub(false).await;
    let limits = Limits {
        admission: Some(AdmissionConfig::default()),
        ..sessions(Duration::from_secs(300), 10)
    };
    let f = front(&[&a], BusyThresholds::default(), limits).await;
    let long = "k".repeat(transport::bounds::MAX_SESSION_KEY_BYTES + 1);
    let (status, _, body) =
        complete(&f.base, "hi", &format!("x-sgl-routing-key: {long}\r\n")).await;
    assert_eq!(status, 400, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-sgl-routing-key")
    );
    let at_max = "k".repeat(transport::bounds::MAX_SESSION_KEY_BYTES);
    let (status, _, _) = complete(&f.base, "hi", &format!("x-sgl-routing-key: {at_max}\r\n")).await;
    assert_eq!(status, 200);
    for bad in ["urgent", "1e3", "99999999999999999999"] {
        let (status, _, body) =
            complete(&f.base, "hi", &format!("x-kvengine-priority: {bad}\r\n")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, _, _) = complete(&f.base, "hi", "x-kvengine-priority: -3\r\n").await;
    assert_eq!(status, 200);
    let page = metrics(&f.base).await;
    assert_eq!(sample(&page, "kvengine_session_headers_refused_total"), 1.0);
    assert_eq!(
        sample(
            &page,
            r#"kvengine_admission_rejected_total{reason="bad_priority"}"#
        ),
        3.0
    );
}

fn queue(capacity: usize, timeout: Duration) -> Limits {
    Limits {
        admission: Some(AdmissionConfig { capacity, timeout }),
        ..Limits::default()
    }
}

fn busy_at(n: u64) -> BusyThresholds {
    BusyThresholds {
        max_active: Some(n),
        ..BusyThresholds::default()
    }
}

/// Waits until the queue's tally satisfies `f` (an event, not a poll).
async fn tally(hub: &Hub, f: impl Fn(&QueueTally) -> bool) {
    let mut rx = hub.routing().queue_tally();
    tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|t| f(t)))
        .await
        .expect("the queue never reached the state")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_workers_queue_requests_by_priority_and_a_full_queue_answers_429() {
    let a = stub(true).await;
    let f = front(&[&a], busy_at(1), queue(2, Duration::from_secs(60))).await;
    let mut held = a.arrivals.unwrap();
    let send = |text: &'static str, prio: i64| {
        let base = f.base.clone();
        tokio::spawn(async move {
            complete(&base, text, &format!("x-kvengine-priority: {prio}\r\n")).await
        })
    };
    let first = send("first", 0);
    let (body, release_first) = held.recv().await.unwrap();
    assert_eq!(body["prompt"], "first");
    // The worker is busy: the next two wait; the low priority one came first.
    let low = send("low", 0);
    tally(&f.hub, |t| t.entered == 1).await;
    let high = send("high", 7);
    tally(&f.hub, |t| t.entered == 2).await;
    // The queue holds 2: the next is refused at once.
    let (status, head, body) = complete(&f.base, "refused", "").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(header(&head, "retry-after"), Some("1"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "queue_full");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    let page = metrics(&f.base).await;
    assert_eq!(sample(&page, "kvengine_admission_queue_depth"), 2.0);

    // The worker finishes one: the higher priority goes next, then the other.
    release_first.send(()).unwrap();
    assert_eq!(first.await.unwrap().0, 200);
    let (body, release) = held.recv().await.unwrap();
    assert_eq!(body["prompt"], "high");
    release.send(()).unwrap();
    let (body, release) = held.recv().await.unwrap();
    assert_eq!(body["prompt"], "low");
    release.send(()).unwrap();
    assert_eq!(high.await.unwrap().0, 200);
    assert_eq!(low.await.unwrap().0, 200);

    let page = metrics(&f.base).await;
    assert_eq!(sample(&page, "kvengine_admission_queue_depth"), 0.0);
    assert_eq!(sample(&page, "kvengine_admission_queued_total"), 2.0);
    assert_eq!(sample(&page, "kvengine_admission_admitted_total"), 2.0);
    assert_eq!(sample(&page, "kvengine_admission_wait_seconds_count"), 2.0);
    assert_eq!(
        sample(&page, r#"kvengine_admission_rejected_total{reason="full"}"#),
        1.0
    );
    assert_eq!(f.hub.routing().active_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_times_out_with_503_and_a_gone_client_leaves_the_queue() {
    let a = stub(true).await;
    let timeout = Duration::from_millis(300);
    let f = front(&[&a], busy_at(1), queue(4, timeout)).await;
    let mut held = a.arrivals.unwrap();
    let base = f.base.clone();
    let first = tokio::spawn(async move { complete(&base, "first", "").await });
    let (_, release_first) = held.recv().await.unwrap();

    // Waits its whole timeout (the behaviour under test), then 503 with Retry-After.
    let (status, head, body) = complete(&f.base, "late", "").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(header(&head, "retry-after"), Some("1"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout");
    assert_eq!(v["error"]["type"], "service_unavailable");

    // A client that hangs up while queued leaves the queue.
    let before = *f.hub.routing().queue_tally().borrow();
    let addr = f.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = json!({"model": "m", "prompt": "gone"}).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    tally(&f.hub, |t| t.entered == before.entered + 1).await;
    drop(conn);
    tally(&f.hub, |t| t.left == before.left + 1).await;
    let page = metrics(&f.base).await;
    assert_eq!(sample(&page, "kvengine_admission_queue_depth"), 0.0);
    assert_eq!(
        sample(
            &page,
            r#"kvengine_admission_rejected_total{reason="timeout"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &page,
            r#"kvengine_admission_rejected_total{reason="client_gone"}"#
        ),
        1.0
    );

    // Neither took the worker's room: once it finishes, the next request routes at once.
    release_first.send(()).unwrap();
    assert_eq!(first.await.unwrap().0, 200);
    let base = f.base.clone();
    let next = tokio::spawn(async move { complete(&base, "next", "").await });
    let (body, release) = held.recv().await.unwrap();
    assert_eq!(body["prompt"], "next");
    release.send(()).unwrap();
    assert_eq!(next.await.unwrap().0, 200);
    assert_eq!(
        f.hub.routing().queue_tally().borrow().entered,
        before.entered + 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_queue_busy_workers_still_take_requests() {
    let a = stub(true).await;
    let f = front(&[&a], busy_at(1), Limits::default()).await;
    let mut held = a.arrivals.unwrap();
    let base = f.base.clone();
    let first = tokio::spawn(async move { complete(&base, "first", "").await });
    let (_, r1) = held.recv().await.unwrap();
    let base = f.base.clone();
    let second = tokio::spawn(async move { complete(&base, "second", "").await });
    let (body, r2) = held.recv().await.unwrap();
    assert_eq!(
        body["prompt"], "second",
        "routed to the busy worker: no queue"
    );
    r1.send(()).unwrap();
    r2.send(()).unwrap();
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(second.await.unwrap().0, 200);
    assert_eq!(f.hub.routing().queue_tally().borrow().entered, 0);
}
