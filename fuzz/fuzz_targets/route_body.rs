//! Fuzzes the `/v1/route` and `/v1/overlap` body decoder: the hand-written scanner must
//! agree with the plain serde decoder on every input (its invariant 1), and neither may
//! panic. Run: `cd fuzz && cargo +nightly fuzz run route_body`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::http::route_body::{parse_prompt, parse_prompt_serde};

fuzz_target!(|data: &[u8]| {
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    let a = parse_prompt(data, &mut fast);
    let b = parse_prompt_serde(data, &mut slow);
    match (a, b) {
        (Ok(a), Ok(b)) => assert!(a == b && fast == slow, "the scanner and serde disagree"),
        (Err(_), Err(_)) => {}
        _ => panic!("the scanner and serde disagree on acceptance"),
    }
});
