//! Miss attribution at the front door: what the router predicted for a request
//! ([`MissProbe`], from its decision) meets what the worker's answer reports
//! (`usage.prompt_tokens_details.cached_tokens`, read by a [`MissTap`] as the answer
//! streams through), and the engine's [`attribute`] splits the prompt into hit, stale,
//! routing and cold blocks, counted per model ([`crate::misses`]).
//!
//! # Invariants
//! 1. A tap never changes, delays or holds back the answer: it reads a copy of the bytes
//!    that went out.
//! 2. What a tap keeps is bounded: the last [`TAIL`] bytes of the answer (the usage object
//!    is found there: the last `"usage":` key whose value is an object; vLLM and SGLang
//!    send it in the last data event of a stream, and at the end of a whole answer).
//! 3. Every probed request is counted exactly once ([`crate::misses`]'s invariant 2):
//!    attributed at the end of a successful answer, or unattributed (no usage, no cached
//!    tokens, malformed, or failed: an error status, a failure mid-answer, a client that
//!    went away, which is the tap's drop before its end).
//! 4. Nothing in an answer reaches a panic: bad usage is [`Unattributed::BadUsage`].

use crate::hub::Hub;
use crate::misses::{Attributed, Unattributed};
use engine::WorkerKey;
use engine::router::Routed;
use engine::router::misses::{Predicted, Unattributable, attribute};
use serde_json::Value;
use std::sync::Arc;

/// The bytes of an answer's end a tap keeps (invariant 2).
pub(crate) const TAIL: usize = 256 << 10;

/// What the router predicted for one request when it routed it.
#[derive(Clone, Debug)]
pub(crate) struct MissProbe {
    model: String,
    worker: WorkerKey,
    predicted: Predicted,
    /// The shadow's predicted overlap tokens, if the request was shadowed.
    shadow_tokens: Option<u64>,
}

impl MissProbe {
    /// The probe of `routed`, whose prompt had `prompt_tokens` tokens at `block_size`.
    pub(crate) fn of(routed: &Routed, block_size: u32, prompt_tokens: usize) -> Self {
        let prompt_tokens = prompt_tokens as u64;
        Self {
            model: routed.model.clone(),
            worker: routed.decision.worker,
            predicted: Predicted {
                block_size,
                prompt_tokens,
                chosen_blocks: routed.decision.overlap_blocks,
                best_blocks: routed.decision.best_available_overlap_blocks,
            },
            shadow_tokens: crate::hub::shadow::shadow_tokens(routed, block_size, prompt_tokens),
        }
    }
}

/// Reads an answer's usage as it streams through, and counts the request at its end (or
/// as failed when dropped before).
#[derive(Debug)]
pub(crate) struct MissTap {
    hub: Arc<Hub>,
    probe: MissProbe,
    tail: Tail,
    counted: bool,
}

/// The last [`TAIL`] bytes (at least; at most twice that) of what it was fed.
#[derive(Debug, Default)]
struct Tail(Vec<u8>);

impl Tail {
    fn feed(&mut self, data: &[u8]) {
        let buf = &mut self.0;
        if data.len() >= TAIL {
            buf.clear();
            buf.extend_from_slice(data.get(data.len() - TAIL..).unwrap_or(data));
            return;
        }
        buf.extend_from_slice(data);
        if buf.len() > 2 * TAIL {
            let cut = buf.len() - TAIL;
            buf.drain(..cut);
        }
    }
}

impl MissTap {
    /// A tap for the answer to `probe`'s request.
    pub(crate) fn new(hub: Arc<Hub>, probe: MissProbe) -> Self {
        Self {
            hub,
            probe,
            tail: Tail::default(),
            counted: false,
        }
    }

    /// Sees the next bytes of the answer (a copy: invariant 1).
    pub(crate) fn feed(&mut self, data: &[u8]) {
        self.tail.feed(data);
    }

