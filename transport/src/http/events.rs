//! `POST /v1/events`: a batch of JSON KV events for one worker rank, applied synchronously
//! with per-event results, optionally fenced by `seq`.
//!
//! Fencing (per worker rank, only for batches that carry `seq`):
//! * first batch seen, or `seq` equal to the next expected: apply;
//! * `seq` above the next expected (a gap): the rank is cleared and marked resyncing (HTTP
//!   has no replay), then the batch applies;
//! * `seq` 0 while a higher one is expected: the publisher restarted; the rank is cleared,
//!   then the batch applies;
//! * any other `seq` below the next expected: a duplicate (a client retry): skipped,
//!   counted as `duplicate_seq`.
//!
//! A batch consumes its number once it passes the fence, even if none of its events applied.

use super::errors::{ApiError, RejectedEvent, json};
use super::{AppState, RawBody, lock, malformed};
use crate::error::{DropReason, TransportError};
use crate::json_events::{parse_events_body, to_engine};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use engine::event::KvEvent;
use engine::{DpRank, WorkerId, WorkerKey};
use serde::Serialize;
use std::sync::atomic::Ordering::Relaxed;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum FenceOutcome {
    InOrder,
    Duplicate,
    Gap,
    Restart,
}

#[derive(Serialize)]
struct EventsResponse {
    applied: usize,
    rejected: usize,
    #[serde(skip_serializing_if = "is_zero")]
    skipped: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<FenceOutcome>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rejected_reasons: Vec<RejectedEvent>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

pub(super) async fn post_events(State(st): State<AppState>, body: RawBody) -> Response {
    let task = tokio::task::spawn_blocking(move || apply_batch(&st, &body.0));
    match task.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("event batch task failed: {e}"),
        )
        .into_response(),
    }
}

fn classify(next: Option<u64>, seq: u64) -> FenceOutcome {
    match next {
        None => FenceOutcome::InOrder,
        Some(n) if seq == n => FenceOutcome::InOrder,
        Some(n) if seq > n => FenceOutcome::Gap,
        Some(_) if seq == 0 => FenceOutcome::Restart,
        Some(_) => FenceOutcome::Duplicate,
    }
}

fn apply_batch(st: &AppState, bytes: &[u8]) -> Result<Response, ApiError> {
    let hub = &st.hub;
    let body = parse_events_body(bytes).map_err(|e| malformed(hub, e))?;
    let key = WorkerKey {
        worker: WorkerId(body.worker_id),
        dp_rank: DpRank(body.dp_rank.unwrap_or(0)),
    };
    if !hub.is_registered(key.worker) {
        let e = TransportError::UnknownWorker(body.worker_id);
        hub.metrics()
            .drop_input(DropReason::UnknownWorker, body.events.len() as u64, &e);
        return Err(e.into());
    }

    // Hold the rank's fence for the whole batch so concurrent batches of one rank apply in
    // fence order.
    let fence = body.seq.map(|_| st.fence(key));
    let mut fence_guard = fence.as_ref().map(|f| lock(f));
    let mut outcome = None;
    if let (Some(seq), Some(f)) = (body.seq, fence_guard.as_deref_mut()) {
        let o = classify(f.next_expected(), seq);
        match o {
            FenceOutcome::InOrder => {}
            FenceOutcome::Duplicate => {
                hub.metrics().drop_input(
                    DropReason::DuplicateSeq,
                    body.events.len() as u64,
                    &format_args!(
                        "worker {} rank {}: batch {seq} already applied",
                        key.worker, key.dp_rank
                    ),
                );
                return Ok(json(
                    StatusCode::OK,
                    &EventsResponse {
                        applied: 0,
                        rejected: 0,
                        skipped: body.events.len(),
                        fence: Some(o),
                        rejected_reasons: Vec::new(),
                    },
                ));
            }
            FenceOutcome::Gap => {
                tracing::warn!(
                    worker = key.worker.0,
                    dp_rank = key.dp_rank.0,
                    seq,
                    expected = f.next_expected(),
                    "event batches missing; clearing the rank (no replay over HTTP)"
                );
                hub.resync(key)?;
            }
            FenceOutcome::Restart => {
                tracing::info!(
                    worker = key.worker.0,
                    dp_rank = key.dp_rank.0,
                    "event publisher restarted (seq 0); clearing the rank"
                );
                hub.clear(key)?;
                hub.metrics().restarts.fetch_add(1, Relaxed);
            }
        }
        f.accept(seq);
        outcome = Some(o);
    }

    let block_size = hub.block_size();
    let mut engine_events: Vec<KvEvent> = Vec::with_capacity(body.events.len());
    let mut positions = Vec::with_capacity(body.events.len());
    let mut rejected_reasons = Vec::new();
    for (i, e) in body.events.iter().enumerate() {
        match to_engine(e, block_size) {
            Ok(ev) => {
                engine_events.push(ev);
                positions.push(i);
            }
            Err(err) => {
                hub.metrics().drop_input(err.reason(), 1, &err);
                rejected_reasons.push(RejectedEvent {
                    index: i,
                    reason: err.reason().as_str(),
                    message: err.to_string(),
                });
            }
        }
    }
    let mut applied = 0;
    if !engine_events.is_empty() {
        let results = hub.apply(key, &engine_events)?;
        for (r, &i) in results.iter().zip(&positions) {
            match r {
                Ok(_) => applied += 1,
                Err(err) => rejected_reasons.push(RejectedEvent {
                    index: i,
                    reason: err.reason().as_str(),
                    message: err.to_string(),
                }),
            }
        }
    }
    drop(fence_guard);
    rejected_reasons.sort_by_key(|r| r.index);
    let rejected = rejected_reasons.len();
    if applied == 0 && rejected > 0 {
        let mut msg = format!("none of the {rejected} events applied:");
        for r in rejected_reasons.iter().take(8) {
            msg.push_str(&format!(" [{}] {};", r.index, r.message));
        }
        if rejected > 8 {
            msg.push_str(" ...");
        }
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "nothing_applied", msg);
        e.rejected_reasons = rejected_reasons;
        return Err(e);
    }
    Ok(json(
        StatusCode::OK,
        &EventsResponse {
            applied,
            rejected,
            skipped: 0,
            fence: outcome,
            rejected_reasons,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_classes() {
        assert_eq!(classify(None, 9), FenceOutcome::InOrder);
        assert_eq!(classify(Some(3), 3), FenceOutcome::InOrder);
        assert_eq!(classify(Some(3), 5), FenceOutcome::Gap);
        assert_eq!(classify(Some(3), 2), FenceOutcome::Duplicate);
        assert_eq!(classify(Some(3), 0), FenceOutcome::Restart);
        assert_eq!(classify(Some(1), 0), FenceOutcome::Restart);
    }
}
