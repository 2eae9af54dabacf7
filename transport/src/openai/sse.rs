//! A whole (non-streamed) OpenAI answer as the SSE stream a streaming client expects.
//!
//! Used where the front door holds a complete answer but the client asked to stream: a
//! TensorRT-LLM context phase that already finished the request.
//!
//! # Invariants
//! 1. The stream is one chunk per choice carrying its whole text (`delta` for chat, `text`
//!    for completions) and finish reason, then a usage chunk (`choices: []`) if asked for and
//!    present, then `data: [DONE]`.

use serde_json::{Map, Value, json};

/// `answer` as SSE events; `include_usage` as the client's `stream_options.include_usage`.
pub(crate) fn whole_answer_as_sse(answer: &Value, include_usage: bool) -> String {
    let chat = answer.get("object").and_then(Value::as_str) == Some("chat.completion");
    let mut head = Map::new();
    for k in ["id", "created", "model", "system_fingerprint"] {
        if let Some(v) = answer.get(k) {
            head.insert(k.into(), v.clone());
        }
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    head.insert("object".into(), json!(object));
    let mut out = String::new();
    let mut event = |v: &Value| {
        out.push_str("data: ");
        out.push_str(&v.to_string());
        out.push_str("\n\n");
    };
    let choices = answer.get("choices").and_then(Value::as_array);
    for (i, c) in choices.into_iter().flatten().enumerate() {
        let index = c.get("index").cloned().unwrap_or(json!(i));
        let finish = c.get("finish_reason").cloned().unwrap_or(Value::Null);
        let choice = if chat {
            let content = c.pointer("/message/content").cloned().unwrap_or(json!(""));
            json!({"index": index, "delta": {"role": "assistant", "content": content},
                   "finish_reason": finish})
        } else {
            let text = c.get("text").cloned().unwrap_or(json!(""));
            json!({"index": index, "text": text, "finish_reason": finish})
        };
        let mut chunk = head.clone();
        chunk.insert("choices".into(), json!([choice]));
        event(&Value::Object(chunk));
    }
    if include_usage && let Some(usage) = answer.get("usage").filter(|u| u.is_object()) {
        let mut chunk = head.clone();
        chunk.insert("choices".into(), json!([]));
        chunk.insert("usage".into(), usage.clone());
        event(&Value::Object(chunk));
    }
    out.push_str("data: [DONE]\n\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(s: &str) -> Vec<&str> {
        s.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap())
            .collect()
    }

    #[test]
    fn chat_answers_become_one_delta_then_usage_then_done() {
        let answer = json!({"id": "c1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2}});
        let s = whole_answer_as_sse(&answer, true);
        let e = events(&s);
        assert_eq!(e.len(), 3);
        let first: Value = serde_json::from_str(e[0]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["content"], "hi there");
        assert_eq!(first["choices"][0]["finish_reason"], "stop");
        let usage: Value = serde_json::from_str(e[1]).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 2);
        assert_eq!(e[2], "[DONE]");
        // Without include_usage: no usage chunk.
        assert_eq!(events(&whole_answer_as_sse(&answer, false)).len(), 2);
    }

    #[test]
    fn completions_keep_their_text_and_odd_answers_still_end() {
        let answer = json!({"object": "text_completion",
            "choices": [{"text": "abc", "finish_reason": "length"}]});
        let s = whole_answer_as_sse(&answer, true);
        let e = events(&s);
        let first: Value = serde_json::from_str(e[0]).unwrap();
        assert_eq!(
            (
                first["choices"][0]["text"].clone(),
                first["choices"][0]["index"].clone()
            ),
            (json!("abc"), json!(0))
        );
        assert_eq!(e.len(), 2, "no usage in the answer: no usage chunk");
        assert_eq!(events(&whole_answer_as_sse(&json!({}), true)), ["[DONE]"]);
    }
}
