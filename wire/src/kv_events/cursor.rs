//! The byte cursor under the msgpack decoder: one forward pass over a slice, markers
//! classified with [`rmp::Marker`], payloads read in place, and the generic reads every
//! field needs (integers, lengths bounded by the input left, strings, bins, skipping a value
//! of any type without recursion).
//!
//! # Invariants
//! 1. No read goes past the slice: every read is a checked `get`, and a failure is a
//!    [`Bad`] naming the offset.
//! 2. An array (map) length is refused when it exceeds the bytes left (half of them): every
//!    element takes at least one byte, so a lying header fails before anything is reserved.
//! 3. [`Cursor::skip_value`] keeps a count of values still to skip, not a stack: nesting
//!    depth costs no memory and no recursion.

use rmp::Marker;

/// Decode failure: what was wrong and where. Formatted once, at the top.
#[derive(Debug)]
pub(super) struct Bad {
    pub(super) what: &'static str,
    pub(super) pos: usize,
}

pub(super) type R<T> = Result<T, Bad>;

pub(super) struct Cursor<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    pub(super) fn bad<T>(&self, what: &'static str) -> R<T> {
        Err(Bad {
            what,
            pos: self.pos,
        })
    }

    #[inline]
    pub(super) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[inline]
    pub(super) fn byte(&mut self) -> R<u8> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => self.bad("unexpected end of input"),
        }
    }

    #[inline]
    pub(super) fn take(&mut self, n: usize) -> R<&'a [u8]> {
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
    pub(super) fn array_n<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    #[inline]
    pub(super) fn be_u8(&mut self) -> R<u8> {
        self.byte()
    }
    #[inline]
    pub(super) fn be_u16(&mut self) -> R<u16> {
        Ok(u16::from_be_bytes(self.array_n()?))
    }
    #[inline]
    pub(super) fn be_u32(&mut self) -> R<u32> {
        Ok(u32::from_be_bytes(self.array_n()?))
    }
    #[inline]
    pub(super) fn be_u64(&mut self) -> R<u64> {
        Ok(u64::from_be_bytes(self.array_n()?))
    }

    #[inline]
    pub(super) fn marker(&mut self) -> R<Marker> {
        Ok(Marker::from_u8(self.byte()?))
    }

    #[inline]
    pub(super) fn peek_marker(&self) -> R<Marker> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => self.bad("unexpected end of input"),
        }
    }

    /// The integer payload after marker `m`, or `None` if `m` is not an integer marker.
    #[inline]
    pub(super) fn int_after(&mut self, m: Marker) -> R<Option<i128>> {
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
    pub(super) fn array_len_after(&mut self, m: Marker) -> R<Option<usize>> {
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
    pub(super) fn map_len_after(&mut self, m: Marker) -> R<Option<usize>> {
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
    pub(super) fn str_after(&mut self, m: Marker) -> R<Option<&'a [u8]>> {
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
    pub(super) fn bin_after(&mut self, m: Marker) -> R<Option<&'a [u8]>> {
        let n = match m {
            Marker::Bin8 => usize::from(self.be_u8()?),
            Marker::Bin16 => usize::from(self.be_u16()?),
            Marker::Bin32 => self.be_u32()? as usize,
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// Skips one value of any type, nested arrays and maps included, without recursion.
    pub(super) fn skip_value(&mut self) -> R<()> {
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
    pub(super) fn eat_nil(&mut self) -> R<bool> {
        if let Marker::Null = self.peek_marker()? {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
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
}
