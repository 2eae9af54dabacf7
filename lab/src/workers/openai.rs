//! The OpenAI request and response shapes a simulated worker speaks: parsing a request body
//! into a [`Parsed`] request (or an [`OpenAiError`], the front door's error type), and the
//! JSON of answers and stream chunks, and vLLM's 404 for a model it does not serve
//! ([`model_not_found`]).
//!
//! # Invariants
//! 1. Any body parses to a request or an [`OpenAiError`] with status 400; nothing panics.
//!    Disaggregation fields are parsed by [`super::disagg`].

use axum::http::StatusCode;
use serde_json::{Map, Value, json};
pub use transport::openai::openai_error::OpenAiError;
use transport::openai::request_prompt::{PromptSource, prompt_token_ids};

use super::disagg::{Disagg, detect};
use super::tokens::Prompter;

/// `max_tokens` when a request gives none (vLLM's completions default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Which endpoint a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request, validated and tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The endpoint.
    pub api: Api,
    /// The model it asks for; `None` when absent, null or empty, which vLLM takes as the
    /// served model.
    pub model: Option<String>,
    /// The prompt's token ids (not empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    pub max_tokens: u32,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Send a usage chunk before `[DONE]` (streaming only).
    pub include_usage: bool,
    /// Its disaggregated-serving fields ([`super::disagg`]).
    pub disagg: Disagg,
}

