//! vLLM / SGLang KV-event batches as msgpack: the decoded shape ([`WireBatch`]), the
//! decoder ([`decode_batch`]) and an encoder that writes batches as vLLM publishes them
//! ([`encode_batch`]).
//!
//! # Wire shapes accepted
//! * Batch: an array `[ts, events]`, `[ts, events, dp_rank]` (later elements ignored), or a
//!   map with keys `ts`, `events`, `data_parallel_rank` / `dp_rank` (others ignored). `ts` is
//!   a float, an integer or nil; `dp_rank` an integer in `u32` or nil.
//! * Event: a positional array with the type tag first, or a map with a `"type"` key (keys in
//!   any order, unknown ones ignored).
//!   * `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size?, lora_id?,
//!     medium?, lora_name?, extra_keys?, ...]` (4 or more elements; later ones of any type
//!     are skipped). In a map, `extra_keys` is read by name.
//!   * `extra_keys` (vLLM 0.32): nil, or one entry per block, each nil or an array of untagged
//!     items: a string (the LoRA name, first when `lora_name` is set; else the `cache_salt`),
//!     an `[identifier, offset]` array (a multimodal item) or a bin (a prompt-embeds digest).
//!     A well-formed value of any other shape decodes as [`WireExtraKeys::Malformed`]: the
//!     consumer drops that event (kvengine's converter counts it), not the batch.
//!   * `["BlockRemoved", block_hashes, medium?, ...]`.
//!   * `["AllBlocksCleared", ...]`.
//!   * Any other tag: skipped and counted in [`WireBatch::unknown_events`].
//! * Block hash: an unsigned integer; a signed one, bit-cast (`v as u64`); or a bin of 1 to
//!   32 bytes whose last `min(8, len)` bytes are read big-endian (vLLM publishes
//!   `int.from_bytes(digest, "big") & (2**64 - 1)`, so both forms give the same id).
//! * Token ids: integers in `0..=u32::MAX`.
//!
//! # Written shape
//! [`encode_batch`] writes what vLLM publishes today: `[ts, [event maps], dp_rank]`, each
//! event a map with a `"type"` key, optional fields omitted when absent (a missing `dp_rank`
//! is written as 0, a missing `medium` as `"GPU"`, a missing `block_size` as 0;
//! [`WireExtraKeys::Malformed`] has no wire form and is left out).
//!
//! # Invariants
//! 1. No input panics or allocates out of proportion to its size: every declared length is
//!    checked against the bytes left before anything is reserved, so a 5-byte header claiming
//!    4 billion elements fails without allocating. Batches over [`MAX_BATCH_BYTES`] are
//!    refused before decoding.
//! 2. Nested values are skipped iteratively (no recursion, so no stack exhaustion).
//! 3. Decoding is one forward pass with no intermediate value tree; tokens are decoded
//!    straight into the event's `Vec<u32>`.
//! 4. A batch either decodes whole or is refused whole ([`WireError::MalformedMsgpack`]).
//!    The one per-event exception is `extra_keys` (see above).
//! 5. `decode_batch(&encode_batch(b)) == b` for every batch whose `dp_rank` is set, whose
//!    stored events carry a `block_size` and a `medium` (removed ones a `medium`) and no
//!    [`WireExtraKeys::Malformed`]: the encoder writes the defaults above for those, and
//!    everything else as given.
//!
//! # Files
//! `cursor.rs`: the byte cursor and the generic msgpack reads (markers, lengths, skipping);
//! `decode.rs`: the batch and event fields on top of it; `encode.rs`: the writer.
//!
//! [`WireError::MalformedMsgpack`]: crate::WireError::MalformedMsgpack

mod cursor;
mod decode;
mod encode;

pub use decode::decode_batch;
pub use encode::encode_batch;

/// The largest batch [`decode_batch`] accepts, in bytes (64 MiB).
pub const MAX_BATCH_BYTES: usize = 64 * 1024 * 1024;

/// The largest binary digest accepted as a block hash, in bytes.
pub const MAX_HASH_BIN_BYTES: usize = 32;

/// A decoded batch: what one publisher message carries, before any router policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WireBatch {
    /// Publisher timestamp (seconds since the epoch), if it sent a number.
    pub ts: Option<f64>,
    /// The data-parallel rank the batch is from, if given (`None` for old publishers).
    pub dp_rank: Option<u32>,
    /// The events with a known type, in order.
    pub events: Vec<WireEvent>,
    /// Events with an unknown type tag: skipped, counted here.
    pub unknown_events: u32,
}

/// One KV event as published, fields as on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    /// `BlockStored`: a chain of full blocks entered the cache.
    Stored {
        /// The worker's ids of the new blocks, in sequence order (folded to u64, see
        /// [the module docs](self)).
        block_hashes: Vec<u64>,
        /// The worker's id of the block before the first one (`None`: a sequence start).
        parent: Option<u64>,
        /// The token ids of all the blocks, concatenated.
        token_ids: Vec<u32>,
        /// The publisher's block size, when it sends one.
        block_size: Option<u32>,
        /// The LoRA adapter's integer id, when not the base model.
        lora_id: Option<i64>,
        /// The LoRA adapter's name, when sent.
        lora_name: Option<String>,
        /// The storage medium (`"GPU"`, `"CPU"`, ...), when sent.
        medium: Option<String>,
        /// vLLM's `extra_keys` (one entry per block of `block_hashes`), when sent and not nil.
        extra_keys: Option<WireExtraKeys>,
    },
    /// `BlockRemoved`: blocks left the cache.
    Removed {
        /// The worker's ids of the evicted blocks.
        block_hashes: Vec<u64>,
        /// The storage medium they left, when sent.
        medium: Option<String>,
    },
    /// `AllBlocksCleared`: the whole cache of this rank was emptied.
    Cleared,
}

/// `BlockStored.extra_keys` as published (vLLM's `to_event_extra_keys`): untagged, one
/// entry per block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireExtraKeys {
    /// One entry per block: `None` (nil) for a block without extra keys, else its items in
    /// order.
    Blocks(Vec<Option<Vec<WireExtraItem>>>),
    /// Well-formed msgpack that is not a list of nil-or-array entries of known items: the
    /// event is dropped at conversion (counted), the rest of the batch still applies.
    Malformed,
}

/// One untagged item of a block's `extra_keys` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireExtraItem {
    /// A bare string: the LoRA name (first, when the event's `lora_name` is set) or the
    /// `cache_salt` (block 0 only).
    Str(String),
    /// A multimodal item: `(identifier, offset)`.
    Mm(String, i64),
    /// A bin: a prompt-embeddings digest (vLLM: SHA-256).
    Bin(Vec<u8>),
}
