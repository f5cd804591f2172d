//! The C allocator's settings: how freed memory goes back to the system.

/// Gives each allocation of `bytes` or more pages of its own (mmap), returned to the system
/// when freed; false if the allocator refused.
pub fn mmap_from(bytes: libc::c_int) -> bool {
    // SAFETY: mallopt only sets an allocator parameter, it touches no memory of the caller's.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) != 0 }
}

/// Returns the free pages inside the allocator's heaps to the system.
pub fn trim() {
    // SAFETY: malloc_trim only releases memory the allocator holds free; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
