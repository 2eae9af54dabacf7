//! TensorRT-LLM workers: their KV-cache events, polled from `trtllm-serve`'s
//! `POST /kv_cache_events` (a destructive drain: each call hands out the events since the
//! last one), decoded ([`decode_page`]: the `wire` crate's decoder, `wire::trtllm`, whose
//! types are re-exported here), fenced by `event_id` and applied ([`apply`]) with one
//! converter per attention-DP rank ([`convert`]), by one poller task per worker
//! ([`poller`]) that a finished request wakes ([`crate::hub::FinishWakeups`]).
//!
//! Only one client may drain a worker: a second one (another router, or TensorRT-LLM's own
//! disaggregated router) takes events this router then never sees, which its fence reports
//! as gaps (the worker's blocks are cleared and resynced each time).

/// TensorRT-LLM's default `tokens_per_block`: the block size its workers' events carry
/// unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: u32 = 32;

pub mod apply;
pub mod convert;
pub mod poller;
pub mod source;

use crate::error::TransportError;

pub use apply::WorkerEvents;
pub use convert::{Outcome, RankConverter};
pub use poller::{spawn_poller, spawn_poller_on};
pub use source::{DEFAULT_POLL_INTERVAL, TrtllmSource};
pub use wire::trtllm::{
    Diff, MAX_PAGE_BYTES, PageEntry, TrtBlock, TrtData, TrtEvent, TrtToken, WireHash,
};

/// Decodes one `/kv_cache_events` answer ([`wire::trtllm::decode_page`]).
///
/// # Errors
/// [`TransportError::Oversized`] above [`MAX_PAGE_BYTES`]; [`TransportError::MalformedJson`]
/// when the body is not a JSON array. Bad elements are [`PageEntry::Unreadable`], not errors.
pub fn decode_page(bytes: &[u8]) -> Result<Vec<PageEntry>, TransportError> {
    wire::trtllm::decode_page(bytes).map_err(TransportError::from)
}
