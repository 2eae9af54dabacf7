//! `kvengine --cores N` starts the shards, stays up, and stops cleanly on a signal.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a running `kvengine` has printed so far.
struct Printed(Arc<Mutex<String>>);

impl Printed {
    /// Waits until the output contains `needle` (true), or `timeout` passes (false): a
    /// loaded machine may take a while, and a fixed sleep would make the test flaky.
    fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.0.lock().unwrap().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "{needle:?} not printed; so far:\n{}",
            self.0.lock().unwrap()
        );
        false
    }
}

fn serve_until(signal: &str, args: &[&str], env: &[(&str, &str)]) -> (String, bool) {
    let served = serve(signal, args, env, &[]);
    (served.stdout, served.ok)
}

/// What a `kvengine` run printed, and whether it exited cleanly.
struct Served {
    stdout: String,
    stderr: String,
    ok: bool,
}

/// Runs `kvengine args` with `env` set and `unset` removed until it says it is up, checks it
/// stays up, stops it with `signal` and collects its output.
fn serve(signal: &str, args: &[&str], env: &[(&str, &str)], unset: &[&str]) -> Served {
    serve_with(signal, args, env, unset, &|_, _| {})
}

/// [`serve`], calling `meanwhile(pid, printed)` once it is up, before stopping it.
fn serve_with(
    signal: &str,
    args: &[&str],
    env: &[(&str, &str)],
    unset: &[&str],
    meanwhile: &dyn Fn(u32, &Printed),
) -> Served {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvengine"));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    for k in unset {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let err = child.stderr.take().unwrap();
    // Drained on its own thread, so a chatty log never blocks the process.
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(err), &mut s).unwrap();
        s
    });
    let mut text = String::new();
    // Wait until it says it is up and waiting.
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "exited early: {text}"
        );
        text.push_str(&line);
        if line.contains("Ctrl-C stops") {
            break;
        }
    }
    // Still running: it stays up (and has time to log what it logs at start).
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "kvengine did not stay up"
    );
    // The rest of stdout is read on its own thread, so `meanwhile` can watch it.
    let printed = Arc::new(Mutex::new(text));
    let reader = {
        let printed = printed.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            while out.read_line(&mut line).unwrap_or(0) > 0 {
                printed.lock().unwrap().push_str(&line);
                line.clear();
            }
        })
    };
    meanwhile(child.id(), &Printed(printed.clone()));
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    reader.join().unwrap();
    let text = std::mem::take(&mut *printed.lock().unwrap());
    let ok = child.wait().unwrap().success();
    Served {
        stdout: text,
        stderr: stderr.join().unwrap(),
        ok,
    }
}

#[test]
fn serves_until_sigint_with_cores_flag() {
    let (out, ok) = serve_until(
        "-INT",
        &["--cores", "3", "--no-pin", "--http-port", "0"],
        &[],
    );
    assert!(ok, "{out}");
    assert!(out.contains("3 core thread(s) up"), "{out}");
    assert!(
        out.contains("HTTP and ingest run on the core threads"),
        "{out}"
    );
    assert_eq!(out.matches("applied 0 block ops").count(), 3, "{out}");
    assert!(out.contains("kvengine: stopped"), "{out}");
}

#[test]
fn serves_until_sigterm_with_env_vars() {
    let env = [
        ("KVENGINE_CORES", "2"),
        ("KVENGINE_REPLICATE_DEPTH", "8"),
        ("KVENGINE_HTTP_PORT", "0"),
        ("KVENGINE_HTTP_HOST", "127.0.0.1"),
    ];
    let (out, ok) = serve_until("-TERM", &["serve"], &env);
    assert!(ok, "{out}");
    assert!(out.contains("2 core thread(s) up"), "{out}");
    assert!(out.contains("replicate depth 8 blocks"), "{out}");
}

#[test]
fn serves_with_http_on_threads_of_its_own_when_asked() {
    let (out, ok) = serve_until(
        "-INT",
        &[
            "--cores",
            "2",
            "--no-pin",
            "--http-port",
            "0",
            "--http-threads",
            "1",
        ],
        &[],
    );
    assert!(ok, "{out}");
    assert!(out.contains("2 core thread(s) up"), "{out}");
    assert!(!out.contains("run on the core threads"), "{out}");
    assert_eq!(out.matches("applied 0 block ops").count(), 2, "{out}");
}

#[test]
fn a_port_in_use_is_refused_not_shared() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args([
            "--cores",
            "2",
            "--no-pin",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            &port,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--http-port"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_cores_exit_non_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["--cores", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cores"));
}

/// `--log-format json` writes one JSON object per stderr line, and `RUST_LOG` sets the
/// filter when `KVENGINE_LOG` is absent: here only `sim::server`'s lines pass, so the
/// subscription line the router logs at the same level (`transport::zmq`) must not appear.
#[test]
fn json_logs_and_rust_log_are_honoured() {
    let args = [
        "--log-format",
        "json",
        "--sim-workers",
        "1",
        "--cores",
        "1",
        "--no-pin",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
    ];
    let env = [("RUST_LOG", "off,sim::server=info")];
    let served = serve("-INT", &args, &env, &["KVENGINE_LOG"]);
    assert!(served.ok, "{}", served.stdout);
    let logs = served.stderr;
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|v| v["target"] == "sim::server"
            && v["level"] == "INFO"
            && v["fields"]["message"] == "simulated worker up"),
        "{logs}"
    );
    assert!(
        lines.iter().all(|v| v["target"] == "sim::server"),
        "RUST_LOG let other targets through: {logs}"
    );
}

