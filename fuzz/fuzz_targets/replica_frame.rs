//! Fuzzes the decoders of what router replicas send each other on NATS (load frames and
//! resync requests): neither may panic on any input.
//! Run: `cd fuzz && cargo +nightly fuzz run replica_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::replicas::wire::{decode_frame, decode_resync};

fuzz_target!(|data: &[u8]| {
    let _ = decode_frame(data);
    let _ = decode_resync(data);
});
