//! Worker roles in a disaggregated deployment, and the pool a routing call chooses from.
//!
//! A disaggregated deployment splits a request in two: a prefill worker computes the
//! prompt's KV blocks and hands them to a decode worker, which generates the answer. The
//! scheduler keeps one pool per role ([`WorkerRole`]); each routing call names the pool it
//! chooses from ([`Pool`]). Aggregated workers (the default, and every worker of a
//! deployment that does not disaggregate) serve whole requests.
//!
//! # Invariants
//! 1. Every registered key has exactly one role; a worker's ranks share it.
//! 2. [`Pool::Whole`] never names an empty pool while any worker that can serve a whole
//!    request is registered: aggregated workers first, then decode workers (which prefill
//!    locally when asked to), then prefill workers.

use std::fmt;
use std::str::FromStr;

/// What a worker does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerRole {
    /// Prefill and decode of whole requests.
    #[default]
    Aggregated,
    /// The prefill (context) phase only; hands the KV blocks to a decode worker.
    Prefill,
    /// The decode (generation) phase, from KV blocks a prefill worker computed.
    Decode,
}

impl WorkerRole {
    /// Every role, in index order.
    pub const ALL: [WorkerRole; 3] = [Self::Aggregated, Self::Prefill, Self::Decode];

    /// A dense index (0..3) for per-role tables.
    #[inline]
    pub const fn index(self) -> usize {
        match self {
            Self::Aggregated => 0,
            Self::Prefill => 1,
            Self::Decode => 2,
        }
    }

    /// The name used in flags, JSON and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Aggregated => "aggregated",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not one of `aggregated`, `prefill`, `decode`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownRole(pub String);

impl fmt::Display for UnknownRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown worker role {:?} (expected aggregated, prefill or decode)",
            self.0
        )
    }
}

impl std::error::Error for UnknownRole {}

impl FromStr for WorkerRole {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "aggregated" | "agg" | "both" => Ok(Self::Aggregated),
            "prefill" | "context" => Ok(Self::Prefill),
            "decode" | "generation" => Ok(Self::Decode),
            _ => Err(UnknownRole(s.to_owned())),
        }
    }
}

/// The workers one routing call chooses among.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Pool {
    /// Workers that serve the whole request (see invariant 2).
    #[default]
    Whole,
    /// Prefill workers: chosen by the KV cost function.
    Prefill,
    /// Decode workers: chosen mostly by load (the configured decode overlap weight).
    Decode,
}

impl Pool {
    /// The roles this pool draws from, most preferred first; the first non-empty one wins.
    pub const fn roles(self) -> &'static [WorkerRole] {
        match self {
            Self::Whole => &[
                WorkerRole::Aggregated,
                WorkerRole::Decode,
                WorkerRole::Prefill,
            ],
            Self::Prefill => &[WorkerRole::Prefill],
            Self::Decode => &[WorkerRole::Decode],
        }
    }

    /// A dense index (0..3) for per-pool state.
    #[inline]
    pub const fn index(self) -> usize {
        match self {
            Self::Whole => 0,
            Self::Prefill => 1,
            Self::Decode => 2,
        }
    }

    /// The name used in decisions and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Whole => "whole",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_with_the_engines_names() {
        for r in WorkerRole::ALL {
            assert_eq!(r.as_str().parse::<WorkerRole>(), Ok(r));
            assert_eq!(WorkerRole::ALL[r.index()], r);
        }
        assert_eq!("context".parse(), Ok(WorkerRole::Prefill));
        assert_eq!(" Generation".parse(), Ok(WorkerRole::Decode));
        let err = "gpu".parse::<WorkerRole>().unwrap_err();
        assert!(err.to_string().contains("\"gpu\""));
    }

    #[test]
    fn whole_requests_prefer_aggregated_then_decode_workers() {
        assert_eq!(Pool::Whole.roles()[0], WorkerRole::Aggregated);
        assert_eq!(Pool::Whole.roles()[1], WorkerRole::Decode);
        assert_eq!(Pool::Prefill.roles(), &[WorkerRole::Prefill]);
        assert_eq!(Pool::Decode.roles(), &[WorkerRole::Decode]);
    }
}
