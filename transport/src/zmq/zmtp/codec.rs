//! ZMTP 3.x framing, sans-IO: the greeting, command frames and multipart messages,
//! decoded from a byte buffer with every length checked against a bound before anything
//! is reserved for it.
//!
//! The wire format (RFC 23/ZMTP 3.0, RFC 37/ZMTP 3.1, NULL mechanism):
//! * greeting, 64 bytes: `0xff`, 8 padding bytes, `0x7f`, major and minor version,
//!   mechanism name (20 bytes, NUL padded), as-server (1 byte), 31 bytes of filler;
//! * frame: a flags byte (`0x01` MORE, `0x02` LONG, `0x04` COMMAND; the other bits are
//!   reserved and must be zero), a size (1 byte, or 8 bytes big-endian with LONG), the body;
//! * command body: name length (1 byte), name, data; READY's data is properties, each a name
//!   length (1 byte), name, value length (4 bytes big-endian), value.
//!
//! # Invariants
//! 1. No length read from the input is trusted: a frame's declared size is compared with
//!    the bound (the message's remaining budget, or [`MAX_COMMAND_BYTES`] for a command)
//!    before the decoder asks for its bytes, so [`Decoder::needed`] never exceeds the bound.
//! 2. Every slice of the input is taken after a length check; the decoder never panics and
//!    never allocates more than the frames it returns (plus one `Vec` of at most
//!    [`MAX_PARTS`] handles per message).
//! 3. Decoding is the same whatever the input's split into reads: the decoder consumes a
//!    unit (greeting, frame header, frame body) only once all of it is buffered.
//! 4. After an error the decoder is done: the caller closes the connection.
//!
//! # Concurrency
//! A [`Decoder`] belongs to one connection's reader; it is plain data (`Send`, no sharing).

use crate::error::{Result, TransportError};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::fmt;

/// Length of a ZMTP 3.x greeting.
pub const GREETING_LEN: usize = 64;

/// Largest command body accepted (READY with its properties, SUBSCRIBE with a topic, PING).
pub const MAX_COMMAND_BYTES: usize = 64 << 10;

/// Most frames one message may have (kvengine's longest is vLLM's 4-frame replay reply;
/// a ROUTER adds none here: replies are written to the connection that asked).
pub const MAX_PARTS: usize = 16;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// The version kvengine greets with: ZMTP 3.0 (a 3.1 peer speaks 3.0 to it, sending
/// subscriptions as `0x01`-prefixed messages, as libzmq does with 3.0 peers).
const OUR_VERSION: (u8, u8) = (3, 0);
const NULL_MECHANISM: &[u8] = b"NULL";

/// A ZMQ socket type, as READY's `Socket-Type` property names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// `PAIR`.
    Pair,
    /// `PUB`.
    Pub,
    /// `SUB`.
    Sub,
    /// `REQ`.
    Req,
    /// `REP`.
    Rep,
    /// `DEALER`.
    Dealer,
    /// `ROUTER`.
    Router,
    /// `PULL`.
    Pull,
    /// `PUSH`.
    Push,
    /// `XPUB`.
    XPub,
    /// `XSUB`.
    XSub,
}

impl SocketType {
    const ALL: [SocketType; 11] = [
        SocketType::Pair,
        SocketType::Pub,
        SocketType::Sub,
        SocketType::Req,
        SocketType::Rep,
        SocketType::Dealer,
        SocketType::Router,
        SocketType::Pull,
        SocketType::Push,
        SocketType::XPub,
        SocketType::XSub,
    ];

    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketType::Pair => "PAIR",
            SocketType::Pub => "PUB",
            SocketType::Sub => "SUB",
            SocketType::Req => "REQ",
            SocketType::Rep => "REP",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
            SocketType::Pull => "PULL",
            SocketType::Push => "PUSH",
            SocketType::XPub => "XPUB",
            SocketType::XSub => "XSUB",
        }
    }

    /// The type a wire name stands for.
    pub fn from_wire(name: &[u8]) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str().as_bytes() == name)
    }

    /// Whether a socket of this type may talk to a `peer` (RFC 23's and RFC 37's table,
    /// for the types kvengine uses).
    pub fn accepts(self, peer: SocketType) -> bool {
        use SocketType::*;
        match self {
            Sub => matches!(peer, Pub | XPub),
            Pub => matches!(peer, Sub | XSub),
            Dealer => matches!(peer, Rep | Dealer | Router),
            Router => matches!(peer, Req | Dealer | Router),
            _ => false,
        }
    }

    /// Whether READY carries an `Identity` property for this type (libzmq sends one, empty
    /// unless set, for REQ, DEALER and ROUTER).
    fn sends_identity(self) -> bool {
        matches!(
            self,
            SocketType::Req | SocketType::Dealer | SocketType::Router
        )
    }
}

