//! OpenAI chat messages and the conversation vLLM hands the chat template.
//!
//! vLLM does not pass request messages to the template verbatim (`vllm/entrypoints/chat_utils.py`,
//! `_parse_chat_message_content` and `_postprocess_messages`); [`template_messages`] repeats
//! its rewrite so that the rendered prompt, and so the token ids, are the engine's:
//!
//! - each message becomes `{"role", "content"}`; `content` is a string when the template's
//!   content format is [`ContentFormat::String`] (text parts joined with `"\n"`, `null` →
//!   `""`), or a list of `{"type": "text", "text": …}` parts when it is
//!   [`ContentFormat::OpenAi`] (a plain string becomes a one-part list, `null` an empty list);
//! - an assistant message keeps `tool_calls` (unless `null`; an empty list is dropped), each
//!   call's `function.arguments` JSON string parsed into an object (`{}` when it does not
//!   parse, as vLLM does), and `reasoning` (also exposed as `reasoning_content`);
//! - a tool message keeps `tool_call_id`, and its text-only part list is joined into a string
//!   whatever the content format;
//! - `name` and `task` are kept when they are strings; a `developer` message carries `tools`
//!   (`None` when absent);
//! - every other field of a request message is dropped, as vLLM drops it.

use minijinja::Value;
use serde::{Deserialize, Serialize};
use serde_json::Map;

use crate::error::TransportError;

/// One message of an OpenAI chat request.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant`, `tool`, or whatever the template knows.
    pub role: String,
    /// The text, as a string or a list of parts; `null` or absent for e.g. an assistant
    /// message that only carries `tool_calls`.
    #[serde(default)]
    pub content: MessageContent,
    /// The message's other fields (`name`, `tool_calls`, `tool_call_id`, `reasoning` …). The
    /// ones vLLM forwards reach the template (see the module docs); the rest are ignored.
    #[serde(flatten)]
    pub extra: Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with text content and no other fields.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: MessageContent::Text(content.into()),
            extra: Map::new(),
        }
    }
}

/// A chat message's `content`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(untagged)]
pub enum MessageContent {
    /// `"content": "..."`.
    Text(String),
    /// `"content": [{"type": "text", "text": "..."}, ...]`.
    Parts(Vec<ContentPart>),
    /// `"content": null`, or no `content` at all.
    #[default]
    Null,
}

/// One element of a content list. Text-like parts (`text`, `input_text`, `output_text` with
/// a `text` field; `refusal` with `refusal`; `thinking` with `thinking`) are rendered; a
/// text-like part whose text is missing or `null` is skipped, as vLLM skips it. Any other type
/// (`image_url`, `input_audio`, `video_url` …) is refused with
/// [`TransportError::Invalid`] naming the type: multimodal prompts expand into
/// model-specific placeholder tokens that only the engine's processor knows, so kvengine
/// cannot reproduce their token ids.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
pub struct ContentPart {
    /// The part's `type`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text`-type part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The part's other fields (`refusal`, `thinking`, `image_url` …).
    #[serde(flatten)]
    pub extra: Map<String, serde_json::Value>,
}

impl ContentPart {
    /// A `{"type": "text", "text": ...}` part.
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart {
            kind: "text".to_owned(),
            text: Some(text.into()),
            extra: Map::new(),
        }
    }

    /// The part's text: `Ok(None)` for a text-like part without text (skipped), an error for
    /// a part type kvengine cannot tokenize.
    fn text_of(&self) -> Result<Option<&str>, TransportError> {
        let field = match self.kind.as_str() {
            "text" | "input_text" | "output_text" => return Ok(self.text.as_deref()),
            "refusal" => "refusal",
            "thinking" => "thinking",
            other => {
                return Err(TransportError::Invalid {
                    name: "chat_message",
                    reason: format!(
                        "content part type {other:?} is not supported: kvengine tokenizes \
                         text-only prompts (text, input_text, output_text, refusal, thinking)"
                    ),
                });
            }
        };
        Ok(self.extra.get(field).and_then(serde_json::Value::as_str))
    }
}

