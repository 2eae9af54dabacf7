//! What the router reads back from workers, by kind: one [`BodyKind`] per kind of answer it
//! keeps, each with a size cap, and the [`Refusals`] counter of answers over their bound.
//! The reading itself is [`crate::outbound`]'s ([`crate::outbound::fetch`],
//! [`crate::outbound::body::read_capped`]); this is what the error type, the metrics and
//! the readers share, so it depends on nothing else of the crate.
//!
//! # Invariants
//! 1. Each kind has one cap ([`BodyKind::cap`]); TensorRT-LLM's event pages have the same
//!    one whether they are read ([`BodyKind::KvCacheEvents`]) or decoded
//!    (`trtllm::decode_page`): [`MAX_PAGE_BYTES`].
//! 2. Every refusal (too large, or not whole within its deadline) is counted per kind and
//!    reason ([`Refusals::refused`], `kvengine_worker_answers_refused_total`) and logged,
//!    at most once a second per kind.
//!
//! # Concurrency
//! [`Refusals`] is shared by every task that talks to workers: relaxed atomic counters
//! (independent counts, read only for reporting) and a mutex held only to stamp the log
//! rate limit.

use crate::log_limit::LogLimit;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The largest TensorRT-LLM `/kv_cache_events` answer (a page of events) the router reads
/// and decodes, in bytes (64 MiB): the wire decoder's cap.
pub use wire::trtllm::MAX_PAGE_BYTES;

/// What an answer read from a worker is for; each kind has its own cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BodyKind {
    /// `GET {url}/health` (the body is only drained).
    Health,
    /// `GET {url}/metrics`, the worker's Prometheus page.
    Metrics,
    /// `GET {url}/v1/models`, relayed to clients of `GET /v1/models`.
    Models,
    /// A disaggregated request's prefill answer, read whole before the decode half.
    Prefill,
    /// `POST {url}/kv_cache_events`, a TensorRT-LLM worker's page of KV events.
    KvCacheEvents,
    /// What the front door holds back of a relayed answer to patch its usage (one SSE
    /// event, or a whole non-streamed answer): over the cap the answer is relayed as is.
    Usage,
}

impl BodyKind {
    /// Every kind, in label order.
    pub const ALL: [BodyKind; 6] = [
        Self::Health,
        Self::Metrics,
        Self::Models,
        Self::Prefill,
        Self::KvCacheEvents,
        Self::Usage,
    ];

    /// Its label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Health => "health",
            Self::Metrics => "metrics",
            Self::Models => "models",
            Self::Prefill => "prefill",
            Self::KvCacheEvents => "kv_cache_events",
            Self::Usage => "usage",
        }
    }

    /// The most bytes of such an answer the router holds: 1 MiB for health and model
    /// lists, 4 MiB for metrics pages (vLLM's are tens of KiB), 16 MiB for a prefill
    /// answer (one token, plus whatever the client asked for: logprobs, an echoed
    /// prompt), TensorRT-LLM's page cap ([`MAX_PAGE_BYTES`]) for event pages, and for
    /// usage patching 1 MiB per SSE event (16 MiB for a whole answer:
    /// [`MAX_HELD_ANSWER`]).
    pub const fn cap(self) -> usize {
        match self {
            Self::Health | Self::Models | Self::Usage => 1 << 20,
            Self::Metrics => 4 << 20,
            Self::Prefill => 16 << 20,
            Self::KvCacheEvents => MAX_PAGE_BYTES,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for BodyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most bytes of a whole non-streamed answer the front door holds back to patch its
/// usage ([`BodyKind::Usage`]).
pub const MAX_HELD_ANSWER: usize = 16 << 20;

/// Why an answer was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overrun {
    /// Larger than its kind's cap.
    TooLarge,
    /// Not whole within its deadline (a worker that trickles or stalls).
    TooSlow,
}

impl Overrun {
    /// Both, in label order.
    pub const ALL: [Overrun; 2] = [Self::TooLarge, Self::TooSlow];

    /// Its label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::TooLarge => "too_large",
            Self::TooSlow => "too_slow",
        }
    }
}

/// Answers refused per kind and reason (see the module docs).
#[derive(Debug, Default)]
pub struct Refusals {
    counts: [[AtomicU64; 2]; BodyKind::ALL.len()],
    logged: LogLimit<{ BodyKind::ALL.len() }>,
}

impl Refusals {
    /// Counts one refusal and logs `detail` (at most once a second per kind).
    pub fn refused(&self, kind: BodyKind, why: Overrun, detail: &dyn fmt::Display) {
        if let Some(c) = self
            .counts
            .get(kind.index())
            .and_then(|k| k.get(why as usize))
        {
            c.fetch_add(1, Relaxed);
        }
        let now = Instant::now();
        let log = self.logged.allow(kind.index(), now);
        if log {
            tracing::warn!(
                kind = kind.as_str(),
                reason = why.as_str(),
                "refused a worker's answer: {detail}"
            );
        }
    }

    /// Refusals of `kind` for `why` so far.
    pub fn count(&self, kind: BodyKind, why: Overrun) -> u64 {
        self.counts
            .get(kind.index())
            .and_then(|k| k.get(why as usize))
            .map_or(0, |c| c.load(Relaxed))
    }

    /// `(kind, reason, count)` for every pair.
    pub fn all(&self) -> impl Iterator<Item = (BodyKind, Overrun, u64)> + '_ {
        BodyKind::ALL.into_iter().flat_map(move |k| {
            Overrun::ALL
                .into_iter()
                .map(move |o| (k, o, self.count(k, o)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_count_per_kind_and_reason() {
        let r = Refusals::default();
        r.refused(BodyKind::Models, Overrun::TooLarge, &"x");
        r.refused(BodyKind::Models, Overrun::TooLarge, &"x");
        r.refused(BodyKind::Health, Overrun::TooSlow, &"x");
        assert_eq!(r.count(BodyKind::Models, Overrun::TooLarge), 2);
        assert_eq!(r.count(BodyKind::Health, Overrun::TooSlow), 1);
        assert_eq!(r.all().map(|(_, _, n)| n).sum::<u64>(), 3);
        assert_eq!(r.all().count(), 12);
    }
}
