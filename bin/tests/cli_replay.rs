//! `kvengine bench replay` as a user runs it: a small trace, every mode, JSON and SVG;
//! disaggregated; through router replicas on a real NATS server.

use std::process::{Command, Output};

fn kvengine(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvengine"));
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("KVENGINE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("the kvengine binary runs")
}

/// A small Mooncake-format trace: 12 requests in 3 families sharing 512-token blocks.
fn write_trace(path: &std::path::Path) {
    let mut text = String::new();
    for i in 0..12u64 {
        let family = i % 3;
        let ids: Vec<String> = [family * 100, family * 100 + 1, 1000 + i]
            .iter()
            .map(u64::to_string)
            .collect();
        text.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}\n",
            i * 40,
            1024 + 100 + i,
            4 + i % 5,
            ids.join(", ")
        ));
    }
    std::fs::write(path, text).unwrap();
}

/// A temporary directory holding the test trace and a replay's JSON and SVG.
struct ReplayDir {
    dir: std::path::PathBuf,
    trace: String,
    json: String,
    svg: String,
}

impl ReplayDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvengine-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = |f: &str| dir.join(f).to_str().unwrap().to_owned();
        let (trace, json, svg) = (path("trace.jsonl"), path("r.json"), path("r.svg"));
        write_trace(std::path::Path::new(&trace));
        Self {
            dir,
            trace,
            json,
            svg,
        }
    }

    /// `kvengine bench replay --trace T --json J ARGS` (env `env`): must succeed; returns
    /// its stdout and JSON.
    fn replay(&self, args: &[&str], env: &[(&str, &str)]) -> (String, serde_json::Value) {
        let mut all = vec![
            "bench",
            "replay",
            "--trace",
            &self.trace,
            "--json",
            &self.json,
        ];
        all.extend_from_slice(args);
        let out = kvengine(&all, env);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc = serde_json::from_str(&std::fs::read_to_string(&self.json).unwrap()).unwrap();
        (stdout, doc)
    }
}

impl Drop for ReplayDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn replay_all_modes_writes_json_array_and_svg() {
    let d = ReplayDir::new("replay-cli");
    let (stdout, doc) = d.replay(
        &[
            "--workers",
            "2",
            "--mode",
            "all",
            "--max-requests",
            "10",
            "--plot",
            &d.svg,
        ],
        &[
            ("KVENGINE_BENCH_SPEEDUP", "20"),
            ("KVENGINE_BENCH_KV_BLOCKS", "1024"),
        ],
    );
    // Every mode `all` stands for has its row.
    for mode in lab::replay::RunMode::ALL.map(|m| format!("{} ", m.as_str())) {
        assert!(stdout.lines().any(|l| l.starts_with(&mode)), "{stdout}");
    }
    assert!(stdout.contains("--router-cost dynamo"), "{stdout}");
    assert!(!stdout.contains("replica sync"), "{stdout}");
    let reports = doc.as_array().expect("several modes: an array");
    assert_eq!(reports.len(), lab::replay::RunMode::ALL.len());
    for r in reports {
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
            "overlap_regret",
            "requests_per_s",
            "load_spread",
            "errors",
            "workers",
            "speedup",
            "machine",
            "date",
        ] {
            assert!(r.get(key).is_some(), "missing {key}");
        }
        assert_eq!(r["router_cost"], "dynamo");
        // One cache of both workers' blocks holds no more than an infinite one.
        let (cap, inf) = (
            r["capacity_hit_bound"].as_f64().unwrap(),
            r["hit_rate_bound"].as_f64().unwrap(),
        );
        assert!(cap > 0.0 && cap <= inf + 1e-9, "{r}");
        assert_eq!(r["requests"], 10);
        assert_eq!(r["errors"], 0);
        assert_eq!(r["workers"], 2);
        assert_eq!(r["speedup"], 20.0);
        // One router: no replica figures, as before replicas existed.
        assert!(r.get("replicas").is_none(), "{r}");
        assert!(r.get("sync_bytes_per_request").is_none(), "{r}");
        assert!(r["hit_rate_bound"].as_f64().unwrap() > 0.3);
    }
    let svg_text = std::fs::read_to_string(&d.svg).unwrap();
    assert!(svg_text.starts_with("<svg ") && svg_text.trim_end().ends_with("</svg>"));
    assert!(svg_text.contains("kv-no-events") && svg_text.contains("power-of-two"));

    // One mode: a JSON object.
    let (_, doc) = d.replay(
        &[],
        &[
            ("KVENGINE_BENCH_MODE", "round-robin"),
            ("KVENGINE_BENCH_WORKERS", "2"),
            ("KVENGINE_BENCH_SPEEDUP", "20"),
        ],
    );
    assert_eq!(doc["mode"], "round-robin");
    assert_eq!(doc["requests"], 12);
}

