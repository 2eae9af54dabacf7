//! Fuzzes the OpenAI front door's request decoder (`/v1/chat/completions`,
//! `/v1/completions`): reading the model and prompt, then tokenizing it with the built-in
//! stand-in, may fail but never panic. Run: `cd fuzz && cargo +nightly fuzz run openai_body`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::openai::request_prompt::{PromptSource, parse_request};

fuzz_target!(|data: &[u8]| {
    for source in [PromptSource::Chat, PromptSource::Completion] {
        if let Ok(prompt) = parse_request(data, source) {
            let _ = prompt.token_ids(None);
        }
    }
});
