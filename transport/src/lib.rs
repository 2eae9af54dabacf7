//! kvengine's transports: the I/O that drives the sans-IO `engine` crate.
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod bounds;
pub mod cores;
pub mod error;
pub mod http;
pub mod hub;
pub mod json_events;
pub mod kv_events;
pub mod log_limit;
pub mod metrics;
pub mod misses;
pub mod native;
pub mod openai;
pub mod outbound;
pub mod replicas;
pub mod sources;
pub mod state;
pub mod stream;
pub mod tls;
pub mod trtllm;
pub mod worker_answers;
pub mod zmq;

pub use error::{DropReason, Result, TransportError};
