//! The routing-quality replay: trace expansion and its bound, the report's math, the SVG,
//! and a small replay end to end through the real router onto simulated workers.

use engine::WorkerId;
use lab::replay::client::{ClientConfig, RequestResult, SseState, replay};
use lab::replay::cluster::{Cluster, ClusterConfig};
use lab::replay::replicas::SyncTotals;
use lab::replay::report::{RunInfo, load_spread, percentile, sorted, summarize, sync_table, table};
use lab::replay::trace::{TraceOptions, chat_workload, expand, hit_rate_bound, parse_trace};
use lab::replay::{ReplayConfig, ReplayRequest, RunMode, demo_chat_config, plot};
use sim::engine::EngineConfig;
use std::sync::Arc;
use std::time::Duration;

const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [7, 8]}
{"timestamp": 50, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}

{"timestamp": 80, "input_length": 512, "output_length": 0, "hash_ids": [7]}
"#;

#[test]
fn trace_expansion_shares_prefixes_and_keeps_lengths() {
    let opts = TraceOptions {
        max_requests: None,
        rate_scale: 2.0,
        block_size: 16,
    };
    let w = parse_trace(TRACE, "hand-made", &opts).unwrap();
    let r = &w.requests;
    assert_eq!(r.len(), 3);
    assert_eq!(
        r.iter().map(|r| r.tokens.len()).collect::<Vec<_>>(),
        [1000, 1100, 512]
    );
    // Equal hash ids, equal tokens: request 1 extends request 0's 1000 tokens, request 2
    // is exactly the shared first 512-token block.
    assert_eq!(r[0].tokens[..], r[1].tokens[..1000]);
    assert_eq!(r[2].tokens[..], r[0].tokens[..512]);
    // Different ids, different tokens.
    assert_ne!(expand(&[9], 512), expand(&[8], 512));
    assert_eq!(expand(&[7, 8], 1000)[..], r[0].tokens[..]);
    // Arrivals divided by the rate scale; output lengths at least 1.
    assert_eq!(
        r.iter().map(|r| r.arrival_ms).collect::<Vec<_>>(),
        [0.0, 25.0, 40.0]
    );
    assert_eq!(
        r.iter().map(|r| r.output_tokens).collect::<Vec<_>>(),
        [6, 3, 1]
    );
    let cut = parse_trace(
        TRACE,
        "cut",
        &TraceOptions {
            max_requests: Some(2),
            ..opts
        },
    )
    .unwrap();
    assert_eq!(cut.requests.len(), 2);
    assert!(parse_trace("{\"timestamp\": 0}\n", "bad", &opts).is_err());
    assert!(
        parse_trace(
            TRACE,
            "bad rate",
            &TraceOptions {
                rate_scale: 0.0,
                ..opts
            }
        )
        .is_err()
    );
}

#[test]
fn bound_of_a_hand_made_trace() {
    let w = parse_trace(TRACE, "hand-made", &TraceOptions::default()).unwrap();
    let b = w.bound;
    // Block size 16. Request 0 (1000 tokens): nothing seen before.
    // Request 1 (1100 tokens): its first 1000 tokens are request 0's; request 0 had
    // floor(1000 / 16) = 62 full blocks, all seen; 62 * 16 = 992 tokens hit.
    // Request 2 (512 tokens): 32 full blocks, all seen, but the last token is always
    // computed, so at most floor(511 / 16) = 31 blocks hit: 496 tokens.
    assert_eq!(b.prompt_tokens, 1000 + 1100 + 512);
    assert_eq!(b.reusable_tokens, 992 + 496);
    // Distinct full blocks: request 0's 62, request 1's 68 of which 62 shared.
    assert_eq!(b.distinct_blocks, 68);
    assert!((b.hit_rate() - 1488.0 / 2612.0).abs() < 1e-12);
    // The same by hand with another block size: 512-token blocks.
    let b512 = hit_rate_bound(&w.requests, 512);
    // Request 1: block 0 seen (request 0 has 1 full 512-block); request 2: 511 / 512 = 0.
    assert_eq!(b512.reusable_tokens, 512);
    assert_eq!(hit_rate_bound(&[], 16).hit_rate(), 0.0);
}