/// How a chat template expects `message.content`, as vLLM's
/// `--chat-template-content-format` (whose default, `auto`, is what
/// [`detect_content_format`] computes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// `content` is a string; text parts are joined with `"\n"`.
    String,
    /// `content` is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// vLLM's `auto` detection: a template that loops over a message's `content`
/// (`{% for part in message['content'] %}`, `message.content`, or a variable set from either)
/// wants [`ContentFormat::OpenAi`]; any other wants [`ContentFormat::String`]. vLLM inspects
/// the Jinja AST; this scans the `{% for %}` and `{% set %}` tags, which decides the same for
/// the templates seen in practice.
pub fn detect_content_format(template: &str) -> ContentFormat {
    let mut content_vars: Vec<String> = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else { break };
        let tag = after[..end]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        rest = &after[end + 2..];
        if let Some(set) = tag.strip_prefix("set ") {
            if let Some((name, expr)) = set.split_once('=') {
                let name = name.trim();
                if is_content_access(expr, &content_vars) && is_identifier(name) {
                    content_vars.push(name.to_owned());
                }
            }
        } else if let Some(for_) = tag.strip_prefix("for ")
            && let Some((_, iterable)) = for_.split_once(" in ")
            && is_content_access(iterable, &content_vars)
        {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// `X['content']`, `X["content"]`, `X.content` or a known content variable, optionally
/// followed by a filter or a loop condition.
fn is_content_access(expr: &str, content_vars: &[String]) -> bool {
    let expr = expr.trim();
    let head = expr
        .split(['|', ' '])
        .next()
        .unwrap_or_default()
        .trim()
        .trim_start_matches('(')
        .trim_end_matches(')');
    if content_vars.iter().any(|v| v == head) {
        return true;
    }
    let compact: String = head.chars().filter(|c| !c.is_whitespace()).collect();
    ["['content']", "[\"content\"]", ".content"]
        .iter()
        .any(|suffix| {
            compact
                .strip_suffix(suffix)
                .is_some_and(|base| is_identifier(base) || base.ends_with(']'))
        })
}

/// The conversation vLLM renders for `messages` (see the module docs).
pub(crate) fn template_messages(
    messages: &[ChatMessage],
    format: ContentFormat,
) -> Result<Vec<Value>, TransportError> {
    messages
        .iter()
        .map(|m| template_message(m, format))
        .collect()
}

fn template_message(message: &ChatMessage, format: ContentFormat) -> Result<Value, TransportError> {
    let texts: Vec<&str> = match &message.content {
        MessageContent::Text(s) => vec![s.as_str()],
        MessageContent::Null => Vec::new(),
        MessageContent::Parts(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                if let Some(text) = part.text_of()? {
                    texts.push(text);
                }
            }
            texts
        }
    };
    let as_string = format == ContentFormat::String || message.role == "tool";
    let content = if as_string {
        Value::from(texts.join("\n"))
    } else {
        Value::from(
            texts
                .iter()
                .map(|t| {
                    Value::from_iter([("type", Value::from("text")), ("text", Value::from(*t))])
                })
                .collect::<Vec<_>>(),
        )
    };
    let mut fields: Vec<(&str, Value)> = vec![
        ("role", Value::from(message.role.as_str())),
        ("content", content),
    ];
    let extra = &message.extra;
    match message.role.as_str() {
        "assistant" => {
            if let Some(serde_json::Value::Array(calls)) = extra.get("tool_calls")
                && !calls.is_empty()
            {
                let calls: Vec<serde_json::Value> = calls.iter().map(parse_arguments).collect();
                fields.push(("tool_calls", Value::from_serialize(&calls)));
            } else if let Some(calls) = extra.get("tool_calls")
                && !calls.is_null()
                && !calls.is_array()
            {
                fields.push(("tool_calls", Value::from_serialize(calls)));
            }
            if let Some(reasoning) = extra.get("reasoning").and_then(|r| r.as_str()) {
                fields.push(("reasoning", Value::from(reasoning)));
                fields.push(("reasoning_content", Value::from(reasoning)));
            }
        }
        "tool" => {
            if let Some(id) = extra.get("tool_call_id") {
                fields.push(("tool_call_id", Value::from_serialize(id)));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = extra.get(key).and_then(|v| v.as_str()) {
            fields.push((key, Value::from(v)));
        }
    }
    if message.role == "developer" {
        let tools = extra
            .get("tools")
            .map(Value::from_serialize)
            .unwrap_or(Value::from(()));
        fields.push(("tools", tools));
    }
    Ok(Value::from_iter(fields))
}

/// One tool call with `function.arguments` as vLLM's `_postprocess_messages` leaves it: a
/// JSON string parsed (`{}` if it does not parse), an object or list kept, anything else `{}`.
fn parse_arguments(call: &serde_json::Value) -> serde_json::Value {
    let mut call = call.clone();
    if let Some(function) = call.get_mut("function").and_then(|f| f.as_object_mut()) {
        let parsed = match function.get("arguments") {
            Some(serde_json::Value::String(s)) => {
                serde_json::from_str(s).unwrap_or_else(|_| serde_json::Value::Object(Map::new()))
            }
            Some(v @ (serde_json::Value::Object(_) | serde_json::Value::Array(_))) => v.clone(),
            _ => serde_json::Value::Object(Map::new()),
        };
        function.insert("arguments".to_owned(), parsed);
    }
    call
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_content_loops() {
        let s = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
        assert_eq!(detect_content_format(s), ContentFormat::String);
        for t in [
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
            "{%- for message in messages %}{%- for c in message.content | selectattr('type') -%}x{% endfor %}{% endfor %}",
            "{% for m in messages %}{% set c = m[\"content\"] %}{% for p in c %}{{p}}{% endfor %}{% endfor %}",
            "{% for p in messages[0]['content'] %}{% endfor %}",
        ] {
            assert_eq!(detect_content_format(t), ContentFormat::OpenAi, "{t}");
        }
    }

    #[test]
    fn message_json_round_trip() {
        let json = r#"[{"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function",
              "function":{"name":"f","arguments":"{\"x\": 1}"}}]},
            {"role":"tool","tool_call_id":"1","content":"42"},
            {"role":"assistant"}]"#;
        let msgs: Vec<ChatMessage> = serde_json::from_str(json).unwrap();
        assert_eq!(msgs[0], ChatMessage::text("system", "be brief"));
        assert_eq!(
            msgs[1].content,
            MessageContent::Parts(vec![ContentPart::text("a"), ContentPart::text("b")])
        );
        assert_eq!(msgs[2].content, MessageContent::Null);
        assert_eq!(msgs[4].content, MessageContent::Null);
        let back: Vec<ChatMessage> =
            serde_json::from_str(&serde_json::to_string(&msgs).unwrap()).unwrap();
        assert_eq!(back, msgs);

        let conv = template_messages(&msgs, ContentFormat::String).unwrap();
        assert_eq!(conv[1].get_attr("content").unwrap().as_str(), Some("a\nb"));
        assert_eq!(conv[2].get_attr("content").unwrap().as_str(), Some(""));
        let args = conv[2]
            .get_attr("tool_calls")
            .unwrap()
            .get_item(&Value::from(0))
            .unwrap()
            .get_attr("function")
            .unwrap()
            .get_attr("arguments")
            .unwrap();
        assert_eq!(args.get_attr("x").unwrap(), Value::from(1));
        assert_eq!(
            conv[3].get_attr("tool_call_id").unwrap().as_str(),
            Some("1")
        );

        let conv = template_messages(&msgs, ContentFormat::OpenAi).unwrap();
        assert_eq!(conv[0].get_attr("content").unwrap().len(), Some(1));
        assert_eq!(conv[1].get_attr("content").unwrap().len(), Some(2));
        assert_eq!(conv[2].get_attr("content").unwrap().len(), Some(0));
        // Tool results are always strings.
        assert_eq!(conv[3].get_attr("content").unwrap().as_str(), Some("42"));
    }

    #[test]
    fn unsupported_parts_are_refused() {
        let msg: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}"#,
        )
        .unwrap();
        let err = template_messages(&[msg], ContentFormat::String).unwrap_err();
        assert!(err.to_string().contains("image_url"), "{err}");
    }
}
