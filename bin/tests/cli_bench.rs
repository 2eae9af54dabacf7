//! `kvengine bench indexer` runs the harness end to end on the threaded runtime, and the
//! anchor-exact harness (`--workload dynamo-w1`) on the one-shard index.

use std::process::Command;

#[test]
fn bench_indexer_reports_every_key_and_clean_checks() {
    let dir = std::env::temp_dir().join(format!("kvengine-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    for (workload, cores) in [("dynamo", "2"), ("shared-prefix", "1")] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["bench", "indexer", "--workload", workload, "--cores", cores])
            .args([
                "--size",
                "16384",
                "--workers",
                "16",
                "--queries",
                "200",
                "--quiet",
            ])
            .arg("--json")
            .arg(&json)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        for key in [
            "workload",
            "cores",
            "workers",
            "store_blocks_per_s",
            "remove_blocks_per_s",
            "block_ops_per_s",
            "queries_per_s",
            "query_p50_us",
            "query_p99_us",
            "query_p999_us",
            "live_block_entries",
            "bytes_per_block_entry",
            "shard_balance",
        ] {
            assert!(r.get(key).is_some(), "{workload}: missing {key}");
        }
        assert_eq!(r["workload"], workload);
        assert_eq!(r["cores"].as_u64().unwrap().to_string(), cores);
        assert_eq!(r["checks"]["anomalies"], 0);
        assert_eq!(r["checks"]["query_mismatches"], 0);
        assert_eq!(r["checks"]["final_live_entries"], 0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_indexer_anchor_workload_repeats_and_reports_every_key() {
    let dir = std::env::temp_dir().join(format!("kvengine-bench-anchor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("anchor.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["bench", "indexer", "--workload", "dynamo-w1"])
        .args(["--indexer", "kv-index", "--cores", "1"])
        .args(["--anchor-size", "32768", "--anchor-queries", "300"])
        .args(["--repeat", "2", "--quiet", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let keys = [
        "store_blocks_per_s",
        "remove_blocks_per_s",
        "hit_p50_us",
        "hit_p99_us",
        "prefix_p50_us",
        "prefix_p99_us",
        "hit_qps_1",
        "hit_qps_2",
        "mixed_store_blocks_per_s",
        "mixed_query_p50_us",
        "mixed_query_p99_us",
        "mixed_query_p999_us",
        "mixed_query_max_us",
        "bytes_per_block",
        "bytes_per_block_entry",
        "shard_balance",
        "rss_before_bytes",
        "rss_built_bytes",
        "rss_after_remove_bytes",
        "residual_after_remove",
    ];
    // Resident-memory figures are the first run's (the warm-up's), the rest medians.
    let memory = [
        "bytes_per_block",
        "rss_before_bytes",
        "rss_built_bytes",
        "rss_after_remove_bytes",
        "residual_after_remove",
    ];
    for key in keys {
        assert!(r[key].is_number(), "missing {key}");
        let range = r["range"][key].as_array().unwrap();
        assert_eq!(range.len(), 3, "{key}");
        if memory.contains(&key) {
            assert_eq!(r["warmup"][0][key], r[key], "{key}: the first run's");
        } else {
            assert_eq!(range[1], r[key], "{key}: the top level is the median");
        }
    }
    let runs = r["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        assert!(keys.iter().all(|k| run[k].is_number()));
        assert_eq!(run["checks"]["hit_mismatches"], 0);
        assert_eq!(run["checks"]["anomalies"], 0);
    }
    assert_eq!(r["workload"], "dynamo-w1");
    assert_eq!(r["indexer"], "kv-index");
    assert_eq!(r["cores"], 1);
    assert_eq!(r["repeat"], 2);
    assert_eq!(r["mixed_mode"], "interleaved");
    assert_eq!(r["checks_passed"], true);
    // W1's parameters with S scaled: N = S / D, E = N / 4, P = round(0.25 D).
    let p = &r["params"];
    assert_eq!(
        (p["W"].as_u64(), p["D"].as_u64(), p["G"].as_u64()),
        (Some(128), Some(128), Some(4))
    );
    assert_eq!(
        (p["N"].as_u64(), p["E"].as_u64(), p["P"].as_u64()),
        (Some(256), Some(64), Some(32))
    );
    assert!(r["mem_latency_ns"]["1MB"].as_f64().unwrap() > 0.0);
    assert!(r["mem_latency_ns"]["128MB"].as_f64().unwrap() > 0.0);
    for key in ["machine", "date", "version"] {
        assert!(r.get(key).is_some(), "missing {key}");
    }

    // A workload flag the anchor fixes is refused, naming it.
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args([
            "bench",
            "indexer",
            "--workload",
            "dynamo-w1",
            "--workers",
            "16",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--workers"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_snapshot_restores_a_small_index_and_reports_every_phase() {
    let dir = std::env::temp_dir().join(format!("kvengine-bench-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("snapshot.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["bench", "snapshot", "--entries", "20000", "--repeat", "1"])
        .args(["--cores", "2", "--workers", "16", "--dir"])
        .arg(&dir)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["bench"], "snapshot");
    assert_eq!(r["cores"], 2);
    assert_eq!(r["workers"], 16);
    assert_eq!(r["repeat"], 1);
    let entries = r["entries"].as_u64().unwrap();
    assert!(entries >= 20_000, "{entries}");
    assert_eq!(r["workload"]["distinct_entries"].as_u64(), Some(entries));
    // Trunk blocks count once per shard in the trees.
    assert!(r["shard_entries"].as_u64().unwrap() >= entries);
    assert!(r["trunk_blocks"].as_u64().unwrap() > 0);
    assert!(r["file_bytes"].as_u64().unwrap() > 0);
    assert_eq!(r["problems"].as_array().unwrap().len(), 0);
    for key in [
        "cut_s",
        "encode_s",
        "write_s",
        "read_s",
        "decode_s",
        "rebuild_s",
        "first_query_s",
        "restart_to_serving_s",
        "restart_s_per_10m_entries",
    ] {
        let range = r["range"][key].as_array().unwrap();
        assert_eq!(range.len(), 3, "{key}");
        assert!(range[1].as_f64().unwrap() > 0.0, "{key}");
    }
    let run = &r["runs"][0];
    assert_eq!(run["query_mismatches"], 0);
    assert_eq!(run["shard_mismatches"], 0);
    assert!(r["mem_latency_ns_before"]["128MB"].as_f64().unwrap() > 0.0);
    // The snapshot file is the run's own and is gone afterwards.
    assert!(!dir.join("snapshot.kvs").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--export DIR` writes the four anchors in the neutral format; the standard-library
/// Python reader (`lab/export/check_workload.py`) checks every answer in them with an
/// index of its own and catches a wrong one; `--import DIR/dynamo-w2` times the hosted
/// runtime on the files with clean checks, and refuses workload flags beside it.
#[test]
fn bench_indexer_exports_and_imports_the_anchor_workloads() {
    let dir = std::env::temp_dir().join(format!("kvengine-bench-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let kvengine = || Command::new(env!("CARGO_BIN_EXE_kvengine"));
    let out = kvengine()
        .args([
            "bench",
            "indexer",
            "--anchor-size",
            "65536",
            "--anchor-queries",
            "200",
        ])
        .arg("--export")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    for w in ["dynamo-w1", "dynamo-w2", "dynamo-w3", "dynamo-w4"] {
        assert!(said.contains(w), "{said}");
        assert!(dir.join(w).join("manifest.json").is_file(), "{w}");
    }

    let checker = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/export/check_workload.py"
    );
    let python = Command::new("python3").arg("--version").output();
    if python.is_ok_and(|o| o.status.success()) {
        let w1 = dir.join("dynamo-w1");
        let out = Command::new("python3")
            .arg(checker)
            .arg(&w1)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            said.contains("400 queries answered as the files say"),
            "{said}"
        );
        // One overlap off by one in the answers: the checker says so.
        let path = w1.join("answers.bin");
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        // Magic (8), count (8), first answer's holder count (4), worker (8), rank (4).
        bad[32] = bad[32].wrapping_add(1);
        std::fs::write(&path, bad).unwrap();
        let out = Command::new("python3")
            .arg(checker)
            .arg(&w1)
            .output()
            .unwrap();
        assert!(!out.status.success(), "a wrong answer passed");
        std::fs::write(&path, good).unwrap();
    } else {
        assert!(
            std::env::var_os("KVENGINE_E2E_REQUIRED").is_none(),
            "KVENGINE_E2E_REQUIRED is set (CI) and python3 does not run"
        );
        eprintln!("skipped the Python reader: python3 does not run");
    }

    let json = dir.join("imported.json");
    let out = kvengine()
        .args([
            "bench",
            "indexer",
            "--indexer",
            "hosted-runtime",
            "--cores",
            "2",
            "--quiet",
        ])
        .arg("--import")
        .arg(dir.join("dynamo-w2"))
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["workload"], "dynamo-w2");
    assert_eq!(r["checks_passed"], true);
    assert!(
        r["indexer"]
            .as_str()
            .is_some_and(|s| s.starts_with("hosted-runtime")),
        "{}",
        r["indexer"]
    );

    let out = kvengine()
        .args(["bench", "indexer", "--workload", "dynamo-w1", "--quiet"])
        .arg("--import")
        .arg(dir.join("dynamo-w2"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("drop --workload"));
    let _ = std::fs::remove_dir_all(&dir);
}