#[test]
fn bad_replay_flags_exit_non_zero_with_a_message() {
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case<'_>; 6] = [
        (&["bench", "replay", "--mode", "fastest"], &[], "fastest"),
        (&["bench", "replay", "--replicas", "0"], &[], "--replicas"),
        (&["bench", "replay", "--replicas", "17"], &[], "--replicas"),
        (&["bench", "replay", "--speedup", "0"], &[], "--speedup"),
        (
            &["bench", "replay", "--trace", "/nonexistent/trace.jsonl"],
            &[],
            "--trace",
        ),
        (
            &["bench", "replay"],
            &[("KVENGINE_BENCH_CORES", "3")],
            "--cores",
        ),
    ];
    for (args, env, needle) in cases {
        let out = kvengine(args, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// `--disagg 1:1`: prefill and decode workers against aggregated kv, every request served,
/// the split's figures in the JSON, the table and the SVG.
#[test]
fn disaggregated_replay_compares_pairs_with_aggregated_kv() {
    let d = ReplayDir::new("replay-disagg");
    let (stdout, doc) = d.replay(
        &[
            "--disagg",
            "1:1",
            "--max-requests",
            "10",
            "--speedup",
            "20",
            "--kv-blocks",
            "1024",
            "--plot",
            &d.svg,
        ],
        &[],
    );
    for run in ["disagg-kv ", "disagg-round-robin ", "kv "] {
        assert!(stdout.lines().any(|l| l.starts_with(run)), "{stdout}");
    }
    let reports = doc.as_array().expect("several runs: an array");
    let runs: Vec<&str> = reports
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(runs, ["disagg-kv", "disagg-round-robin", "kv"]);
    for r in reports {
        assert_eq!(r["requests"], 10, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["workers"], 2, "{r}");
        assert_eq!(r["router_active_after"], 0, "{r}");
        for key in [
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
            "output_tok_per_s",
            "requests_per_s",
            "cache_hit_rate",
        ] {
            assert!(r[key].as_f64().is_some(), "missing {key}: {r}");
        }
        assert!(r["output_tok_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["requests_per_s"].as_f64().unwrap() > 0.0);
    }
    let split = &reports[0]["disagg"];
    assert_eq!(split["protocol"], "vllm");
    assert_eq!(
        (
            split["prefill_workers"].as_u64(),
            split["decode_workers"].as_u64()
        ),
        (Some(1), Some(1))
    );
    assert!(split["remote_prefills"].as_u64().unwrap() > 0, "{split}");
    assert!(split["transferred_tokens"].as_u64().unwrap() > 0, "{split}");
    assert_eq!(
        split["remote_prefills"].as_u64().unwrap() + split["local_prefills"].as_u64().unwrap(),
        10,
        "{split}"
    );
    assert!(reports[1]["disagg"].is_object());
    assert!(
        reports[2].get("disagg").is_none(),
        "aggregated kv has no split"
    );
    let svg_text = std::fs::read_to_string(&d.svg).unwrap();
    assert!(svg_text.starts_with("<svg ") && svg_text.trim_end().ends_with("</svg>"));
    assert!(
        svg_text.contains("disagg-round-robin") && svg_text.contains("Inter-token latency p99")
    );

    // SGLang's hand-off (bootstrap rooms on the prefill workers' HTTP ports), kv only.
    let (_, doc) = d.replay(
        &[
            "--disagg",
            "1:1",
            "--disagg-protocol",
            "sglang",
            "--mode",
            "kv",
        ],
        &[("KVENGINE_BENCH_SPEEDUP", "20")],
    );
    let reports = doc.as_array().expect("disagg-kv and kv: an array");
    assert_eq!(reports.len(), 2);
    assert_eq!(reports[0]["mode"], "disagg-kv");
    assert_eq!(reports[0]["disagg"]["protocol"], "sglang");
    assert!(reports[0]["disagg"]["remote_prefills"].as_u64().unwrap() > 0);
    assert!(reports[0]["disagg"]["transferred_tokens"].as_u64().unwrap() > 0);
    for r in reports {
        assert_eq!(
            (r["requests"].as_u64(), r["errors"].as_u64()),
            (Some(12), Some(0))
        );
    }
}

#[test]
fn bad_disagg_flags_exit_non_zero_with_a_message() {
    let cases: [(&[&str], &str); 7] = [
        (&["--disagg", "2"], "not P:D"),
        (&["--disagg", "0:2"], "P >= 1"),
        (&["--disagg", "2:0"], "D >= 1"),
        (&["--disagg", "200:57"], "at most 256"),
        (
            &["--disagg", "1:1", "--workers", "3"],
            "--workers 3 conflicts",
        ),
        (
            &["--disagg", "1:1", "--mode", "kv-no-events"],
            "cannot be disaggregated",
        ),
        (&["--disagg", "1:1", "--disagg-protocol", "nixl"], "nixl"),
    ];
    for (flags, needle) in cases {
        let args: Vec<&str> = ["bench", "replay"].iter().chain(flags).copied().collect();
        let out = kvengine(&args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} succeeded");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
    }
}

/// `--replicas 2` on a real NATS server: the requests spread over two routers in front of
/// the same workers, every one served, the replicas' load shared (events sent and applied,
/// none dropped), the sync's cost reported beside the usual figures. Skipped without
/// `nats-server` unless `KVENGINE_NATS_REQUIRED=1`.
#[test]
fn replay_through_two_replicas_shares_their_load_over_nats() {
    let Some(nats) = lab::nats::binary_or_skip("the replica replay test") else {
        return;
    };
    let d = ReplayDir::new("replay-replicas");
    // `kvengine` below runs with no KVENGINE_* variable but those given: name the server.
    let nats = nats.to_str().unwrap().to_owned();
    let (stdout, doc) = d.replay(
        &[
            "--replicas",
            "2",
            "--mode",
            "kv",
            "--workers",
            "2",
            "--speedup",
            "20",
            "--kv-blocks",
            "1024",
        ],
        &[("KVENGINE_NATS_SERVER", &nats)],
    );
    assert!(stdout.lines().any(|l| l.starts_with("kv ")), "{stdout}");
    let sync_table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("replica sync"))
        .collect();
    assert!(
        sync_table.get(1).is_some_and(|l| l.starts_with("kv ")),
        "{stdout}"
    );
    assert_eq!(doc["mode"], "kv", "{doc}");
    assert_eq!(
        (doc["requests"].as_u64(), doc["errors"].as_u64()),
        (Some(12), Some(0)),
        "{doc}"
    );
    assert_eq!(doc["router_active_after"], 0, "{doc}");
    assert_eq!(doc["replicas"], 2, "{doc}");
    assert!(doc["cache_hit_rate"].as_f64().unwrap() > 0.0, "{doc}");
    assert!(
        doc["sync_bytes_per_request"].as_f64().unwrap() > 0.0,
        "{doc}"
    );
    assert!(
        doc["sync_frames_per_request"].as_f64().unwrap() > 0.0,
        "{doc}"
    );
    assert!(
        doc["sync_cpu_us_per_request"].as_f64().unwrap() > 0.0,
        "{doc}"
    );
    assert!(doc["nats_cpu_us_per_request"].as_f64().is_some(), "{doc}");
    // Each request's route, prefill and end, from whichever replica routed it, reached
    // the other one.
    let sent = doc["sync_events_sent"].as_u64().unwrap();
    assert!(sent >= 3 * 12, "{doc}");
    assert_eq!(doc["sync_events_applied"].as_u64(), Some(sent), "{doc}");
    assert_eq!(doc["sync_events_dropped"], 0, "{doc}");
    assert_eq!(doc["sync_gaps"], 0, "{doc}");
}

/// `--unshared-replicas`: the same replicas as independent routers (the control): no NATS
/// needed, every request served, no sync figures.
#[test]
fn replay_through_unshared_replicas_needs_no_nats() {
    let d = ReplayDir::new("replay-unshared");
    let (stdout, doc) = d.replay(
        &[
            "--replicas",
            "2",
            "--unshared-replicas",
            "--mode",
            "kv",
            "--workers",
            "2",
            "--speedup",
            "20",
            "--kv-blocks",
            "1024",
        ],
        // A nats-server that does not exist: the control must not look for one.
        &[("KVENGINE_NATS_SERVER", "/nonexistent/nats-server")],
    );
    assert!(stdout.lines().any(|l| l.starts_with("kv ")), "{stdout}");
    assert!(!stdout.contains("replica sync"), "{stdout}");
    assert_eq!(
        (doc["requests"].as_u64(), doc["errors"].as_u64()),
        (Some(12), Some(0)),
        "{doc}"
    );
    assert_eq!(doc["router_active_after"], 0, "{doc}");
    assert!(doc.get("sync_bytes_per_request").is_none(), "{doc}");
}
