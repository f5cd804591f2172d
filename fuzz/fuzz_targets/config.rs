//! libFuzzer target: guard::fuzz::config.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard::fuzz::config(data));
