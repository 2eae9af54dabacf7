//! Counters the transports bump as input arrives. Lock-free (relaxed atomics: each is an
//! independent count, read only for reporting); rendered as Prometheus text by
//! [`crate::http`] together with the figures the engine reports at scrape time.

use crate::error::DropReason;
use engine::RejectReason;
use engine::sched::RouteMode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Upper bounds (seconds) of the ingest-lag histogram buckets.
pub const LAG_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];
/// Upper bounds (seconds) of the front door's latency histograms (TTFT, inter-chunk, end
/// to end): 1 ms to 2 min.
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];
/// Upper bounds (blocks) of the overlap histogram buckets.
pub const OVERLAP_BUCKETS: [f64; 12] = [
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

/// Transport-level drop reasons, in counter order (engine refusals are read from the engine).
pub const TRANSPORT_DROPS: [DropReason; 15] = [
    DropReason::MalformedMsgpack,
    DropReason::MalformedFrame,
    DropReason::MalformedJson,
    DropReason::Oversized,
    DropReason::BlockSizeMismatch,
    DropReason::TokenCountMismatch,
    DropReason::NonGpuMedium,
    DropReason::UnknownWorker,
    DropReason::Unauthorized,
    DropReason::UnsupportedVersion,
    DropReason::DuplicateSeq,
    DropReason::IndexFull,
    DropReason::HelloTimeout,
    DropReason::TooManyUnauthenticated,
    DropReason::Other,
];

/// The HTTP edge's connection counters, shared by every listener's accept loop
/// ([`crate::http::conn`]).
#[derive(Debug, Default)]
pub struct EdgeCounters {
    /// Connections being served now.
    pub open: AtomicU64,
    /// Connections refused at `--max-connections-per-core`.
    pub refused: AtomicU64,
    /// Connections closed because a request's headers did not arrive in time (idle
    /// keep-alive connections included).
    pub header_timeouts: AtomicU64,
    /// Requests answered 408 because their body did not arrive in time.
    pub body_timeouts: AtomicU64,
    /// Connections closed because the client stopped reading its response.
    pub write_stalls: AtomicU64,
    /// TLS handshakes that failed or timed out.
    pub handshake_failures: AtomicU64,
    /// Connections a core accepted and handed to a lower core (`http::placement`).
    pub handed: AtomicU64,
    /// Connections closed because moving one between cores failed (the socket could not be
    /// taken off one core's reactor or put on the other's).
    pub handoff_failures: AtomicU64,
}

/// A fixed-bucket histogram: cumulative counts are computed when rendered.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), plus one overflow bucket.
    counts: Box<[AtomicU64]>,
    /// Sum of observations, as f64 bits (updated under a lock-free CAS loop).
    sum_bits: AtomicU64,
}

impl Histogram {
    /// A histogram with the given upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Records one observation.
    pub fn observe(&self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Relaxed);
        }
        let _ = self.sum_bits.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// `(upper bound, cumulative count)` per bucket, then the total count and the sum.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, u64, f64) {
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(self.bounds.len());
        for (b, c) in self.bounds.iter().zip(self.counts.iter()) {
            cumulative += c.load(Relaxed);
            buckets.push((*b, cumulative));
        }
        let total = cumulative + self.counts.last().map_or(0, |c| c.load(Relaxed));
        (buckets, total, f64::from_bits(self.sum_bits.load(Relaxed)))
    }
}

/// Why a routing decision chose its worker, as `/metrics` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionReason {
    /// No candidate cached any of the prompt: load decided.
    NoCacheHit,
    /// The chosen worker had the best overlap of all candidates.
    BestOverlap,
    /// A worker with a better overlap was passed over (its load cost more).
    TradedForLoad,
}

impl DecisionReason {
    /// Every reason, in label order.
    pub const ALL: [DecisionReason; 3] = [Self::NoCacheHit, Self::BestOverlap, Self::TradedForLoad];

    /// The reason of a decision whose worker cached `chosen` blocks of the prompt when
    /// the best candidate cached `best`.
    pub fn of(chosen: u32, best: u32) -> Self {
        match (best, chosen >= best) {
            (0, _) => Self::NoCacheHit,
            (_, true) => Self::BestOverlap,
            (_, false) => Self::TradedForLoad,
        }
    }

    /// Its label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoCacheHit => "no_cache_hit",
            Self::BestOverlap => "best_overlap",
            Self::TradedForLoad => "traded_for_load",
        }
    }
}

/// The `model` label of front-door answers refused before their model was known (malformed
/// bodies, unknown models).
pub const NO_MODEL: &str = "(none)";

