//! Disaggregated serving on simulated workers over real sockets: a prefill worker and a
//! decode worker speaking vLLM's, SGLang's and TensorRT-LLM's hand-offs, streamed and not.
//! The decode worker computes no prefill, holds (and publishes) the prompt's blocks, waits
//! the modelled transfer time and reports its own cached tokens; bad parameters are 400s;
//! an SGLang decode whose prefill worker is gone is a 502 before any token.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use common::{SubscribedHub, call, ids, post_json};
use lab::workers::tokens::token_text;
use lab::workers::{SimRole, SimWorkerConfig, SimWorkerHandle, TransferModel, spawn_worker};
use serde_json::{Value, json};
use sim::engine::EngineConfig;

const SPEEDUP: f64 = 50.0;

async fn worker_with(role: SimRole, cfg: SimWorkerConfig) -> SimWorkerHandle {
    spawn_worker(
        SimWorkerConfig {
            role,
            speedup: SPEEDUP,
            ..cfg
        },
        None,
    )
    .await
    .unwrap()
}

async fn worker(role: SimRole) -> SimWorkerHandle {
    worker_with(role, SimWorkerConfig::default()).await
}

/// A streamed answer's JSON chunks (`[DONE]` checked and dropped).
async fn post_stream(w: &SimWorkerHandle, path: &str, body: &Value) -> Vec<Value> {
    let (status, ct, text) = call(w.http_addr(), "POST", path, body.to_string().as_bytes()).await;
    assert_eq!(status, 200, "{text}");
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The generated text of a stream's chunks (completions or chat).
fn streamed_text(chunks: &[Value]) -> Vec<String> {
    chunks
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str())
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
        })
        .collect()
}

fn words(v: &Value) -> usize {
    let choice = &v["choices"][0];
    choice["text"]
        .as_str()
        .or(choice["message"]["content"].as_str())
        .unwrap()
        .split_whitespace()
        .count()
}

