//! The two phases of one disaggregated request (see the parent module's invariants).
//!
//! 1. Route the decode half (decode pool, by load) and the prefill half (prefill pool, by
//!    the KV cost); both become active in the load tracker.
//! 2. Conditional disaggregation: a short uncached prompt is prefilled on the decode worker
//!    (the prefill half is freed at once).
//! 3. Sequential protocols send the prefill request, read its whole answer, then send the
//!    decode request; SGLang sends both together and waits for the prefill answer before
//!    answering the client (the decode worker cannot produce a token before then anyway).
//! 4. A prefill failure (connection, timeout, 5xx, an answer without hand-off parameters)
//!    retries once on the next-best prefill worker, then prefills on the decode worker; a
//!    decode failure before its answer starts hands the whole request to the next-best decode
//!    worker. A 4xx from either half is the client's error and is returned as is.

use super::SGLANG_BOOTSTRAP_PORT;
use super::handoff::{Body, Handoff, Pair};
use crate::error::WorkerCallError;
use crate::openai::forward::{
    Outgoing, Proxy, respond, retry_elsewhere, route, runner_up, send, send_or_retry,
};
use crate::openai::headers::Forwarded;
use crate::openai::openai_error::{OpenAiError, openai_error};
use crate::openai::relay::Active;
use crate::openai::sse::whole_answer_as_sse;
use crate::openai::usage::cached_tokens;
use crate::outbound::body::{BodyKind, Overrun, ReadError, read_capped};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use engine::WorkerKey;
use engine::sched::{Pool, RouteMode, RouteOverrides};
use hyper::body::Incoming;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// Prefill workers tried before prefilling on the decode worker.
const PREFILL_ATTEMPTS: usize = 2;

fn pool(pool: Pool) -> RouteOverrides {
    RouteOverrides {
        pool,
        ..RouteOverrides::default()
    }
}

fn direct(pool: Pool, key: WorkerKey) -> RouteOverrides {
    RouteOverrides {
        pool,
        mode: Some(RouteMode::Direct),
        worker: Some(key.worker),
        ..RouteOverrides::default()
    }
}

/// Why a phase failed.
enum Failure {
    /// The prefill half failed: worth another prefill worker.
    Prefill(String),
    /// The decode half failed before its answer started.
    Decode(String),
    /// The request itself was refused (a 4xx): the client's answer.
    Client(Response),
    /// The prefill answer finished the request: the client's answer (streamed if the
    /// client asked, with usage if it asked).
    Done(Value, Option<bool>),
}