    /// The answer ended: attributes the request by its usage.
    pub(crate) fn finish(mut self) {
        let outcome = cached_tokens(&self.tail.0).and_then(|cached| {
            attribute(&self.probe.predicted, cached)
                .map(|a| (a, cached))
                .map_err(|e| match e {
                    Unattributable::NoBlockSize | Unattributable::CachedBeyondPrompt => {
                        Unattributed::BadUsage
                    }
                })
        });
        let misses = &self.hub.metrics().misses;
        let p = &self.probe;
        match outcome {
            Ok((attribution, cached_tokens)) => misses.attributed(&Attributed {
                model: &p.model,
                worker: p.worker,
                predicted: p.predicted,
                attribution,
                cached_tokens,
                shadow_tokens: p.shadow_tokens,
            }),
            Err(why) => misses.unattributed(&p.model, why),
        }
        self.counted = true;
    }
}

impl Drop for MissTap {
    fn drop(&mut self) {
        if !self.counted {
            self.hub
                .metrics()
                .misses
                .unattributed(&self.probe.model, Unattributed::Failed);
        }
    }
}

/// `usage.prompt_tokens_details.cached_tokens` of the last usage object in `tail` (the
/// end of an answer: SSE events or a whole JSON body).
pub(crate) fn cached_tokens(tail: &[u8]) -> Result<u64, Unattributed> {
    let usage = last_usage(tail).ok_or(Unattributed::NoUsage)?;
    match usage.get("prompt_tokens_details") {
        None | Some(Value::Null) => Err(Unattributed::NoCachedTokens),
        Some(details) => match details.get("cached_tokens") {
            None | Some(Value::Null) => Err(Unattributed::NoCachedTokens),
            Some(n) => n.as_u64().ok_or(Unattributed::BadUsage),
        },
    }
}

/// The value of the last `"usage":` key in `text` that is an object.
fn last_usage(text: &[u8]) -> Option<serde_json::Map<String, Value>> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = text.len();
    while let Some(at) = text.get(..end)?.windows(KEY.len()).rposition(|w| w == KEY) {
        end = at;
        let rest = text.get(at + KEY.len()..)?.trim_ascii_start();
        let Some(value) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Value>();
        if let Some(Ok(Value::Object(usage))) = values.next() {
            return Some(usage);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_at_the_end_of_streams_and_bodies() {
        let sse = concat!(
            "data: {\"choices\":[{\"text\":\"\\\"usage\\\": {}\"}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,",
            "\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(cached_tokens(sse.as_bytes()), Ok(48));
        let body = br#"{"choices":[{"text":"x"}],"usage" : {"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":null}"#;
        assert_eq!(cached_tokens(body), Ok(0));
    }

    #[test]
    fn missing_and_bad_usage_are_reasons_not_panics() {
        let no_usage = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(no_usage), Err(Unattributed::NoUsage));
        let null = b"data: {\"choices\":[],\"usage\":null}\n\n";
        assert_eq!(cached_tokens(null), Err(Unattributed::NoUsage));
        let no_details = br#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}"#;
        assert_eq!(cached_tokens(no_details), Err(Unattributed::NoCachedTokens));
        for bad in [
            &br#"{"usage":{"prompt_tokens_details":{"cached_tokens":-1}}}"#[..],
            br#"{"usage":{"prompt_tokens_details":{"cached_tokens":"12"}}}"#,
            br#"{"usage":{"prompt_tokens_details":{"cached_tokens":99999999999999999999999}}}"#,
        ] {
            assert_eq!(cached_tokens(bad), Err(Unattributed::BadUsage), "{bad:?}");
        }
        // Truncated, nested beyond serde's limit, garbage: no usage found.
        let deep = format!("{{\"usage\":{}", "[".repeat(10_000));
        let huge = br#"{"usage":{"prompt_tokens_details":{"cached_tokens":1e400}}}"#;
        for junk in [
            &b"{\"usage\":{\"prompt_"[..],
            deep.as_bytes(),
            b"\"usage\"",
            b"",
            huge,
        ] {
            assert_eq!(cached_tokens(junk), Err(Unattributed::NoUsage));
        }
    }

    #[test]
    fn the_tail_is_bounded_and_keeps_the_end() {
        let mut tail = Tail::default();
        let chunk = vec![b'x'; 100 << 10];
        for _ in 0..20 {
            tail.feed(&chunk);
            assert!(tail.0.len() <= 2 * TAIL);
        }
        tail.feed(&vec![b'y'; 3 * TAIL]);
        assert_eq!(tail.0.len(), TAIL);
        tail.feed(b"{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":3}}}");
        assert_eq!(cached_tokens(&tail.0), Ok(3));
    }
}
