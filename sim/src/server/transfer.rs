//! How long moving a prompt's KV from a prefill worker to a decode worker takes.
//!
//! ```text
//! transfer(n tokens) = latency + n * bytes_per_token * 8 / (link_gbps * 1e9)   seconds
//! ```
//!
//! in simulated time (a worker waits it divided by its speedup). The defaults model
//! Llama-3-8B's fp16 KV (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 128 KiB per
//! token) over a 100 Gb/s link with 1 ms per transfer (handshake and completion notice).
//!
//! # Invariants
//! 1. A model that passed [`TransferModel::validate`] gives a finite, non-negative time,
//!    monotone in the token count; nothing panics on any count.

use std::time::Duration;

use crate::error::{Result, SimError};

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
            return Err(SimError::InvalidConfig {
                name: "transfer.link_gbps",
                reason: "must be a finite number above 0",
            });
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            return Err(SimError::InvalidConfig {
                name: "transfer.latency_ms",
                reason: "must be a finite number, at least 0",
            });
        }
        Ok(())
    }

    /// Simulated time to move the KV of `tokens` tokens (saturates at [`Duration::MAX`]).
    pub fn time(&self, tokens: u64) -> Duration {
        let bits = tokens as f64 * self.bytes_per_token as f64 * 8.0;
        let secs = self.latency_ms / 1e3 + bits / (self.link_gbps * 1e9);
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_example() {
        let m = TransferModel::default();
        assert_eq!(m.bytes_per_token, 131_072);
        // 1000 tokens: 1000 * 131072 * 8 = 1,048,576,000 bits at 100 Gb/s = 10.48576 ms,
        // plus 1 ms.
        let t = m.time(1000);
        assert!((t.as_secs_f64() - 0.011_485_76).abs() < 1e-9, "{t:?}");
        assert_eq!(m.time(0), Duration::from_millis(1));
        let slow = TransferModel {
            bytes_per_token: 1_000_000,
            link_gbps: 8.0,
            latency_ms: 0.0,
        };
        // 1 MB per token at 1 GB/s: 1 ms per token.
        assert!((slow.time(250).as_secs_f64() - 0.25).abs() < 1e-12);
        assert!(m.time(u64::MAX) > m.time(1000));
    }

    #[test]
    fn validation() {
        TransferModel::default().validate().unwrap();
        for (gbps, ms) in [
            (0.0, 1.0),
            (-1.0, 1.0),
            (f64::NAN, 1.0),
            (1.0, -1.0),
            (1.0, f64::INFINITY),
        ] {
            let m = TransferModel {
                link_gbps: gbps,
                latency_ms: ms,
                ..TransferModel::default()
            };
            assert!(m.validate().is_err(), "{m:?}");
        }
    }
}
