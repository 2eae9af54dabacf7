//! What replicas say to each other on NATS (rkyv archives, validated with bytecheck; see
//! `docs/protocol.md`, "Replica sync").
//!
//! Subjects, under the cluster's prefix `P` (`--replica-subject`):
//! * `P.load`: [`Frame`]s: every replica's load events and heartbeats;
//! * `P.resync`: [`Resync`] requests: "send your whole state again";
//! * `P.sessions`: [`SessionFrame`]s: sticky-session assignments (issue 31). A subject of
//!   its own with its own version ([`SESSION_WIRE_VERSION`]), so replicas that predate it
//!   (they do not subscribe) and replicas of another session version (they refuse the
//!   frame, counted) keep sharing load as before.
//!
//! # Invariants
//! 1. Changing any archived layout changes [`WIRE_VERSION`]; a frame of another version is
//!    refused as malformed, never misread.
//! 2. A replica numbers its event frames 1, 2, 3, ... in the order it publishes them; a
//!    heartbeat carries the number of the last event frame published before it (0: none).
//! 3. A [`LoadEvent::Reset`] means: forget every request of this replica; the events after
//!    it (in the same and later frames) rebuild its state.

use crate::error::{Result, TransportError};
use bytes::Bytes;
use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};

/// The version every frame carries (invariant 1).
pub const WIRE_VERSION: u32 = 1;

/// The largest frame a replica publishes: below NATS's default `max_payload` (1 MiB) with
/// room to spare; a whole state is split over several frames.
pub const MAX_FRAME_BYTES: usize = 512 * 1024;

/// One message on `P.load`.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// [`WIRE_VERSION`].
    pub version: u32,
    /// The sending replica ([`engine::ReplicaId`]).
    pub replica: u64,
    /// Event frames: this frame's number; heartbeats: the last event frame's (invariant 2).
    pub seq: u64,
    /// What it carries.
    pub body: Body,
}

/// What a [`Frame`] carries.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// "I am alive": sent every heartbeat interval.
    Heartbeat {
        /// The replica's name, for logs and `/v1/replicas`.
        name: String,
        /// Requests it has active now.
        active: u64,
    },
    /// Load events, in the order the replica saw them.
    Events(Vec<LoadEvent>),
}

/// A change in the load one replica put on the workers.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum LoadEvent {
    /// Forget this replica's requests (invariant 3).
    Reset,
    /// A request was routed.
    Added {
        /// Its name at the replica.
        request: String,
        /// Where: the worker ...
        worker: u64,
        /// ... and its rank.
        dp_rank: u32,
        /// Prompt tokens (what is left to prefill, in a state sent again).
        input_tokens: u64,
        /// Prompt blocks the worker had cached.
        overlap_blocks: u32,
        /// The prompt's full blocks (seq hashes).
        blocks: Vec<u64>,
    },
    /// A request's first token was produced.
    Prefilled {
        /// Its name.
        request: String,
    },
    /// A request finished or was cancelled.
    Freed {
        /// Its name.
        request: String,
    },
}

impl LoadEvent {
    /// Roughly what it adds to a frame, in bytes (to split states under
    /// [`MAX_FRAME_BYTES`]).
    pub fn weight(&self) -> usize {
        match self {
            LoadEvent::Reset => 8,
            LoadEvent::Added {
                request, blocks, ..
            } => 48 + request.len() + 8 * blocks.len(),
            LoadEvent::Prefilled { request } | LoadEvent::Freed { request } => 16 + request.len(),
        }
    }
}

/// The version every [`SessionFrame`] carries (changes with its archived layout).
pub const SESSION_WIRE_VERSION: u32 = 1;

/// The most assignments one [`SessionFrame`] carries (about 64 bytes each plus the model
/// name: well under [`MAX_FRAME_BYTES`]); a receiver refuses a frame with more.
pub const MAX_SESSIONS_PER_FRAME: usize = 2048;

/// One message on `P.sessions`: sessions a replica just routed, so its peers send the
/// session's next requests to the same worker.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SessionFrame {
    /// [`SESSION_WIRE_VERSION`].
    pub version: u32,
    /// The sending replica.
    pub replica: u64,
    /// The assignments, oldest first.
    pub sessions: Vec<SessionAssign>,
}

/// Session `session` (an [`engine::SessionId`]) of `model` was routed to a worker rank.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SessionAssign {
    /// The namespace (`""`: the default one).
    pub model: String,
    /// The session's id.
    pub session: u64,
    /// The worker ...
    pub worker: u64,
    /// ... and its rank.
    pub dp_rank: u32,
}

/// The bytes of `frame`.
pub fn encode_sessions(frame: &SessionFrame) -> Result<Bytes> {
    encode_archive(frame)
}

/// Reads a session frame from a NATS payload (any bytes give a frame or an error, never a
/// panic); another version, or more than [`MAX_SESSIONS_PER_FRAME`] assignments, is an
/// error.
pub fn decode_sessions(payload: &[u8]) -> Result<SessionFrame> {
    let buf = aligned(payload);
    let frame = rkyv::from_bytes::<SessionFrame, rancor::Error>(&buf).map_err(malformed)?;
    if frame.version != SESSION_WIRE_VERSION {
        return Err(malformed(format!(
            "session frame version {} (this router speaks {SESSION_WIRE_VERSION})",
            frame.version
        )));
    }
    if frame.sessions.len() > MAX_SESSIONS_PER_FRAME {
        return Err(malformed(format!(
            "{} session assignments in one frame (at most {MAX_SESSIONS_PER_FRAME})",
            frame.sessions.len()
        )));
    }
    Ok(frame)
}

