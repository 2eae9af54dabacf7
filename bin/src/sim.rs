//! `kvengine sim`: simulated vLLM or TensorRT-LLM workers you can run and talk to, no GPU
//! needed.
//!
//! Starts `--workers N` simulated engines in this process (see `lab::workers`): worker `i`
//! answers OpenAI requests on HTTP port `--port + i` and publishes vLLM KV events on ZMQ port
//! `--zmq-port + 2i` (replay on `+ 2i + 1`); port 0 means any free port. Prints each worker's
//! URL and the `--zmq-worker` flag that points kvengine at it, then runs until SIGINT or
//! SIGTERM. Every engine constant is a flag (and a `KVENGINE_SIM_*` variable).
//!
//! `--engine trtllm` makes them TensorRT-LLM workers instead: no ZMQ socket, their KV events
//! are drained by `POST /kv_cache_events` (a buffer of `--event-buffer` events), the block
//! size defaults to TensorRT-LLM's 32 tokens, and the printed flag is
//! `--trtllm-worker ID=http://HOST:PORT`.
//!
//! `--role prefill|decode|aggregated` makes them the prefill or decode workers of a
//! disaggregated deployment (vLLM, SGLang and TensorRT-LLM hand-offs; see
//! `lab::workers::disagg`), with the KV-transfer model `--kv-bytes-per-token`, `--link-gbps`
//! and `--transfer-latency-ms`. Run one `kvengine sim` per role.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ::sim::engine::{EngineConfig, TimingModel};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use lab::workers::trtllm::DEFAULT_EVENT_BUFFER;
use lab::workers::{EventFormat, SimRole, SimWorkerConfig, TransferModel, spawn_cluster};
use transport::openai::tokenize::PromptTokenizer;

/// Which inference server the workers imitate (how they hand out their KV events).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SimEngineKind {
    /// vLLM: KV events published over ZMQ (PUB plus replay), 16-token blocks.
    Vllm,
    /// TensorRT-LLM: KV events drained by `POST /kv_cache_events`, 32-token blocks.
    Trtllm,
}

impl SimEngineKind {
    /// Its flag value.
    fn name(self) -> &'static str {
        match self {
            SimEngineKind::Vllm => "vllm",
            SimEngineKind::Trtllm => "trtllm",
        }
    }

    /// Its default tokens per block.
    fn default_block_size(self) -> u32 {
        match self {
            SimEngineKind::Vllm => 16,
            SimEngineKind::Trtllm => 32,
        }
    }
}

