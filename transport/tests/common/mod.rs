//! Setup shared by the transport tests: a real engine behind a hub, and an HTTP edge on a
//! free port. Each test crate uses what it needs.
#![allow(dead_code)]

use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use std::sync::Arc;
use transport::http::{HttpConfig, router, serve_http};
use transport::hub::{Hub, HubConfig, start_engine};

/// A hub over an unpinned engine of `cores` shards (blocks shallower than 2 replicated),
/// with two ingest and two query handles.
pub fn hub(cores: usize) -> (Arc<Hub>, Runtime) {
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let (hub, runtime) = start_engine(config, cores, 2, engine).unwrap();
    (Arc::new(hub), runtime)
}

/// Serves the HTTP edge over `hub` on a free loopback port; returns its base URL and the
/// sender that stops it (dropping the sender stops it too). The engine threads stop when
/// the hub's last holder goes; HTTP tests do not wait for them.
pub async fn http_server(
    hub: Arc<Hub>,
    cfg: HttpConfig,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(hub, cfg);
    tokio::spawn(async move {
        serve_http(listener, app, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    (format!("http://{addr}"), tx)
}
