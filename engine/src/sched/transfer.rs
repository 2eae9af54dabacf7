//! How long moving a prompt's KV blocks from a prefill worker to a decode worker takes.
//!
//! ```text
//! transfer(n tokens) = latency + n * bytes_per_token * 8 / (link_gbps * 1e9)   seconds
//! ```
//!
//! The router's conditional disaggregation ([`super::disagg`]) estimates with it; the
//! simulated workers wait it. The defaults model Llama-3-8B's fp16 KV (32 layers x 8 KV heads
//! x 128 dims x K and V x 2 bytes = 128 KiB per token) over a 100 Gb/s link with 1 ms per
//! transfer (handshake and completion notice).
//!
//! # Invariants
//! 1. A model that passed [`TransferModel::validate`] gives a finite, non-negative time,
//!    monotone in the token count; nothing panics on any count.

use std::time::Duration;

use crate::error::{EngineError, Result};

/// The KV-transfer time model (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferModel {
    /// Bytes of KV per token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Link bandwidth in gigabits per second: finite, > 0.
    pub link_gbps: f64,
    /// Fixed cost of one transfer in milliseconds: finite, >= 0.
    pub latency_ms: f64,
}

impl Default for TransferModel {
    fn default() -> Self {
        Self {
            bytes_per_token: 32 * 8 * 128 * 2 * 2,
            link_gbps: 100.0,
            latency_ms: 1.0,
        }
    }
}

impl TransferModel {
    /// Rejects a value outside its documented range.
    pub fn validate(&self) -> Result<()> {
        if !(self.link_gbps.is_finite() && self.link_gbps > 0.0) {
            return Err(EngineError::InvalidArgument {
                name: "link_gbps",
                reason: "must be a finite number above 0",
            });
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            return Err(EngineError::InvalidArgument {
                name: "transfer_latency_ms",
                reason: "must be a finite number, at least 0",
            });
        }
        Ok(())
    }

    /// Seconds to move the KV of `tokens` tokens.
    pub fn seconds(&self, tokens: u64) -> f64 {
        let bits = tokens as f64 * self.bytes_per_token as f64 * 8.0;
        self.latency_ms / 1e3 + bits / (self.link_gbps * 1e9)
    }

    /// [`TransferModel::seconds`] as a duration (saturates at [`Duration::MAX`]).
    pub fn time(&self, tokens: u64) -> Duration {
        Duration::try_from_secs_f64(self.seconds(tokens)).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_examples() {
        let m = TransferModel::default();
        assert_eq!(m.bytes_per_token, 131_072);
        // 1000 tokens: 1000 * 131072 * 8 = 1,048,576,000 bits at 100 Gb/s = 10.48576 ms,
        // plus 1 ms.
        assert!((m.time(1000).as_secs_f64() - 0.011_485_76).abs() < 1e-9);
        assert_eq!(m.time(0), Duration::from_millis(1));
        let small = TransferModel {
            bytes_per_token: 1_000,
            link_gbps: 8.0,
            latency_ms: 2.0,
        };
        // 1,000 tokens x 1,000 bytes x 8 bits = 8e6 bits over 8e9 bit/s = 1 ms, + 2 ms.
        assert!((small.seconds(1_000) - 0.003).abs() < 1e-12);
        assert!(small.time(u64::MAX) > Duration::from_secs(1));
    }

    #[test]
    fn bad_links_are_refused() {
        for bad in [
            TransferModel {
                link_gbps: 0.0,
                ..TransferModel::default()
            },
            TransferModel {
                link_gbps: f64::NAN,
                ..TransferModel::default()
            },
            TransferModel {
                latency_ms: -1.0,
                ..TransferModel::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(TransferModel::default().validate().is_ok());
    }
}
