//! Noticing departed clients: the kernel's socket state changes (eBPF), and who connected.

pub mod ebpf;
pub mod event;
mod mounts;
pub mod peer;
pub mod reaper;
pub mod registry;
pub mod userspace;

pub use ebpf::{ConnOwner, EbpfError, EbpfTracker, Loaded};
pub use event::{ConnEvent, TcpState};
/// The tracepoint record's layout the loader hands the program.
pub use guard_common::Layout;
