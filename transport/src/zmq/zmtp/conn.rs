//! One ZMTP connection over TCP: the handshake (greeting and NULL READY, under a deadline),
//! then messages in and out through [`super::codec`].
//!
//! # Invariants
//! 1. The read buffer grows with what the peer actually sent: each read reserves at most
//!    `max(READ_CHUNK, bytes buffered)` more, so a header declaring a large (but allowed)
//!    frame and nothing after it costs [`READ_CHUNK`] bytes, not the declared size.
//! 2. A connection whose handshake did not finish within [`super::Limits`]'s deadline, or
//!    whose peer's socket type does not pair with ours, is an error: the caller drops it.
//!
//! # Concurrency
//! A [`Connection`] (or its [`Reader`] and [`Writer`] halves) is owned by one task.
//! [`Reader::next`] is cancel safe (the decoder's state and the buffer live in the reader);
//! [`Connection::recv`] is not while it answers a PING, and callers that cancel it (a
//! timeout) drop the connection.

use super::Limits;
use super::codec::{self, Command, Decoded, Decoder, SocketType};
use crate::error::{Result, TransportError};
use bytes::{Bytes, BytesMut};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// The most a read reserves beyond what is buffered, while less is buffered (invariant 1).
pub const READ_CHUNK: usize = 64 << 10;
/// The least a read reserves (many small messages are read in one go).
const MIN_READ: usize = 8 << 10;
/// The write buffer: frames smaller than this are coalesced, larger ones written directly.
const WRITE_BUFFER: usize = 64 << 10;

fn io_err(context: &str) -> impl FnOnce(std::io::Error) -> TransportError + '_ {
    move |source| TransportError::Io {
        context: context.to_owned(),
        source,
    }
}

/// The peer's host and port of a `tcp://HOST:PORT` endpoint (`[v6]` brackets removed).
pub fn split_endpoint(endpoint: &str) -> Result<(&str, u16)> {
    let invalid = || TransportError::Invalid {
        name: "zmq endpoint",
        reason: format!("{endpoint:?} is not tcp://HOST:PORT"),
    };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(invalid)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(invalid)?;
    let port = port.parse::<u16>().map_err(|_| invalid())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(invalid());
    }
    Ok((host, port))
}

/// A connection's incoming half: decodes what the peer sends.
#[derive(Debug)]
pub struct Reader {
    half: OwnedReadHalf,
    buf: BytesMut,
    decoder: Decoder,
}

impl Reader {
    /// The next greeting, command or message. Cancel safe. An error ends the connection:
    /// [`TransportError::Oversized`] and [`TransportError::MalformedFrame`] for what the
    /// peer sent (see [`super::is_violation`]), I/O otherwise (`UnexpectedEof` for a clean
    /// close between messages).
    pub async fn next(&mut self) -> Result<Decoded> {
        loop {
            if let Some(unit) = self.decoder.decode(&mut self.buf)? {
                return Ok(unit);
            }
            let needed = self.decoder.needed(&self.buf);
            // Invariant 1: grow with what arrived, never by the declared size at once.
            let grow = needed.max(MIN_READ).min(READ_CHUNK.max(self.buf.len()));
            self.buf.reserve(grow);
            let n = self
                .half
                .read_buf(&mut self.buf)
                .await
                .map_err(io_err("ZMQ receive"))?;
            if n == 0 {
                return Err(self.decoder.at_eof(self.buf.len()));
            }
        }
    }
}

/// A connection's outgoing half. Writes are buffered until [`Writer::flush`].
#[derive(Debug)]
pub struct Writer {
    half: BufWriter<OwnedWriteHalf>,
}

impl Writer {
    /// Queues `frames` as one message (flushed by [`Writer::flush`], or by the buffer
    /// filling up). A frame larger than the buffer is written without a copy.
    pub async fn write(&mut self, frames: &[Bytes]) -> Result<()> {
        let last = frames.len().saturating_sub(1);
        if frames.is_empty() {
            return self.write_raw(&[0, 0]).await;
        }
        for (i, f) in frames.iter().enumerate() {
            let (h, n) = codec::frame_header(f.len(), i < last, false);
            self.write_raw(h.get(..n).unwrap_or_default()).await?;
            self.write_raw(f).await?;
        }
        Ok(())
    }

