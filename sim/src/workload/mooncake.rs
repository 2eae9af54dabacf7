//! A loader for Mooncake-format request traces (kvcache-ai/Mooncake, `FAST25-release/traces`).
//!
//! One JSON object per line: `{"timestamp": <ms>, "input_length": <tokens>,
//! "output_length": <tokens>, "hash_ids": [<id>, ...]}`. Each hash id names one 512-token
//! block, and ids are tree-consistent: equal ids at position `i` mean equal first
//! `(i + 1) * 512` tokens. Traces carry no text, so each id is expanded into 512 token ids
//! derived from the id alone, and the last block is cut to `input_length`.
//!
//! # Invariants
//! 1. A block's tokens depend only on its hash id (and the vocabulary size): requests with
//!    equal leading ids have equal leading tokens, so the trace's prefix sharing survives
//!    expansion exactly, at any kvengine block size.
//! 2. Every loaded record's ids cover its `input_length` (`ids * 512 >= input_length`);
//!    a line that breaks this, or is not a record, fails the load with its line number.
//! 3. The expansion is stable: it uses a fixed mixing function, not a versioned RNG.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, SimError};
use crate::workload::{DEFAULT_VOCAB, SimRequest, mix64};

/// Tokens per trace block (Mooncake's hash-id granularity).
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Mixed into every hash id so trace tokens differ from other synthetic tokens.
const SALT: u64 = 0x6d6f_6f6e_6361_6b65;

#[derive(Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeRecord {
    /// Arrival, in milliseconds since the trace started.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Answer tokens.
    pub output_length: u32,
    /// The prompt's 512-token blocks, by id.
    pub hash_ids: Box<[u64]>,
}

impl MooncakeRecord {
    /// The record's prompt as token ids drawn from `0..vocab` (invariant 1).
    pub fn tokens(&self, vocab: u32) -> Vec<u32> {
        let vocab = u64::from(vocab.max(1));
        let len = self.input_length as usize;
        let mut out = Vec::with_capacity(len);
        for &id in self.hash_ids.iter() {
            let base = mix64(id ^ SALT);
            let take = (len - out.len()).min(MOONCAKE_BLOCK_TOKENS);
            out.extend((0..take as u64).map(|j| (mix64(base.wrapping_add(j)) % vocab) as u32));
            if out.len() == len {
                break;
            }
        }
        out
    }
}

/// A loaded trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MooncakeTrace {
    records: Vec<MooncakeRecord>,
}

impl MooncakeTrace {
    /// Loads the JSONL trace at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::TraceIo {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses JSONL trace text; blank lines are skipped.
    pub fn parse(text: &str) -> Result<Self> {
        let mut records = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let l: Line =
                serde_json::from_str(raw).map_err(|source| SimError::TraceJson { line, source })?;
            let input_length =
                u32::try_from(l.input_length).map_err(|_| SimError::TraceRecord {
                    line,
                    reason: "input_length does not fit in 32 bits",
                })?;
            let covered = (l.hash_ids.len() as u64).saturating_mul(MOONCAKE_BLOCK_TOKENS as u64);
            if covered < l.input_length {
                return Err(SimError::TraceRecord {
                    line,
                    reason: "hash_ids cover fewer tokens than input_length",
                });
            }
            records.push(MooncakeRecord {
                timestamp_ms: l.timestamp,
                input_length,
                output_length: u32::try_from(l.output_length).unwrap_or(u32::MAX),
                hash_ids: l.hash_ids.into_boxed_slice(),
            });
        }
        Ok(Self { records })
    }

    /// The records, in trace order.
    pub fn records(&self) -> &[MooncakeRecord] {
        &self.records
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the trace has no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The trace as requests on the base model, expanded one at a time.
    pub fn requests(&self) -> impl ExactSizeIterator<Item = SimRequest> + '_ {
        self.records.iter().map(|r| SimRequest {
            tokens: r.tokens(DEFAULT_VOCAB),
            lora: None,
            output_tokens: r.output_length,
            arrival_ms: r.timestamp_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [0, 1]}

{"timestamp": 40, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}
{"timestamp": 41, "input_length": 512, "output_length": 3, "hash_ids": [5], "extra": true}
"#;

    #[test]
    fn parses_and_expands_with_shared_prefixes() {
        let t = MooncakeTrace::parse(TRACE).unwrap();
        assert_eq!(t.len(), 3);
        let r: Vec<SimRequest> = t.requests().collect();
        assert_eq!(r[0].tokens.len(), 1000);
        assert_eq!(r[1].tokens.len(), 1100);
        assert_eq!(r[2].tokens.len(), 512);
        // Ids 0 and 1 are shared: the first 1000 tokens agree, the third block differs.
        assert_eq!(r[0].tokens[..], r[1].tokens[..1000]);
        assert_ne!(r[0].tokens[..512], r[2].tokens[..]);
        assert_eq!((r[1].arrival_ms, r[1].output_tokens), (40, 3));
        assert!(r.iter().flat_map(|r| &r.tokens).all(|&t| t < DEFAULT_VOCAB));
        // Stable across runs and builds (invariant 3).
        assert_eq!(t.records()[0].tokens(DEFAULT_VOCAB)[..4], r[0].tokens[..4]);
    }

    #[test]
    fn malformed_lines_fail_with_their_line_number() {
        let e = MooncakeTrace::parse("{\"timestamp\": 0}\n").unwrap_err();
        assert!(matches!(e, SimError::TraceJson { line: 1, .. }), "{e}");
        let e = MooncakeTrace::parse(
            "\n{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [1]}",
        )
        .unwrap_err();
        assert!(matches!(e, SimError::TraceRecord { line: 2, .. }), "{e}");
        let e = MooncakeTrace::load(Path::new("/nonexistent/trace.jsonl")).unwrap_err();
        assert!(matches!(e, SimError::TraceIo { .. }), "{e}");
    }
}
