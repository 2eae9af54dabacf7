//! Router replicas on a real NATS server (issue 15): three `kvengine` processes in front of
//! the same simulated workers, a client spreading requests over them, then a replica and
//! NATS killed in turn. Every replica must count the whole cluster's load while NATS is up,
//! drop a dead replica's load within its timeout, and keep routing on its own load while
//! NATS is down.
//!
//! Needs `nats-server` (see `lab::nats`); without one the test says why and
//! passes, unless `KVENGINE_NATS_REQUIRED=1` (CI installs it and sets that).

mod common;

use common::{Router, Sims, eventually};
use lab::nats::{NatsServer, binary_or_skip};
use std::time::Duration;

fn nats_or_skip() -> Option<NatsServer> {
    binary_or_skip("the replica test")?;
    Some(NatsServer::start().unwrap())
}

fn replica(nats: &str, name: &str, sims: &Sims) -> Router {
    let mut args = vec![
        "--replica-nats",
        nats,
        "--replica-name",
        name,
        "--replica-heartbeat-ms",
        "100",
        "--replica-timeout-ms",
        "1000",
        "--tokenizer",
        "stand-in",
    ];
    for f in &sims.flags {
        args.extend(["--zmq-worker", f.as_str()]);
    }
    Router::start(&args)
}

/// Every worker's active load as one replica counts it: `(series, value)` sorted.
fn loads(r: &Router) -> Vec<(String, u64)> {
    let (_, text) = r.call("GET", "/metrics", "");
    let mut out: Vec<(String, u64)> = text
        .lines()
        .filter(|l| {
            l.starts_with("kvengine_worker_active_requests{")
                || l.starts_with("kvengine_worker_active_blocks{")
                || l.starts_with("kvengine_worker_active_prefill_tokens{")
        })
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            Some((series.to_owned(), v.parse().ok()?))
        })
        .collect();
    out.sort();
    out
}

fn total_active(r: &Router) -> u64 {
    loads(r)
        .iter()
        .filter(|(s, _)| s.starts_with("kvengine_worker_active_requests{"))
        .map(|(_, v)| v)
        .sum()
}

fn all_agree(rs: &[&Router], active: u64) -> Result<(), String> {
    let first = loads(rs[0]);
    for r in rs {
        let l = loads(r);
        let t = total_active(r);
        if l != first || t != active {
            return Err(format!(
                "{} active ({active} expected); {l:?} vs {first:?}",
                t
            ));
        }
    }
    Ok(())
}

