//! Fuzzes the vLLM / SGLang msgpack KV-event decoder (`wire`) and the router's conversion to
//! engine events (`transport`): neither may panic on any input. Run:
//! `cd fuzz && cargo +nightly fuzz run msgpack_batch`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::kv_events::ConvertConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = wire::kv_events::decode_batch(data) {
        let _ = transport::kv_events::convert(b, &ConvertConfig { block_size: 16 });
    }
});
