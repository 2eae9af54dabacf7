//! The msgpack writer: batches as vLLM publishes them (see [`crate::kv_events`], "Written
//! shape"). Used by simulated workers, tests and benchmarks; the router only decodes.

use super::{WireBatch, WireEvent, WireExtraItem, WireExtraKeys};

/// Encodes a batch as vLLM does today: `[ts, [event maps], dp_rank]`, each event a map with
/// a `"type"` key; optional fields are omitted when absent.
pub fn encode_batch(batch: &WireBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 96);
    // Writes into a Vec cannot fail; a failed write would only truncate the buffer.
    let _ = write_batch(&mut out, batch);
    out
}

type W = std::result::Result<(), rmp::encode::ValueWriteError>;

fn write_batch(out: &mut Vec<u8>, batch: &WireBatch) -> W {
    use rmp::encode::*;
    write_array_len(out, 3)?;
    match batch.ts {
        Some(ts) => write_f64(out, ts)?,
        None => write_nil(out).map_err(rmp::encode::ValueWriteError::InvalidMarkerWrite)?,
    }
    write_array_len(out, batch.events.len() as u32)?;
    for e in &batch.events {
        write_event(out, e)?;
    }
    write_uint(out, u64::from(batch.dp_rank.unwrap_or(0)))?;
    Ok(())
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> W {
    use rmp::encode::*;
    write_array_len(out, hashes.len() as u32)?;
    for &h in hashes {
        write_uint(out, h)?;
    }
    Ok(())
}

/// `extra_keys` as vLLM publishes it: per block nil or an array of untagged items.
fn write_extra_keys(out: &mut Vec<u8>, blocks: &[Option<Vec<WireExtraItem>>]) -> W {
    use rmp::encode::*;
    write_array_len(out, blocks.len() as u32)?;
    for entry in blocks {
        let Some(items) = entry else {
            write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?;
            continue;
        };
        write_array_len(out, items.len() as u32)?;
        for item in items {
            match item {
                WireExtraItem::Str(s) => write_str(out, s)?,
                WireExtraItem::Mm(id, offset) => {
                    write_array_len(out, 2)?;
                    write_str(out, id)?;
                    write_sint(out, *offset)?;
                }
                WireExtraItem::Bin(b) => write_bin(out, b)?,
            }
        }
    }
    Ok(())
}

fn write_event(out: &mut Vec<u8>, e: &WireEvent) -> W {
    use rmp::encode::*;
    let nil = |out: &mut Vec<u8>| write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite);
    match e {
        WireEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium,
            extra_keys,
        } => {
            // `Malformed` has no wire form of its own: it is left out.
            let extras = match extra_keys {
                Some(WireExtraKeys::Blocks(b)) => Some(b),
                _ => None,
            };
            let fields = 7 + u32::from(lora_name.is_some()) + u32::from(extras.is_some());
            write_map_len(out, fields)?;
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes)?;
            write_str(out, "parent_block_hash")?;
            match parent {
                Some(p) => write_uint(out, *p).map(|_| ())?,
                None => nil(out)?,
            }
            write_str(out, "token_ids")?;
            write_array_len(out, token_ids.len() as u32)?;
            for &t in token_ids {
                write_uint(out, u64::from(t))?;
            }
            write_str(out, "block_size")?;
            write_uint(out, u64::from(block_size.unwrap_or(0)))?;
            write_str(out, "lora_id")?;
            match lora_id {
                Some(id) => write_sint(out, *id).map(|_| ())?,
                None => nil(out)?,
            }
            write_str(out, "medium")?;
            write_str(out, medium.as_deref().unwrap_or("GPU"))?;
            if let Some(name) = lora_name {
                write_str(out, "lora_name")?;
                write_str(out, name)?;
            }
            if let Some(blocks) = extras {
                write_str(out, "extra_keys")?;
                write_extra_keys(out, blocks)?;
            }
        }
        WireEvent::Removed {
            block_hashes,
            medium,
        } => {
            write_map_len(out, 3)?;
            write_str(out, "type")?;
            write_str(out, "BlockRemoved")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes)?;
            write_str(out, "medium")?;
            write_str(out, medium.as_deref().unwrap_or("GPU"))?;
        }
        WireEvent::Cleared => {
            write_map_len(out, 1)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::decode_batch;

    #[test]
    fn encoded_batches_decode_to_themselves() {
        let batch = WireBatch {
            ts: Some(1.5),
            dp_rank: Some(2),
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![u64::MAX, 1],
                    parent: Some(9),
                    token_ids: (0..32).collect(),
                    block_size: Some(16),
                    lora_id: Some(-3),
                    lora_name: Some("adapter".into()),
                    medium: Some("GPU".into()),
                    extra_keys: Some(WireExtraKeys::Blocks(vec![
                        Some(vec![
                            WireExtraItem::Str("adapter".into()),
                            WireExtraItem::Mm("img".into(), -2),
                            WireExtraItem::Str("salt".into()),
                            WireExtraItem::Bin(vec![0, 1, 255]),
                        ]),
                        Some(vec![WireExtraItem::Str("adapter".into())]),
                    ])),
                },
                WireEvent::Stored {
                    block_hashes: vec![5],
                    parent: None,
                    token_ids: vec![70_000; 16],
                    block_size: Some(16),
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    extra_keys: Some(WireExtraKeys::Blocks(vec![None])),
                },
                WireEvent::Removed {
                    block_hashes: vec![1, u64::MAX],
                    medium: Some("GPU".into()),
                },
                WireEvent::Cleared,
            ],
            unknown_events: 0,
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
    }
}
