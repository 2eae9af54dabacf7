//! The positional msgpack decoder for vLLM / SGLang KV-event batches: the batch, its
//! events and their fields, read with [`super::cursor`]'s primitives. Nothing is copied
//! except the values kept (hashes, token ids, the short strings). See [`crate::kv_events`]
//! for the wire shapes and the invariants.

use super::cursor::{Bad, Cursor, R};
use super::{
    MAX_BATCH_BYTES, MAX_HASH_BIN_BYTES, WireBatch, WireEvent, WireExtraItem, WireExtraKeys,
};
use crate::error::WireError;
use rmp::Marker;

/// Decodes one msgpack KV-event batch.
///
/// # Errors
/// [`WireError::Oversized`] when `bytes` is longer than [`MAX_BATCH_BYTES`];
/// [`WireError::MalformedMsgpack`] when the bytes are not a well-formed batch (truncated,
/// wrong types, out-of-range integers, a known event missing a required field). Unknown event
/// types are not errors: they are skipped and counted in [`WireBatch::unknown_events`].
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch, WireError> {
    if bytes.len() > MAX_BATCH_BYTES {
        return Err(WireError::Oversized {
            what: "msgpack KV-event batch",
            got: bytes.len(),
            limit: MAX_BATCH_BYTES,
        });
    }
    let mut cur = Cursor { buf: bytes, pos: 0 };
    cur.batch()
        .map_err(|Bad { what, pos }| WireError::MalformedMsgpack { what, at: pos })
}

/// Event type tags.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// The fields of a stored or removed event, filled in as they are found.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    medium: Option<String>,
    extra_keys: Option<WireExtraKeys>,
}

impl<'a> Cursor<'a> {
    fn batch(&mut self) -> R<WireBatch> {
        let m = self.marker()?;
        if let Some(n) = self.array_len_after(m)? {
            if n < 2 {
                return self.bad("batch array has fewer than 2 elements");
            }
            let ts = self.ts()?;
            let (events, unknown_events) = self.events()?;
            let dp_rank = if n >= 3 { self.dp_rank()? } else { None };
            for _ in 3..n {
                self.skip_value()?;
            }
            self.end()?;
            return Ok(WireBatch {
                ts,
                dp_rank,
                events,
                unknown_events,
            });
        }
        if let Some(n) = self.map_len_after(m)? {
            let mut batch = WireBatch::default();
            let mut saw_events = false;
            for _ in 0..n {
                let km = self.marker()?;
                let key = self.str_after(km)?;
                match key {
                    Some(b"ts") => batch.ts = self.ts()?,
                    Some(b"events") => {
                        (batch.events, batch.unknown_events) = self.events()?;
                        saw_events = true;
                    }
                    Some(b"data_parallel_rank" | b"dp_rank") => batch.dp_rank = self.dp_rank()?,
                    Some(_) => self.skip_value()?,
                    None => {
                        // A non-string key: unknown. Skip the rest of the key, then its value.
                        self.pos -= 1;
                        self.skip_value()?;
                        self.skip_value()?;
                    }
                }
            }
            if !saw_events {
                return self.bad("batch map has no \"events\"");
            }
            self.end()?;
            return Ok(batch);
        }
        self.bad("batch is neither an array nor a map")
    }

    fn end(&self) -> R<()> {
        if self.remaining() != 0 {
            return self.bad("trailing bytes after the batch");
        }
        Ok(())
    }

    fn ts(&mut self) -> R<Option<f64>> {
        let m = self.marker()?;
        match m {
            Marker::Null => Ok(None),
            Marker::F64 => Ok(Some(f64::from_bits(self.be_u64()?))),
            Marker::F32 => Ok(Some(f64::from(f32::from_bits(self.be_u32()?)))),
            _ => match self.int_after(m)? {
                Some(v) => Ok(Some(v as f64)),
                None => self.bad("timestamp is not a number"),
            },
        }
    }

    fn dp_rank(&mut self) -> R<Option<u32>> {
        let m = self.marker()?;
        if let Marker::Null = m {
            return Ok(None);
        }
        match self.int_after(m)? {
            Some(v) => match u32::try_from(v) {
                Ok(v) => Ok(Some(v)),
                Err(_) => self.bad("dp rank out of range"),
            },
            None => self.bad("dp rank is not an integer"),
        }
    }

