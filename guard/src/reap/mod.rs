//! Noticing departed clients: the kernel's socket state changes (eBPF), and who connected.

pub mod ebpf;
pub mod event;
mod mounts;
pub mod owner;
pub mod reaper;
pub mod registry;
pub mod userspace;

pub use ebpf::{ConnOwner, EbpfError, EbpfTracker};
pub use event::{ConnEvent, TcpState};
