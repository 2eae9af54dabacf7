//! The positional msgpack decoder for vLLM / SGLang KV-event batches.
//!
//! One pass over the input with a cursor; markers are classified with [`rmp::Marker`] and
//! payloads are read straight from the slice. Nothing is copied except the values kept
//! (hashes, token ids, the two short strings). See the module docs of
//! [`crate::kv_events`] for the wire shapes and the invariants.

use crate::error::TransportError;
use rmp::Marker;

/// The largest batch [`decode_batch`] accepts, in bytes (64 MiB).
pub const MAX_BATCH_BYTES: usize = 64 * 1024 * 1024;

/// The largest binary digest accepted as a block hash, in bytes.
pub const MAX_HASH_BIN_BYTES: usize = 32;

/// A decoded batch: what one publisher message carries, before any router policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WireBatch {
    /// Publisher timestamp (seconds since the epoch), if it sent a number.
    pub ts: Option<f64>,
    /// The data-parallel rank the batch is from, if given (`None` for old publishers).
    pub dp_rank: Option<u32>,
    /// The events with a known type, in order.
    pub events: Vec<WireEvent>,
    /// Events with an unknown type tag: skipped, counted here.
    pub unknown_events: u32,
}

/// One KV event as published, fields as on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    /// `BlockStored`: a chain of full blocks entered the cache.
    Stored {
        /// The worker's ids of the new blocks, in sequence order (folded to u64, see
        /// [`crate::kv_events`]).
        block_hashes: Vec<u64>,
        /// The worker's id of the block before the first one (`None`: a sequence start).
        parent: Option<u64>,
        /// The token ids of all the blocks, concatenated.
        token_ids: Vec<u32>,
        /// The publisher's block size, when it sends one.
        block_size: Option<u32>,
        /// The LoRA adapter's integer id, when not the base model.
        lora_id: Option<i64>,
        /// The LoRA adapter's name, when sent.
        lora_name: Option<String>,
        /// The storage medium (`"GPU"`, `"CPU"`, ...), when sent.
        medium: Option<String>,
        /// vLLM's `extra_keys` (one entry per block of `block_hashes`), when sent and not nil.
        extra_keys: Option<WireExtraKeys>,
    },
    /// `BlockRemoved`: blocks left the cache.
    Removed {
        /// The worker's ids of the evicted blocks.
        block_hashes: Vec<u64>,
        /// The storage medium they left, when sent.
        medium: Option<String>,
    },
    /// `AllBlocksCleared`: the whole cache of this rank was emptied.
    Cleared,
}

/// `BlockStored.extra_keys` as published (vLLM's `to_event_extra_keys`): untagged, one
/// entry per block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireExtraKeys {
    /// One entry per block: `None` (nil) for a block without extra keys, else its items in
    /// order.
    Blocks(Vec<Option<Vec<WireExtraItem>>>),
    /// Well-formed msgpack that is not a list of nil-or-array entries of known items: the
    /// event is dropped at conversion (counted), the rest of the batch still applies.
    Malformed,
}

/// One untagged item of a block's `extra_keys` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireExtraItem {
    /// A bare string: the LoRA name (first, when the event's `lora_name` is set) or the
    /// `cache_salt` (block 0 only).
    Str(String),
    /// A multimodal item: `(identifier, offset)`.
    Mm(String, i64),
    /// A bin: a prompt-embeddings digest (vLLM: SHA-256).
    Bin(Vec<u8>),
}

/// Decodes one msgpack KV-event batch.
///
/// # Errors
/// [`TransportError::Oversized`] when `bytes` is longer than [`MAX_BATCH_BYTES`];
/// [`TransportError::MalformedMsgpack`] when the bytes are not a well-formed batch (truncated,
/// wrong types, out-of-range integers, a known event missing a required field). Unknown event
/// types are not errors: they are skipped and counted in [`WireBatch::unknown_events`].
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch, TransportError> {
    if bytes.len() > MAX_BATCH_BYTES {
        return Err(TransportError::Oversized {
            what: "msgpack KV-event batch",
            got: bytes.len(),
            limit: MAX_BATCH_BYTES,
        });
    }
    let mut cur = Cursor { buf: bytes, pos: 0 };
    cur.batch()
        .map_err(|e| TransportError::MalformedMsgpack(format!("{} at byte {}", e.what, e.pos)))
}

/// Decode failure: what was wrong and where. Formatted once, at the top.
#[derive(Debug)]
struct Bad {
    what: &'static str,
    pos: usize,
}