/// Serves one client request over a prefill and a decode worker.
pub(crate) async fn forward(
    p: &Arc<Proxy>,
    path: &str,
    body: &Bytes,
    tokens: &[u32],
    cache_salt: Option<&str>,
    fwd: &Forwarded,
    (model, block_size): (&str, u32),
) -> Response {
    let hub = &p.hub;
    let out = Outgoing {
        path,
        body,
        fwd,
        model,
        block_size,
        cache_salt,
    };
    let client: Body = match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => m,
        _ => return OpenAiError::invalid(None, "the body must be a JSON object").into_response(),
    };
    let decode = match route(
        hub,
        model,
        block_size,
        tokens,
        cache_salt,
        pool(Pool::Decode),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let d_key = decode.decision.worker;
    let mut d_active = Active::new(hub.clone(), decode.ticket());
    let mut prefill = route(
        hub,
        model,
        block_size,
        tokens,
        cache_salt,
        pool(Pool::Prefill),
    )
    .await
    .ok();
    let mut p_active = prefill
        .as_ref()
        .map(|r| Active::new(hub.clone(), r.ticket()));
    let running = hub
        .routing()
        .active_load(d_key)
        .map_or(0, |l| l.active_requests.saturating_sub(1));
    let split = match decode.decision.chosen() {
        Some(d) => p.cfg.disagg.split.decide(
            tokens.len() as u64,
            block_size,
            d,
            running,
            prefill.as_ref().and_then(|r| r.decision.chosen()),
        ),
        None => {
            return openai_error(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "no decode worker",
            );
        }
    };
    let metrics = hub.metrics();
    if !split.remote {
        drop(p_active);
        metrics.disagg_local.fetch_add(1, Relaxed);
        return send_or_retry(p, out, tokens, &decode, d_active, Pool::Decode).await;
    }
    metrics.disagg_remote.fetch_add(1, Relaxed);
    let handoff = p.cfg.disagg.protocol.handoff();
    for attempt in 0..PREFILL_ATTEMPTS {
        let Some(routed) = prefill.take() else { break };
        let p_key = routed.decision.worker;
        let halves = Attempt {
            path,
            client: &client,
            handoff,
            pair: pair(p, p_key, &routed.request_id, attempt),
            p_key,
            d_key,
            fwd,
        };
        let outcome = if handoff.concurrent() {
            concurrent(p, &halves).await
        } else {
            sequential(p, &halves).await
        };
        if let Some(a) = p_active.as_mut() {
            a.finish();
        }
        match outcome {
            Ok((resp, cached)) => {
                // The prompt was computed on the prefill worker: from now on the decode
                // worker carries this request's blocks, not its prefill.
                d_active.prefilled();
                return respond(resp, d_active, d_key, Some(p_key), cached, fwd);
            }
            Err(Failure::Client(resp)) => return resp,
            Err(Failure::Done(answer, stream)) => {
                return finished(answer, stream, d_key, p_key);
            }
            Err(Failure::Decode(e)) => {
                tracing::warn!(worker = %d_key.worker, "decode half failed: {e}");
                metrics.disagg_fallbacks.fetch_add(1, Relaxed);
                d_active.finish();
                return retry_elsewhere(p, out, tokens, &decode, Pool::Decode, &e).await;
            }
            Err(Failure::Prefill(e)) => {
                tracing::warn!(worker = %p_key.worker, attempt, "prefill half failed: {e}");
                metrics.disagg_fallbacks.fetch_add(1, Relaxed);
                if attempt + 1 < PREFILL_ATTEMPTS
                    && let Some(next) = runner_up(&routed, p_key)
                    && let Ok(r) = route(
                        hub,
                        model,
                        block_size,
                        tokens,
                        cache_salt,
                        direct(Pool::Prefill, next),
                    )
                    .await
                {
                    p_active = Some(Active::new(hub.clone(), r.ticket()));
                    prefill = Some(r);
                }
            }
        }
    }
    // No prefill worker could serve: prefill on the decode worker.
    send_or_retry(p, out, tokens, &decode, d_active, Pool::Decode).await
}

/// Where the two halves meet: the prefill worker's host and bootstrap port, and a fresh room.
fn pair(p: &Proxy, p_key: WorkerKey, request_id: &str, attempt: usize) -> Pair {
    let reg = p.hub.registry().registration(p_key.worker);
    let prefill_host = reg
        .as_ref()
        .and_then(|r| r.url.as_deref())
        .and_then(|u| crate::outbound::WorkerUrl::parse(u).ok())
        .map(|u| u.host().to_string())
        .unwrap_or_else(|| "127.0.0.1".into());
    let bootstrap_port = reg
        .and_then(|r| r.bootstrap_port)
        .unwrap_or(SGLANG_BOOTSTRAP_PORT);
    // Unique per process run and attempt; SGLang wants it below 2^63.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed = format!("{request_id}/{attempt}/{nanos}");
    let room = xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) & (u64::MAX >> 1);
    Pair {
        prefill_host,
        bootstrap_port,
        room,
    }
}

fn to_bytes(b: &Body) -> Bytes {
    // A map of JSON values always serializes.
    Bytes::from(serde_json::to_vec(b).unwrap_or_default())
}

/// The prefill worker's whole answer, or why it is unusable.
async fn prefill_answer(
    p: &Proxy,
    key: WorkerKey,
    path: &str,
    body: &Body,
    fwd: &Forwarded,
) -> Result<Value, Failure> {
    // One deadline for the whole answer, headers and body (crate::outbound, invariant 4).
    let started = std::time::Instant::now();
    let resp = send(p, key, path, &to_bytes(body), fwd)
        .await
        .map_err(Failure::Prefill)?;
    let status = resp.status();
    let left = p.cfg.upstream_timeout.saturating_sub(started.elapsed());
    let kind = BodyKind::Prefill;
    let refusals = &p.hub.metrics().worker_answers;
    let bytes = match tokio::time::timeout(left, read_capped(resp.into_body(), kind.cap())).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(ReadError::TooLarge)) => {
            let e = WorkerCallError::TooLarge {
                kind,
                cap: kind.cap(),
            };
            refusals.refused(
                kind,
                Overrun::TooLarge,
                &format_args!("worker {}: {e}", key.worker),
            );
            return Err(Failure::Prefill(e.to_string()));
        }
        Ok(Err(ReadError::Broken(why))) => {
            return Err(Failure::Prefill(format!("answer broke off: {why}")));
        }
        Err(_) => {
            let e = WorkerCallError::TooSlow {
                kind,
                deadline: p.cfg.upstream_timeout,
            };
            refusals.refused(
                kind,
                Overrun::TooSlow,
                &format_args!("worker {}: {e}", key.worker),
            );
            return Err(Failure::Prefill(e.to_string()));
        }
    };
    if status.is_client_error() {
        let mut r = (status, bytes).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        return Err(Failure::Client(r));
    }
    serde_json::from_slice(&bytes).map_err(|e| Failure::Prefill(format!("answer is not JSON: {e}")))
}

