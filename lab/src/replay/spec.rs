//! What every part of a replay speaks of: one request of a workload ([`ReplayRequest`]) and
//! how the router routes in a run ([`RunMode`]).

use engine::sched::RouteMode;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayRequest {
    /// Arrival, in simulated milliseconds since the workload started (non-decreasing).
    pub arrival_ms: f64,
    /// The prompt's token ids (not empty).
    pub tokens: Arc<[u32]>,
    /// Tokens to generate (`max_tokens`, at least 1).
    pub output_tokens: u32,
}

/// How the router routes in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunMode {
    /// KV-aware routing on the workers' KV events, minimising `--router-cost`.
    Kv,
    /// Round robin.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// KV-aware routing without KV events: the router predicts the caches from its own
    /// decisions (`--no-kv-events`).
    KvNoEvents,
    /// SGLang router's cache-aware policy ([`engine::sched::sglang`]).
    Sglang,
    /// llm-d's weighted prefix-cache and queue scorers ([`engine::sched::llmd`]).
    LlmD,
    /// Power of two choices on predicted TTFT ([`engine::sched::power_of_two`]).
    PowerOfTwo,
}

impl RunMode {
    /// Every mode, in the order `all` runs them.
    pub const ALL: [RunMode; 7] = [
        RunMode::Kv,
        RunMode::RoundRobin,
        RunMode::Random,
        RunMode::KvNoEvents,
        RunMode::Sglang,
        RunMode::LlmD,
        RunMode::PowerOfTwo,
    ];

    /// Its name on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            RunMode::Kv => "kv",
            RunMode::RoundRobin => "round-robin",
            RunMode::Random => "random",
            RunMode::KvNoEvents => "kv-no-events",
            RunMode::Sglang => "sglang",
            RunMode::LlmD => "llm-d",
            RunMode::PowerOfTwo => "power-of-two",
        }
    }

    /// The scheduler's mode.
    pub fn route_mode(self) -> RouteMode {
        match self {
            RunMode::Kv | RunMode::KvNoEvents => RouteMode::Kv,
            RunMode::RoundRobin => RouteMode::RoundRobin,
            RunMode::Random => RouteMode::Random,
            RunMode::Sglang => RouteMode::Sglang,
            RunMode::LlmD => RouteMode::LlmD,
            RunMode::PowerOfTwo => RouteMode::PowerOfTwo,
        }
    }

    /// Whether the router subscribes to the workers' KV events.
    pub fn kv_events(self) -> bool {
        self != RunMode::KvNoEvents
    }

    /// Parses a comma-separated list; `all` stands for every mode.
    pub fn parse_list(s: &str) -> Result<Vec<RunMode>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "all" {
                out.extend(RunMode::ALL);
            } else {
                out.push(part.parse()?);
            }
        }
        if out.is_empty() {
            return Err("no mode given".into());
        }
        Ok(out)
    }
}

impl fmt::Display for RunMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RunMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        RunMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown mode {s:?}: expected kv, round-robin, random, kv-no-events, \
                     sglang, llm-d, power-of-two or all"
                )
            })
    }
}
