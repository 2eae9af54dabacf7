//! A router's overhead as a proxy: the most tiny requests per second it relays.
//!
//! `connections` closed loops, each on a connection of its own, send
//! `POST /v1/completions` (a two-word prompt, `max_tokens` 1, not streamed) for `duration`
//! and count the answers. The workers behind do almost nothing for such a request, so the
//! figure is the router's (and the client's, the same for every router).
//!
//! # Invariants
//! 1. Only answers with a 2xx status and a complete body count; every other outcome is
//!    counted in [`Overhead::errors`].

use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use std::time::{Duration, Instant};

/// What one overhead run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Overhead {
    /// Closed loops (connections).
    pub connections: usize,
    /// Answers per second.
    pub requests_per_s: f64,
    /// Latency percentiles of the answers, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Requests that failed (invariant 1).
    pub errors: u64,
}

const BODY: &str = r#"{"model":"kvengine-sim","prompt":"tiny request","max_tokens":1}"#;

/// Runs `connections` closed loops against `base_url` for `duration`.
pub async fn measure(base_url: &str, connections: usize, duration: Duration) -> Overhead {
    let url = format!("{}/v1/completions", base_url.trim_end_matches('/'));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let mut loops = Vec::with_capacity(connections);
    for _ in 0..connections {
        let url = url.clone();
        loops.push(tokio::spawn(async move {
            // One pooled connection per loop: a closed loop never has two requests out.
            let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build_http();
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
            let (mut ok, mut errors) = (0u64, 0u64);
            while Instant::now() < deadline {
                let sent = Instant::now();
                let req = hyper::Request::post(url.as_str())
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from_static(BODY.as_bytes())));
                let Ok(req) = req else {
                    errors += 1;
                    continue;
                };
                let answered = match client.request(req).await {
                    Ok(resp) if resp.status().is_success() => {
                        resp.into_body().collect().await.is_ok()
                    }
                    Ok(resp) => {
                        let _ = resp.into_body().collect().await;
                        false
                    }
                    Err(_) => false,
                };
                if answered {
                    ok += 1;
                    if let Some(h) = hist.as_mut() {
                        let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                        let _ = h.record(us.max(1));
                    }
                } else {
                    errors += 1;
                }
            }
            (ok, errors, hist)
        }));
    }
    let mut total = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
    let (mut ok, mut errors) = (0u64, 0u64);
    for l in loops {
        match l.await {
            Ok((o, e, h)) => {
                ok += o;
                errors += e;
                if let (Some(t), Some(h)) = (total.as_mut(), h.as_ref()) {
                    let _ = t.add(h);
                }
            }
            Err(_) => errors += 1,
        }
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let q = |p: f64| {
        total
            .as_ref()
            .filter(|t| !t.is_empty())
            .map_or(0.0, |t| t.value_at_quantile(p) as f64 / 1000.0)
    };
    Overhead {
        connections,
        requests_per_s: ok as f64 / secs,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        errors,
    }
}