/// Simulated worker settings.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The inference server the workers imitate: vllm (KV events over ZMQ) or trtllm (KV
    /// events polled over HTTP, `POST /kv_cache_events`; point kvengine at them with
    /// `--trtllm-worker`).
    #[arg(long, env = "KVENGINE_SIM_ENGINE", value_enum, default_value_t = SimEngineKind::Vllm)]
    pub engine: SimEngineKind,
    /// With --engine trtllm: KV events each worker keeps until they are polled
    /// (TensorRT-LLM's event_buffer_max_size); the oldest are dropped beyond it.
    #[arg(long, env = "KVENGINE_SIM_EVENT_BUFFER", default_value_t = DEFAULT_EVENT_BUFFER,
          value_parser = event_buffer)]
    pub event_buffer: usize,
    /// Simulated workers to run.
    #[arg(long, env = "KVENGINE_SIM_WORKERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub workers: u16,
    /// Address the workers listen on (HTTP and ZMQ).
    #[arg(long, env = "KVENGINE_SIM_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port of the first worker; worker i listens on PORT + i (0: any free ports).
    #[arg(long, env = "KVENGINE_SIM_PORT", default_value_t = 8100)]
    pub port: u16,
    /// ZMQ port of the first worker's KV events; worker i publishes on ZMQ_PORT + 2i and
    /// replays on ZMQ_PORT + 2i + 1 (default: PORT + 1000, or any free ports when PORT is 0).
    /// Unused with --engine trtllm (no ZMQ socket).
    #[arg(long, env = "KVENGINE_SIM_ZMQ_PORT")]
    pub zmq_port: Option<u16>,
    /// The worker id of the first worker in the printed `--zmq-worker` (or
    /// `--trtllm-worker`) flags.
    #[arg(long, env = "KVENGINE_SIM_FIRST_WORKER_ID", default_value_t = 0)]
    pub first_worker_id: u64,
    /// Model name reported by `/v1/models` and in answers; a request naming another model
    /// gets vLLM's 404 (naming none means this one).
    #[arg(long, env = "KVENGINE_SIM_MODEL", default_value = "kvengine-sim")]
    pub model: String,
    /// vLLM's --api-key: requests under /v1 must send `Authorization: Bearer KEY` (else
    /// 401); /health and /load stay open. Register the workers with kvengine under the
    /// same key (`api_key` of their `[[workers]]` entry, or of `POST /v1/workers`) so that
    /// the requests it forwards get in.
    #[arg(long, env = "KVENGINE_SIM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model's tokenizer (`tokenizer.json` or its directory). Without it prompts are
    /// tokenized by the built-in stand-in (one token per word); give kvengine the same
    /// choice so its prefix hits line up with the workers' caches.
    #[arg(long, env = "KVENGINE_SIM_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, env = "KVENGINE_SIM_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,

    /// Pages in each worker's KV cache.
    #[arg(long, env = "KVENGINE_SIM_KV_BLOCKS", default_value_t = 28_000,
          value_parser = clap::value_parser!(u32).range(1..u32::MAX as i64))]
    pub kv_blocks: u32,
    /// Tokens per page (kvengine's --kv-cache-block-size must match) [default: 16 with
    /// --engine vllm, 32 with --engine trtllm]
    #[arg(long, env = "KVENGINE_SIM_BLOCK_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub block_size: Option<u32>,
    /// Most requests running at once.
    #[arg(long, env = "KVENGINE_SIM_MAX_NUM_SEQS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_seqs: u32,
    /// Most tokens computed in one step.
    #[arg(long, env = "KVENGINE_SIM_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_batched_tokens: u32,
    /// Data-parallel rank stamped on the workers' event batches.
    #[arg(long, env = "KVENGINE_SIM_DP_RANK", default_value_t = 0)]
    pub dp_rank: u32,
    /// Event batches each worker keeps for replay (--engine vllm).
    #[arg(long, env = "KVENGINE_SIM_REPLAY_BUFFER", default_value_t = 4096)]
    pub replay_buffer: usize,

    /// The workers' role in a disaggregated deployment: aggregated, prefill or decode.
    #[arg(long, env = "KVENGINE_SIM_ROLE", default_value_t = SimRole::Aggregated)]
    pub role: SimRole,
    /// KV transfer: bytes of KV per token (default: Llama-3-8B in fp16, 32 layers x 8 KV
    /// heads x 128 dims x K,V x 2 bytes).
    #[arg(
        long,
        env = "KVENGINE_SIM_KV_BYTES_PER_TOKEN",
        default_value_t = 131_072
    )]
    pub kv_bytes_per_token: u64,
    /// KV transfer: link bandwidth between prefill and decode workers, in gigabits/s.
    #[arg(long, env = "KVENGINE_SIM_LINK_GBPS", default_value_t = 100.0)]
    pub link_gbps: f64,
    /// KV transfer: fixed cost of each transfer, in milliseconds.
    #[arg(long, env = "KVENGINE_SIM_TRANSFER_LATENCY_MS", default_value_t = 1.0)]
    pub transfer_latency_ms: f64,
    /// SGLang bootstrap (prefill workers): how long `GET /sim/bootstrap/{room}` waits for
    /// the room's prefill, in seconds.
    #[arg(
        long,
        env = "KVENGINE_SIM_BOOTSTRAP_TIMEOUT_SECS",
        default_value_t = 30.0
    )]
    pub bootstrap_timeout_secs: f64,

    /// Timing: fixed cost of every step, in microseconds.
    #[arg(long, env = "KVENGINE_SIM_STEP_OVERHEAD_US", default_value_t = 1000.0,
          value_parser = micros)]
    pub step_overhead_us: f64,
    /// Timing: fixed GPU cost of every forward pass (reading the weights), in microseconds.
    #[arg(long, env = "KVENGINE_SIM_FORWARD_BASE_US", default_value_t = 5000.0,
          value_parser = micros)]
    pub forward_base_us: f64,
    /// Timing: cost of each prefilled token, in microseconds.
    #[arg(long, env = "KVENGINE_SIM_PREFILL_PER_TOKEN_US", default_value_t = 40.0,
          value_parser = micros)]
    pub prefill_per_token_us: f64,
    /// Timing: attention cost of a prefilled token per 1024 tokens of context, in
    /// microseconds.
    #[arg(long, env = "KVENGINE_SIM_PREFILL_PER_TOKEN_PER_1K_CONTEXT_US",
          default_value_t = 1.5, value_parser = micros)]
    pub prefill_per_token_per_1k_context_us: f64,
    /// Timing: cost of each sequence in a decode batch, in microseconds.
    #[arg(long, env = "KVENGINE_SIM_DECODE_PER_SEQ_US", default_value_t = 75.0,
          value_parser = micros)]
    pub decode_per_seq_us: f64,
    /// Timing: cost of each context token a decoding sequence attends to, in microseconds.
    #[arg(long, env = "KVENGINE_SIM_DECODE_PER_CONTEXT_TOKEN_US", default_value_t = 0.05,
          value_parser = micros)]
    pub decode_per_context_token_us: f64,
}

