//! kvengine's native ingest protocol: QUIC (quinn) carrying rkyv archives, the server that
//! feeds the [`crate::hub::Hub`] and the publisher client workers link against.
//!
//! The wire contract is in `docs/protocol.md`, "Native protocol (QUIC + rkyv)".
//!
//! * [`schema`] holds the messages, [`PROTOCOL_VERSION`] and the ALPN id.
//! * [`frame`] does length-prefixed framing, validation and conversion (pure; fuzzed).
//! * [`server`] runs the ingest server, [`serve_quic`].
//! * [`client`] is the publisher, [`Publisher`].
//! * [`quic_tls`] handles certificates, fingerprints and trust.
//! * [`auth`] holds the ingest tokens and the workers each may publish for.

pub mod auth;
pub mod client;
pub mod frame;
pub mod quic_tls;
pub mod schema;
pub mod server;

pub use auth::{IngestCredentials, ScopedToken, WorkerScope};
pub use client::{Done, Publisher, PublisherConfig};
pub use frame::MAX_FRAME_BYTES;
pub use quic_tls::{TlsSource, Trust};
pub use schema::{
    ClientFrame, EventBatch, NativeBlock, NativeEvent, PROTOCOL_VERSION, ServerFrame,
};
pub use server::{HELLO_TIMEOUT, MAX_UNAUTHENTICATED, QuicServer, QuicServerConfig, serve_quic};