impl fmt::Display for SocketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A peer's greeting (only what kvengine looks at).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Greeting {
    /// ZMTP major version (3 for every peer accepted).
    pub major: u8,
    /// ZMTP minor version (libzmq 4.2+ sends 1).
    pub minor: u8,
}

/// A command frame, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The end of the NULL handshake: the peer's socket type and identity.
    Ready {
        /// `Socket-Type`.
        socket_type: SocketType,
        /// `Identity`, if sent (0 to 255 bytes).
        identity: Option<Bytes>,
    },
    /// ZMTP 3.1 subscription (from a SUB to a PUB).
    Subscribe(Bytes),
    /// ZMTP 3.1 unsubscription.
    Cancel(Bytes),
    /// A heartbeat: answered with a PONG carrying `context`.
    Ping {
        /// Up to 16 bytes the PONG echoes.
        context: Bytes,
    },
    /// A heartbeat's answer.
    Pong,
    /// The peer gives up: why.
    Error(Bytes),
    /// A command this build does not know (ignored after the handshake).
    Unknown(Bytes),
}

/// What the decoder produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// The peer's greeting (always first).
    Greeting(Greeting),
    /// A command frame.
    Command(Command),
    /// A whole multipart message, its frames in order (1 to [`MAX_PARTS`]).
    Message(Vec<Bytes>),
}

#[derive(Clone, Copy, Debug)]
enum State {
    Greeting,
    Header,
    Body { flags: u8, len: usize },
}

fn malformed(what: impl fmt::Display) -> TransportError {
    TransportError::MalformedFrame(format!("ZMTP: {what}"))
}

/// Decodes one connection's incoming bytes. See the module docs.
#[derive(Debug)]
pub struct Decoder {
    max_message: usize,
    state: State,
    /// The frames of the message being received.
    parts: Vec<Bytes>,
    /// Their bytes.
    message_bytes: usize,
}

impl Decoder {
    /// A decoder for a new connection (expecting the greeting), whose messages may carry at
    /// most `max_message` bytes in all their frames.
    pub fn new(max_message: usize) -> Self {
        Self {
            max_message,
            state: State::Greeting,
            parts: Vec::new(),
            message_bytes: 0,
        }
    }