type R<T> = Result<T, Bad>;

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

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    fn bad<T>(&self, what: &'static str) -> R<T> {
        Err(Bad {
            what,
            pos: self.pos,
        })
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[inline]
    fn byte(&mut self) -> R<u8> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => self.bad("unexpected end of input"),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = match self.pos.checked_add(n) {
            Some(e) => e,
            None => return self.bad("length overflows"),
        };
        match self.buf.get(self.pos..end) {
            Some(s) => {
                self.pos = end;
                Ok(s)
            }
            None => self.bad("unexpected end of input"),
        }
    }

    #[inline]
    fn array_n<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    #[inline]
    fn be_u8(&mut self) -> R<u8> {
        self.byte()
    }
    #[inline]
    fn be_u16(&mut self) -> R<u16> {
        Ok(u16::from_be_bytes(self.array_n()?))
    }
    #[inline]
    fn be_u32(&mut self) -> R<u32> {
        Ok(u32::from_be_bytes(self.array_n()?))
    }
    #[inline]
    fn be_u64(&mut self) -> R<u64> {
        Ok(u64::from_be_bytes(self.array_n()?))
    }

    #[inline]
    fn marker(&mut self) -> R<Marker> {
        Ok(Marker::from_u8(self.byte()?))
    }

    #[inline]
    fn peek_marker(&self) -> R<Marker> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => self.bad("unexpected end of input"),
        }
    }

    /// The integer payload after marker `m`, or `None` if `m` is not an integer marker.
    #[inline]
    fn int_after(&mut self, m: Marker) -> R<Option<i128>> {
        Ok(Some(match m {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be_u8()?),
            Marker::U16 => i128::from(self.be_u16()?),
            Marker::U32 => i128::from(self.be_u32()?),
            Marker::U64 => i128::from(self.be_u64()?),
            Marker::I8 => i128::from(self.be_u8()? as i8),
            Marker::I16 => i128::from(self.be_u16()? as i16),
            Marker::I32 => i128::from(self.be_u32()? as i32),
            Marker::I64 => i128::from(self.be_u64()? as i64),
            _ => return Ok(None),
        }))
    }

    /// Length of an array whose marker is `m`, bounded by the remaining input (every element
    /// takes at least one byte).
    #[inline]
    fn array_len_after(&mut self, m: Marker) -> R<Option<usize>> {
        let n = match m {
            Marker::FixArray(n) => usize::from(n),
            Marker::Array16 => usize::from(self.be_u16()?),
            Marker::Array32 => self.be_u32()? as usize,
            _ => return Ok(None),
        };
        if n > self.remaining() {
            return self.bad("array length exceeds the input");
        }
        Ok(Some(n))
    }

    /// Number of entries of a map whose marker is `m`, bounded by the remaining input.
    #[inline]
    fn map_len_after(&mut self, m: Marker) -> R<Option<usize>> {
        let n = match m {
            Marker::FixMap(n) => usize::from(n),
            Marker::Map16 => usize::from(self.be_u16()?),
            Marker::Map32 => self.be_u32()? as usize,
            _ => return Ok(None),
        };
        if n > self.remaining() / 2 {
            return self.bad("map length exceeds the input");
        }
        Ok(Some(n))
    }

    /// The bytes of a string whose marker is `m`, or `None` if `m` is not a string marker.
    #[inline]
    fn str_after(&mut self, m: Marker) -> R<Option<&'a [u8]>> {
        let n = match m {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => usize::from(self.be_u8()?),
            Marker::Str16 => usize::from(self.be_u16()?),
            Marker::Str32 => self.be_u32()? as usize,
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// The bytes of a bin whose marker is `m`, or `None` if `m` is not a bin marker.
    #[inline]
    fn bin_after(&mut self, m: Marker) -> R<Option<&'a [u8]>> {
        let n = match m {
            Marker::Bin8 => usize::from(self.be_u8()?),
            Marker::Bin16 => usize::from(self.be_u16()?),
            Marker::Bin32 => self.be_u32()? as usize,
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// Skips one value of any type, nested arrays and maps included, without recursion.
    fn skip_value(&mut self) -> R<()> {
        // Values still to skip. Every value takes at least one byte, so a count above the
        // remaining input is malformed: this bounds the loop and rejects lying headers early.
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let m = self.marker()?;
            let n = match m {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => 0,
                Marker::U8 | Marker::I8 => 1,
                Marker::U16 | Marker::I16 => 2,
                Marker::U32 | Marker::I32 | Marker::F32 => 4,
                Marker::U64 | Marker::I64 | Marker::F64 => 8,
                Marker::FixStr(n) => usize::from(n),
                Marker::Str8 | Marker::Bin8 => usize::from(self.be_u8()?),
                Marker::Str16 | Marker::Bin16 => usize::from(self.be_u16()?),
                Marker::Str32 | Marker::Bin32 => self.be_u32()? as usize,
                Marker::FixExt1 => 2,
                Marker::FixExt2 => 3,
                Marker::FixExt4 => 5,
                Marker::FixExt8 => 9,
                Marker::FixExt16 => 17,
                Marker::Ext8 => usize::from(self.be_u8()?) + 1,
                Marker::Ext16 => usize::from(self.be_u16()?) + 1,
                Marker::Ext32 => (self.be_u32()? as usize).saturating_add(1),
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                    let n = self.array_len_after(m)?.unwrap_or(0);
                    pending = pending.saturating_add(n);
                    0
                }
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                    let n = self.map_len_after(m)?.unwrap_or(0);
                    pending = pending.saturating_add(n.saturating_mul(2));
                    0
                }
                Marker::Reserved => return self.bad("reserved marker 0xc1"),
            };
            self.take(n)?;
            if pending > self.remaining() {
                return self.bad("nested length exceeds the input");
            }
        }
        Ok(())
    }

    /// Whether the next value is nil; consumes it if so.
    #[inline]
    fn eat_nil(&mut self) -> R<bool> {
        if let Marker::Null = self.peek_marker()? {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    // ---- typed fields ----

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
    fn skip_handles_deep_nesting_without_recursion() {
        // 1 MiB of nested one-element arrays around a nil.
        let mut v = vec![0x91u8; 1 << 20];
        v.push(0xc0);
        let mut c = Cursor { buf: &v, pos: 0 };
        c.skip_value().unwrap();
        assert_eq!(c.remaining(), 0);
    }

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
