//! `kvengine [serve]`: the router: engine, ingest transports and the HTTP edge in one
//! process.
//!
//! Starts one core thread per core (`--cores`, default: the CPUs this process may use),
//! pinned where a CPU exists. Each core thread runs a single-threaded tokio runtime that
//! serves its share of the HTTP edge (`--http-port`, one `SO_REUSEPORT` listener per core),
//! the subscriptions to the vLLM/SGLang KV events of the `--zmq-worker`s homed on it (and of
//! workers registered later over HTTP with a `zmq` endpoint), and its engine core in between
//! (`transport::cores`); core 0 also accepts native publishers (`--quic`).
//! Waits for SIGINT or SIGTERM; then stops accepting, lets each core drain what it was sent,
//! joins them and prints their figures.
//!
//! Flags follow Dynamo's router where one exists (`--router-mode`, `--kv-cache-block-size`,
//! `--router-temperature`, `--kv-overlap-score-weight`, `--kv-events/--no-kv-events`,
//! `--http-port`), so an operator can switch without relearning.

use anyhow::{Context, Result, bail};
use clap::Args;
use engine::WorkerId;
use engine::approx::ApproxConfig;
use engine::runtime::{CoreSummary, RuntimeConfig, start_hosted_from};
use engine::sched::{BusyThresholds, RouteMode, RouterCost, SchedulerConfig};
use engine::sharding::adaptive::Adaptive;
use engine::sharding::choice::Sharding;
use lab::workers::{SimRole, SimWorkerConfig, SimWorkerHandle, spawn_mixed_cluster};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use transport::cores::{self, Homes};
use transport::http::{HttpConfig, health::health_loop, router};
use transport::hub::{Hub, HubConfig, Registration, start_engine_from};
use transport::models::ModelSpec;
use transport::native::{IngestCredentials, QuicServerConfig, ScopedToken, TlsSource, serve_quic};
use transport::openai::proxy::{ProxyConfig, openai_router};
use transport::openai::tokenize::PromptTokenizer;
use transport::outbound::Outbound;
use transport::trtllm::TrtllmSource;
use transport::zmq::{SubscriberConfig, ZmqSource, spawn_subscriber_on};

use crate::disagg_args::DisaggArgs;

