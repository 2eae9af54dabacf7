//! The open-loop client: each request is sent at its arrival time (divided by the
//! speedup), whatever happened to the earlier ones, and its answer is read as it streams.
//! With several routers ([`replay_over`], router replicas) request `i` goes to router
//! `i % N`, as a round-robin load balancer in front of the replicas would send it.
//!
//! A request is `POST /v1/completions` with the prompt as token ids (or one word per id,
//! [`PromptForm::Words`], for routers that route on text), `max_tokens`,
//! `stream: true` and `stream_options.include_usage`. Per request, in simulated time (wall
//! time times the speedup), measured from the moment it is sent:
//! * TTFT: until the first SSE data event that carries generated text;
//! * inter-token latencies: between successive such events;
//! * end to end: until the stream ends (`[DONE]`).
//!
//! The serving worker comes from the `x-kvengine-worker-id` header (for a disaggregated
//! request, the decode worker; the prefill worker from `x-kvengine-prefill-worker-id` when
//! the prefill was sent away), prompt and cached
//! tokens from the usage chunk (`usage.prompt_tokens`,
//! `usage.prompt_tokens_details.cached_tokens`).
//!
//! # Invariants
//! 1. Every request yields exactly one [`RequestResult`]; anything that goes wrong (status,
//!    transport, an SSE error event, a missing usage chunk or `[DONE]`, a timeout) is
//!    recorded in its `error`, never raised.

use super::spec::ReplayRequest;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How the client runs.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Simulated time runs this many times faster than real time (finite, > 0).
    pub speedup: f64,
    /// Longest wall time one request may take.
    pub request_timeout: Duration,
    /// How prompts are written in the request body.
    pub prompt: PromptForm,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            speedup: 1.0,
            request_timeout: Duration::from_secs(300),
            prompt: PromptForm::TokenIds,
        }
    }
}

/// How a request's prompt is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PromptForm {
    /// `"prompt": [ids]`: what kvengine and the simulated workers take as they are.
    #[default]
    TokenIds,
    /// `"prompt": "t17 t4096 ..."`: one word per token id (`t` and the id), for routers that
    /// route on text (SGLang's and vLLM's cache-aware policies). The simulated workers and
    /// kvengine (`--tokenizer stand-in`) turn each word into one token, so the blocks, and
    /// hence the prefixes two requests share, are those of the ids.
    Words,
}

/// What happened to one request. Times are simulated milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestResult {
    /// Its index in the workload.
    pub index: usize,
    /// The worker that served it (`x-kvengine-worker-id`).
    pub worker: Option<u64>,
    /// The prefill worker of a disaggregated request (`x-kvengine-prefill-worker-id`).
    pub prefill_worker: Option<u64>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Time to the first generated token.
    pub ttft_ms: Option<f64>,
    /// Gaps between successive tokens.
    pub itl_ms: Vec<f64>,
    /// Time to the end of the stream.
    pub e2e_ms: Option<f64>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Token events received.
    pub output_tokens: u64,
    /// When it was sent, from the replay's start.
    pub sent_ms: f64,
    /// How late it was sent compared with its arrival time.
    pub lag_ms: f64,
}

