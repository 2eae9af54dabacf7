//! The OpenAI front door's error responses (`/v1/completions`, `/v1/chat/completions`, and
//! the error event of a failed stream), in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`.

use crate::error::TransportError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error as OpenAI clients expect it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenAiError {
    /// HTTP status.
    pub status: StatusCode,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.message`.
    pub message: String,
    /// `error.param`: the offending request field, if one.
    pub param: Option<&'static str>,
    /// `error.code`: a machine-readable code, if any (e.g. `context_length_exceeded`).
    pub code: Option<&'static str>,
}

impl OpenAiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
        }
    }

    /// OpenAI's 404 for a model nobody serves (`code: model_not_found`).
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// A 503 `service_unavailable`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The error's JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// A routing refusal as a response: no (healthy) worker is 503, anything else the
    /// request's fault (400) or the router's (500).
    pub fn from_routing(e: TransportError) -> Self {
        use engine::EngineError;
        if let TransportError::UnknownModel(m) = &e {
            return Self::model_not_found(m);
        }
        let (status, kind) = match &e {
            TransportError::Engine(EngineError::NoWorkers) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable")
            }
            TransportError::Engine(EngineError::RuntimeStopped | EngineError::Timeout { .. }) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable")
            }
            TransportError::Engine(EngineError::UnknownWorker { .. })
            | TransportError::UnknownWorker(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable")
            }
            TransportError::Engine(EngineError::AtCapacity { .. }) => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
            }
            TransportError::Overloaded { .. } | TransportError::QueueTimeout { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable")
            }
            TransportError::QueueFull { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            TransportError::Engine(EngineError::InvalidArgument { .. })
            | TransportError::Invalid { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        };
        let code = match &e {
            TransportError::Overloaded { .. } => Some(crate::http::api_error::OVERLOADED),
            TransportError::QueueFull { .. } => Some(crate::http::api_error::QUEUE_FULL),
            TransportError::QueueTimeout { .. } => Some(crate::http::api_error::QUEUE_TIMEOUT),
            _ => None,
        };
        Self {
            status,
            kind,
            message: e.to_string(),
            param: None,
            code,
        }
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.code == Some(crate::http::api_error::OVERLOADED)
            || self.code == Some(crate::http::api_error::QUEUE_TIMEOUT)
        {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(crate::http::api_error::RETRY_AFTER_SECS),
            );
        }
        r
    }
}

/// A response with an OpenAI error body.
pub fn openai_error(status: StatusCode, kind: &'static str, message: &str) -> Response {
    OpenAiError {
        status,
        kind,
        message: message.to_owned(),
        param: None,
        code: None,
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overloaded_router_answers_503_with_retry_after() {
        let e = OpenAiError::from_routing(TransportError::Overloaded { limit: 5 });
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.kind, "service_unavailable");
        assert_eq!(e.code, Some("overloaded"));
        let r = e.into_response();
        assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "1");
        let invalid = OpenAiError::from_routing(TransportError::Invalid {
            name: "request_id",
            reason: "holds a control character (at byte 0)".into(),
        });
        assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
        assert_eq!(invalid.code, None);
    }
}
