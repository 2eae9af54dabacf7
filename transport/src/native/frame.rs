//! Framing: a little-endian u32 length, then that many bytes of an rkyv archive.
//!
//! Pure functions, no I/O: the server and the publisher read and write the bytes, these
//! encode and validate them. [`decode_client_frame`] is what the fuzz target drives.
//!
//! # Invariants
//! 1. A frame body is validated with bytecheck before anything reads it; invalid bytes give
//!    [`TransportError::MalformedFrame`], never a panic.
//! 2. Archives are read from [`FrameBuf`]s (16-byte aligned), so access is zero-copy.

use super::schema::{
    ArchivedClientFrame, ArchivedEventBatch, ArchivedServerFrame, ClientFrame, ClientFrameRef,
    EventBatchRef, NativeEvent, ServerFrame,
};
use crate::error::{Result, TransportError};
use engine::event::KvEvent;
use rkyv::rancor;

/// The largest frame body a peer may declare (16 MiB); a larger one closes the connection.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// The largest hello a server reads before the publisher is authenticated (64 KiB).
pub const MAX_HELLO_BYTES: usize = 64 << 10;

/// Bytes of the length prefix.
pub const LEN_BYTES: usize = 4;

/// The buffer frames are read into and written from: aligned for in-place access.
pub type FrameBuf = rkyv::util::AlignedVec<16>;

fn malformed(e: impl std::fmt::Display) -> TransportError {
    TransportError::MalformedFrame(format!("native frame: {e}"))
}

/// The length prefix of a frame body of `len` bytes, refusing bodies over `max`.
pub fn length_prefix(len: usize, max: usize) -> Result<[u8; LEN_BYTES]> {
    if len > max {
        return Err(TransportError::Oversized {
            what: "frame",
            got: len,
            limit: max,
        });
    }
    let n = u32::try_from(len).map_err(|_| TransportError::Oversized {
        what: "frame",
        got: len,
        limit: max,
    })?;
    Ok(n.to_le_bytes())
}

/// Validates `body` as a client frame and returns it in place. `body` must start 16-byte
/// aligned (a [`FrameBuf`]); a misaligned slice is refused, never read.
pub fn access_client_frame(body: &[u8]) -> Result<&ArchivedClientFrame> {
    rkyv::access::<ArchivedClientFrame, rancor::Error>(body).map_err(malformed)
}

/// Validates `body` as a server frame and returns it in place (alignment as above).
pub fn access_server_frame(body: &[u8]) -> Result<&ArchivedServerFrame> {
    rkyv::access::<ArchivedServerFrame, rancor::Error>(body).map_err(malformed)
}

/// Copies `bytes` into an aligned buffer, validates them as a client frame and
/// deserializes it (tests and the fuzz target; the server reads frames in place).
pub fn decode_client_frame(bytes: &[u8]) -> Result<ClientFrame> {
    let mut buf = FrameBuf::with_capacity(bytes.len());
    buf.extend_from_slice(bytes);
    let archived = access_client_frame(&buf)?;
    rkyv::deserialize::<ClientFrame, rancor::Error>(archived).map_err(malformed)
}

/// Validates and deserializes a server frame body (small frames; the publisher's side).
pub fn decode_server_frame(body: &[u8]) -> Result<ServerFrame> {
    let archived = access_server_frame(body)?;
    rkyv::deserialize::<ServerFrame, rancor::Error>(archived).map_err(malformed)
}

/// Serializes `frame` into `out` (cleared first).
pub fn encode_client_frame(frame: &ClientFrame, out: &mut FrameBuf) -> Result<()> {
    out.clear();
    rkyv::api::high::to_bytes_in::<_, rancor::Error>(frame, &mut *out).map_err(malformed)?;
    Ok(())
}

/// Serializes the batch frame `(worker_id, dp_rank, seq, events)` into `out` (cleared
/// first), straight from the borrowed events.
pub fn encode_batch(
    worker_id: u64,
    dp_rank: u32,
    seq: u64,
    events: &[NativeEvent],
    out: &mut FrameBuf,
) -> Result<()> {
    out.clear();
    let frame = ClientFrameRef::Batch(EventBatchRef {
        worker_id,
        dp_rank,
        seq,
        events,
    });
    rkyv::api::high::to_bytes_in::<_, rancor::Error>(&frame, &mut *out).map_err(malformed)?;
    Ok(())
}

/// Serializes `frame` into `out` (cleared first).
pub fn encode_server_frame(frame: &ServerFrame, out: &mut FrameBuf) -> Result<()> {
    out.clear();
    rkyv::api::high::to_bytes_in::<_, rancor::Error>(frame, &mut *out).map_err(malformed)?;
    Ok(())
}

