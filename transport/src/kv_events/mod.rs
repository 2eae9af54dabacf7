//! vLLM / SGLang KV-event batches: msgpack decoding ([`decode_batch`]) and conversion to
//! engine events for one worker ([`convert`]).
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
//!     A well-formed value of any other shape decodes as [`WireExtraKeys::Malformed`] and
//!     [`convert`] drops that event (counted), not the batch.
//!   * `["BlockRemoved", block_hashes, medium?, ...]`.
//!   * `["AllBlocksCleared", ...]`.
//!   * Any other tag: skipped and counted in [`WireBatch::unknown_events`].
//! * Block hash: an unsigned integer; a signed one, bit-cast (`v as u64`); or a bin of 1 to
//!   32 bytes whose last `min(8, len)` bytes are read big-endian (vLLM publishes
//!   `int.from_bytes(digest, "big") & (2**64 - 1)`, so both forms give the same id).
//! * Token ids: integers in `0..=u32::MAX`.
//!
//! # Invariants
//! 1. No input panics or allocates out of proportion to its size: every declared length is
//!    checked against the bytes left before anything is reserved, so a 5-byte header claiming
//!    4 billion elements fails without allocating. Batches over [`MAX_BATCH_BYTES`] are
//!    refused before decoding.
//! 2. Nested values are skipped iteratively (no recursion, so no stack exhaustion).
//! 3. Decoding is one forward pass with no intermediate value tree; tokens are decoded
//!    straight into the event's `Vec<u32>`.
//! 4. A batch either decodes whole or is refused whole ([`TransportError::MalformedMsgpack`]);
//!    [`convert`] never fails, it drops and counts what the router cannot apply. The one
//!    per-event exception is `extra_keys` (see above).
//!
//! [`TransportError::MalformedMsgpack`]: crate::TransportError::MalformedMsgpack

mod convert;
mod decode;

pub use convert::{ConvertConfig, Converted, convert};
pub use decode::{
    MAX_BATCH_BYTES, MAX_HASH_BIN_BYTES, WireBatch, WireEvent, WireExtraItem, WireExtraKeys,
    decode_batch,
};