/// Router settings.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Core threads, each owning a shard (default: the CPUs available to this process).
    #[arg(long, env = "KVENGINE_CORES",
          value_parser = clap::value_parser!(u16).range(1..=32768))]
    pub cores: Option<u16>,
    /// Replicate the first N blocks of every sequence in every shard and shard the rest by
    /// the block at depth N, instead of the default adaptive trunk.
    #[arg(long, env = "KVENGINE_REPLICATE_DEPTH",
          value_parser = clap::value_parser!(u32).range(0..=(1 << 30)))]
    pub replicate_depth: Option<u32>,
    /// Adaptive trunk (the default): a block that this many different continuations follow
    /// in one shard is copied to every shard, and what continues it is spread over them.
    #[arg(long, env = "KVENGINE_HUB_FANOUT", default_value_t = Adaptive::DEFAULT_HUB_FANOUT,
          value_parser = clap::value_parser!(u32).range(2..=(1 << 20)))]
    pub hub_fanout: u32,
    /// Messages each client-to-shard ring holds.
    #[arg(long, env = "KVENGINE_RING_CAPACITY", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 24)))]
    pub ring_capacity: u32,
    /// The longest a request waits for a core (a query, an event applied over HTTP): a core
    /// that does not answer in time gets the request a 503 (`engine_timeout`), not a hang.
    #[arg(long, env = "KVENGINE_ENGINE_TIMEOUT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub engine_timeout_ms: u64,
    /// Do not pin shard threads to cores.
    #[arg(long, env = "KVENGINE_NO_PIN")]
    pub no_pin: bool,
    /// Keep the index in this directory across restarts: a snapshot is written every
    /// `--snapshot-interval-s` and at shutdown, and read at start (with the same `--cores`
    /// and sharding flags); each ZMQ worker then replays what it published meanwhile.
    #[arg(long, env = "KVENGINE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Seconds between snapshots in `--state-dir` (0: only at shutdown).
    #[arg(long, env = "KVENGINE_SNAPSHOT_INTERVAL_S", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub snapshot_interval_s: u64,

    /// Address the HTTP edge listens on.
    #[arg(long, env = "KVENGINE_HTTP_HOST", default_value = "0.0.0.0")]
    pub http_host: String,
    /// Port of the HTTP edge (0: any free port, printed at start).
    #[arg(long, env = "KVENGINE_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,
    /// Serve HTTP and the ingest transports on N threads of their own, apart from the
    /// cores (the layout before the edge moved onto the cores; kept to compare against).
    /// Default: HTTP and ingest run on the core threads, one listener per core.
    #[arg(long, env = "KVENGINE_HTTP_THREADS",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub http_threads: Option<u16>,
    /// Request bodies larger than this are refused with 413. Default: what fits
    /// --max-prompt-tokens (11 bytes a token id plus 1 MiB), at least 16 MiB.
    #[arg(long, env = "KVENGINE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Prompts of more tokens are refused with 400 (`prompt_too_long` on the routing API,
    /// `context_length_exceeded` on the OpenAI front door), counted while the body is
    /// read. 0: each model's `model_max_length` from its tokenizer, else 1,048,576.
    #[arg(long, env = "KVENGINE_MAX_PROMPT_TOKENS", default_value_t = 0)]
    pub max_prompt_tokens: usize,

    /// How requests are routed unless a request says otherwise.
    #[arg(long, env = "KVENGINE_ROUTER_MODE", default_value = "kv",
          value_parser = parse_mode)]
    pub router_mode: RouteMode,
    /// What `kv` mode minimises: `dynamo`, Dynamo's formula (`--kv-overlap-score-weight` x
    /// prefill blocks + decode blocks), or `ttft`, each worker's predicted time to first
    /// token (fitted online from observed TTFTs; better median TTFT and hit rate, worse
    /// 99th percentile on some workloads: docs/benchmarks.md, "Issue 16").
    #[arg(long, env = "KVENGINE_ROUTER_COST", default_value = "dynamo",
          value_parser = parse_cost)]
    pub router_cost: RouterCost,
    /// With `--router-cost ttft`: what a millisecond of prefill stall on each of a worker's
    /// running requests costs against a millisecond of the new request's TTFT.
    #[arg(long, env = "KVENGINE_ROUTER_STALL_WEIGHT",
          default_value_t = engine::sched::config::DEFAULT_STALL_WEIGHT)]
    pub router_stall_weight: f64,
    /// Tokens per KV block; must equal the workers' page size (default 16, vLLM's and
    /// SGLang's; 32, TensorRT-LLM's `tokens_per_block`, when every worker with KV events is
    /// a TensorRT-LLM one).
    #[arg(long, env = "KVENGINE_KV_CACHE_BLOCK_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub kv_cache_block_size: Option<u32>,
    /// Softmax temperature over worker costs (0: always the cheapest).
    #[arg(long, env = "KVENGINE_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub router_temperature: f64,
    /// Weight of prefill work against decode load in a worker's cost (Dynamo's current
    /// name, `--router-kv-overlap-score-weight`, is accepted too).
    #[arg(
        long,
        alias = "router-kv-overlap-score-weight",
        env = "KVENGINE_KV_OVERLAP_SCORE_WEIGHT",
        default_value_t = 1.0
    )]
    pub kv_overlap_score_weight: f64,
    /// Route on the workers' KV events (the default; `--router-kv-events` too).
    /// `KVENGINE_KV_EVENTS=false` (or `--kv-events=false`) is `--no-kv-events`.
    #[arg(long, alias = "router-kv-events", env = "KVENGINE_KV_EVENTS",
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new(),
          overrides_with = "no_kv_events")]
    pub kv_events: Option<bool>,
    /// Workers publish no KV events: predict their caches from routing decisions
    /// (`--no-router-kv-events` too).
    #[arg(long, alias = "no-router-kv-events", overrides_with = "kv_events")]
    pub no_kv_events: bool,
    /// A worker whose reported KV usage exceeds this fraction is skipped while others are
    /// not busy.
    #[arg(long, env = "KVENGINE_BUSY_THRESHOLD")]
    pub busy_threshold: Option<f64>,
    /// A worker with more waiting requests than this is skipped while others are not busy.
    #[arg(long, env = "KVENGINE_BUSY_MAX_WAITING")]
    pub busy_max_waiting: Option<u64>,
    /// Active requests not finished after this many seconds are dropped from the load.
    #[arg(long, env = "KVENGINE_REQUEST_TIMEOUT_SECS", default_value_t = 300)]
    pub request_timeout_secs: u64,
    /// The most active (routed, not freed) requests one worker rank may carry; with every
    /// rank at it, routing answers 429 with Retry-After. 0: no limit.
    #[arg(long, env = "KVENGINE_MAX_ACTIVE_REQUESTS_PER_WORKER",
          default_value_t = engine::sched::config::DEFAULT_MAX_ACTIVE_PER_KEY)]
    pub max_active_requests_per_worker: u64,
    /// The most requests active (routed, not freed) in this router at once, over every
    /// worker and model; past it routing answers 503 `overloaded` with Retry-After. 0: no
    /// limit.
    #[arg(long, env = "KVENGINE_MAX_ACTIVE_REQUESTS",
          default_value_t = transport::bounds::DEFAULT_MAX_ACTIVE_REQUESTS as u64)]
    pub max_active_requests: u64,
    /// The most blocks (engine hashes) the index keeps for one worker rank; a store past it
    /// is refused whole (`worker_full`) and the rank reported degraded. 0: no limit.
    #[arg(long, env = "KVENGINE_MAX_BLOCKS_PER_WORKER",
          default_value_t = engine::directories::DEFAULT_MAX_BLOCKS_PER_KEY as u64)]
    pub max_blocks_per_worker: u64,
    /// The most heap bytes the index and the workers' directories may take; while over it
    /// (checked every health-check round), stores are refused (`index_full`), removals still
    /// apply. 0: no budget.
    #[arg(long, env = "KVENGINE_MAX_INDEX_BYTES", default_value_t = 0)]
    pub max_index_bytes: u64,

    /// Subscribe to a worker's KV events: `ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]`
    /// (repeatable; the env var takes a `;`-separated list).
    #[arg(long = "zmq-worker", env = "KVENGINE_ZMQ_WORKERS", value_delimiter = ';',
          value_parser = parse_zmq)]
    pub zmq_workers: Vec<ZmqSource>,
    /// The largest ZMQ message (all its frames) a KV-event publisher or its replay socket
    /// may send; a frame header that would exceed it is refused before its bytes are read
    /// (counted `reason="oversized"`, the connection closed and made again). The default is
    /// the largest batch the decoder takes (64 MiB) plus 64 KiB for the topic and seq.
    #[arg(long, env = "KVENGINE_ZMQ_MAX_MESSAGE_BYTES",
          default_value_t = transport::zmq::zmtp::DEFAULT_MAX_MESSAGE_BYTES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=(1 << 40)))]
    pub zmq_max_message_bytes: usize,
    /// Poll a TensorRT-LLM worker's KV events (`POST {URL}/kv_cache_events` of
    /// `trtllm-serve`): `ID=http://HOST:PORT[,poll_ms=N]` (repeatable; the env var takes a
    /// `;`-separated list). The URL is also where its requests go.
    #[arg(long = "trtllm-worker", env = "KVENGINE_TRTLLM_WORKERS", value_delimiter = ';',
          value_parser = parse_trtllm)]
    pub trtllm_workers: Vec<TrtllmSource>,
    /// A worker, whole: `id=1,url=http://gpu-1:8000,model=NAME,role=prefill,
    /// zmq=tcp://gpu-1:5557,replay=tcp://gpu-1:5558,dp_ranks=0:1,api_key=KEY` (repeatable;
    /// the env var takes a `;`-separated list). The config file's `[[workers]]` take the
    /// same keys.
    #[arg(long = "worker", env = "KVENGINE_WORKER", value_delimiter = ';',
          value_parser = crate::config_file::WorkerEntry::from_spec)]
    pub workers: Vec<crate::config_file::WorkerEntry>,
    /// A served model: `NAME[,block_size=N][,tokenizer=SPEC]` (repeatable; `;`-separated in
    /// the env var). Requests are routed by their `model` among that model's workers, at its
    /// block size, tokenized with its tokenizer; an unknown model gets 404 `model_not_found`.
    #[arg(long = "model", env = "KVENGINE_MODEL", value_delimiter = ';',
          value_parser = crate::config_file::ModelEntry::from_spec)]
    pub models: Vec<crate::config_file::ModelEntry>,
    /// Accept native (QUIC + rkyv) publishers on this address; needs an ingest token
    /// (--ingest-token, --scoped-ingest-token or --ingest-token-file).
    #[arg(long, env = "KVENGINE_QUIC")]
    pub quic: Option<SocketAddr>,
    /// Log lines as `text` or `json` (one object per line). The level filter is
    /// `KVENGINE_LOG`, else `RUST_LOG` (e.g. `info,transport=debug`), else `info`.
    #[arg(long, env = "KVENGINE_LOG_FORMAT", value_enum, default_value_t = crate::logging::LogFormat::Text)]
    pub log_format: crate::logging::LogFormat,
    /// A TOML file of settings (any long flag, by name) and `[[workers]]` (docs/api.md
    /// "Configuration file"). Flags beat environment variables, which beat the file.
    #[arg(long, env = "KVENGINE_CONFIG")]
    pub config: Option<PathBuf>,
    /// A token QUIC publishers may present to publish for ANY worker (kept for
    /// compatibility: --scoped-ingest-token and --ingest-token-file bind a publisher to the
    /// workers it may write).
    #[arg(long, env = "KVENGINE_INGEST_TOKEN", hide_env_values = true)]
    pub ingest_token: Option<String>,
    /// A QUIC ingest token bound to the workers it may publish for: `WORKERS=TOKEN`, WORKERS
    /// `*` or worker ids and ranges such as `1,4-7` (repeatable; `;`-separated in the env
    /// var). Each token once; a hello for a worker its token does not cover is refused.
    #[arg(
        long = "scoped-ingest-token",
        env = "KVENGINE_SCOPED_INGEST_TOKEN",
        value_delimiter = ';',
        hide_env_values = true
    )]
    pub scoped_ingest_tokens: Vec<transport::native::ScopedToken>,
    /// A file of QUIC ingest tokens, one `WORKERS=TOKEN` a line as --scoped-ingest-token
    /// takes them (blank lines and `#` comments skipped); read at start.
    #[arg(long, env = "KVENGINE_INGEST_TOKEN_FILE")]
    pub ingest_token_file: Option<PathBuf>,
    /// Milliseconds a QUIC connection has, from its first packet, to complete the TLS
    /// handshake and have its authenticated hello accepted; then it is closed (counted as
    /// `hello_timeout`).
    #[arg(long, env = "KVENGINE_QUIC_HELLO_TIMEOUT_MS",
          default_value_t = transport::native::HELLO_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub quic_hello_timeout_ms: u64,
    /// QUIC connections not authenticated yet (handshake or hello pending), at most; a new
    /// connection past it is refused at once (counted as `too_many_unauthenticated`).
    #[arg(long, env = "KVENGINE_QUIC_MAX_UNAUTHENTICATED",
          default_value_t = transport::native::MAX_UNAUTHENTICATED as u32,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub quic_max_unauthenticated: u32,
    /// The bearer token HTTP control calls (`POST`/`DELETE /v1/workers`, `/v1/events`,
    /// `/v1/load`) must carry. Without it, control calls are accepted from this host only.
    #[arg(long, env = "KVENGINE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The bearer token routing calls (`POST /v1/route`, `/v1/overlap`,
    /// `/v1/requests/...`) must carry (the admin token passes too). Without it the routing
    /// API is open to whoever reaches the edge (each client's reservations stay its own and
    /// capped).
    #[arg(long, env = "KVENGINE_ROUTING_TOKEN", hide_env_values = true)]
    pub routing_token: Option<String>,
    /// The most route reservations (`POST /v1/route` not yet freed) one client (peer
    /// address; IPv6: its /64) may hold; past it, routing answers 429
    /// `too_many_reservations`. 0: no cap.
    #[arg(long, env = "KVENGINE_MAX_RESERVATIONS_PER_CLIENT",
          default_value_t = transport::reservations::DEFAULT_MAX_RESERVATIONS_PER_CLIENT as u64)]
    pub max_reservations_per_client: u64,
    /// A route reservation never freed is dropped from the load after this many seconds
    /// (requests the router proxies itself keep --request-timeout-secs).
    #[arg(long, env = "KVENGINE_RESERVATION_TIMEOUT_SECS",
          default_value_t = transport::reservations::DEFAULT_RESERVATION_TIMEOUT.as_secs())]
    pub reservation_timeout_secs: u64,
    /// The most HTTP connections one core serves at once; one more is answered 503
    /// `too_many_connections` and closed.
    #[arg(long, env = "KVENGINE_MAX_CONNECTIONS_PER_CORE",
          default_value_t = transport::http::conn::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections_per_core: usize,
    /// Seconds a client has to send a request's headers; an idle keep-alive connection is
    /// closed after the same time.
    #[arg(long, env = "KVENGINE_HTTP_HEADER_TIMEOUT_SECS",
          default_value_t = transport::http::conn::DEFAULT_HEADER_TIMEOUT.as_secs_f64())]
    pub http_header_timeout_secs: f64,
    /// Seconds a client has to send a request's body once its headers arrived (408).
    #[arg(long, env = "KVENGINE_HTTP_BODY_TIMEOUT_SECS",
          default_value_t = transport::http::DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    pub http_body_timeout_secs: f64,
    /// Seconds a response may stay unread by its client (its receive window full) before
    /// the connection is closed.
    #[arg(long, env = "KVENGINE_HTTP_WRITE_TIMEOUT_SECS",
          default_value_t = transport::http::conn::DEFAULT_WRITE_TIMEOUT.as_secs_f64())]
    pub http_write_timeout_secs: f64,
    /// The only hosts `POST /v1/workers` may point the router at (in `url`, `zmq`,
    /// `replay`): names or addresses, or `*.suffix` (comma-separated). Default: any host an
    /// authenticated admin names. Workers from flags and the config file are not checked;
    /// registrations restored from a snapshot (this router's or a peer replica's) are.
    #[arg(long, env = "KVENGINE_WORKER_HOSTS", value_delimiter = ',')]
    pub worker_hosts: Vec<String>,
    /// PEM file of the CA certificates `https://` workers must present a chain to (it
    /// replaces the public web roots compiled in, which are used without it). Worker API
    /// keys and clients' Authorization headers then travel encrypted.
    #[arg(long, env = "KVENGINE_WORKER_CA")]
    pub worker_ca: Option<PathBuf>,
    /// TLS certificate chain (PEM): the HTTP edge then serves HTTPS only, and QUIC uses it
    /// too (without it QUIC generates a self-signed one and logs its fingerprint).
    #[arg(
        long,
        alias = "tls-cert-path",
        env = "KVENGINE_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM: PKCS#8, RSA or SEC1) of `--tls-cert`.
    #[arg(
        long,
        alias = "tls-key-path",
        env = "KVENGINE_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Seconds between health checks of workers registered with a `url`.
    #[arg(long, env = "KVENGINE_HEALTH_INTERVAL_SECS", default_value_t = 2.0)]
    pub health_interval_secs: f64,
    /// Consecutive failed checks that take a worker out of routing.
    #[arg(long, env = "KVENGINE_HEALTH_FAILURES", default_value_t = 3)]
    pub health_failures: u32,
    /// The model's tokenizer (a directory with `tokenizer.json` and `tokenizer_config.json`,
    /// the `tokenizer.json` file, or a Hugging Face repo id such as `Qwen/Qwen2.5-7B-Instruct`:
    /// looked up in the local cache under `HF_HOME`, else downloaded into it from
    /// `HF_ENDPOINT` with `HF_TOKEN`): the OpenAI front door tokenizes prompts with it exactly
    /// as the workers do. `stand-in` names the built-in one-token-per-word stand-in shared
    /// with `kvengine sim` (the default with simulated workers only); with real workers
    /// (`--zmq-worker`) in kv mode it must be asked for by that name: a real model's blocks
    /// would never match its ids, and kv routing would silently become load balancing.
    #[arg(long, env = "KVENGINE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Start this many simulated vLLM (or --sim-engine) workers in this process, registered
    /// and subscribed,
    /// so the OpenAI front door works with no GPU (`curl localhost:8000/v1/chat/completions`).
    #[arg(long, env = "KVENGINE_SIM_WORKERS", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub sim_workers: u16,
    /// Simulated workers run this many times faster than real time.
    #[arg(long, env = "KVENGINE_SIM_SPEEDUP", default_value_t = 1.0)]
    pub sim_speedup: f64,
    /// The engine the simulated workers imitate: vllm (KV events over ZMQ) or trtllm
    /// (TensorRT-LLM: the router polls each one's POST /kv_cache_events; blocks of 32
    /// tokens unless --kv-cache-block-size says otherwise).
    #[arg(long, env = "KVENGINE_SIM_ENGINE", default_value = "vllm",
          value_parser = lab::replay::parse_engine)]
    pub sim_engine: lab::workers::EventFormat,
    /// KV-cache blocks of each simulated worker.
    #[arg(long, env = "KVENGINE_SIM_KV_BLOCKS")]
    pub sim_kv_blocks: Option<u32>,
    /// Of the --sim-workers, this many are prefill workers (ids 1..), the next
    /// --sim-decode-workers decode workers; they speak --disagg-protocol.
    #[arg(long, env = "KVENGINE_SIM_PREFILL_WORKERS", default_value_t = 0)]
    pub sim_prefill_workers: u16,
    /// Of the --sim-workers, this many are decode workers (after the prefill ones).
    #[arg(long, env = "KVENGINE_SIM_DECODE_WORKERS", default_value_t = 0)]
    pub sim_decode_workers: u16,
    #[command(flatten)]
    pub disagg: DisaggArgs,
    #[command(flatten)]
    pub replicas: crate::replicas::ReplicaArgs,
}