impl RequestResult {
    /// Whether it completed.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// The JSON body of `r`, its prompt as token ids.
pub fn body(r: &ReplayRequest) -> String {
    body_as(r, PromptForm::TokenIds)
}

/// The JSON body of `r`, its prompt written as `form` says.
pub fn body_as(r: &ReplayRequest, form: PromptForm) -> String {
    let mut s = String::with_capacity(r.tokens.len() * 8 + 128);
    s.push_str(r#"{"model":"kvengine-sim","prompt":"#);
    let (open, sep, close) = match form {
        PromptForm::TokenIds => ('[', ',', ']'),
        PromptForm::Words => ('"', ' ', '"'),
    };
    s.push(open);
    for (i, t) in r.tokens.iter().enumerate() {
        if i > 0 {
            s.push(sep);
        }
        match form {
            PromptForm::TokenIds => {
                let _ = write!(s, "{t}");
            }
            PromptForm::Words => {
                let _ = write!(s, "t{t}");
            }
        }
    }
    s.push(close);
    let _ = write!(
        s,
        r#","max_tokens":{},"stream":true,"stream_options":{{"include_usage":true}}}}"#,
        r.output_tokens
    );
    s
}

/// Sends every request of `requests` to `base_url`'s `/v1/completions` at its arrival time
/// and returns their results, in workload order. `done` is called as each one finishes.
pub async fn replay(
    base_url: &str,
    requests: &[ReplayRequest],
    cfg: &ClientConfig,
    done: Arc<dyn Fn() + Send + Sync>,
) -> Vec<RequestResult> {
    replay_over(&[base_url.to_owned()], requests, cfg, done).await
}

/// [`replay`] over several routers: request `i` goes to `base_urls[i % N]`. Without any
/// URL every request fails (invariant 1 still holds).
pub async fn replay_over(
    base_urls: &[String],
    requests: &[ReplayRequest],
    cfg: &ClientConfig,
    done: Arc<dyn Fn() + Send + Sync>,
) -> Vec<RequestResult> {
    if base_urls.is_empty() {
        return (0..requests.len())
            .map(|index| RequestResult {
                index,
                error: Some("no router to send to".into()),
                ..RequestResult::default()
            })
            .collect();
    }
    let speedup = if cfg.speedup.is_finite() && cfg.speedup > 0.0 {
        cfg.speedup
    } else {
        1.0
    };
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let urls: Vec<Arc<str>> = base_urls
        .iter()
        .map(|u| Arc::from(format!("{}/v1/completions", u.trim_end_matches('/'))))
        .collect();
    // A short head start so the first arrivals are not late by the setup.
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::with_capacity(requests.len());
    for ((index, r), url) in requests.iter().enumerate().zip(urls.iter().cycle()) {
        let at = Duration::try_from_secs_f64(r.arrival_ms.max(0.0) / 1000.0 / speedup)
            .unwrap_or(Duration::ZERO);
        let due = start + at;
        tokio::time::sleep_until(due.into()).await;
        let (client, url, done, r) = (client.clone(), url.clone(), done.clone(), r.clone());
        let (timeout, form) = (cfg.request_timeout, cfg.prompt);
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let mut result = RequestResult {
                index,
                sent_ms: sim_ms(sent.saturating_duration_since(start), speedup),
                lag_ms: sim_ms(sent.saturating_duration_since(due), speedup),
                ..RequestResult::default()
            };
            let run = one(&client, &url, &r, form, speedup, sent, &mut result);
            if tokio::time::timeout(timeout, run).await.is_err() {
                result.error = Some(format!("no complete answer within {timeout:?}"));
            }
            done();
            result
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for (index, t) in tasks.into_iter().enumerate() {
        out.push(t.await.unwrap_or_else(|e| RequestResult {
            index,
            error: Some(format!("the client task failed: {e}")),
            ..RequestResult::default()
        }));
    }
    out
}

fn sim_ms(d: Duration, speedup: f64) -> f64 {
    d.as_secs_f64() * 1000.0 * speedup
}

/// Sends one request and reads its stream into `out`.
async fn one(
    client: &HttpClient,
    url: &str,
    r: &ReplayRequest,
    form: PromptForm,
    speedup: f64,
    sent: Instant,
    out: &mut RequestResult,
) {
    let req = match hyper::Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body_as(r, form))))
    {
        Ok(req) => req,
        Err(e) => {
            out.error = Some(format!("building the request: {e}"));
            return;
        }
    };
    let resp = match client.request(req).await {
        Ok(resp) => resp,
        Err(e) => {
            out.error = Some(format!("sending: {e}"));
            return;
        }
    };
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    out.worker = header("x-kvengine-worker-id");
    out.prefill_worker = header("x-kvengine-prefill-worker-id");
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        out.error = Some(format!(
            "status {status}: {}",
            text.chars().take(300).collect::<String>()
        ));
        return;
    }
    let mut sse = SseState::default();
    let mut buf: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                out.error = Some(format!("reading the stream: {e}"));
                return;
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = sim_ms(sent.elapsed(), speedup);
        buf.extend_from_slice(&data);
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end.0 + end.1).collect();
            sse.event(&event[..end.0], now, out);
        }
        if out.error.is_some() {
            return;
        }
    }
    if out.error.is_none() {
        if !sse.done {
            out.error = Some("the stream ended without [DONE]".into());
        } else if !sse.usage {
            out.error = Some("the stream carried no usage chunk".into());
        } else if out.ttft_ms.is_none() {
            out.error = Some("the stream carried no token".into());
        } else {
            out.e2e_ms = Some(sim_ms(sent.elapsed(), speedup));
        }
    }
}

/// The end of the first complete SSE event in `buf`: (its length, the separator's length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// What one stream has shown so far.
#[derive(Debug, Default)]
pub struct SseState {
    /// `[DONE]` seen.
    pub done: bool,
    /// A usage chunk seen.
    pub usage: bool,
    last_token_ms: Option<f64>,
}

impl SseState {
    /// Takes one SSE event (without its blank-line separator) received at `now_ms`.
    pub fn event(&mut self, event: &[u8], now_ms: f64, out: &mut RequestResult) {
        let text = String::from_utf8_lossy(event);
        let mut data = String::new();
        for line in text.lines() {
            if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        let data = data.trim();
        if data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let v: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => {
                out.error = Some(format!("a stream chunk is not JSON: {e}"));
                return;
            }
        };
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            out.error = Some(format!("error event: {err}"));
            return;
        }
        let has_text = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
            .and_then(|c| c.get("text").or_else(|| c.pointer("/delta/content")))
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty());
        if has_text {
            match self.last_token_ms {
                None => out.ttft_ms = Some(now_ms),
                Some(last) => out.itl_ms.push((now_ms - last).max(0.0)),
            }
            self.last_token_ms = Some(now_ms);
            out.output_tokens += 1;
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = true;
            out.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
            out.cached_tokens = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
        }
    }
}
