//! Rewriting the `cached_tokens` a disaggregated answer reports.
//!
//! In a disaggregated request the decode worker's answer is the one the client sees, but the
//! prompt's cache hit happened on the prefill worker (the decode worker received the blocks,
//! and engines differ in whether they count them as cached). The front door reports the
//! prefill side's figure: `usage.prompt_tokens_details.cached_tokens`.
//!
//! # Invariants
//! 1. Bytes go out in order; an SSE event is held back only until its terminating blank
//!    line arrives, a whole (non-SSE) answer until its end.
//! 2. Anything that is not a JSON object with a `usage` object passes through unchanged.

use bytes::Bytes;
use serde_json::{Value, json};

/// The cached-token figure to write into an answer's usage.
#[derive(Debug)]
pub(crate) struct UsagePatch {
    cached_tokens: u64,
    sse: bool,
    pending: Vec<u8>,
}

impl UsagePatch {
    /// A patch for an SSE stream (`sse`) or a whole JSON answer.
    pub(crate) fn new(cached_tokens: u64, sse: bool) -> Self {
        Self {
            cached_tokens,
            sse,
            pending: Vec::new(),
        }
    }

    /// Takes the next bytes of the answer; returns what can go out now.
    pub(crate) fn feed(&mut self, data: &[u8]) -> Bytes {
        self.pending.extend_from_slice(data);
        if !self.sse {
            return Bytes::new();
        }
        let Some(end) = last_event_end(&self.pending) else {
            return Bytes::new();
        };
        let rest = self.pending.split_off(end);
        let complete = std::mem::replace(&mut self.pending, rest);
        Bytes::from(self.patch_events(&complete))
    }

    /// The end of the answer: whatever was held back, patched.
    pub(crate) fn finish(&mut self) -> Bytes {
        let all = std::mem::take(&mut self.pending);
        if self.sse {
            Bytes::from(self.patch_events(&all))
        } else {
            Bytes::from(self.patch_json(&all).unwrap_or(all))
        }
    }

    fn patch_events(&self, events: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(events.len() + 16);
        for line in events.split_inclusive(|&b| b == b'\n') {
            let body = line
                .strip_prefix(b"data: ")
                .or_else(|| line.strip_prefix(b"data:"));
            match body
                .map(|b| b.trim_ascii())
                .and_then(|b| self.patch_json(b))
            {
                Some(patched) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&patched);
                    out.push(b'\n');
                }
                None => out.extend_from_slice(line),
            }
        }
        out
    }

    /// The JSON object `text` with its usage patched, or `None` if it has no usage object.
    fn patch_json(&self, text: &[u8]) -> Option<Vec<u8>> {
        if !text.starts_with(b"{") || !contains(text, b"\"usage\"") {
            return None;
        }
        let mut v: Value = serde_json::from_slice(text).ok()?;
        let usage = v.get_mut("usage")?.as_object_mut()?;
        let details = usage
            .entry("prompt_tokens_details")
            .or_insert_with(|| json!({}));
        if !details.is_object() {
            *details = json!({});
        }
        details
            .as_object_mut()?
            .insert("cached_tokens".into(), json!(self.cached_tokens));
        serde_json::to_vec(&v).ok()
    }
}

/// One past the last `\n\n` of `buf`, if any.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON answer, if present.
pub(crate) fn cached_tokens(answer: &Value) -> Option<u64> {
    answer
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_usage_is_patched_across_split_chunks() {
        let mut p = UsagePatch::new(48, true);
        let stream = concat!(
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
            "data: [DONE]\n\n"
        );
        let mut out = Vec::new();
        // Feed in awkward pieces: mid-line, mid-event.
        for piece in stream.as_bytes().chunks(7) {
            out.extend_from_slice(&p.feed(piece));
        }
        out.extend_from_slice(&p.finish());
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("data: {\"choices\":[{\"text\":\"a\"}]}\n\n"));
        assert!(text.contains("\"cached_tokens\":48"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(text.matches("\n\n").count(), 3);
    }

    #[test]
    fn whole_answers_get_details_added_and_others_pass_through() {
        let mut p = UsagePatch::new(7, false);
        assert!(p.feed(br#"{"usage":{"prompt_tokens":9}}"#).is_empty());
        let out = p.finish();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(cached_tokens(&v), Some(7));

        let mut p = UsagePatch::new(7, false);
        p.feed(b"not json at all");
        assert_eq!(&p.finish()[..], b"not json at all");

        let mut p = UsagePatch::new(7, true);
        let out = p.feed(b"data: {\"usage\":null}\n\n: comment\n\n");
        assert_eq!(&out[..], b"data: {\"usage\":null}\n\n: comment\n\n");
    }
}