fn parse_mode(s: &str) -> Result<RouteMode, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

fn parse_cost(s: &str) -> Result<RouterCost, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

fn parse_trtllm(s: &str) -> Result<TrtllmSource, String> {
    s.parse()
        .map_err(|e: transport::TransportError| e.to_string())
}

fn parse_zmq(s: &str) -> Result<ZmqSource, String> {
    s.parse()
        .map_err(|e: transport::TransportError| e.to_string())
}

impl ServeArgs {
    /// Tokens per block: `--kv-cache-block-size`, else 32 when every worker with KV events
    /// (flags and config file) is a TensorRT-LLM one, else 16.
    pub fn block_size(&self) -> Result<u32> {
        if let Some(b) = self.kv_cache_block_size {
            return Ok(b);
        }
        let (workers, _) = config_workers(self)?;
        let trtllm = !self.trtllm_workers.is_empty()
            || workers.iter().any(|w| w.is_trtllm())
            || (self.sim_workers > 0 && self.sim_engine.is_trtllm());
        let others = !self.zmq_workers.is_empty()
            || workers
                .iter()
                .any(|w| w.zmq.is_some() || w.kv_events_config.is_some());
        Ok(if trtllm && !others {
            transport::trtllm::DEFAULT_BLOCK_SIZE
        } else {
            engine::hash::DEFAULT_BLOCK_SIZE as u32
        })
    }

    fn scheduler(&self) -> Result<SchedulerConfig> {
        let config = SchedulerConfig {
            block_size: self.block_size()?,
            mode: self.router_mode,
            overlap_weight: self.kv_overlap_score_weight,
            decode_overlap_weight: self.disagg.decode_overlap_weight,
            temperature: self.router_temperature,
            busy: BusyThresholds {
                max_waiting: self.busy_max_waiting,
                max_kv_usage: self.busy_threshold,
            },
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            // Replicas behind one balancer must not draw the same random sequence: their
            // random picks, samples and tie-breaks would line up on the same workers.
            seed: match self.replicas.config()? {
                Some(_) => transport::replicas::new_replica_id().0,
                None => 0,
            },
            cost: self.router_cost,
            stall_weight: self.router_stall_weight,
            max_active_per_key: (self.max_active_requests_per_worker > 0)
                .then_some(self.max_active_requests_per_worker),
        };
        config.validate().context(
            "--router-temperature, --kv-overlap-score-weight, --decode-overlap-weight, \
                 --router-stall-weight or --busy-threshold",
        )?;
        Ok(config)
    }
}

