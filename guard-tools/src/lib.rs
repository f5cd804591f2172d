//! guard's tools beside the daemon: the benchmark logbook (`guard bench`, `guard logbook`),
//! `guard doctor`, what `guard check-config` asks of the host, `guard status`'s tables,
//! `guard usage`'s ledger, `guard exec`, and the entry points the fuzzers drive. The daemon (the `guard` crate) never depends on them.

#![forbid(unsafe_code)]

pub mod doctor;
pub mod exec;
pub mod fuzz;
pub mod host;
pub mod logbook;
pub mod status;
pub mod usage;
