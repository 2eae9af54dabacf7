//! Conditional disaggregation: whether a request's prefill runs on a prefill worker (and its
//! KV blocks travel to the decode worker) or locally on the decode worker.
//!
//! Two modes:
//! * [`SplitMode::Threshold`] (Dynamo's rule): remote when the prompt tokens the decode
//!   worker does not cache reach `min_prefill_tokens`.
//! * [`SplitMode::Model`]: remote when the predicted cost of a local prefill exceeds the
//!   predicted cost of the remote one:
//!   ```text
//!   local  = uncached_on_decode / prefill_tps * (1 + running requests on the decode worker)
//!   remote = (queued prefill tokens on the prefill worker + uncached_on_prefill) / prefill_tps
//!          + transfer(tokens the decode worker lacks)          (see `super::transfer`)
//!   ```
//!   A local prefill stalls every request decoding on that worker for its duration (hence the
//!   factor); a remote one costs the prefill worker's queue and the transfer of the blocks
//!   the decode worker lacks. `min_prefill_tokens` still applies as a floor.
//!
//! # Invariants
//! 1. Pure and sans-IO: the same inputs give the same [`Split`]; no clock, no I/O.
//! 2. With no prefill candidate, the split is always local.

use crate::error::{EngineError, Result};
use crate::sched::cost::CandidateScore;
use crate::sched::transfer::TransferModel;

/// How the split is decided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SplitMode {
    /// Remote when the decode worker's uncached prompt tokens reach the threshold.
    #[default]
    Threshold,
    /// Remote when the time model predicts it is cheaper (and the threshold is reached).
    Model,
}

impl std::str::FromStr for SplitMode {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "threshold" => Ok(Self::Threshold),
            "model" => Ok(Self::Model),
            _ => Err(EngineError::InvalidArgument {
                name: "disagg_mode",
                reason: "expected threshold or model",
            }),
        }
    }
}

/// The settings of conditional disaggregation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitConfig {
    /// See [`SplitMode`].
    pub mode: SplitMode,
    /// Fewer uncached prompt tokens than this on the decode worker: prefill locally.
    pub min_prefill_tokens: u64,
    /// Prefill throughput of one worker, tokens per second (model mode).
    pub prefill_tokens_per_s: f64,
    /// What moving the blocks costs (model mode).
    pub transfer: TransferModel,
}

impl Default for SplitConfig {
    fn default() -> Self {
        Self {
            mode: SplitMode::Threshold,
            min_prefill_tokens: 512,
            prefill_tokens_per_s: 10_000.0,
            transfer: TransferModel::default(),
        }
    }
}

/// Where the prefill runs, and the numbers that decided it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    /// True: on the prefill worker; false: on the decode worker.
    pub remote: bool,
    /// Prompt tokens the decode worker does not cache.
    pub uncached_on_decode: u64,
    /// Predicted local cost, seconds (model mode; 0 otherwise).
    pub local_s: f64,
    /// Predicted remote cost, seconds (model mode; 0 otherwise).
    pub remote_s: f64,
}