impl ServeArgs {
    /// The bounds of `--max-active-requests`, `--max-blocks-per-worker`, `--max-index-bytes`
    /// (0: none).
    pub(crate) fn limits(&self) -> transport::bounds::Limits {
        let some = |n: u64| (n > 0).then(|| usize::try_from(n).unwrap_or(usize::MAX));
        transport::bounds::Limits {
            max_index_bytes: (self.max_index_bytes > 0).then_some(self.max_index_bytes),
            max_active_requests: some(self.max_active_requests),
            max_blocks_per_key: some(self.max_blocks_per_worker),
            max_reservations_per_client: some(self.max_reservations_per_client),
            reservation_timeout: Some(Duration::from_secs(self.reservation_timeout_secs.max(1))),
        }
    }

    /// The HTTP edge's connection bounds (`--max-connections-per-core`,
    /// `--http-header-timeout-secs`, `--http-write-timeout-secs`).
    pub fn conn_limits(&self) -> transport::http::conn::ConnLimits {
        let secs = |s: f64| Duration::from_secs_f64(s.max(0.001));
        transport::http::conn::ConnLimits {
            max_connections: self.max_connections_per_core.max(1),
            header_timeout: secs(self.http_header_timeout_secs),
            write_timeout: secs(self.http_write_timeout_secs),
            ..transport::http::conn::ConnLimits::default()
        }
    }

    /// `--max-prompt-tokens`, if set.
    pub fn prompt_cap(&self) -> Option<usize> {
        (self.max_prompt_tokens > 0).then_some(self.max_prompt_tokens)
    }

    /// `--max-body-bytes`, else the limit that fits the prompt cap.
    pub fn body_limit(&self) -> usize {
        self.max_body_bytes.unwrap_or_else(|| {
            transport::http::body_limit_for(
                self.prompt_cap()
                    .unwrap_or(transport::http::DEFAULT_MAX_PROMPT_TOKENS),
            )
        })
    }

    /// The QUIC ingest tokens: --ingest-token (any worker), --scoped-ingest-token and the
    /// lines of --ingest-token-file. A token given twice, or an empty one, is an error
    /// (an empty --ingest-token counts as none).
    fn ingest_credentials(&self) -> Result<IngestCredentials> {
        let mut creds = IngestCredentials::default();
        if let Some(token) = self.ingest_token.as_deref().filter(|t| !t.is_empty()) {
            creds.insert(ScopedToken::any_worker(token))?;
        }
        for token in &self.scoped_ingest_tokens {
            creds
                .insert(token.clone())
                .context("--scoped-ingest-token")?;
        }
        if let Some(path) = &self.ingest_token_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --ingest-token-file {}", path.display()))?;
            creds
                .insert_lines(&text)
                .with_context(|| format!("--ingest-token-file {}", path.display()))?;
        }
        Ok(creds)
    }

    /// Whether the router runs without KV events (`--no-kv-events`, or `--kv-events=false`
    /// / `KVENGINE_KV_EVENTS=false`).
    pub fn approximate(&self) -> bool {
        self.no_kv_events || self.kv_events == Some(false)
    }
}

/// The workers and models of `--worker` / `--model` and `--config`'s file, checked
/// together (an id or name given twice is an error).
fn config_workers(
    args: &ServeArgs,
) -> Result<(
    Vec<crate::config_file::WorkerEntry>,
    Vec<crate::config_file::ModelEntry>,
)> {
    let (mut workers, mut models) = (args.workers.clone(), args.models.clone());
    if let Some(path) = &args.config {
        let file = crate::config_file::load(path)?;
        workers.extend(file.workers);
        models.extend(file.models);
    }
    crate::config_file::check(&workers, &models).context("--worker / --model / --config")?;
    Ok((workers, models))
}

/// Loads a tokenizer as `--tokenizer` names it: `None` for the stand-in. A Hugging Face repo
/// id missing from the local cache is downloaded into it (`HF_ENDPOINT`, `HF_TOKEN`;
/// `HF_HUB_OFFLINE` forbids it), so the next start needs no network.
fn load_tokenizer(spec: &str) -> Result<Option<Arc<PromptTokenizer>>> {
    if spec == STAND_IN {
        return Ok(None);
    }
    let hf_home = std::env::var_os("HF_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface")))
        .unwrap_or_else(|| PathBuf::from(".cache/huggingface"));
    let path = match PromptTokenizer::resolve(spec, &hf_home) {
        Ok(path) => path,
        // `resolve` takes any existing path as is, so a failure for a repo id's shape means
        // "not in the cache": the one case a download can mend.
        Err(_) if PromptTokenizer::is_repo_id(spec) => {
            let hub = transport::openai::tokenize::HubOptions::from_env();
            match PromptTokenizer::fetch(spec, &hf_home, &hub) {
                Ok(dir) => {
                    println!(
                        "kvengine: downloaded tokenizer of {spec} into {}",
                        dir.display()
                    );
                    dir
                }
                Err(download) => bail!(
                    "{spec} is not in the Hugging Face cache under {}, and the download failed: \
                     {download}",
                    hf_home.join("hub").display()
                ),
            }
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Some(Arc::new(PromptTokenizer::from_path(&path)?)))
}

/// `--tokenizer stand-in`: the built-in stand-in, asked for by name.
const STAND_IN: &str = "stand-in";

pub fn run(args: &ServeArgs) -> Result<()> {
    crate::logging::init("info", args.log_format);
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = args.cores.map_or(available, usize::from);
    let scheduler = args.scheduler()?;
    if args.quic.is_some() && args.ingest_credentials()?.is_empty() {
        bail!(
            "--quic needs --ingest-token, --scoped-ingest-token or --ingest-token-file (or \
             KVENGINE_INGEST_TOKEN, ..._SCOPED_INGEST_TOKEN, ..._INGEST_TOKEN_FILE): \
             publishers must authenticate"
        );
    }
    if u32::from(args.sim_prefill_workers) + u32::from(args.sim_decode_workers)
        > u32::from(args.sim_workers)
    {
        bail!("--sim-prefill-workers plus --sim-decode-workers exceed --sim-workers");
    }
    args.disagg.config()?;
    if args.sim_workers > 0 && !(args.sim_speedup.is_finite() && args.sim_speedup > 0.0) {
        bail!("--sim-speedup must be a finite number above 0");
    }
    if args.approximate() && !args.zmq_workers.is_empty() {
        bail!("--zmq-worker subscribes to KV events, which --no-kv-events turns off");
    }
    if args.approximate() && !args.trtllm_workers.is_empty() {
        bail!("--trtllm-worker polls KV events, which --no-kv-events turns off");
    }
    let (workers, models) = config_workers(args)?;
    // A publishing worker whose model has no tokenizer of its own falls back to
    // --tokenizer: that must then be given.
    let own_tokenizer = |m: &Option<String>| {
        models
            .iter()
            .any(|e| Some(&e.name) == m.as_ref() && e.tokenizer.is_some())
    };
    let untokenized_publishers = workers.iter().any(|w| {
        (w.zmq.is_some() || w.kv_events_config.is_some() || w.is_trtllm())
            && !own_tokenizer(&w.model)
    });
    if args.tokenizer.is_none()
        && (!args.zmq_workers.is_empty()
            || !args.trtllm_workers.is_empty()
            || untokenized_publishers)
        && scheduler.mode == engine::sched::RouteMode::Kv
    {
        bail!(
            "real workers (--zmq-worker, --trtllm-worker) and no --tokenizer: the OpenAI \
             front door would \
             tokenize prompts with the one-token-per-word stand-in, no block would ever match \
             what the workers cache, and kv routing would become load balancing. Pass \
             --tokenizer <the model's tokenizer directory or tokenizer.json>, or \
             --tokenizer {STAND_IN} to use the stand-in anyway (when clients send token ids \
             to /v1/route only)"
        );
    }
    let rx = crate::signals::stop_channel()?;

    let sharding = Sharding::configured(cores, args.replicate_depth, args.hub_fanout)
        .context("invalid sharding flags")?;
    println!(
        "kvengine: {cores} core thread(s) up ({available} CPU(s) available); sharding {}",
        sharding.describe()
    );
    println!("kvengine: {}", crate::memory::huge_pages().describe());
    let engine = RuntimeConfig {
        ring_capacity: args.ring_capacity as usize,
        pin_cores: !args.no_pin,
        call_timeout: Duration::from_millis(args.engine_timeout_ms),
        max_blocks_per_key: args.limits().max_blocks_per_key,
        ..RuntimeConfig::default()
    };
    let summaries = match args.http_threads {
        Some(n) => run_threaded(
            args,
            HubConfig { scheduler },
            sharding,
            engine,
            n.into(),
            rx,
        )?,
        None => run_on_cores(args, HubConfig { scheduler }, sharding, engine, rx)?,
    };
    for s in &summaries {
        println!(
            "kvengine: {} applied {} block ops, answered {} queries, {} entries live",
            s.shard, s.applied, s.queries, s.index.entries
        );
    }
    println!("kvengine: stopped");
    Ok(())
}

