//! Fast decoding of `/v1/route` and `/v1/overlap` bodies.
//!
//! The `token_ids` array dominates these bodies (an 8,000-token prompt is ~50 KB of
//! digits), so a hand-written scanner reads the top-level object, parses `token_ids`
//! eight bytes at a time (SWAR: find the digit run with a bit trick, convert it with three
//! multiplies) straight into a caller-owned, reused `Vec<u32>`, and leaves the few small
//! fields to `serde_json`. Anything the scanner is not sure about (escaped keys, `-0`,
//! exponents, syntax errors, ...) falls back to a plain serde parse of the whole body, so
//! the accepted language and the error messages are exactly serde's.
//!
//! # Invariants
//! 1. `parse_prompt` returns `Ok` iff `serde_json` accepts the body as a [`PromptFields`]
//!    plus `token_ids: Vec<u32>`, and then returns the same values.
//! 2. Never panics, whatever the bytes.

use crate::error::TransportError;
use serde::de::{DeserializeOwned, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::fmt;

/// The fields of a route or overlap body other than `token_ids`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptFields {
    /// The caller's request id (route only).
    pub request_id: Option<String>,
    /// The LoRA adapter (selects the hash seed).
    pub lora_name: Option<String>,
    /// vLLM's `cache_salt`: folded into block 0's hash (`""` is no salt).
    pub cache_salt: Option<String>,
    /// `kv`, `round-robin`, `random` or `direct` (route only).
    pub mode: Option<String>,
    /// The worker for `direct` mode (route only).
    pub worker_id: Option<u64>,
    /// Overlap weight for this call (route only).
    pub overlap_weight: Option<f64>,
    /// Temperature for this call (route only).
    pub temperature: Option<f64>,
    /// `whole`, `prefill` or `decode`: the workers to choose among (route only).
    pub pool: Option<String>,
    /// The served model whose workers to choose among (see [`engine::router::namespaces`]).
    pub model: Option<String>,
}

/// Decodes a prompt body: its token ids into `tokens` (cleared first), the rest returned.
pub fn parse_prompt(bytes: &[u8], tokens: &mut Vec<u32>) -> Result<PromptFields, TransportError> {
    parse_prompt_capped(bytes, tokens, usize::MAX)
}

/// [`parse_prompt`] refusing prompts of more than `cap` tokens
/// ([`TransportError::PromptTooLong`]). The scanner stops at the first id past the cap, and
/// never reserves room for more than `cap` ids; a body it hands to serde is checked once
/// decoded (serde's buffer is bounded by the body's size).
pub fn parse_prompt_capped(
    bytes: &[u8],
    tokens: &mut Vec<u32>,
    cap: usize,
) -> Result<PromptFields, TransportError> {
    tokens.clear();
    let mut too_long = false;
    if let Some(fields) = fast(bytes, tokens, cap, &mut too_long) {
        return Ok(fields);
    }
    if too_long {
        tokens.clear();
        return Err(TransportError::PromptTooLong { limit: cap });
    }
    let fields = parse_prompt_serde(bytes, tokens)?;
    if tokens.len() > cap {
        tokens.clear();
        return Err(TransportError::PromptTooLong { limit: cap });
    }
    Ok(fields)
}

/// The reference decoder: serde only (what the scanner must agree with).
pub fn parse_prompt_serde(
    bytes: &[u8],
    tokens: &mut Vec<u32>,
) -> Result<PromptFields, TransportError> {
    let slow: SlowPrompt =
        serde_json::from_slice(bytes).map_err(|e| TransportError::MalformedJson(e.to_string()))?;
    *tokens = slow.token_ids.0;
    Ok(PromptFields {
        request_id: slow.request_id,
        lora_name: slow.lora_name,
        cache_salt: slow.cache_salt,
        mode: slow.mode,
        worker_id: slow.worker_id,
        overlap_weight: slow.overlap_weight,
        temperature: slow.temperature,
        pool: slow.pool,
        model: slow.model,
    })
}

#[derive(Deserialize)]
struct SlowPrompt {
    token_ids: TokenIds,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    worker_id: Option<u64>,
    #[serde(default)]
    overlap_weight: Option<f64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

/// A `Vec<u32>` filled straight from the JSON sequence, with the capacity hint used.
struct TokenIds(Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids (u32)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenIds, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(t) = seq.next_element::<u32>()? {
                    v.push(t);
                }
                Ok(TokenIds(v))
            }
        }
        d.deserialize_seq(V)
    }
}

// ----- the scanner -----

const ONES: u64 = 0x0101_0101_0101_0101;

