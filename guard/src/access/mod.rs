//! The access log: one JSON line per request, queued or passed through, written when it
//! concludes, off the request path (docs/design.md §7a).

pub mod clock;
mod line;
mod record;
mod writer;

pub use line::who;
pub use record::{Identity, Record, RequestId, RequestIdError, Text, Tokens, Word};
pub use writer::{AccessLog, LaterLine, OpenError};

/// The header that tells the client its request's id (its access log line's `id`).
const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-guard-request-id");

/// Adds `X-Guard-Request-Id: id` to an answer.
pub fn tag<B>(response: &mut http::Response<B>, id: RequestId) {
    if let Ok(id) = http::HeaderValue::from_bytes(id.as_bytes()) {
        response.headers_mut().insert(REQUEST_ID_HEADER, id);
    }
}

/// Milliseconds as the log writes them: nanoseconds over a million, so `0.418554` reads back
/// as written (not `0.41855400000000004`). The nanoseconds as a u64 (584 years), whose
/// conversion takes a few instructions where a u128's is a library call.
pub fn millis(elapsed: std::time::Duration) -> f64 {
    u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX) as f64 / 1e6
}

/// A request's id: 16 hex digits, unique in this process and unlikely across restarts. Each
/// thread takes numbers in blocks: the shared counter is touched once a block, not bounced
/// between serving threads once a request.
pub fn request_id() -> RequestId {
    use std::{
        cell::Cell,
        sync::atomic::{AtomicU64, Ordering},
    };
    const BLOCK: u64 = 1 << 10;
    static NEXT_BLOCK: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // The start's microseconds in the high bits: ids of different runs differ.
        (now.as_micros() as u64) << 24
    });
    thread_local! {
        /// This thread's next number and the end of its block.
        static TAKEN: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }
    let n = TAKEN.with(|taken| {
        let (mut next, mut end) = taken.get();
        if next == end {
            next = NEXT_BLOCK.fetch_add(BLOCK, Ordering::Relaxed);
            end = next + BLOCK;
        }
        taken.set((next + 1, end));
        next
    });
    RequestId::from(START.wrapping_add(n))
}