fn object(body: &[u8]) -> Result<Map<String, Value>, OpenAiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(OpenAiError::invalid(None, "the body must be a JSON object")),
        Err(e) => Err(OpenAiError::invalid(
            None,
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

/// A non-null field.
fn field<'a>(map: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    map.get(name).filter(|v| !v.is_null())
}

fn boolean(map: &Map<String, Value>, name: &'static str) -> Result<bool, OpenAiError> {
    match field(map, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(OpenAiError::invalid(
            Some(name),
            format!("{name} must be a boolean"),
        )),
    }
}

fn max_tokens(map: &Map<String, Value>, names: &[&'static str]) -> Result<u32, OpenAiError> {
    let Some((name, v)) = names.iter().find_map(|&n| field(map, n).map(|v| (n, v))) else {
        return Ok(DEFAULT_MAX_TOKENS);
    };
    match v.as_u64() {
        Some(0) => Err(OpenAiError::invalid(
            Some(name),
            format!("{name} must be at least 1"),
        )),
        Some(n) => u32::try_from(n).map_err(|_| {
            OpenAiError::invalid(Some(name), format!("{name} must be at most {}", u32::MAX))
        }),
        None => Err(OpenAiError::invalid(
            Some(name),
            format!("{name} must be a positive integer"),
        )),
    }
}

/// The requested model: a string, or nothing (absent, null or empty).
fn model(map: &Map<String, Value>) -> Result<Option<String>, OpenAiError> {
    match field(map, "model") {
        None => Ok(None),
        Some(Value::String(m)) if m.is_empty() => Ok(None),
        Some(Value::String(m)) => Ok(Some(m.clone())),
        Some(_) => Err(OpenAiError::invalid(
            Some("model"),
            "model must be a string",
        )),
    }
}

/// vLLM's answer to a request naming a model it does not serve: 404 and its
/// `ErrorResponse` body, `{"error": {"message": "The model `NAME` does not exist.", "type":
/// "NotFoundError", "param": "model", "code": 404}}`. Unlike [`OpenAiError`]'s, its `code`
/// is the HTTP status as a number, which is what vLLM sends.
pub fn model_not_found(requested: &str) -> (StatusCode, Value) {
    let status = StatusCode::NOT_FOUND;
    let body = json!({"error": {
        "message": format!("The model `{requested}` does not exist."),
        "type": "NotFoundError",
        "param": "model",
        "code": status.as_u16(),
    }});
    (status, body)
}

fn include_usage(map: &Map<String, Value>) -> Result<bool, OpenAiError> {
    match field(map, "stream_options") {
        None => Ok(false),
        Some(Value::Object(o)) => boolean(o, "include_usage").map_err(|e| OpenAiError {
            param: Some("stream_options"),
            ..e
        }),
        Some(_) => Err(OpenAiError::invalid(
            Some("stream_options"),
            "stream_options must be an object",
        )),
    }
}

/// Validates and tokenizes a request body for `api`.
pub fn parse(api: Api, body: &[u8], prompter: &Prompter) -> Result<Parsed, OpenAiError> {
    let map = object(body)?;
    if let Some(n) = field(&map, "n")
        && n.as_u64() != Some(1)
    {
        return Err(OpenAiError::invalid(Some("n"), "only n = 1 is supported"));
    }
    let stream = boolean(&map, "stream")?;
    let include_usage = include_usage(&map)?;
    // The router's own reading of the prompt, so both sides see the same token ids.
    let (source, limits): (_, &[&'static str]) = match api {
        Api::Completions => (PromptSource::Completion, &["max_tokens"]),
        Api::Chat => (PromptSource::Chat, &["max_completion_tokens", "max_tokens"]),
    };
    let prompt = prompt_token_ids(body, source, prompter.tokenizer())?;
    let max_tokens = max_tokens(&map, limits)?;
    let disagg = detect(&map, stream)?;
    // A name of the wrong type is malformed (400). Whether it is served is checked by the
    // caller once the whole body is valid, the order vLLM checks them in.
    let model = model(&map)?;
    Ok(Parsed {
        api,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        disagg,
    })
}

/// What every answer and chunk of one request shares.
#[derive(Clone, Debug)]
pub struct Envelope {
    /// The endpoint.
    pub api: Api,
    /// `cmpl-N` or `chatcmpl-N`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
}

/// A request's token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Of those, served from the prefix cache.
    pub cached_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
}

impl Usage {
    /// Its JSON (`usage` of OpenAI answers).
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": u64::from(self.prompt_tokens) + u64::from(self.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

impl Envelope {
    fn head(&self, object: &str) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), self.id.clone().into());
        m.insert("object".into(), object.into());
        m.insert("created".into(), self.created.into());
        m.insert("model".into(), self.model.clone().into());
        m
    }

    /// The whole (non-streamed) answer.
    pub fn answer(&self, text: String, usage: &Usage) -> Value {
        let (object, choice) = match self.api {
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null,
                       "finish_reason": "length", "stop_reason": null}),
            ),
            Api::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text},
                       "logprobs": null, "finish_reason": "length", "stop_reason": null}),
            ),
        };
        let mut m = self.head(object);
        m.insert("choices".into(), json!([choice]));
        m.insert("usage".into(), usage.json());
        Value::Object(m)
    }

    fn chunk_object(&self) -> &'static str {
        match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut m = self.head(self.chunk_object());
        m.insert("choices".into(), json!([choice]));
        Value::Object(m)
    }

    /// The chat stream's first chunk: `delta.role = "assistant"`. `None` for completions.
    pub fn role_chunk(&self) -> Option<Value> {
        (self.api == Api::Chat).then(|| {
            self.chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": null, "finish_reason": null}),
            )
        })
    }

    /// The chunk of one generated token's text.
    pub fn token_chunk(&self, text: String) -> Value {
        match self.api {
            Api::Completions => self
                .chunk(json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null})),
            Api::Chat => self.chunk(json!({"index": 0, "delta": {"content": text},
                                           "logprobs": null, "finish_reason": null})),
        }
    }

    /// The chunk that ends the choice: `finish_reason: "length"`.
    pub fn finish_chunk(&self) -> Value {
        match self.api {
            Api::Completions => self.chunk(json!({"index": 0, "text": "", "logprobs": null,
                                                  "finish_reason": "length", "stop_reason": null})),
            Api::Chat => self.chunk(json!({"index": 0, "delta": {}, "logprobs": null,
                                           "finish_reason": "length", "stop_reason": null})),
        }
    }

    /// The `include_usage` chunk: no choices, the usage.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut m = self.head(self.chunk_object());
        m.insert("choices".into(), json!([]));
        m.insert("usage".into(), usage.json());
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(api: Api, body: &str) -> Result<Parsed, OpenAiError> {
        parse(api, body.as_bytes(), &Prompter::Fallback)
    }

    #[test]
    fn prompt_forms() {
        let ids = |b: &str| p(Api::Completions, b).unwrap().prompt;
        assert_eq!(ids(r#"{"prompt": [5, 6, 7]}"#), vec![5, 6, 7]);
        assert_eq!(ids(r#"{"prompt": [[5, 6]]}"#), vec![5, 6]);
        assert_eq!(ids(r#"{"prompt": ["a b"]}"#), ids(r#"{"prompt": "a b"}"#));
        assert_eq!(ids(r#"{"prompt": [9]}"#), vec![9]);
        let r = p(
            Api::Completions,
            r#"{"prompt": "x", "stream": true,
                  "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (16, true, true));
    }

    #[test]
    fn max_tokens_forms() {
        let mt = |b: &str| p(Api::Chat, b).map(|r| r.max_tokens);
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        assert_eq!(mt(&format!("{{{msgs}, \"max_tokens\": 3}}")).unwrap(), 3);
        assert_eq!(
            mt(&format!(
                "{{{msgs}, \"max_tokens\": 3, \"max_completion_tokens\": 5}}"
            ))
            .unwrap(),
            5
        );
        assert_eq!(
            mt(&format!("{{{msgs}, \"max_tokens\": 0}}"))
                .unwrap_err()
                .param,
            Some("max_tokens")
        );
        assert!(mt(&format!("{{{msgs}, \"max_tokens\": -1}}")).is_err());
        assert!(mt(&format!("{{{msgs}, \"max_tokens\": 1.5}}")).is_err());
    }

    #[test]
    fn model_names_and_their_404() {
        let model = |b: &str| p(Api::Completions, b).map(|r| r.model);
        assert_eq!(model(r#"{"prompt": [1]}"#).unwrap(), None);
        assert_eq!(model(r#"{"prompt": [1], "model": null}"#).unwrap(), None);
        assert_eq!(model(r#"{"prompt": [1], "model": ""}"#).unwrap(), None);
        assert_eq!(
            model(r#"{"prompt": [1], "model": "m"}"#)
                .unwrap()
                .as_deref(),
            Some("m")
        );
        let e = model(r#"{"prompt": [1], "model": 5}"#).unwrap_err();
        assert_eq!(
            (e.status, e.param),
            (StatusCode::BAD_REQUEST, Some("model"))
        );
        let (status, body) = model_not_found("gpt-9");
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(
            body,
            json!({"error": {"message": "The model `gpt-9` does not exist.",
                             "type": "NotFoundError", "param": "model", "code": 404}})
        );
    }

    #[test]
    fn malformed_bodies_are_400() {
        for body in [
            "",
            "nope",
            "[]",
            "{}",
            r#"{"prompt": ""}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [1, "a"]}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": {}}"#,
            r#"{"prompt": "a", "stream": "yes"}"#,
            r#"{"prompt": "a", "stream_options": 1}"#,
            r#"{"prompt": "a", "n": 2}"#,
        ] {
            let e = p(Api::Completions, body).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        for body in [
            "{}",
            r#"{"messages": []}"#,
            r#"{"messages": "hi"}"#,
            r#"{"messages": [{"content": "no role"}]}"#,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#,
        ] {
            assert!(p(Api::Chat, body).is_err(), "{body}");
        }
    }
}
