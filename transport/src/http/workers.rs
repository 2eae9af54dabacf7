//! `GET /v1/workers`, `POST /v1/workers`, `DELETE /v1/workers/{id}`, `POST /v1/load`.

use super::api_error::{ApiError, json};
use super::routing::path_param;
use super::shared::{AppState, RawBody, decode};
use crate::hub::{Registration, WorkerInfo};
use crate::outbound::{self, AddrError, AddrRefusal, Host, WorkerUrl, ZmqEndpoint};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use engine::sched::{WorkerLoad, WorkerRole};
use engine::{DpRank, WorkerId, WorkerKey};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Serialize)]
pub(super) struct LoadJson {
    dp_rank: u32,
    active_blocks: u64,
    active_prefill_tokens: u64,
    active_requests: u64,
    num_requests_waiting: Option<u64>,
    kv_usage: Option<f64>,
    /// Its GPU KV cache in blocks, where the worker reports it (TensorRT-LLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_capacity_blocks: Option<u64>,
}

#[derive(Serialize)]
pub(super) struct WorkerJson {
    worker_id: u64,
    dp_ranks: Vec<u32>,
    url: Option<String>,
    zmq: Option<String>,
    replay: Option<String>,
    role: &'static str,
    bootstrap_port: Option<u16>,
    /// Whether an API key is set (the key itself is never shown).
    api_key: bool,
    /// Its ZMQ event stream: `connecting`, `subscribed`, or `null` (none subscribed to).
    stream: Option<&'static str>,
    /// A TensorRT-LLM worker: `"trtllm"`, and its poll interval (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    event_source: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    poll_ms: Option<u64>,
    /// The model it serves (`null`: none named).
    model: Option<String>,
    healthy: bool,
    /// Why its last health check failed (`null`: it passed, or none ran yet).
    health_error: Option<String>,
    resyncing: Vec<u32>,
    config_error: Option<String>,
    events: u64,
    loads: Vec<LoadJson>,
    /// Ranks whose stores the bounds refused (`index_full`, `worker_full`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    degraded: Vec<DegradedJson>,
}

#[derive(Serialize)]
pub(super) struct DegradedJson {
    dp_rank: u32,
    reason: &'static str,
}

impl From<WorkerInfo> for WorkerJson {
    fn from(w: WorkerInfo) -> Self {
        let r = w.registration;
        let role = r.role().as_str();
        Self {
            worker_id: r.worker.0,
            dp_ranks: r.dp_ranks.iter().map(|d| d.0).collect(),
            url: r.url,
            zmq: r.zmq,
            replay: r.replay,
            role,
            bootstrap_port: r.bootstrap_port,
            api_key: r.api_key.is_some(),
            stream: w.stream.map(|s| s.as_str()),
            event_source: r.trtllm_poll.map(|_| "trtllm"),
            poll_ms: r
                .trtllm_poll
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            model: r.model,
            healthy: w.healthy,
            health_error: w.health_error,
            resyncing: w.resyncing.iter().map(|d| d.0).collect(),
            config_error: w.config_error,
            events: w.events,
            degraded: w
                .degraded
                .iter()
                .map(|&(rank, why)| DegradedJson {
                    dp_rank: rank.0,
                    reason: why.as_str(),
                })
                .collect(),
            loads: w
                .loads
                .into_iter()
                .map(|(rank, active, reported)| {
                    let capacity = w.kv_capacity.iter().find(|(r, _)| *r == rank);
                    let active = active.unwrap_or_default();
                    LoadJson {
                        dp_rank: rank.0,
                        active_blocks: active.active_blocks,
                        active_prefill_tokens: active.active_prefill_tokens,
                        active_requests: active.active_requests,
                        num_requests_waiting: reported.map(|l| l.num_requests_waiting),
                        kv_usage: reported.map(|l| l.kv_usage),
                        kv_capacity_blocks: capacity.map(|&(_, b)| b),
                    }
                })
                .collect(),
        }
    }
}

#[derive(Serialize)]
struct WorkersResponse {
    workers: Vec<WorkerJson>,
}

pub(super) async fn list(State(st): State<AppState>) -> Response {
    let workers = st.hub.workers().into_iter().map(WorkerJson::from).collect();
    json(StatusCode::OK, &WorkersResponse { workers })
}

