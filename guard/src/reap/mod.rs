//! Noticing departed clients: the kernel's socket state changes (eBPF), and who connected.

pub mod ebpf;
pub mod event;
mod mounts;

pub use ebpf::{ConnOwner, EbpfError, EbpfTracker};
pub use event::{ConnEvent, TcpState};
