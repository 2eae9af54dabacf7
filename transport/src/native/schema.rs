//! The native protocol's messages (rkyv archives; see `docs/protocol.md`, "Native protocol
//! (QUIC + rkyv)").
//!
//! Every type derives rkyv's `Archive`: the server validates a frame with bytecheck and reads
//! the archived form in place. The `*Ref` twins archive to byte-identical layouts from
//! borrowed data, so a publisher serializes `&[NativeEvent]` without cloning it (a unit
//! test checks the bytes are equal).
//!
//! # Invariants
//! 1. Changing any archived layout changes [`PROTOCOL_VERSION`].
//! 2. `ClientFrameRef` / `EventBatchRef` archive exactly like `ClientFrame` / `EventBatch`.

use engine::event::{KvEvent, StoredBlock};
use engine::{EngineHash, TokensHash};
use rkyv::{Archive, Deserialize, Serialize};

/// The protocol version a hello carries; a server refuses any other. Version 2 added the
/// hello's `instance` (fences that persist across reconnects).
pub const PROTOCOL_VERSION: u32 = 2;

/// The TLS ALPN protocol id.
pub const ALPN: &[u8] = b"kvengine/1";

/// A frame from a publisher to the server.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum ClientFrame {
    /// The first frame of a stream: who is publishing and with what credentials.
    Hello {
        /// [`PROTOCOL_VERSION`] of the publisher.
        version: u32,
        /// The worker this connection publishes for.
        worker_id: u64,
        /// Its data-parallel ranks (empty: rank 0).
        dp_ranks: Vec<u32>,
        /// Tokens per block (must equal the router's).
        block_size: u32,
        /// The ingest token the server was configured with.
        token: String,
        /// The publishing process's identity: drawn at random when it starts and kept
        /// across its reconnects, so the server keeps each rank's fence from one connection
        /// to the next (a gap is then detected across a reconnect, and a new instance is a
        /// restart). 0: none (fences last one connection).
        instance: u64,
    },
    /// A numbered batch of one rank's events.
    Batch(EventBatch),
}

/// A numbered batch of events of one worker rank.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct EventBatch {
    /// Must equal the hello's worker id.
    pub worker_id: u64,
    /// The rank the events belong to.
    pub dp_rank: u32,
    /// Per-rank sequence number: from 0, one more per batch.
    pub seq: u64,
    /// The events, in order.
    pub events: Vec<NativeEvent>,
}

/// One block of a `Stored` event.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct NativeBlock {
    /// The worker's own id for the block.
    pub engine_hash: u64,
    /// `engine::hash::tokens_hash` of the block's tokens.
    pub tokens_hash: u64,
}

/// A change to one rank's KV cache.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum NativeEvent {
    /// A chain of blocks was stored, tokens already hashed by the publisher (fast path).
    Stored {
        /// Engine hash of the block before the first one (`None`: starts a sequence).
        parent: Option<u64>,
        /// The blocks, in sequence order.
        blocks: Vec<NativeBlock>,
    },
    /// A chain of blocks was stored; the server hashes the tokens.
    StoredTokens {
        /// Engine hash of the block before the first one.
        parent: Option<u64>,
        /// The blocks' engine hashes, in order.
        engine_hashes: Vec<u64>,
        /// `engine_hashes.len() * block_size` token ids.
        token_ids: Vec<u32>,
        /// The LoRA adapter (selects the hash seed).
        lora_name: Option<String>,
    },
    /// One copy of each listed block was evicted.
    Removed {
        /// Engine hashes.
        blocks: Vec<u64>,
    },
    /// The rank's whole cache was emptied.
    Cleared,
}

/// A frame from the server to a publisher.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum ServerFrame {
    /// The hello was accepted.
    HelloAck {
        /// The server's [`PROTOCOL_VERSION`].
        version: u32,
        /// The router's block size.
        block_size: u32,
    },
    /// The hello was refused; the server closes the connection.
    Refused {
        /// Why (stable prefixes, see `docs/protocol.md`).
        reason: String,
    },
    /// The publisher finished its side and everything it sent was handed to the index.
    Done {
        /// Batches received and handled.
        batches: u64,
        /// Events handed to the index.
        events: u64,
    },
}

