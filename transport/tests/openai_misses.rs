//! Miss attribution against hostile or unusual answers, over real sockets: a stub worker
//! answers each request with a scripted body (malformed usage, huge numbers, no details,
//! an error status, a stream that dies), the front door relays it unchanged and counts the
//! request exactly once, attributed or under an unattributed reason; nothing panics.

mod common;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use engine::WorkerId;
use serde_json::json;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use transport::http::{HttpConfig, router};
use transport::hub::{Hub, Registration};
use transport::misses::ModelMisses;
use transport::openai::proxy::{ProxyConfig, openai_router};

/// What the stub answers: content type, status and body.
type Scripted = (&'static str, u16, String);

/// A worker that answers each request with the next scripted answer.
async fn stub(script: Vec<Scripted>) -> String {
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let handler = move |_body: Bytes| {
        let script = script.clone();
        async move {
            let next = script.lock().unwrap().pop_front();
            let (ct, status, body) = next.expect("an answer per request");
            Response::builder()
                .status(status)
                .header("content-type", ct)
                .body(Body::from(body))
                .unwrap()
        }
    };
    let app = Router::new().route("/v1/completions", post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

async fn front_door(url: String) -> (String, Arc<Hub>, tokio::sync::oneshot::Sender<()>) {
    let (hub, runtime) = common::hub(2);
    std::mem::forget(runtime);
    hub.register(Registration {
        url: Some(url),
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    let app = router(hub.clone(), HttpConfig::default())
        .merge(openai_router(hub.clone(), ProxyConfig::default()));
    let (addr, stop) = common::serve_app(app, [127, 0, 0, 1].into()).await;
    (format!("http://{addr}"), hub, stop)
}

fn usage(cached: &str) -> String {
    format!(
        r#"{{"choices":[{{"text":"ok"}}],"usage":{{"prompt_tokens":40,"prompt_tokens_details":{cached}}}}}"#
    )
}

fn sse_answer() -> String {
    let first = r#"{"choices":[{"text":"a"}],"usage":null}"#;
    let last = usage(r#"{"cached_tokens":16}"#);
    format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n")
}

fn figures(hub: &Hub) -> ModelMisses {
    let snap = hub.metrics().misses.snapshot();
    assert!(snap.models.len() <= 1, "{snap:?}");
    snap.models
        .into_iter()
        .next()
        .map(|(_, m)| m)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_is_counted_once_and_relayed_unchanged() {
    let json = "application/json";
    let sse = "text/event-stream";
    let huge = usage(r#"{"cached_tokens":99999999999999999999999}"#);
    let script: Vec<Scripted> = vec![
        // Attributed: 32 of 40 cached (2 of 2 cacheable blocks): a hit.
        (json, 200, (usage(r#"{"cached_tokens":32}"#))),
        // Bad usage: negative, a string, more than the prompt, a number beyond u64.
        (json, 200, (usage(r#"{"cached_tokens":-1}"#))),
        (json, 200, (usage(r#"{"cached_tokens":"32"}"#))),
        (json, 200, (usage(r#"{"cached_tokens":41}"#))),
        (json, 200, (huge)),
        // No details (vLLM without --enable-prompt-tokens-details).
        (json, 200, (usage("null"))),
        // No usage at all, and not JSON at all.
        (json, 200, (r#"{"choices":[]}"#.to_owned())),
        (json, 200, ("\"usage\": {".repeat(100))),
        // A stream whose usage event comes after an event without one.
        (sse, 200, sse_answer()),
        // An error answer: no cache outcome, whatever its usage says.
        (json, 400, (usage(r#"{"cached_tokens":0}"#))),
    ];
    let expected: Vec<String> = script.iter().map(|(_, _, b)| b.clone()).collect();
    let (base, hub, _stop) = front_door(stub(script).await).await;
    let prompt: Vec<u32> = (0..40).collect();
    let body = json!({"prompt": prompt}).to_string();
    for (i, want) in expected.iter().enumerate() {
        let ct = "Content-Type: application/json\r\n";
        let (status, _, text) =
            common::raw_request(&base, "POST", "/v1/completions", ct, &body).await;
        assert!(status == 200 || status == 400, "{i}: {status} {text}");
        assert!(text.contains(want.as_str()), "{i}: relayed as sent: {text}");
    }
    let m = figures(&hub);
    // A hit, and a stream that found 1 of 2 blocks: stale, as the same prompt's earlier
    // decisions predicted worker 1 to hold both (predict-on-route, on by default; the stub
    // publishes no KV events, so nothing else could have).
    assert_eq!(m.requests, [1, 0, 1, 0], "{m:?}");
    assert_eq!(m.hit_tokens, 48);
    assert_eq!(m.miss_tokens, [0, 16, 0]);
    // no_usage, no_cached_tokens, bad_usage, failed.
    assert_eq!(m.unattributed, [2, 1, 4, 1], "{m:?}");
    let counted = m.requests.iter().sum::<u64>() + m.unattributed.iter().sum::<u64>();
    assert_eq!(counted, expected.len() as u64, "each exactly once");
    assert_eq!(hub.routing().active_requests(), 0);
}
