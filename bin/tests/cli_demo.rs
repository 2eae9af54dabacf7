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
        &["demo", "--requests", "150", "--json", json_arg],
        &[("KVENGINE_WORKERS", "4")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 workers x 1 dp ranks"), "{stdout}");
    for mode in ["kv ", "round-robin ", "random "] {
        assert!(
            stdout.lines().any(|l| l.starts_with(mode)),
            "no {mode}row:\n{stdout}"
        );
    }
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["workers"], 4);
    let modes = doc["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 3);
    for m in modes {
        assert_eq!(m["requests"], 150);
        assert_eq!(m["events_rejected"], 0);
    }
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
        (
            &["demo", "--workers", "4096", "--dp-ranks", "2"],
            &[],
            "workers",
        ),
    ];
    for (args, env, needle) in cases {
        let out = kvengine(args, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}