    /// Writes raw bytes (a greeting, an encoded command).
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.half.write_all(bytes).await.map_err(io_err("ZMQ send"))
    }

    /// Sends what is buffered.
    pub async fn flush(&mut self) -> Result<()> {
        self.half.flush().await.map_err(io_err("ZMQ send"))
    }

    /// Queues and flushes one message.
    pub async fn send(&mut self, frames: &[Bytes]) -> Result<()> {
        self.write(frames).await?;
        self.flush().await
    }

    /// Answers a PING.
    pub async fn pong(&mut self, context: &[u8]) -> Result<()> {
        let mut b = BytesMut::new();
        codec::encode_command(&mut b, "PONG", context);
        self.write_raw(&b).await?;
        self.flush().await
    }
}

/// What a peer sent, after the handshake, that the socket acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A multipart message.
    Message(Vec<Bytes>),
    /// A subscription to a topic prefix (ZMTP 3.1 SUBSCRIBE, or a 3.0 `0x01` message).
    Subscribe(Bytes),
    /// The end of one (CANCEL, or a 3.0 `0x00` message).
    Cancel(Bytes),
}

/// A handshaken ZMTP connection.
#[derive(Debug)]
pub struct Connection {
    reader: Reader,
    writer: Writer,
    me: SocketType,
    peer: SocketType,
}

impl Connection {
    /// Connects to `tcp://HOST:PORT` as a socket of type `me` and handshakes.
    pub async fn connect(endpoint: &str, me: SocketType, limits: &Limits) -> Result<Self> {
        let (host, port) = split_endpoint(endpoint)?;
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(io_err("ZMQ connect"))?;
        Self::handshake(stream, me, limits).await
    }

    /// Handshakes on an accepted connection as a socket of type `me`.
    pub async fn accept(stream: TcpStream, me: SocketType, limits: &Limits) -> Result<Self> {
        Self::handshake(stream, me, limits).await
    }

    async fn handshake(stream: TcpStream, me: SocketType, limits: &Limits) -> Result<Self> {
        // ZMQ messages are small and latency matters (libzmq sets it too).
        let _ = stream.set_nodelay(true);
        let (read, write) = stream.into_split();
        let mut reader = Reader {
            half: read,
            buf: BytesMut::with_capacity(1024),
            decoder: Decoder::new(limits.max_message_bytes),
        };
        let mut writer = Writer {
            half: BufWriter::with_capacity(WRITE_BUFFER, write),
        };
        let exchange = async {
            writer.write_raw(&codec::greeting()).await?;
            writer.flush().await?;
            match reader.next().await? {
                Decoded::Greeting(_) => {}
                _ => return Err(TransportError::MalformedFrame("ZMTP: no greeting".into())),
            }
            let mut ready = BytesMut::new();
            codec::encode_ready(&mut ready, me);
            writer.write_raw(&ready).await?;
            writer.flush().await?;
            match reader.next().await? {
                Decoded::Command(Command::Ready { socket_type, .. }) if me.accepts(socket_type) => {
                    Ok(socket_type)
                }
                Decoded::Command(Command::Ready { socket_type, .. }) => {
                    Err(TransportError::MalformedFrame(format!(
                        "ZMTP: a {me} socket does not talk to a {socket_type} socket"
                    )))
                }
                Decoded::Command(Command::Error(reason)) => Err(TransportError::Io {
                    context: "ZMQ handshake".into(),
                    source: std::io::Error::other(format!(
                        "the peer refused: {}",
                        String::from_utf8_lossy(&reason)
                    )),
                }),
                _ => Err(TransportError::MalformedFrame(
                    "ZMTP: the handshake's second frame is not READY".into(),
                )),
            }
        };
        let peer = tokio::time::timeout(limits.handshake_timeout, exchange)
            .await
            .map_err(|_| handshake_timeout(limits.handshake_timeout))??;
        Ok(Self {
            reader,
            writer,
            me,
            peer,
        })
    }

    /// The peer's socket type.
    pub fn peer_type(&self) -> SocketType {
        self.peer
    }

