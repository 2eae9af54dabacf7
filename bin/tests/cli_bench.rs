//! `kvengine bench indexer` runs the harness end to end on the threaded runtime.

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
