//! `GET /metrics`: the hub's counters and the engine's figures as Prometheus text
//! (OpenMetrics), rendered with `prometheus-client` from a registry built at scrape time.

use super::api_error::ApiError;
use super::shared::AppState;
use crate::hub::Hub;
use crate::metrics::Histogram as HubHistogram;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use engine::runtime::CoreSummary;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The `Content-Type` of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A histogram already aggregated elsewhere (the hub's lock-free one), for encoding.
#[derive(Debug)]
struct Snapshot {
    sum: f64,
    count: u64,
    /// `(upper bound, count in this bucket)`, `+Inf` last (non-cumulative, as the encoder
    /// accumulates).
    buckets: Vec<(f64, u64)>,
}

impl Snapshot {
    fn of(h: &HubHistogram) -> Self {
        let (cumulative, count, sum) = h.snapshot();
        let mut buckets = Vec::with_capacity(cumulative.len() + 1);
        let mut prev = 0;
        for (bound, c) in cumulative {
            buckets.push((bound, c.saturating_sub(prev)));
            prev = c;
        }
        buckets.push((f64::INFINITY, count.saturating_sub(prev)));
        Self {
            sum,
            count,
            buckets,
        }
    }
}

impl TypedMetric for Snapshot {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Snapshot {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

type Labels1 = [(&'static str, String); 1];
type Labels2 = [(&'static str, String); 2];

fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

fn gauge(v: u64) -> Gauge {
    let g = Gauge::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    g
}

fn seconds(us: u64) -> Gauge<f64, std::sync::atomic::AtomicU64> {
    let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    g.set(us as f64 / 1e6);
    g
}

/// Snapshots and the restore at start (`--state-dir`).
fn register_state(reg: &mut Registry, p: &crate::state::Persisted) {
    reg.register(
        "kvengine_snapshots",
        "Snapshots written to --state-dir",
        counter(p.snapshots.load(Relaxed)),
    );
    reg.register(
        "kvengine_snapshot_failures",
        "Snapshots that could not be taken or written",
        counter(p.snapshot_failures.load(Relaxed)),
    );
    reg.register(
        "kvengine_snapshot_last_seconds",
        "Seconds the last snapshot took, from the engine's cut to the file in place",
        seconds(p.last_snapshot_us.load(Relaxed)),
    );
    reg.register(
        "kvengine_snapshot_last_bytes",
        "Bytes of the last snapshot",
        gauge(p.last_snapshot_bytes.load(Relaxed)),
    );
    reg.register(
        "kvengine_restore_seconds",
        "Seconds the restore from the snapshot took at start (0: started cold)",
        seconds(p.restore_us.load(Relaxed)),
    );
    reg.register(
        "kvengine_restored_workers",
        "Workers whose restored blocks were kept (their streams resume from the snapshot)",
        gauge(p.restored_workers.load(Relaxed)),
    );
    reg.register(
        "kvengine_restore_cleared_workers",
        "Workers whose restored blocks were dropped: no resumable stream, or no longer \
         registered",
        gauge(p.restore_cleared.load(Relaxed)),
    );
}

/// Renders every metric (see `docs/api.md` for the list). `cores` is `None` when the
/// engine did not answer in time: the per-shard series are then left out and
/// `kvengine_engine_responsive` is 0.
pub fn render(hub: &Hub, cores: Option<&[CoreSummary]>) -> Result<String, std::fmt::Error> {
    let m = hub.metrics();
    let mut reg = Registry::default();
    let responsive = Gauge::<i64>::default();
    responsive.set(i64::from(cores.is_some()));
    reg.register(
        "kvengine_engine_responsive",
        "1 when every engine core answered this scrape's stats query within its deadline",
        responsive,
    );
    reg.register(
        "kvengine_engine_unresponsive",
        "Stats queries (/metrics, /ready, /health) some core did not answer in time: a \
         stalled core",
        counter(m.engine_unresponsive.load(Relaxed)),
    );
    let cores = cores.unwrap_or_default();
    super::process::ProcessStats::read().register(&mut reg);

    let engine_rejects: u64 = cores.iter().map(|c| c.rejects.total()).sum();
    reg.register(
        "kvengine_events_applied",
        "KV events applied to the index (handed to the engine minus its refusals)",
        counter(m.events_applied(engine_rejects)),
    );

    let mut reasons: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (r, n) in m.drops() {
        *reasons.entry(r.as_str()).or_default() += n;
    }
    for r in crate::metrics::engine_reasons() {
        let n: u64 = cores.iter().map(|c| c.rejects.get(r)).sum();
        *reasons.entry(r.as_str()).or_default() += n;
    }
    let rejected = Family::<Labels1, Counter>::default();
    for (r, n) in reasons {
        rejected
            .get_or_create(&[("reason", r.to_owned())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_events_rejected",
        "KV events (or inputs) refused, by reason",
        rejected,
    );

    let blocks = Family::<Labels1, Counter>::default();
    blocks
        .get_or_create(&[("kind", "stored".to_owned())])
        .inc_by(m.blocks_stored.load(Relaxed));
    blocks
        .get_or_create(&[("kind", "removed".to_owned())])
        .inc_by(m.blocks_removed.load(Relaxed));
    reg.register(
        "kvengine_block_events",
        "Blocks carried by the stored and removed events handed to the engine",
        blocks,
    );

    let entries = Family::<Labels1, Gauge>::default();
    let backlog = Family::<Labels1, Gauge>::default();
    for c in cores {
        entries
            .get_or_create(&[("shard", c.shard.to_string())])
            .set(i64::try_from(c.index.entries).unwrap_or(i64::MAX));
        backlog
            .get_or_create(&[("shard", c.shard.to_string())])
            .set(i64::try_from(c.ring_backlog).unwrap_or(i64::MAX));
    }
    reg.register(
        "kvengine_index_entries",
        "(seq_hash, worker rank) pairs held by each shard's index",
        entries,
    );
    reg.register(
        "kvengine_ring_backlog",
        "Messages waiting in each core's incoming rings when it reported",
        backlog,
    );
    reg.register(
        "kvengine_directory_entries",
        "Engine hashes in the workers' directories",
        gauge(cores.iter().map(|c| c.directory_entries as u64).sum()),
    );
    reg.register(
        "kvengine_queries",
        "Prefix queries the shards answered",
        counter(cores.iter().map(|c| c.queries).sum()),
    );
    register_bounds(&mut reg, hub, cores);
    register_sessions_admission(&mut reg, hub);

    let decisions = Family::<Labels1, Counter>::default();
    for (mode, n) in m.decisions() {
        decisions
            .get_or_create(&[("mode", mode.as_str().to_owned())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_decisions",
        "Routing decisions, by mode",
        decisions,
    );
    let reasons = Family::<Labels1, Counter>::default();
    for (reason, n) in m.decision_reasons() {
        reasons
            .get_or_create(&[("reason", reason.as_str().to_owned())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_decision_reasons",
        "Routing decisions, by why the chosen worker won: no candidate cached the prompt \
         (no_cache_hit), it cached the most (best_overlap), or a better-cached worker cost \
         more in load (traded_for_load)",
        reasons,
    );

    let answers = Family::<Labels2, Counter>::default();
    for ((model, status), n) in m.answers_by_model() {
        answers
            .get_or_create(&[("model", model), ("status", status.to_string())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_frontdoor_requests",
        "OpenAI front-door requests answered, by model (\"\": the unnamed pool) and HTTP status",
        answers,
    );
    reg.register(
        "kvengine_frontdoor_ttft_seconds",
        "Front door: request arrival to the first bytes of the worker's answer",
        Snapshot::of(&m.ttft),
    );
    reg.register(
        "kvengine_frontdoor_inter_chunk_seconds",
        "Front door: gaps between an answer's chunks (tokens, when streamed)",
        Snapshot::of(&m.inter_chunk),
    );
    reg.register(
        "kvengine_frontdoor_e2e_seconds",
        "Front door: request arrival to the end of the worker's answer",
        Snapshot::of(&m.end_to_end),
    );
    reg.register(
        "kvengine_frontdoor_answer_writes",
        "Front door: writes of answers to clients (chunks that arrived together go out in one)",
        counter(m.answer_writes.load(Relaxed)),
    );
    reg.register(
        "kvengine_frontdoor_upstream_errors",
        "Front door: workers that failed before or while answering",
        counter(m.upstream_errors.load(Relaxed)),
    );
    reg.register(
        "kvengine_frontdoor_retries",
        "Front door: requests sent again to another worker after a failure",
        counter(m.retries.load(Relaxed)),
    );

    super::misses::register(&mut reg, hub);
    reg.register(
        "kvengine_route_overlap_blocks",
        "Overlap, in blocks, of each routed request with the worker chosen",
        Snapshot::of(&m.chosen_overlap),
    );
    reg.register(
        "kvengine_route_best_overlap_blocks",
        "Best overlap, in blocks, any worker had for each routed request",
        Snapshot::of(&m.best_overlap),
    );
    reg.register(
        "kvengine_ingest_lag_seconds",
        "Seconds between a batch's publisher timestamp and its arrival",
        Snapshot::of(&m.ingest_lag),
    );
    reg.register(
        "kvengine_replayed_batches",
        "Event batches replayed after a gap",
        counter(m.replayed_batches.load(Relaxed)),
    );
    reg.register(
        "kvengine_resyncs",
        "Worker ranks cleared because their event stream could not be repaired",
        counter(m.resyncs.load(Relaxed)),
    );
    register_state(&mut reg, hub.persisted());
    if let Some(r) = hub.routing().replicas() {
        register_replicas(&mut reg, r.stats());
    }
    reg.register(
        "kvengine_worker_load_scrapes",
        "Worker /metrics pages read for their load",
        counter(m.load_scrapes.load(Relaxed)),
    );
    reg.register(
        "kvengine_worker_load_scrape_failures",
        "Worker /metrics pages that could not be read",
        counter(m.load_scrape_failures.load(Relaxed)),
    );
    let refused = Family::<Labels2, Counter>::default();
    for (kind, why, n) in m.worker_answers.all() {
        refused
            .get_or_create(&[
                ("kind", kind.as_str().into()),
                ("reason", why.as_str().into()),
            ])
            .inc_by(n);
    }
    reg.register(
        "kvengine_worker_answers_refused",
        "Answers read from workers refused for their size (too_large) or slowness (too_slow), \
         by kind (health, metrics, models, prefill, kv_cache_events, usage)",
        refused,
    );
    reg.register(
        "kvengine_publisher_restarts",
        "Event publisher restarts detected",
        counter(m.restarts.load(Relaxed)),
    );
    reg.register(
        "kvengine_disagg_remote_prefills",
        "Disaggregated requests prefilled on a prefill worker",
        counter(m.disagg_remote.load(Relaxed)),
    );
    reg.register(
        "kvengine_disagg_local_prefills",
        "Disaggregated requests prefilled on their decode worker (uncached part too short)",
        counter(m.disagg_local.load(Relaxed)),
    );
    reg.register(
        "kvengine_disagg_fallbacks",
        "Prefill or decode halves that failed and were served elsewhere",
        counter(m.disagg_fallbacks.load(Relaxed)),
    );
    reg.register(
        "kvengine_active_requests",
        "Routed requests not finished yet",
        gauge(hub.routing().active_requests() as u64),
    );

    let active_blocks = Family::<Labels2, Gauge>::default();
    let prefill = Family::<Labels2, Gauge>::default();
    let active_requests = Family::<Labels2, Gauge>::default();
    let waiting = Family::<Labels2, Gauge>::default();
    let kv_usage = Family::<Labels2, Gauge<f64, AtomicU64>>::default();
    let healthy = Family::<Labels2, Gauge>::default();
    for w in hub.workers() {
        let id = w.registration.worker.0.to_string();
        for (rank, active, reported) in w.loads {
            let labels = [("worker_id", id.clone()), ("dp_rank", rank.0.to_string())];
            let a = active.unwrap_or_default();
            let set = |f: &Family<Labels2, Gauge>, v: u64| {
                f.get_or_create(&labels)
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            };
            set(&active_blocks, a.active_blocks);
            set(&prefill, a.active_prefill_tokens);
            set(&active_requests, a.active_requests);
            set(&healthy, u64::from(w.healthy));
            if let Some(r) = reported {
                set(&waiting, r.num_requests_waiting);
                kv_usage.get_or_create(&labels).set(r.kv_usage);
            }
        }
    }
    reg.register(
        "kvengine_worker_active_blocks",
        "Distinct blocks of the active requests on each worker rank",
        active_blocks,
    );
    reg.register(
        "kvengine_worker_active_prefill_tokens",
        "Tokens still to prefill on each worker rank",
        prefill,
    );
    reg.register(
        "kvengine_worker_active_requests",
        "Active requests on each worker rank",
        active_requests,
    );
    reg.register(
        "kvengine_worker_requests_waiting",
        "Requests queued on each worker rank, as it last reported",
        waiting,
    );
    reg.register(
        "kvengine_worker_kv_usage",
        "KV cache usage (0..1) of each worker rank, as it last reported",
        kv_usage,
    );
    reg.register(
        "kvengine_worker_healthy",
        "1 if the worker rank takes part in routing, 0 after failed health checks",
        healthy,
    );

    let mut out = String::with_capacity(8 << 10);
    prometheus_client::encoding::text::encode(&mut out, &reg)?;
    Ok(out)
}

/// The bounds of [`crate::bounds`]: the index's memory against its budget, refused stores,
/// degraded ranks, routes refused at the active-request cap.
fn register_bounds(reg: &mut Registry, hub: &Hub, cores: &[CoreSummary]) {
    let budget = hub.index_budget();
    reg.register(
        "kvengine_index_heap_bytes",
        "Heap bytes of every shard's index and the workers' directories",
        gauge(
            cores
                .iter()
                .map(|c| c.index.bytes.saturating_add(c.directory_bytes) as u64)
                .sum(),
        ),
    );
    reg.register(
        "kvengine_index_budget_bytes",
        "--max-index-bytes (0: no budget)",
        gauge(budget.limit().unwrap_or(0)),
    );
    reg.register(
        "kvengine_index_full",
        "1 while the index is over --max-index-bytes and stores are refused",
        gauge(u64::from(budget.is_full())),
    );
    let refused = Family::<Labels1, Counter>::default();
    let worker_full: u64 = cores
        .iter()
        .map(|c| c.rejects.get(engine::RejectReason::WorkerFull))
        .sum();
    let index_full = hub.metrics().dropped(crate::error::DropReason::IndexFull);
    for (reason, n) in [("index_full", index_full), ("worker_full", worker_full)] {
        refused
            .get_or_create(&[("reason", reason.to_owned())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_stores_refused",
        "Stored events refused by the bounds: the index over --max-index-bytes (index_full) \
         or a rank at --max-blocks-per-worker (worker_full)",
        refused,
    );
    let degraded = Family::<Labels1, Gauge>::default();
    let workers = hub.workers();
    for reason in crate::bounds::Degraded::ALL {
        let n = workers
            .iter()
            .flat_map(|w| &w.degraded)
            .filter(|(_, r)| *r == reason)
            .count();
        degraded
            .get_or_create(&[("reason", reason.as_str().to_owned())])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    reg.register(
        "kvengine_workers_degraded",
        "Worker ranks whose stores the bounds refused, by reason",
        degraded,
    );
    reg.register(
        "kvengine_routes_overloaded",
        "Routing calls refused (503 overloaded) at --max-active-requests",
        counter(hub.metrics().overloaded.load(Relaxed)),
    );
    reg.register(
        "kvengine_routes_too_many_reservations",
        "Routing calls refused (429 too_many_reservations) at --max-reservations-per-client",
        counter(hub.metrics().too_many_reservations.load(Relaxed)),
    );
    let edge = &hub.metrics().edge;
    reg.register(
        "kvengine_http_connections_open",
        "HTTP connections being served",
        gauge(edge.open.load(Relaxed)),
    );
    let closed = Family::<Labels1, Counter>::default();
    for (reason, n) in [
        ("connection_limit", &edge.refused),
        ("header_timeout", &edge.header_timeouts),
        ("body_timeout", &edge.body_timeouts),
        ("write_stall", &edge.write_stalls),
        ("tls_handshake", &edge.handshake_failures),
        ("handoff_failed", &edge.handoff_failures),
    ] {
        closed
            .get_or_create(&[("reason", reason.to_owned())])
            .inc_by(n.load(Relaxed));
    }
    reg.register(
        "kvengine_http_connections_handed",
        "HTTP connections a core accepted and handed to a lower core that was not busy \
         (--edge-fill)",
        counter(edge.handed.load(Relaxed)),
    );
    reg.register(
        "kvengine_http_connections_refused",
        "HTTP connections refused or closed by the edge's bounds, by reason (body_timeout: \
         requests answered 408)",
        closed,
    );
}

pub(super) async fn metrics(State(st): State<AppState>) -> Response {
    // A stalled core must not take the whole page with it: that is when the rest matters.
    let cores = match crate::cores::engine_call(|| st.hub.core_stats()) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("/metrics without the shards' figures: {e}");
            st.hub.metrics().engine_unresponsive.fetch_add(1, Relaxed);
            None
        }
    };
    match render(&st.hub, cores.as_deref()) {
        Ok(text) => {
            let mut r = (StatusCode::OK, text).into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
            r
        }
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "could not encode the metrics",
        )
        .into_response(),
    }
}

/// Router replicas' sync ([`crate::replicas`]).
/// Sticky sessions and the admission queue ([`engine::router::sessions`],
/// [`engine::router::admission`]).
fn register_sessions_admission(reg: &mut Registry, hub: &Hub) {
    let m = hub.metrics();
    let s = &m.sessions;
    let routed = Family::<Labels1, Counter>::default();
    for (how, c) in [
        ("sticky", &s.sticky),
        ("new", &s.new),
        ("moved_busy", &s.moved_busy),
        ("moved_gone", &s.moved_gone),
    ] {
        routed
            .get_or_create(&[("route", how.to_owned())])
            .inc_by(c.load(Relaxed));
    }
    reg.register(
        "kvengine_session_requests",
        "Front-door requests naming a session, by how they routed: to the session's worker \
         (sticky), the session's first (new), or by cost because its worker was busy or full \
         (moved_busy) or out of routing (moved_gone)",
        routed,
    );
    let table = hub.routing().session_stats();
    reg.register(
        "kvengine_sessions",
        "Sessions remembered, over every model",
        gauge(table.live),
    );
    let removed = Family::<Labels1, Counter>::default();
    for (reason, n) in [
        ("evicted", table.evicted),
        ("expired", table.expired),
        ("worker_removed", table.dropped),
    ] {
        removed
            .get_or_create(&[("reason", reason.to_owned())])
            .inc_by(n);
    }
    reg.register(
        "kvengine_sessions_removed",
        "Sessions forgotten: evicted at --max-sessions (least recently used), expired after \
         --session-ttl-secs unused, or their worker removed",
        removed,
    );
    reg.register(
        "kvengine_session_headers_refused",
        "Session headers answered 400 (too long, or not visible ASCII)",
        counter(s.refused.load(Relaxed)),
    );
    let a = &m.admission;
    reg.register(
        "kvengine_admission_queue_depth",
        "Requests waiting in the admission queues, over every model",
        gauge(hub.routing().queued() as u64),
    );
    reg.register(
        "kvengine_admission_queued",
        "Requests that found every worker busy and waited in the admission queue",
        counter(a.queued.load(Relaxed)),
    );
    reg.register(
        "kvengine_admission_admitted",
        "Queued requests admitted (routed after their wait)",
        counter(a.admitted.load(Relaxed)),
    );
    reg.register(
        "kvengine_admission_wait_seconds",
        "Time admitted requests waited in the admission queue",
        Snapshot::of(&a.wait),
    );
    let rejected = Family::<Labels1, Counter>::default();
    for (reason, c) in [
        ("full", &a.rejected_full),
        ("timeout", &a.rejected_timeout),
        ("client_gone", &a.cancelled),
        ("bad_priority", &a.bad_priority),
    ] {
        rejected
            .get_or_create(&[("reason", reason.to_owned())])
            .inc_by(c.load(Relaxed));
    }
    reg.register(
        "kvengine_admission_rejected",
        "Requests that left without being admitted: 429 queue_full (full), 503 queue_timeout \
         (timeout), their client went away while queued (client_gone), or 400 for a bad \
         x-kvengine-priority (bad_priority)",
        rejected,
    );
}

fn register_replicas(reg: &mut Registry, s: &crate::replicas::ReplicaStats) {
    let c = |a: &std::sync::atomic::AtomicU64| counter(a.load(Relaxed));
    reg.register(
        "kvengine_replica_connected",
        "1 while the link to NATS is up (0: routing on this replica's own load)",
        gauge(u64::from(s.connected.load(Relaxed))),
    );
    reg.register(
        "kvengine_replica_peers",
        "Peer replicas heard within the timeout",
        gauge(s.peers.load(Relaxed)),
    );
    for (name, help, v) in [
        (
            "kvengine_replica_outages",
            "Times the link to NATS went down",
            &s.outages,
        ),
        (
            "kvengine_replica_frames_sent",
            "Frames published to peers",
            &s.frames_sent,
        ),
        (
            "kvengine_replica_sent_bytes",
            "Bytes published to peers",
            &s.bytes_sent,
        ),
        (
            "kvengine_replica_events_queued",
            "Load events handed to the sync (each then sent or dropped)",
            &s.events_queued,
        ),
        (
            "kvengine_replica_events_sent",
            "Load events published",
            &s.events_sent,
        ),
        (
            "kvengine_replica_events_dropped",
            "Load events not published (link down or queue full; the state is sent instead)",
            &s.events_dropped,
        ),
        (
            "kvengine_replica_frames_received",
            "Peers' frames received",
            &s.frames_received,
        ),
        (
            "kvengine_replica_received_bytes",
            "Peers' frame bytes received",
            &s.bytes_received,
        ),
        (
            "kvengine_replica_events_applied",
            "Peers' load events applied",
            &s.events_applied,
        ),
        (
            "kvengine_replica_unknown_worker",
            "Peers' requests on workers this replica does not route to",
            &s.unknown_worker,
        ),
        (
            "kvengine_replica_unmatched",
            "Peers' prefilled/freed events for requests not active here",
            &s.unmatched,
        ),
        (
            "kvengine_replica_refused",
            "Peers' requests refused (bad names)",
            &s.refused,
        ),
        (
            "kvengine_replica_malformed",
            "Frames that could not be decoded",
            &s.malformed,
        ),
        (
            "kvengine_replica_unauthenticated",
            "Frames and resync requests refused for a missing or bad MAC (--replica-secret)",
            &s.unauthenticated,
        ),
        (
            "kvengine_replica_gaps",
            "Gaps in peers' frames (each asks for a state)",
            &s.gaps,
        ),
        (
            "kvengine_replica_states_sent",
            "Whole states this replica sent",
            &s.states_sent,
        ),
        (
            "kvengine_replica_peers_expired",
            "Peers found dead (load dropped)",
            &s.peers_expired,
        ),
        (
            "kvengine_replica_sessions_sent",
            "Session assignments published to peer replicas",
            &s.sessions_sent,
        ),
        (
            "kvengine_replica_sessions_dropped",
            "Session assignments not published (NATS down or the queue full)",
            &s.sessions_dropped,
        ),
        (
            "kvengine_replica_sessions_applied",
            "Peers' session assignments applied",
            &s.sessions_applied,
        ),
        (
            "kvengine_replica_sessions_ignored",
            "Peers' session assignments for a model or worker not routed here, or with \
             sessions off",
            &s.sessions_ignored,
        ),
        (
            "kvengine_replica_snapshots_put",
            "Snapshots put in the replicas' object store",
            &s.snapshots_put,
        ),
        (
            "kvengine_replica_snapshot_failures",
            "Snapshots that could not be put in the object store",
            &s.snapshot_failures,
        ),
        (
            "kvengine_replica_busy_nanoseconds",
            "Nanoseconds the sync spent encoding, decoding and applying (its CPU)",
            &s.busy_ns,
        ),
    ] {
        reg.register(name, help, c(v));
    }
}
