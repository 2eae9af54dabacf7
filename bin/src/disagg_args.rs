//! Flags of disaggregated serving: worker roles, the hand-off protocol and conditional
//! disaggregation (`kvengine --worker-role 1=prefill --worker-role 2=decode ...`).

use anyhow::{Context, Result};
use clap::Args;
use engine::WorkerId;
use engine::sched::{SplitConfig, SplitMode, TransferModel, WorkerRole};
use transport::openai::disagg::{DisaggConfig, Protocol};

/// A worker's role from the command line: `ID=ROLE[,bootstrap_port=PORT]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleFlag {
    /// The worker.
    pub worker: WorkerId,
    /// Its role.
    pub role: WorkerRole,
    /// SGLang prefill workers: their bootstrap port.
    pub bootstrap_port: Option<u16>,
}

impl std::str::FromStr for RoleFlag {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (id, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected ID=ROLE[,bootstrap_port=PORT]"))?;
        let worker = id
            .trim()
            .parse::<u64>()
            .map(WorkerId)
            .map_err(|_| format!("{s:?}: worker id {id:?} is not a u64"))?;
        let mut parts = rest.split(',');
        let role = parts
            .next()
            .unwrap_or_default()
            .parse::<WorkerRole>()
            .map_err(|e| format!("{s:?}: {e}"))?;
        let mut bootstrap_port = None;
        for part in parts {
            match part.split_once('=') {
                Some(("bootstrap_port", p)) => {
                    bootstrap_port = Some(
                        p.parse::<u16>()
                            .map_err(|_| format!("{s:?}: bad bootstrap_port {p:?}"))?,
                    );
                }
                _ => return Err(format!("{s:?}: unknown option {part:?}")),
            }
        }
        Ok(Self {
            worker,
            role,
            bootstrap_port,
        })
    }
}

/// Disaggregated serving.
#[derive(Debug, Args)]
pub struct DisaggArgs {
    /// A worker's role: `ID=prefill|decode|aggregated[,bootstrap_port=PORT]` (repeatable;
    /// the env var takes a `;`-separated list). With prefill and decode workers registered,
    /// the OpenAI front door splits requests between them.
    #[arg(
        long = "worker-role",
        env = "KVENGINE_WORKER_ROLES",
        value_delimiter = ';'
    )]
    pub worker_roles: Vec<RoleFlag>,
    /// How prefill and decode workers hand the KV blocks over: `vllm` (kv_transfer_params),
    /// `sglang` (bootstrap room) or `trtllm` (context-only / generation-only requests).
    #[arg(long, env = "KVENGINE_DISAGG_PROTOCOL", default_value = "vllm")]
    pub disagg_protocol: Protocol,
    /// `threshold`: prefill remotely when the decode worker lacks at least
    /// --disagg-min-prefill-tokens of the prompt; `model`: also only when the time model
    /// (prefill throughput, transfer) predicts it pays.
    #[arg(long, env = "KVENGINE_DISAGG_MODE", default_value = "threshold",
          value_parser = parse_split_mode)]
    pub disagg_mode: SplitMode,
    /// Uncached prompt tokens below which the decode worker prefills locally.
    #[arg(
        long,
        env = "KVENGINE_DISAGG_MIN_PREFILL_TOKENS",
        default_value_t = 512
    )]
    pub disagg_min_prefill_tokens: u64,
    /// Prefill throughput of one worker, tokens/s (model mode).
    #[arg(
        long,
        env = "KVENGINE_DISAGG_PREFILL_TOKENS_PER_S",
        default_value_t = 10_000.0
    )]
    pub disagg_prefill_tokens_per_s: f64,
    /// KV-cache bytes per token, all layers (model mode).
    #[arg(
        long,
        env = "KVENGINE_DISAGG_KV_BYTES_PER_TOKEN",
        default_value_t = 131_072
    )]
    pub disagg_kv_bytes_per_token: u64,
    /// Prefill-to-decode link bandwidth, Gbit/s (model mode).
    #[arg(long, env = "KVENGINE_DISAGG_LINK_GBPS", default_value_t = 100.0)]
    pub disagg_link_gbps: f64,
    /// Fixed cost of one KV transfer, ms (model mode).
    #[arg(
        long,
        env = "KVENGINE_DISAGG_TRANSFER_LATENCY_MS",
        default_value_t = 1.0
    )]
    pub disagg_transfer_latency_ms: f64,
    /// Weight of blocks a decode worker must receive against its decode load when choosing
    /// it (0: load only).
    #[arg(long, env = "KVENGINE_DECODE_OVERLAP_WEIGHT", default_value_t = 0.1)]
    pub decode_overlap_weight: f64,
}

fn parse_split_mode(s: &str) -> Result<SplitMode, String> {
    s.parse().map_err(|e: engine::EngineError| e.to_string())
}

impl DisaggArgs {
    /// The front door's disaggregation settings.
    pub fn config(&self) -> Result<DisaggConfig> {
        let split = SplitConfig {
            mode: self.disagg_mode,
            min_prefill_tokens: self.disagg_min_prefill_tokens,
            prefill_tokens_per_s: self.disagg_prefill_tokens_per_s,
            transfer: TransferModel {
                bytes_per_token: self.disagg_kv_bytes_per_token,
                link_gbps: self.disagg_link_gbps,
                latency_ms: self.disagg_transfer_latency_ms,
            },
        };
        split.validate().context("--disagg-* flags")?;
        Ok(DisaggConfig {
            protocol: self.disagg_protocol,
            split,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_flags_parse_and_explain_mistakes() {
        let f: RoleFlag = "3=prefill,bootstrap_port=8998".parse().unwrap();
        assert_eq!(
            f,
            RoleFlag {
                worker: WorkerId(3),
                role: WorkerRole::Prefill,
                bootstrap_port: Some(8998)
            }
        );
        assert_eq!(
            "4=decode".parse::<RoleFlag>().unwrap().role,
            WorkerRole::Decode
        );
        for bad in [
            "prefill",
            "x=prefill",
            "1=gpu",
            "1=prefill,port=1",
            "1=decode,bootstrap_port=x",
        ] {
            assert!(bad.parse::<RoleFlag>().is_err(), "{bad}");
        }
    }
}
