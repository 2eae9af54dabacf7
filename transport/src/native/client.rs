//! The publisher: what a worker links to send its KV events to kvengine natively.
//!
//! ```no_run
//! # async fn demo() -> transport::Result<()> {
//! use transport::native::{NativeEvent, Publisher, PublisherConfig, Trust};
//! let mut p = Publisher::connect(PublisherConfig {
//!     server: "10.0.0.1:7400".parse().unwrap(),
//!     server_name: "kvengine".into(),
//!     trust: Trust::Fingerprint("3f…".into()),
//!     token: "s3cret".into(),
//!     worker_id: 7,
//!     dp_ranks: vec![0],
//!     block_size: 16,
//!     instance: 0,
//! })
//! .await?;
//! p.send(0, &[NativeEvent::Cleared]).await?;
//! let done = p.finish().await?;
//! # let _ = done; Ok(()) }
//! ```
//!
//! # Invariants
//! 1. Per dp rank, [`Publisher::send`] numbers batches 0, 1, 2, ...; after
//!    [`Publisher::send_with_seq`] it continues from that number plus one.
//! 2. A batch is serialized into one reused buffer straight from the borrowed events.
//! 3. A publisher has one non-zero instance id for its whole life; [`Publisher::reconnect`]
//!    keeps it and the numbering.

use super::frame::{self, FrameBuf, LEN_BYTES, MAX_FRAME_BYTES};
use super::quic_tls::{self, Trust};
use super::schema::{ClientFrame, PROTOCOL_VERSION, ServerFrame};
use crate::error::{Result, TransportError};
use crate::native::schema::NativeEvent;
use quinn::{Connection, ReadExactError, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;

/// How a publisher connects.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// The server's UDP address.
    pub server: SocketAddr,
    /// The name the certificate is checked against (with [`Trust::CaPem`]).
    pub server_name: String,
    /// How the server's certificate is trusted.
    pub trust: Trust,
    /// An ingest token the server accepts for [`PublisherConfig::worker_id`].
    pub token: String,
    /// The worker this publisher speaks for.
    pub worker_id: u64,
    /// Its data-parallel ranks (empty: rank 0).
    pub dp_ranks: Vec<u32>,
    /// Tokens per block (must equal the router's).
    pub block_size: u32,
    /// This process's identity across reconnects (see the hello's `instance`); 0: one is
    /// drawn at random at connect. A publisher that reconnects with
    /// [`Publisher::reconnect`] keeps it and its numbering, so the server tells a lost batch
    /// (a gap) and a restarted publisher (a new instance) apart from a reconnect.
    pub instance: u64,
}

/// The server's final answer: everything it received was handed to the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// Batches it handled.
    pub batches: u64,
    /// Events it handed to the index.
    pub events: u64,
}

/// A connected publisher (see the module docs).
#[derive(Debug)]
pub struct Publisher {
    _endpoint: quinn::Endpoint,
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    worker_id: u64,
    server_block_size: u32,
    next_seq: HashMap<u32, u64>,
    buf: FrameBuf,
    cfg: PublisherConfig,
}

