//! Load scraped from the workers' own `/metrics` pages by the health loop: a vLLM page with
//! two data-parallel engines sets both ranks' load; a worker without a page stays healthy
//! and is counted; a page naming unknown ranks adds none.

mod common;

use axum::Router;
use axum::routing::get;
use engine::sched::WorkerLoad;
use engine::{DpRank, WorkerId};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use transport::http::health::health_loop;
use transport::hub::{Hub, Registration};

/// A worker answering `/health`, and `/metrics` with `page` when given.
async fn worker(page: Option<&'static str>) -> String {
    let mut app = Router::new().route("/health", get(|| async { "ok" }));
    if let Some(page) = page {
        app = app.route("/metrics", get(move || async move { page }));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

fn reported(hub: &Hub, worker: u64) -> Vec<(DpRank, Option<WorkerLoad>)> {
    hub.workers()
        .into_iter()
        .find(|w| w.registration.worker == WorkerId(worker))
        .map(|w| w.loads.into_iter().map(|(r, _, load)| (r, load)).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_loop_reads_each_ranks_load_from_the_workers_page() {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    let vllm = worker(Some(include_str!("data/metrics/vllm_v1_dp2.txt"))).await;
    let sglang = worker(Some(include_str!("data/metrics/sglang.txt"))).await;
    let silent = worker(None).await;
    hub.register(Registration {
        url: Some(vllm),
        dp_ranks: vec![DpRank(0), DpRank(1)],
        ..Registration::new(WorkerId(1))
    })
    .unwrap();
    hub.register(Registration {
        url: Some(sglang),
        ..Registration::new(WorkerId(2))
    })
    .unwrap();
    hub.register(Registration {
        url: Some(silent),
        ..Registration::new(WorkerId(3))
    })
    .unwrap();
    let task = tokio::spawn(health_loop(
        hub.clone(),
        Duration::from_millis(20),
        Duration::from_secs(2),
        1,
        Default::default(),
    ));
    let mut tries = 0;
    while hub.metrics().load_scrape_failures.load(Relaxed) < 2
        || reported(&hub, 2).iter().any(|(_, l)| l.is_none())
    {
        tries += 1;
        assert!(tries < 500, "no scrape in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    let load = |w, kv_usage| {
        Some(WorkerLoad {
            num_requests_waiting: w,
            kv_usage,
        })
    };
    assert_eq!(
        reported(&hub, 1),
        vec![
            (DpRank(0), load(3, 0.8731501057082452)),
            (DpRank(1), load(0, 0.41289640591966175))
        ]
    );
    assert_eq!(reported(&hub, 2), vec![(DpRank(0), load(5, 0.56))]);
    // No page: no load, still healthy, counted.
    assert_eq!(reported(&hub, 3), vec![(DpRank(0), None)]);
    assert!(hub.workers().iter().all(|w| w.healthy));
    assert!(hub.metrics().load_scrapes.load(Relaxed) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_naming_unknown_ranks_adds_none() {
    let (hub, runtime) = common::hub(1);
    std::mem::forget(runtime);
    // The dp=2 page, for a worker registered with rank 0 only.
    let url = worker(Some(include_str!("data/metrics/vllm_v1_dp2.txt"))).await;
    hub.register(Registration {
        url: Some(url),
        ..Registration::new(WorkerId(7))
    })
    .unwrap();
    let hub2: Arc<Hub> = hub.clone();
    let task = tokio::spawn(health_loop(
        hub2,
        Duration::from_millis(20),
        Duration::from_secs(2),
        1,
        Default::default(),
    ));
    let mut tries = 0;
    while reported(&hub, 7).iter().all(|(_, l)| l.is_none()) {
        tries += 1;
        assert!(tries < 500, "no scrape in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    let ranks: Vec<DpRank> = reported(&hub, 7).into_iter().map(|(r, _)| r).collect();
    assert_eq!(ranks, vec![DpRank(0)]);
}