/// Borrowed twin of [`EventBatch`] (same archived bytes).
#[derive(Archive, Serialize, Debug)]
pub(crate) struct EventBatchRef<'a> {
    pub(crate) worker_id: u64,
    pub(crate) dp_rank: u32,
    pub(crate) seq: u64,
    #[rkyv(with = rkyv::with::AsVec)]
    pub(crate) events: &'a [NativeEvent],
}

/// Borrowed twin of [`ClientFrame`] (same archived bytes).
#[derive(Archive, Serialize, Debug)]
#[allow(dead_code)] // `Hello` exists for the layout; hellos are sent from `ClientFrame`.
pub(crate) enum ClientFrameRef<'a> {
    Hello {
        version: u32,
        worker_id: u64,
        #[rkyv(with = rkyv::with::AsVec)]
        dp_ranks: &'a [u32],
        block_size: u32,
        #[rkyv(with = rkyv::with::AsString)]
        token: &'a str,
        instance: u64,
    },
    Batch(EventBatchRef<'a>),
}

impl NativeEvent {
    /// The native form of an engine event.
    pub fn from_engine(event: &KvEvent) -> NativeEvent {
        match event {
            KvEvent::Stored { parent, blocks } => NativeEvent::Stored {
                parent: parent.map(|p| p.0),
                blocks: blocks
                    .iter()
                    .map(|b| NativeBlock {
                        engine_hash: b.engine_hash.0,
                        tokens_hash: b.tokens_hash.0,
                    })
                    .collect(),
            },
            KvEvent::Removed { blocks } => NativeEvent::Removed {
                blocks: blocks.iter().map(|h| h.0).collect(),
            },
            KvEvent::Cleared => NativeEvent::Cleared,
        }
    }

    /// Block events this event carries (stored or removed blocks; 0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match self {
            NativeEvent::Stored { blocks, .. } => blocks.len(),
            NativeEvent::StoredTokens { engine_hashes, .. } => engine_hashes.len(),
            NativeEvent::Removed { blocks } => blocks.len(),
            NativeEvent::Cleared => 0,
        }
    }
}

impl ArchivedNativeEvent {
    /// The engine event this archived event describes, hashing `StoredTokens` blocks of
    /// `block_size` tokens. `scratch` is reused between calls.
    pub fn to_engine(
        &self,
        block_size: u32,
        scratch: &mut Vec<u32>,
    ) -> crate::error::Result<KvEvent> {
        Ok(match self {
            ArchivedNativeEvent::Stored { parent, blocks } => KvEvent::Stored {
                parent: parent.as_ref().map(|p| EngineHash(p.to_native())),
                blocks: blocks
                    .iter()
                    .map(|b| StoredBlock {
                        engine_hash: EngineHash(b.engine_hash.to_native()),
                        tokens_hash: TokensHash(b.tokens_hash.to_native()),
                    })
                    .collect(),
            },
            ArchivedNativeEvent::StoredTokens {
                parent,
                engine_hashes,
                token_ids,
                lora_name,
            } => {
                let bs = block_size as usize;
                let expected = engine_hashes.len().checked_mul(bs);
                if bs == 0 || expected != Some(token_ids.len()) {
                    return Err(crate::error::TransportError::TokenCountMismatch {
                        tokens: token_ids.len(),
                        blocks: engine_hashes.len(),
                        block_size,
                    });
                }
                let seed = engine::hash::lora_seed(lora_name.as_ref().map(|s| s.as_str()));
                let blocks = engine_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(bs))
                    .map(|(h, toks)| {
                        scratch.clear();
                        scratch.extend(toks.iter().map(|t| t.to_native()));
                        StoredBlock {
                            engine_hash: EngineHash(h.to_native()),
                            tokens_hash: engine::hash::tokens_hash(scratch, seed),
                        }
                    })
                    .collect();
                KvEvent::Stored {
                    parent: parent.as_ref().map(|p| EngineHash(p.to_native())),
                    blocks,
                }
            }
            ArchivedNativeEvent::Removed { blocks } => KvEvent::Removed {
                blocks: blocks.iter().map(|h| EngineHash(h.to_native())).collect(),
            },
            ArchivedNativeEvent::Cleared => KvEvent::Cleared,
        })
    }
}