/// How the front door's session requests routed ([`engine::router::sessions`]); the
/// table's own figures (live, evicted, expired, dropped) are read from the namespaces at
/// scrape time.
#[derive(Debug, Default)]
pub struct SessionCounters {
    /// Requests routed to their session's worker.
    pub sticky: AtomicU64,
    /// First requests of a session (routed by cost, then remembered).
    pub new: AtomicU64,
    /// Requests whose session's worker was busy or full: routed by cost, session moved.
    pub moved_busy: AtomicU64,
    /// Requests whose session's worker was out of routing: routed by cost, session moved.
    pub moved_gone: AtomicU64,
    /// Session headers refused (over [`crate::bounds::MAX_SESSION_KEY_BYTES`], not
    /// visible ASCII): answered 400.
    pub refused: AtomicU64,
}

impl SessionCounters {
    /// Counts a request routed as `how`.
    pub fn routed(&self, how: engine::router::SessionRoute) {
        use engine::router::{MoveReason, SessionRoute};
        let c = match how {
            SessionRoute::Sticky => &self.sticky,
            SessionRoute::New => &self.new,
            SessionRoute::Moved(MoveReason::Busy) => &self.moved_busy,
            SessionRoute::Moved(MoveReason::Gone) => &self.moved_gone,
        };
        c.fetch_add(1, Relaxed);
    }
}

/// The admission queue's counters ([`engine::router::admission`]); its depth is read from
/// the namespaces at scrape time.
#[derive(Debug)]
pub struct AdmissionCounters {
    /// Requests that had to wait (queued).
    pub queued: AtomicU64,
    /// Queued requests admitted (routed after their wait).
    pub admitted: AtomicU64,
    /// Requests refused with 429 `queue_full`.
    pub rejected_full: AtomicU64,
    /// Queued requests refused with 503 `queue_timeout`.
    pub rejected_timeout: AtomicU64,
    /// Queued requests whose client went away while they waited.
    pub cancelled: AtomicU64,
    /// Priority headers refused (not an integer): answered 400.
    pub bad_priority: AtomicU64,
    /// Seconds admitted requests waited.
    pub wait: Histogram,
}

impl Default for AdmissionCounters {
    fn default() -> Self {
        Self {
            queued: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            rejected_full: AtomicU64::new(0),
            rejected_timeout: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            bad_priority: AtomicU64::new(0),
            wait: Histogram::new(&LATENCY_BUCKETS),
        }
    }
}

