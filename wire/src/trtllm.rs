//! TensorRT-LLM's KV-cache events as JSON: what `trtllm-serve` answers to
//! `POST /kv_cache_events` (its `KVCacheEventSerializer`), decoded ([`decode_page`]) and
//! written ([`TrtEvent`] serializes to the same shape, for the simulated workers).
//!
//! ```json
//! [{"event_id": 0, "window_size": 4096,
//!   "data": {"type": "created", "num_blocks_per_cache_level": [8192, 0]}},
//!  {"event_id": 1, "window_size": 4096, "attention_dp_rank": 0,
//!   "data": {"type": "stored", "parent_hash": null, "blocks": [
//!     {"type": "stored_block", "block_hash": 1729, "lora_id": null, "cache_level": 0,
//!      "priority": 35,
//!      "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}]}]}},
//!  {"event_id": 2, "window_size": 4096,
//!   "data": {"type": "removed", "block_hashes": [1729]}},
//!  {"event_id": 3, "window_size": 4096,
//!   "data": {"type": "updated", "block_hash": 1729,
//!            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
//!            "priority": null}}]
//! ```
//!
//! # Invariants
//! 1. [`decode_page`] never panics and refuses only a body that is not a JSON array (or is
//!    larger than [`MAX_PAGE_BYTES`]). Each element decodes on its own: one that does not
//!    is returned as [`PageEntry::Unreadable`] (with its `event_id` when that much can be
//!    read), so the caller counts it and treats its events as lost.
//! 2. Unknown object keys are ignored (newer servers add fields); an unknown `data.type`
//!    decodes as [`TrtData::Unknown`], which still consumes its `event_id`.
//! 3. Block hashes are TensorRT-LLM's `size_t`: any JSON integer in `u64`, or a negative
//!    one in `i64`, bit-cast (`v as u64`), so both signednesses name the same block; or a
//!    hex string (newer servers' `v2_sha256` hashes), folded to its last 8 bytes.
//! 4. Memory is proportional to the events read: a run of unreadable elements is one entry.

use crate::error::WireError;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use std::fmt;

/// The largest `/kv_cache_events` answer [`decode_page`] accepts, in bytes (64 MiB); the
/// router's poller reads pages under the same cap.
pub const MAX_PAGE_BYTES: usize = 64 * 1024 * 1024;

/// TensorRT-LLM's id for a block (its `size_t` block hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WireHash(pub u64);

impl Serialize for WireHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block hash (an integer in u64 or i64)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(v as u64))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<WireHash, E> {
                hex_hash(v)
                    .map(WireHash)
                    .ok_or_else(|| E::custom(format!("{v:?} is not a hex block hash")))
            }
        }
        d.deserialize_any(V)
    }
}

/// A hex digest (`"0x"` optional, 1 to 64 digits) folded to its last 8 bytes read
/// big-endian, as the msgpack decoder folds vLLM's byte digests ([`crate::kv_events`]): newer TensorRT-LLM servers
/// (`hash_algo` `v2_sha256`) send block hashes as hex strings.
fn hex_hash(s: &str) -> Option<u64> {
    let digits = s.strip_prefix("0x").unwrap_or(s);
    if digits.is_empty() || digits.len() > 64 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let tail = &digits[digits.len().saturating_sub(16)..];
    u64::from_str_radix(tail, 16).ok()
}

/// One event of a page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrtEvent {
    /// The event's number: one counter per KV-cache manager (per attention-DP rank),
    /// consecutive from 0 in each server process.
    pub event_id: u64,
    /// What happened.
    pub data: TrtData,
    /// The attention window the event's blocks belong to (models with variable sliding
    /// windows have one pool per window size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_size: Option<u64>,
    /// The attention data-parallel rank that sent it (absent: rank 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_dp_rank: Option<u32>,
    /// Newer servers (KV cache manager v2): the layer group whose pool the event is from.
    /// Every group reports the same blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_group_id: Option<u64>,
}

/// An event's body, tagged by `"type"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TrtData {
    /// The cache manager was created: its pool sizes in blocks, primary (GPU) first, then
    /// secondary (host memory).
    Created {
        /// Blocks per cache level.
        num_blocks_per_cache_level: Vec<u64>,
    },
    /// A chain of full blocks entered the cache under `parent_hash` (null: a sequence
    /// start).
    Stored {
        /// TensorRT-LLM's hash of the block before `blocks[0]`.
        #[serde(default)]
        parent_hash: Option<WireHash>,
        /// The blocks, in sequence order.
        blocks: Vec<TrtBlock>,
    },
    /// Blocks left the cache (from whichever level they were on).
    Removed {
        /// The blocks' hashes.
        block_hashes: Vec<WireHash>,
    },
    /// A block changed cache level (offloaded to host memory, or brought back) or priority.
    Updated {
        /// The block's hash.
        block_hash: WireHash,
        /// Its level change, if any (0: GPU, 1: host memory).
        #[serde(default)]
        cache_level: Option<Diff>,
        /// Its priority change, if any.
        #[serde(default)]
        priority: Option<Diff>,
    },
    /// A type this router does not know: skipped (and counted), its id still consumed.
    #[serde(other)]
    Unknown,
}