#[inline]
fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if !is_ws(c) {
                break;
            }
            self.i += 1;
        }
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        if self.peek() == Some(c) {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    /// A string without escapes or non-ASCII bytes (an object key); its contents.
    fn plain_string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.i;
        loop {
            let c = self.peek()?;
            match c {
                b'"' => break,
                b'\\' | 0..0x20 | 0x80.. => return None,
                _ => self.i += 1,
            }
        }
        let s = self.b.get(start..self.i)?;
        self.i += 1;
        Some(s)
    }

    /// Skips one value (its extent only; the caller validates it with serde).
    fn skip_value(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match self.peek()? {
                b'"' => {
                    self.i += 1;
                    loop {
                        match self.peek()? {
                            b'"' => {
                                self.i += 1;
                                break;
                            }
                            b'\\' => self.i += 2,
                            _ => self.i += 1,
                        }
                    }
                }
                b'{' | b'[' => {
                    depth += 1;
                    self.i += 1;
                }
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    self.i += 1;
                }
                c if is_ws(c) || c == b',' || c == b':' => {
                    if depth == 0 {
                        return None;
                    }
                    self.i += 1;
                }
                _ => {
                    // A scalar: up to the next delimiter.
                    while let Some(c) = self.peek() {
                        if is_ws(c) || matches!(c, b',' | b':' | b'}' | b']' | b'"' | b'{' | b'[') {
                            break;
                        }
                        self.i += 1;
                    }
                }
            }
            if depth == 0 {
                return Some(());
            }
            if self.i > self.b.len() {
                return None;
            }
        }
    }

    /// The next value, decoded by serde.
    fn serde_value<T: DeserializeOwned>(&mut self) -> Option<T> {
        let start = self.i;
        self.skip_value()?;
        serde_json::from_slice(self.b.get(start..self.i)?).ok()
    }

    /// A `[u32, ...]` array into `out`, of at most `cap` ids (past it: `None` with
    /// `too_long` set).
    fn token_array(&mut self, out: &mut Vec<u32>, cap: usize, too_long: &mut bool) -> Option<()> {
        self.eat(b'[')?;
        self.ws();
        if self.eat(b']').is_some() {
            return Some(());
        }
        // Each id takes at least two bytes ("1,"), so this bounds the count.
        out.reserve((self.b.len().saturating_sub(self.i) / 2 + 1).min(cap.saturating_add(1)));
        loop {
            if out.len() >= cap {
                *too_long = true;
                return None;
            }
            out.push(self.uint()?);
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    if !self.peek()?.is_ascii_digit() {
                        self.ws();
                    }
                }
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                c if is_ws(c) => {
                    self.ws();
                    match self.peek()? {
                        b',' => {
                            self.i += 1;
                            self.ws();
                        }
                        b']' => {
                            self.i += 1;
                            return Some(());
                        }
                        _ => return None,
                    }
                }
                _ => return None,
            }
        }
    }

    /// A JSON integer in `0..=u32::MAX` without sign, fraction, exponent or leading zeros.
    #[inline]
    fn uint(&mut self) -> Option<u32> {
        if let Some(chunk) = self.b.get(self.i..).and_then(|s| s.first_chunk::<8>()) {
            let w = u64::from_le_bytes(*chunk);
            // Per byte: non-zero unless it is an ASCII digit (exact up to the first
            // non-digit; the +6 can only carry out of a non-digit byte).
            let hi = 0xF0 * ONES;
            let zeros = 0x30 * ONES;
            let nd = ((w & hi) ^ zeros) | ((w.wrapping_add(0x06 * ONES) & hi) ^ zeros);
            if nd != 0 {
                let n = (nd.trailing_zeros() / 8) as usize;
                if n == 0 || (n > 1 && w & 0xFF == u64::from(b'0')) {
                    return None;
                }
                // Digits to 0..=9, most significant first in the low byte, left-aligned so
                // that the missing leading digits are zeros.
                let mut v = (w ^ zeros) << (64 - 8 * n as u32);
                v = (v.wrapping_mul(10).wrapping_add(v >> 8)) & 0x00FF_00FF_00FF_00FF;
                v = (v.wrapping_mul(100).wrapping_add(v >> 16)) & 0x0000_FFFF_0000_FFFF;
                v = (v.wrapping_mul(10_000).wrapping_add(v >> 32)) & 0xFFFF_FFFF;
                self.i += n;
                return u32::try_from(v).ok();
            }
        }
        self.uint_slow()
    }

    #[cold]
    fn uint_slow(&mut self) -> Option<u32> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            v = v * 10 + u64::from(d);
            self.i += 1;
            if self.i - start > 10 {
                return None;
            }
        }
        let n = self.i - start;
        if n == 0 || (n > 1 && self.b.get(start) == Some(&b'0')) {
            return None;
        }
        u32::try_from(v).ok()
    }
}

