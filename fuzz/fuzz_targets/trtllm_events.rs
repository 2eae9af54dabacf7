//! Fuzzes TensorRT-LLM's `/kv_cache_events` page decoder (`wire`) and the router's per-rank
//! conversion to engine events (`transport`): neither may panic on any input.
//! Run: `cd fuzz && cargo +nightly fuzz run trtllm_events`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use transport::trtllm::RankConverter;
use wire::trtllm::{PageEntry, decode_page};

fuzz_target!(|data: &[u8]| {
    let Ok(page) = decode_page(data) else {
        return;
    };
    for block_size in [32, 16] {
        let mut ranks: BTreeMap<u32, RankConverter> = BTreeMap::new();
        let mut out = Vec::new();
        for entry in &page {
            if let PageEntry::Event { event, .. } = entry {
                let rank = ranks
                    .entry(event.attention_dp_rank.unwrap_or(0))
                    .or_default();
                let _ = rank.convert(event.data.clone(), block_size, &mut out);
            }
        }
    }
});