    /// The next greeting, command or whole message from `buf` (consumed from its front);
    /// `Ok(None)` when more bytes are needed ([`Decoder::needed`] says how many).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Decoded>> {
        loop {
            match self.state {
                State::Greeting => {
                    check_greeting_prefix(buf)?;
                    if buf.len() < GREETING_LEN {
                        return Ok(None);
                    }
                    let g = buf.split_to(GREETING_LEN);
                    self.state = State::Header;
                    let (major, minor) = match (g.get(10), g.get(11)) {
                        (Some(&major), Some(&minor)) => (major, minor),
                        _ => return Err(malformed("short greeting")),
                    };
                    return Ok(Some(Decoded::Greeting(Greeting { major, minor })));
                }
                State::Header => {
                    let Some((flags, len, header_len)) = self.header(buf)? else {
                        return Ok(None);
                    };
                    buf.advance(header_len);
                    self.state = State::Body { flags, len };
                }
                State::Body { flags, len } => {
                    if buf.len() < len {
                        return Ok(None);
                    }
                    let body = buf.split_to(len).freeze();
                    self.state = State::Header;
                    if flags & FLAG_COMMAND != 0 {
                        return parse_command(body).map(|c| Some(Decoded::Command(c)));
                    }
                    self.message_bytes += len;
                    self.parts.push(body);
                    if flags & FLAG_MORE == 0 {
                        self.message_bytes = 0;
                        return Ok(Some(Decoded::Message(std::mem::take(&mut self.parts))));
                    }
                }
            }
        }
    }

    /// A frame header at the front of `buf`, checked: `(flags, body length, header length)`,
    /// or `None` when it is not all there yet.
    fn header(&self, buf: &[u8]) -> Result<Option<(u8, usize, usize)>> {
        let Some(&flags) = buf.first() else {
            return Ok(None);
        };
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(malformed(format_args!(
                "frame flags {flags:#04x} set reserved bits"
            )));
        }
        let command = flags & FLAG_COMMAND != 0;
        if command && flags & FLAG_MORE != 0 {
            return Err(malformed("a command frame with the MORE flag"));
        }
        if command && !self.parts.is_empty() {
            return Err(malformed("a command frame inside a multipart message"));
        }
        if !command && flags & FLAG_MORE != 0 && self.parts.len() + 1 >= MAX_PARTS {
            return Err(malformed(format_args!(
                "a message of more than {MAX_PARTS} frames"
            )));
        }
        let (len, header_len) = if flags & FLAG_LONG != 0 {
            let Some(size) = buf.get(1..9) else {
                return Ok(None);
            };
            let mut be = [0u8; 8];
            be.copy_from_slice(size);
            (u64::from_be_bytes(be), 9)
        } else {
            let Some(&size) = buf.get(1) else {
                return Ok(None);
            };
            (u64::from(size), 2)
        };
        // The bound, before anything is reserved for the body (invariant 1).
        let (what, room, limit) = if command {
            ("ZMTP command", MAX_COMMAND_BYTES, MAX_COMMAND_BYTES)
        } else {
            (
                "ZMQ message",
                self.max_message.saturating_sub(self.message_bytes),
                self.max_message,
            )
        };
        match usize::try_from(len) {
            Ok(n) if n <= room => Ok(Some((flags, n, header_len))),
            _ => {
                let already = if command { 0 } else { self.message_bytes };
                let got = usize::try_from(len)
                    .unwrap_or(usize::MAX)
                    .saturating_add(already);
                Err(TransportError::Oversized { what, got, limit })
            }
        }
    }

    /// How many bytes beyond the `buf` already held the next [`Decoder::decode`] step needs
    /// (at least 1). Never more than the bound allows (invariant 1).
    pub fn needed(&self, buf: &[u8]) -> usize {
        let want = match self.state {
            State::Greeting => GREETING_LEN,
            State::Header => match buf.first() {
                Some(flags) if flags & FLAG_LONG != 0 => 9,
                _ => 2,
            },
            State::Body { len, .. } => len,
        };
        want.saturating_sub(buf.len()).max(1)
    }

    /// The error for a connection that ended with `buffered` bytes not decoded: a clean
    /// close between messages is I/O (`UnexpectedEof`); a close inside the greeting or a
    /// message is a truncated frame.
    pub fn at_eof(&self, buffered: usize) -> TransportError {
        match self.state {
            State::Greeting if buffered == 0 => TransportError::Io {
                context: "ZMQ connection".into(),
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed by the peer before its greeting",
                ),
            },
            State::Greeting => malformed(format_args!(
                "the connection closed after {buffered} of the greeting's {GREETING_LEN} bytes"
            )),
            State::Header if buffered == 0 && self.parts.is_empty() => TransportError::Io {
                context: "ZMQ connection".into(),
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed by the peer",
                ),
            },
            _ => malformed("the connection closed inside a frame"),
        }
    }
}

/// Checks what has arrived of a greeting, so garbage is refused at its first wrong byte
/// rather than after 64 bytes (or never, from a peer that sends fewer).
fn check_greeting_prefix(g: &[u8]) -> Result<()> {
    if g.first().is_some_and(|&b| b != 0xff) {
        return Err(malformed("not a ZMTP greeting (first byte is not 0xff)"));
    }
    // Byte 9's low bit clear: a ZMTP 1.0 peer.
    if g.get(9).is_some_and(|&b| b & 1 == 0) {
        return Err(malformed("not a ZMTP 3 greeting (ZMTP 1.0 signature)"));
    }
    if let Some(&major) = g.get(10)
        && major < 3
    {
        return Err(TransportError::UnsupportedVersion {
            got: u32::from(major),
            supported: 3,
        });
    }
    if let Some(mechanism) = g.get(12..32) {
        let name_len = mechanism
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(mechanism.len());
        let (name, pad) = mechanism.split_at(name_len);
        if name != NULL_MECHANISM || pad.iter().any(|&b| b != 0) {
            return Err(malformed(format_args!(
                "security mechanism {:?}: only NULL is spoken",
                String::from_utf8_lossy(name)
            )));
        }
    }
    Ok(())
}

