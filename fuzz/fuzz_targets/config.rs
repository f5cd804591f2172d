//! libFuzzer target: guard_tools::fuzz::config.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard_tools::fuzz::config(data));
