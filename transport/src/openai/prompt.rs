//! The token ids of an OpenAI request's prompt, as the engine will see them.
//!
//! * `/v1/completions`: `prompt` is a string (tokenized with special tokens, as vLLM does),
//!   a list of token ids, or a one-element list of either. Batches of prompts are refused:
//!   each prompt is its own routing decision, so send them as separate requests.
//! * `/v1/chat/completions`: `messages` rendered with the model's chat template and tokenized
//!   without adding special tokens (vLLM's default), or the built-in stand-in without a
//!   tokenizer ([`super::fallback`]).
//! * Both: `cache_salt`, vLLM's per-request prefix-cache namespace, a top-level string
//!   (absent, `null` and `""` are no salt; any other type is refused as vLLM refuses it). The
//!   router folds it into the prompt's block hashes ([`engine::hash::seq_hashes_salted`]).

use super::errors::OpenAiError;
use super::fallback;
use super::tokenize::{ChatMessage, PromptTokenizer};
use serde::Deserialize;
use serde_json::Value;

/// Which endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptSource {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(default)]
    model: Option<Value>,
    prompt: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: Option<Value>,
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// An optional string field of the body, `name`: `model` (`null` and `""` are absent, as
/// vLLM takes them for its default model) or `cache_salt` (`null` and `""` are absent: vLLM
/// salts only with a non-empty one). Any other type is refused, naming the field.
fn optional_string(name: &'static str, v: Option<Value>) -> Result<Option<String>, OpenAiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(OpenAiError::invalid(
            Some(name),
            format!("{name} must be a string"),
        )),
    }
}

fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

fn text_ids(text: &str, tokenizer: Option<&PromptTokenizer>) -> Result<Vec<u32>, OpenAiError> {
    match tokenizer {
        Some(t) => t
            .encode(text, true)
            .map_err(|e| OpenAiError::invalid(Some("prompt"), e.to_string())),
        None => Ok(fallback::text_token_ids(text)),
    }
}

/// A request's model and prompt, before tokenization (the model picks the tokenizer).
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiPrompt {
    /// The request's `model`.
    pub model: Option<String>,
    /// The request's non-empty `cache_salt`, if any.
    pub cache_salt: Option<String>,
    input: Input,
}

#[derive(Clone, Debug, PartialEq)]
enum Input {
    Text(String),
    Ids(Vec<u32>),
    Messages(Vec<ChatMessage>),
}

/// The request's model and prompt, or the OpenAI error to answer with.
pub fn parse_request(body: &[u8], source: PromptSource) -> Result<OpenAiPrompt, OpenAiError> {
    let malformed =
        |e: serde_json::Error| OpenAiError::invalid(None, format!("malformed JSON: {e}"));
    match source {
        PromptSource::Completion => {
            let b: CompletionBody = serde_json::from_slice(body).map_err(malformed)?;
            let bad = || {
                OpenAiError::invalid(
                    Some("prompt"),
                    "prompt must be a string, a list of token ids, or a one-element list of either",
                )
            };
            let input = match b.prompt {
                None => return Err(OpenAiError::invalid(Some("prompt"), "prompt is required")),
                Some(Value::String(s)) => Input::Text(s),
                Some(Value::Array(mut items)) => match items.as_mut_slice() {
                    [Value::String(s)] => Input::Text(std::mem::take(s)),
                    [Value::Array(ids)] => Input::Ids(token_list(ids).ok_or_else(bad)?),
                    [Value::String(_) | Value::Array(_), _, ..] => {
                        return Err(OpenAiError::invalid(
                            Some("prompt"),
                            "kvengine routes one prompt per request: send a batch as separate requests",
                        ));
                    }
                    ids => Input::Ids(token_list(ids).ok_or_else(bad)?),
                },
                Some(_) => return Err(bad()),
            };
            Ok(OpenAiPrompt {
                model: optional_string("model", b.model)?,
                cache_salt: optional_string("cache_salt", b.cache_salt)?,
                input,
            })
        }
        PromptSource::Chat => {
            let b: ChatBody = serde_json::from_slice(body).map_err(malformed)?;
            let messages = b
                .messages
                .filter(|m| !m.is_empty())
                .ok_or_else(|| OpenAiError::invalid(Some("messages"), "messages is required"))?;
            Ok(OpenAiPrompt {
                model: optional_string("model", b.model)?,
                cache_salt: optional_string("cache_salt", b.cache_salt)?,
                input: Input::Messages(messages),
            })
        }
    }
}

