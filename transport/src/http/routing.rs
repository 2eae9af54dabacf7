//! `POST /v1/overlap`, `POST /v1/route`, `POST /v1/requests/{id}/prefilled`,
//! `DELETE /v1/requests/{id}`.
//!
//! A route made here is its caller's reservation ([`engine::router::reservations`]): capped per
//! client, freed at `--reservation-timeout-secs` if the caller never frees it, and only the
//! caller (its peer address) may mark it prefilled or free it.

use super::api_error::{ApiError, json};
use super::route_body::{PromptFields, parse_prompt_capped};
use super::shared::{AppState, Peer, RawBody, malformed};
use crate::hub::{Hub, RouteCall};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use engine::WorkerId;
use engine::router::reservations::ClientId;
use engine::sched::{Pool, RouteMode, RouteOverrides};
use serde::Serialize;
use std::cell::RefCell;
use std::time::Instant;

/// Buffers above this many token ids are not kept between requests.
const KEEP_TOKENS: usize = 1 << 20;

thread_local! {
    /// Each runtime thread decodes prompts into one reused buffer.
    static TOKENS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with the thread's token buffer (a fresh one if it is somehow in use).
fn with_tokens<T>(f: impl FnOnce(&mut Vec<u32>) -> T) -> T {
    TOKENS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            let out = f(&mut buf);
            if buf.capacity() > KEEP_TOKENS {
                *buf = Vec::new();
            }
            out
        }
        Err(_) => f(&mut Vec::new()),
    })
}

fn parse(
    hub: &Hub,
    body: &[u8],
    tokens: &mut Vec<u32>,
    cap: usize,
) -> Result<PromptFields, ApiError> {
    parse_prompt_capped(body, tokens, cap).map_err(|e| malformed(hub, e))
}

#[derive(Serialize)]
struct OverlapScore {
    worker_id: u64,
    dp_rank: u32,
    overlap_blocks: u32,
}

#[derive(Serialize)]
struct OverlapResponse {
    block_size: u32,
    blocks: usize,
    scores: Vec<OverlapScore>,
}

pub(super) async fn overlap(State(st): State<AppState>, body: RawBody) -> Response {
    let hub = &st.hub;
    let result = with_tokens(|tokens| {
        let fields = parse(hub, &body.0, tokens, st.cfg.max_prompt_tokens)?;
        let (block_size, blocks, matches) = hub.overlap_salted(
            fields.model.as_deref(),
            tokens,
            fields.lora_name.as_deref(),
            fields.cache_salt.as_deref(),
        )?;
        Ok::<_, ApiError>(OverlapResponse {
            block_size,
            blocks,
            scores: matches
                .overlaps
                .iter()
                .filter(|(_, o)| *o > 0)
                .map(|(k, o)| OverlapScore {
                    worker_id: k.worker.0,
                    dp_rank: k.dp_rank.0,
                    overlap_blocks: *o,
                })
                .collect(),
        })
    });
    match result {
        Ok(r) => json(StatusCode::OK, &r),
        Err(e) => axum::response::IntoResponse::into_response(e),
    }
}

#[derive(Serialize)]
struct Candidate {
    worker_id: u64,
    dp_rank: u32,
    overlap_blocks: u32,
    prefill_blocks: f64,
    decode_blocks: u64,
    predicted_ttft_ms: f64,
    logit: f64,
}

#[derive(Serialize)]
struct RouteResponse {
    request_id: String,
    worker_id: u64,
    dp_rank: u32,
    mode: &'static str,
    pool: &'static str,
    blocks: usize,
    overlap_blocks: u32,
    best_available_overlap_blocks: u32,
    busy_skipped: usize,
    candidates: Vec<Candidate>,
}

