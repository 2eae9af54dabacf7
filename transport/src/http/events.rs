//! `POST /v1/events`: a batch of JSON KV events for one worker rank, applied synchronously
//! with per-event results, optionally fenced by `seq`.
//!
//! Fencing (per worker rank, only for batches that carry `seq`) is
//! [`crate::stream::EventStream`]'s, as for ZMQ and QUIC:
//! * first batch seen, or `seq` equal to the next expected: apply;
//! * `seq` above the next expected (a gap): the rank is cleared and marked resyncing (HTTP
//!   has no replay), then the batch applies;
//! * the last batch again, byte for byte (a client retry): skipped, counted as
//!   `duplicate_seq`;
//! * any other `seq` below the next expected: the publisher restarted; the rank is cleared,
//!   then the batch applies.
//!
//! A batch consumes its number once it passes the fence, even if none of its events applied.

use super::api_error::{ApiError, RejectedEvent, json};
use super::shared::{AppState, RawBody, malformed};
use crate::cores::engine_call;
use crate::error::{DropReason, TransportError};
use crate::hub::Hub;
use crate::json_events::{EventsBody, parse_events_body, to_engine};
use crate::stream::{Action, BatchId, ClearKind, EventStream, clear_keys, skip_duplicate};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use engine::event::KvEvent;
use engine::{DpRank, WorkerId, WorkerKey};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum FenceOutcome {
    InOrder,
    Duplicate,
    Gap,
    Restart,
}

impl FenceOutcome {
    fn of(action: Action) -> Self {
        match action {
            Action::Apply => Self::InOrder,
            Action::Skip => Self::Duplicate,
            Action::ClearThenApply(ClearKind::Restart) => Self::Restart,
            Action::ClearThenApply(ClearKind::Resync) | Action::Replay { .. } => Self::Gap,
        }
    }
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
    match apply_batch(&st, &body.0).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn apply_batch(st: &AppState, bytes: &[u8]) -> Result<Response, ApiError> {
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
    // Hold the rank's stream for the whole batch so concurrent batches of one rank apply in
    // fence order. The lock is async: a task waiting for it never blocks its core thread,
    // which the holder's engine calls may be waiting for.
    let stream = body.seq.map(|_| st.event_stream(key));
    let mut guard = match &stream {
        Some(f) => Some(f.lock().await),
        None => None,
    };
    engine_call(|| apply_in_order(hub, key, &body, bytes, guard.as_deref_mut()))
}

/// Fences (when the batch has a seq), converts and applies one rank's batch; `stream` is
/// the rank's fence, held by the caller.
fn apply_in_order(
    hub: &Hub,
    key: WorkerKey,
    body: &EventsBody,
    bytes: &[u8],
    stream: Option<&mut EventStream>,
) -> Result<Response, ApiError> {
    let mut outcome = None;
    if let (Some(seq), Some(f)) = (body.seq, stream) {
        let why = format_args!("worker {} rank {}: batch {seq}", key.worker, key.dp_rank);
        let action = f.live(BatchId::of(seq, bytes));
        match action {
            Action::Apply => {}
            Action::Skip => {
                skip_duplicate(hub, body.events.len() as u64, &why);
                return Ok(json(
                    StatusCode::OK,
                    &EventsResponse {
                        applied: 0,
                        rejected: 0,
                        skipped: body.events.len(),
                        fence: Some(FenceOutcome::Duplicate),
                        rejected_reasons: Vec::new(),
                    },
                ));
            }
            // HTTP has no replay: its streams never ask for one.
            Action::ClearThenApply(kind) => clear_keys(hub, [key], kind, &why)?,
            Action::Replay { .. } => clear_keys(hub, [key], ClearKind::Resync, &why)?,
        }
        outcome = Some(FenceOutcome::of(action));
    }

    let block_size = hub.block_size_of(key.worker);
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