/// Takes `n` bytes from the front of `body`, if it has them.
fn take(body: &mut Bytes, n: usize, what: &str) -> Result<Bytes> {
    if body.len() < n {
        return Err(malformed(format_args!(
            "{what} runs past its command frame"
        )));
    }
    Ok(body.split_to(n))
}

fn parse_command(mut body: Bytes) -> Result<Command> {
    let name_len = usize::from(
        *take(&mut body, 1, "command name length")?
            .first()
            .unwrap_or(&0),
    );
    let name = take(&mut body, name_len, "command name")?;
    match name.as_ref() {
        b"READY" => parse_ready(body),
        b"SUBSCRIBE" => Ok(Command::Subscribe(body)),
        b"CANCEL" => Ok(Command::Cancel(body)),
        b"PING" => {
            if body.len() < 2 || body.len() > 2 + 16 {
                return Err(malformed(
                    "PING is not a TTL and at most 16 bytes of context",
                ));
            }
            Ok(Command::Ping {
                context: body.slice(2..),
            })
        }
        b"PONG" => Ok(Command::Pong),
        b"ERROR" => {
            let n = usize::from(
                *take(&mut body, 1, "ERROR reason length")?
                    .first()
                    .unwrap_or(&0),
            );
            Ok(Command::Error(take(&mut body, n, "ERROR reason")?))
        }
        _ => Ok(Command::Unknown(name)),
    }
}

fn parse_ready(mut body: Bytes) -> Result<Command> {
    let mut socket_type = None;
    let mut identity = None;
    while !body.is_empty() {
        let n = usize::from(
            *take(&mut body, 1, "property name length")?
                .first()
                .unwrap_or(&0),
        );
        let name = take(&mut body, n, "property name")?;
        let mut len = [0u8; 4];
        len.copy_from_slice(&take(&mut body, 4, "property value length")?);
        let n = usize::try_from(u32::from_be_bytes(len)).unwrap_or(usize::MAX);
        let value = take(&mut body, n, "property value")?;
        // Property names are case-insensitive (RFC 23).
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            let t = SocketType::from_wire(&value).ok_or_else(|| {
                malformed(format_args!(
                    "unknown socket type {:?}",
                    String::from_utf8_lossy(&value)
                ))
            })?;
            socket_type = Some(t);
        } else if name.eq_ignore_ascii_case(b"Identity") {
            if value.len() > 255 {
                return Err(malformed("an Identity longer than 255 bytes"));
            }
            identity = Some(value);
        }
    }
    match socket_type {
        Some(socket_type) => Ok(Command::Ready {
            socket_type,
            identity,
        }),
        None => Err(malformed("READY without a Socket-Type")),
    }
}

/// kvengine's greeting: ZMTP 3.0, NULL mechanism, not as-server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    // libzmq's padding: a ZMTP 1.0 peer reads it as a 1-byte identity length.
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = OUR_VERSION.0;
    g[11] = OUR_VERSION.1;
    g[12..12 + NULL_MECHANISM.len()].copy_from_slice(NULL_MECHANISM);
    g
}

/// A frame header for a body of `len` bytes: the bytes and how many of them are used
/// (2 for a short frame, 9 for a long one, which libzmq uses above 255 bytes).
pub fn frame_header(len: usize, more: bool, command: bool) -> ([u8; 9], usize) {
    let mut h = [0u8; 9];
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    match u8::try_from(len) {
        Ok(short) => {
            h[0] = flags;
            h[1] = short;
            (h, 2)
        }
        Err(_) => {
            h[0] = flags | FLAG_LONG;
            h[1..].copy_from_slice(&(len as u64).to_be_bytes());
            (h, 9)
        }
    }
}

/// Appends a command frame `name` with `data` to `dst`.
pub fn encode_command(dst: &mut BytesMut, name: &str, data: &[u8]) {
    let body_len = 1 + name.len() + data.len();
    let (h, n) = frame_header(body_len, false, true);
    dst.reserve(n + body_len);
    dst.put_slice(&h[..n]);
    dst.put_u8(name.len() as u8);
    dst.put_slice(name.as_bytes());
    dst.put_slice(data);
}