fn overrides(f: &PromptFields) -> Result<RouteOverrides, ApiError> {
    let mode = match f.mode.as_deref() {
        None => None,
        Some(m) => Some(m.parse::<RouteMode>().map_err(|_| {
            ApiError::invalid(format!(
                "unknown mode {m:?}: expected kv, round-robin, random, direct, sglang, \
                 llm-d or power-of-two"
            ))
        })?),
    };
    Ok(RouteOverrides {
        mode,
        worker: f.worker_id.map(WorkerId),
        overlap_weight: f.overlap_weight,
        temperature: f.temperature,
        pool: match f.pool.as_deref() {
            None | Some("whole") => Pool::Whole,
            Some("prefill") => Pool::Prefill,
            Some("decode") => Pool::Decode,
            Some(p) => {
                return Err(ApiError::invalid(format!(
                    "unknown pool {p:?}: expected whole, prefill or decode"
                )));
            }
        },
    })
}

/// The client a routing call comes from ([`engine::router::reservations`]).
fn client_of(peer: Peer) -> ClientId {
    ClientId::of(peer.0.map(|a| a.ip()))
}

pub(super) async fn route(State(st): State<AppState>, peer: Peer, body: RawBody) -> Response {
    let client = client_of(peer);
    let hub = &st.hub;
    let now = Instant::now();
    // The buffer leaves the thread-local for the await (another request on this thread may
    // decode meanwhile) and goes back after.
    let mut tokens = TOKENS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => std::mem::take(&mut *buf),
        Err(_) => Vec::new(),
    });
    let cap = st.cfg.max_prompt_tokens;
    let result = route_tokens(hub, &body.0, &mut tokens, now, client, cap).await;
    if tokens.capacity() <= KEEP_TOKENS {
        TOKENS.with(|cell| {
            if let Ok(mut buf) = cell.try_borrow_mut()
                && buf.capacity() < tokens.capacity()
            {
                *buf = tokens;
            }
        });
    }
    match result {
        Ok(r) => json(StatusCode::OK, &r),
        Err(e) => axum::response::IntoResponse::into_response(e),
    }
}

async fn route_tokens(
    hub: &Hub,
    body: &[u8],
    tokens: &mut Vec<u32>,
    now: Instant,
    client: ClientId,
    cap: usize,
) -> Result<RouteResponse, ApiError> {
    let fields = parse(hub, body, tokens, cap)?;
    let overrides = overrides(&fields)?;
    let call = RouteCall {
        request_id: fields.request_id,
        tokens,
        lora_name: fields.lora_name.as_deref(),
        cache_salt: fields.cache_salt.as_deref(),
        overrides,
        session: None,
    };
    let routed = hub
        .reserve_async(fields.model.as_deref(), &call, now, client)
        .await?;
    let d = routed.decision;
    Ok(RouteResponse {
        request_id: routed.request_id,
        worker_id: d.worker.worker.0,
        dp_rank: d.worker.dp_rank.0,
        mode: d.mode.as_str(),
        pool: d.pool.as_str(),
        blocks: routed.blocks,
        overlap_blocks: d.overlap_blocks,
        best_available_overlap_blocks: d.best_available_overlap_blocks,
        busy_skipped: d.busy_skipped,
        candidates: d
            .candidates
            .iter()
            .map(|c| Candidate {
                worker_id: c.key.worker.0,
                dp_rank: c.key.dp_rank.0,
                overlap_blocks: c.overlap_blocks,
                prefill_blocks: c.prefill_blocks,
                decode_blocks: c.decode_blocks,
                predicted_ttft_ms: c.predicted_ttft_ms,
                logit: c.logit,
            })
            .collect(),
    })
}

/// A path parameter, or a JSON 400.
pub(super) fn path_param(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    p.map(|Path(s)| s)
        .map_err(|e| ApiError::invalid(format!("bad path parameter: {}", e.body_text())))
}

#[derive(Serialize)]
struct Empty {}

pub(super) async fn prefilled(
    State(st): State<AppState>,
    peer: Peer,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_param(id)?;
    st.hub.prefilled_by(&id, client_of(peer))?;
    Ok(json(StatusCode::OK, &Empty {}))
}

pub(super) async fn finish(
    State(st): State<AppState>,
    peer: Peer,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_param(id)?;
    st.hub.finish_by(&id, client_of(peer))?;
    Ok(json(StatusCode::OK, &Empty {}))
}
