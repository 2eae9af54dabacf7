//! KV events as JSON (`POST /v1/events`, `kvengine publish`): decoding and conversion to
//! the engine's [`KvEvent`]s. Pure: no I/O, no counters, no clock.
//!
//! ```json
//! {"worker_id": 7, "dp_rank": 0, "seq": 12, "events": [
//!   {"type": "stored", "parent_hash": null, "lora_name": null,
//!    "blocks": [{"block_hash": 11, "token_ids": [1, 2, 3, 4]}]},
//!   {"type": "removed", "block_hashes": [11]},
//!   {"type": "cleared"}
//! ]}
//! ```
//!
//! # Invariants
//! 1. [`parse_events_body`] never panics; every refusal is [`TransportError::MalformedJson`]
//!    carrying serde's message (with line and column).
//! 2. [`to_engine`] accepts a stored event only if every block carries exactly `block_size`
//!    token ids; block `i` then gets engine hash `block_hash` and tokens hash
//!    `tokens_hash(token_ids, lora_seed(lora_name))` (DESIGN.md "Vocabulary").
//! 3. Unknown object keys are ignored (forward compatibility); unknown event types are not.

use crate::error::TransportError;
use engine::EngineHash;
use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, tokens_hash};
use serde::{Deserialize, Serialize};

/// The body of `POST /v1/events`: one batch of one worker rank.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct EventsBody {
    /// The (registered) worker.
    pub worker_id: u64,
    /// Its data-parallel rank (absent: 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// The batch's sequence number, for fencing (absent: not fenced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// The events, in order.
    pub events: Vec<JsonEvent>,
}

/// One KV event, tagged by `"type"`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum JsonEvent {
    /// A chain of blocks was stored under `parent_hash` (null: the chain starts a sequence).
    Stored {
        /// The worker's hash of the block before `blocks[0]`.
        #[serde(default)]
        parent_hash: Option<u64>,
        /// The blocks, in sequence order.
        blocks: Vec<JsonBlock>,
        /// The LoRA adapter the blocks belong to (selects the hash seed); null: base model.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lora_name: Option<String>,
    },
    /// One copy of each listed block was evicted.
    Removed {
        /// The worker's hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The rank's whole cache was emptied.
    Cleared,
}

/// One stored block.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct JsonBlock {
    /// The worker's own id for the block (signed engines send the bit pattern as u64).
    pub block_hash: u64,
    /// The block's token ids: exactly `block_size` of them.
    pub token_ids: Vec<u32>,
}

/// Decodes a `POST /v1/events` body.
pub fn parse_events_body(bytes: &[u8]) -> Result<EventsBody, TransportError> {
    serde_json::from_slice(bytes).map_err(|e| TransportError::MalformedJson(e.to_string()))
}

