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

use super::fallback;
use super::openai_error::OpenAiError;
use super::tokenize::{ChatMessage, PromptTokenizer};
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt;

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
    model: OptStr,
    #[serde(default)]
    prompt: PromptField,
    #[serde(default)]
    cache_salt: OptStr,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: OptStr,
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    cache_salt: OptStr,
}

/// An optional string field (`model`: `null` and `""` are absent, as vLLM takes them for
/// its default model; `cache_salt`: `null` and `""` are absent, vLLM salts only with a
/// non-empty one), read without building a `serde_json::Value`: a value of another type is
/// skipped (nothing of it is kept) and refused afterwards, naming the field.
#[derive(Debug, Default)]
enum OptStr {
    #[default]
    Absent,
    Str(String),
    WrongType,
}

impl OptStr {
    fn into_field(self, name: &'static str) -> Result<Option<String>, OpenAiError> {
        match self {
            OptStr::Absent => Ok(None),
            OptStr::Str(s) => Ok(Some(s)),
            OptStr::WrongType => Err(OpenAiError::invalid(
                Some(name),
                format!("{name} must be a string"),
            )),
        }
    }
}

/// Skips the rest of a sequence without keeping any of it.
fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skips the rest of a map without keeping any of it.
fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

impl<'de> Deserialize<'de> for OptStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OptStr;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OptStr, E> {
                Ok(match v.is_empty() {
                    true => OptStr::Absent,
                    false => OptStr::Str(v.to_owned()),
                })
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<OptStr, E> {
                Ok(match v.is_empty() {
                    true => OptStr::Absent,
                    false => OptStr::Str(v),
                })
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<OptStr, E> {
                Ok(OptStr::Absent)
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<OptStr, E> {
                Ok(OptStr::Absent)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<OptStr, E> {
                Ok(OptStr::WrongType)
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<OptStr, E> {
                Ok(OptStr::WrongType)
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<OptStr, E> {
                Ok(OptStr::WrongType)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<OptStr, E> {
                Ok(OptStr::WrongType)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<OptStr, A::Error> {
                drain_seq(seq)?;
                Ok(OptStr::WrongType)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<OptStr, A::Error> {
                drain_map(map)?;
                Ok(OptStr::WrongType)
            }
        }
        d.deserialize_any(V)
    }
}

thread_local! {
    /// The prompt cap of the parse running on this thread ([`parse_request_capped`] sets
    /// it around one synchronous `serde_json` call; serde's derive has no other way to
    /// hand a parameter to a field).
    static PROMPT_CAP: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// A completion's `prompt`, scanned straight into token ids or text: nothing of it is
/// held as a `serde_json::Value`, and ids past the cap are not kept.
#[derive(Debug, Default)]
enum PromptField {
    /// No `prompt` key.
    #[default]
    Missing,
    Text(String),
    Ids(Vec<u32>),
    /// More ids than the cap.
    TooLong,
    /// Several prompts.
    Batch,
    /// Anything else (`null` included).
    Bad,
}

/// One element of a `prompt` array.
enum Item {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
    TooLong,
    Bad,
}

/// Reads the rest of an array of ids into `ids` (which holds its first ones), at most
/// `cap` in all.
fn more_ids<'de, A: SeqAccess<'de>>(
    mut seq: A,
    mut ids: Vec<u32>,
    cap: usize,
) -> Result<Result<Vec<u32>, Item>, A::Error> {
    while let Some(item) = seq.next_element::<IdItem>()? {
        match item.0 {
            Some(_) if ids.len() >= cap => {
                drain_seq(seq)?;
                return Ok(Err(Item::TooLong));
            }
            Some(id) => ids.push(id),
            None => {
                drain_seq(seq)?;
                return Ok(Err(Item::Bad));
            }
        }
    }
    Ok(Ok(ids))
}

/// One element of an array of ids: `None` when it is not a u32.
struct IdItem(Option<u32>);

impl<'de> Deserialize<'de> for IdItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IdItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<IdItem, E> {
                Ok(IdItem(u32::try_from(v).ok()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<IdItem, E> {
                Ok(IdItem(u32::try_from(v).ok()))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<IdItem, E> {
                Ok(IdItem(None))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<IdItem, E> {
                Ok(IdItem(None))
            }
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<IdItem, E> {
                Ok(IdItem(None))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<IdItem, E> {
                Ok(IdItem(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<IdItem, A::Error> {
                drain_seq(seq)?;
                Ok(IdItem(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<IdItem, A::Error> {
                drain_map(map)?;
                Ok(IdItem(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id, a string or an array of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Item, E> {
                Ok(u32::try_from(v).map_or(Item::Bad, Item::Id))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Item, E> {
                Ok(u32::try_from(v).map_or(Item::Bad, Item::Id))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Item, E> {
                Ok(Item::Bad)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Item, E> {
                Ok(Item::Bad)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Item, E> {
                Ok(Item::Bad)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Item, E> {
                Ok(Item::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
                let cap = PROMPT_CAP.with(Cell::get);
                Ok(match more_ids(seq, Vec::new(), cap)? {
                    Ok(ids) => Item::Ids(ids),
                    Err(e) => e,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
                drain_map(map)?;
                Ok(Item::Bad)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptField, E> {
                Ok(PromptField::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptField, E> {
                Ok(PromptField::Text(v))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<PromptField, E> {
                Ok(PromptField::Bad)
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<PromptField, E> {
                Ok(PromptField::Bad)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<PromptField, E> {
                Ok(PromptField::Bad)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<PromptField, E> {
                Ok(PromptField::Bad)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<PromptField, E> {
                Ok(PromptField::Bad)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PromptField, A::Error> {
                drain_map(map)?;
                Ok(PromptField::Bad)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptField, A::Error> {
                let cap = PROMPT_CAP.with(Cell::get);
                let Some(first) = seq.next_element::<Item>()? else {
                    return Ok(PromptField::Ids(Vec::new()));
                };
                let single = |seq: A, one: PromptField| -> Result<PromptField, A::Error> {
                    let mut seq = seq;
                    match seq.next_element::<IgnoredAny>()? {
                        None => Ok(one),
                        Some(_) => {
                            drain_seq(seq)?;
                            Ok(PromptField::Batch)
                        }
                    }
                };
                match first {
                    Item::Id(_) if cap == 0 => {
                        drain_seq(seq)?;
                        Ok(PromptField::TooLong)
                    }
                    Item::Id(id) => {
                        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                        ids.push(id);
                        Ok(match more_ids(seq, ids, cap)? {
                            Ok(ids) => PromptField::Ids(ids),
                            Err(Item::TooLong) => PromptField::TooLong,
                            Err(_) => PromptField::Bad,
                        })
                    }
                    Item::Text(s) => single(seq, PromptField::Text(s)),
                    Item::Ids(ids) => single(seq, PromptField::Ids(ids)),
                    // A nested list past the cap is refused for its length even when a
                    // batch (the first reason found).
                    Item::TooLong => {
                        drain_seq(seq)?;
                        Ok(PromptField::TooLong)
                    }
                    Item::Bad => {
                        drain_seq(seq)?;
                        Ok(PromptField::Bad)
                    }
                }
            }
        }
        d.deserialize_any(V)
    }
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

/// The error for a prompt of more than `cap` tokens (OpenAI's `context_length_exceeded`).
pub fn too_long(param: &'static str, cap: usize) -> OpenAiError {
    OpenAiError {
        code: Some("context_length_exceeded"),
        ..OpenAiError::invalid(
            Some(param),
            format!(
                "the prompt has more than {cap} tokens, the most this router accepts (--max-prompt-tokens)"
            ),
        )
    }
}

/// The request's model and prompt, or the OpenAI error to answer with.
pub fn parse_request(body: &[u8], source: PromptSource) -> Result<OpenAiPrompt, OpenAiError> {
    parse_request_capped(body, source, usize::MAX)
}

/// [`parse_request`] refusing a list of more than `cap` token ids as it is read (a text
/// prompt's tokens are counted once tokenized: [`OpenAiPrompt::token_ids`]).
pub fn parse_request_capped(
    body: &[u8],
    source: PromptSource,
    cap: usize,
) -> Result<OpenAiPrompt, OpenAiError> {
    let malformed =
        |e: serde_json::Error| OpenAiError::invalid(None, format!("malformed JSON: {e}"));
    match source {
        PromptSource::Completion => {
            let previous = PROMPT_CAP.with(|c| c.replace(cap));
            let parsed = serde_json::from_slice::<CompletionBody>(body);
            PROMPT_CAP.with(|c| c.set(previous));
            let b = parsed.map_err(malformed)?;
            let bad = || {
                OpenAiError::invalid(
                    Some("prompt"),
                    "prompt must be a string, a list of token ids, or a one-element list of either",
                )
            };
            let input = match b.prompt {
                PromptField::Missing => {
                    return Err(OpenAiError::invalid(Some("prompt"), "prompt is required"));
                }
                PromptField::Text(s) => Input::Text(s),
                PromptField::Ids(ids) => Input::Ids(ids),
                PromptField::TooLong => return Err(too_long("prompt", cap)),
                PromptField::Batch => {
                    return Err(OpenAiError::invalid(
                        Some("prompt"),
                        "kvengine routes one prompt per request: send a batch as separate requests",
                    ));
                }
                PromptField::Bad => return Err(bad()),
            };
            Ok(OpenAiPrompt {
                model: b.model.into_field("model")?,
                cache_salt: b.cache_salt.into_field("cache_salt")?,
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
                model: b.model.into_field("model")?,
                cache_salt: b.cache_salt.into_field("cache_salt")?,
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
    fn token_lists_past_the_cap_are_refused_as_they_are_read() {
        let capped =
            |body: &str, cap| parse_request_capped(body.as_bytes(), PromptSource::Completion, cap);
        assert_eq!(
            capped(r#"{"prompt": [1, 2, 3]}"#, 3)
                .unwrap()
                .token_ids(None)
                .unwrap(),
            vec![1, 2, 3]
        );
        for body in [
            r#"{"prompt": [1, 2, 3]}"#,
            r#"{"prompt": [[1, 2, 3]]}"#,
            r#"{"prompt": [[1, 2, 3], [4]]}"#,
        ] {
            let e = capped(body, 2).unwrap_err();
            assert_eq!(e.code, Some("context_length_exceeded"), "{body}: {e:?}");
            assert_eq!(e.param, Some("prompt"));
        }
        // The other fields are still checked, and values of the wrong type are skipped
        // without being kept.
        let e = capped(r#"{"prompt": [1], "model": [1, 2, {"a": [3]}]}"#, 5).unwrap_err();
        assert_eq!(e.param, Some("model"), "{e:?}");
        let p = capped(r#"{"prompt": [1], "model": "m", "cache_salt": ""}"#, 5).unwrap();
        assert_eq!((p.model.as_deref(), p.cache_salt), (Some("m"), None));
        // A text prompt is counted once tokenized (by the proxy), not here.
        assert!(capped(r#"{"prompt": "a b c d e f"}"#, 2).is_ok());
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
            r#"{"prompt": null}"#,
            r#"{"prompt": {"a": 1}}"#,
            r#"{"prompt": [1.5]}"#,
            r#"{"prompt": [[1, -2]]}"#,
            r#"{"prompt": [null]}"#,
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