/// Dynamo's environment names (`DYN_*`) configure the router when kvengine's own are
/// absent, and `KVENGINE_KV_EVENTS=false` turns KV events off.
#[test]
fn dynamo_env_names_and_kv_events_false_are_honoured() {
    let env = [
        ("DYN_ROUTER_MODE", "round-robin"),
        ("DYN_HTTP_PORT", "0"),
        ("DYN_HTTP_HOST", "127.0.0.1"),
        ("KVENGINE_KV_EVENTS", "false"),
        ("KVENGINE_CORES", "1"),
    ];
    let (out, ok) = serve_until("-INT", &["--no-pin"], &env);
    assert!(ok, "{out}");
    assert!(
        out.contains("routing mode round-robin without KV events (approximate)"),
        "{out}"
    );
    assert!(out.contains("http://127.0.0.1:"), "{out}");
    // kvengine's own name wins over Dynamo's.
    let env = [
        ("DYN_ROUTER_MODE", "round-robin"),
        ("KVENGINE_ROUTER_MODE", "random"),
        ("KVENGINE_HTTP_PORT", "0"),
        ("KVENGINE_CORES", "1"),
    ];
    let (out, ok) = serve_until("-INT", &["--no-pin"], &env);
    assert!(ok, "{out}");
    assert!(out.contains("routing mode random; Ctrl-C stops"), "{out}");
    // Dynamo's current flag names beside the older ones.
    let args = [
        "--no-pin",
        "--cores",
        "1",
        "--http-port",
        "0",
        "--router-kv-overlap-score-weight",
        "2.5",
        "--no-router-kv-events",
    ];
    let (out, ok) = serve_until("-INT", &args, &[]);
    assert!(ok, "{out}");
    assert!(out.contains("without KV events (approximate)"), "{out}");
}

/// `--config FILE`: settings by flag name (a flag on the command line still wins) and
/// `[[workers]]`, vLLM's `--kv-events-config` taken as is; unknown names refuse to start.
#[test]
fn a_config_file_sets_flags_and_workers() {
    let dir = std::env::temp_dir().join(format!("kvengine-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvengine.toml");
    std::fs::write(
        &path,
        r#"
router-mode = "round-robin"
http-host = "127.0.0.1"
http_port = 0
cores = 1
no-pin = true
tokenizer = "stand-in"

[[workers]]
id = 7
url = "http://127.0.0.1:9"
api_key = "sk-7"

[[workers]]
id = 8
url = "http://127.0.0.1:9/"
kv_events_config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5999", "replay_endpoint": "tcp://*:5998", "topic": "kv-events"}'
"#,
    )
    .unwrap();
    let path_s = path.to_str().unwrap();
    let (out, ok) = serve_until("-INT", &["--config", path_s], &[]);
    assert!(ok, "{out}");
    assert!(out.contains("routing mode round-robin"), "{out}");
    assert!(out.contains("1 core thread(s) up"), "{out}");
    assert!(out.contains("worker 7 from the config file\n"), "{out}");
    assert!(
        out.contains("worker 8 from the config file, KV events from tcp://127.0.0.1:5999"),
        "{out}"
    );
    // SIGHUP reloads the workers: 8 left the file, 9 joined; 7 stays as it was.
    let reloaded = std::fs::read_to_string(&path)
        .unwrap()
        .replace("id = 8", "id = 9");
    let served = serve_with("-INT", &["--config", path_s], &[], &[], &|pid, printed| {
        std::fs::write(&path, &reloaded).unwrap();
        Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap();
        assert!(printed.wait_for("reloaded 2 worker(s)", Duration::from_secs(20)));
    });
    let out = served.stdout;
    assert!(served.ok, "{out}");
    assert!(
        out.contains("worker 8 left the config file; removed"),
        "{out}"
    );
    assert!(
        out.contains("worker 9 from the config file, KV events from tcp://127.0.0.1:5999"),
        "{out}"
    );
    assert!(out.contains("reloaded 2 worker(s)"), "{out}");
    // Registered at start and again by the reload (a poll that saw the new file first may
    // add one more; registering it again changes nothing).
    assert!(
        out.matches("worker 7 from the config file").count() >= 2,
        "{out}"
    );
    // A changed file is reloaded without a signal (a ConfigMap update sends none).
    let changed = reloaded.replace("id = 9", "id = 10");
    let served = serve_with("-INT", &["--config", path_s], &[], &[], &|_, printed| {
        std::fs::write(&path, &changed).unwrap();
        assert!(printed.wait_for("reloaded 2 worker(s)", Duration::from_secs(20)));
    });
    let out = served.stdout;
    assert!(served.ok, "{out}");
    assert!(out.contains("kvengine.toml changed"), "{out}");
    assert!(
        out.contains("worker 9 left the config file; removed")
            && out.contains("worker 10 from the config file, KV events from"),
        "{out}"
    );
    std::fs::write(&path, &reloaded).unwrap();
    // The command line beats the file.
    let (out, ok) = serve_until(
        "-INT",
        &["--config", path_s, "--router-mode", "random"],
        &[],
    );
    assert!(ok, "{out}");
    assert!(out.contains("routing mode random"), "{out}");

    std::fs::write(&path, "router-mod = \"kv\"\n").unwrap();
    let done = Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["--config", path_s])
        .output()
        .unwrap();
    assert!(!done.status.success());
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(
        err.contains("unknown settings") && err.contains("router-mod"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
