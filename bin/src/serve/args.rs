//! `kvengine serve`'s flags and what they turn into (settings, workers, tokenizers).

use crate::disagg_args::DisaggArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use engine::sched::{BusyThresholds, RouteMode, RouterCost, SchedulerConfig};
use engine::sharding::adaptive::Adaptive;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use transport::native::{IngestCredentials, ScopedToken};
use transport::openai::tokenize::PromptTokenizer;
use transport::trtllm::TrtllmSource;
use transport::zmq::ZmqSource;

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
    #[arg(long, alias = "hub-fanout", env = "KVENGINE_JUNCTION_FANOUT",
          default_value_t = Adaptive::DEFAULT_JUNCTION_FANOUT,
          value_parser = clap::value_parser!(u32).range(2..=(1 << 20)))]
    pub junction_fanout: u32,
    /// Idle rounds a core thread spends before it parks (each lets the thread's other ready
    /// tasks run; no system call): more catch a busy peer core's next message without a
    /// wake-up, fewer leave an idle CPU alone sooner.
    #[arg(long, env = "KVENGINE_CORE_IDLE_POLLS",
          default_value_t = transport::cores::DEFAULT_IDLE_POLLS,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub core_idle_polls: u32,
    /// New HTTP connections fill the cores in order: a core hands a connection it accepted
    /// to the lowest core whose thread was awake less than this share of the last 100 ms
    /// (at most 4 a core per 100 ms, so a burst still spreads). 0: every core serves what
    /// the kernel gives its listener.
    #[arg(long, env = "KVENGINE_EDGE_FILL",
          default_value_t = transport::http::placement::DEFAULT_FILL_SHARE,
          value_parser = parse_share)]
    pub edge_fill: f64,
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
    /// Beside every routing decision, take the decision POLICY would have taken and
    /// report in /metrics what it would have gained (`kvengine_shadow_*`), without
    /// changing the route: a `--router-mode` (`round-robin`, `kv`, `sglang`, ...), optionally
    /// with a `--router-cost` (`kv:ttft`), `worker:ID` (a fixed worker), or `header` (the
    /// worker each request's `x-kvengine-shadow-worker` header names: another router's
    /// choice, for mirrored traffic). docs/api.md, "Why requests missed the cache".
    #[arg(long, env = "KVENGINE_SHADOW", value_name = "POLICY",
          value_parser = parse_shadow)]
    pub shadow: Option<transport::hub::Shadow>,
    /// With `--router-cost ttft`: what a millisecond of prefill stall on each of a worker's
    /// running requests costs against a millisecond of the new request's TTFT.
    #[arg(long, env = "KVENGINE_ROUTER_STALL_WEIGHT",
          default_value_t = engine::sched::config::DEFAULT_STALL_WEIGHT)]
    pub router_stall_weight: f64,
    /// What prefill that recomputes a prefix another worker caches costs, on top of the
    /// request's own cost (`dynamo`: times the overlap weight, per block; `ttft`: per
    /// millisecond of that prefill): the cluster computing the same blocks twice.
    #[arg(long, env = "KVENGINE_ROUTER_RECOMPUTE_WEIGHT",
          default_value_t = engine::sched::config::DEFAULT_RECOMPUTE_WEIGHT)]
    pub router_recompute_weight: f64,
    /// What each KV block a worker caches beyond the least-filled candidate costs, in
    /// blocks of prefill: a fuller cache evicts sooner, so new prefixes go where they live
    /// longest (SGLang's router sends a cold prompt to its smallest tree). 0: cache
    /// footprints only break exact ties.
    #[arg(long, env = "KVENGINE_ROUTER_FOOTPRINT_WEIGHT",
          default_value_t = engine::sched::config::DEFAULT_FOOTPRINT_WEIGHT)]
    pub router_footprint_weight: f64,
    /// Predict-on-route: each routing decision also counts as the chosen worker holding
    /// the prompt's blocks for this many milliseconds (refreshed by each later decision for
    /// them), so that requests sharing a prefix that arrive before the worker's KV events
    /// find it there; a worker's overlap is the larger of its indexed and predicted ones.
    /// 0: off. Ignored with --no-kv-events (where every overlap is predicted).
    #[arg(long, env = "KVENGINE_PREDICT_ON_ROUTE_MS",
          default_value_t = engine::sched::config::DEFAULT_PREDICT_ON_ROUTE.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub predict_on_route_ms: u64,
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
    /// A worker rank carrying this many routed, unfreed requests is busy: skipped while
    /// others are not, and with every rank busy front-door requests wait in the admission
    /// queue (`--admission-queue`).
    #[arg(long, env = "KVENGINE_BUSY_MAX_ACTIVE",
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub busy_max_active: Option<u64>,
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
    /// Sticky sessions: a session (`x-kvengine-session`, `X-Dynamo-Session-ID`,
    /// `x-smg-routing-key` or `x-sgl-routing-key`) unused this many seconds is forgotten.
    /// 0: no sessions.
    #[arg(long, env = "KVENGINE_SESSION_TTL_SECS",
          default_value_t = engine::router::sessions::DEFAULT_SESSION_TTL.as_secs())]
    pub session_ttl_secs: u64,
    /// The most sessions remembered per model; past it the least recently used is evicted.
    /// 0: no sessions.
    #[arg(long, env = "KVENGINE_MAX_SESSIONS",
          default_value_t = engine::router::sessions::DEFAULT_MAX_SESSIONS as u64)]
    pub max_sessions: u64,
    /// The most front-door requests that may wait per model while every worker is busy
    /// (`--busy-max-active`, `--busy-threshold`, `--busy-max-waiting`); past it 429
    /// `queue_full`. 0: no queue (requests go to a busy worker).
    #[arg(long, env = "KVENGINE_ADMISSION_QUEUE",
          default_value_t = engine::router::admission::DEFAULT_ADMISSION_QUEUE as u64)]
    pub admission_queue: u64,
    /// How long a request may wait in the admission queue before it is answered 503
    /// `queue_timeout`.
    #[arg(long, env = "KVENGINE_ADMISSION_TIMEOUT_MS",
          default_value_t = engine::router::admission::DEFAULT_ADMISSION_TIMEOUT.as_millis() as u64,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub admission_timeout_ms: u64,

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
          default_value_t = engine::router::reservations::DEFAULT_MAX_RESERVATIONS_PER_CLIENT as u64)]
    pub max_reservations_per_client: u64,
    /// A route reservation never freed is dropped from the load after this many seconds
    /// (requests the router proxies itself keep --request-timeout-secs).
    #[arg(long, env = "KVENGINE_RESERVATION_TIMEOUT_SECS",
          default_value_t = engine::router::reservations::DEFAULT_RESERVATION_TIMEOUT.as_secs())]
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

