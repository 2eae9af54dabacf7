//! kvengine's own ZMTP 3.x, on tokio: exactly the sockets and patterns kvengine uses (a SUB
//! and a DEALER that connect out; a PUB and a ROUTER that bind), NULL mechanism only, with
//! a bound on every length a peer sends.
//!
//! # Why not the `zeromq` crate
//! Its decoder (zeromq 0.7.0, `codec/zmq_codec.rs`) reserves a frame's declared length
//! (plus a read chunk) before reading it: a 9-byte frame header claiming 2^62 bytes makes
//! `BytesMut::reserve` fail and the process abort (`memory allocation of ... failed`), and
//! any length below that reserves it outright. 0.7.0 is the newest release (no fix to move
//! to), and the decoder is internal: no option bounds a frame. A guard in front (a relay
//! that parses ZMTP to validate it) would need this very decoder, plus a second hop and a
//! copy of every batch on the ingest path; replacing the crate where it faces the network
//! is smaller. What kvengine needs of ZMTP is small: the greeting, READY, SUBSCRIBE /
//! CANCEL (3.1 commands and 3.0 messages), PING/PONG, and multipart messages.
//!
//! # Interop
//! kvengine greets as ZMTP 3.0, NULL mechanism, as the `zeromq` crate did against real vLLM
//! (libzmq 4.3 greets 3.1 and speaks 3.0 to a 3.0 peer, sending subscriptions as
//! `0x01`-prefixed messages). It accepts any 3.x greeting with the NULL mechanism, both
//! subscription forms, and READY's properties in any case. READY carries `Socket-Type` and,
//! for DEALER and ROUTER, an empty `Identity`, as libzmq sends. Peers of another major
//! version or mechanism (CURVE, PLAIN) are refused.
//!
//! # Invariants
//! 1. No byte sequence from a peer panics or aborts the process, nor makes it allocate
//!    more than the peer sent plus a bounded read chunk ([`codec`], [`conn`]).
//! 2. A message (all its frames) larger than [`Limits::max_message_bytes`], a command
//!    larger than [`codec::MAX_COMMAND_BYTES`], or more than [`codec::MAX_PARTS`] frames is
//!    refused from its frame header, before its bytes are read.
//! 3. Every error is the connection's end: [`is_violation`] tells a peer's fault (counted
//!    by the caller: `malformed_frame`, `oversized`, `unsupported_version`) from the
//!    network's (a reset, a timeout, a close).
//!
//! * [`codec`]: sans-IO framing (and the fuzz targets' entry point).
//! * [`conn`]: one connection: handshake under a deadline, bounded reads, buffered writes.
//! * [`server`]: the bound PUB and ROUTER sockets of kvengine's publisher.

pub mod codec;
pub mod conn;
pub mod server;

pub use codec::{Decoded, Decoder, SocketType};
pub use conn::{Connection, Incoming};
pub use server::{PubSocket, Refusals, RouterSocket};

use crate::error::TransportError;
use crate::kv_events::MAX_BATCH_BYTES;
use std::time::Duration;

/// The default bound on a message: the largest batch the decoder takes
/// ([`MAX_BATCH_BYTES`], 64 MiB) plus 64 KiB for its topic and seq frames.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = MAX_BATCH_BYTES + (64 << 10);

/// The default deadline for a connection's greeting and READY exchange.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What one connection accepts from its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes the frames of one message may carry together (invariant 2).
    pub max_message_bytes: usize,
    /// Longest the greeting and READY exchange may take.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

/// Whether `e` is a peer's fault (a frame or greeting refused), to be counted, rather than
/// the network's.
pub fn is_violation(e: &TransportError) -> bool {
    matches!(
        e,
        TransportError::MalformedFrame(_)
            | TransportError::Oversized { .. }
            | TransportError::UnsupportedVersion { .. }
    )
}