fn print_pinning(no_pin: bool, pinned: &[Option<usize>]) {
    let cores = pinned.len();
    let pinned_count = pinned.iter().flatten().count();
    if no_pin {
        println!("kvengine: pinning disabled (--no-pin)");
    } else if pinned_count < cores {
        println!(
            "kvengine: pinned {pinned_count} of {cores} core threads; the other {} share CPUs \
             (more core threads than CPUs)",
            cores - pinned_count
        );
    } else {
        println!("kvengine: every core thread pinned to its own CPU");
    }
}

fn hub_for(args: &ServeArgs, hub: Hub) -> Result<Arc<Hub>> {
    let hub = hub.with_limits(args.limits());
    Ok(Arc::new(if args.approximate() {
        hub.without_kv_events(ApproxConfig::default())?
    } else {
        hub
    }))
}

/// The default layout: the edge on the cores. Each core thread runs a single-threaded
/// runtime that accepts its share of HTTP connections (one `SO_REUSEPORT` listener per
/// core), runs the subscriptions of the workers homed on it, and steps its engine core in
/// between (`transport::cores`). Core 0 also runs the setup, QUIC, the simulated workers and
/// the health checks. No other thread serves requests.
fn run_on_cores(
    args: &ServeArgs,
    config: HubConfig,
    sharding: Sharding,
    engine: RuntimeConfig,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<CoreSummary>> {
    let policy = sharding.describe();
    let shards = engine::sharding::ShardPolicy::shards(&sharding);
    let mut peer = crate::replicas::fetch_snapshot(&args.replicas);
    let (hosted, warm) = crate::warm::start_engine(
        peer.snapshot.take(),
        args.state_dir.as_deref(),
        args.snapshot_interval_s,
        shards,
        &policy,
        |image| start_hosted_from(sharding.clone(), engine, image),
    )?;
    let cores = hosted.cores.len();
    let hub = hub_for(args, Hub::hosted(config, hosted.ingest, hosted.query)?)?;
    peer.record(&hub);
    if let Some(w) = &warm {
        w.record(&hub);
    }
    let mut warm = warm;
    let listeners = reuseport_listeners(&args.http_host, args.http_port, cores)?;
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let (app_tx, app_rx) = tokio::sync::watch::channel::<Option<Edge>>(None);
    let mut app_tx = Some(app_tx);
    let mut handle_rx = Some(handle_rx);
    let shared_tls = edge_tls(args)?;
    let results: Vec<Result<CoreSummary>> = std::thread::scope(|scope| {
        let mut threads = Vec::with_capacity(cores);
        for (k, (host, listener)) in hosted.cores.into_iter().zip(listeners).enumerate() {
            let (hub, stop, handle_tx, app_rx, tls, policy) = (
                hub.clone(),
                stop.clone(),
                handle_tx.clone(),
                app_rx.clone(),
                shared_tls.clone(),
                policy.clone(),
            );
            let setup = if k == 0 {
                app_tx
                    .take()
                    .zip(handle_rx.take())
                    .map(|(a, h)| (a, h, warm.take()))
            } else {
                None
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvengine-core-{k}"))
                .spawn_scoped(scope, move || -> Result<CoreSummary> {
                    let pinned = host.pin_current_thread();
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .context("cannot start a core's runtime")?;
                    let _ = handle_tx.send((k, pinned, rt.handle().clone()));
                    drop(handle_tx);
                    cores::install(host);
                    let served = rt.block_on(async move {
                        tokio::spawn(cores::drive());
                        let listener =
                            tokio::net::TcpListener::from_std(listener).context("HTTP listener")?;
                        match setup {
                            Some((app_tx, handles, warm)) => {
                                let handles = collect_handles(handles, cores, args.no_pin)?;
                                let share = Some(app_tx);
                                let startup = Startup { tls, warm, policy };
                                serve(hub, args, stop, listener, handles, share, startup).await
                            }
                            None => serve_share(listener, app_rx, stop).await,
                        }
                    });
                    // Ends every task left (subscriptions, connections, health checks).
                    drop(rt);
                    let summary = cores::finish().context("the core is gone")?;
                    served?;
                    Ok(summary)
                });
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    tracing::error!("cannot start core thread {k}: {e}");
                    break;
                }
            }
        }
        drop((hub, handle_tx, app_tx, app_rx));
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a core thread panicked")))
            })
            .collect()
    });
    if results.len() < cores {
        bail!("only {} of {cores} core threads started", results.len());
    }
    results.into_iter().collect()
}

/// The runtimes of every core, by core, as each thread reports its own (it also reports the
/// CPU it pinned itself to, printed here).
fn collect_handles(
    rx: std::sync::mpsc::Receiver<(usize, Option<usize>, tokio::runtime::Handle)>,
    cores: usize,
    no_pin: bool,
) -> Result<Homes> {
    let mut handles: Vec<Option<tokio::runtime::Handle>> = vec![None; cores];
    let mut pinned = vec![None; cores];
    for _ in 0..cores {
        let (k, cpu, h) = rx
            .recv()
            .context("a core thread ended before its runtime started")?;
        if let (Some(slot), Some(p)) = (handles.get_mut(k), pinned.get_mut(k)) {
            (*slot, *p) = (Some(h), cpu);
        }
    }
    print_pinning(no_pin, &pinned);
    println!("kvengine: HTTP and ingest run on the core threads");
    let handles: Option<Vec<_>> = handles.into_iter().collect();
    Homes::new(handles.context("a core's runtime is missing")?).context("no core runtimes")
}

/// The HTTP edge's TLS settings (`--tls-cert` / `--tls-key`), if it serves HTTPS.
fn edge_tls(args: &ServeArgs) -> Result<Option<EdgeTls>> {
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(
            transport::http::tls::server_config(cert, key).context("--tls-cert / --tls-key")?,
        )),
        _ => Ok(None),
    }
}

type EdgeTls = Arc<transport::http::tls::TlsServerConfig>;

use transport::http::conn::Edge;

/// Another core's share of the HTTP edge: the edge core 0 built, on this core's listener.
async fn serve_share(
    listener: tokio::net::TcpListener,
    mut app: tokio::sync::watch::Receiver<Option<Edge>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let Ok(ready) = app.wait_for(Option::is_some).await else {
        // Core 0's setup failed; it reports why.
        return Ok(());
    };
    let Some(edge) = ready.clone() else {
        return Ok(());
    };
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    transport::http::conn::serve(listener, edge, shutdown)
        .await
        .context("HTTP edge")
}

