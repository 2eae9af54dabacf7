//! Request traffic through the router while faults happen: two open-loop generators.
//!
//! * Completions: `POST /v1/completions` (the OpenAI front door; the prompt as token ids
//!   from a multi-turn chat workload, [`sim::workload::chat`]) at `rate` per second. They
//!   reach the workers, fill and churn their caches (so KV events flow), and exercise the
//!   front door's retry when a worker fails. Each answer's status and end-to-end time are
//!   recorded.
//! * Route probes: `POST /v1/route` with the prompt of a recent completion (so overlaps
//!   are real), at `route_rate` per second, then `DELETE /v1/requests/{id}` (not timed).
//!   Their client-side latency is the figure the soak's p99 goals are about: routing
//!   itself, without a worker's time in it.
//!
//! Open loop: a request is sent on its tick whatever happened to earlier ones (up to
//! [`MAX_IN_FLIGHT`] each; ticks past it are counted as shed), so a stall shows as latency
//! or errors, not as fewer requests.
//!
//! # Invariants
//! 1. Every request sent yields one [`Sample`], with `ok` false for any failure (status,
//!    transport, timeout).
//! 2. While paused nothing is sent; [`Traffic::in_flight`] counts what is still out.
//!
//! # Concurrency
//! [`Traffic`] is shared by the generator tasks, their request tasks and the harness:
//! atomics (relaxed: counters and flags read for progress only; the pause is confirmed by
//! waiting for `in_flight` to reach 0) and short mutexes.

use super::router::Http;
use hyper::Method;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sim::workload::chat::{ChatConfig, ChatWorkload};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// Requests of one generator in flight at most.
pub const MAX_IN_FLIGHT: u64 = 512;
/// Recent prompts route probes draw from.
const RECENT: usize = 256;
const ROUTE_TIMEOUT: Duration = Duration::from_secs(5);
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);

/// Which generator a sample is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleKind {
    /// `POST /v1/route`.
    Route,
    /// `POST /v1/completions`.
    Completion,
}

/// One request.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Sent at, from the run's start.
    pub at: Duration,
    /// Until its answer (or failure).
    pub latency: Duration,
    /// Which generator.
    pub kind: SampleKind,
    /// HTTP status (0: no answer).
    pub status: u16,
}