/// One stored block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrtBlock {
    /// `"stored_block"` on the wire; not checked.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// TensorRT-LLM's hash of the block.
    pub block_hash: WireHash,
    /// The block's tokens (`tokens_per_block` of them).
    pub tokens: Vec<TrtToken>,
    /// The LoRA task id the block was computed under (absent or null: the base model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_id: Option<u64>,
    /// The cache level the block was stored at (0: GPU).
    #[serde(default)]
    pub cache_level: u32,
    /// Its retention priority (0-100, 35 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
}

/// One token of a stored block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrtToken {
    /// `"unique_token"` on the wire; not checked.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<UniqueTokenTag>,
    /// The token id.
    pub token_id: u32,
    /// Non-zero for multimodal placeholder tokens: what tells two images' tokens apart.
    #[serde(default)]
    pub token_extra_id: u64,
}

/// The `"unique_token"` tag, kept as a marker so a token stays `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueTokenTag;

impl Serialize for UniqueTokenTag {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("unique_token")
    }
}

impl<'de> Deserialize<'de> for UniqueTokenTag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::IgnoredAny::deserialize(d).map(|_| UniqueTokenTag)
    }
}

impl TrtToken {
    /// A text token (no extra id), tagged as `trtllm-serve` writes it.
    pub fn text(token_id: u32) -> Self {
        Self {
            kind: Some(UniqueTokenTag),
            token_id,
            token_extra_id: 0,
        }
    }
}

/// A change of one value (`{"type": "event_diff", "new_value": N, "old_value": O}`; the tag
/// is written, not required when read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct Diff {
    /// The value after the change.
    pub new_value: i64,
    /// The value before it.
    pub old_value: i64,
}

impl Serialize for Diff {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("Diff", 3)?;
        m.serialize_field("type", "event_diff")?;
        m.serialize_field("new_value", &self.new_value)?;
        m.serialize_field("old_value", &self.old_value)?;
        m.end()
    }
}

/// One element of a page, decoded on its own.
#[derive(Clone, Debug, PartialEq)]
pub enum PageEntry {
    /// A well-formed event; `digest` is xxh3 of its bytes as received.
    Event {
        /// The event.
        event: TrtEvent,
        /// xxh3 of the element's JSON text (tells a re-sent event from a new one).
        digest: u64,
    },
    /// An element that is not a readable event.
    Unreadable {
        /// Its `event_id`, when that much could be read.
        event_id: Option<u64>,
        /// serde's message.
        error: String,
    },
}

/// Just the id of an element that does not decode as a whole.
#[derive(Deserialize)]
struct IdOnly {
    event_id: u64,
}

/// Decodes one `/kv_cache_events` answer: a JSON array of events, oldest first.
///
/// Elements are read one at a time (no array of the page's elements is built first), and
/// a run of consecutive unreadable elements is one [`PageEntry::Unreadable`] (the run's
/// first): the caller treats any as lost events, and a page of junk then costs one entry,
/// not one per element.
///
/// # Errors
/// [`WireError::Oversized`] above [`MAX_PAGE_BYTES`]; [`WireError::MalformedJson`] when the
/// body is not a JSON array. Bad elements are [`PageEntry::Unreadable`], not errors.
pub fn decode_page(bytes: &[u8]) -> Result<Vec<PageEntry>, WireError> {
    if bytes.len() > MAX_PAGE_BYTES {
        return Err(WireError::Oversized {
            what: "TensorRT-LLM /kv_cache_events answer",
            got: bytes.len(),
            limit: MAX_PAGE_BYTES,
        });
    }
    let malformed = |source: serde_json::Error| WireError::MalformedJson {
        what: "/kv_cache_events",
        source,
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let page = de.deserialize_seq(PageVisitor).map_err(malformed)?;
    de.end().map_err(malformed)?;
    Ok(page)
}

/// Reads a page's elements one by one (see [`decode_page`]).
struct PageVisitor;

impl<'de> Visitor<'de> for PageVisitor {
    type Value = Vec<PageEntry>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON array of KV-cache events")
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut page = Vec::new();
        while let Some(raw) = seq.next_element::<&'de RawValue>()? {
            let entry = element(raw.get());
            if matches!(
                (&entry, page.last()),
                (
                    PageEntry::Unreadable { .. },
                    Some(PageEntry::Unreadable { .. })
                )
            ) {
                continue;
            }
            page.push(entry);
        }
        Ok(page)
    }
}

/// One element, decoded on its own.
fn element(text: &str) -> PageEntry {
    match serde_json::from_str::<TrtEvent>(text) {
        Ok(event) => PageEntry::Event {
            event,
            digest: xxhash_rust::xxh3::xxh3_64(text.as_bytes()),
        },
        Err(e) => PageEntry::Unreadable {
            event_id: serde_json::from_str::<IdOnly>(text)
                .ok()
                .map(|i| i.event_id),
            error: e.to_string(),
        },
    }
}
