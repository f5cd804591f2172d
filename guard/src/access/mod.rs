//! The access log: one JSON line per request, queued or passed through, written when it
//! concludes, off the request path (docs/design.md §7a).

mod record;
mod writer;

pub use record::{Identity, Record, RequestId, RequestIdError, Tokens, Word};
pub use writer::{AccessLog, OpenError};

/// The header that tells the client its request's id (its access log line's `id`).
const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-guard-request-id");

/// Adds `X-Guard-Request-Id: id` to an answer.
pub fn tag<B>(response: &mut http::Response<B>, id: RequestId) {
    if let Ok(id) = http::HeaderValue::from_bytes(&id.digits()) {
        response.headers_mut().insert(REQUEST_ID_HEADER, id);
    }
}

/// Milliseconds as the log writes them: nanoseconds over a million, so `0.418554` reads back
/// as written (not `0.41855400000000004`).
pub fn millis(elapsed: std::time::Duration) -> f64 {
    elapsed.as_nanos() as f64 / 1e6
}

/// A request's id: 16 hex digits, unique in this process and unlikely across restarts.
pub fn request_id() -> RequestId {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // The start's microseconds in the high bits: ids of different runs differ.
        (now.as_micros() as u64) << 24
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    RequestId(START.wrapping_add(n))
}