#[test]
fn chat_workload_is_deterministic_and_shares_system_prompts() {
    let a = chat_workload(demo_chat_config(3, 50), 16).unwrap();
    let b = chat_workload(demo_chat_config(3, 50), 16).unwrap();
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.requests.len(), 50);
    assert!(a.bound.hit_rate() > 0.3, "{}", a.bound.hit_rate());
    assert!(
        a.requests
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms)
    );
}

fn result(worker: u64, ttft: f64, itl: &[f64], prompt: u64, cached: u64) -> RequestResult {
    RequestResult {
        worker: Some(worker),
        ttft_ms: Some(ttft),
        itl_ms: itl.to_vec(),
        e2e_ms: Some(ttft + itl.iter().sum::<f64>()),
        prompt_tokens: prompt,
        cached_tokens: cached,
        output_tokens: itl.len() as u64 + 1,
        ..RequestResult::default()
    }
}

#[test]
fn percentiles_and_spread() {
    let v = sorted((1..=100).map(f64::from).rev());
    assert_eq!(percentile(&v, 50.0), 50.0);
    assert_eq!(percentile(&v, 90.0), 90.0);
    assert_eq!(percentile(&v, 99.0), 99.0);
    assert_eq!(percentile(&v, 100.0), 100.0);
    assert_eq!(percentile(&v, 0.0), 1.0);
    assert_eq!(percentile(&[], 50.0), 0.0);
    assert_eq!(percentile(&[7.0], 99.0), 7.0);
    assert_eq!(sorted([3.0, f64::NAN, 1.0]), vec![1.0, 3.0]);
    assert_eq!(load_spread(&[10, 10, 10, 10]), 0.0);
    assert!((load_spread(&[40, 0, 0, 0]) - 3.0).abs() < 1e-12);
    assert!((load_spread(&[30, 10, 10, 10]) - 1.0).abs() < 1e-12);
    assert_eq!(load_spread(&[0, 0]), 0.0);
    assert_eq!(load_spread(&[]), 0.0);
}

/// A run of two workers, without replicas.
fn synthetic_info() -> RunInfo {
    RunInfo {
        mode: RunMode::Kv,
        workload: "synthetic".into(),
        workers: vec![WorkerId(1), WorkerId(2)],
        speedup: 10.0,
        kv_blocks: 100,
        rate_scale: 1.0,
        hit_rate_bound: 0.5,
        capacity_hit_bound: 0.4,
        router_cost: engine::sched::RouterCost::Ttft,
        wall_s: 1.0,
        router_active_after: 0,
        preemptions: 0,
        chosen_overlap_blocks: 0.0,
        best_overlap_blocks: 0.0,
        block_size: 16,
        sync: None,
    }
}

#[test]
fn summary_of_synthetic_results() {
    let info = synthetic_info();
    let mut results = vec![
        result(1, 100.0, &[10.0, 20.0], 1000, 500),
        result(2, 300.0, &[30.0], 1000, 0),
        result(1, 200.0, &[], 2000, 1500),
    ];
    results.push(RequestResult {
        error: Some("status 400".into()),
        ..RequestResult::default()
    });
    for (i, r) in results.iter_mut().enumerate() {
        r.index = i;
        r.sent_ms = 100.0 * i as f64;
    }
    let r = summarize(&info, &results);
    assert_eq!((r.requests, r.errors, r.workers), (4, 1, 2));
    assert_eq!(r.ttft_p50_ms, 200.0);
    assert_eq!(r.ttft_p99_ms, 300.0);
    assert_eq!(r.itl_p50_ms, 20.0);
    assert_eq!(r.e2e_p50_ms, 200.0);
    // 2000 of 4000 prompt tokens cached.
    assert!((r.cache_hit_rate - 0.5).abs() < 1e-12);
    // Prefill: worker 1 computed 500 + 500, worker 2 1000: perfectly even.
    assert_eq!(r.prefill_tokens_per_worker, vec![1000, 1000]);
    assert_eq!(r.requests_per_worker, vec![2, 1]);
    assert_eq!(r.load_spread, 0.0);
    // 6 tokens from t=0 to the last end (request 1: sent 100 + 330).
    assert!((r.output_tok_per_s - 6.0 / 0.43).abs() < 1e-9);
    assert_eq!(r.error_samples.len(), 1);
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "mode",
        "requests",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "e2e_p50_ms",
        "output_tok_per_s",
        "cache_hit_rate",
        "hit_rate_bound",
        "capacity_hit_bound",
        "capacity_share",
        "overlap_regret",
        "router_cost",
        "load_spread",
        "errors",
        "workers",
        "speedup",
        "machine",
        "date",
    ] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    assert_eq!(json["mode"], "kv");
    assert!(
        json.get("replicas").is_none(),
        "no replicas, no sync figures"
    );
    assert_eq!(sync_table(std::slice::from_ref(&r)), "");
    assert!(table(&[r]).lines().nth(1).unwrap().starts_with("kv "));
}

