//! Empty on purpose: this library target lets `guard` name guard-ebpf as a build-dependency,
//! so cargo rebuilds guard when the eBPF programs change. The programs are in `main.rs`.
#![no_std]
