//! Fuzzes the native protocol's frame validation and the conversion of an archived batch to
//! engine events: neither may panic on any input. Run:
//! `cd fuzz && cargo +nightly fuzz run native_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::native::frame::{FrameBuf, access_client_frame, batch_events, decode_client_frame};
use transport::native::schema::ArchivedClientFrame;

fuzz_target!(|data: &[u8]| {
    // The owned decode (copies into an aligned buffer inside).
    let _ = decode_client_frame(data);
    // The server's in-place path: validate, then convert with a few block sizes.
    let mut buf = FrameBuf::with_capacity(data.len());
    buf.extend_from_slice(data);
    if let Ok(ArchivedClientFrame::Batch(batch)) = access_client_frame(&buf) {
        for block_size in [0, 1, 16] {
            let mut out = Vec::new();
            batch_events(batch, block_size, &mut out, |_| {});
        }
    }
});
