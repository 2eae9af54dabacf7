//! `kvengine demo` as a user runs it: the real binary, its exit status and its output.

use std::process::{Command, Output};

fn kvengine(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvengine"));
    cmd.args(args);
    // A developer's own KVENGINE_* settings must not leak into the test.
    for (k, _) in std::env::vars() {
        if k.starts_with("KVENGINE_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("the kvengine binary runs")
}

#[test]
fn demo_prints_a_row_per_mode_and_writes_json() {
    let json = std::env::temp_dir().join(format!("kvengine-demo-{}.json", std::process::id()));
    let json_arg = json.to_str().expect("temp path is UTF-8");
    let out = kvengine(
        &["demo", "--requests", "40", "--json", json_arg],
        &[("KVENGINE_WORKERS", "2"), ("KVENGINE_SPEEDUP", "20")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("2 workers"), "{stdout}");
    // Every mode `all` stands for has its row.
    for mode in lab::replay::RunMode::ALL.map(|m| format!("{} ", m.as_str())) {
        assert!(
            stdout.lines().any(|l| l.starts_with(&mode)),
            "no {mode}row:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("TTFT p50") && stdout.contains("load spread"),
        "{stdout}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["workers"], 2);
    let modes = doc["modes"].as_array().unwrap();
    assert_eq!(modes.len(), lab::replay::RunMode::ALL.len());
    for m in modes {
        assert_eq!(m["requests"], 40);
        assert_eq!(m["errors"], 0);
        assert_eq!(m["router_active_after"], 0);
    }
    assert!(modes[0]["cache_hit_rate"].as_f64().unwrap() > 0.0);
}

#[test]
fn demo_runs_one_mode_from_the_environment() {
    let out = kvengine(
        &["demo", "--requests", "10"],
        &[
            ("KVENGINE_MODES", "kv-no-events"),
            ("KVENGINE_WORKERS", "2"),
            ("KVENGINE_SPEEDUP", "20"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    // The table: the header, then one row per mode up to a blank line.
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("mode "))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(rows[0].starts_with("kv-no-events "), "{stdout}");
}

#[test]
fn bad_flags_and_env_vars_exit_non_zero_with_a_message() {
    /// Arguments, environment, and a word the error message must contain.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case<'_>; 4] = [
        (&["demo", "--workers", "0"], &[], "--workers"),
        (&["demo"], &[("KVENGINE_MODES", "kv,fastest")], "fastest"),
        (
            &["demo", "--trace", "/nonexistent/trace.jsonl"],
            &[],
            "--trace",
        ),
        (&["demo", "--workers", "4096"], &[], "--workers"),
    ];
    for (args, env, needle) in cases {
        let out = kvengine(args, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}