impl Sample {
    /// Answered 2xx.
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// The chat workload the completions follow: short turns over a few shared system
/// prompts, so caches share prefixes and evict.
pub fn chat_config(seed: u64) -> ChatConfig {
    ChatConfig {
        seed,
        requests: usize::MAX,
        system_prompts: 6,
        system_prompt_tokens: 200..=800,
        live_sessions: 48,
        turns: 2..=10,
        first_message_tokens: 30..=400,
        user_tokens: 10..=120,
        answer_tokens: 4..=16,
        max_prompt_tokens: 3000,
        mean_gap_ms: 0.0,
        vocab: sim::workload::DEFAULT_VOCAB,
        adapters: Vec::new(),
        adapter_share: 0.0,
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Traffic {
    start: Instant,
    /// The router's `HOST:PORT`, switched at each restart.
    addr: RwLock<String>,
    paused: AtomicBool,
    stopped: AtomicBool,
    in_flight: AtomicU64,
    /// Ticks skipped because a generator had [`MAX_IN_FLIGHT`] requests out.
    pub shed: AtomicU64,
    samples: Mutex<Vec<Sample>>,
    recent: Mutex<VecDeque<Arc<[u32]>>>,
    workload: Mutex<ChatWorkload>,
    rng: Mutex<SmallRng>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Traffic {
    /// Traffic toward `addr` following `chat`, timed from `start`.
    pub fn new(start: Instant, addr: String, chat: ChatConfig) -> anyhow::Result<Self> {
        let seed = chat.seed;
        let workload = ChatWorkload::new(chat).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Self {
            start,
            addr: RwLock::new(addr),
            paused: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
            workload: Mutex::new(workload),
            rng: Mutex::new(SmallRng::seed_from_u64(seed ^ 0x5eed)),
            next_id: AtomicU64::new(0),
        })
    }

    /// Points the traffic at a restarted router.
    pub fn set_addr(&self, addr: String) {
        *self
            .addr
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = addr;
    }

    fn addr(&self) -> String {
        self.addr
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Stops sending (requests out finish).
    pub fn pause(&self) {
        self.paused.store(true, Relaxed);
    }

    /// Sends again.
    pub fn resume(&self) {
        self.paused.store(false, Relaxed);
    }

    /// Ends the generators.
    pub fn stop(&self) {
        self.stopped.store(true, Relaxed);
    }

    /// Requests sent and not answered.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Every sample so far.
    pub fn samples(&self) -> Vec<Sample> {
        lock(&self.samples).clone()
    }

    fn record(&self, sent: Instant, kind: SampleKind, status: u16) {
        let s = Sample {
            at: sent.saturating_duration_since(self.start),
            latency: sent.elapsed(),
            kind,
            status,
        };
        lock(&self.samples).push(s);
    }

    fn recent_prompt(&self) -> Option<Arc<[u32]>> {
        let recent = lock(&self.recent);
        if recent.is_empty() {
            return None;
        }
        let i = lock(&self.rng).random_range(0..recent.len());
        recent.get(i).cloned()
    }
}

fn ids_json(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{t}");
    }
    s
}

/// Runs one generator until stopped: completions, or route probes.
pub async fn generate(t: Arc<Traffic>, http: Http, kind: SampleKind, rate: f64) {
    if !(rate.is_finite() && rate > 0.0) {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let out = Arc::new(AtomicU64::new(0));
    while !t.stopped.load(Relaxed) {
        tick.tick().await;
        if t.paused.load(Relaxed) {
            continue;
        }
        if out.load(Relaxed) >= MAX_IN_FLIGHT {
            t.shed.fetch_add(1, Relaxed);
            continue;
        }
        let request = match kind {
            SampleKind::Completion => {
                let Some(r) = lock(&t.workload).next() else {
                    return;
                };
                let prompt: Arc<[u32]> = r.tokens.into();
                {
                    let mut recent = lock(&t.recent);
                    if recent.len() == RECENT {
                        recent.pop_front();
                    }
                    recent.push_back(prompt.clone());
                }
                let body = format!(
                    r#"{{"prompt":[{}],"max_tokens":{},"stream":false}}"#,
                    ids_json(&prompt),
                    r.output_tokens.max(1)
                );
                (body, None)
            }
            SampleKind::Route => {
                let Some(prompt) = t.recent_prompt() else {
                    continue;
                };
                let id = format!("soak-{}", t.next_id.fetch_add(1, Relaxed));
                let body = format!(
                    r#"{{"token_ids":[{}],"request_id":"{id}"}}"#,
                    ids_json(&prompt)
                );
                (body, Some(id))
            }
        };
        out.fetch_add(1, Relaxed);
        t.in_flight.fetch_add(1, Relaxed);
        let (t, http, out) = (t.clone(), http.clone(), out.clone());
        tokio::spawn(async move {
            let base = format!("http://{}", t.addr());
            let sent = Instant::now();
            let (body, id) = request;
            let (path, timeout) = match kind {
                SampleKind::Completion => ("/v1/completions", COMPLETION_TIMEOUT),
                SampleKind::Route => ("/v1/route", ROUTE_TIMEOUT),
            };
            let url = format!("{base}{path}");
            let status = match http.call(Method::POST, &url, Some(body), timeout).await {
                Ok((status, _)) => status,
                Err(_) => 0,
            };
            t.record(sent, kind, status);
            if let Some(id) = id
                && status == 200
            {
                let url = format!("{base}/v1/requests/{id}");
                let _ = http.call(Method::DELETE, &url, None, ROUTE_TIMEOUT).await;
            }
            out.fetch_sub(1, Relaxed);
            t.in_flight.fetch_sub(1, Relaxed);
        });
    }
}
