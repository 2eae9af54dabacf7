//! What one engine's disaggregation protocol asks of the front door: how to rewrite the
//! client's body for the prefill worker and for the decode worker.
//!
//! # Invariants
//! 1. Implementations are pure: no I/O, the same inputs give the same bodies.
//! 2. The decode body is the client's body plus the protocol's fields: sampling settings,
//!    `stream` and `max_tokens` reach the decode worker as the client sent them.

use serde_json::{Map, Value, json};

/// A JSON object body.
pub type Body = Map<String, Value>;

/// Where the two halves of one request meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The prefill worker's host (from its registered URL).
    pub prefill_host: String,
    /// SGLang: the prefill worker's bootstrap port.
    pub bootstrap_port: u16,
    /// SGLang: the room both requests name, below 2^63.
    pub room: u64,
}

/// One engine's hand-off protocol.
pub trait Handoff: Sync {
    /// Whether the prefill and decode requests go out together (SGLang) rather than the
    /// decode request after the prefill answer (vLLM, TensorRT-LLM).
    fn concurrent(&self) -> bool {
        false
    }

    /// The prefill worker's body.
    fn prefill_body(&self, client: &Body, pair: &Pair) -> Body;

    /// The decode worker's body; `prefill_answer` is the prefill worker's whole JSON answer
    /// for sequential protocols, `None` for concurrent ones. An error names what the answer
    /// lacked (the prefill worker is then treated as failed).
    fn decode_body(
        &self,
        client: &Body,
        pair: &Pair,
        prefill_answer: Option<&Value>,
    ) -> Result<Body, String>;

    /// Whether the prefill answer already finished the request (the client gets it as is).
    fn finished_in_prefill(&self, _prefill_answer: &Value) -> bool {
        false
    }
}

/// `client` asked as a one-token, non-streamed request (what a prefill worker is sent).
pub fn one_token(client: &Body) -> Body {
    let mut b = client.clone();
    b.insert("stream".into(), Value::Bool(false));
    b.remove("stream_options");
    b.remove("min_tokens");
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    b
}

/// `client` as a non-streamed request (the prefill half where the protocol keeps the
/// client's token limit).
pub fn not_streamed(client: &Body) -> Body {
    let mut b = client.clone();
    b.insert("stream".into(), Value::Bool(false));
    b.remove("stream_options");
    b
}

/// A pair for tests that do not look at it.
#[cfg(test)]
pub(crate) fn test_pair() -> Pair {
    Pair {
        prefill_host: "p".into(),
        bootstrap_port: 0,
        room: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_token_keeps_sampling_and_drops_streaming() {
        let client: Body = serde_json::from_str(
            r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true},
                "max_tokens":64,"max_completion_tokens":64,"min_tokens":3,"temperature":0.5}"#,
        )
        .unwrap();
        let b = one_token(&client);
        assert_eq!(b["stream"], json!(false));
        assert_eq!(
            (b["max_tokens"].clone(), b["max_completion_tokens"].clone()),
            (json!(1), json!(1))
        );
        assert!(!b.contains_key("stream_options") && !b.contains_key("min_tokens"));
        assert_eq!(b["temperature"], json!(0.5));
        let c: Body = serde_json::from_str(r#"{"prompt":"x"}"#).unwrap();
        assert!(!one_token(&c).contains_key("max_completion_tokens"));
    }
}