#[derive(Deserialize)]
struct RegisterBody {
    worker_id: u64,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    zmq: Option<String>,
    #[serde(default)]
    replay: Option<String>,
    #[serde(default)]
    dp_ranks: Option<Vec<u32>>,
    /// `aggregated` (default), `prefill` or `decode`.
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    /// The worker's API key (vLLM `--api-key`), sent on the requests forwarded to it.
    #[serde(default)]
    api_key: Option<String>,
    /// The model it serves (see `crate::models`); `""` is the default namespace.
    #[serde(default)]
    model: Option<String>,
    /// `zmq` (the default) or `trtllm`: a TensorRT-LLM worker, whose events are polled from
    /// `{url}/kv_cache_events`.
    #[serde(default)]
    events: Option<String>,
    /// With `events: "trtllm"`: the poll interval in milliseconds (default 100).
    #[serde(default)]
    poll_ms: Option<u64>,
}

/// `field`'s worker address, parsed and checked ([`crate::outbound::check_addr`]): 400
/// naming the field if it is not a bare base address, 403 if its host is not in
/// `--worker-hosts`.
fn check_addr<T>(
    allowed: &[String],
    field: &str,
    text: &str,
    parse: impl Fn(&str) -> Result<T, AddrError>,
    host: impl Fn(&T) -> &Host,
) -> Result<T, ApiError> {
    outbound::check_addr(allowed, field, text, parse, host).map_err(|refusal| match refusal {
        AddrRefusal::Invalid(m) => ApiError::invalid(m),
        AddrRefusal::HostNotAllowed(m) => {
            ApiError::new(StatusCode::FORBIDDEN, "host_not_allowed", m)
        }
    })
}

pub(super) async fn register(
    State(st): State<AppState>,
    body: RawBody,
) -> Result<Response, ApiError> {
    let hub = &st.hub;
    let b: RegisterBody = decode(hub, &body.0)?;
    if let Some(k) = &b.api_key
        && !k.bytes().all(|c| c.is_ascii_graphic())
    {
        return Err(ApiError::invalid(
            "invalid api_key: printable ASCII without spaces only",
        ));
    }
    let allowed = &st.cfg.worker_hosts;
    let url = b
        .url
        .as_deref()
        .map(|u| check_addr(allowed, "url", u, WorkerUrl::parse, WorkerUrl::host))
        .transpose()?;
    let [zmq, replay] = [("zmq", &b.zmq), ("replay", &b.replay)].map(|(field, e)| {
        e.as_deref()
            .map(|e| check_addr(allowed, field, e, ZmqEndpoint::parse, ZmqEndpoint::host))
            .transpose()
    });
    let (zmq, replay) = (zmq?, replay?);
    let trtllm_poll = match (b.events.as_deref(), b.poll_ms) {
        (None | Some("zmq"), None) => None,
        (None | Some("zmq"), Some(_)) => {
            return Err(ApiError::invalid("poll_ms is for events \"trtllm\""));
        }
        (Some("trtllm"), ms) => {
            if b.zmq.is_some() || b.replay.is_some() {
                return Err(ApiError::invalid(
                    "events \"trtllm\" polls the worker's url; it takes no zmq or replay",
                ));
            }
            let Some(url) = &url else {
                return Err(ApiError::invalid(
                    "events \"trtllm\" needs the worker's url (trtllm-serve)",
                ));
            };
            let interval = ms.map_or(crate::trtllm::DEFAULT_POLL_INTERVAL, Duration::from_millis);
            crate::trtllm::TrtllmSource::new(WorkerId(b.worker_id), url.as_str(), interval)
                .map_err(|e| ApiError::invalid(e.to_string()))?;
            Some(interval)
        }
        (Some(other), _) => {
            return Err(ApiError::invalid(format!(
                "invalid events {other:?}: \"zmq\" or \"trtllm\""
            )));
        }
    };
    let role = match b.role.as_deref() {
        None => None,
        Some(r) => Some(
            r.parse::<WorkerRole>()
                .map_err(|e| ApiError::invalid(e.to_string()))?,
        ),
    };
    let worker = WorkerId(b.worker_id);
    let new = hub.register(Registration {
        worker,
        dp_ranks: b
            .dp_ranks
            .unwrap_or_default()
            .into_iter()
            .map(DpRank)
            .collect(),
        url: url.map(|u| u.as_str().to_owned()),
        zmq: zmq.map(|e| e.as_str().to_owned()),
        replay: replay.map(|e| e.as_str().to_owned()),
        role,
        bootstrap_port: b.bootstrap_port,
        api_key: b.api_key.filter(|k| !k.is_empty()),
        model: b.model,
        trtllm_poll,
    })?;
    let Some(info) = hub
        .workers()
        .into_iter()
        .find(|w| w.registration.worker == worker)
    else {
        // Removed by a concurrent DELETE.
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_worker",
            format!("worker {worker} was removed while registering"),
        ));
    };
    hub.persisted().note_api_worker(worker);
    if let Some(sources) = &st.cfg.sources {
        sources.start(&info.registration);
    }
    tracing::info!(worker = worker.0, new, "worker registered over HTTP");
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json(status, &WorkerJson::from(info)))
}