/// One message on `P.resync`.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resync {
    /// [`WIRE_VERSION`].
    pub version: u32,
    /// Who asks.
    pub from: u64,
    /// Whose state is wanted; 0: everyone's.
    pub target: u64,
}

fn malformed(e: impl std::fmt::Display) -> TransportError {
    TransportError::MalformedFrame(format!("replica frame: {e}"))
}

fn encode_archive<T>(value: &T) -> Result<Bytes>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let bytes = rkyv::to_bytes::<rancor::Error>(value).map_err(malformed)?;
    Ok(Bytes::from(bytes.into_vec()))
}

/// The bytes of `frame`.
pub fn encode_frame(frame: &Frame) -> Result<Bytes> {
    encode_archive(frame)
}

/// The bytes of `resync`.
pub fn encode_resync(resync: &Resync) -> Result<Bytes> {
    encode_archive(resync)
}

/// Copies `payload` into an aligned buffer (NATS hands out unaligned bytes).
fn aligned(payload: &[u8]) -> rkyv::util::AlignedVec<16> {
    let mut buf = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
    buf.extend_from_slice(payload);
    buf
}

/// Reads a frame from a NATS payload: any bytes give a frame or an error, never a panic.
pub fn decode_frame(payload: &[u8]) -> Result<Frame> {
    let buf = aligned(payload);
    let frame = rkyv::from_bytes::<Frame, rancor::Error>(&buf).map_err(malformed)?;
    if frame.version != WIRE_VERSION {
        return Err(malformed(format!(
            "version {} (this router speaks {WIRE_VERSION})",
            frame.version
        )));
    }
    Ok(frame)
}

/// Reads a resync request from a NATS payload (as [`decode_frame`]).
pub fn decode_resync(payload: &[u8]) -> Result<Resync> {
    let buf = aligned(payload);
    let resync = rkyv::from_bytes::<Resync, rancor::Error>(&buf).map_err(malformed)?;
    if resync.version != WIRE_VERSION {
        return Err(malformed(format!("resync version {}", resync.version)));
    }
    Ok(resync)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Frame {
        Frame {
            version: WIRE_VERSION,
            replica: 0xfeed,
            seq: 7,
            body: Body::Events(vec![
                LoadEvent::Reset,
                LoadEvent::Added {
                    request: "r1".into(),
                    worker: 3,
                    dp_rank: 1,
                    input_tokens: 100,
                    overlap_blocks: 2,
                    blocks: vec![11, 12, 13],
                },
                LoadEvent::Prefilled {
                    request: "r1".into(),
                },
                LoadEvent::Freed {
                    request: "r1".into(),
                },
            ]),
        }
    }

    #[test]
    fn frames_and_resyncs_round_trip() {
        let f = sample();
        assert_eq!(decode_frame(&encode_frame(&f).unwrap()).unwrap(), f);
        let hb = Frame {
            body: Body::Heartbeat {
                name: "a".into(),
                active: 4,
            },
            ..f
        };
        assert_eq!(decode_frame(&encode_frame(&hb).unwrap()).unwrap(), hb);
        let r = Resync {
            version: WIRE_VERSION,
            from: 1,
            target: 0,
        };
        assert_eq!(decode_resync(&encode_resync(&r).unwrap()).unwrap(), r);
    }

    #[test]
    fn session_frames_round_trip_and_bad_ones_are_errors() {
        let f = SessionFrame {
            version: SESSION_WIRE_VERSION,
            replica: 9,
            sessions: vec![SessionAssign {
                model: "qwen".into(),
                session: 0xabc,
                worker: 2,
                dp_rank: 1,
            }],
        };
        let bytes = encode_sessions(&f).unwrap();
        assert_eq!(decode_sessions(&bytes).unwrap(), f);
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode_sessions(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let newer = SessionFrame {
            version: SESSION_WIRE_VERSION + 1,
            ..f.clone()
        };
        let e = decode_sessions(&encode_sessions(&newer).unwrap()).unwrap_err();
        assert!(e.to_string().contains("version"), "{e}");
        let huge = SessionFrame {
            sessions: vec![f.sessions[0].clone(); MAX_SESSIONS_PER_FRAME + 1],
            ..f
        };
        assert!(decode_sessions(&encode_sessions(&huge).unwrap()).is_err());
        // A load frame is no session frame.
        assert!(decode_sessions(&encode_frame(&sample()).unwrap()).is_err());
    }

    #[test]
    fn bad_bytes_and_other_versions_are_errors() {
        let bytes = encode_frame(&sample()).unwrap();
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode_frame(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = bytes.to_vec();
        let last = flipped.len() - 1;
        flipped[last] ^= 0xff;
        let _ = decode_frame(&flipped); // any outcome but a panic
        let other = Frame {
            version: WIRE_VERSION + 1,
            ..sample()
        };
        let e = decode_frame(&encode_frame(&other).unwrap()).unwrap_err();
        assert!(e.to_string().contains("version"), "{e}");
        assert!(decode_resync(b"nonsense").is_err());
    }
}
