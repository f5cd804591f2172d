//! libFuzzer target: guard_tools::fuzz::request_head.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard_tools::fuzz::request_head(data));
