//! Fuzzes the decoders of what router replicas send each other on NATS (load frames,
//! resync requests and session frames): none may panic on any input.
//! Run: `cd fuzz && cargo +nightly fuzz run replica_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::replicas::wire::{decode_frame, decode_resync, decode_sessions};

fuzz_target!(|data: &[u8]| {
    let _ = decode_frame(data);
    let _ = decode_resync(data);
    let _ = decode_sessions(data);
});
