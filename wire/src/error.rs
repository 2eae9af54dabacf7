//! The wire crate's one error type: why a decoder refused its input whole.
//!
//! Parts of an input a decoder can skip (an unknown event type, one unreadable element of a
//! TensorRT-LLM page, a malformed `extra_keys`) are not errors: they are returned or counted
//! in the decoded value, and the caller decides what to drop.

/// Why an input was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The input is larger than its format's bound.
    #[error("{what} of {got} bytes exceeds the limit of {limit} bytes")]
    Oversized {
        /// What was too large.
        what: &'static str,
        /// Its size in bytes.
        got: usize,
        /// The bound in bytes.
        limit: usize,
    },
    /// A msgpack KV-event batch is not well-formed (truncated, wrong types, out-of-range
    /// integers, a known event missing a required field).
    #[error("{what} at byte {at}")]
    MalformedMsgpack {
        /// What was wrong.
        what: &'static str,
        /// The byte offset where the decoder found it.
        at: usize,
    },
    /// A JSON body is not of the expected shape.
    #[error("{what}: {source}")]
    MalformedJson {
        /// Which body.
        what: &'static str,
        /// serde_json's error.
        source: serde_json::Error,
    },
}

/// `Result` with [`WireError`].
pub type Result<T> = std::result::Result<T, WireError>;