fn io(context: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> TransportError {
    TransportError::Io {
        context: context.to_owned(),
        source: std::io::Error::other(e),
    }
}

async fn read_frame(recv: &mut RecvStream, buf: &mut FrameBuf) -> Result<ServerFrame> {
    let mut len = [0u8; LEN_BYTES];
    recv.read_exact(&mut len).await.map_err(|e| match e {
        ReadExactError::FinishedEarly(_) => io(
            "reading the server's answer",
            "the server finished its stream early",
        ),
        ReadExactError::ReadError(e) => io("reading the server's answer", e),
    })?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME_BYTES {
        return Err(TransportError::Oversized {
            what: "server frame",
            got: n,
            limit: MAX_FRAME_BYTES,
        });
    }
    buf.clear();
    buf.resize(n, 0);
    recv.read_exact(buf)
        .await
        .map_err(|e| io("reading the server's answer", e))?;
    frame::decode_server_frame(buf)
}

/// The error a `Refused` reason stands for (stable prefixes, see `docs/protocol.md`).
fn refused(reason: String) -> TransportError {
    if reason.starts_with(super::server::UNAUTHORIZED_WORKER) {
        TransportError::Unauthorized("the ingest token does not cover this worker")
    } else if reason.starts_with("unauthorized") {
        TransportError::Unauthorized("the server refused the ingest token")
    } else if reason.starts_with("unsupported version") {
        let server = reason
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        TransportError::UnsupportedVersion {
            got: server,
            supported: PROTOCOL_VERSION,
        }
    } else {
        TransportError::Invalid {
            name: "hello",
            reason,
        }
    }
}

impl Publisher {
    /// Connects, sends the hello and waits for the server's answer. A refusal closes the
    /// connection and returns [`TransportError::Unauthorized`],
    /// [`TransportError::UnsupportedVersion`] or [`TransportError::Invalid`].
    pub async fn connect(mut cfg: PublisherConfig) -> Result<Publisher> {
        if cfg.instance == 0 {
            cfg.instance = random_instance()?;
        }
        Self::open(cfg, HashMap::new()).await
    }

    /// A new connection for the same process: same instance, numbering going on where this
    /// one stopped (after a lost connection; the server keeps each rank's fence, so batches
    /// lost with the old connection show up as a gap).
    pub async fn reconnect(self) -> Result<Publisher> {
        self.conn
            .close(VarInt::from_u32(super::server::CLOSE_DONE), b"reconnect");
        Self::open(self.cfg, self.next_seq).await
    }

    /// This process's instance (see [`PublisherConfig::instance`]).
    pub fn instance(&self) -> u64 {
        self.cfg.instance
    }

    async fn open(cfg: PublisherConfig, next_seq: HashMap<u32, u64>) -> Result<Publisher> {
        let client = quic_tls::client_config(&cfg.trust)?;
        let bind: SocketAddr = if cfg.server.is_ipv4() {
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            SocketAddr::from(([0u16; 8], 0))
        };
        let endpoint = quinn::Endpoint::client(bind).map_err(|e| TransportError::Io {
            context: "binding a QUIC client socket".into(),
            source: e,
        })?;
        let conn = endpoint
            .connect_with(client, cfg.server, &cfg.server_name)
            .map_err(|e| io("connecting", e))?
            .await
            .map_err(|e| io(&format!("connecting to {}", cfg.server), e))?;
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| io("opening a stream", e))?;
        let mut buf = FrameBuf::with_capacity(64 << 10);
        let hello = ClientFrame::Hello {
            version: PROTOCOL_VERSION,
            worker_id: cfg.worker_id,
            dp_ranks: cfg.dp_ranks.clone(),
            block_size: cfg.block_size,
            token: cfg.token.clone(),
            instance: cfg.instance,
        };
        frame::encode_client_frame(&hello, &mut buf)?;
        write(&mut send, &buf).await?;
        match read_frame(&mut recv, &mut buf).await? {
            ServerFrame::HelloAck {
                version,
                block_size,
            } if version == PROTOCOL_VERSION => Ok(Publisher {
                _endpoint: endpoint,
                conn,
                send,
                recv,
                worker_id: cfg.worker_id,
                server_block_size: block_size,
                next_seq,
                buf,
                cfg,
            }),
            ServerFrame::HelloAck { version, .. } => {
                conn.close(VarInt::from_u32(super::server::CLOSE_PROTOCOL), b"version");
                Err(TransportError::UnsupportedVersion {
                    got: version,
                    supported: PROTOCOL_VERSION,
                })
            }
            ServerFrame::Refused { reason } => {
                conn.close(VarInt::from_u32(super::server::CLOSE_DONE), b"refused");
                Err(refused(reason))
            }
            ServerFrame::Done { .. } => Err(TransportError::Invalid {
                name: "hello",
                reason: "the server answered the hello with done".into(),
            }),
        }
    }

    /// The router's block size, as the server acknowledged it.
    pub fn server_block_size(&self) -> u32 {
        self.server_block_size
    }

    /// Sends `events` of `dp_rank` as its next batch; returns the sequence number used.
    pub async fn send(&mut self, dp_rank: u32, events: &[NativeEvent]) -> Result<u64> {
        let seq = self.next_seq.get(&dp_rank).copied().unwrap_or(0);
        self.send_with_seq(dp_rank, seq, events).await?;
        Ok(seq)
    }

    /// Sends `events` of `dp_rank` numbered `seq` (the next [`Publisher::send`] on this rank
    /// uses `seq + 1`).
    pub async fn send_with_seq(
        &mut self,
        dp_rank: u32,
        seq: u64,
        events: &[NativeEvent],
    ) -> Result<()> {
        frame::encode_batch(self.worker_id, dp_rank, seq, events, &mut self.buf)?;
        write(&mut self.send, &self.buf).await?;
        self.next_seq.insert(dp_rank, seq.wrapping_add(1));
        Ok(())
    }

    /// Finishes the send side and waits for the server's `Done` (everything sent was handed
    /// to the index), then closes the connection.
    pub async fn finish(mut self) -> Result<Done> {
        self.send
            .finish()
            .map_err(|e| io("finishing the stream", e))?;
        let answer = read_frame(&mut self.recv, &mut self.buf).await;
        self.conn
            .close(VarInt::from_u32(super::server::CLOSE_DONE), b"done");
        match answer? {
            ServerFrame::Done { batches, events } => Ok(Done { batches, events }),
            other => Err(TransportError::Invalid {
                name: "done",
                reason: format!("expected done, the server sent {other:?}"),
            }),
        }
    }
}

/// A non-zero instance id from the OS's random source.
fn random_instance() -> Result<u64> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    loop {
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| io("drawing an instance id", "no random source"))?;
        let id = u64::from_le_bytes(bytes);
        if id != 0 {
            return Ok(id);
        }
    }
}

async fn write(send: &mut SendStream, body: &[u8]) -> Result<()> {
    let prefix = frame::length_prefix(body.len(), MAX_FRAME_BYTES)?;
    send.write_all(&prefix)
        .await
        .map_err(|e| io("sending a frame", e))?;
    send.write_all(body)
        .await
        .map_err(|e| io("sending a frame", e))?;
    Ok(())
}