    /// The next message, or (on a PUB socket) subscription or cancellation. PINGs are answered (not cancel safe
    /// then: see the module docs), PONGs and unknown commands skipped; an ERROR command
    /// ends the connection.
    pub async fn recv(&mut self) -> Result<Incoming> {
        loop {
            match self.reader.next().await? {
                // Only a publisher reads ZMTP 3.0 subscriptions out of messages.
                Decoded::Message(frames) if self.me == SocketType::Pub => {
                    return Ok(incoming(frames));
                }
                Decoded::Message(frames) => return Ok(Incoming::Message(frames)),
                Decoded::Command(c) => match c {
                    Command::Subscribe(t) => return Ok(Incoming::Subscribe(t)),
                    Command::Cancel(t) => return Ok(Incoming::Cancel(t)),
                    Command::Ping { context } => self.writer.pong(&context).await?,
                    Command::Error(reason) => return Err(peer_error(&reason)),
                    Command::Pong | Command::Unknown(_) => {}
                    Command::Ready { .. } => {
                        return Err(TransportError::MalformedFrame(
                            "ZMTP: READY after the handshake".into(),
                        ));
                    }
                },
                Decoded::Greeting(_) => {
                    return Err(TransportError::MalformedFrame(
                        "ZMTP: a second greeting".into(),
                    ));
                }
            }
        }
    }

    /// Sends one message and flushes it.
    pub async fn send(&mut self, frames: &[Bytes]) -> Result<()> {
        self.writer.send(frames).await
    }

    /// Queues one message ([`Connection::flush`] sends it).
    pub async fn write(&mut self, frames: &[Bytes]) -> Result<()> {
        self.writer.write(frames).await
    }

    /// Sends what is queued.
    pub async fn flush(&mut self) -> Result<()> {
        self.writer.flush().await
    }

    /// The two halves, for a task that reads and writes at once.
    pub fn into_split(self) -> (Reader, Writer) {
        (self.reader, self.writer)
    }
}

/// A ZMTP 3.0 subscription message (`0x01` + topic) or cancellation (`0x00` + topic) is
/// one; any other message is a message.
pub fn incoming(frames: Vec<Bytes>) -> Incoming {
    if let [only] = frames.as_slice() {
        match only.first() {
            Some(1) => return Incoming::Subscribe(only.slice(1..)),
            Some(0) => return Incoming::Cancel(only.slice(1..)),
            _ => {}
        }
    }
    Incoming::Message(frames)
}

/// The error for a peer's ERROR command.
pub fn peer_error(reason: &[u8]) -> TransportError {
    TransportError::Io {
        context: "ZMQ connection".into(),
        source: std::io::Error::other(format!(
            "the peer sent ERROR: {}",
            String::from_utf8_lossy(reason)
        )),
    }
}

fn handshake_timeout(after: Duration) -> TransportError {
    TransportError::Io {
        context: "ZMQ handshake".into(),
        source: std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no greeting and READY within {after:?}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_split() {
        assert_eq!(
            split_endpoint("tcp://127.0.0.1:5557").unwrap(),
            ("127.0.0.1", 5557)
        );
        assert_eq!(split_endpoint("tcp://[::1]:1").unwrap(), ("::1", 1));
        assert_eq!(split_endpoint("tcp://gpu-1:0").unwrap(), ("gpu-1", 0));
        for bad in [
            "udp://a:1",
            "tcp://a",
            "tcp://:1",
            "tcp://a:x",
            "tcp://a:70000",
        ] {
            assert!(split_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn legacy_subscriptions_are_recognised() {
        let one = |b: &'static [u8]| vec![Bytes::from_static(b)];
        assert_eq!(
            incoming(one(b"\x01kv")),
            Incoming::Subscribe(Bytes::from_static(b"kv"))
        );
        assert_eq!(incoming(one(b"\x00")), Incoming::Cancel(Bytes::new()));
        assert_eq!(incoming(one(b"x")), Incoming::Message(one(b"x")));
        let two = vec![Bytes::from_static(b"\x01"), Bytes::new()];
        assert_eq!(incoming(two.clone()), Incoming::Message(two));
    }
}
