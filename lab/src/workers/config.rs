//! A simulated worker's settings ([`SimWorkerConfig`]) and how it hands out its KV events
//! ([`EventFormat`]).
//!
//! # Invariants
//! 1. A worker is started only from a configuration [`SimWorkerConfig::validate`] accepted:
//!    every documented range is checked there, once.

use std::net::SocketAddr;
use std::time::Duration;

use sim::SimError;
use sim::engine::EngineConfig;

use super::error::{Result, WorkerError};
use super::role::SimRole;
use super::transfer::TransferModel;
use super::trtllm;

/// [`SimWorkerConfig::bootstrap_timeout`]'s default.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);

/// How a worker hands out its KV events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventFormat {
    /// As vLLM: msgpack batches published over ZMQ (PUB plus the replay ROUTER).
    #[default]
    Vllm,
    /// As TensorRT-LLM: buffered and drained by `POST /kv_cache_events` ([`trtllm`]); no
    /// ZMQ socket is bound.
    Trtllm {
        /// Events kept (TensorRT-LLM's `event_buffer_max_size`): at least 1; when full the
        /// oldest is dropped.
        buffer: usize,
    },
}

impl EventFormat {
    /// TensorRT-LLM's format with the default buffer ([`trtllm::DEFAULT_EVENT_BUFFER`]).
    pub const fn trtllm() -> Self {
        Self::Trtllm {
            buffer: trtllm::DEFAULT_EVENT_BUFFER,
        }
    }

    /// Whether it is TensorRT-LLM's.
    pub const fn is_trtllm(self) -> bool {
        matches!(self, Self::Trtllm { .. })
    }
}

/// One simulated worker's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SimWorkerConfig {
    /// The engine: cache shape, scheduler limits, timing model and the data-parallel rank
    /// stamped on its event batches (`engine.dp_rank`).
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time: finite, > 0.
    pub speedup: f64,
    /// The model name `/v1/models` reports and answers carry; a completion asking for
    /// another model is answered 404, as vLLM does.
    pub model: String,
    /// vLLM's `--api-key`: when set, every request whose path starts with `/v1` must carry
    /// `Authorization: Bearer KEY` (else 401); `/health`, `/load` and `/sim/...` stay open.
    /// Printable ASCII without spaces, as kvengine's worker registration requires.
    pub api_key: Option<String>,
    /// Where the HTTP server listens (port 0: any free port).
    pub http: SocketAddr,
    /// How KV events are handed out: vLLM's ZMQ (the default) or TensorRT-LLM's
    /// `POST /kv_cache_events`.
    pub events: EventFormat,
    /// Where KV events are published: `tcp://HOST:PORT` (port 0: any free port). Unused
    /// with [`EventFormat::Trtllm`].
    pub zmq_pub: String,
    /// The replay (ROUTER) endpoint: `tcp://HOST:PORT` (port 0: any free port). Unused
    /// with [`EventFormat::Trtllm`].
    pub zmq_replay: String,
    /// Event batches kept for replay (vLLM format).
    pub replay_buffer: usize,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: usize,
    /// Which side of disaggregated requests it serves (SGLang's side comes from it).
    pub role: SimRole,
    /// How long receiving a prompt's KV from a prefill worker takes.
    pub transfer: TransferModel,
    /// How long SGLang's bootstrap (`GET /sim/bootstrap/{room}`, on prefill workers) waits
    /// for a room's prefill before answering 404: at least 1 ms, at most a day.
    pub bootstrap_timeout: Duration,
    /// Whether `GET /metrics` serves vLLM's load gauges (`vllm:num_requests_waiting`,
    /// `vllm:kv_cache_usage_perc`), so a router's load scrape sees a vLLM. Off by default:
    /// `kvengine sim` and the replay bench route without scraped load.
    pub vllm_metrics: bool,
}

impl Default for SimWorkerConfig {
    fn default() -> Self {
        Self {
            engine: EngineConfig::default(),
            speedup: 1.0,
            model: "kvengine-sim".into(),
            api_key: None,
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            events: EventFormat::Vllm,
            zmq_pub: "tcp://127.0.0.1:0".into(),
            zmq_replay: "tcp://127.0.0.1:0".into(),
            replay_buffer: 4096,
            max_body_bytes: 64 << 20,
            role: SimRole::Aggregated,
            transfer: TransferModel::default(),
            bootstrap_timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
            vllm_metrics: false,
        }
    }
}

impl SimWorkerConfig {
    /// Rejects a value outside its documented range.
    pub fn validate(&self) -> Result<()> {
        self.engine.validate()?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(WorkerError::InvalidConfig {
                name: "speedup",
                reason: "must be a finite number above 0",
            });
        }
        if self.model.is_empty() {
            return Err(WorkerError::InvalidConfig {
                name: "model",
                reason: "must not be empty",
            });
        }
        if let Some(key) = &self.api_key
            && (key.is_empty() || !key.bytes().all(|c| c.is_ascii_graphic()))
        {
            // A key a client (or kvengine's registration) cannot send would lock the worker.
            return Err(WorkerError::InvalidConfig {
                name: "api_key",
                reason: "must be printable ASCII without spaces, and not empty",
            });
        }
        if let EventFormat::Trtllm { buffer: 0 } = self.events {
            return Err(WorkerError::InvalidConfig {
                name: "events.buffer",
                reason: "must be at least 1",
            });
        }
        self.transfer.validate().map_err(SimError::from)?;
        let timeout = Duration::from_millis(1)..=Duration::from_secs(86_400);
        if !timeout.contains(&self.bootstrap_timeout) {
            return Err(WorkerError::InvalidConfig {
                name: "bootstrap_timeout",
                reason: "must be within 1 ms and a day",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_and_bootstrap_timeout_are_validated() {
        let bad_link = SimWorkerConfig {
            transfer: TransferModel {
                link_gbps: 0.0,
                ..TransferModel::default()
            },
            ..SimWorkerConfig::default()
        };
        assert!(bad_link.validate().is_err());
        for t in [Duration::ZERO, Duration::from_secs(86_401)] {
            let cfg = SimWorkerConfig {
                bootstrap_timeout: t,
                ..SimWorkerConfig::default()
            };
            assert!(cfg.validate().is_err());
        }
        SimWorkerConfig::default().validate().unwrap();
        let empty = SimWorkerConfig {
            events: EventFormat::Trtllm { buffer: 0 },
            ..SimWorkerConfig::default()
        };
        assert!(empty.validate().is_err());
        let trt = SimWorkerConfig {
            events: EventFormat::trtllm(),
            ..SimWorkerConfig::default()
        };
        trt.validate().unwrap();
    }

    #[test]
    fn speedup_must_be_positive_and_finite() {
        for speedup in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = SimWorkerConfig {
                speedup,
                ..SimWorkerConfig::default()
            };
            assert!(cfg.validate().is_err());
        }
    }
}
