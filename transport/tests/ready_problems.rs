//! `/ready` over a real socket names the workers kv routing cannot see (issue 28): a worker
//! whose events carry another block size is not usable; the router stays ready while another
//! worker is, says which one is not and why, and is unready when none is.

mod common;

use engine::WorkerId;
use serde_json::Value;
use transport::hub::Registration;

async fn ready(base: &str) -> (u16, Value) {
    let (status, _, body) = common::raw_request(base, "GET", "/ready", "", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    (status, v)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_config_error_is_named_and_not_usable() {
    let (hub, _runtime) = common::hub(2);
    for id in [1, 2] {
        hub.register(Registration::new(WorkerId(id))).unwrap();
    }
    let (base, _stop) = common::http_server(hub.clone(), Default::default()).await;
    let (status, v) = ready(&base).await;
    assert_eq!(status, 200, "{v}");
    assert!(strings(&v["problems"]).is_empty(), "{v}");

    let why = "worker publishes blocks of 32 tokens; this router uses 16 \
               (set --kv-cache-block-size to match)";
    assert!(
        hub.registry()
            .note_config_error(WorkerId(2), why.to_owned())
    );
    let (status, v) = ready(&base).await;
    assert_eq!(status, 200, "worker 1 still routes: {v}");
    assert_eq!(
        strings(&v["problems"]),
        vec![format!("worker 2: its KV events cannot be applied: {why}")]
    );
    assert_eq!(v["workers"]["config_errors"], 1);
    let (_, _, workers) = common::raw_request(&base, "GET", "/v1/workers", "", "").await;
    assert!(workers.contains("blocks of 32 tokens"), "{workers}");

    // With the only usable worker gone, the router cannot route by cache: not ready.
    assert!(
        hub.registry()
            .note_config_error(WorkerId(1), why.to_owned())
    );
    let (status, v) = ready(&base).await;
    assert_eq!(status, 503, "{v}");
    let reasons = strings(&v["reasons"]);
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("2 with a configuration error")),
        "{reasons:?}"
    );
    assert_eq!(strings(&v["problems"]).len(), 2, "{v}");
}