/// Everything the transports count.
#[derive(Debug)]
pub struct Metrics {
    /// KV events handed to the engine (the engine's own refusals are subtracted when
    /// reporting `kvengine_events_applied_total`).
    pub events_forwarded: AtomicU64,
    /// Blocks in the stored events handed to the engine.
    pub blocks_stored: AtomicU64,
    /// Blocks in the removed events handed to the engine.
    pub blocks_removed: AtomicU64,
    /// Batches that arrived after a gap and were replayed.
    pub replayed_batches: AtomicU64,
    /// Workers cleared because their stream could not be repaired.
    pub resyncs: AtomicU64,
    /// Publisher restarts detected (live seq went backwards).
    pub restarts: AtomicU64,
    /// Worker metrics pages read (load scraped from `{url}/metrics`).
    pub load_scrapes: AtomicU64,
    /// Worker metrics pages that could not be read (no page, bad status, timeout).
    pub load_scrape_failures: AtomicU64,
    /// Front door: seconds from a request's arrival to the first bytes of its answer.
    pub ttft: Histogram,
    /// Front door: seconds between consecutive chunks of an answer (tokens, when streamed).
    pub inter_chunk: Histogram,
    /// Front door: seconds from a request's arrival to the end of its answer.
    pub end_to_end: Histogram,
    /// Front door: writes of answers' bodies to clients (the chunks of an answer that
    /// arrived together go out in one: `openai::relay`, invariant 4).
    pub answer_writes: AtomicU64,
    /// Front door: requests forwarded to a worker that failed before answering.
    pub upstream_errors: AtomicU64,
    /// Front door: requests sent again to another worker after a failure.
    pub retries: AtomicU64,
    /// Times the engine's cores did not all answer a stats query within its deadline (a
    /// stalled core), seen by `/metrics`, `/ready` or `/health`.
    pub engine_unresponsive: AtomicU64,
    /// Front door: answers per (model, HTTP status). Models are the configured or
    /// registered ones (clients cannot add labels: an unknown name is [`NO_MODEL`]).
    statuses: Mutex<std::collections::BTreeMap<(String, u16), u64>>,
    /// The HTTP edge's connections.
    pub edge: std::sync::Arc<EdgeCounters>,
    /// Routing calls refused because the router carried `--max-active-requests`.
    pub overloaded: AtomicU64,
    /// Routing calls refused because their client held `--max-reservations-per-client`.
    pub too_many_reservations: AtomicU64,
    /// Sticky sessions.
    pub sessions: SessionCounters,
    /// The admission queue.
    pub admission: AdmissionCounters,
    /// Disaggregated requests whose prefill went to a prefill worker.
    pub disagg_remote: AtomicU64,
    /// Disaggregated requests prefilled on their decode worker (conditional disaggregation).
    pub disagg_local: AtomicU64,
    /// Prefill or decode halves that failed and were served elsewhere.
    pub disagg_fallbacks: AtomicU64,
    /// Workers' answers refused for their size or slowness ([`crate::worker_answers`]).
    pub worker_answers: crate::worker_answers::Refusals,
    drops: [AtomicU64; TRANSPORT_DROPS.len()],
    decisions: [AtomicU64; RouteMode::ALL.len()],
    /// Routing decisions by why the chosen worker won ([`DecisionReason`]).
    reasons: [AtomicU64; DecisionReason::ALL.len()],
    /// Seconds between a batch's publisher timestamp and its arrival.
    pub ingest_lag: Histogram,
    /// Overlap, in blocks, of each routed request with the worker chosen.
    pub chosen_overlap: Histogram,
    /// Best overlap, in blocks, any worker had for each routed request.
    pub best_overlap: Histogram,
    /// Why requests missed the cache, and what a shadow policy would have had.
    pub misses: crate::misses::MissCounters,
    /// When a drop was last logged, per reason, to rate-limit the log lines.
    logged: crate::log_limit::LogLimit<{ TRANSPORT_DROPS.len() }>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            events_forwarded: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            blocks_removed: AtomicU64::new(0),
            replayed_batches: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            load_scrapes: AtomicU64::new(0),
            load_scrape_failures: AtomicU64::new(0),
            ttft: Histogram::new(&LATENCY_BUCKETS),
            inter_chunk: Histogram::new(&LATENCY_BUCKETS),
            end_to_end: Histogram::new(&LATENCY_BUCKETS),
            answer_writes: AtomicU64::new(0),
            upstream_errors: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            engine_unresponsive: AtomicU64::new(0),
            statuses: Mutex::new(std::collections::BTreeMap::new()),
            overloaded: AtomicU64::new(0),
            too_many_reservations: AtomicU64::new(0),
            edge: std::sync::Arc::default(),
            sessions: SessionCounters::default(),
            admission: AdmissionCounters::default(),
            disagg_remote: AtomicU64::new(0),
            disagg_local: AtomicU64::new(0),
            disagg_fallbacks: AtomicU64::new(0),
            worker_answers: Default::default(),
            drops: Default::default(),
            decisions: Default::default(),
            reasons: Default::default(),
            ingest_lag: Histogram::new(&LAG_BUCKETS),
            chosen_overlap: Histogram::new(&OVERLAP_BUCKETS),
            best_overlap: Histogram::new(&OVERLAP_BUCKETS),
            misses: Default::default(),
            logged: crate::log_limit::LogLimit::default(),
        }
    }
}

fn drop_index(reason: DropReason) -> usize {
    match reason {
        // The engine's refusals are counted by the engine; a transport that sees one
        // (a synchronous apply) leaves it to the engine's counter.
        DropReason::Engine(_) => usize::MAX,
        r => TRANSPORT_DROPS
            .iter()
            .position(|&d| d == r)
            .unwrap_or(TRANSPORT_DROPS.len() - 1),
    }
}

impl Metrics {
    /// Counts `n` inputs dropped for `reason` and logs a warning with `detail`, at most once
    /// a second per reason (a flood of bad frames must not flood the log).
    pub fn drop_input(&self, reason: DropReason, n: u64, detail: &dyn std::fmt::Display) {
        let i = drop_index(reason);
        let Some(counter) = self.drops.get(i) else {
            return;
        };
        counter.fetch_add(n, Relaxed);
        let now = std::time::Instant::now();
        let log = self.logged.allow(i, now);
        if log {
            tracing::warn!(
                reason = reason.as_str(),
                count = n,
                "dropped input: {detail}"
            );
        }
    }