/// The scanner: `None` when unsure (the caller then asks serde).
fn fast(
    bytes: &[u8],
    tokens: &mut Vec<u32>,
    cap: usize,
    too_long: &mut bool,
) -> Option<PromptFields> {
    let mut c = Cursor { b: bytes, i: 0 };
    let mut f = PromptFields::default();
    let mut seen = 0u16;
    c.ws();
    c.eat(b'{')?;
    c.ws();
    loop {
        let key = c.plain_string()?;
        c.ws();
        c.eat(b':')?;
        c.ws();
        let bit = match key {
            b"token_ids" => {
                c.token_array(tokens, cap, too_long)?;
                1
            }
            b"request_id" => {
                f.request_id = c.serde_value()?;
                2
            }
            b"lora_name" => {
                f.lora_name = c.serde_value()?;
                4
            }
            b"mode" => {
                f.mode = c.serde_value()?;
                8
            }
            b"worker_id" => {
                f.worker_id = c.serde_value()?;
                16
            }
            b"overlap_weight" => {
                f.overlap_weight = c.serde_value()?;
                32
            }
            b"temperature" => {
                f.temperature = c.serde_value()?;
                64
            }
            b"pool" => {
                f.pool = c.serde_value()?;
                128
            }
            b"model" => {
                f.model = c.serde_value()?;
                256
            }
            b"cache_salt" => {
                f.cache_salt = c.serde_value()?;
                512
            }
            _ => {
                let _: IgnoredAny = c.serde_value()?;
                0
            }
        };
        if seen & bit != 0 {
            // A duplicate field: serde's error.
            return None;
        }
        seen |= bit;
        c.ws();
        match c.peek()? {
            b',' => {
                c.i += 1;
                c.ws();
            }
            b'}' => {
                c.i += 1;
                break;
            }
            _ => return None,
        }
    }
    c.ws();
    (c.i == bytes.len() && seen & 1 == 1).then_some(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prompts_past_the_cap_are_refused_by_the_scanner_and_by_serde() {
        let mut t = Vec::new();
        let ok = br#"{"token_ids": [1, 2, 3]}"#;
        assert!(parse_prompt_capped(ok, &mut t, 3).is_ok());
        assert_eq!(t, [1, 2, 3]);
        let err = parse_prompt_capped(ok, &mut t, 2).unwrap_err();
        assert!(
            matches!(err, TransportError::PromptTooLong { limit: 2 }),
            "{err}"
        );
        assert!(t.is_empty());
        // An escaped key sends the body to serde: same answer.
        let slow = br#"{"token\u005fids": [1, 2, 3]}"#;
        assert!(fast(slow, &mut t, 2, &mut false).is_none());
        assert!(parse_prompt_capped(slow, &mut t, 3).is_ok());
        let err = parse_prompt_capped(slow, &mut t, 2).unwrap_err();
        assert!(
            matches!(err, TransportError::PromptTooLong { limit: 2 }),
            "{err}"
        );
        // The scanner reserves for the cap, not for the body.
        let big = format!(r#"{{"token_ids": [{}]}}"#, vec!["7"; 100_000].join(","));
        let mut t = Vec::new();
        assert!(parse_prompt_capped(big.as_bytes(), &mut t, 10).is_err());
        assert!(t.capacity() < 1000, "{}", t.capacity());
    }

    type Parsed = Option<(PromptFields, Vec<u32>)>;

    fn both(body: &str) -> (Parsed, Parsed) {
        let mut a = Vec::new();
        let fast = parse_prompt(body.as_bytes(), &mut a).ok().map(|f| (f, a));
        let mut b = Vec::new();
        let slow = parse_prompt_serde(body.as_bytes(), &mut b)
            .ok()
            .map(|f| (f, b));
        (fast, slow)
    }

    #[test]
    fn scanner_reads_the_usual_shapes() {
        let mut t = Vec::new();
        let f = parse_prompt(
            br#"{"token_ids": [0, 1, 22, 333, 4444, 55555, 666666, 7777777, 88888888, 999999999, 4294967295], "request_id": "r1", "mode": "kv", "worker_id": null, "overlap_weight": 1.5, "x": {"y": [1, "]"]}}"#,
            &mut t,
        )
        .unwrap();
        assert_eq!(
            t,
            vec![
                0, 1, 22, 333, 4444, 55555, 666666, 7777777, 88888888, 999999999, 4294967295
            ]
        );
        assert_eq!(f.request_id.as_deref(), Some("r1"));
        assert_eq!(f.mode.as_deref(), Some("kv"));
        assert_eq!(f.worker_id, None);
        assert_eq!(f.overlap_weight, Some(1.5));
        let mut t = Vec::new();
        let f = parse_prompt(br#"{"token_ids": [1], "cache_salt": "tenant-a"}"#, &mut t).unwrap();
        assert_eq!(f.cache_salt.as_deref(), Some("tenant-a"));
        assert!(
            fast(
                br#"{"token_ids": [1], "cache_salt": "tenant-a"}"#,
                &mut t,
                usize::MAX,
                &mut false
            )
            .is_some()
        );
        let mut t = Vec::new();
        assert!(fast(br#"{"token_ids":[1,2,3]}"#, &mut t, usize::MAX, &mut false).is_some());
        assert_eq!(t, vec![1, 2, 3]);
        let mut t = Vec::new();
        assert!(
            fast(
                b"{\"token_ids\" :\n[ 1 ,\t2 ] }\n",
                &mut t,
                usize::MAX,
                &mut false
            )
            .is_some()
        );
        assert_eq!(t, vec![1, 2]);
    }

    #[test]
    fn edge_cases_agree_with_serde() {
        for body in [
            r#"{"token_ids": []}"#,
            r#"{"token_ids": [4294967296]}"#,
            r#"{"token_ids": [01]}"#,
            r#"{"token_ids": [-0]}"#,
            r#"{"token_ids": [-1]}"#,
            r#"{"token_ids": [1e3]}"#,
            r#"{"token_ids": [1.0]}"#,
            r#"{"token_ids": [1,]}"#,
            r#"{"token_ids": [,1]}"#,
            r#"{"token_ids": [1 2]}"#,
            r#"{"token_ids": [1], "token_ids": [2]}"#,
            r#"{"token_ids": [1], "request_id": 5}"#,
            r#"{"token_ids": [1], "request_id": "a\"b"}"#,
            r#"{"token_ids": [1], "x": [}"#,
            r#"{"token_ids": [1], "x": 01}"#,
            r#"{"token\u005fids": [7]}"#,
            r#"{"token_ids": [1]} x"#,
            r#"{"token_ids": [1]"#,
            r#"{"token_ids": null}"#,
            r#"{"request_id": "a"}"#,
            r#"{}"#,
            r#"[]"#,
            r#""#,
            r#"{"token_ids": [12345678901]}"#,
            r#"{"token_ids": [99999999]}"#,
            r#"{"token_ids": [1], "temperature": "hot"}"#,
            r#"{"token_ids": [1], "worker_id": -3}"#,
            r#"{"token_ids": [1], "lora_name": "é"}"#,
            r#"{"token_ids": [1], "cache_salt": "s\u00e9"}"#,
            r#"{"token_ids": [1], "cache_salt": 7}"#,
            r#"{"token_ids": [1], "cache_salt": null}"#,
            r#"{"token_ids": [1], "cache_salt": "a", "cache_salt": "b"}"#,
            r#"{"ключ": 1, "token_ids": [1]}"#,
        ] {
            let (a, b) = both(body);
            assert_eq!(a, b, "{body}");
        }
    }

    proptest! {
        #[test]
        fn scanner_equals_serde_on_arrays(ids in proptest::collection::vec(any::<u32>(), 0..64), sep in prop_oneof![Just(","), Just(", "), Just(" ,\n")]) {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            let body = format!("{{\"token_ids\": [{}], \"request_id\": \"r\"}}", list.join(sep));
            let mut t = Vec::new();
            prop_assert!(fast(body.as_bytes(), &mut t, usize::MAX, &mut false).is_some());
            prop_assert_eq!(&t, &ids);
            let (a, b) = both(&body);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn scanner_equals_serde_on_mutations(ids in proptest::collection::vec(0u32..200_000, 1..16), pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            let mut body = format!("{{\"token_ids\": [{}], \"mode\": \"kv\", \"temperature\": 0.5}}", list.join(",")).into_bytes();
            let i = pos.index(body.len());
            body[i] = byte;
            let mut a = Vec::new();
            let fast = parse_prompt(&body, &mut a).ok().map(|f| (f, a));
            let mut b = Vec::new();
            let slow = parse_prompt_serde(&body, &mut b).ok().map(|f| (f, b));
            prop_assert_eq!(fast, slow);
        }
    }
}