/// Routes a prompt of `blocks` 16-token blocks (distinct per `i`, sharing a 2-block
/// prefix) at `r`; returns its request id.
fn route(r: &Router, i: usize, blocks: usize) -> String {
    let tokens: Vec<String> = (0..blocks * 16)
        .map(|t| if t < 32 { t } else { t + 1000 * i }.to_string())
        .collect();
    let body = format!(r#"{{"token_ids": [{}]}}"#, tokens.join(","));
    let (status, answer) = r.call("POST", "/v1/route", &body);
    assert_eq!(status, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    v["request_id"].as_str().unwrap().to_owned()
}

fn ready_details(r: &Router) -> serde_json::Value {
    let (status, body) = r.call("GET", "/ready", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn replicas_share_load_and_survive_a_dead_replica_and_a_nats_outage() {
    let Some(mut nats) = nats_or_skip() else {
        return;
    };
    let url = nats.url();
    let sims = Sims::start(3);
    assert_eq!(sims.flags.len(), 3);
    let a = replica(&url, "a", &sims);
    let b = replica(&url, "b", &sims);
    let c = replica(&url, "c", &sims);
    eventually(20, "every replica ready, with 2 peers", || {
        for r in [&a, &b, &c] {
            let v = ready_details(r);
            if v["replicas"]["peers"] != 2 || v["replicas"]["load"] != "shared" {
                return Err(v["replicas"].to_string());
            }
        }
        Ok(())
    });

    // A client spreads 30 requests over the replicas, round robin.
    let rs = [&a, &b, &c];
    let mut routed: Vec<(usize, String)> = Vec::new();
    for i in 0..30 {
        let at = i % 3;
        routed.push((at, route(rs[at], i, 3 + i % 4)));
    }
    eventually(10, "every replica counts all 30 requests alike", || {
        all_agree(&rs, 30)
    });

    // Prefill and finish some at the replica that routed them: the others follow.
    for (at, id) in routed.iter().take(12) {
        let path = format!("/v1/requests/{id}/prefilled");
        assert_eq!(rs[*at].call("POST", &path, "").0 / 100, 2);
    }
    for (at, id) in routed.drain(..6) {
        let path = format!("/v1/requests/{id}");
        assert_eq!(rs[at].call("DELETE", &path, "").0 / 100, 2);
    }
    eventually(10, "frees and prefills reach every replica", || {
        all_agree(&rs, 24)
    });

    // A replica dies: its 8 requests leave the others' load within its timeout.
    let c_left = routed.iter().filter(|(at, _)| *at == 2).count() as u64;
    assert_eq!(c_left, 8);
    c.kill9();
    let rs = [&a, &b];
    eventually(10, "the dead replica's load is dropped", || {
        all_agree(&rs, 24 - c_left)
    });
    routed.retain(|(at, _)| *at != 2);

    // NATS dies: both keep routing, on their own load only, and say so.
    nats.kill();
    eventually(10, "NATS outage seen", || {
        for r in rs {
            let v = ready_details(r);
            if v["replicas"]["load"] != "local_only" {
                return Err(v["replicas"].to_string());
            }
        }
        Ok(())
    });
    let own = |r: usize| routed.iter().filter(|(at, _)| *at == r).count() as u64;
    eventually(5, "each replica counts only its own requests", || {
        for (i, r) in rs.iter().enumerate() {
            if total_active(r) != own(i) {
                return Err(format!("replica {i}: {} != {}", total_active(r), own(i)));
            }
        }
        Ok(())
    });
    for i in 100..104 {
        let at = i % 2;
        routed.push((at, route(rs[at], i, 3)));
    }
    assert!(a.metric("kvengine_replica_outages_total").unwrap() >= 1.0);

    // NATS is back: states are exchanged and the replicas agree again, on everything,
    // including what was routed during the outage.
    nats.restart().unwrap();
    let n = routed.len() as u64;
    eventually(20, "the replicas agree again after NATS returns", || {
        all_agree(&rs, n)
    });
    for r in rs {
        assert_eq!(ready_details(r)["replicas"]["load"], "shared");
        assert!(r.metric("kvengine_replica_states_sent_total").unwrap() >= 1.0);
    }
}

fn prompt(i: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|t| t + 10_000 * i).collect()
}

fn overlap(r: &Router, tokens: &[u32]) -> serde_json::Value {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let (status, body) = r.call(
        "POST",
        "/v1/overlap",
        &format!(r#"{{"token_ids": [{}]}}"#, ids.join(",")),
    );
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["scores"].clone()
}

/// Waits until `r` indexes every prompt of `prompts`. A subscription that connected after
/// a worker's last batch learns of the batches it missed (and replays them) at that
/// worker's next batch, which a busy worker sends soon: each wait nudges both workers with
/// a fresh prompt.
fn indexed(r: &Router, sims: &Sims, prompts: &[Vec<u32>]) {
    let mut nudge = 1_000;
    eventually(20, "the workers' caches indexed", || {
        let seen: Vec<_> = prompts.iter().map(|p| overlap(r, p)).collect();
        if seen.iter().all(|s| s != &serde_json::json!([])) {
            return Ok(());
        }
        for w in 0..sims.urls.len() {
            nudge += 1;
            sims.serve(w, &prompt(nudge, 1));
        }
        std::thread::sleep(Duration::from_millis(200));
        Err(format!("{seen:?}"))
    });
}

#[test]
fn a_new_replica_starts_from_its_peers_snapshot_and_replays_from_its_marks() {
    let Some(nats) = nats_or_skip() else {
        return;
    };
    let url = nats.url();
    let sims = Sims::start(2);
    let mut args = vec![
        "--replica-nats",
        url.as_str(),
        "--replica-snapshot-interval-s",
        "1",
        "--tokenizer",
        "stand-in",
    ];
    for f in &sims.flags {
        args.extend(["--zmq-worker", f.as_str()]);
    }
    let a = Router::start(&args);
    assert!(
        a.out
            .contains("no snapshot in bucket kvengine-snapshots yet"),
        "{}",
        a.out
    );
    // The workers cache some prompts; A indexes them, then puts a snapshot.
    let before: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 4 + i)).collect();
    for (i, p) in before.iter().enumerate() {
        sims.serve(i % 2, p);
    }
    indexed(&a, &sims, &before);
    let puts = a
        .metric("kvengine_replica_snapshots_put_total")
        .unwrap_or(0.0);
    eventually(20, "A puts a snapshot with them", || {
        match a
            .metric("kvengine_replica_snapshots_put_total")
            .unwrap_or(0.0)
            >= puts + 1.0
        {
            true => Ok(()),
            false => Err("no new snapshot".into()),
        }
    });
    // What the workers cache after the snapshot must reach B too: through the replay
    // from the snapshot's marks, since B was not subscribed when it was published.
    let after: Vec<Vec<u32>> = (10..13).map(|i| prompt(i, 3)).collect();
    for (i, p) in after.iter().enumerate() {
        sims.serve(i % 2, p);
    }
    indexed(&a, &sims, &after);
    let b = Router::start(&args);
    let restored = b
        .out
        .lines()
        .find(|l| l.contains("from a peer replica's snapshot"))
        .unwrap_or_else(|| panic!("B did not restore from the peers' snapshot: {}", b.out));
    assert!(!restored.contains("restored 0 index"), "{restored}");
    eventually(
        20,
        "B holds what A holds, before and after the snapshot",
        || {
            for p in before.iter().chain(&after) {
                let (x, y) = (overlap(&a, p), overlap(&b, p));
                if x != y {
                    return Err(format!("A {x} vs B {y}"));
                }
            }
            Ok(())
        },
    );
    assert!(b.metric("kvengine_resyncs_total").unwrap_or(0.0) == 0.0);
}

// ---- Trust: secrets, MACs and --worker-hosts (issue 29, item 8) ----

const BUCKET: &str = "kvengine-snapshots";
/// A worker API key: it must never be in a snapshot's bytes.
const WORKER_KEY: &str = "kvtest-worker-key-0f9e8d7c";
const SECRET: &str = "kvtest-replica-secret-0123456789";

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// The bucket's latest object, as stored.
fn bucket_object(url: &str) -> Vec<u8> {
    let nats = transport::replicas::NatsAccess::new(url);
    block_on(transport::replicas::warm::fetch_raw(
        &nats,
        BUCKET,
        Duration::from_secs(10),
    ))
    .unwrap()
    .expect("a snapshot in the bucket")
    .to_vec()
}

/// Replaces the bucket's latest object with `bytes`.
fn put_object(url: &str, bytes: &[u8]) {
    block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        transport::replicas::warm::put(&client, BUCKET, bytes)
            .await
            .unwrap();
        client.flush().await.unwrap();
    });
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

fn workers(r: &Router) -> Vec<serde_json::Value> {
    let (status, body) = r.call("GET", "/v1/workers", "");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["workers"].as_array().unwrap().clone()
}

/// `kvengine_events_rejected_total{reason="unauthorized"}`.
fn unauthorized(r: &Router) -> f64 {
    let (_, text) = r.call("GET", "/metrics", "");
    text.lines()
        .find_map(|l| {
            l.strip_prefix(r#"kvengine_events_rejected_total{reason="unauthorized"} "#)?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// Waits until `r` has put a snapshot after the call (its count went up).
fn next_snapshot(r: &Router) {
    let puts = r
        .metric("kvengine_replica_snapshots_put_total")
        .unwrap_or(0.0);
    eventually(20, "a new snapshot in the bucket", || {
        match r
            .metric("kvengine_replica_snapshots_put_total")
            .unwrap_or(0.0)
            > puts
        {
            true => Ok(()),
            false => Err("none yet".into()),
        }
    });
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvengine-replica-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A worker's API key stays out of the snapshot a replica puts (and out of its own
/// snapshot file: the key file beside it keeps it), and a replica that starts from a peer's
/// snapshot registers only the workers its own `--worker-hosts` allows, without a key.
#[test]
fn peer_snapshots_carry_no_keys_and_their_workers_are_checked_again() {
    let Some(nats) = nats_or_skip() else {
        return;
    };
    let url = nats.url();
    let state = temp_dir("keys");
    let a = Router::start(&[
        "--replica-nats",
        &url,
        "--replica-snapshot-interval-s",
        "1",
        "--state-dir",
        state.to_str().unwrap(),
        "--snapshot-interval-s",
        "1",
        "--tokenizer",
        "stand-in",
    ]);
    for body in [
        format!(r#"{{"worker_id": 7, "url": "http://127.0.0.1:9", "api_key": "{WORKER_KEY}"}}"#),
        r#"{"worker_id": 8, "url": "http://outside.invalid:8000"}"#.to_owned(),
    ] {
        let (status, answer) = a.call("POST", "/v1/workers", &body);
        assert_eq!(status / 100, 2, "{answer}");
    }
    next_snapshot(&a);
    let object = bucket_object(&url);
    assert!(contains(&object, "127.0.0.1:9"), "the worker is in it");
    assert!(
        !contains(&object, WORKER_KEY),
        "the peers' snapshot holds a worker's API key"
    );
    // The router's own snapshot file: no key either; the key file keeps it, owner-only.
    eventually(20, "the state directory's snapshot and key file", || {
        let snap = std::fs::read(state.join("snapshot.kvs")).map_err(|e| e.to_string())?;
        let keys = std::fs::read(state.join("worker-keys.json")).map_err(|e| e.to_string())?;
        assert!(!contains(&snap, WORKER_KEY), "snapshot.kvs holds a key");
        match contains(&snap, "127.0.0.1:9") && contains(&keys, WORKER_KEY) {
            true => Ok(()),
            false => Err("not written yet".into()),
        }
    });
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(state.join("worker-keys.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o077,
            0,
            "the key file is the owner's only: {mode:o}"
        );
    }

    // B starts from A's snapshot, allowing only 127.0.0.1.
    let b = Router::start(&[
        "--replica-nats",
        &url,
        "--replica-snapshot-interval-s",
        "0",
        "--worker-hosts",
        "127.0.0.1",
        "--tokenizer",
        "stand-in",
    ]);
    assert!(
        b.out.contains("1 re-registered, 1 refused"),
        "B's restore: {}",
        b.out
    );
    let ws = workers(&b);
    assert_eq!(ws.len(), 1, "{ws:?}");
    assert_eq!(ws[0]["worker_id"], 7);
    assert_eq!(ws[0]["api_key"], false, "a key learnt from a peer: {ws:?}");

    // A restarted on its state directory gets its key back from its own key file.
    drop(b);
    drop(a);
    let a2 = Router::start(&[
        "--state-dir",
        state.to_str().unwrap(),
        "--tokenizer",
        "stand-in",
    ]);
    let ws = workers(&a2);
    let seven = ws.iter().find(|w| w["worker_id"] == 7).expect("worker 7");
    assert_eq!(seven["api_key"], true, "{ws:?}");
    drop(a2);
    let _ = std::fs::remove_dir_all(&state);
}

/// With `--replica-secret`, frames from a replica without it (or with another) are
/// refused and counted, never applied; a snapshot put without a MAC, or changed after it
/// was signed, is refused by a replica that starts; the genuine one is used.
#[test]
fn with_a_secret_unsigned_or_tampered_replica_state_is_refused() {
    let Some(nats) = nats_or_skip() else {
        return;
    };
    let url = nats.url();
    let sims = Sims::start(1);
    let base = |secret: Option<&str>, interval: &str, name: &str| {
        let mut args = vec![
            "--replica-nats".to_owned(),
            url.clone(),
            "--replica-name".into(),
            name.into(),
            "--replica-heartbeat-ms".into(),
            "100".into(),
            "--replica-timeout-ms".into(),
            "1000".into(),
            "--replica-snapshot-interval-s".into(),
            interval.into(),
            "--tokenizer".into(),
            "stand-in".into(),
        ];
        if let Some(s) = secret {
            args.extend(["--replica-secret".into(), s.to_owned()]);
        }
        for f in &sims.flags {
            args.extend(["--zmq-worker".into(), f.clone()]);
        }
        args
    };
    let start = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Router::start(&args)
    };
    let a = start(base(Some(SECRET), "1", "a"));
    assert!(a.out.contains("authenticated (HMAC-SHA256"), "{}", a.out);
    let plain = start(base(None, "0", "plain"));
    assert!(
        plain.out.contains("replica state is unauthenticated"),
        "{}",
        plain.out
    );
    let other = start(base(
        Some("another-secret-of-32-bytes-xxxxxx"),
        "0",
        "other",
    ));
    let b = start(base(Some(SECRET), "0", "b"));
    // A and B hear each other; neither hears the others, and both count what they drop.
    eventually(20, "A and B peers of each other only", || {
        for r in [&a, &b] {
            let v = ready_details(r);
            if v["replicas"]["peers"] != 1 {
                return Err(v["replicas"].to_string());
            }
            let n = r
                .metric("kvengine_replica_unauthenticated_total")
                .unwrap_or(0.0);
            if n < 2.0 || unauthorized(r) < 2.0 {
                return Err(format!("{n} unauthenticated so far"));
            }
        }
        Ok(())
    });
    // A request routed at the replica without the secret never counts at A.
    route(&plain, 1, 3);
    route(&a, 2, 3);
    eventually(10, "B counts A's request", || match total_active(&b) {
        1 => Ok(()),
        n => Err(format!("{n} active at B")),
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(total_active(&a), 1, "A counts only its own request");
    assert_eq!(ready_details(&plain)["replicas"]["peers"], 0);
    assert_eq!(ready_details(&other)["replicas"]["peers"], 0);

    // The snapshot A puts ends with its MAC; changed, or without it, it is refused.
    next_snapshot(&a);
    let signed = bucket_object(&url);
    drop(a);
    let mut tampered = signed.clone();
    let mid = tampered.len() / 2;
    tampered[mid] ^= 0x01;
    let unsigned = signed[..signed.len() - 32].to_vec();
    for (what, bytes) in [("tampered", &tampered), ("unsigned", &unsigned)] {
        put_object(&url, bytes);
        let c = start(base(Some(SECRET), "0", what));
        assert!(
            !c.out.contains("from a peer replica's snapshot"),
            "{what} snapshot used: {}",
            c.out
        );
        assert!(unauthorized(&c) >= 1.0, "{what}: not counted");
    }
    put_object(&url, &signed);
    let d = start(base(Some(SECRET), "0", "d"));
    assert!(
        d.out.contains("from a peer replica's snapshot"),
        "the genuine snapshot is used: {}",
        d.out
    );
}

/// `/ready`'s `replicas` details, whatever its status (no worker: 503).
fn replicas_of(r: &Router) -> serde_json::Value {
    let (_, body) = r.call("GET", "/ready", "");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["replicas"].clone()
}

/// A NATS server that wants a user and password: a replica given them in the URL connects
/// (and never shows them), one without them does not, and routes on its own load.
#[test]
fn nats_credentials_in_the_url_are_used_and_never_shown() {
    if binary_or_skip("the replica test").is_none() {
        return;
    }
    let nats = NatsServer::start_with(&["--user", "kvrouter", "--pass", "s3cret-pass"]).unwrap();
    let port = nats.url().rsplit(':').next().unwrap().to_owned();
    let start = |url: &str, name: &str| {
        Router::start(&[
            "--replica-nats",
            url,
            "--replica-name",
            name,
            "--replica-snapshot-bucket",
            "",
            "--tokenizer",
            "stand-in",
        ])
    };
    let with = start(
        &format!("nats://kvrouter:s3cret-pass@127.0.0.1:{port}"),
        "with",
    );
    let without = start(&format!("nats://127.0.0.1:{port}"), "without");
    assert!(!with.out.contains("s3cret-pass"), "{}", with.out);
    assert!(with.out.contains("nats://***@127.0.0.1"), "{}", with.out);
    eventually(20, "the replica with credentials connected", || {
        let v = replicas_of(&with);
        match v["connected"] == true {
            true => Ok(()),
            false => Err(v.to_string()),
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let v = replicas_of(&without);
    assert_eq!(v["connected"], false, "{v}");
    assert_eq!(v["load"], "local_only", "{v}");
}