/// What to warn about at start when the control plane (registering workers, KV events,
/// load) is served without a token on an address others can reach: the loopback-only rule
/// then stands between anyone on the network and the router's index, and any proxy or
/// sidecar on this host that forwards traffic makes every client look local.
pub(crate) fn control_plane_warning(args: &ServeArgs, addr: SocketAddr) -> Option<String> {
    let token = args.admin_token.as_deref().is_some_and(|t| !t.is_empty());
    (!token && !addr.ip().is_loopback()).then(|| {
        format!(
            "the control plane (POST /v1/workers, /v1/events, /v1/load) is served on {addr} \
             without --admin-token: it is refused to other hosts, but every client behind a \
             proxy or sidecar on this host arrives from 127.0.0.1 and passes; set \
             --admin-token (KVENGINE_ADMIN_TOKEN) (docs/api.md \"Security\")"
        )
    })
}

/// `cores` listeners on one address with `SO_REUSEPORT`, so the kernel spreads connections
/// over the cores (with port 0, the port the first one got).
fn reuseport_listeners(host: &str, port: u16, cores: usize) -> Result<Vec<std::net::TcpListener>> {
    use std::net::ToSocketAddrs;
    let context = || format!("--http-host/--http-port {host}:{port}");
    let mut addr = (host, port)
        .to_socket_addrs()
        .with_context(context)?
        .next()
        .with_context(context)?;
    // SO_REUSEPORT lets any process of this user join a port already listened on; a second
    // kvengine started on the same port would silently take half the connections. Probe
    // with a plain socket first, which fails if anything listens there.
    if port != 0 {
        drop(std::net::TcpListener::bind(addr).with_context(context)?);
    }
    // Registering a socket needs a runtime; the listeners move to the cores' runtimes.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .context("cannot start a runtime to bind with")?;
    let _entered = rt.enter();
    let mut out = Vec::with_capacity(cores);
    for _ in 0..cores {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .with_context(context)?;
        socket.set_reuseaddr(true).with_context(context)?;
        socket.set_reuseport(true).with_context(context)?;
        socket.bind(addr).with_context(context)?;
        let listener = socket.listen(1024).with_context(context)?;
        addr = listener.local_addr().with_context(context)?;
        out.push(listener.into_std().with_context(context)?);
    }
    Ok(out)
}

/// The comparison layout (`--http-threads N`): core threads of their own and a separate
/// N-thread runtime for HTTP and ingest, which reaches the cores over rings and parks for
/// their replies. Kept to measure the edge on the cores against (docs/architecture.md).
fn run_threaded(
    args: &ServeArgs,
    config: HubConfig,
    sharding: Sharding,
    engine: RuntimeConfig,
    http_threads: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<CoreSummary>> {
    let cores = engine::sharding::ShardPolicy::shards(&sharding);
    let engine = RuntimeConfig {
        ingest_handles: cores,
        query_handles: http_threads + 1,
        ..engine
    };
    let policy = sharding.describe();
    let mut peer = crate::replicas::fetch_snapshot(&args.replicas);
    let ((hub, runtime), warm) = crate::warm::start_engine(
        peer.snapshot.take(),
        args.state_dir.as_deref(),
        args.snapshot_interval_s,
        cores,
        &policy,
        |image| start_engine_from(config, sharding.clone(), engine, image),
    )?;
    let hub = hub_for(args, hub)?;
    peer.record(&hub);
    if let Some(w) = &warm {
        w.record(&hub);
    }
    print_pinning(args.no_pin, runtime.pinned());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(http_threads)
        .thread_name("kvengine-io")
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.http_host.as_str(), args.http_port))
            .await
            .with_context(|| {
                format!(
                    "--http-host/--http-port {}:{}",
                    args.http_host, args.http_port
                )
            })?;
        let spawner = Homes::new(vec![tokio::runtime::Handle::current()])
            .context("no runtime for the subscriptions")?;
        serve(
            hub.clone(),
            args,
            stop,
            listener,
            spawner,
            None,
            Startup {
                tls: edge_tls(args)?,
                warm,
                policy: policy.clone(),
            },
        )
        .await
    });
    // Dropping the runtime ends every task (subscriptions, connections, health checks).
    drop(rt);
    println!("kvengine: stopping: draining the cores");
    let hub = Arc::try_unwrap(hub).map_err(|_| anyhow::anyhow!("the hub is still shared"))?;
    drop(hub);
    let summaries = runtime.join().context("a shard thread failed")?;
    served?;
    Ok(summaries)
}

/// The running subscriptions and pollers, by worker and source.
type SubscriptionTasks = HashMap<(WorkerId, String), JoinHandle<()>>;

/// One subscription per (worker, publisher endpoint): a data-parallel worker has one
/// publisher per rank, all under the same worker id; and the settings new ZMQ
/// subscriptions get.
#[derive(Clone, Default)]
struct Subscriptions {
    tasks: Arc<Mutex<SubscriptionTasks>>,
    zmq: SubscriberConfig,
}

/// Ends `worker`'s subscriptions (all, or all but the one to `keep`).
fn unsubscribe(subs: &Subscriptions, worker: WorkerId, keep: Option<&str>) {
    let mut subs = subs
        .tasks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    subs.retain(|(w, publisher), task| {
        let gone = *w == worker && keep != Some(publisher.as_str());
        if gone {
            task.abort();
        }
        !gone
    });
}

/// Registers (or updates) the config file's workers and subscribes to their events. An
/// update keeps the worker's indexed blocks; a changed publisher replaces its subscription.
fn register_file_workers(
    hub: &Arc<Hub>,
    subs: &Subscriptions,
    spawner: &Homes,
    outbound: &Outbound,
    workers: &[crate::config_file::WorkerEntry],
) -> Result<()> {
    for w in workers {
        let id = WorkerId(w.id);
        let endpoints = w.endpoints()?;
        let role = w
            .role
            .as_deref()
            .map(str::parse::<engine::sched::WorkerRole>)
            .transpose()
            .map_err(|e| anyhow::anyhow!("worker {}: role: {e}", w.id))?;
        hub.register(Registration {
            url: w.url.clone(),
            zmq: endpoints.as_ref().map(|(z, _)| z.clone()),
            replay: endpoints.as_ref().and_then(|(_, r)| r.clone()),
            dp_ranks: w.dp_ranks.iter().copied().map(engine::DpRank).collect(),
            role,
            api_key: w.api_key.clone(),
            model: w.model.clone(),
            trtllm_poll: w.trtllm_source()?.map(|s| s.poll_interval),
            ..Registration::new(id)
        })?;
        if let Some(source) = w.trtllm_source()? {
            println!(
                "kvengine: worker {} from the config file, KV events polled from {}",
                w.id,
                source.events_url()
            );
            unsubscribe(subs, id, Some(&source.events_url()));
            poll(hub, subs, spawner, outbound, source);
            continue;
        }
        match &endpoints {
            Some((zmq, _)) => println!(
                "kvengine: worker {} from the config file, KV events from {zmq}",
                w.id
            ),
            None => println!("kvengine: worker {} from the config file", w.id),
        }
        unsubscribe(subs, id, endpoints.as_ref().map(|(z, _)| z.as_str()));
        if let Some((zmq, replay)) = endpoints {
            subscribe(
                hub,
                subs,
                spawner,
                ZmqSource::new(id, &zmq, replay.as_deref())?.with_topic(w.topic()?),
            );
        }
    }
    Ok(())
}

/// How often the config file is checked for changes (a Kubernetes ConfigMap update swaps
/// the mounted file; no signal comes with it).
const CONFIG_POLL: Duration = Duration::from_secs(2);

/// What tells a changed config file from the one last read: its size and modification time
/// (`None` while it cannot be read).
fn file_stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()?))
}