    fn events(&mut self) -> R<(Vec<WireEvent>, u32)> {
        let m = self.marker()?;
        let Some(n) = self.array_len_after(m)? else {
            return self.bad("events is not an array");
        };
        // The smallest event kept is 15 bytes; bound the up-front capacity by that.
        let mut events = Vec::with_capacity(n.min(self.remaining() / 15));
        let mut unknown: u32 = 0;
        for _ in 0..n {
            match self.event()? {
                Some(e) => events.push(e),
                None => unknown = unknown.saturating_add(1),
            }
        }
        Ok((events, unknown))
    }

    /// One event; `None` for an unknown type (skipped).
    fn event(&mut self) -> R<Option<WireEvent>> {
        let start = self.pos;
        let m = self.marker()?;
        if let Some(n) = self.array_len_after(m)? {
            return self.positional_event(n);
        }
        if let Some(n) = self.map_len_after(m)? {
            return self.map_event(start, n);
        }
        self.bad("event is neither an array nor a map")
    }

    fn positional_event(&mut self, n: usize) -> R<Option<WireEvent>> {
        if n == 0 {
            return self.bad("empty event array");
        }
        let m = self.marker()?;
        let Some(tag) = self.str_after(m)? else {
            return self.bad("event tag is not a string");
        };
        let tag = tag_of(tag);
        let mut f = Fields::default();
        let mut i = 1;
        // Fields by position; `i` counts the elements consumed so far.
        match tag {
            Tag::Stored => {
                if n < 4 {
                    return self.bad("BlockStored has fewer than 4 elements");
                }
                f.block_hashes = Some(self.hashes()?);
                f.parent = self.opt_hash()?;
                f.token_ids = Some(self.tokens()?);
                i = 4;
                if i < n {
                    f.block_size = self.opt_u32("block_size")?;
                    i += 1;
                }
                if i < n {
                    f.lora_id = self.opt_i64("lora_id")?;
                    i += 1;
                }
                if i < n {
                    f.medium = self.opt_string("medium")?;
                    i += 1;
                }
                if i < n {
                    f.lora_name = self.opt_string("lora_name")?;
                    i += 1;
                }
                if i < n {
                    f.extra_keys = self.extra_keys()?;
                    i += 1;
                }
            }
            Tag::Removed => {
                if n < 2 {
                    return self.bad("BlockRemoved has no block_hashes");
                }
                f.block_hashes = Some(self.hashes()?);
                i = 2;
                if i < n {
                    f.medium = self.opt_string("medium")?;
                    i += 1;
                }
            }
            Tag::Cleared | Tag::Unknown => {}
        }
        for _ in i..n {
            self.skip_value()?;
        }
        self.finish(tag, f)
    }

    fn map_event(&mut self, start: usize, n: usize) -> R<Option<WireEvent>> {
        if n == 0 {
            return self.bad("event map has no \"type\"");
        }
        let body = self.pos;
        // Fast path: the tag is the first key (msgspec writes it first). Otherwise find it
        // first, then come back and read the fields knowing the type.
        let tag = match self.map_key()? {
            Some(b"type") => self.tag_value()?,
            _ => {
                self.pos = body;
                let mut tag = None;
                for _ in 0..n {
                    if let Some(b"type") = self.map_key()? {
                        tag = Some(self.tag_value()?);
                    } else {
                        self.skip_value()?;
                    }
                }
                let Some(tag) = tag else {
                    self.pos = start;
                    return self.bad("event map has no \"type\"");
                };
                self.pos = body;
                tag
            }
        };
        if matches!(tag, Tag::Cleared | Tag::Unknown) {
            // Skip the whole map (start over from its marker).
            self.pos = start;
            self.skip_value()?;
            return self.finish(tag, Fields::default());
        }
        self.pos = body;
        let mut f = Fields::default();
        for _ in 0..n {
            let key = self.map_key()?;
            match (tag, key) {
                (_, Some(b"block_hashes")) => f.block_hashes = Some(self.hashes()?),
                (_, Some(b"medium")) => f.medium = self.opt_string("medium")?,
                (Tag::Stored, Some(b"parent_block_hash")) => f.parent = self.opt_hash()?,
                (Tag::Stored, Some(b"token_ids")) => f.token_ids = Some(self.tokens()?),
                (Tag::Stored, Some(b"block_size")) => f.block_size = self.opt_u32("block_size")?,
                (Tag::Stored, Some(b"lora_id")) => f.lora_id = self.opt_i64("lora_id")?,
                (Tag::Stored, Some(b"lora_name")) => f.lora_name = self.opt_string("lora_name")?,
                (Tag::Stored, Some(b"extra_keys")) => f.extra_keys = self.extra_keys()?,
                _ => self.skip_value()?,
            }
        }
        self.finish(tag, f)
    }

