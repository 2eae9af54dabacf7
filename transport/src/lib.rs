//! kvengine's transports: the I/O that drives the sans-IO `engine` crate.
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod error;

pub use error::{DropReason, Result, TransportError};
