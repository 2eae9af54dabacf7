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
//! 3. What is held back is bounded: an SSE event over [`BodyKind::Usage`]'s cap (1 MiB),
//!    or a whole answer over [`MAX_HELD_ANSWER`] (16 MiB), ends the patching: what was
//!    held goes out as it came, and so does the rest of the answer ([`UsagePatch::gave_up`]
//!    tells the relay, which counts it).

use crate::outbound::body::{BodyKind, MAX_HELD_ANSWER};
use bytes::Bytes;
use serde_json::{Value, json};

/// The cached-token figure to write into an answer's usage.
#[derive(Debug)]
pub(crate) struct UsagePatch {
    cached_tokens: u64,
    sse: bool,
    pending: Vec<u8>,
    /// Whether the answer outgrew what may be held (invariant 3): relayed as is since.
    bypass: bool,
    /// Set when `bypass` began, until [`UsagePatch::gave_up`] reads it.
    newly_bypassed: bool,
}

impl UsagePatch {
    /// A patch for an SSE stream (`sse`) or a whole JSON answer.
    pub(crate) fn new(cached_tokens: u64, sse: bool) -> Self {
        Self {
            cached_tokens,
            sse,
            pending: Vec::new(),
            bypass: false,
            newly_bypassed: false,
        }
    }

    /// The most bytes held back: one SSE event, or a whole answer.
    fn cap(&self) -> usize {
        match self.sse {
            true => BodyKind::Usage.cap(),
            false => MAX_HELD_ANSWER,
        }
    }

    /// Whether the patching was given up since the last call (invariant 3; true once).
    pub(crate) fn gave_up(&mut self) -> bool {
        std::mem::take(&mut self.newly_bypassed)
    }

    /// Gives up patching: what is held goes out as it came.
    #[cold]
    fn give_up(&mut self, out: &mut Vec<u8>) {
        self.bypass = true;
        self.newly_bypassed = true;
        out.append(&mut self.pending);
        self.pending = Vec::new();
    }

    /// Takes the next bytes of the answer; returns what can go out now.
    pub(crate) fn feed(&mut self, data: Bytes) -> Bytes {
        if self.bypass {
            return data;
        }
        self.pending.extend_from_slice(&data);
        let mut out = Vec::new();
        if self.sse
            && let Some(end) = last_event_end(&self.pending)
        {
            let rest = self.pending.split_off(end);
            let complete = std::mem::replace(&mut self.pending, rest);
            out = self.patch_events(&complete);
        }
        if self.pending.len() > self.cap() {
            self.give_up(&mut out);
        }
        Bytes::from(out)
    }

    /// The end of the answer: whatever was held back, patched.
    pub(crate) fn finish(&mut self) -> Bytes {
        let all = std::mem::take(&mut self.pending);
        if self.bypass {
            return Bytes::from(all);
        }
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
            out.extend_from_slice(&p.feed(Bytes::copy_from_slice(piece)));
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
        assert!(
            p.feed(Bytes::from_static(br#"{"usage":{"prompt_tokens":9}}"#))
                .is_empty()
        );
        let out = p.finish();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(cached_tokens(&v), Some(7));

        let mut p = UsagePatch::new(7, false);
        p.feed(Bytes::from_static(b"not json at all"));
        assert_eq!(&p.finish()[..], b"not json at all");

        let mut p = UsagePatch::new(7, true);
        let out = p.feed(Bytes::from_static(
            b"data: {\"usage\":null}\n\n: comment\n\n",
        ));
        assert_eq!(&out[..], b"data: {\"usage\":null}\n\n: comment\n\n");
    }

    #[test]
    fn what_is_held_back_is_bounded_and_then_relayed_as_is() {
        // An SSE event that never ends: held up to the cap, then everything passes.
        let mut p = UsagePatch::new(5, true);
        let chunk = Bytes::from(vec![b'x'; 64 << 10]);
        let mut out = 0;
        let mut fed = 0;
        while !p.bypass {
            out += p.feed(chunk.clone()).len();
            fed += chunk.len();
            assert!(p.pending.len() <= BodyKind::Usage.cap());
        }
        assert!(p.gave_up());
        assert!(!p.gave_up(), "told once");
        assert_eq!(out, fed, "what was held went out");
        assert_eq!(p.feed(chunk.clone()), chunk);
        assert!(p.finish().is_empty());
        // A whole answer over its cap: the same.
        let mut p = UsagePatch::new(5, false);
        let big = Bytes::from(vec![b' '; MAX_HELD_ANSWER + 1]);
        assert_eq!(p.feed(big).len(), MAX_HELD_ANSWER + 1);
        assert!(p.gave_up());
        assert_eq!(
            &p.feed(Bytes::from_static(br#"{"usage":{}}"#))[..],
            br#"{"usage":{}}"#
        );
    }
}