#[derive(Serialize)]
struct Removed {
    removed: bool,
}

pub(super) async fn remove(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_param(id)?;
    let worker = id
        .parse::<u64>()
        .map(WorkerId)
        .map_err(|_| ApiError::invalid(format!("worker id {id:?} is not a u64")))?;
    // On the worker's home core: its sources stop first, then it leaves the registry and
    // the index, all between two of its batches and behind them on the engine's ring, so
    // none lands after the removal.
    let (hub, sources) = (st.hub.clone(), st.cfg.sources.clone());
    let removed = crate::cores::on_home(st.cfg.homes.as_ref(), worker, move || {
        if let Some(sources) = &sources {
            sources.stop(worker);
        }
        hub.remove_worker(worker)
    })
    .await
    .ok_or_else(|| ApiError::from(engine::EngineError::RuntimeStopped))??;
    match removed {
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_worker",
            format!("unknown worker {worker}"),
        )),
        Some(_) => {
            st.forget_fences(worker);
            tracing::info!(worker = worker.0, "worker removed over HTTP");
            Ok(json(StatusCode::OK, &Removed { removed: true }))
        }
    }
}

#[derive(Deserialize)]
struct LoadBody {
    worker_id: u64,
    #[serde(default)]
    dp_rank: Option<u32>,
    num_requests_waiting: u64,
    kv_usage: f64,
}

#[derive(Serialize)]
struct Empty {}

pub(super) async fn load(State(st): State<AppState>, body: RawBody) -> Result<Response, ApiError> {
    let b: LoadBody = decode(&st.hub, &body.0)?;
    let key = WorkerKey {
        worker: WorkerId(b.worker_id),
        dp_rank: DpRank(b.dp_rank.unwrap_or(0)),
    };
    st.hub.update_load(
        key,
        WorkerLoad {
            num_requests_waiting: b.num_requests_waiting,
            kv_usage: b.kv_usage,
        },
    )?;
    Ok(json(StatusCode::OK, &Empty {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked_as_parsed_then_against_the_allowed_hosts() {
        let allowed = vec!["gpu-1".to_owned(), "*.pool.internal".to_owned()];
        let url = |s: &str| {
            check_addr(&allowed, "url", s, WorkerUrl::parse, WorkerUrl::host).map_err(|e| e.status)
        };
        assert!(url("http://gpu-1:8000").is_ok());
        assert!(url("https://a.pool.internal").is_ok());
        assert_eq!(
            url("http://169.254.169.254#@gpu-1"),
            Err(StatusCode::BAD_REQUEST)
        );
        assert_eq!(url("http://gpu-1.evil.com"), Err(StatusCode::FORBIDDEN));
        let zmq = |s: &str| {
            check_addr(&allowed, "zmq", s, ZmqEndpoint::parse, ZmqEndpoint::host)
                .map_err(|e| e.status)
        };
        assert!(zmq("tcp://gpu-1:5557").is_ok());
        assert_eq!(
            zmq("tcp://gpu-1@10.0.0.1:5557"),
            Err(StatusCode::BAD_REQUEST)
        );
        assert_eq!(zmq("tcp://10.0.0.1:5557"), Err(StatusCode::FORBIDDEN));
    }
}
