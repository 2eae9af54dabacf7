//! Issue 12 part 6: `kvengine bench soak` for 60 s. The router (this binary, as a child
//! process) serves front-door traffic onto simulated workers while every kind of fault is
//! injected (worker restarts, dropped batches, bursts, worker HTTP failures, the router
//! killed with SIGKILL and restarted from its state directory); its index must never lose
//! an acknowledged entry nor keep a stale one at any checkpoint.
//!
//! Route latency and resident memory are reported, not asserted here: on a shared 2-CPU
//! machine with a debug build they measure the machine as much as the router
//! (docs/benchmarks.md has a 30-minute release run).

use std::process::Command;

#[test]
fn a_minute_of_faults_loses_nothing_acknowledged_and_keeps_nothing_stale() {
    // The report and plot stay in the target's temporary directory after the run.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli_soak");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("soak.json"), dir.join("soak.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["bench", "soak", "--duration-s", "60", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .arg("--work-dir")
        .arg(dir.join("work"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    let text = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("no report ({e}); the soak said:\n{stderr}"));
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let n = |k: &str| {
        r[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing: {text}"))
    };
    assert_eq!(
        n("acknowledged_lost"),
        0,
        "acknowledged entries lost:\n{stderr}"
    );
    assert_eq!(n("stale_entries"), 0, "stale entries kept:\n{stderr}");
    for kind in [
        "publisher_restart",
        "dropped_batches",
        "slow_consumer",
        "worker_http_failure",
        "router_restart",
    ] {
        assert!(
            r["faults_injected"][kind].as_u64().unwrap_or(0) >= 1,
            "{kind} never injected: {}",
            r["faults_injected"]
        );
    }
    for k in [
        "rss_growth_ratio",
        "route_p99_ms_quiet",
        "route_p99_ms_faults",
    ] {
        assert!(r[k].as_f64().is_some_and(f64::is_finite), "{k}: {}", r[k]);
    }
    assert!(r["route_quiet"]["requests"].as_u64().unwrap_or(0) > 100);
    assert!(r["completions_quiet"]["requests"].as_u64().unwrap_or(0) > 50);
    let checkpoints = r["checkpoints"].as_array().unwrap();
    assert!(!checkpoints.is_empty());
    for c in checkpoints {
        assert_eq!(c["model_mismatches"], 0, "harness self-check: {c}");
        assert!(c["reference_blocks"].as_u64().unwrap_or(0) > 0, "{c}");
        assert_eq!(c["probe_errors"], 0, "{c}");
    }
    // The router really restarted from its snapshot, and resumed every stream.
    assert!(r["router_restarts"].as_u64().unwrap_or(0) >= 1);
    assert_eq!(r["router"]["resyncs"], 0, "{}", r["router"]);
    assert!(r["router"]["batches_replayed"].as_u64().unwrap_or(0) > 0);
    // Every worker restart was detected as one (at a checkpoint's heartbeat at the latest).
    assert!(r["worker_restarts"].as_u64().unwrap_or(0) >= 1);
    assert_eq!(
        r["router"]["publisher_restarts_detected"], r["worker_restarts"],
        "{}",
        r["router"]
    );
    let restores = r["router_restore"].as_array().unwrap();
    assert!(
        restores
            .iter()
            .all(|l| l.as_str().is_some_and(|l| l.contains("restored"))),
        "{restores:?}"
    );
    assert!(out.status.success(), "the soak failed:\n{stderr}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.ends_with("</svg>\n"));
    eprintln!("report: {}", json.display());
}
