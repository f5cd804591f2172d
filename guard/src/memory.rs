//! Memory that request bodies used goes back to the system when they end. Bodies are large and
//! come and go; glibc's allocator keeps what it frees for reuse unless told otherwise, so
//! 40 large bodies could leave hundreds of MB resident long after they ended.

/// Each allocation of 128 KiB or more (a body) gets pages of its own (mmap), returned to the
/// system when freed. glibc would otherwise raise that threshold after the first large free
/// and serve the next bodies from its heap.
pub fn return_large_blocks_to_the_system() {
    if !guard_sys::alloc::mmap_from(128 << 10) {
        tracing::warn!(
            "could not set the allocator's mmap threshold; freed bodies may stay resident"
        );
    }
}

/// Returns the free pages inside the allocator's heaps (what many smaller buffers, freed at
/// different times, leave behind); the watchers call it once a tick.
pub fn trim() {
    guard_sys::alloc::trim();
}