/// On SIGHUP, or when the file changes, reads the config file's workers and models again:
/// new models get their pools, new and changed workers are registered, those gone from the
/// file are removed; everyone else keeps its index and subscription. A file that does not
/// load changes nothing (logged). `stamp` is the file's as of before it was first read, so
/// a change made while the router was starting is not missed.
#[cfg(unix)]
#[allow(clippy::too_many_arguments)] // the reload task's whole state, moved in once
async fn reload_on_sighup(
    path: PathBuf,
    mut stamp: Option<(u64, std::time::SystemTime)>,
    mut known: std::collections::BTreeSet<u64>,
    hub: Arc<Hub>,
    subs: Subscriptions,
    spawner: Homes,
    outbound: Outbound,
    mut hup: Option<tokio::signal::unix::Signal>,
) {
    let mut poll = tokio::time::interval(CONFIG_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let signalled = async {
            match hup.as_mut() {
                Some(h) => h.recv().await.is_some(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            alive = signalled => {
                if !alive {
                    hup = None;
                    continue;
                }
                // What is read now needs no second reload when the poll sees the change.
                stamp = file_stamp(&path);
            }
            _ = poll.tick() => {
                let now = file_stamp(&path);
                if now == stamp {
                    continue;
                }
                stamp = now;
                println!("kvengine: {} changed", path.display());
            }
        }
        let workers = match crate::config_file::load(&path) {
            Ok(f) => {
                // New models get their pools now; a model's tokenizer is read at start only.
                let declared = f.models.iter().try_for_each(|m| {
                    hub.declare_model(&ModelSpec {
                        name: m.name.clone(),
                        block_size: m.block_size,
                    })
                });
                if let Err(e) = declared {
                    tracing::error!("reloading {}: {e}; workers unchanged", path.display());
                    continue;
                }
                f.workers
            }
            Err(e) => {
                tracing::error!("reloading {}: {e:#}; workers unchanged", path.display());
                continue;
            }
        };
        if let Err(e) = register_file_workers(&hub, &subs, &spawner, &outbound, &workers) {
            tracing::error!("reloading {}: {e:#}", path.display());
            continue;
        }
        let now: std::collections::BTreeSet<u64> = workers.iter().map(|w| w.id).collect();
        for &gone in known.difference(&now) {
            // On its home core, streams first: none of its batches lands after it
            // (transport::cores::on_home).
            let (hub, subs) = (hub.clone(), subs.clone());
            let removed = cores::on_home(Some(&spawner), WorkerId(gone), move || {
                unsubscribe(&subs, WorkerId(gone), None);
                hub.remove_worker(WorkerId(gone))
            })
            .await;
            match removed {
                Some(Ok(_)) => println!("kvengine: worker {gone} left the config file; removed"),
                Some(Err(e)) => tracing::error!("removing worker {gone}: {e}"),
                None => tracing::error!("removing worker {gone}: the router is stopping"),
            }
        }
        println!(
            "kvengine: reloaded {} worker(s) from {}",
            now.len(),
            path.display()
        );
        known = now;
    }
}

/// Starts polling a TensorRT-LLM worker's events (once per worker and URL, as
/// [`subscribe`]), with a client of `outbound`.
fn poll(
    hub: &Arc<Hub>,
    subs: &Subscriptions,
    spawner: &Homes,
    outbound: &Outbound,
    source: TrtllmSource,
) {
    let mut subs = subs
        .tasks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let id = (source.worker, source.events_url());
    if subs.get(&id).is_some_and(|t| !t.is_finished()) {
        return;
    }
    let current = tokio::runtime::Handle::current();
    let on = spawner.home(source.worker).unwrap_or(&current);
    let task = transport::trtllm::spawn_poller_on(on, hub.clone(), source, outbound);
    subs.insert(id, task);
}

fn subscribe(hub: &Arc<Hub>, subs: &Subscriptions, spawner: &Homes, source: ZmqSource) {
    let mut tasks = subs
        .tasks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let id = (source.worker, source.publisher.clone());
    if tasks.get(&id).is_some_and(|t| !t.is_finished()) {
        // Already subscribed (a repeated registration): keep the stream and its fence.
        return;
    }
    let current = tokio::runtime::Handle::current();
    let on = spawner.home(source.worker).unwrap_or(&current);
    let task = spawn_subscriber_on(on, hub.clone(), source, subs.zmq);
    tasks.insert(id, task);
}

/// The setup and this thread's share of the edge: registrations and subscriptions, simulated
/// workers, QUIC, the app (shared with the other cores through `share`), health checks;
/// then HTTP (over `tls` when given) on `listener` until `stop`.
/// What the setup core starts with besides the hub: the edge's TLS and the state directory.
struct Startup {
    tls: Option<EdgeTls>,
    warm: Option<crate::warm::Warm>,
    /// The sharding policy (snapshots record it).
    policy: String,
}

async fn serve(
    hub: Arc<Hub>,
    args: &ServeArgs,
    mut stop: tokio::sync::watch::Receiver<bool>,
    listener: tokio::net::TcpListener,
    spawner: Homes,
    share: Option<tokio::sync::watch::Sender<Option<Edge>>>,
    Startup { tls, warm, policy }: Startup,
) -> Result<()> {
    let subs = Subscriptions {
        zmq: SubscriberConfig {
            limits: transport::zmq::zmtp::Limits {
                max_message_bytes: args.zmq_max_message_bytes,
                ..Default::default()
            },
            ..SubscriberConfig::default()
        },
        ..Subscriptions::default()
    };
    let outbound = Outbound::new(args.worker_ca.as_deref()).context("--worker-ca")?;
    if args.worker_ca.is_some() {
        println!(
            "kvengine: https:// workers are verified against {}",
            outbound.trust()
        );
    }
    // Before any subscription starts: restored workers get their resume points.
    let restoring = match warm.as_ref().and_then(|w| w.plan.as_ref()) {
        Some(plan) => Some(transport::state::begin_restore(&hub, plan)?),
        None => None,
    };
    for source in &args.zmq_workers {
        hub.register(Registration {
            zmq: Some(source.publisher.clone()),
            replay: source.replay.clone(),
            ..Registration::new(source.worker)
        })?;
        println!("kvengine: subscribing to worker {source}");
        subscribe(&hub, &subs, &spawner, source.clone());
    }
    for source in &args.trtllm_workers {
        hub.register(Registration {
            url: Some(source.url.to_string()),
            trtllm_poll: Some(source.poll_interval),
            ..Registration::new(source.worker)
        })?;
        println!("kvengine: polling TensorRT-LLM worker {source}");
        poll(&hub, &subs, &spawner, &outbound, source.clone());
    }
    // Taken before the file is read: a change from here on is reloaded.
    let stamp = args.config.as_deref().and_then(file_stamp);
    let (file_workers, models) = config_workers(args)?;
    let mut model_tokenizers = std::collections::HashMap::new();
    for m in &models {
        hub.declare_model(&ModelSpec {
            name: m.name.clone(),
            block_size: m.block_size,
        })?;
        if let Some(spec) = &m.tokenizer
            && let Some(t) =
                load_tokenizer(spec).with_context(|| format!("model {:?}: tokenizer", m.name))?
        {
            model_tokenizers.insert(m.name.clone(), t);
        }
        println!(
            "kvengine: serving model {:?} (block size {})",
            m.name,
            hub.block_size_in(&m.name)
        );
    }
    register_file_workers(&hub, &subs, &spawner, &outbound, &file_workers)?;
    #[cfg(unix)]
    if let Some(path) = args.config.clone() {
        // The file's own workers: those given with --worker are not the file's to remove.
        let known = file_workers
            .iter()
            .filter(|w| !args.workers.iter().any(|c| c.id == w.id))
            .map(|w| w.id)
            .collect();
        // Installed here, before the router says it is up: a SIGHUP that came before the
        // reload task first ran would otherwise take the default action and end the process.
        let hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot watch SIGHUP (reloads on file changes only): {e}");
                None
            }
        };
        tokio::spawn(reload_on_sighup(
            path,
            stamp,
            known,
            hub.clone(),
            subs.clone(),
            spawner.clone(),
            outbound.clone(),
            hup,
        ));
    }

    let tokenizer = match &args.tokenizer {
        Some(spec) => load_tokenizer(&spec.to_string_lossy()).context("--tokenizer")?,
        None => None,
    };
    let sims = start_sim_workers(&hub, &subs, &spawner, &outbound, args, tokenizer.clone()).await?;
    for r in &args.disagg.worker_roles {
        hub.register(Registration {
            role: Some(r.role),
            bootstrap_port: r.bootstrap_port,
            ..Registration::new(r.worker)
        })?;
        println!("kvengine: worker {} is a {} worker", r.worker, r.role);
    }

    let quic = match args.quic {
        Some(listen) => {
            let tls = match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => TlsSource::Files {
                    cert: cert.clone(),
                    key: key.clone(),
                },
                _ => TlsSource::SelfSigned {
                    names: vec!["localhost".into(), listen.ip().to_string()],
                },
            };
            let config = QuicServerConfig {
                credentials: args.ingest_credentials()?,
                // Each publisher's batches run on its worker's home core.
                homes: Some(spawner.clone()),
                hello_timeout: Duration::from_millis(args.quic_hello_timeout_ms),
                max_unauthenticated: args.quic_max_unauthenticated as usize,
                ..QuicServerConfig::new(listen, String::new(), tls)
            };
            let server = serve_quic(hub.clone(), config).await.context("--quic")?;
            println!(
                "kvengine: QUIC ingest on {} (ALPN kvengine/1), certificate sha256 {}",
                server.local_addr(),
                server.fingerprint()
            );
            Some(server)
        }
        None => None,
    };

    let on_register = {
        let (hub, subs, spawner) = (hub.clone(), subs.clone(), spawner.clone());
        let outbound = outbound.clone();
        Arc::new(move |reg: &Registration| {
            if let (Some(interval), Some(url)) = (reg.trtllm_poll, &reg.url) {
                match TrtllmSource::new(reg.worker, url, interval) {
                    Ok(source) => {
                        // A worker that moved from ZMQ (or another URL) keeps one source.
                        unsubscribe(&subs, reg.worker, Some(&source.events_url()));
                        poll(&hub, &subs, &spawner, &outbound, source);
                    }
                    Err(e) => tracing::warn!(worker = %reg.worker, "not polling: {e}"),
                }
                return;
            }
            let Some(zmq) = &reg.zmq else { return };
            match ZmqSource::new(reg.worker, zmq, reg.replay.as_deref()) {
                Ok(source) => subscribe(&hub, &subs, &spawner, source),
                Err(e) => tracing::warn!(worker = %reg.worker, "not subscribing: {e}"),
            }
        })
    };
    // After the configured workers are registered: peers' requests on them then apply.
    let replica_link = crate::replicas::start(&hub, &args.replicas).await?;
    if let (Some(done), Some(w)) = (restoring, &warm)
        && let Some(plan) = &w.plan
    {
        let r =
            transport::state::finish_restore(&hub, plan, done, &args.worker_hosts, &*on_register)?;
        println!(
            "kvengine: restore: {} worker(s) resume from the snapshot, {} cleared, {} \
             re-registered, {} refused",
            r.kept, r.cleared, r.registered, r.refused
        );
    }
    let snapshots = warm.as_ref().and_then(|w| {
        let (dir, every) = w.dir.as_ref().zip(w.interval)?;
        Some(tokio::spawn(transport::state::snapshot_every(
            hub.clone(),
            dir.clone(),
            w.policy.clone(),
            every,
        )))
    });
    let peer_snapshots = replica_link
        .as_ref()
        .and_then(|link| crate::replicas::put_snapshots(&hub, link, &args.replicas, &policy));
    let on_remove = {
        let subs = subs.clone();
        Arc::new(move |worker: WorkerId| unsubscribe(&subs, worker, None))
    };
    let app = router(
        hub.clone(),
        HttpConfig {
            max_body_bytes: args.body_limit(),
            max_prompt_tokens: args
                .prompt_cap()
                .unwrap_or(transport::http::DEFAULT_MAX_PROMPT_TOKENS),
            on_register: Some(on_register),
            on_remove: Some(on_remove),
            admin_token: args.admin_token.clone().filter(|t| !t.is_empty()),
            routing_token: args.routing_token.clone().filter(|t| !t.is_empty()),
            body_timeout: Duration::from_secs_f64(args.http_body_timeout_secs.max(0.001)),
            worker_hosts: args.worker_hosts.clone(),
            homes: Some(spawner.clone()),
        },
    )
    .merge(openai_router(
        hub.clone(),
        ProxyConfig {
            tokenizer,
            model_tokenizers,
            max_body_bytes: args.body_limit(),
            max_prompt_tokens: args.prompt_cap(),
            body_timeout: Duration::from_secs_f64(args.http_body_timeout_secs.max(0.001)),
            disagg: args.disagg.config()?,
            outbound: outbound.clone(),
            ..ProxyConfig::default()
        },
    ));
    let edge = Edge {
        router: app,
        tls: tls.clone(),
        limits: args.conn_limits(),
        counters: hub.metrics().edge.clone(),
    };
    if let Some(share) = share {
        let _ = share.send(Some(edge.clone()));
    }
    let addr = listener.local_addr().context("HTTP listener")?;
    if let Some(warning) = control_plane_warning(args, addr) {
        tracing::warn!("{warning}");
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    println!(
        "kvengine: HTTP on {scheme}://{addr} (OpenAI /v1/chat/completions and \
         /v1/completions; /v1/route, /v1/events, /v1/workers, /metrics)"
    );
    let interval = Duration::from_secs_f64(args.health_interval_secs.max(0.01));
    let health = tokio::spawn(health_loop(
        hub.clone(),
        interval,
        interval.min(Duration::from_secs(2)),
        args.health_failures,
        outbound.clone(),
    ));
    let events = match args.approximate() {
        true => " without KV events (approximate)",
        false => "",
    };
    println!(
        "kvengine: routing mode {}{events}; Ctrl-C stops",
        args.router_mode
    );

    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let served = transport::http::conn::serve(listener, edge, shutdown).await;
    health.abort();
    if let Some(s) = snapshots {
        s.abort();
    }
    for (_, task) in subs
        .tasks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .drain()
    {
        task.abort();
    }
    if let Some(p) = peer_snapshots {
        p.abort();
    }
    if let Some(w) = &warm
        && let Some(dir) = &w.dir
    {
        // The subscriptions are stopped: this snapshot holds everything they applied.
        if transport::state::save_now(&hub, dir, &w.policy).await {
            println!(
                "kvengine: snapshot written to {}",
                dir.snapshot_path().display()
            );
        }
    }
    if let Some(q) = quic {
        q.close();
    }
    if let Some(link) = replica_link {
        link.shutdown().await;
    }
    for w in sims {
        w.shutdown().await;
    }
    served.context("HTTP edge")
}

