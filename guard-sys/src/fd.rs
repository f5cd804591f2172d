//! File descriptors guard hands to tokio's reactor.

use std::os::fd::AsFd;

use tokio::io::unix::AsyncFd;

/// Registers an owner of a descriptor with tokio's reactor. `AsFd` ties the descriptor to
/// `inner`: it stays open, and the same, for as long as `inner` lives (I/O safety).
pub fn register<T: AsFd + std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    // SAFETY: `inner` owns its descriptor (AsFd: it is open, and the same one, until `inner`
    // is dropped), and AsyncFd owns `inner` from here on; as_raw_fd() returns that
    // descriptor.
    unsafe { AsyncFd::register(inner) }.map_err(std::io::Error::from)
}