pub(super) fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not a share between 0 and 1")),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

pub(super) fn parse_mode(s: &str) -> Result<RouteMode, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

pub(super) fn parse_cost(s: &str) -> Result<RouterCost, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

pub(super) fn parse_shadow(s: &str) -> Result<transport::hub::Shadow, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

pub(super) fn parse_trtllm(s: &str) -> Result<TrtllmSource, String> {
    s.parse()
        .map_err(|e: transport::TransportError| e.to_string())
}

pub(super) fn parse_zmq(s: &str) -> Result<ZmqSource, String> {
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

    pub(super) fn scheduler(&self) -> Result<SchedulerConfig> {
        let config = SchedulerConfig {
            block_size: self.block_size()?,
            mode: self.router_mode,
            overlap_weight: self.kv_overlap_score_weight,
            decode_overlap_weight: self.disagg.decode_overlap_weight,
            temperature: self.router_temperature,
            busy: BusyThresholds {
                max_waiting: self.busy_max_waiting,
                max_kv_usage: self.busy_threshold,
                max_active: self.busy_max_active,
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
            recompute_weight: self.router_recompute_weight,
            footprint_weight: self.router_footprint_weight,
            max_active_per_key: (self.max_active_requests_per_worker > 0)
                .then_some(self.max_active_requests_per_worker),
            predict_on_route: (self.predict_on_route_ms > 0)
                .then(|| Duration::from_millis(self.predict_on_route_ms)),
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
            sessions: (self.session_ttl_secs > 0 && self.max_sessions > 0).then(|| {
                engine::router::SessionConfig {
                    ttl: Some(Duration::from_secs(self.session_ttl_secs)),
                    max_sessions: some(self.max_sessions).unwrap_or(0),
                }
            }),
            admission: some(self.admission_queue).map(|capacity| {
                engine::router::admission::AdmissionConfig {
                    capacity,
                    timeout: Duration::from_millis(self.admission_timeout_ms),
                }
            }),
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
    pub(super) fn ingest_credentials(&self) -> Result<IngestCredentials> {
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
pub(super) fn config_workers(
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
pub(super) fn load_tokenizer(spec: &str) -> Result<Option<Arc<PromptTokenizer>>> {
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
pub(super) const STAND_IN: &str = "stand-in";