#[test]
fn sync_figures_are_per_routed_request() {
    let info = RunInfo {
        sync: Some(SyncTotals {
            replicas: 3,
            frames_sent: 30,
            bytes_sent: 6000,
            events_sent: 9,
            events_applied: 18,
            busy_ns: 3_000_000,
            nats_cpu_ns: Some(10_000_000),
            ..SyncTotals::default()
        }),
        ..synthetic_info()
    };
    // Three routed (one of them failed after routing), one never routed.
    let mut results = vec![
        result(1, 100.0, &[], 100, 0),
        result(2, 100.0, &[], 100, 0),
        RequestResult {
            worker: Some(1),
            error: Some("the stream ended without [DONE]".into()),
            ..RequestResult::default()
        },
        RequestResult {
            error: Some("sending: refused".into()),
            ..RequestResult::default()
        },
    ];
    for (i, r) in results.iter_mut().enumerate() {
        r.index = i;
    }
    let r = summarize(&info, &results);
    let s = r.sync.clone().unwrap();
    assert_eq!(s.replicas, 3);
    assert_eq!(s.sync_frames_per_request, 10.0);
    assert_eq!(s.sync_bytes_per_request, 2000.0);
    assert_eq!(s.sync_cpu_us_per_request, 1000.0);
    assert_eq!(s.nats_cpu_us_per_request, Some(10_000.0 / 3.0));
    assert_eq!((s.sync_events_sent, s.sync_events_applied), (9, 18));
    // Flattened beside the usual figures.
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["replicas"], 3);
    assert_eq!(json["sync_bytes_per_request"], 2000.0);
    assert_eq!(json["sync_events_dropped"], 0);
    assert!(json.get("sync").is_none());
    let text = sync_table(&[r]);
    let row = text.lines().nth(1).unwrap();
    assert!(row.starts_with("kv "), "{text}");
    assert!(row.contains(" 2000 ") && row.contains(" 1000.0 "), "{text}");
}