impl SplitConfig {
    /// Rejects values that would make the model meaningless.
    pub fn validate(&self) -> Result<()> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.prefill_tokens_per_s) {
            return Err(EngineError::InvalidArgument {
                name: "disagg_prefill_tokens_per_s",
                reason: "must be a finite number above 0",
            });
        }
        self.transfer.validate()?;
        Ok(())
    }

    /// Decides the split of a request of `input_tokens` prompt tokens (block size
    /// `block_size`) whose decode worker scored `decode` and runs `decode_running` requests,
    /// and whose best prefill worker (if any) scored `prefill`.
    pub fn decide(
        &self,
        input_tokens: u64,
        block_size: u32,
        decode: &CandidateScore,
        decode_running: u64,
        prefill: Option<&CandidateScore>,
    ) -> Split {
        let bs = u64::from(block_size.max(1));
        let cached = |c: &CandidateScore| u64::from(c.overlap_blocks).saturating_mul(bs);
        let uncached_on_decode = input_tokens.saturating_sub(cached(decode));
        let mut split = Split {
            remote: false,
            uncached_on_decode,
            local_s: 0.0,
            remote_s: 0.0,
        };
        let Some(prefill) = prefill else {
            return split;
        };
        if uncached_on_decode < self.min_prefill_tokens.max(1) {
            return split;
        }
        match self.mode {
            SplitMode::Threshold => split.remote = true,
            SplitMode::Model => {
                let tps = self.prefill_tokens_per_s;
                split.local_s = uncached_on_decode as f64 / tps * (1 + decode_running) as f64;
                // The prefill candidate's prefill_blocks already holds its queue plus this
                // request's uncached tokens.
                split.remote_s = prefill.prefill_blocks * bs as f64 / tps
                    + self.transfer.seconds(uncached_on_decode);
                split.remote = split.remote_s < split.local_s;
            }
        }
        split
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::WorkerKey;

    fn score(overlap_blocks: u32, prefill_blocks: f64) -> CandidateScore {
        CandidateScore {
            key: WorkerKey::new(1, 0),
            overlap_blocks,
            prefill_blocks,
            decode_blocks: 0,
            predicted_ttft_ms: 0.0,
            logit: 0.0,
        }
    }

    #[test]
    fn threshold_counts_only_what_the_decode_worker_lacks() {
        let cfg = SplitConfig {
            min_prefill_tokens: 100,
            ..SplitConfig::default()
        };
        let p = score(0, 10.0);
        // 160 tokens, 4 blocks of 16 cached on decode: 96 uncached < 100: local.
        let s = cfg.decide(160, 16, &score(4, 0.0), 0, Some(&p));
        assert_eq!((s.remote, s.uncached_on_decode), (false, 96));
        // 3 blocks cached: 112 uncached: remote.
        assert!(cfg.decide(160, 16, &score(3, 0.0), 0, Some(&p)).remote);
        // No prefill worker: local whatever the prompt.
        assert!(!cfg.decide(100_000, 16, &score(0, 0.0), 0, None).remote);
    }

    #[test]
    fn model_weighs_decode_interference_against_queue_and_transfer() {
        let cfg = SplitConfig {
            mode: SplitMode::Model,
            min_prefill_tokens: 1,
            prefill_tokens_per_s: 1_000.0,
            transfer: TransferModel {
                bytes_per_token: 1_000,
                link_gbps: 8.0,
                latency_ms: 0.0,
            },
        };
        // 1,600 uncached tokens: local 1.6 s x (1 + 0) running; remote: the prefill worker's
        // 100 blocks x 16 = 1.6 s plus 1.6 ms of transfer: local wins on an idle decoder.
        let busy_prefill = score(0, 100.0);
        let s = cfg.decide(1_600, 16, &score(0, 0.0), 0, Some(&busy_prefill));
        assert!(!s.remote, "{s:?}");
        assert!((s.local_s - 1.6).abs() < 1e-9 && (s.remote_s - 1.6016).abs() < 1e-9);
        // Three requests decoding there: a local prefill stalls them: remote wins.
        assert!(
            cfg.decide(1_600, 16, &score(0, 0.0), 3, Some(&busy_prefill))
                .remote
        );
        // A prefill worker that caches most of the prompt wins even on an idle decoder.
        assert!(
            cfg.decide(1_600, 16, &score(0, 0.0), 0, Some(&score(90, 10.0)))
                .remote
        );
    }

    #[test]
    fn bad_model_settings_are_refused() {
        for cfg in [
            SplitConfig {
                prefill_tokens_per_s: 0.0,
                ..SplitConfig::default()
            },
            SplitConfig {
                transfer: TransferModel {
                    link_gbps: f64::NAN,
                    ..TransferModel::default()
                },
                ..SplitConfig::default()
            },
        ] {
            assert!(cfg.validate().is_err());
        }
        assert!(SplitConfig::default().validate().is_ok());
        assert_eq!("model".parse::<SplitMode>().ok(), Some(SplitMode::Model));
        assert!("sometimes".parse::<SplitMode>().is_err());
    }
}
