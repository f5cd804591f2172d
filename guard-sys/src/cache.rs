//! Hints to the CPU's caches.

/// The size of a cache line on the machines guard runs on.
const LINE: usize = 64;

/// Asks the CPU to bring into its cache the lines of the room `spare` (a vector's unused
/// capacity, about to be written) begins with, up to `bytes` of it. The fetch goes on while
/// the thread works: the stores that come later find their lines here, not in another CPU's
/// cache, and a lock released after them does not wait for those lines to come.
pub fn prefetch(spare: &[std::mem::MaybeUninit<u8>], bytes: usize) {
    let room = &spare[..spare.len().min(bytes)];
    #[cfg(target_arch = "x86_64")]
    for line in room.chunks(LINE) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch neither reads nor writes memory, and never faults; SSE, whose
        // instruction it is, is part of every x86-64 CPU. The address lies in `room`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = room;
}
