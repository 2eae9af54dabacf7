//! Fuzzes the JSON KV-event decoder (`POST /v1/events`, `kvengine publish`) and the
//! conversion to engine events: neither may panic on any input.
//! Run: `cd fuzz && cargo +nightly fuzz run json_events`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::json_events::{parse_events_body, to_engine};

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = parse_events_body(data) {
        for event in &body.events {
            for block_size in [1, 4, 16] {
                let _ = to_engine(event, block_size);
            }
        }
    }
});
