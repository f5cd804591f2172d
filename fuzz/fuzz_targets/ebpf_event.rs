//! libFuzzer target: guard_tools::fuzz::ebpf_event.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| guard_tools::fuzz::ebpf_event(data));
