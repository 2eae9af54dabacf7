//! vLLM / SGLang KV-event batches at the router: msgpack decoding ([`decode_batch`], the
//! `wire` crate's decoder with its refusals as [`TransportError`]s) and conversion to engine
//! events for one worker ([`convert`]).
//!
//! The wire shapes accepted, the decoder's bounds and the batch types
//! ([`WireBatch`], [`WireEvent`], ...) are `wire::kv_events`'s (see its docs); they are
//! re-exported here.
//!
//! # Invariants
//! 1. A batch either decodes whole or is refused whole ([`TransportError::MalformedMsgpack`],
//!    or [`TransportError::Oversized`] above [`MAX_BATCH_BYTES`]).
//! 2. [`convert`] never fails: it drops and counts what the router cannot apply. The one
//!    per-event refusal of the decoder, a malformed `extra_keys`
//!    ([`WireExtraKeys::Malformed`]), is such a drop: that event goes, not the batch.
//!
//! [`TransportError::MalformedMsgpack`]: crate::TransportError::MalformedMsgpack
//! [`TransportError::Oversized`]: crate::TransportError::Oversized

mod convert;

use crate::error::TransportError;

pub use convert::{ConvertConfig, Converted, convert};
pub use wire::kv_events::{
    MAX_BATCH_BYTES, MAX_HASH_BIN_BYTES, WireBatch, WireEvent, WireExtraItem, WireExtraKeys,
};

/// Decodes one msgpack KV-event batch ([`wire::kv_events::decode_batch`]).
///
/// # Errors
/// [`TransportError::Oversized`] when `bytes` is longer than [`MAX_BATCH_BYTES`];
/// [`TransportError::MalformedMsgpack`] when the bytes are not a well-formed batch (truncated,
/// wrong types, out-of-range integers, a known event missing a required field). Unknown event
/// types are not errors: they are skipped and counted in [`WireBatch::unknown_events`].
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch, TransportError> {
    wire::kv_events::decode_batch(bytes).map_err(TransportError::from)
}