    /// A map key: `Some(bytes)` for a string key (its value is next); `None` after skipping a
    /// non-string key (its value is next).
    fn map_key(&mut self) -> R<Option<&'a [u8]>> {
        let m = self.marker()?;
        match self.str_after(m)? {
            Some(s) => Ok(Some(s)),
            None => {
                self.pos -= 1;
                self.skip_value()?;
                Ok(None)
            }
        }
    }

    fn tag_value(&mut self) -> R<Tag> {
        let m = self.marker()?;
        match self.str_after(m)? {
            Some(s) => Ok(tag_of(s)),
            None => self.bad("event \"type\" is not a string"),
        }
    }

    fn finish(&self, tag: Tag, f: Fields) -> R<Option<WireEvent>> {
        Ok(Some(match tag {
            Tag::Unknown => return Ok(None),
            Tag::Cleared => WireEvent::Cleared,
            Tag::Removed => WireEvent::Removed {
                block_hashes: match f.block_hashes {
                    Some(h) => h,
                    None => return self.bad("BlockRemoved has no block_hashes"),
                },
                medium: f.medium,
            },
            Tag::Stored => {
                let (Some(block_hashes), Some(token_ids)) = (f.block_hashes, f.token_ids) else {
                    return self.bad("BlockStored lacks block_hashes or token_ids");
                };
                WireEvent::Stored {
                    block_hashes,
                    parent: f.parent,
                    token_ids,
                    block_size: f.block_size,
                    lora_id: f.lora_id,
                    lora_name: f.lora_name,
                    medium: f.medium,
                    extra_keys: f.extra_keys,
                }
            }
        }))
    }

    /// A block hash: an integer (signed ones bit-cast) or a bin of 1..=32 bytes whose last
    /// `min(8, len)` bytes are read big-endian.
    #[inline]
    fn hash_after(&mut self, m: Marker) -> R<u64> {
        match m {
            Marker::U64 => return self.be_u64(),
            Marker::I64 => return self.be_u64(),
            _ => {}
        }
        if let Some(v) = self.int_after(m)? {
            // Every value here fits i64 (u64 was handled above).
            return Ok(v as i64 as u64);
        }
        match self.bin_after(m)? {
            Some(b) if !b.is_empty() && b.len() <= MAX_HASH_BIN_BYTES => {
                let tail = b.get(b.len().saturating_sub(8)..).unwrap_or(b);
                Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
            }
            Some(_) => self.bad("block hash bin is not 1..=32 bytes"),
            None => self.bad("block hash is neither an integer nor bin"),
        }
    }

    fn opt_hash(&mut self) -> R<Option<u64>> {
        let m = self.marker()?;
        if let Marker::Null = m {
            return Ok(None);
        }
        self.hash_after(m).map(Some)
    }

    fn hashes(&mut self) -> R<Vec<u64>> {
        let m = self.marker()?;
        let Some(n) = self.array_len_after(m)? else {
            return self.bad("block_hashes is not an array");
        };
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let m = self.marker()?;
            out.push(self.hash_after(m)?);
        }
        Ok(out)
    }

    /// Token ids: the hot loop. Fast paths for the unsigned markers vLLM writes.
    fn tokens(&mut self) -> R<Vec<u32>> {
        let m = self.marker()?;
        let Some(n) = self.array_len_after(m)? else {
            return self.bad("token_ids is not an array");
        };
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.byte()?;
            let v = match b {
                0x00..=0x7f => u32::from(b),
                0xcc => u32::from(self.be_u8()?),
                0xcd => u32::from(self.be_u16()?),
                0xce => self.be_u32()?,
                _ => match self.int_after(Marker::from_u8(b))? {
                    Some(v) => match u32::try_from(v) {
                        Ok(v) => v,
                        Err(_) => return self.bad("token id out of u32 range"),
                    },
                    None => return self.bad("token id is not an integer"),
                },
            };
            out.push(v);
        }
        Ok(out)
    }

    fn opt_u32(&mut self, what: &'static str) -> R<Option<u32>> {
        let m = self.marker()?;
        if let Marker::Null = m {
            return Ok(None);
        }
        match self.int_after(m)? {
            Some(v) => match u32::try_from(v) {
                Ok(v) => Ok(Some(v)),
                Err(_) => self.bad(what),
            },
            None => self.bad(what),
        }
    }

    fn opt_i64(&mut self, what: &'static str) -> R<Option<i64>> {
        let m = self.marker()?;
        if let Marker::Null = m {
            return Ok(None);
        }
        match self.int_after(m)? {
            Some(v) => match i64::try_from(v) {
                Ok(v) => Ok(Some(v)),
                Err(_) => self.bad(what),
            },
            None => self.bad(what),
        }
    }

    /// `extra_keys`: nil (`None`), the per-block list, or [`WireExtraKeys::Malformed`] for
    /// any other well-formed value. Only bytes that are not msgpack at all are an error.
    fn extra_keys(&mut self) -> R<Option<WireExtraKeys>> {
        if self.eat_nil()? {
            return Ok(None);
        }
        let start = self.pos;
        match self.extra_key_blocks() {
            Ok(blocks) => Ok(Some(WireExtraKeys::Blocks(blocks))),
            Err(_) => {
                // Not the expected shape (or not msgpack): skip the value whole from its
                // start; if even that fails the bytes are malformed.
                self.pos = start;
                self.skip_value()?;
                Ok(Some(WireExtraKeys::Malformed))
            }
        }
    }

    fn extra_key_blocks(&mut self) -> R<Vec<Option<Vec<WireExtraItem>>>> {
        let m = self.marker()?;
        let Some(n) = self.array_len_after(m)? else {
            return self.bad("extra_keys is not an array");
        };
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            if self.eat_nil()? {
                out.push(None);
                continue;
            }
            let m = self.marker()?;
            let Some(k) = self.array_len_after(m)? else {
                return self.bad("extra_keys entry is neither nil nor an array");
            };
            let mut items = Vec::with_capacity(k);
            for _ in 0..k {
                items.push(self.extra_item()?);
            }
            out.push(Some(items));
        }
        Ok(out)
    }

    fn extra_item(&mut self) -> R<WireExtraItem> {
        let m = self.marker()?;
        if let Some(s) = self.str_after(m)? {
            return match std::str::from_utf8(s) {
                Ok(s) => Ok(WireExtraItem::Str(s.to_owned())),
                Err(_) => self.bad("extra key string is not UTF-8"),
            };
        }
        if let Some(b) = self.bin_after(m)? {
            return Ok(WireExtraItem::Bin(b.to_vec()));
        }
        match self.array_len_after(m)? {
            Some(2) => {}
            _ => return self.bad("extra key is not a string, bin or (identifier, offset)"),
        }
        let m = self.marker()?;
        let id = match self.str_after(m)? {
            Some(s) => match std::str::from_utf8(s) {
                Ok(s) => s.to_owned(),
                Err(_) => return self.bad("multimodal identifier is not UTF-8"),
            },
            None => return self.bad("multimodal identifier is not a string"),
        };
        let m = self.marker()?;
        match self.int_after(m)?.map(i64::try_from) {
            Some(Ok(offset)) => Ok(WireExtraItem::Mm(id, offset)),
            _ => self.bad("multimodal offset is not an i64"),
        }
    }

    fn opt_string(&mut self, what: &'static str) -> R<Option<String>> {
        if self.eat_nil()? {
            return Ok(None);
        }
        let m = self.marker()?;
        match self.str_after(m)? {
            Some(s) => match std::str::from_utf8(s) {
                Ok(s) => Ok(Some(s.to_owned())),
                Err(_) => self.bad(what),
            },
            None => self.bad(what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bin_hash_folds_last_eight_bytes() {
        let mut v = vec![0xc4, 10];
        v.extend_from_slice(&[0xff, 0xee, 1, 2, 3, 4, 5, 6, 7, 8]);
        let mut c = Cursor { buf: &v, pos: 0 };
        let m = c.marker().unwrap();
        assert_eq!(c.hash_after(m).unwrap(), 0x0102030405060708);
        let v = [0xc4, 2, 0x01, 0x02];
        let mut c = Cursor { buf: &v, pos: 0 };
        let m = c.marker().unwrap();
        assert_eq!(c.hash_after(m).unwrap(), 0x0102);
    }
}
