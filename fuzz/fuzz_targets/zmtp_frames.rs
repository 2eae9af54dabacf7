//! Fuzzes kvengine's ZMTP decoder (the bytes any ZMQ peer sends kvengine's subscriber or
//! publisher): no input may panic it, make it ask for more than its bound, or decode
//! differently when it arrives in pieces. Run: `cd fuzz && cargo +nightly fuzz run zmtp_frames`.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use transport::zmq::zmtp::codec::{Decoder, GREETING_LEN, MAX_COMMAND_BYTES};

/// Everything decoded from `input` fed `chunk` bytes at a time, and whether it ended in an
/// error.
fn decode(input: &[u8], max: usize, chunk: usize) -> (Vec<transport::zmq::zmtp::Decoded>, bool) {
    let bound = max.max(MAX_COMMAND_BYTES).max(GREETING_LEN) + 9;
    let mut d = Decoder::new(max);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for piece in input.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        loop {
            match d.decode(&mut buf) {
                Ok(Some(unit)) => out.push(unit),
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
        assert!(d.needed(&buf) <= bound, "the decoder asked past its bound");
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, input)) = data.split_first() else {
        return;
    };
    // A bound from 0 to 3,810 bytes, and a split from 1 to 8 bytes.
    let max = usize::from(knobs >> 3) * 123;
    let chunk = usize::from(knobs & 7) + 1;
    let whole = decode(input, max, input.len());
    assert_eq!(whole, decode(input, max, chunk), "decoding depends on the split");
});
