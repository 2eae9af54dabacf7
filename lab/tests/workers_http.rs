//! Simulated workers over real sockets ([`lab::workers`]): OpenAI answers and their usage,
//! prefix-cache hits, streaming order, the fallback tokenizer, malformed requests, vLLM's
//! API key (401) and unknown-model (404) answers, clients that go away, and the KV events
//! reaching kvengine's index over ZMQ.

mod common;

use std::time::{Duration, Instant};

use common::{SubscribedHub, call, call_with, get_json, ids, post_json, request_bytes};
use lab::workers::{SimWorkerConfig, SimWorkerHandle, spawn_worker};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sim::engine::EngineConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport::openai::fallback;
use transport::openai::tokenize::ChatMessage;

async fn worker(speedup: f64, engine: EngineConfig) -> SimWorkerHandle {
    let cfg = SimWorkerConfig {
        engine,
        speedup,
        ..SimWorkerConfig::default()
    };
    spawn_worker(cfg, None).await.unwrap()
}

/// The `data:` payloads of an SSE body, in order.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").expect(e).to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_load() {
    let w = worker(1000.0, EngineConfig::default()).await;
    let (status, _, _) = call(w.http_addr(), "GET", "/health", b"").await;
    assert_eq!(status, 200);
    let models = get_json(&w, "/v1/models").await;
    assert_eq!(
        models,
        json!({"object": "list", "data": [{"id": "kvengine-sim", "object": "model",
                "created": 0, "owned_by": "kvengine-sim"}]})
    );
    let load = get_json(&w, "/load").await;
    assert_eq!(load["num_requests_waiting"], 0);
    assert_eq!(load["num_requests_running"], 0);
    assert_eq!(load["kv_usage"], 0.0);
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_completions_count_usage_and_hit_the_prefix_cache() {
    let w = worker(1000.0, EngineConfig::default()).await;
    let prompt = ids(5000, 100);
    let body = json!({"model": "kvengine-sim", "prompt": prompt, "max_tokens": 5});
    let (status, first) = post_json(&w, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["model"], "kvengine-sim");
    let choice = &first["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        choice["text"].as_str().unwrap().split_whitespace().count(),
        5
    );
    assert_eq!(
        first["usage"],
        json!({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // The same prompt again: its 6 full blocks are cached (96 <= 100 - 1 tokens).
    let (status, second) = post_json(&w, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    // A one-element list of token ids is the same prompt.
    let nested = json!({"prompt": [prompt], "max_tokens": 1});
    let (_, third) = post_json(&w, "/v1/completions", &nested).await;
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    assert_eq!(third["usage"]["completion_tokens"], 1);
    let load = get_json(&w, "/load").await;
    assert_eq!(load["finished"], 3);
    assert_eq!(load["kv_usage"], 0.0);
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_sends_role_tokens_finish_usage_done_in_order() {
    let w = worker(1000.0, EngineConfig::default()).await;
    let body = json!({
        "model": "kvengine-sim",
        "messages": [{"role": "system", "content": "you are terse"},
                     {"role": "user", "content": [{"type": "text", "text": "say four words"}]}],
        "max_completion_tokens": 4,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (status, _, text) = call(
        w.http_addr(),
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.len(), 1 + 4 + 1 + 1 + 1, "{text}");
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks[1..5] {
        let content = c["choices"][0]["delta"]["content"].as_str().unwrap();
        assert!(content.ends_with(' ') && content.len() > 1, "{c}");
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    let messages = [
        ChatMessage::text("system", "you are terse"),
        ChatMessage::text("user", "say four words"),
    ];
    let prompt_tokens = fallback::chat_token_ids(&messages).len();
    assert_eq!(chunks[6]["choices"], json!([]));
    assert_eq!(chunks[6]["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 4);

    // Completions stream the same way, without the role chunk or usage unless asked.
    let body = json!({"prompt": "one two three", "max_tokens": 3, "stream": true});
    let (_, _, text) = call(
        w.http_addr(),
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    )
    .await;
    let data = sse_data(&text);
    assert_eq!(data.len(), 3 + 1 + 1, "{text}");
    let last: Value = serde_json::from_str(&data[3]).unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_use_the_deterministic_fallback_tokenizer() {
    let w = worker(1000.0, EngineConfig::default()).await;
    let words: Vec<String> = (0..40).map(|i| format!("word{i}")).collect();
    let text = words.join(" ");
    let (status, a) = post_json(&w, "/v1/completions", &json!({"prompt": text})).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["usage"]["prompt_tokens"], 40);
    assert_eq!(a["usage"]["completion_tokens"], 16);
    // The same ids given directly hit the blocks the text prompt cached: same tokenization.
    let ids = fallback::text_token_ids(&text);
    let (_, b) = post_json(
        &w,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    // And chat messages are rendered as role lines first.
    let msgs = json!([{"role": "user", "content": text}]);
    let (_, c) = post_json(&w, "/v1/chat/completions", &json!({"messages": msgs})).await;
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(c["usage"]["prompt_tokens"], 41);
    w.shutdown().await;
}

fn mutate(rng: &mut SmallRng, body: &[u8]) -> Vec<u8> {
    let mut b = body.to_vec();
    match rng.random_range(0..5) {
        0 if !b.is_empty() => {
            let i = rng.random_range(0..b.len());
            b[i] = rng.random();
        }
        1 => b.truncate(rng.random_range(0..=b.len())),
        2 => {
            let i = rng.random_range(0..=b.len());
            let junk: &[u8] = [
                &b"null"[..],
                b"-1",
                b"0",
                b"[",
                b"}",
                b"\"x\"",
                b"1e400",
                b"\xff",
            ][rng.random_range(0..8)];
            b.splice(i..i, junk.iter().copied());
        }
        3 => {
            let mut v: Value = serde_json::from_slice(body).unwrap();
            let keys = [
                "prompt",
                "messages",
                "max_tokens",
                "stream",
                "stream_options",
                "n",
            ];
            let vals = [
                json!(null),
                json!(0),
                json!(-3),
                json!(1.5),
                json!(4_000_000_000u64),
                json!(1u64 << 40),
                json!("s"),
                json!([]),
                json!([[]]),
                json!([1, 2]),
                json!({}),
                json!(true),
                json!([{"role": "user"}]),
                json!([{"role": "user", "content": [{"type": "image_url"}]}]),
            ];
            let key = keys[rng.random_range(0..keys.len())];
            v[key] = vals[rng.random_range(0..vals.len())].clone();
            b = v.to_string().into_bytes();
        }
        _ => {
            let n = rng.random_range(0..64);
            b = (0..n).map(|_| rng.random()).collect();
        }
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_openai_400s_and_never_5xx() {
    let engine = EngineConfig {
        kv_blocks: 64,
        ..EngineConfig::default()
    };
    let w = worker(100_000.0, engine).await;
    let fixed: [(&str, &[u8], Option<&str>); 9] = [
        ("/v1/completions", b"not json", None),
        ("/v1/completions", b"{}", Some("prompt")),
        (
            "/v1/completions",
            br#"{"prompt": "a", "max_tokens": 0}"#,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": [1, 2], "max_tokens": 5000}"#,
            None,
        ),
        ("/v1/completions", br#"{"prompt": [-5]}"#, Some("prompt")),
        ("/v1/chat/completions", b"{}", Some("messages")),
        (
            "/v1/chat/completions",
            br#"{"messages": []}"#,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "hi"}], "stream": 3}"#,
            Some("stream"),
        ),
    ];
    for (path, body, param) in fixed {
        let (status, _, text) = call(w.http_addr(), "POST", path, body).await;
        assert_eq!(
            status,
            400,
            "{path} {}: {text}",
            String::from_utf8_lossy(body)
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        let err = &v["error"];
        assert_eq!(err["type"], "invalid_request_error", "{v}");
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert_eq!(err["param"].as_str(), param, "{v}");
        assert!(err.get("code").is_some(), "{v}");
    }

    let seeds: [(&str, Value); 3] = [
        (
            "/v1/completions",
            json!({"prompt": "a b c d", "max_tokens": 3}),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 2, "stream": true,
                                    "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2, "stream": false}),
        ),
    ];
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..400 {
        let (path, seed) = &seeds[rng.random_range(0..seeds.len())];
        let body = mutate(&mut rng, seed.to_string().as_bytes());
        let (status, _, text) = call(w.http_addr(), "POST", path, &body).await;
        assert!(
            status < 500,
            "{status} for {}: {text}",
            String::from_utf8_lossy(&body)
        );
        if status == 400 {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            refused += 1;
        } else if status == 200 {
            ok += 1;
        }
    }
    assert!(ok > 20 && refused > 100, "ok {ok}, refused {refused}");
    // Everything finished or was refused: nothing is left holding pages.
    let load = get_json(&w, "/load").await;
    assert_eq!(load["num_requests_running"], 0, "{load}");
    assert_eq!(load["kv_usage"], 0.0, "{load}");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_every_v1_path_and_nothing_else() {
    let cfg = SimWorkerConfig {
        speedup: 1000.0,
        api_key: Some("s3cret".into()),
        ..SimWorkerConfig::default()
    };
    let w = spawn_worker(cfg, None).await.unwrap();
    let addr = w.http_addr();
    let completion = json!({"prompt": ids(1000, 20), "max_tokens": 2}).to_string();
    let chat =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let guarded: [(&str, &str, &[u8]); 3] = [
        ("GET", "/v1/models", b""),
        ("POST", "/v1/completions", completion.as_bytes()),
        ("POST", "/v1/chat/completions", chat.as_bytes()),
    ];
    let refused: [&[(&str, &str)]; 5] = [
        &[],
        &[("Authorization", "Bearer nope")],
        &[("Authorization", "Bearer s3cret2")],
        &[("Authorization", "Basic s3cret")],
        &[("Authorization", "s3cret")],
    ];
    for (method, path, body) in guarded {
        for headers in refused {
            let (status, content_type, text) = call_with(addr, method, path, headers, body).await;
            assert_eq!(status, 401, "{method} {path} {headers:?}: {text}");
            assert!(
                content_type.starts_with("application/json"),
                "{content_type}"
            );
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v, json!({"error": "Unauthorized"}));
        }
        // vLLM reads the scheme case-insensitively.
        for auth in ["Bearer s3cret", "bearer s3cret"] {
            let headers = [("Authorization", auth)];
            let (status, _, text) = call_with(addr, method, path, &headers, body).await;
            assert_eq!(status, 200, "{method} {path} {auth}: {text}");
        }
    }
    // An unknown /v1 path is refused before it is found missing, as in vLLM.
    let (status, _, _) = call(addr, "GET", "/v1/nope", b"").await;
    assert_eq!(status, 401);
    let key = [("Authorization", "Bearer s3cret")];
    let (status, _, _) = call_with(addr, "GET", "/v1/nope", &key, b"").await;
    assert_eq!(status, 404);
    // The rest stays open.
    let (status, _, _) = call(addr, "GET", "/health", b"").await;
    assert_eq!(status, 200);
    let load = get_json(&w, "/load").await;
    assert_eq!(load["finished"], 4, "{load}");
    let (status, _, _) = call(addr, "GET", "/sim/bootstrap/7", b"").await;
    assert_ne!(status, 401);
    // The key reaches the router's registration, so that forwarded requests get in.
    let reg = w.registration(engine::WorkerId(1));
    assert_eq!(reg.api_key.as_deref(), Some("s3cret"));
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_gets_vllms_404() {
    let cfg = SimWorkerConfig {
        speedup: 1000.0,
        model: "served-model".into(),
        ..SimWorkerConfig::default()
    };
    let w = spawn_worker(cfg, None).await.unwrap();
    let messages = json!([{"role": "user", "content": "hi"}]);
    for name in ["kvengine-sim", "gpt-9"] {
        for stream in [false, true] {
            let asks = [
                (
                    "/v1/completions",
                    json!({"model": name, "prompt": [1, 2, 3], "stream": stream}),
                ),
                (
                    "/v1/chat/completions",
                    json!({"model": name, "messages": messages, "stream": stream}),
                ),
            ];
            for (path, body) in asks {
                let (status, v) = post_json(&w, path, &body).await;
                assert_eq!(status, 404, "{path} {body}: {v}");
                let message = format!("The model `{name}` does not exist.");
                assert_eq!(
                    v,
                    json!({"error": {"message": message, "type": "NotFoundError",
                                     "param": "model", "code": 404}})
                );
            }
        }
    }
    // Nothing was queued for them.
    assert_eq!(get_json(&w, "/load").await["requests"], 0);
    // The served name, no name, or a null or empty one: the served model.
    for model in [json!("served-model"), Value::Null, json!("")] {
        let mut completion = json!({"prompt": [1, 2, 3], "max_tokens": 2});
        let mut chat = json!({"messages": messages, "max_tokens": 2});
        if model != Value::Null {
            completion["model"] = model.clone();
            chat["model"] = model.clone();
        }
        for (path, body) in [
            ("/v1/completions", completion),
            ("/v1/chat/completions", chat),
        ] {
            let (status, v) = post_json(&w, path, &body).await;
            assert_eq!(status, 200, "{path} {body}: {v}");
            assert_eq!(v["model"], "served-model");
        }
    }
    let mut null = json!({"prompt": [1, 2, 3], "max_tokens": 1});
    null["model"] = Value::Null;
    assert_eq!(post_json(&w, "/v1/completions", &null).await.0, 200);
    // A name that is not a string is malformed.
    let (status, v) = post_json(
        &w,
        "/v1/completions",
        &json!({"model": 5, "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "model");
    w.shutdown().await;
}

async fn wait_idle(w: &SimWorkerHandle, what: &str) -> Value {
    let start = Instant::now();
    loop {
        let load = get_json(w, "/load").await;
        if load["num_requests_running"] == 0
            && load["num_requests_waiting"] == 0
            && load["kv_usage"] == 0.0
        {
            return load;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{what}: {load}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_request() {
    // 20,000 decode steps of ~6 ms at 10x: 12 s of real time if nobody aborted it.
    let w = worker(10.0, EngineConfig::default()).await;
    let body = json!({"prompt": ids(7000, 64), "max_tokens": 20_000, "stream": true});
    let mut s = TcpStream::connect(w.http_addr()).await.unwrap();
    s.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    let busy = get_json(&w, "/load").await;
    assert_eq!(busy["num_requests_running"], 1, "{busy}");
    assert!(busy["kv_usage"].as_f64().unwrap() > 0.0);
    drop(s);
    let load = wait_idle(&w, "streaming client gone").await;
    assert_eq!(load["aborted"], 1, "{load}");
    assert_eq!(load["finished"], 0, "{load}");

    // A non-streaming client that goes away is aborted too.
    let body = json!({"prompt": ids(9000, 64), "max_tokens": 20_000});
    let mut s = TcpStream::connect(w.http_addr()).await.unwrap();
    s.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    let start = Instant::now();
    while get_json(&w, "/load").await["num_requests_running"] != 1 {
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(s);
    let load = wait_idle(&w, "waiting client gone").await;
    assert_eq!(load["aborted"], 2, "{load}");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_rebuild_the_engine_cache_in_kvengines_index() {
    let w = worker(1000.0, EngineConfig::default()).await;
    let hub = SubscribedHub::start(&w, 1).await;

    let prompt = ids(50_000, 100);
    let body = json!({"prompt": prompt, "max_tokens": 3});
    let (_, first) = post_json(&w, "/v1/completions", &body).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // What the engine reports as cached for this prompt now.
    let (_, again) = post_json(&w, "/v1/completions", &body).await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, 96);
    let what = format!("engine cached {cached} tokens");
    hub.wait_overlap(&prompt, vec![(hub.key(), (cached / 16) as u32)], &what)
        .await;
    hub.stop().await;
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_time_runs_speedup_times_faster_than_real_time() {
    // A 16-token prompt and 100 tokens: ~7 ms of prefill and 99 decode steps of ~6.1 ms,
    // ~0.61 s simulated, ~61 ms at 10x.
    let w = worker(10.0, EngineConfig::default()).await;
    let body = json!({"prompt": ids(3000, 16), "max_tokens": 100});
    let start = Instant::now();
    let (status, v) = post_json(&w, "/v1/completions", &body).await;
    let took = start.elapsed();
    assert_eq!(status, 200, "{v}");
    assert!(
        took >= Duration::from_millis(55) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let load = get_json(&w, "/load").await;
    let sim = load["sim_time_secs"].as_f64().unwrap();
    assert!(sim >= 0.6, "{load}");
    w.shutdown().await;
}
