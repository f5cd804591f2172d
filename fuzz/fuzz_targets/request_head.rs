//! libFuzzer target: guard::fuzz::request_head.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard::fuzz::request_head(data));