type Started = (hyper::Response<Incoming>, Option<u64>);

/// One try at serving a request over a prefill and a decode worker.
struct Attempt<'a> {
    path: &'a str,
    client: &'a Body,
    handoff: &'a dyn Handoff,
    pair: Pair,
    p_key: WorkerKey,
    d_key: WorkerKey,
    /// What the client's request carries to both workers.
    fwd: &'a Forwarded,
}

async fn sequential(p: &Proxy, a: &Attempt<'_>) -> Result<Started, Failure> {
    let (client, handoff) = (a.client, a.handoff);
    let prefill_body = handoff.prefill_body(client, &a.pair);
    let answer = prefill_answer(p, a.p_key, a.path, &prefill_body, a.fwd).await?;
    if handoff.finished_in_prefill(&answer) {
        let stream = (client.get("stream").and_then(Value::as_bool) == Some(true)).then(|| {
            client
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true)
        });
        return Err(Failure::Done(answer, stream));
    }
    let body = handoff
        .decode_body(client, &a.pair, Some(&answer))
        .map_err(Failure::Prefill)?;
    let resp = send(p, a.d_key, a.path, &to_bytes(&body), a.fwd)
        .await
        .map_err(Failure::Decode)?;
    Ok((resp, cached_tokens(&answer)))
}

async fn concurrent(p: &Arc<Proxy>, a: &Attempt<'_>) -> Result<Started, Failure> {
    let (client, handoff) = (a.client, a.handoff);
    let d_body = to_bytes(
        &handoff
            .decode_body(client, &a.pair, None)
            .map_err(Failure::Prefill)?,
    );
    let (pp, d_path, d_key, d_fwd) = (p.clone(), a.path.to_owned(), a.d_key, a.fwd.clone());
    // Aborting the task drops the decode request: the decode worker sees its client go.
    let mut decode = AbortOnDrop(tokio::spawn(async move {
        send(&pp, d_key, &d_path, &d_body, &d_fwd).await
    }));
    let prefill_body = handoff.prefill_body(client, &a.pair);
    let answer = prefill_answer(p, a.p_key, a.path, &prefill_body, a.fwd).await?;
    let resp = match (&mut decode.0).await {
        Ok(r) => r.map_err(Failure::Decode)?,
        Err(e) => return Err(Failure::Decode(e.to_string())),
    };
    Ok((resp, cached_tokens(&answer)))
}

/// A spawned request that is cancelled if its result is no longer wanted.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The prefill answer finished the request: it is the client's answer, as SSE when the
/// client streams (`stream`: whether it asked for usage).
fn finished(
    mut answer: Value,
    stream: Option<bool>,
    d_key: WorkerKey,
    p_key: WorkerKey,
) -> Response {
    if let Some(c) = answer
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    {
        c.remove("disaggregated_params");
    }
    let mut r = match stream {
        Some(include_usage) => (
            [(header::CONTENT_TYPE, "text/event-stream")],
            whole_answer_as_sse(&answer, include_usage),
        )
            .into_response(),
        None => axum::Json(answer).into_response(),
    };
    r.headers_mut()
        .insert("x-kvengine-worker-id", p_key.worker.0.into());
    r.headers_mut()
        .insert("x-kvengine-decode-worker-id", d_key.worker.0.into());
    r
}

#[cfg(test)]
mod tests {
    use super::super::Protocol;

    #[test]
    fn protocols_pick_their_flow() {
        assert!(!Protocol::Vllm.handoff().concurrent());
        assert!(Protocol::Sglang.handoff().concurrent());
        assert!(!Protocol::Trtllm.handoff().concurrent());
    }
}