/// An event buffer size: at least 1.
fn event_buffer(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// A duration in microseconds: finite, at least 0, at most an hour.
fn micros(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if v.is_finite() && (0.0..=3.6e9).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s:?} is not a duration in microseconds (0 to 3.6e9)"
        ))
    }
}

/// Microseconds (checked by [`micros`]) to a duration, rounded to the nanosecond.
fn us(v: f64) -> Duration {
    Duration::from_nanos((v * 1000.0).round() as u64)
}

impl SimArgs {
    /// Tokens per page: `--block-size`, else the engine's default.
    fn block_size(&self) -> u32 {
        self.block_size
            .unwrap_or_else(|| self.engine.default_block_size())
    }

    fn worker_config(&self) -> Result<SimWorkerConfig> {
        let timing = TimingModel {
            step_overhead: us(self.step_overhead_us),
            forward_base: us(self.forward_base_us),
            prefill_per_token: us(self.prefill_per_token_us),
            prefill_per_token_per_1k_context: us(self.prefill_per_token_per_1k_context_us),
            decode_per_seq: us(self.decode_per_seq_us),
            decode_per_context_token: us(self.decode_per_context_token_us),
        };
        let trtllm = self.engine == SimEngineKind::Trtllm;
        let zmq_port = match (self.zmq_port, self.port) {
            // TensorRT-LLM workers bind no ZMQ socket.
            _ if trtllm => 0,
            (Some(z), _) => z,
            (None, 0) => 0,
            (None, p) => p
                .checked_add(1000)
                .context("--port is too high for the default --zmq-port (PORT + 1000)")?,
        };
        let replay_port = if zmq_port == 0 {
            0
        } else {
            zmq_port.checked_add(1).context("--zmq-port is too high")?
        };
        let host = match self.host {
            IpAddr::V6(h) => format!("[{h}]"),
            IpAddr::V4(h) => h.to_string(),
        };
        let cfg = SimWorkerConfig {
            engine: EngineConfig {
                kv_blocks: self.kv_blocks,
                block_size: self.block_size(),
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                dp_rank: self.dp_rank,
                timing,
            },
            speedup: self.speedup,
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            http: SocketAddr::new(self.host, self.port),
            events: if trtllm {
                EventFormat::Trtllm {
                    buffer: self.event_buffer,
                }
            } else {
                EventFormat::Vllm
            },
            zmq_pub: format!("tcp://{host}:{zmq_port}"),
            zmq_replay: format!("tcp://{host}:{replay_port}"),
            replay_buffer: self.replay_buffer,
            role: self.role,
            transfer: TransferModel {
                bytes_per_token: self.kv_bytes_per_token,
                link_gbps: self.link_gbps,
                latency_ms: self.transfer_latency_ms,
            },
            bootstrap_timeout: Duration::try_from_secs_f64(self.bootstrap_timeout_secs)
                .context("--bootstrap-timeout-secs")?,
            ..SimWorkerConfig::default()
        };
        cfg.validate().context(
            "--speedup, --model, --api-key, an engine flag, a transfer flag or \
             --bootstrap-timeout-secs",
        )?;
        Ok(cfg)
    }
}