/// Appends the READY command of a socket of type `me` to `dst`.
pub fn encode_ready(dst: &mut BytesMut, me: SocketType) {
    let mut props = Vec::with_capacity(64);
    let mut property = |name: &str, value: &[u8]| {
        props.push(name.len() as u8);
        props.extend_from_slice(name.as_bytes());
        props.extend_from_slice(&(value.len() as u32).to_be_bytes());
        props.extend_from_slice(value);
    };
    property("Socket-Type", me.as_str().as_bytes());
    if me.sends_identity() {
        property("Identity", b"");
    }
    encode_command(dst, "READY", &props);
}

/// Appends a message of `frames` to `dst` (at least one frame: an empty list is sent as
/// one empty frame).
pub fn encode_message(dst: &mut BytesMut, frames: &[Bytes]) {
    if frames.is_empty() {
        dst.put_slice(&[0, 0]);
    }
    for (i, f) in frames.iter().enumerate() {
        let (h, n) = frame_header(f.len(), i + 1 < frames.len(), false);
        dst.reserve(n + f.len());
        dst.put_slice(&h[..n]);
        dst.put_slice(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8], max: usize) -> (Vec<Decoded>, Option<TransportError>) {
        let mut d = Decoder::new(max);
        let mut buf = BytesMut::from(input);
        let mut out = Vec::new();
        loop {
            match d.decode(&mut buf) {
                Ok(Some(x)) => out.push(x),
                Ok(None) => return (out, None),
                Err(e) => return (out, Some(e)),
            }
        }
    }

    fn libzmq_greeting(minor: u8) -> Vec<u8> {
        let mut g = greeting().to_vec();
        g[11] = minor;
        g
    }

    fn ready_frame(t: SocketType) -> Vec<u8> {
        let mut b = BytesMut::new();
        encode_ready(&mut b, t);
        b.to_vec()
    }

    #[test]
    fn a_handshake_and_messages_decode_in_any_split() {
        let mut input = libzmq_greeting(1);
        input.extend(ready_frame(SocketType::Router));
        let mut m = BytesMut::new();
        let big = Bytes::from(vec![7u8; 300]);
        encode_message(
            &mut m,
            &[Bytes::new(), Bytes::from_static(b"kv"), big.clone()],
        );
        encode_command(&mut m, "PING", &[0, 10, b'c']);
        encode_message(&mut m, &[Bytes::from_static(b"x")]);
        input.extend_from_slice(&m);
        let (whole, err) = decode_all(&input, 1 << 20);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(
            whole,
            vec![
                Decoded::Greeting(Greeting { major: 3, minor: 1 }),
                Decoded::Command(Command::Ready {
                    socket_type: SocketType::Router,
                    identity: Some(Bytes::new()),
                }),
                Decoded::Message(vec![Bytes::new(), Bytes::from_static(b"kv"), big]),
                Decoded::Command(Command::Ping {
                    context: Bytes::from_static(b"c")
                }),
                Decoded::Message(vec![Bytes::from_static(b"x")]),
            ]
        );
        // Byte by byte: the same units (invariant 3), and `needed` never overshoots.
        let mut d = Decoder::new(1 << 20);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for &b in &input {
            buf.put_u8(b);
            while let Some(x) = d.decode(&mut buf).unwrap() {
                out.push(x);
            }
            assert!(d.needed(&buf) <= 300);
        }
        assert_eq!(out, whole);
        assert!(buf.is_empty());
    }

    #[test]
    fn a_giant_length_is_refused_from_its_header() {
        let mut input = libzmq_greeting(1);
        input.extend(ready_frame(SocketType::Pub));
        for (flags, len) in [(0x02u8, 1u64 << 62), (0x03, u64::MAX), (0x06, 1 << 62)] {
            let mut x = input.clone();
            x.push(flags);
            x.extend_from_slice(&len.to_be_bytes());
            let (out, err) = decode_all(&x, 64 << 20);
            assert_eq!(out.len(), 2);
            assert!(
                matches!(err, Some(TransportError::Oversized { .. })),
                "{err:?}"
            );
        }
        // The budget is the message's: a second frame may not take it past the bound.
        let mut x = input.clone();
        x.extend_from_slice(&[0x01, 3, b'a', b'b', b'c', 0x00, 8]);
        let (_, err) = decode_all(&x, 10);
        assert!(matches!(
            err,
            Some(TransportError::Oversized {
                got: 11,
                limit: 10,
                ..
            })
        ));
        // And the header alone decides: nothing needed beyond the header that was refused.
        let mut d = Decoder::new(64 << 20);
        let mut buf = BytesMut::from(&input[..]);
        while d.decode(&mut buf).unwrap().is_some() {}
        buf.put_u8(0x02);
        assert_eq!(d.needed(&buf), 8);
        buf.put_slice(&(1u64 << 62).to_be_bytes());
        assert!(d.decode(&mut buf).is_err());
    }

    #[test]
    fn bad_greetings_are_refused_at_the_first_wrong_byte() {
        let (_, err) = decode_all(b"G", 100);
        assert!(matches!(err, Some(TransportError::MalformedFrame(_))));
        let mut v1 = greeting();
        v1[9] = 0x7e;
        assert!(decode_all(&v1[..10], 100).1.is_some());
        let mut v2 = greeting();
        v2[10] = 1;
        assert!(matches!(
            decode_all(&v2[..11], 100).1,
            Some(TransportError::UnsupportedVersion { got: 1, .. })
        ));
        let mut curve = greeting();
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(decode_all(&curve, 100).1.is_some());
        // A prefix of a good greeting waits for more.
        assert!(decode_all(&greeting()[..63], 100).1.is_none());
    }

    #[test]
    fn malformed_frames_are_refused() {
        let g = libzmq_greeting(1);
        let cases: &[&[u8]] = &[
            // A reserved flag bit.
            &[0x08, 0],
            // A command with MORE.
            &[0x05, 1, 0],
            // A command inside a multipart message.
            &[0x01, 0, 0x04, 1, 0],
            // A command name running past its frame.
            &[0x04, 3, 9, b'R', b'E'],
            // READY without a Socket-Type.
            &[0x04, 6, 5, b'R', b'E', b'A', b'D', b'Y'],
            // A property value length past the frame.
            &[0x04, 11, 5, b'R', b'E', b'A', b'D', b'Y', 1, b'X', 0, 0, 0],
            // PING without its TTL.
            &[0x04, 6, 4, b'P', b'I', b'N', b'G', 0],
        ];
        for (i, c) in cases.iter().enumerate() {
            let mut x = g.clone();
            x.extend_from_slice(c);
            let (_, err) = decode_all(&x, 100);
            assert!(
                matches!(err, Some(TransportError::MalformedFrame(_))),
                "case {i}: {err:?}"
            );
        }
        // Too many frames.
        let mut x = g.clone();
        for _ in 0..MAX_PARTS {
            x.extend_from_slice(&[0x01, 0]);
        }
        assert!(decode_all(&x, 100).1.is_some());
        // Unknown commands are not errors (they are skipped after the handshake).
        let mut x = g;
        x.extend_from_slice(&[0x04, 4, 3, b'F', b'O', b'O']);
        assert_eq!(
            decode_all(&x, 100).0.last(),
            Some(&Decoded::Command(Command::Unknown(Bytes::from_static(
                b"FOO"
            ))))
        );
    }

    #[test]
    fn eof_is_a_close_between_messages_and_truncation_inside_one() {
        let mut d = Decoder::new(100);
        assert!(matches!(d.at_eof(0), TransportError::Io { .. }));
        assert!(matches!(d.at_eof(20), TransportError::MalformedFrame(_)));
        let mut buf = BytesMut::from(&libzmq_greeting(1)[..]);
        d.decode(&mut buf).unwrap();
        assert!(matches!(d.at_eof(0), TransportError::Io { .. }));
        buf.put_slice(&[0x01, 1, b'a']);
        assert!(d.decode(&mut buf).unwrap().is_none());
        assert!(matches!(d.at_eof(0), TransportError::MalformedFrame(_)));
    }

    #[test]
    fn socket_types_pair_as_the_rfc_says() {
        use SocketType::*;
        assert!(Sub.accepts(Pub) && Sub.accepts(XPub) && !Sub.accepts(Sub));
        assert!(Pub.accepts(Sub) && Pub.accepts(XSub) && !Pub.accepts(Dealer));
        assert!(Dealer.accepts(Router) && !Dealer.accepts(Pub));
        assert!(Router.accepts(Dealer) && Router.accepts(Req) && !Router.accepts(Sub));
        for t in SocketType::ALL {
            assert_eq!(SocketType::from_wire(t.as_str().as_bytes()), Some(t));
        }
    }
}