fn usage(prompt: u64, completion: u64, cached: u64) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Waits until a worker has finished `n` requests and holds no pages.
async fn settled(w: &SimWorkerHandle, n: u64) -> lab::workers::driver::Snapshot {
    let start = Instant::now();
    loop {
        let s = w.snapshot();
        if s.stats.finished == n && s.load.kv_usage == 0.0 {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn vllm_prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_then_decode_whole_and_streamed() {
    let p = worker(SimRole::Prefill).await;
    let d = worker(SimRole::Decode).await;
    let prompt = ids(5000, 100); // 6 full blocks of 16, 4 tokens over
    let prefill_body = json!({"prompt": prompt, "max_tokens": 1, "stream": false,
                              "kv_transfer_params": vllm_prefill_params()});
    let (status, pre) = post_json(&p, "/v1/completions", &prefill_body).await;
    assert_eq!(status, 200, "{pre}");
    assert_eq!(words(&pre), 1);
    assert_eq!(pre["choices"][0]["finish_reason"], "length");
    assert_eq!(pre["usage"], usage(100, 1, 0));
    let params = pre["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], p.engine_id());
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.http_addr().port());
    assert_eq!(params["tp_size"], 1);
    let blocks = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(blocks.len(), 6);
    assert!(blocks.iter().all(Value::is_u64));
    let ps = settled(&p, 1).await;
    assert_eq!(ps.stats.prefill_tokens, 100);
    assert_eq!(ps.stats.stored_blocks, 6);

    // The decode request: the client's body plus the prefill's kv_transfer_params.
    let decode_body = json!({"prompt": prompt, "max_tokens": 5, "kv_transfer_params": params});
    let (status, dec) = post_json(&d, "/v1/completions", &decode_body).await;
    assert_eq!(status, 200, "{dec}");
    assert_eq!(words(&dec), 5);
    assert_eq!(dec["usage"], usage(100, 5, 0));
    assert!(dec.get("kv_transfer_params").is_none());
    let ds = settled(&d, 1).await;
    assert_eq!(
        ds.stats.prefill_tokens, 0,
        "the decode worker computed no prefill"
    );
    assert_eq!(ds.stats.remote_prefills, 1);
    assert_eq!(ds.stats.transferred_tokens, 99);
    assert_eq!(ds.stats.decode_tokens, 5);
    assert_eq!(
        ds.stats.stored_blocks, 6,
        "the received prompt blocks were stored"
    );
    assert_eq!(ds.stats.cached_blocks, 6);

    // Streamed: the decode worker now caches 96 of the prompt's tokens and receives only
    // the rest.
    let stream_body = json!({"prompt": prompt, "max_tokens": 3, "stream": true,
                             "stream_options": {"include_usage": true},
                             "kv_transfer_params": pre["kv_transfer_params"]});
    let chunks = post_stream(&d, "/v1/completions", &stream_body).await;
    assert_eq!(streamed_text(&chunks).len(), 3);
    assert_eq!(chunks.last().unwrap()["usage"], usage(100, 3, 96));
    let ds = settled(&d, 2).await;
    assert_eq!(ds.stats.prefill_tokens, 0);
    assert_eq!(ds.stats.transferred_tokens, 99 + 3);
    assert_eq!(ds.stats.stored_blocks, 6, "nothing new to store");

    // A plain request on the decode worker is served whole (the router's fallback).
    let (status, plain) = post_json(&d, "/v1/completions", &json!({"prompt": ids(9000, 40)})).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(settled(&d, 3).await.stats.prefill_tokens, 40);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_side_waits_the_transfer_time_of_what_it_does_not_cache() {
    // 200 tokens x 1 Mbit at 0.1 Gb/s + 1 ms = 2.098 s simulated, 42 ms at 50x.
    let slow = SimWorkerConfig {
        transfer: TransferModel {
            link_gbps: 0.1,
            ..TransferModel::default()
        },
        ..SimWorkerConfig::default()
    };
    let d = worker_with(SimRole::Decode, slow).await;
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_block_ids": [],
                        "remote_host": "127.0.0.1", "remote_port": 1});
    let body = json!({"prompt": ids(100, 200), "max_tokens": 1, "kv_transfer_params": params});
    let start = Instant::now();
    let (status, v) = post_json(&d, "/v1/completions", &body).await;
    let took = start.elapsed();
    assert_eq!(status, 200, "{v}");
    assert!(took >= Duration::from_millis(41), "{took:?}");
    // The same prompt again: 192 tokens cached, 8 to receive: 1.08 ms / 50 of waiting,
    // well under the 41 ms the whole prompt's transfer takes (the bound is that one, not a
    // tighter figure: a loaded test machine adds milliseconds to any request).
    let start = Instant::now();
    let (_, v) = post_json(&d, "/v1/completions", &body).await;
    assert!(
        start.elapsed() < Duration::from_millis(41),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 192);
    d.shutdown().await;
}

fn bootstrap(p: &SimWorkerHandle, room: u64) -> Value {
    json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": p.http_addr().port(),
           "bootstrap_room": room})
}