#[test]
fn sse_events_are_read_like_a_client() {
    let mut st = SseState::default();
    let mut out = RequestResult::default();
    st.event(
        br#"data: {"choices":[{"index":0,"text":"the "}]}"#,
        10.0,
        &mut out,
    );
    st.event(
        br#"data: {"choices":[{"index":0,"text":"of "}]}"#,
        14.0,
        &mut out,
    );
    st.event(
        br#"data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
        15.0,
        &mut out,
    );
    st.event(
        br#"data: {"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#,
        16.0,
        &mut out,
    );
    assert!(!st.done);
    st.event(b"data: [DONE]", 16.0, &mut out);
    assert!(st.done && st.usage);
    assert_eq!(out.ttft_ms, Some(10.0));
    assert_eq!(out.itl_ms, vec![4.0]);
    assert_eq!(
        (out.prompt_tokens, out.cached_tokens, out.output_tokens),
        (40, 32, 2)
    );
    assert!(out.error.is_none());
    st.event(br#"data: {"error":{"message":"boom"}}"#, 17.0, &mut out);
    assert!(out.error.as_deref().unwrap().contains("boom"));
}

fn well_formed(svg: &str) {
    assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
    // Every element is closed: count opening and closing tags by hand.
    let mut stack: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(i) = rest.find('<') {
        let Some(j) = rest[i..].find('>') else {
            panic!("unterminated tag");
        };
        let tag = &rest[i + 1..i + j];
        rest = &rest[i + j + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap_or("");
            stack.push(name.to_owned());
        }
        assert!(!tag.contains('<'), "stray < in {tag}");
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
}

#[test]
fn small_replay_end_to_end() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // 30 requests: 3 conversations' worth of shared prefixes, 10 ms apart.
    let workload = chat_workload(
        sim::workload::chat::ChatConfig {
            requests: 30,
            system_prompts: 2,
            system_prompt_tokens: 200..=400,
            live_sessions: 4,
            first_message_tokens: 50..=300,
            answer_tokens: 5..=20,
            mean_gap_ms: 10.0,
            ..demo_chat_config(1, 30)
        },
        16,
    )
    .unwrap();
    let cfg = ReplayConfig {
        workers: 2,
        speedup: 20.0,
        engine: EngineConfig {
            kv_blocks: 2048,
            ..EngineConfig::default()
        },
        ..ReplayConfig::default()
    };
    let mut reports = Vec::new();
    for mode in [RunMode::Kv, RunMode::RoundRobin] {
        let report = rt.block_on(async {
            let cluster = Cluster::start(&ClusterConfig::of(&cfg, mode))
                .await
                .unwrap();
            let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let tick = {
                let done = done.clone();
                Arc::new(move || {
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                })
            };
            let results = replay(
                &cluster.url(),
                &workload.requests,
                &ClientConfig {
                    speedup: cfg.speedup,
                    request_timeout: Duration::from_secs(60),
                    ..ClientConfig::default()
                },
                tick,
            )
            .await;
            assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), 30);
            assert_eq!(results.len(), 30);
            for r in &results {
                assert!(r.ok(), "request {}: {:?}", r.index, r.error);
                let sent = &workload.requests[r.index];
                assert_eq!(r.prompt_tokens, sent.tokens.len() as u64);
                assert_eq!(r.output_tokens, u64::from(sent.output_tokens));
                assert!(r.worker.is_some_and(|w| (1..=2).contains(&w)));
                assert!(r.ttft_ms.unwrap() > 0.0);
            }
            // Every routed request was freed.
            assert_eq!(cluster.wait_idle(Duration::from_secs(2)).await, 0);
            assert_eq!(cluster.hub().routing().active_requests(), 0);
            let info = RunInfo {
                mode,
                workload: workload.name.clone(),
                workers: cluster.worker_ids(),
                speedup: cfg.speedup,
                kv_blocks: cfg.engine.kv_blocks,
                rate_scale: 1.0,
                hit_rate_bound: workload.bound.hit_rate(),
                capacity_hit_bound: 0.0,
                router_cost: engine::sched::RouterCost::Dynamo,
                wall_s: 0.0,
                router_active_after: 0,
                preemptions: 0,
                chosen_overlap_blocks: 0.0,
                best_overlap_blocks: 0.0,
                block_size: 16,
                sync: None,
            };
            cluster.shutdown().await.unwrap();
            summarize(&info, &results)
        });
        assert_eq!((report.requests, report.errors), (30, 0));
        reports.push(report);
    }
    let kv = &reports[0];
    assert!(kv.cache_hit_rate > 0.0, "{kv:?}");
    assert!(kv.cache_hit_rate <= kv.hit_rate_bound + 1e-9);
    assert!(kv.ttft_p50_ms > 0.0 && kv.output_tok_per_s > 0.0);

    let svg = plot::svg(&reports, "small <replay> & \"test\"");
    well_formed(&svg);
    assert!(svg.contains("round-robin") && svg.contains("&lt;replay&gt;"));
    let path = std::env::temp_dir().join(format!("kvengine-replay-{}.svg", std::process::id()));
    plot::write_svg(&reports, "small", &path).unwrap();
    well_formed(&std::fs::read_to_string(&path).unwrap());
    let _ = std::fs::remove_file(&path);
}

/// A small chat workload and a 2-worker, 20x replay setup.
fn small_chat(seed: u64, requests: usize) -> (lab::replay::Workload, ReplayConfig) {
    let workload = chat_workload(
        sim::workload::chat::ChatConfig {
            requests,
            system_prompt_tokens: 100..=200,
            first_message_tokens: 20..=100,
            answer_tokens: 3..=8,
            ..demo_chat_config(seed, requests)
        },
        16,
    )
    .unwrap();
    let cfg = ReplayConfig {
        workers: 2,
        speedup: 20.0,
        ..ReplayConfig::default()
    };
    (workload, cfg)
}

