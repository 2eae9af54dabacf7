//! The HTTP edge's error responses, in OpenAI's shape so that one client library reads
//! every error of the process: `{"error": {"message": "...", "type": "...", "param": null,
//! "code": "<snake_case>"}}`. `code` is ours and stable; `type` is OpenAI's class of the
//! status (`invalid_request_error`, `authentication_error`, `permission_error`,
//! `not_found_error`, `rate_limit_error`, `service_unavailable`, `server_error`).
//!
//! Status codes: 400 for any bad input (syntax, schema or value), 404 for an unknown worker,
//! request or path, 405 for a wrong method, 409 for a duplicate request id, 413 for a body
//! over the limit, 503 when no worker can take a request, the router carries its most active
//! requests (`overloaded`, with `Retry-After`) or the engine stopped. A 500 would be a bug.

use crate::error::TransportError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use engine::EngineError;
use serde::Serialize;

/// One refused event of a `POST /v1/events` batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RejectedEvent {
    /// The event's position in the batch.
    pub index: usize,
    /// The `kvengine_events_rejected_total` label it was counted under.
    pub reason: &'static str,
    /// What was wrong.
    pub message: String,
}

/// An error response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable snake_case code.
    pub code: &'static str,
    /// Human-readable detail.
    pub message: String,
    /// Per-event refusals (`nothing_applied` only).
    pub rejected_reasons: Vec<RejectedEvent>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'a str,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    rejected_reasons: &'a [RejectedEvent],
}

impl ApiError {
    /// An error with `status`, `code` and `message`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            rejected_reasons: Vec::new(),
        }
    }

    /// 400 `malformed_json`.
    pub fn malformed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "malformed_json", message)
    }

    /// 400 `invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
    }

    /// 404 `not_found` (no such route).
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
    }

    /// 405 `method_not_allowed`.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this endpoint does not take that method",
        )
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::NoWorkers | EngineError::NoWorkersInPool { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "no_workers", message)
            }
            EngineError::RuntimeStopped => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "engine_stopped", message)
            }
            EngineError::Timeout { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "engine_timeout", message)
            }
            EngineError::UnknownWorker { .. } => {
                Self::new(StatusCode::NOT_FOUND, "unknown_worker", message)
            }
            EngineError::UnknownRequest(_) => {
                Self::new(StatusCode::NOT_FOUND, "unknown_request", message)
            }
            EngineError::DuplicateRequest(_) => {
                Self::new(StatusCode::CONFLICT, "duplicate_request", message)
            }
            EngineError::AtCapacity { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "at_capacity", message)
            }
            EngineError::QueueFull { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, QUEUE_FULL, message)
            }
            EngineError::TooManyWorkers => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "too_many_workers", message)
            }
            EngineError::IndexFull => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "index_full", message)
            }
            EngineError::BadSnapshot(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "bad_snapshot", message)
            }
            EngineError::UnknownPosition => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "index_inconsistent",
                message,
            ),
            EngineError::InvalidArgument { .. } | EngineError::BlockSizeMismatch { .. } => {
                Self::invalid(message)
            }
            EngineError::UnknownParent { .. }
            | EngineError::UnknownBlock { .. }
            | EngineError::EngineHashConflict { .. }
            | EngineError::WorkerFull { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "rejected", message)
            }
        }
    }
}

impl From<TransportError> for ApiError {
    fn from(e: TransportError) -> Self {
        let message = e.to_string();
        match e {
            TransportError::Engine(e) => e.into(),
            TransportError::MalformedJson(m) => Self::malformed(m),
            TransportError::UnknownWorker(_) => {
                Self::new(StatusCode::NOT_FOUND, "unknown_worker", message)
            }
            TransportError::UnknownRequest(_) => {
                Self::new(StatusCode::NOT_FOUND, "unknown_request", message)
            }
            TransportError::UnknownRank { .. } => {
                Self::new(StatusCode::NOT_FOUND, "unknown_rank", message)
            }
            TransportError::TooManyRanks { .. } => Self::invalid(message),
            TransportError::UnknownModel(_) => {
                Self::new(StatusCode::NOT_FOUND, "model_not_found", message)
            }
            TransportError::DuplicateRequest(_) => {
                Self::new(StatusCode::CONFLICT, "duplicate_request", message)
            }
            TransportError::Overloaded { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, OVERLOADED, message)
            }
            TransportError::Oversized { .. } => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message)
            }
            TransportError::QueueFull { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, QUEUE_FULL, message)
            }
            TransportError::QueueTimeout { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, QUEUE_TIMEOUT, message)
            }
            TransportError::TooManyReservations { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_reservations",
                message,
            ),
            TransportError::PromptTooLong { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "prompt_too_long", message)
            }
            TransportError::TokenCountMismatch { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "token_count_mismatch", message)
            }
            TransportError::BlockSizeMismatch { .. } | TransportError::Invalid { .. } => {
                Self::invalid(message)
            }
            TransportError::Unauthorized(_) | TransportError::ReplicaMac { .. } => {
                Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
            }
            TransportError::MalformedMsgpack(_)
            | TransportError::MalformedFrame(_)
            | TransportError::UnsupportedVersion { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "bad_input", message)
            }
            TransportError::Io { .. } => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&Envelope {
            error: Body {
                message: &self.message,
                kind: kind_of(self.status),
                param: None,
                code: self.code,
                rejected_reasons: &self.rejected_reasons,
            },
        })
        .unwrap_or_else(|_| {
            br#"{"error":{"message":"unserializable error","type":"server_error","param":null,"code":"internal"}}"#
                .to_vec()
        });
        let mut r = (self.status, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.code == OVERLOADED
            || self.code == QUEUE_TIMEOUT
        {
            // Active requests free within seconds; a client should not hammer meanwhile.
            r.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        r
    }
}

/// `Retry-After` of a 429 (every worker at its active-request limit) and of a 503
/// `overloaded` (the router at `--max-active-requests`).
pub const RETRY_AFTER_SECS: &str = "1";

/// The code of a route refused at `--max-active-requests`.
pub const OVERLOADED: &str = "overloaded";

/// The code of a request refused because every worker is busy and the admission queue is
/// full (429, `Retry-After`).
pub const QUEUE_FULL: &str = "queue_full";

/// The code of a request that waited `--admission-timeout-ms` in the admission queue (503,
/// `Retry-After`).
pub const QUEUE_TIMEOUT: &str = "queue_timeout";

/// OpenAI's error `type` for `status`.
pub fn kind_of(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
        s if s.is_client_error() => "invalid_request_error",
        _ => "server_error",
    }
}

/// A JSON success response with `status`.
pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => {
            let mut r = (status, body).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("could not serialize the response: {e}"),
        )
        .into_response(),
    }
}
