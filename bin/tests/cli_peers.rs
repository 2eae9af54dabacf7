//! `kvengine bench peers` end to end against the real peer routers: SMG, sglang-router and
//! vllm-router from PyPI (pinned versions, one cached virtualenv each), each in front of
//! fresh simulated workers, beside kvengine.
//!
//! The peers must be installed (`kvengine bench peers --install-peers` installs them under
//! `~/.cache/kvengine/peers/`). Without them the test prints why and passes, unless
//! `KVENGINE_PEERS_REQUIRED` is set (CI sets it): then it installs them itself and may not
//! skip.

use std::process::Command;

#[test]
fn every_router_serves_the_same_workload_and_the_table_names_them_all() {
    let required = std::env::var_os("KVENGINE_PEERS_REQUIRED").is_some();
    let dir = tempdir();
    let json = dir.join("peers.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvengine"));
    cmd.args([
        "bench",
        "peers",
        "--routers",
        "all",
        "--max-requests",
        "40",
        "--runs",
        "1",
        "--overhead-secs",
        "1",
        "--overhead-connections",
        "4",
        "--speedup",
        "20",
        "--workdir",
    ])
    .arg(dir.join("logs"))
    .arg("--json")
    .arg(&json);
    if required {
        cmd.args(["--install-peers", "--require-peers"]);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    let routers: Vec<&str> = runs.iter().filter_map(|r| r["router"].as_str()).collect();
    if !required && routers == ["kvengine"] {
        eprintln!(
            "skipped the peers (not installed; kvengine bench peers --install-peers): {stderr}"
        );
    } else {
        assert_eq!(
            routers,
            [
                "kvengine",
                "smg",
                "sglang-router",
                "vllm-router",
                "vllm-router-kv"
            ],
            "{stderr}"
        );
    }
    for r in runs {
        let name = r["router"].as_str().unwrap();
        assert!(r["failed"].is_null(), "{name}: {r}");
        assert_eq!(r["requests"], 40, "{name}");
        assert_eq!(r["errors"], 0, "{name}: {}", r["first_error"]);
        assert!(r["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{name}");
        // The router process did work, and its proxy answered tiny requests.
        assert!(r["router_cpu_s"].as_f64().unwrap() > 0.0, "{name}");
        let o = &r["overhead"][0];
        assert_eq!(o["connections"], 4, "{name}");
        assert!(o["requests_per_s"].as_f64().unwrap() > 0.0, "{name}: {o}");
        // The chat workload shares system prompts: any router sees some cache hits.
        assert!(r["worker_hit_rate"].as_f64().unwrap() > 0.0, "{name}: {r}");
        assert!(stdout.contains(&format!("| {name} | 1 |")), "{stdout}");
    }
    assert!(stdout.contains("memory latency"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvengine-cli-peers-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