/// `--sim-workers N`: simulated vLLM workers on free loopback ports, worker ids 1..=N, each
/// registered with its URL and subscribed to (unless KV events are off).
async fn start_sim_workers(
    hub: &Arc<Hub>,
    subs: &Subscriptions,
    spawner: &Homes,
    outbound: &Outbound,
    args: &ServeArgs,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    if args.sim_workers == 0 {
        return Ok(Vec::new());
    }
    let mut base = SimWorkerConfig {
        speedup: args.sim_speedup,
        events: args.sim_engine,
        ..SimWorkerConfig::default()
    };
    base.engine.block_size = args.block_size()?;
    if let Some(blocks) = args.sim_kv_blocks {
        base.engine.kv_blocks = blocks;
    }
    let (p, d) = (
        usize::from(args.sim_prefill_workers),
        usize::from(args.sim_decode_workers),
    );
    let roles: Vec<SimRole> = (0..usize::from(args.sim_workers))
        .map(|i| match i {
            i if i < p => SimRole::Prefill,
            i if i < p + d => SimRole::Decode,
            _ => SimRole::Aggregated,
        })
        .collect();
    let workers = spawn_mixed_cluster(&roles, base, tokenizer)
        .await
        .context("--sim-workers")?;
    for (i, w) in workers.iter().enumerate() {
        let id = WorkerId(i as u64 + 1);
        let (zmq, replay) = (w.zmq_endpoint().to_owned(), w.replay_endpoint().to_owned());
        let role = w.role();
        let mut reg = w.registration(id);
        if args.approximate() {
            (reg.zmq, reg.replay) = (None, None);
        }
        hub.register(reg)?;
        if !args.approximate() && w.is_trtllm() {
            let source = TrtllmSource::new(id, &w.url(), transport::trtllm::DEFAULT_POLL_INTERVAL)?;
            poll(hub, subs, spawner, outbound, source);
        } else if !args.approximate() {
            subscribe(hub, subs, spawner, ZmqSource::new(id, &zmq, Some(&replay))?);
        }
        println!("kvengine: simulated worker {id} ({role}) at {}", w.url());
    }
    Ok(workers)
}
