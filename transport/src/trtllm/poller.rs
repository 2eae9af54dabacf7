//! One task per TensorRT-LLM worker: `POST {url}/kv_cache_events` every poll interval, and
//! at once when a request finishes on the worker ([`crate::hub::FinishWakeups`]); each answer is fenced
//! and applied by [`WorkerEvents`].
//!
//! # Invariants
//! 1. One poll at a time per worker, so pages apply in the order the server drained them.
//! 2. A failed poll (connection refused, a failed TLS handshake, no whole answer within
//!    [`POLL_TIMEOUT`], non-2xx, an answer over [`MAX_PAGE_BYTES`] (counted, see
//!    [`crate::outbound::body`]), or not a JSON array) is logged once per outage and
//!    retried next tick; the stream shows `connecting` until a poll succeeds. The server still holds
//!    what it did not hand out, so nothing is lost unless its buffer overflows, which the
//!    next page's ids reveal.
//! 3. Nothing stops the task but aborting it; on abort the worker's wake-up is removed.

#[cfg(doc)]
use super::MAX_PAGE_BYTES;
use super::apply::WorkerEvents;
use super::decode_page;
use super::source::TrtllmSource;
use crate::hub::{Hub, StreamState};
use crate::metrics::Metrics;
use crate::outbound::body::BodyKind;
use crate::outbound::{Outbound, WorkerClient, fetch};
use bytes::Bytes;
use http_body_util::Full;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// The longest a poll may take, answer and all, before it counts as failed.
pub const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts `source`'s poller on the runtime `on` (with the edge on the cores: the worker's
/// home core, so its pages are applied on one thread), polling through a client of
/// `outbound`. The worker must be registered first.
pub fn spawn_poller_on(
    on: &tokio::runtime::Handle,
    hub: Arc<Hub>,
    source: TrtllmSource,
    outbound: &Outbound,
) -> JoinHandle<()> {
    let client = outbound.client(
        source
            .poll_interval
            .saturating_mul(4)
            .max(Duration::from_secs(2)),
    );
    let resume = hub.persisted().take_resume(source.worker);
    on.spawn(async move {
        let events = match resume {
            Some(r) => WorkerEvents::resume(&hub, source.worker, r.last_seq, &r.ranks),
            None => WorkerEvents::new(source.worker),
        };
        let _unregister = Unregister {
            hub: hub.clone(),
            worker: source.worker,
        };
        run(hub, source, events, client).await;
    })
}

/// Starts `source`'s poller on the current runtime.
pub fn spawn_poller(hub: Arc<Hub>, source: TrtllmSource, outbound: &Outbound) -> JoinHandle<()> {
    spawn_poller_on(&tokio::runtime::Handle::current(), hub, source, outbound)
}

/// Removes the worker's wake-up when the task ends (or is aborted).
struct Unregister {
    hub: Arc<Hub>,
    worker: engine::WorkerId,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.hub.routing().finish_wakeups().unregister(self.worker);
    }
}

async fn run(hub: Arc<Hub>, source: TrtllmSource, mut events: WorkerEvents, client: WorkerClient) {
    let worker = source.worker;
    let wake = hub.routing().finish_wakeups().register(worker);
    let uri: hyper::Uri = match source.url.join("/kv_cache_events") {
        Ok(u) => u,
        Err(e) => {
            tracing::error!(worker = %worker, url = %source.url, "cannot poll: {e}");
            return;
        }
    };
    hub.registry().note_stream(worker, StreamState::Connecting);
    // Whether the last poll succeeded (None: none yet): state changes are logged once.
    let mut reachable: Option<bool> = None;
    tracing::info!(worker = %worker, url = %source.events_url(),
        interval_ms = source.poll_interval.as_millis() as u64, "polling TensorRT-LLM KV events");
    loop {
        match poll(&client, &uri, hub.metrics()).await {
            Ok(body) => {
                if reachable != Some(true) {
                    tracing::info!(worker = %worker, "TensorRT-LLM KV events reachable");
                    hub.registry().note_stream(worker, StreamState::Subscribed);
                }
                reachable = Some(true);
                match decode_page(&body) {
                    Ok(page) => events.apply_page(&hub, page),
                    Err(e) => {
                        hub.metrics().drop_input(
                            e.reason(),
                            1,
                            &format_args!("worker {worker}: /kv_cache_events: {e}"),
                        );
                    }
                }
            }
            Err(e) => {
                if reachable != Some(false) {
                    tracing::warn!(worker = %worker, url = %source.events_url(),
                        "cannot poll KV events, retrying: {e}");
                    hub.registry().note_stream(worker, StreamState::Connecting);
                }
                reachable = Some(false);
            }
        }
        // A request that finished meanwhile asks for the next poll at once.
        tokio::select! {
            () = tokio::time::sleep(source.poll_interval) => {}
            () = wake.notified() => {}
        }
    }
}

/// One drain: the answer's body, or why there is none.
async fn poll(client: &WorkerClient, uri: &hyper::Uri, metrics: &Metrics) -> Result<Bytes, String> {
    let request = hyper::Request::post(uri.clone())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let kind = BodyKind::KvCacheEvents;
    match fetch(client, request, kind, POLL_TIMEOUT, &metrics.worker_answers).await {
        Ok((status, body)) if status.is_success() => Ok(body),
        Ok((status, _)) => Err(format!("status {status}")),
        Err(e) => Err(e.to_string()),
    }
}
