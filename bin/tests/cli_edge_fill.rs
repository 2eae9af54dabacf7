//! The edge fills cores in order (`--edge-fill`, `transport::http::placement`): through the
//! binary, connections the kernel gave to another core's listener are handed to core 0
//! while it is idle, and `--edge-fill 0` leaves them where they landed.

mod common;

use common::Router;

/// Sequential connections, each answered: with two or more cores the kernel gives some of
/// them to a listener other than core 0's (all 16 to core 0's: 2^-16 with two cores).
const CONNECTIONS: usize = 16;

fn handed_after_connections(args: &[&str]) -> f64 {
    let r = Router::start(args);
    for _ in 0..CONNECTIONS {
        let (status, body) = r.call("GET", "/health", "");
        assert_eq!(status, 200, "{body}");
    }
    r.metric("kvengine_http_connections_handed_total")
        .expect("the handed counter is on /metrics")
}

#[test]
fn idle_cores_hand_their_connections_to_core_0() {
    let handed = handed_after_connections(&["--sim-workers", "1"]);
    assert!(handed >= 1.0, "handed {handed}");
}

#[test]
fn edge_fill_0_leaves_each_connection_on_the_core_that_accepted_it() {
    let handed = handed_after_connections(&["--sim-workers", "1", "--edge-fill", "0"]);
    assert_eq!(handed, 0.0);
}

#[test]
fn an_edge_fill_outside_0_to_1_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvengine"))
        .args(["--edge-fill", "1.5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a share between 0 and 1"), "{err}");
}
