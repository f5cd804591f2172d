//! libFuzzer target: guard_tools::fuzz::model_field.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard_tools::fuzz::model_field(data));