fn with(mut body: Value, extra: &Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pairs_rendezvous_through_the_bootstrap() {
    let p = worker(SimRole::Prefill).await;
    let d = worker(SimRole::Decode).await;
    let msgs = json!([{"role": "system", "content": "a fixed system prompt of some words"},
                      {"role": "user", "content": "one two three four five six seven eight"}]);
    let base = json!({"messages": msgs, "max_tokens": 4});
    // Concurrently, the decode request first so it has to wait for the room.
    let room = (1u64 << 63) - 5;
    let dec_body = with(base.clone(), &bootstrap(&p, room));
    let pre_body = with(
        with(base.clone(), &bootstrap(&p, room)),
        &json!({"max_tokens": 1}),
    );
    let decode = post_json(&d, "/v1/chat/completions", &dec_body);
    let prefill = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        post_json(&p, "/v1/chat/completions", &pre_body).await
    };
    let ((ds, dec), (ps, pre)) = tokio::join!(decode, prefill);
    assert_eq!((ps, ds), (200, 200), "{pre} {dec}");
    assert_eq!(words(&pre), 1);
    assert_eq!(words(&dec), 4);
    let prompt_tokens = pre["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(dec["usage"], usage(prompt_tokens, 4, 0));
    let stats = settled(&d, 1).await.stats;
    assert_eq!(stats.prefill_tokens, 0);
    assert_eq!(stats.remote_prefills, 1);
    assert_eq!(stats.stored_blocks, (prompt_tokens - 1) / 16);
    assert_eq!(settled(&p, 1).await.stats.prefill_tokens, prompt_tokens);

    // Both streamed, the prefill first this time, with max_tokens as the client gave it:
    // the prefill side still generates one token.
    let room = 77;
    let stream = with(
        with(base.clone(), &bootstrap(&p, room)),
        &json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 6}),
    );
    let pre = post_stream(&p, "/v1/chat/completions", &stream).await;
    assert_eq!(streamed_text(&pre).len(), 1);
    let chunks = post_stream(&d, "/v1/chat/completions", &stream).await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(streamed_text(&chunks).len(), 6);
    let cached = (prompt_tokens - 1) / 16 * 16;
    assert_eq!(
        chunks.last().unwrap()["usage"],
        usage(prompt_tokens, 6, cached)
    );
    assert_eq!(settled(&d, 2).await.stats.prefill_tokens, 0);

    // Bootstrap fields on an aggregated worker are ignored: served whole.
    let a = worker(SimRole::Aggregated).await;
    let (status, v) = post_json(&a, "/v1/chat/completions", &with(base, &bootstrap(&p, 5))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(words(&v), 4);
    assert_eq!(settled(&a, 1).await.stats.prefill_tokens, prompt_tokens);
    // Only prefill workers serve the bootstrap.
    let (status, _, _) = call(d.http_addr(), "GET", "/sim/bootstrap/1", b"").await;
    assert_eq!(status, 404);
    let (status, _, _) = call(p.http_addr(), "GET", "/sim/bootstrap/nope", b"").await;
    assert_eq!(status, 400);
    for w in [p, d, a] {
        w.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_decode_without_its_prefill_is_a_502_before_any_token() {
    let short = SimWorkerConfig {
        bootstrap_timeout: Duration::from_millis(200),
        engine: EngineConfig {
            kv_blocks: 64,
            ..EngineConfig::default()
        },
        ..SimWorkerConfig::default()
    };
    let p = worker_with(SimRole::Prefill, short).await;
    let d = worker(SimRole::Decode).await;
    let check_502 = |status: u16, ct: &str, text: &str| {
        assert_eq!(status, 502, "{text}");
        assert!(ct.starts_with("application/json"), "{ct}");
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(v["error"]["code"], "kv_transfer_failed", "{v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    };
    let body = |room: u64, stream: bool| {
        with(
            json!({"prompt": ids(300, 40), "max_tokens": 3, "stream": stream}),
            &bootstrap(&p, room),
        )
    };

    // A room nobody prefills: the prefill worker's bootstrap gives up after 200 ms.
    let start = Instant::now();
    let (status, ct, text) = call(
        d.http_addr(),
        "POST",
        "/v1/completions",
        body(1, true).to_string().as_bytes(),
    )
    .await;
    check_502(status, &ct, &text);
    assert!(start.elapsed() >= Duration::from_millis(190));

    // A prefill the worker refuses (it could never fit) fails its room at once.
    let too_big = with(
        json!({"prompt": ids(300, 2000), "max_tokens": 1}),
        &bootstrap(&p, 2),
    );
    let decode_body = with(too_big.clone(), &json!({"max_tokens": 3})).to_string();
    let decode = call(
        d.http_addr(),
        "POST",
        "/v1/completions",
        decode_body.as_bytes(),
    );
    let prefill = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        post_json(&p, "/v1/completions", &too_big).await
    };
    let start = Instant::now();
    let ((status, ct, text), (pre_status, _)) = tokio::join!(decode, prefill);
    assert_eq!(pre_status, 400);
    check_502(status, &ct, &text);
    assert!(start.elapsed() < Duration::from_millis(190), "failed fast");

    // The prefill worker dies: connection refused.
    let gone = body(3, true);
    p.shutdown().await;
    for stream in [true, false] {
        let mut b = gone.clone();
        b["stream"] = json!(stream);
        let (status, ct, text) = call(
            d.http_addr(),
            "POST",
            "/v1/completions",
            b.to_string().as_bytes(),
        )
        .await;
        check_502(status, &ct, &text);
    }
    let s = d.snapshot();
    assert_eq!(
        (s.stats.requests, s.stats.output_tokens),
        (0, 0),
        "nothing was queued"
    );
    d.shutdown().await;
}

fn trt(kind: &str) -> Value {
    json!({"request_type": kind})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_context_then_generation_whole_and_streamed() {
    let p = worker(SimRole::Prefill).await;
    let d = worker(SimRole::Decode).await;
    let msgs = json!([{"role": "user", "content": "tell me about caches and blocks and routes"}]);
    let ctx_body = json!({"messages": msgs, "max_tokens": 1, "stream": false,
                          "disaggregated_params": trt("context_only")});
    let (status, ctx) = post_json(&p, "/v1/chat/completions", &ctx_body).await;
    assert_eq!(status, 200, "{ctx}");
    assert_eq!(words(&ctx), 1);
    let dp = ctx["choices"][0]["disaggregated_params"].clone();
    assert_eq!(dp["request_type"], "context_only");
    assert!(dp["ctx_request_id"].is_u64());
    assert!(dp["draft_tokens"].is_null());
    assert_eq!(
        dp["encoded_opaque_state"],
        STANDARD.encode(p.http_addr().to_string())
    );
    let first = dp["first_gen_tokens"][0].as_u64().unwrap() as u32;
    assert_eq!(dp["first_gen_tokens"].as_array().unwrap().len(), 1);
    assert_eq!(
        ctx["choices"][0]["message"]["content"],
        token_text(first),
        "the first generated token is the one answered"
    );
    let prompt_tokens = ctx["usage"]["prompt_tokens"].as_u64().unwrap();

    let mut gen_params = dp.clone();
    gen_params["request_type"] = json!("generation_only");
    let gen_body = json!({"messages": msgs, "max_tokens": 4, "disaggregated_params": gen_params});
    let (status, gen_) = post_json(&d, "/v1/chat/completions", &gen_body).await;
    assert_eq!(status, 200, "{gen_}");
    assert_eq!(words(&gen_), 4);
    let text = gen_["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with(&token_text(first)), "{text}");
    assert_eq!(gen_["usage"], usage(prompt_tokens, 4, 0));
    assert!(gen_["choices"][0].get("disaggregated_params").is_none());

    let mut streamed = gen_body.clone();
    streamed["stream"] = json!(true);
    let chunks = post_stream(&d, "/v1/chat/completions", &streamed).await;
    let tokens = streamed_text(&chunks);
    assert_eq!(tokens.len(), 4);
    assert_eq!(tokens[0], token_text(first));
    let stats = settled(&d, 2).await.stats;
    assert_eq!(stats.prefill_tokens, 0);
    assert_eq!(stats.remote_prefills, 2);
    assert_eq!(stats.stored_blocks, (prompt_tokens - 1) / 16);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_disaggregation_fields_are_400s() {
    let d = worker(SimRole::Decode).await;
    let p = worker(SimRole::Prefill).await;
    let prompt = json!(ids(10, 20));
    let remote = |drop_key: &str| {
        let mut kv = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
            "remote_port": 9, "tp_size": 1});
        kv.as_object_mut().unwrap().remove(drop_key);
        json!({"prompt": prompt, "kv_transfer_params": kv})
    };
    let cases: Vec<(Value, Option<&str>, &str)> = vec![
        (
            remote("remote_engine_id"),
            Some("kv_transfer_params"),
            "remote_engine_id",
        ),
        (
            remote("remote_block_ids"),
            Some("kv_transfer_params"),
            "remote_block_ids",
        ),
        (
            remote("remote_port"),
            Some("kv_transfer_params"),
            "remote_port",
        ),
        (
            json!({"prompt": prompt, "kv_transfer_params": "yes"}),
            Some("kv_transfer_params"),
            "object",
        ),
        (
            json!({"prompt": prompt, "stream": true, "kv_transfer_params": vllm_prefill_params()}),
            Some("stream"),
            "stream",
        ),
        (
            json!({"prompt": prompt, "bootstrap_host": "h", "bootstrap_port": 1,
                   "bootstrap_room": 9_223_372_036_854_775_808u64}),
            Some("bootstrap_room"),
            "2^63",
        ),
        (
            json!({"prompt": prompt, "bootstrap_host": "h", "bootstrap_room": 1}),
            Some("bootstrap_port"),
            "bootstrap_port",
        ),
        (
            json!({"prompt": prompt, "disaggregated_params": trt("generation_only")}),
            Some("disaggregated_params"),
            "first_gen_tokens",
        ),
        (
            json!({"prompt": prompt, "disaggregated_params":
                   {"request_type": "generation_only", "first_gen_tokens": [5]}}),
            Some("disaggregated_params"),
            "ctx_request_id",
        ),
        (
            json!({"prompt": prompt, "disaggregated_params": trt("sideways")}),
            Some("disaggregated_params"),
            "sideways",
        ),
        (
            json!({"prompt": prompt, "stream": true, "disaggregated_params": trt("context_only")}),
            Some("stream"),
            "stream",
        ),
        (
            json!({"prompt": prompt, "disaggregated_params": trt("context_only"),
                   "kv_transfer_params": vllm_prefill_params()}),
            None,
            "one",
        ),
    ];
    for w in [&d, &p] {
        for (body, param, needle) in &cases {
            let (status, v) = post_json(w, "/v1/completions", body).await;
            assert_eq!(status, 400, "{body}: {v}");
            let err = &v["error"];
            assert_eq!(err["type"], "invalid_request_error", "{v}");
            assert_eq!(err["param"].as_str(), *param, "{v}");
            let message = err["message"].as_str().unwrap();
            assert!(message.contains(needle), "{needle:?} not in {message:?}");
        }
    }
    assert_eq!(d.snapshot().stats.requests, 0);
    d.shutdown().await;
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_workers_events_rebuild_the_received_prompt_in_kvengines_index() {
    let p = worker(SimRole::Prefill).await;
    let d = worker(SimRole::Decode).await;
    let hub = SubscribedHub::start(&d, 2).await;

    let prompt = ids(70_000, 130); // 8 full blocks
    let pre_body = json!({"prompt": prompt, "max_tokens": 1,
                          "disaggregated_params": trt("context_only")});
    let (_, ctx) = post_json(&p, "/v1/completions", &pre_body).await;
    let mut params = ctx["choices"][0]["disaggregated_params"].clone();
    params["request_type"] = json!("generation_only");
    let gen_body = json!({"prompt": prompt, "max_tokens": 2, "disaggregated_params": params});
    assert_eq!(post_json(&d, "/v1/completions", &gen_body).await.0, 200);
    hub.wait_overlap(&prompt, vec![(hub.key(), 8)], "the received prompt")
        .await;
    hub.stop().await;
    p.shutdown().await;
    d.shutdown().await;
}