impl OpenAiPrompt {
    /// The prompt's token ids with `tokenizer` (the built-in stand-in without one), or
    /// the OpenAI error to answer with.
    pub fn token_ids(&self, tokenizer: Option<&PromptTokenizer>) -> Result<Vec<u32>, OpenAiError> {
        let (ids, param, empty) = match &self.input {
            Input::Text(s) => (text_ids(s, tokenizer)?, "prompt", "the prompt is empty"),
            Input::Ids(ids) => (ids.clone(), "prompt", "the prompt is empty"),
            Input::Messages(messages) => {
                let ids = match tokenizer {
                    Some(t) => t
                        .chat_token_ids(messages)
                        .map_err(|e| OpenAiError::invalid(Some("messages"), e.to_string()))?,
                    None => fallback::chat_token_ids(messages),
                };
                (ids, "messages", "the rendered prompt is empty")
            }
        };
        match ids.is_empty() {
            true => Err(OpenAiError::invalid(Some(param), empty)),
            false => Ok(ids),
        }
    }
}

/// The prompt's token ids, or the OpenAI error to answer with.
pub fn prompt_token_ids(
    body: &[u8],
    source: PromptSource,
    tokenizer: Option<&PromptTokenizer>,
) -> Result<Vec<u32>, OpenAiError> {
    parse_request(body, source)?.token_ids(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: &str) -> Result<Vec<u32>, OpenAiError> {
        prompt_token_ids(body.as_bytes(), PromptSource::Completion, None)
    }

    #[test]
    fn completion_prompts_in_every_accepted_form() {
        assert_eq!(
            completion(r#"{"prompt": [1, 2, 3]}"#).unwrap(),
            vec![1, 2, 3]
        );
        assert_eq!(completion(r#"{"prompt": [[4, 5]]}"#).unwrap(), vec![4, 5]);
        let words = fallback::text_token_ids("hello world");
        assert_eq!(completion(r#"{"prompt": "hello world"}"#).unwrap(), words);
        assert_eq!(completion(r#"{"prompt": ["hello world"]}"#).unwrap(), words);
    }

    #[test]
    fn cache_salt_is_read_from_both_routes() {
        let c = parse_request(
            br#"{"prompt": [1, 2], "cache_salt": "tenant-a"}"#,
            PromptSource::Completion,
        )
        .unwrap();
        assert_eq!(c.cache_salt.as_deref(), Some("tenant-a"));
        let chat = parse_request(
            br#"{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t"}"#,
            PromptSource::Chat,
        )
        .unwrap();
        assert_eq!(chat.cache_salt.as_deref(), Some("t"));
        for body in [
            r#"{"prompt": [1]}"#,
            r#"{"prompt": [1], "cache_salt": null}"#,
            r#"{"prompt": [1], "cache_salt": ""}"#,
        ] {
            let p = parse_request(body.as_bytes(), PromptSource::Completion).unwrap();
            assert_eq!(p.cache_salt, None, "{body}");
        }
        for body in [
            r#"{"prompt": [1], "cache_salt": 5}"#,
            r#"{"prompt": [1], "cache_salt": ["a"]}"#,
        ] {
            let e = parse_request(body.as_bytes(), PromptSource::Completion).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        }
    }

    #[test]
    fn bad_completion_prompts_are_invalid_requests() {
        for body in [
            r#"{}"#,
            r#"{"prompt": 5}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [[1], [2]]}"#,
            r#"{"prompt": ""}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [1, "x"]}"#,
            r#"not json"#,
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        }
    }

    #[test]
    fn chat_messages_use_the_tokenizer_or_the_stand_in() {
        let body = r#"{"messages": [{"role": "user", "content": "hi there"}], "stream": true}"#;
        let ids = prompt_token_ids(body.as_bytes(), PromptSource::Chat, None).unwrap();
        assert_eq!(
            ids,
            fallback::chat_token_ids(&[ChatMessage::text("user", "hi there")])
        );
        for bad in [r#"{}"#, r#"{"messages": []}"#, r#"{"messages": "hi"}"#] {
            assert!(prompt_token_ids(bad.as_bytes(), PromptSource::Chat, None).is_err());
        }
    }
}