/// Converts one JSON event for a router with `block_size` tokens per block.
///
/// Errors: [`TransportError::TokenCountMismatch`] when a stored block does not carry exactly
/// `block_size` token ids (the whole event is refused), [`TransportError::Invalid`] when
/// `block_size` is 0.
pub fn to_engine(event: &JsonEvent, block_size: u32) -> Result<KvEvent, TransportError> {
    match event {
        JsonEvent::Stored {
            parent_hash,
            blocks,
            lora_name,
        } => {
            if block_size == 0 {
                return Err(TransportError::Invalid {
                    name: "block_size",
                    reason: "must be positive".into(),
                });
            }
            let bs = block_size as usize;
            if blocks.iter().any(|b| b.token_ids.len() != bs) {
                return Err(TransportError::TokenCountMismatch {
                    tokens: blocks.iter().map(|b| b.token_ids.len()).sum(),
                    blocks: blocks.len(),
                    block_size,
                });
            }
            let seed = lora_seed(lora_name.as_deref());
            Ok(KvEvent::Stored {
                parent: parent_hash.map(EngineHash),
                blocks: blocks
                    .iter()
                    .map(|b| StoredBlock {
                        engine_hash: EngineHash(b.block_hash),
                        tokens_hash: tokens_hash(&b.token_ids, seed),
                    })
                    .collect(),
            })
        }
        JsonEvent::Removed { block_hashes } => Ok(KvEvent::Removed {
            blocks: block_hashes.iter().copied().map(EngineHash).collect(),
        }),
        JsonEvent::Cleared => Ok(KvEvent::Cleared),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::TokensHash;

    #[test]
    fn parses_every_event_type() {
        let body = br#"{"worker_id": 7, "seq": 3, "events": [
            {"type": "stored", "parent_hash": null,
             "blocks": [{"block_hash": 11, "token_ids": [1, 2, 3, 4]}]},
            {"type": "stored", "parent_hash": 11, "lora_name": "a",
             "blocks": [{"block_hash": 12, "token_ids": [5, 6, 7, 8]}], "extra": 1},
            {"type": "removed", "block_hashes": [11, 18446744073709551615]},
            {"type": "cleared"}]}"#;
        let b = parse_events_body(body).unwrap();
        assert_eq!((b.worker_id, b.dp_rank, b.seq), (7, None, Some(3)));
        assert_eq!(b.events.len(), 4);
        let e = to_engine(&b.events[0], 4).unwrap();
        // DESIGN.md reference vector.
        assert_eq!(
            e,
            KvEvent::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    engine_hash: EngineHash(11),
                    tokens_hash: TokensHash(14643705804678351452),
                }],
            }
        );
        let KvEvent::Stored { parent, blocks } = to_engine(&b.events[1], 4).unwrap() else {
            panic!("not a store")
        };
        assert_eq!(parent, Some(EngineHash(11)));
        assert_eq!(
            blocks[0].tokens_hash,
            tokens_hash(&[5, 6, 7, 8], lora_seed(Some("a")))
        );
        assert_eq!(
            to_engine(&b.events[2], 4).unwrap(),
            KvEvent::Removed {
                blocks: vec![EngineHash(11), EngineHash(u64::MAX)]
            }
        );
        assert_eq!(to_engine(&b.events[3], 4).unwrap(), KvEvent::Cleared);
    }

    #[test]
    fn token_count_must_be_one_block() {
        let e = JsonEvent::Stored {
            parent_hash: None,
            blocks: vec![
                JsonBlock {
                    block_hash: 1,
                    token_ids: vec![1, 2, 3, 4],
                },
                JsonBlock {
                    block_hash: 2,
                    token_ids: vec![1, 2, 3],
                },
            ],
            lora_name: None,
        };
        assert!(matches!(
            to_engine(&e, 4),
            Err(TransportError::TokenCountMismatch {
                tokens: 7,
                blocks: 2,
                block_size: 4
            })
        ));
        assert!(to_engine(&e, 0).is_err());
    }

    #[test]
    fn bad_bodies_are_malformed_json() {
        for body in [
            &b""[..],
            b"{",
            b"[]",
            br#"{"worker_id": -1, "events": []}"#,
            br#"{"worker_id": 1}"#,
            br#"{"worker_id": 1, "events": [{"type": "moved"}]}"#,
            br#"{"worker_id": 1, "events": [{"type": "removed", "block_hashes": [1.5]}]}"#,
            br#"{"worker_id": 1, "events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [4294967296]}]}]}"#,
        ] {
            assert!(
                matches!(
                    parse_events_body(body),
                    Err(TransportError::MalformedJson(_))
                ),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn round_trips_through_serde() {
        let b = EventsBody {
            worker_id: 1,
            dp_rank: Some(2),
            seq: None,
            events: vec![
                JsonEvent::Cleared,
                JsonEvent::Removed {
                    block_hashes: vec![3],
                },
            ],
        };
        let text = serde_json::to_vec(&b).unwrap();
        assert_eq!(parse_events_body(&text).unwrap(), b);
    }
}
