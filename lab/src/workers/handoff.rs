//! What a disaggregated request does around the engine: the decode side receives its
//! prompt's KV before it is queued ([`receive`]); the prefill side's answer carries what
//! the decode side needs ([`annotate`]).
//!
//! Receiving: an SGLang decode first waits for its room on the prefill worker's bootstrap
//! ([`super::bootstrap::poll`]); every decode side then waits the transfer time
//! ([`TransferModel`]) of the prompt tokens this worker does not cache (its cached prefix,
//! capped as the engine caps prefix hits), divided by the speedup, and is queued with a
//! [`RemotePrefill`]: the engine allocates and publishes the prompt's blocks without
//! computing them. The wait holds no pages (a simplification: a real decode worker
//! allocates them before the transfer starts).
//!
//! # Invariants
//! 1. [`receive`] fails only before the request is queued, so a failed decode side has sent
//!    nothing: 502 if the prefill cannot be reached, 503 if this worker is stopping.
//! 2. The answers' extra fields are exactly those of [`super::disagg`]'s table.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use engine::RequestId;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::bootstrap::{self, HttpClient, Rooms};
use super::command::Command;
use super::disagg::{Disagg, trt_context_params, vllm_prefill_params};
use super::openai::{OpenAiError, Parsed};
use super::transfer::TransferModel;
use sim::engine::RemotePrefill;

/// How much longer than its own bootstrap timeout a decode side waits for a prefill
/// worker's bootstrap answer.
const POLL_MARGIN: Duration = Duration::from_secs(5);

/// What a worker needs to serve either side.
#[derive(Debug)]
pub(super) struct Handoff {
    pub(super) transfer: TransferModel,
    pub(super) speedup: f64,
    pub(super) block_size: u32,
    /// This worker's engine id (vLLM's `remote_engine_id`).
    pub(super) engine_id: String,
    /// This worker's HTTP address (vLLM's `remote_host`/`remote_port`, TensorRT-LLM's
    /// `encoded_opaque_state`).
    pub(super) addr: SocketAddr,
    /// SGLang rooms: `Some` on prefill workers.
    pub(super) rooms: Option<Arc<Rooms>>,
    /// For polling a prefill worker's bootstrap.
    pub(super) client: HttpClient,
    /// How long a room is waited for.
    pub(super) bootstrap_timeout: Duration,
}

/// A finished request, as [`annotate`] needs it.
#[derive(Debug)]
pub(super) struct Prefilled {
    pub(super) id: RequestId,
    pub(super) first_token: u32,
    /// The prompt, kept for vLLM prefills (their `remote_block_ids`).
    pub(super) prompt: Option<Vec<u32>>,
}

fn bad_gateway(message: String) -> OpenAiError {
    OpenAiError {
        status: StatusCode::BAD_GATEWAY,
        kind: "server_error",
        message,
        param: None,
        code: Some("kv_transfer_failed"),
    }
}

fn stopping() -> OpenAiError {
    OpenAiError::unavailable("the simulated worker is shutting down")
}

/// The pages holding the leading cached full blocks of `prompt` on this worker (its
/// driver's `commands`).
async fn lookup(
    commands: &mpsc::Sender<Command>,
    prompt: Vec<u32>,
) -> Result<Vec<u32>, OpenAiError> {
    let (ack, answer) = oneshot::channel();
    commands
        .send(Command::Lookup { prompt, ack })
        .await
        .map_err(|_| stopping())?;
    answer.await.map_err(|_| stopping())
}

/// Real time of simulated time `d` at `speedup` (saturating).
fn wall(d: Duration, speedup: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() / speedup).unwrap_or(Duration::MAX)
}

/// Waits for the KV of a decode side's prompt (see the module docs); `commands` reach this
/// worker's driver.
pub(super) async fn receive(
    h: &Handoff,
    commands: &mpsc::Sender<Command>,
    parsed: &Parsed,
) -> Result<RemotePrefill, OpenAiError> {
    if let Disagg::Sglang(b) = &parsed.disagg {
        let timeout = h.bootstrap_timeout.saturating_add(POLL_MARGIN);
        let prefilled = bootstrap::poll(&h.client, b, timeout)
            .await
            .map_err(|e| bad_gateway(format!("bootstrap room {}: {e}", b.room)))?;
        if prefilled as usize != parsed.prompt.len() {
            return Err(bad_gateway(format!(
                "bootstrap room {}: the prefill worker prefilled {prefilled} prompt tokens, \
                 this request has {}",
                b.room,
                parsed.prompt.len()
            )));
        }
    }
    let tokens = parsed.prompt.len() as u64;
    let bs = u64::from(h.block_size.max(1));
    let cached_blocks = lookup(commands, parsed.prompt.clone()).await?.len() as u64;
    // The engine never hits the block holding the last prompt token.
    let cached = cached_blocks.min(tokens.saturating_sub(1) / bs) * bs;
    let transfer = h.transfer.time(tokens - cached);
    tokio::time::sleep(wall(transfer, h.speedup)).await;
    let first_token = match &parsed.disagg {
        Disagg::TrtGeneration(t) => Some(t.first_token),
        _ => None,
    };
    Ok(RemotePrefill { first_token })
}

/// Adds the prefill side's fields to a whole answer (see [`super::disagg`]); `commands`
/// reach this worker's driver.
pub(super) async fn annotate(
    h: &Handoff,
    commands: &mpsc::Sender<Command>,
    disagg: &Disagg,
    done: Prefilled,
    answer: &mut Value,
) -> Result<(), OpenAiError> {
    match disagg {
        Disagg::VllmPrefill => {
            let pages = match done.prompt {
                Some(prompt) => lookup(commands, prompt).await?,
                None => Vec::new(),
            };
            if let Some(m) = answer.as_object_mut() {
                let params = vllm_prefill_params(&h.engine_id, &pages, h.addr);
                m.insert("kv_transfer_params".into(), params);
            }
        }
        Disagg::TrtContext => {
            let choice = answer
                .get_mut("choices")
                .and_then(|c| c.get_mut(0))
                .and_then(Value::as_object_mut);
            if let Some(c) = choice {
                let params = trt_context_params(done.first_token, done.id.0, h.addr);
                c.insert("disaggregated_params".into(), params);
            }
        }
        Disagg::None | Disagg::VllmDecode(_) | Disagg::Sglang(_) | Disagg::TrtGeneration(_) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_time_divides_by_the_speedup() {
        assert_eq!(
            wall(Duration::from_millis(500), 50.0),
            Duration::from_millis(10)
        );
        assert_eq!(wall(Duration::MAX, 1e-300), Duration::MAX);
    }
}
