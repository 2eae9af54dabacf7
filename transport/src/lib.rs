//! kvengine's transports: the I/O that drives the sans-IO `engine` crate.
//!
//! Empty for now: ZMQ (vLLM/SGLang), QUIC + rkyv and the HTTP edge arrive with issue 4.
//! Nothing here pretends to work yet.
#![deny(clippy::unwrap_used, clippy::expect_used)]