/// Converts a batch's events to engine events (appended to `out`), hashing `StoredTokens`
/// with `block_size`. An event that cannot be converted is skipped and passed to
/// `dropped`; the others still convert.
pub fn batch_events(
    batch: &ArchivedEventBatch,
    block_size: u32,
    out: &mut Vec<KvEvent>,
    mut dropped: impl FnMut(TransportError),
) {
    let mut scratch = Vec::new();
    out.reserve(batch.events.len());
    for ev in batch.events.iter() {
        match ev.to_engine(block_size, &mut scratch) {
            Ok(e) => out.push(e),
            Err(e) => dropped(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::schema::{EventBatch, NativeBlock};

    fn events() -> Vec<NativeEvent> {
        vec![
            NativeEvent::Stored {
                parent: Some(7),
                blocks: vec![
                    NativeBlock {
                        engine_hash: 1,
                        tokens_hash: 2,
                    },
                    NativeBlock {
                        engine_hash: 3,
                        tokens_hash: 4,
                    },
                ],
            },
            NativeEvent::StoredTokens {
                parent: None,
                engine_hashes: vec![9],
                token_ids: vec![1, 2, 3, 4],
                lora_name: Some("ad".into()),
            },
            NativeEvent::Removed { blocks: vec![1, 3] },
            NativeEvent::Cleared,
        ]
    }

    #[test]
    fn borrowed_batches_archive_like_owned_ones() {
        let evs = events();
        let mut a = FrameBuf::new();
        let mut b = FrameBuf::new();
        encode_batch(5, 2, 11, &evs, &mut a).unwrap();
        let owned = ClientFrame::Batch(EventBatch {
            worker_id: 5,
            dp_rank: 2,
            seq: 11,
            events: evs.clone(),
        });
        encode_client_frame(&owned, &mut b).unwrap();
        assert_eq!(a.as_slice(), b.as_slice());
        assert_eq!(decode_client_frame(&a).unwrap(), owned);
        // Empty batches too.
        encode_batch(5, 2, 11, &[], &mut a).unwrap();
        let owned = ClientFrame::Batch(EventBatch {
            worker_id: 5,
            dp_rank: 2,
            seq: 11,
            events: vec![],
        });
        encode_client_frame(&owned, &mut b).unwrap();
        assert_eq!(a.as_slice(), b.as_slice());
    }

    #[test]
    fn hellos_archive_like_their_borrowed_twin() {
        let owned = ClientFrame::Hello {
            version: 1,
            worker_id: 3,
            dp_ranks: vec![0, 1],
            block_size: 16,
            token: "secret".into(),
            instance: 0,
        };
        let borrowed = ClientFrameRef::Hello {
            version: 1,
            worker_id: 3,
            dp_ranks: &[0, 1],
            block_size: 16,
            token: "secret",
            instance: 0,
        };
        let mut a = FrameBuf::new();
        encode_client_frame(&owned, &mut a).unwrap();
        let b = rkyv::to_bytes::<rancor::Error>(&borrowed).unwrap();
        assert_eq!(a.as_slice(), b.as_slice());
    }

    #[test]
    fn stored_tokens_hash_like_the_engine_and_bad_counts_are_dropped() {
        let mut buf = FrameBuf::new();
        encode_batch(1, 0, 0, &events(), &mut buf).unwrap();
        let ArchivedClientFrame::Batch(batch) = access_client_frame(&buf).unwrap() else {
            panic!("not a batch")
        };
        let mut out = Vec::new();
        let mut drops = Vec::new();
        batch_events(batch, 4, &mut out, |e| drops.push(e));
        assert!(drops.is_empty());
        assert_eq!(out.len(), 4);
        let seed = engine::hash::lora_seed(Some("ad"));
        assert_eq!(
            out[1],
            KvEvent::Stored {
                parent: None,
                blocks: vec![engine::event::StoredBlock {
                    engine_hash: engine::EngineHash(9),
                    tokens_hash: engine::hash::tokens_hash(&[1, 2, 3, 4], seed),
                }],
            }
        );
        out.clear();
        batch_events(batch, 3, &mut out, |e| drops.push(e));
        assert_eq!(out.len(), 3);
        assert!(matches!(
            drops.as_slice(),
            [TransportError::TokenCountMismatch {
                tokens: 4,
                blocks: 1,
                block_size: 3
            }]
        ));
    }

    #[test]
    fn garbage_is_refused_not_panicked_on() {
        assert!(decode_client_frame(&[]).is_err());
        assert!(decode_client_frame(&[0xff; 7]).is_err());
        let mut buf = FrameBuf::new();
        encode_batch(1, 0, 0, &events(), &mut buf).unwrap();
        for cut in 0..buf.len() {
            let _ = decode_client_frame(&buf[..cut]);
        }
        assert!(length_prefix(MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES).is_err());
        assert_eq!(length_prefix(5, MAX_FRAME_BYTES).unwrap(), [5, 0, 0, 0]);
    }
}