    /// Inputs dropped for `reason` so far (transport reasons only).
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.drops
            .get(drop_index(reason))
            .map_or(0, |c| c.load(Relaxed))
    }

    /// `(reason, count)` for every transport-level reason.
    pub fn drops(&self) -> impl Iterator<Item = (DropReason, u64)> + '_ {
        TRANSPORT_DROPS
            .iter()
            .zip(self.drops.iter())
            .map(|(&r, c)| (r, c.load(Relaxed)))
    }

    /// Counts one front-door answer for `model` (its namespace; [`NO_MODEL`] if the
    /// request was refused before one was known) with HTTP `status`.
    pub fn answered(&self, model: &str, status: u16) {
        let mut m = self
            .statuses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match m.get_mut(&(model.to_owned(), status)) {
            Some(n) => *n += 1,
            None => {
                m.insert((model.to_owned(), status), 1);
            }
        }
    }

    /// `(status, answers)` of the front door, by status (over every model).
    pub fn answers(&self) -> Vec<(u16, u64)> {
        let mut by_status = std::collections::BTreeMap::new();
        for ((_, s), n) in self.answers_by_model() {
            *by_status.entry(s).or_insert(0) += n;
        }
        by_status.into_iter().collect()
    }

    /// `((model, status), answers)` of the front door.
    pub fn answers_by_model(&self) -> Vec<((String, u16), u64)> {
        let m = self
            .statuses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.iter().map(|(k, &n)| (k.clone(), n)).collect()
    }

    /// Counts one routing decision made in `mode`.
    pub fn decided(&self, mode: RouteMode) {
        if let Some(i) = RouteMode::ALL.iter().position(|&m| m == mode)
            && let Some(c) = self.decisions.get(i)
        {
            c.fetch_add(1, Relaxed);
        }
    }

    /// Counts one routing decision by why its worker won.
    pub fn decided_because(&self, reason: DecisionReason) {
        if let Some(c) = self.reasons.get(reason as usize) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// `(reason, decisions)` for every reason.
    pub fn decision_reasons(&self) -> impl Iterator<Item = (DecisionReason, u64)> + '_ {
        DecisionReason::ALL
            .iter()
            .zip(self.reasons.iter())
            .map(|(&r, c)| (r, c.load(Relaxed)))
    }

    /// `(mode, decisions)` for every mode.
    pub fn decisions(&self) -> impl Iterator<Item = (RouteMode, u64)> + '_ {
        RouteMode::ALL
            .iter()
            .zip(self.decisions.iter())
            .map(|(&m, c)| (m, c.load(Relaxed)))
    }

    /// Events applied: forwarded minus the engine's refusals (`engine_rejects`).
    pub fn events_applied(&self, engine_rejects: u64) -> u64 {
        self.events_forwarded
            .load(Relaxed)
            .saturating_sub(engine_rejects)
    }
}

/// Labels of the engine's refusal counters, for rendering beside [`TRANSPORT_DROPS`].
pub fn engine_reasons() -> impl Iterator<Item = RejectReason> {
    RejectReason::ALL.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_reasons_follow_the_overlaps() {
        assert_eq!(DecisionReason::of(0, 0), DecisionReason::NoCacheHit);
        assert_eq!(DecisionReason::of(3, 3), DecisionReason::BestOverlap);
        assert_eq!(DecisionReason::of(1, 3), DecisionReason::TradedForLoad);
        let m = Metrics::default();
        m.decided_because(DecisionReason::TradedForLoad);
        m.decided_because(DecisionReason::TradedForLoad);
        let got: Vec<_> = m.decision_reasons().map(|(r, n)| (r.as_str(), n)).collect();
        assert_eq!(
            got,
            [
                ("no_cache_hit", 0),
                ("best_overlap", 0),
                ("traded_for_load", 2)
            ]
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&OVERLAP_BUCKETS);
        for v in [0.0, 1.0, 3.0, 3.0, 5000.0] {
            h.observe(v);
        }
        let (buckets, total, sum) = h.snapshot();
        assert_eq!(total, 5);
        assert_eq!(sum, 5007.0);
        assert_eq!(buckets[0], (0.0, 1));
        assert_eq!(buckets[1], (1.0, 2));
        assert_eq!(buckets[2], (2.0, 2));
        assert_eq!(buckets[3], (4.0, 4));
        assert_eq!(buckets.last().copied(), Some((1024.0, 4)));
    }

    #[test]
    fn drops_count_by_reason_and_engine_reasons_are_left_to_the_engine() {
        let m = Metrics::default();
        m.drop_input(DropReason::MalformedMsgpack, 2, &"x");
        m.drop_input(DropReason::MalformedMsgpack, 1, &"x");
        m.drop_input(DropReason::Engine(RejectReason::UnknownParent), 5, &"x");
        assert_eq!(m.dropped(DropReason::MalformedMsgpack), 3);
        assert_eq!(m.drops().map(|(_, n)| n).sum::<u64>(), 3);
    }
}