pub fn run(args: &SimArgs) -> Result<()> {
    crate::logging::init("warn", crate::logging::LogFormat::Text);
    let base = args.worker_config()?;
    let tokenizer = match &args.tokenizer {
        Some(path) => Some(Arc::new(
            PromptTokenizer::from_path(path)
                .with_context(|| format!("--tokenizer {}", path.display()))?,
        )),
        None => None,
    };
    let mut rx = crate::signals::stop_channel()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("kvengine-sim")
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(async {
        let has_tokenizer = tokenizer.is_some();
        let workers = spawn_cluster(usize::from(args.workers), base, tokenizer)
            .await
            .context("cannot start the simulated workers")?;
        let mut command = String::from("kvengine");
        if !has_tokenizer {
            command.push_str(" --tokenizer stand-in");
        }
        for (i, w) in workers.iter().enumerate() {
            let id = args.first_worker_id.saturating_add(i as u64);
            let (flag, value) = w.router_flag(id);
            println!("kvengine sim: worker {id}: {}  {flag} {value}", w.url());
            if w.is_trtllm() {
                command.push_str(&format!(" {flag} {value}"));
            } else {
                command.push_str(&format!(
                    " --worker id={id},url={},zmq={},replay={}",
                    w.url(),
                    w.zmq_endpoint(),
                    w.replay_endpoint()
                ));
            }
        }
        println!("kvengine sim: route to them with: {command}");
        let tokenization = if has_tokenizer {
            "the model's tokenizer (give kvengine the same --tokenizer)"
        } else {
            "the built-in stand-in (give kvengine --tokenizer stand-in)"
        };
        println!(
            "kvengine sim: {} {} {} worker(s) of model {:?}, {}x real time, block size {}; \
             prompts tokenized by {tokenization}",
            workers.len(),
            args.role,
            args.engine.name(),
            args.model,
            args.speedup,
            args.block_size()
        );
        if args.api_key.is_some() {
            // Says that a key is needed, never the key itself.
            println!("kvengine sim: /v1 requests need the --api-key (Authorization: Bearer)");
        }
        println!("kvengine sim: Ctrl-C stops");
        // Ends on the signal (or if the handler is gone).
        let _ = rx.wait_for(|stop| *stop).await;
        println!("kvengine sim: stopping");
        for w in workers {
            w.shutdown().await;
        }
        anyhow::Ok(())
    })?;
    println!("kvengine sim: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn config(args: &[&str]) -> Result<SimWorkerConfig> {
        let mut argv = vec!["sim"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)?.sim.worker_config()
    }

    #[test]
    fn flags_reach_the_worker_config() {
        let cfg = config(&[
            "--port",
            "7000",
            "--kv-blocks",
            "64",
            "--decode-per-seq-us",
            "2.5",
        ])
        .unwrap();
        assert_eq!(cfg.http.port(), 7000);
        assert_eq!(cfg.zmq_pub, "tcp://127.0.0.1:8000");
        assert_eq!(cfg.zmq_replay, "tcp://127.0.0.1:8001");
        assert_eq!(cfg.engine.kv_blocks, 64);
        assert_eq!(cfg.engine.timing.decode_per_seq, Duration::from_nanos(2500));
        assert_eq!(
            cfg.engine.timing,
            TimingModel {
                decode_per_seq: Duration::from_nanos(2500),
                ..TimingModel::default()
            }
        );
        let any = config(&["--port", "0"]).unwrap();
        assert_eq!(any.zmq_pub, "tcp://127.0.0.1:0");
        assert_eq!(any.zmq_replay, "tcp://127.0.0.1:0");
        let z = config(&["--port", "0", "--zmq-port", "5000"]).unwrap();
        assert_eq!(z.zmq_replay, "tcp://127.0.0.1:5001");
        assert!(config(&["--speedup", "0"]).is_err());
        assert!(config(&["--block-size", "0"]).is_err());
        assert!(config(&["--step-overhead-us", "-1"]).is_err());
        assert!(config(&["--port", "65000"]).is_err());
    }

    #[test]
    fn role_and_transfer_flags() {
        let plain = config(&[]).unwrap();
        assert_eq!(plain.role, SimRole::Aggregated);
        assert_eq!(plain.transfer, TransferModel::default());
        let cfg = config(&[
            "--role",
            "decode",
            "--kv-bytes-per-token",
            "65536",
            "--link-gbps",
            "400",
            "--transfer-latency-ms",
            "0.5",
            "--bootstrap-timeout-secs",
            "2",
        ])
        .unwrap();
        assert_eq!(cfg.role, SimRole::Decode);
        assert_eq!(
            cfg.transfer,
            TransferModel {
                bytes_per_token: 65_536,
                link_gbps: 400.0,
                latency_ms: 0.5,
            }
        );
        assert_eq!(cfg.bootstrap_timeout, Duration::from_secs(2));
        assert_eq!(
            config(&["--role", "prefill"]).unwrap().role,
            SimRole::Prefill
        );
        assert!(config(&["--role", "gpu"]).is_err());
        assert!(config(&["--link-gbps", "0"]).is_err());
        assert!(config(&["--transfer-latency-ms", "-1"]).is_err());
        assert!(config(&["--bootstrap-timeout-secs", "-1"]).is_err());
    }

    #[test]
    fn engine_flag_picks_the_event_format_and_block_size() {
        let plain = config(&[]).unwrap();
        assert_eq!(plain.events, EventFormat::Vllm);
        assert_eq!(plain.engine.block_size, 16);
        let trt = config(&["--engine", "trtllm", "--port", "65000"]).unwrap();
        assert_eq!(
            trt.events,
            EventFormat::Trtllm {
                buffer: DEFAULT_EVENT_BUFFER
            }
        );
        assert_eq!(trt.engine.block_size, 32);
        let small = config(&[
            "--engine",
            "trtllm",
            "--event-buffer",
            "7",
            "--block-size",
            "64",
        ])
        .unwrap();
        assert_eq!(small.events, EventFormat::Trtllm { buffer: 7 });
        assert_eq!(small.engine.block_size, 64);
        assert_eq!(config(&["--block-size", "8"]).unwrap().engine.block_size, 8);
        assert!(config(&["--engine", "trtllm", "--event-buffer", "0"]).is_err());
        assert!(config(&["--engine", "sglang"]).is_err());
    }

    #[test]
    fn api_key_flag() {
        assert_eq!(config(&[]).unwrap().api_key, None);
        let cfg = config(&["--api-key", "s3cret"]).unwrap();
        assert_eq!(cfg.api_key.as_deref(), Some("s3cret"));
        for bad in ["", "has space", "tab\t"] {
            assert!(config(&["--api-key", bad]).is_err(), "{bad:?}");
        }
    }
}