#[test]
fn run_reports_every_mode() {
    let (workload, cfg) = small_chat(2, 12);
    let reports = lab::replay::run(&workload, &RunMode::ALL, &cfg).unwrap();
    let modes: Vec<&str> = reports.iter().map(|r| r.mode.as_str()).collect();
    assert_eq!(modes, RunMode::ALL.map(RunMode::as_str));
    for r in &reports {
        assert_eq!((r.requests, r.errors, r.router_active_after), (12, 0, 0));
    }
    assert!(
        lab::replay::run(
            &lab::replay::Workload::new("empty".into(), vec![], 16),
            &[RunMode::Kv],
            &cfg
        )
        .is_err()
    );
    let bad = ReplayConfig {
        speedup: 0.0,
        ..cfg
    };
    assert!(lab::replay::run(&workload, &[RunMode::Kv], &bad).is_err());
    let _ = ReplayRequest {
        arrival_ms: 0.0,
        tokens: Arc::from(vec![1u32]),
        output_tokens: 1,
    };
}

#[test]
fn a_replay_with_a_dead_worker_completes_and_leaks_no_active_request() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (workload, cfg) = small_chat(3, 24);
    rt.block_on(async {
        let cluster = Cluster::start(&ClusterConfig::of(&cfg, RunMode::RoundRobin))
            .await
            .unwrap();
        // A third worker whose URL refuses connections: round-robin sends it every third
        // request, which the proxy retries on the next-best worker.
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        cluster
            .hub()
            .register(transport::hub::Registration {
                url: Some(dead_url),
                ..transport::hub::Registration::new(WorkerId(99))
            })
            .unwrap();
        let results = replay(
            &cluster.url(),
            &workload.requests,
            &ClientConfig {
                speedup: cfg.speedup,
                request_timeout: Duration::from_secs(60),
                ..ClientConfig::default()
            },
            Arc::new(|| {}),
        )
        .await;
        assert_eq!(results.len(), 24);
        for r in &results {
            assert!(r.ok(), "request {}: {:?}", r.index, r.error);
            assert_ne!(r.worker, Some(99), "the dead worker served nothing");
        }
        // The dead worker was chosen and every such request retried (in direct mode).
        let retries = cluster
            .hub()
            .metrics()
            .decisions()
            .find(|(m, _)| *m == engine::sched::RouteMode::Direct)
            .map_or(0, |(_, n)| n);
        assert!(retries >= 5, "{retries} retries");
        assert_eq!(cluster.wait_idle(Duration::from_secs(2)).await, 0);
        assert_eq!(cluster.hub().routing().active_requests(), 0);
        for w in cluster.hub().workers() {
            for (rank, active, _) in w.loads {
                let active = active.unwrap_or_default();
                assert_eq!(
                    (
                        active.active_requests,
                        active.active_blocks,
                        active.active_prefill_tokens
                    ),
                    (0, 0, 0),
                    "worker {} rank {rank:?}",
                    w.registration.worker
                );
            }
        }
        cluster.shutdown().await.unwrap();
    });
}

#[test]
fn the_description_warns_when_a_workers_cache_holds_the_whole_workload() {
    let (workload, cfg) = small_chat(4, 12);
    let distinct = workload.bound.distinct_blocks;
    let roomy = ReplayConfig {
        engine: EngineConfig {
            kv_blocks: u32::try_from(distinct).unwrap(),
            ..cfg.engine
        },
        ..cfg.clone()
    };
    let text = lab::replay::describe(&workload, &roomy);
    assert!(text.contains("holds the whole workload"), "{text}");
    let tight = ReplayConfig {
        engine: EngineConfig {
            kv_blocks: u32::try_from(distinct / 2).unwrap(),
            ..cfg.engine
        },
        ..cfg
    };
    let text = lab::replay::describe(&workload, &tight);
    assert!(!text.contains("holds the whole workload"), "{text}");
}
